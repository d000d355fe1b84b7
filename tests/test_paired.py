"""``benchmarks.paired``: a method against a saved run, on the instances that decide retention."""

from __future__ import annotations

import json

import pytest

from benchmarks import paired


def _saved(scores: dict[tuple[str, int], tuple[float, float]]) -> dict:
    """A saved quality result: per (task, seed), the full context's and the method's score."""
    return {
        "model": "smollm2-135m",
        "tokens": 600,
        "tasks": ["b-task", "a-task"],
        "baselines": [
            {
                "task": t,
                "seed": s,
                "method": "full-context",
                "score": full,
                "answer": "x",
            }
            for (t, s), (full, _) in scores.items()
        ],
        "rows": [
            {
                "task": t,
                "seed": s,
                "ratio": 0.1,
                "method": "am",
                "prompt": f"{t}{s}",
                "score": mine,
                "answer": "y",
            }
            for (t, s), (_, mine) in scores.items()
        ],
    }


SCORES = {
    **{("a-task", s): (1.0, 1.0) for s in range(10)},
    ("a-task", 10): (1.0, 0.0),
    ("a-task", 11): (0.0, 1.0),  # the full context is wrong: it cannot move retention
    ("b-task", 0): (1.0, 0.0),
    ("b-task", 1): (1.0, 1.0),
}


def test_losses_come_first_then_a_seeded_shuffle_of_the_wins():
    method, picked = paired._saved_instances(_saved(SCORES), None, 0.1)
    assert method == "am" and ("a-task", 11) not in picked and len(picked) == 13
    order = paired.instance_order(picked, ["b-task", "a-task"], 0)
    # losses in the saved run's task order, then every win once
    assert order[:2] == [("b-task", 0), ("a-task", 10)]
    assert sorted(order[2:]) == sorted(k for k in picked if k not in order[:2])
    assert order == paired.instance_order(picked, ["b-task", "a-task"], 0)
    assert order != paired.instance_order(picked, ["b-task", "a-task"], 1)


def test_retention_is_exact_when_all_ran_and_bounded_by_the_sample_otherwise():
    _, picked = paired._saved_instances(_saved(SCORES), None, 0.1)

    def pair(task, seed, score):
        return {"task": task, "seed": seed, "new": {"score": score}}

    # a-task: its loss given back, 4 of 10 wins run and one of them lost
    pairs = [pair("a-task", 10, 1.0)] + [
        pair("a-task", s, 0.0 if s == 2 else 1.0) for s in range(4)
    ]
    summary = paired.summarize(picked, pairs)["a-task"]
    assert summary["saved_retention"] == 10 / 11
    assert summary["given_back"] == [10] and summary["wins_lost"] == [2]
    assert summary["wins_run"] == "4/10" and not summary["exact"]
    assert summary["retention_bounds"] == [4 / 11, 10 / 11]
    assert summary["retention_estimate"] == pytest.approx((10 * 3 / 4 + 1) / 11)
    # every instance run: exact, bounds equal
    pairs += [pair("a-task", s, 1.0) for s in range(4, 10)]
    summary = paired.summarize(picked, pairs)["a-task"]
    assert summary["exact"] and summary["retention_bounds"] == [10 / 11, 10 / 11]
    # losses not all run yet: bounds only, no estimate
    summary = paired.summarize(picked, pairs)["b-task"]
    assert summary["losses_run"] == "0/1" and "retention_estimate" not in summary


def test_the_sign_test_is_mcnemars_exact_test_and_needs_every_instance():
    # no discordant answer, or as many back as lost: no evidence either way
    assert paired.sign_test(0, 0) == 1.0 and paired.sign_test(3, 3) == 1.0
    # 7 back, 4 lost: 2 * P(X <= 4), X ~ Bin(11, 1/2)
    assert paired.sign_test(7, 4) == pytest.approx(2 * 562 / 2048)
    assert paired.sign_test(4, 7) == paired.sign_test(7, 4)
    assert paired.sign_test(10, 2) == pytest.approx(2 * 79 / 4096)
    assert paired.sign_test(5, 0) == pytest.approx(2 / 32)
    _, picked = paired._saved_instances(_saved(SCORES), None, 0.1)
    pairs = [
        {
            "task": t,
            "seed": s,
            "new": {"score": 0.0 if (t, s) == ("a-task", 3) else 1.0},
        }
        for t, s in picked
    ]
    summary = paired.summarize(picked, pairs)
    # a-task: its loss given back, win 3 lost; b-task: its loss given back
    assert summary["a-task"]["sign_test_p"] == 1.0
    assert summary["b-task"]["sign_test_p"] == 1.0
    total = paired.totals(summary)
    assert total == {
        "full_context_right": 13,
        "saved_kept": 11,
        "given_back": 2,
        "wins_lost": 1,
        "new_kept": 12,
        "sign_test_p": 1.0,
    }
    # a win not run yet: no p-value, the wins lost would be undercounted
    partial = paired.summarize(picked, pairs[:-1])
    assert "sign_test_p" not in paired.totals(partial)
    assert "new_kept" not in paired.totals(partial)


