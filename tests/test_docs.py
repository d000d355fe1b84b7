"""The README's headline numbers are read from the result files they link to, and the docs
refer to nothing outside the repository. (``make test`` builds the site with ``mkdocs build
--strict`` before the suite, which fails on a broken link or a missing page.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: the default ``am`` as its runs name it
AM = "am:queries=repeat-prefill+surprise-number-quote/auto*4+surprise-name-quote/auto"
ESSAY = "am-omp-fast:queries=repeat-prefill+surprise-quote*4,min_layer_share=0.3"
RATIOS = ("0.1", "0.05", "0.02")


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def needles(method: str, name: str = "niah_ruler_12.json") -> str:
    summary = load(name)["summary"]["niah-ruler"][method]
    return ", ".join(summary[r]["score"] for r in RATIOS)


def gpu(method: str) -> dict:
    return load("gpu_check.json")["sections"]["compaction"][method]


def serving() -> dict:
    return load("serving.json")


def kept_answers(result: dict) -> tuple[int, int]:
    """Of the full history's right answers in a conversation result (one method at one ratio),
    how many the compacted prefix keeps, and how many there are."""
    full = {
        (b["task"], b["seed"])
        for b in result["baselines"]
        if b["method"] == "full-context" and b["score"] == 1
    }
    right = [r for r in result["rows"] if (r["task"], r["seed"]) in full]
    return sum(r["score"] == 1 for r in right), len(right)


def conversations() -> str:
    """The default's kept answers on the four conversation families at 10%, and the range of
    the per-family retention."""
    result = load("conversations_names_10pct_48.json")
    kept, total = kept_answers(result)
    shares = [family[AM]["0.1"]["retention"] for family in result["summary"].values()]
    return (
        f"**{kept}/{total} = {kept / total:.0%}** of the full history's right "
        f"answers | {min(shares):.0%}-{max(shares):.0%}".replace("%-", "-")
    )


def conversations_5pct() -> str:
    kept, total = kept_answers(load("conversations_names_5pct_24.json"))
    return f"at 5%, {kept}/{total} = {kept / total:.0%}"


def conversations_2pct() -> str:
    kept, total = kept_answers(load("conversations_default_2pct_48.json"))
    return f"at 2%, {kept}/{total} = {kept / total:.0%}"


def conversations_by_margin() -> str:
    """The default's kept answers through vLLM at 10%, among the full history's confident
    answers and among its near-ties (``retention_by_margin``, summed over the families)."""
    result = load("conversations_default_vllm_48.json")
    sums = {}
    for key in ("margin>=0.5", "margin<0.5"):
        cells = [
            family["am"]["0.1"]["retention_by_margin"][key].split("/")
            for family in result["summary"].values()
        ]
        sums[key] = [sum(int(cell[i]) for cell in cells) for i in (0, 1)]
    (kept, total), near = sums["margin>=0.5"], sums["margin<0.5"]
    return (
        f"by half a nat or more, {kept}/{total} = {kept / total:.0%} "
        f"(its near-ties {near[0]}/{near[1]}"
    )


def conversations_before() -> str:
    """The same at 10% and 5% from the default's earlier forms: before the name probes joined
    it, and before the number probes did."""

    def shares(at_10: str, at_5: str) -> str:
        kept = [kept_answers(load(name)) for name in (at_10, at_5)]
        return " and ".join(f"{k / t:.0%}" for k, t in kept)

    return (
        "without the name probes "
        + shares("conversations_numbers_48.json", "conversations_numbers_5pct_24.json")
        + ", without the number probes too "
        + shares("conversations_default_48.json", "conversations_default_5pct_24.json")
    )


#: (text the README must contain, how it is computed from the result file)
HEADLINES = [
    (conversations, "conversation facts at 10%"),
    (conversations_5pct, "conversation facts at 5%"),
    (conversations_2pct, "conversation facts at 2%"),
    (conversations_by_margin, "conversation facts by the full context's margin"),
    (conversations_before, "conversation facts with the earlier forms of the default"),
    (
        lambda: f"**{needles(AM, 'niah_ruler_names_12.json')}**",
        "AM's needles at 10/5/2%",
    ),
    (
        lambda: (
            f"full context {load('niah_ruler_12.json')['summary']['niah-ruler']['full-context']}"
        ),
        "full context",
    ),
    (lambda: f"KVzip {needles('kvzip')}", "KVzip's needles"),
    (
        lambda: (
            f"**{load('essay_questions_12.json')['summary']['essay-questions'][ESSAY]['0.1']['log_ppl_ratio']:.3f}**"
        ),
        "essay log-ppl ratio",
    ),
    (
        lambda: (
            f"**{load('compaction_speed.json')['main']['am-omp-fast']['ours']['per_head_s']:.3f} s**"
        ),
        "CPU speed",
    ),
    (
        lambda: (
            f"{load('compaction_speed.json')['main']['am-omp-fast']['baseline']['per_head_s']:.2f} s: "
            f"**{load('compaction_speed.json')['main']['am-omp-fast']['speedup']:.1f}x**"
        ),
        "CPU baseline",
    ),
    (
        lambda: (
            f"(`am-highest-attn`: {load('compaction_speed.json')['main']['am-highest-attn']['speedup']:.1f}x)"
        ),
        "CPU HAK speed-up",
    ),
    (lambda: f"**{gpu('am-omp-fast')['total_s']:.1f} s**", "GPU OMP total"),
    (
        lambda: (
            f"{64 * gpu('am-omp-fast')['paper_algorithm']['per_head_s']:.0f} s "
            f"(64 x {gpu('am-omp-fast')['paper_algorithm']['per_head_s']:.2f} s): "
            f"**{64 * gpu('am-omp-fast')['paper_algorithm']['per_head_s'] / gpu('am-omp-fast')['total_s']:.1f}x**"
        ),
        "GPU baseline",
    ),
    (
        lambda: f"**{serving()['variants']['1.0']['ttft_s']['compacted_cold']:.2f} s**",
        "follow-up TTFT",
    ),
    (
        lambda: (
            f"{serving()['full']['ttft_s']:.1f} s: **{serving()['variants']['1.0']['ttft_speedup_cold']:.0f}x**"
        ),
        "re-prefill TTFT",
    ),
    (
        lambda: (
            f"**{serving()['capacity']['kinds']['varlen cap 1.0']['max_concurrent_sessions']}**"
        ),
        "sessions",
    ),
    (
        lambda: (
            f"{serving()['capacity']['kinds']['uncompacted']['max_concurrent_sessions']} uncompacted: "
            f"**{serving()['capacity']['kinds']['varlen cap 1.0']['sessions_vs_uncompacted']:.1f}x**"
        ),
        "sessions vs uncompacted",
    ),
    (
        lambda: (
            f"{gpu('am-highest-attn')['total_s']:.1f} s against its "
            f"{64 * gpu('am-highest-attn')['paper_algorithm']['per_head_s']:.1f} s"
        ),
        "GPU HAK caveat",
    ),
]


@pytest.mark.parametrize(
    "expected,what", HEADLINES, ids=[what for _, what in HEADLINES]
)
def test_readme_headline_numbers_come_from_the_results(expected, what):
    readme = (ROOT / "README.md").read_text()
    text = expected()
    assert text in readme, (
        f"the README's {what} should read {text!r} (from benchmarks/results)"
    )


def test_readme_is_short_and_the_docs_point_inside_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 210
    # the way to enable the plugin in an existing deployment is on the first screen
    assert "--kv-transfer-config" in "\n".join(readme.splitlines()[:40])
    pages = [
        ROOT / "README.md",
        ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
    ]
    for page in pages:
        text = page.read_text()
        assert not re.search(
            r"\bissue \d|measured-findings|\.\./shared/", text, re.I
        ), page
