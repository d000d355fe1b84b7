"""``benchmarks.fidelity``: methods compared answer by answer, by KL and by margin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fidelity
from benchmarks.paired import sign_test
from benchmarks.quality import CONFIDENT_MARGIN

RESULTS = Path(fidelity.__file__).parent / "results"

# per (task, seed): the full context's score and margin, then per (method, ratio) the row's
# score, KL and margin
FULL = {
    ("facts", 0): (1.0, 2.0),
    ("facts", 1): (1.0, 0.1),  # a near-tie
    ("facts", 2): (0.0, None),  # wrong with the full context: never paired
    ("keys", 0): (1.0, 1.5),
    ("keys", 1): (1.0, 0.3),
}
ROWS = {
    ("am", 0.1): {
        ("facts", 0): (1.0, 0.02, 1.2),
        ("facts", 1): (0.0, 0.03, -0.2),
        ("facts", 2): (0.0, 0.05, None),
        ("keys", 0): (1.0, 0.01, 0.9),
        ("keys", 1): (1.0, 0.02, 0.1),
    },
    ("am", 0.05): {
        ("facts", 0): (1.0, 0.04, 0.7),
        ("facts", 1): (1.0, 0.05, 0.2),
        ("facts", 2): (0.0, 0.09, None),
        ("keys", 0): (0.0, 0.03, -0.4),
        ("keys", 1): (1.0, 0.04, 0.05),
    },
    ("kvzip", 0.1): {
        ("facts", 0): (1.0, 0.01, 1.5),
        ("facts", 1): (0.0, 0.02, -0.1),
        ("facts", 2): (1.0, 0.04, None),
        ("keys", 0): (1.0, 0.02, 1.0),
        ("keys", 1): (1.0, 0.01, 0.4),
    },
}


def _result(methods: list[tuple[str, float]], margins: bool = True) -> dict:
    """A ``benchmarks.quality`` result holding ``methods`` of ``ROWS``."""
    return {
        "model": "smollm2-135m",
        "tokens": 600,
        "instances": 3,
        "seed": 0,
        "tasks": ["facts", "keys"],
        "ratios": sorted({r for _, r in methods}, reverse=True),
        "methods": sorted({m for m, _ in methods}),
        "baselines": [
            {
                "task": t,
                "seed": s,
                "method": "full-context",
                "prompt": f"{t}{s}",
                "score": score,
                **({"margin": margin} if margins and margin is not None else {}),
            }
            for (t, s), (score, margin) in FULL.items()
        ],
        "rows": [
            {
                "task": t,
                "seed": s,
                "method": m,
                "ratio": r,
                "prompt": f"{t}{s}",
                "score": score,
                "kl": kl,
                # what quality.combine summarizes besides
                "compaction_s": 1.0,
                "log_ppl_full": 0.5,
                "log_ppl_compacted": 0.5 + kl,
                **({"margin": margin} if margins and margin is not None else {}),
            }
            for m, r in methods
            for (t, s), (score, kl, margin) in ROWS[(m, r)].items()
        ],
    }


def _write(tmp_path: Path, name: str, result: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return str(path)


def test_each_method_pairs_with_the_reference_on_the_full_contexts_right_answers(
    tmp_path,
):
    """Halving the budget (am@0.05 against am@0.1): KL higher on all four right answers, the
    margins down on three, up on one; one answer back and one lost. The wrong instance
    (facts 2) is in no pair, the near-ties (margins 0.1 and 0.3) are split off."""
    path = _write(tmp_path, "run.json", _result([("am", 0.1), ("am", 0.05)]))
    out = fidelity.main(
        [path, "--reference", "am@0.1", "--out", str(tmp_path / "f.json")]
    )
    assert list(out["comparisons"]) == ["am@0.05"]
    c = out["comparisons"]["am@0.05"]
    assert c["reference"] == "am@0.1"
    every = c["all"]
    assert (every["answers"], every["reference_kept"], every["kept"]) == (4, 3, 3)
    assert (every["given_back"], every["lost"]) == (1, 1)
    assert (every["kl_lower"], every["kl_higher"]) == (0, 4)
    assert every["kl_p"] == pytest.approx(sign_test(0, 4)) == pytest.approx(0.125)
    # KL factors 2, 5/3, 3, 2
    assert every["kl_ratio_median"] == pytest.approx(2.0)
    # at 5% keys 0 (KL 0.03) is lost, the others (0.04, 0.05, 0.04) kept; at 10% facts 1
    # (0.03) is lost, the others (0.02, 0.01, 0.02) kept
    assert every["lost_kl_above_kept"] == pytest.approx(0.0)
    assert every["reference_lost_kl_above_kept"] == pytest.approx(1.0)
    assert fidelity.above([1.0, 2.0], [1.0, 0.0]) == pytest.approx(0.875)
    assert fidelity.above([], [1.0]) is None
    # margins: facts 0 1.2 -> 0.7, facts 1 -0.2 -> 0.2, keys 0 0.9 -> -0.4, keys 1 0.1 -> 0.05
    assert (every["margin_higher"], every["margin_lower"]) == (1, 3)
    assert every["margin_difference_median"] == pytest.approx((-0.5 - 0.05) / 2)
    assert every["margin_difference_mean"] == pytest.approx(
        (-0.5 + 0.4 - 1.3 - 0.05) / 4
    )
    confident = c[f"margin>={CONFIDENT_MARGIN:g}"]
    near = c[f"margin<{CONFIDENT_MARGIN:g}"]
    assert (confident["answers"], near["answers"]) == (2, 2)
    assert (confident["lost"], near["given_back"]) == (1, 1)
    assert set(c["by_task"]) == {"facts", "keys"}
    assert c["by_task"]["facts"]["answers"] == 2
    pairs = out["pairs"]["am@0.05"]
    assert {(p["task"], p["seed"]) for p in pairs} == {
        ("facts", 0), ("facts", 1), ("keys", 0), ("keys", 1)
    }  # fmt: skip
    assert (tmp_path / "f.png").exists()


def test_a_reference_without_a_ratio_pairs_each_ratio_with_its_own(tmp_path):
    """``--reference am``: kvzip@0.1 pairs with am@0.1 and nothing pairs with am@0.05 (the
    reference's own other ratio is not compared); results without margins compare by KL."""
    path = _write(
        tmp_path,
        "run.json",
        _result([("am", 0.1), ("am", 0.05), ("kvzip", 0.1)], margins=False),
    )
    out = fidelity.main([path, "--reference", "am", "--out", str(tmp_path / "f.json")])
    assert list(out["comparisons"]) == ["kvzip@0.1"]
    every = out["comparisons"]["kvzip@0.1"]["all"]
    assert (every["kl_lower"], every["kl_higher"]) == (3, 1)
    assert "margins" not in every
    assert all(p["margin"] is None for p in out["pairs"]["kvzip@0.1"])
    # an explicit reference pairs every other cell with it, across ratios
    both = fidelity.main(
        [path, "--reference", "am@0.1", "--out", str(tmp_path / "g.json")]
    )
    assert sorted(both["comparisons"]) == ["am@0.05", "kvzip@0.1"]


def test_runs_of_other_methods_on_the_same_instances_join(tmp_path):
    """Two runs (the reference in one, the other method in another) join through
    ``quality.combine``; a run of other instances is refused."""
    first = _write(tmp_path, "a.json", _result([("am", 0.1)]))
    second = _write(tmp_path, "b.json", _result([("kvzip", 0.1)]))
    out = fidelity.main(
        [first, second, "--reference", "am@0.1", "--out", str(tmp_path / "f.json")]
    )
    assert out["comparisons"]["kvzip@0.1"]["all"]["margin_higher"] == 4
    other = _result([("kvzip", 0.1)])
    other["baselines"][0]["prompt"] = "another"
    third = _write(tmp_path, "c.json", other)
    with pytest.raises(SystemExit, match="cannot combine: the runs differ on facts"):
        fidelity.main([first, third, "--reference", "am@0.1"])


def _paired(against: str, prompt_of_first: str = "facts0") -> dict:
    """A ``benchmarks.paired`` result of kvzip at 0.1 against am@0.1 of the run at ``against``."""
    pairs: list[dict] = []
    for (t, s), (score, kl, margin) in ROWS[("kvzip", 0.1)].items():
        if FULL[(t, s)][0] != 1:
            continue
        prompt = prompt_of_first if not pairs else f"{t}{s}"
        pairs.append(
            {
                "task": t,
                "seed": s,
                "prompt": prompt,
                "full_margin": FULL[(t, s)][1],
                "new": {"score": score, "kl": kl, "margin": margin, "prompt": prompt},
            }
        )
    return {
        "against": against,
        "saved_method": "am",
        "method": "kvzip",
        "ratio": 0.1,
        "saved_ratio": 0.1,
        "model": "smollm2-135m",
        "tokens": 600,
        "pairs": pairs,
    }


def test_paired_results_compare_with_the_run_they_were_paired_against(tmp_path):
    """Parts of one paired run join (each instance once), each new row beside the saved row;
    a pair whose prompt is not the saved run's is refused."""
    saved = _write(tmp_path, "saved.json", _result([("am", 0.1)]))
    whole = _paired(saved)
    first = dict(whole, pairs=whole["pairs"][:3])
    second = dict(whole, pairs=whole["pairs"][2:])
    parts = [_write(tmp_path, f"p{i}.json", p) for i, p in enumerate((first, second))]
    out = fidelity.main([*parts, "--out", str(tmp_path / "f.json")])
    c = out["comparisons"]["kvzip@0.1"]
    assert c["reference"] == f"am@0.1 in {saved}"
    assert c["all"]["answers"] == 4
    assert (c["all"]["kl_lower"], c["all"]["kl_higher"]) == (3, 1)
    assert (c["all"]["margin_higher"], c["all"]["margin_lower"]) == (4, 0)
    assert c[f"margin<{CONFIDENT_MARGIN:g}"]["answers"] == 2
    # a pair without the full context's margin reads the saved run's; a margin of 0 stays 0
    older = _paired(saved)
    older["pairs"][0]["full_margin"] = None
    older["pairs"][1]["full_margin"] = 0.0
    out = fidelity.main(
        [_write(tmp_path, "older.json", older), "--out", str(tmp_path / "g.json")]
    )
    margins = [p["full_margin"] for p in out["pairs"]["kvzip@0.1"]]
    assert margins[:2] == [FULL[("facts", 0)][1], 0.0]
    wrong = _write(tmp_path, "wrong.json", _paired(saved, prompt_of_first="other"))
    with pytest.raises(SystemExit, match="not the run it was paired against"):
        fidelity.main([wrong])


def test_bad_input_is_refused_with_a_sentence(tmp_path):
    path = _write(tmp_path, "run.json", _result([("am", 0.1), ("am", 0.05)]))
    saved = _write(tmp_path, "saved.json", _result([("am", 0.1)]))
    paired = _write(tmp_path, "paired.json", _paired(saved))
    for reference in ("@0.1", "am@", "am@1.5", "am@zero"):
        with pytest.raises(SystemExit, match="--reference takes METHOD"):
            fidelity.main([path, "--reference", reference])
    with pytest.raises(
        SystemExit, match="the results have no kvzip@0.1; they have am@0.1"
    ):
        fidelity.main([path, "--reference", "kvzip@0.1"])
    with pytest.raises(SystemExit, match="give --reference"):
        fidelity.main([path])
    with pytest.raises(SystemExit, match="nothing to compare"):
        fidelity.main([saved, "--reference", "am"])
    with pytest.raises(SystemExit, match="not both"):
        fidelity.main([path, paired, "--reference", "am"])
    with pytest.raises(SystemExit, match="carry their own reference"):
        fidelity.main([paired, "--reference", "am"])
    with pytest.raises(SystemExit, match="cannot read"):
        fidelity.main([str(tmp_path / "none.json"), "--reference", "am"])
    broken = _write(tmp_path, "broken.json", {"rows": []})
    with pytest.raises(SystemExit, match="not a result of"):
        fidelity.main([broken, "--reference", "am"])
    no_rows = _write(
        tmp_path, "no_rows.json", dict(_paired(saved), pairs=[{"task": "facts"}])
    )
    with pytest.raises(SystemExit, match="not a result of benchmarks.quality or"):
        fidelity.main([no_rows])


def test_on_the_saved_run_half_the_budget_raises_kl_on_every_right_answer(tmp_path):
    """The saved six-instance run of the default at 10% and 5%: KL on the full context's
    answer is higher at 5% on all 18 right answers, while the margins move both ways (the
    sign test cannot tell them from noise): the figures quoted in benchmarks/README.md."""
    out = fidelity.main(
        [
            str(RESULTS / "conversations_margins_6.json"),
            "--reference",
            "am@0.1",
            "--out",
            str(tmp_path / "f.json"),
        ]
    )
    every = out["comparisons"]["am@0.05"]["all"]
    assert (every["answers"], every["kl_lower"], every["kl_higher"]) == (18, 0, 18)
    assert every["kl_p"] < 1e-5
    assert (every["margin_higher"], every["margin_lower"]) == (9, 9)


def test_on_the_saved_paired_runs_twice_the_budget_moves_kl_and_a_protect_rule_does_not(
    tmp_path,
):
    """The saved paired runs against the default at 10% (all 124 right answers each): twice
    the budget lowers KL on 121 of them, the facts rule with its floor on 64 and raises it on
    60, while both keep 3-4 answers more (the figures quoted in benchmarks/README.md)."""
    out = fidelity.main(
        [
            str(RESULTS / "paired_default_20pct_combined.json"),
            str(RESULTS / "paired_facts_floor" / "combined_10pct.json"),
            "--out",
            str(tmp_path / "f.json"),
        ]
    )
    budget = out["comparisons"]["am@0.2"]["all"]
    rule = next(c for k, c in out["comparisons"].items() if "identifiers-facts" in k)
    assert (budget["answers"], budget["kl_lower"], budget["kl_higher"]) == (124, 121, 3)
    assert (budget["kept"], budget["reference_kept"]) == (112, 108)
    assert budget["kl_ratio_median"] < 0.3
    assert (rule["all"]["kl_lower"], rule["all"]["kl_higher"]) == (64, 60)
    assert rule["all"]["kept"] == 111
    assert rule["all"]["kl_p"] > 0.5