def test_bad_input_is_refused_with_a_sentence(tmp_path, monkeypatch):
    saved = _saved(SCORES)
    two = dict(saved, rows=saved["rows"] + [dict(saved["rows"][0], method="kvzip")])
    against = tmp_path / "saved.json"
    against.write_text(json.dumps(two))
    out = tmp_path / "paired.json"
    common = ["--against", str(against), "--ratio", "0.1", "--out", str(out)]
    with pytest.raises(SystemExit, match="has 2 methods at 0.1"):
        paired.main([*common, "--method", "am"])
    with pytest.raises(SystemExit, match="has no 'h2o\\+' at 0.1"):
        paired.main([*common, "--method", "am", "--saved-method", "h2o+"])
    with pytest.raises(SystemExit, match="--limit must be >= 1"):
        paired.main([*common, "--method", "am", "--saved-method", "am", "--limit", "0"])
    with pytest.raises(SystemExit, match="cannot read"):
        paired.main(
            [
                "--against",
                str(tmp_path / "none.json"),
                "--method",
                "am",
                "--ratio",
                "0.1",
            ]
        )
    # an instance whose prompt is not the saved one is refused, and what ran before is kept
    calls = []

    def measured(args):
        calls.append((args.tasks, args.seed))
        prompt = "other" if len(calls) == 2 else f"{args.tasks}{args.seed}"
        return {
            "rows": [{"prompt": prompt, "score": 1.0, "answer": "z"}],
            "baselines": [{"method": "full-context", "score": 1.0, "answer": "x"}],
        }

    monkeypatch.setattr(paired, "quality_run", measured)
    with pytest.raises(SystemExit, match="does not compare with the saved run"):
        paired.main([*common, "--method", "am:seed=1", "--saved-method", "am"])
    kept = json.loads(out.read_text())
    assert [(p["task"], p["seed"]) for p in kept["pairs"]] == [calls[0]]
    # resuming with another method is refused
    with pytest.raises(SystemExit, match="cannot resume"):
        paired.main([*common, "--method", "kvzip", "--saved-method", "am", "--resume"])


def test_the_estimate_lies_within_its_bounds_and_the_plot_draws_them(tmp_path):
    """With every sampled win kept the estimate is the upper bound, to the last bit (the
    plot's error bars refuse a negative length)."""
    for wins in range(1, 40):
        scores = {("a-task", s): (1.0, 1.0) for s in range(wins)}
        scores |= {("a-task", wins + s): (1.0, 0.0) for s in range(4)}
        _, picked = paired._saved_instances(_saved(scores), None, 0.1)
        # three of the four losses given back
        given_back = [
            {"task": "a-task", "seed": wins + s, "new": {"score": float(s < 3)}}
            for s in range(4)
        ]
        for ran in range(1, wins + 1):
            pairs = given_back + [
                {"task": "a-task", "seed": s, "new": {"score": 1.0}} for s in range(ran)
            ]
            entry = paired.summarize(picked, pairs)["a-task"]
            low, high = entry["retention_bounds"]
            assert low <= entry["retention_estimate"] <= high == (wins + 3) / (wins + 4)
    result = {
        "summary": {"a-task": entry},
        "saved_method": "am",
        "method": "am:x=1",
        "ratio": 0.1,
    }
    paired.plot(result, tmp_path / "paired.png")
    assert (tmp_path / "paired.png").stat().st_size > 0


def _every_answer_right(monkeypatch) -> list:
    """Stand in for ``quality.run``: every instance's prompt is the saved one and every answer
    right; returns the list of the arguments it was called with."""
    calls = []

    def measured(args):
        calls.append(args)
        return {
            "rows": [
                {"prompt": f"{args.tasks}{args.seed}", "score": 1.0, "answer": "z"}
            ],
            "baselines": [{"method": "full-context", "score": 1.0, "answer": "x"}],
        }

    monkeypatch.setattr(paired, "quality_run", measured)
    return calls


def test_another_ratio_pairs_with_the_saved_runs_instances(tmp_path, monkeypatch):
    """``--saved-ratio``: the saved run's instances at its ratio, the method run at ``--ratio``
    (the same method at another budget); a resume at another saved ratio is refused."""
    saved = _saved(SCORES)
    saved["rows"] += [dict(r, ratio=0.05) for r in saved["rows"]]
    against = tmp_path / "saved.json"
    against.write_text(json.dumps(saved))
    out = tmp_path / "paired.json"
    calls = _every_answer_right(monkeypatch)
    common = ["--against", str(against), "--method", "am", "--out", str(out)]
    result = paired.main(
        [*common, "--ratio", "0.2", "--saved-ratio", "0.1", "--limit", "3"]
    )
    assert [args.ratios for args in calls] == ["0.2"] * 3
    assert (result["ratio"], result["saved_ratio"]) == (0.2, 0.1)
    # the two losses at 0.1 ran first, and came back at 0.2
    assert result["summary"]["a-task"]["given_back"] == [10]
    assert result["summary"]["b-task"]["given_back"] == [0]
    with pytest.raises(SystemExit, match="cannot resume"):
        paired.main([*common, "--ratio", "0.2", "--saved-ratio", "0.05", "--resume"])
    with pytest.raises(SystemExit, match="has 0 methods at 0.3"):
        paired.main([*common, "--ratio", "0.2", "--saved-ratio", "0.3"])


