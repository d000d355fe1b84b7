"""benchmarks.kvpress_kvzip without kvpress: its budget, its resume and its setup error."""

from __future__ import annotations

import pytest

from benchmarks import kvpress_kvzip
from benchmarks.kvpress_kvzip import METHOD, kept_instances, parser, removed_fraction


def test_removed_fraction_keeps_as_many_pairs_as_our_methods():
    # 1,500 tokens, 1,436 of them content: ours keep 144 content slots and 64 template tokens
    removed = removed_fraction(1500, 1436, 0.1)
    assert round((1 - removed) * 1500) == 144 + 64
    assert removed_fraction(100, 10, 1.0) == 0.0
    with pytest.raises(ValueError, match="ratios must be in"):
        removed_fraction(100, 10, 0.0)


def _result(ratios, seeds_done, partial_seed=None):
    baselines, rows = [], []
    for seed in [*seeds_done, *([partial_seed] if partial_seed is not None else [])]:
        for name in ("full-context", "no-context"):
            baselines.append(
                dict(task="chat-facts", seed=seed, method=name, prompt=f"p{seed}")
            )
        measured = ratios if seed in seeds_done else ratios[:1]
        rows += [
            dict(task="chat-facts", seed=seed, ratio=r, method=METHOD) for r in measured
        ]
    return dict(
        model="smollm2-135m", tokens=1500, ratios=ratios, methods=[METHOD],
        baselines=baselines, rows=rows,
    )  # fmt: skip


def test_resume_keeps_complete_instances_only_and_refuses_other_settings():
    args = parser().parse_args(["--ratios", "0.1,0.05"])
    done = kept_instances(
        _result([0.1, 0.05], [0, 1], partial_seed=2), args, [0.1, 0.05]
    )
    assert sorted(done) == [("chat-facts", 0), ("chat-facts", 1)]
    assert len(done[("chat-facts", 0)]["rows"]) == 2
    assert done[("chat-facts", 1)]["prompt"] == "p1"
    with pytest.raises(
        ValueError, match="cannot resume: the earlier result has ratios"
    ):
        kept_instances(_result([0.1], [0]), args, [0.1, 0.05])


def test_without_kvpress_it_says_how_to_get_it(tmp_path, monkeypatch):
    def missing():
        raise kvpress_kvzip.SetupError(
            "kvpress is not importable; run `make kvpress-venv`"
        )

    monkeypatch.setattr(kvpress_kvzip, "_kvpress", missing)
    with pytest.raises(SystemExit, match="kvpress_kvzip: kvpress is not importable"):
        kvpress_kvzip.main(["--out", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()