def test_tasks_and_seeds_limit_the_pairs_to_those_instances(tmp_path, monkeypatch):
    """``--tasks``, ``--seeds``: only the named instances run and are summarized; an unknown
    task, a seed that is no integer and a resume with other tasks or seeds are refused."""
    against = tmp_path / "saved.json"
    against.write_text(json.dumps(_saved(SCORES)))
    out = tmp_path / "paired.json"
    calls = _every_answer_right(monkeypatch)
    common = ["--against", str(against), "--method", "am", "--ratio", "0.1"]
    result = paired.main([*common, "--tasks", "b-task", "--out", str(out)])
    assert [args.tasks for args in calls] == ["b-task", "b-task"]
    assert result["tasks"] == ["b-task"]
    assert list(result["summary"]) == ["b-task"]
    assert result["summary"]["b-task"]["exact"]
    with pytest.raises(SystemExit, match="no task c-task; it has b-task, a-task"):
        paired.main([*common, "--tasks", "b-task,c-task", "--out", str(out)])
    with pytest.raises(SystemExit, match="cannot resume .* on b-task"):
        paired.main([*common, "--tasks", "a-task", "--out", str(out), "--resume"])
    # --seeds the same way: only those seeds of the named tasks
    calls.clear()
    seeded = tmp_path / "seeded.json"
    result = paired.main([*common, "--seeds", "3,10,0", "--out", str(seeded)])
    assert sorted(args.tasks for args in calls) == ["a-task"] * 3 + ["b-task"]
    assert result["seeds"] == [0, 3, 10]
    assert result["summary"]["a-task"]["losses_run"] == "1/1"
    assert result["summary"]["a-task"]["full_context_right"] == 3
    with pytest.raises(SystemExit, match="--seeds takes comma-separated integers"):
        paired.main([*common, "--seeds", "1,x", "--out", str(seeded)])
    with pytest.raises(SystemExit, match="seeds \\[0, 3, 10\\]"):
        paired.main([*common, "--seeds", "3", "--out", str(seeded), "--resume"])


def test_runs_in_parts_combine_into_one_summary_with_its_sign_test(
    tmp_path, monkeypatch
):
    """``--combine``: runs of one method split by task join into the summary of one run over
    both, totals and sign test included; runs of another method, an instance answered twice
    differently and a file that is no paired result are refused with a sentence."""
    against = tmp_path / "saved.json"
    against.write_text(json.dumps(_saved(SCORES)))
    _every_answer_right(monkeypatch)
    common = ["--against", str(against), "--method", "am", "--ratio", "0.1"]
    parts = [tmp_path / "a.json", tmp_path / "b.json"]
    for task, out in zip(["a-task", "b-task"], parts, strict=True):
        paired.main([*common, "--tasks", task, "--out", str(out)])
    whole = tmp_path / "whole.json"
    joined = paired.main(["--combine", *map(str, parts), "--out", str(whole)])
    once = paired.main([*common, "--out", str(tmp_path / "once.json")])
    assert joined["summary"] == once["summary"]
    # both losses given back, nothing lost: 13 of 13 kept, and 2-0 is no evidence
    assert (
        joined["totals"]
        == once["totals"]
        == {
            "full_context_right": 13,
            "saved_kept": 11,
            "given_back": 2,
            "wins_lost": 0,
            "new_kept": 13,
            "sign_test_p": 0.5,
        }
    )
    assert json.loads(whole.read_text())["combined"] == list(map(str, parts))
    other = tmp_path / "other.json"
    paired.main(["--against", str(against), "--method", "kvzip", "--ratio", "0.1",
                 "--tasks", "a-task", "--out", str(other)])  # fmt: skip
    with pytest.raises(SystemExit, match="does not combine .* their method differ"):
        paired.main(["--combine", str(parts[0]), str(other)])
    changed = json.loads(parts[0].read_text())
    changed["pairs"][0]["new"]["answer"] = "another answer"
    twin = tmp_path / "twin.json"
    twin.write_text(json.dumps(changed))
    with pytest.raises(SystemExit, match="ran twice with different answers"):
        paired.main(["--combine", str(parts[0]), str(twin)])
    with pytest.raises(SystemExit, match="is not a benchmarks.paired result"):
        paired.main(["--combine", str(against)])
    with pytest.raises(SystemExit, match="give --against, --method and --ratio"):
        paired.main(["--method", "am"])
