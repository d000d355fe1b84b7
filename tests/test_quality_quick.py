"""The evaluation suite's quick mode (CI size) with quality floors, on the real SmolLM2."""

from __future__ import annotations

import statistics

import pytest

from vllm_compaction.eval.tasks import TASKS, make_task, score_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_compaction.models import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2-135m"))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_tasks_are_seeded_and_hold_their_answers(tokenizer, task):
    a, b = (
        make_task(task, tokenizer, 600, seed=3),
        make_task(task, tokenizer, 600, seed=3),
    )
    assert a == b and a != make_task(task, tokenizer, 600, seed=4)
    assert (
        all(answer in a.context for answer in a.answers) and a.question not in a.context
    )
    assert 450 < len(tokenizer(a.context, add_special_tokens=False)["input_ids"]) <= 620


def test_niah_ruler_keeps_its_instruction_exact_before_the_same_context(smollm2):
    """The RULER instruction joins the chat-template header (51 tokens, the prompt the needle
    targets were measured on), never the compacted span; the context and its compacted tokens are niah's."""
    from vllm_compaction.eval.niah import INSTRUCTION
    from vllm_compaction.eval.tasks import task_prompt

    bare, ruler = (
        make_task("niah", smollm2.tokenizer, 600, seed=3),
        make_task("niah-ruler", smollm2.tokenizer, 600, seed=3),
    )
    assert ruler.instruction == INSTRUCTION and (ruler.context, ruler.answers) == (
        bare.context,
        bare.answers,
    )
    p_bare, p_ruler = task_prompt(smollm2, bare), task_prompt(smollm2, ruler)
    header = int(p_ruler.compact_mask.int().argmax())
    assert (
        header == 51
        and not p_ruler.compact_mask[:header].any()
        and p_ruler.compact_mask[header:].all()
    )
    assert p_ruler.prefix_ids[header:] == [
        i for i, m in zip(p_bare.prefix_ids, p_bare.compact_mask) if m
    ]
    assert INSTRUCTION.strip() in smollm2.tokenizer.decode(p_ruler.prefix_ids[:header])
    assert p_ruler.continuation_ids == p_bare.continuation_ids


def test_scoring_is_whole_word():
    assert (
        score_text("room 42.", ("42",)) == 1.0
        and score_text("room 423", ("42",)) == 0.0
    )
    assert score_text("ABCDE and FGHIJ", ("ABCDE", "FGHIJ", "KLMNO")) == pytest.approx(
        2 / 3
    )


def test_quick_mode_meets_its_floors():
    from benchmarks.quality import SweepError, add_margins, parser, run

    args = parser().parse_args(
        ["--quick", "--tasks", "niah", "--methods", "am-highest-attn-fast,kvzip"]
    )
    args.instances, args.tokens, args.ratios = 2, 600, "0.2"
    partial: list[dict] = []
    result = run(args, on_instance=partial.append)
    # a long sweep keeps what it measured: the result so far after every instance
    assert [len(p["baselines"]) for p in partial] == [2, 4] and all(
        p["partial"] for p in partial
    )
    assert partial[-1]["rows"] == result["rows"] and "partial" not in result
    summary = result["summary"]["niah"]
    assert summary["full-context"] == "2/2" and summary["no-context"] == "0/2"
    am, kvzip = summary["am-highest-attn-fast"]["0.2"], summary["kvzip"]["0.2"]
    assert am["score"] == "2/2"
    # AM reproduces the full cache better than the eviction baseline it starts from (the paper's claim)
    assert am["kl"] < kvzip["kl"] and am["log_ppl_ratio"] < 1.10
    hashes = {(r["seed"], r["prompt"]) for r in result["rows"] + result["baselines"]}
    assert len(hashes) == 2  # one prompt per seed, shared by every method and baseline
    # each right full-context answer carries its margin, each prefix its margin on that answer:
    # a positive one means the prefix's greedy answer starts with the full answer's tokens
    full = [b for b in result["baselines"] if b["method"] == "full-context"]
    assert all(b["margin"] > 0 for b in full)
    assert all(r["score"] == 1 for r in result["rows"] if r["margin"] > 0)
    split = am["retention_by_margin"]
    assert sum(int(v.split("/")[1]) for v in split.values()) == 2, split
    assert am["margin_median"] == pytest.approx(
        statistics.median(
            r["margin"] for r in result["rows"] if r["method"] == "am-highest-attn-fast"
        )
    )

    # margins added to the same result saved without them are the margins it was run with
    bare = {
        **result,
        "baselines": [
            {k: v for k, v in b.items() if k != "margin"} for b in result["baselines"]
        ],
    }
    added = add_margins(bare, max_new_tokens=12)
    assert [b.get("margin") for b in added["baselines"]] == pytest.approx(
        [b.get("margin") for b in result["baselines"]], abs=1e-4
    )
    assert (
        added["summary"]["niah"]["kvzip"]["0.2"]["retention_by_margin"]
        == (summary["kvzip"]["0.2"]["retention_by_margin"])
    )
    with pytest.raises(SweepError, match="not the saved"):
        add_margins(
            {**bare, "baselines": [{**b, "answer": "x"} for b in bare["baselines"]]},
            max_new_tokens=12,
        )
    with pytest.raises(SweepError, match="another prompt"):
        add_margins(
            {**bare, "baselines": [{**b, "prompt": "0"} for b in bare["baselines"]]},
            max_new_tokens=12,
        )

    # --resume keeps completed instances after checking their prompts; nothing is recomputed here
    resumed = run(args, previous=result)
    assert (
        resumed["rows"] == result["rows"]
        and resumed["baselines"] == result["baselines"]
    )
    tampered = {
        **result,
        "baselines": [{**b, "prompt": "0" * 16} for b in result["baselines"]],
    }
    with pytest.raises(SweepError, match="another prompt"):
        run(args, previous=tampered)

    # stopped again after its first new instance, a resumed sweep has saved every instance it
    # resumed from, those its task order had not reached included
    class Stopped(Exception):
        """Raised from ``on_instance`` to stop the sweep after its first new instance."""

    saved: list[dict] = []

    def stop(partial: dict) -> None:
        saved.append(partial)
        raise Stopped

    args.tasks = "niah-ruler,niah"
    with pytest.raises(Stopped):
        run(args, previous=result, on_instance=stop)
    assert {(r["task"], r["seed"]) for r in saved[0]["rows"]} == {
        ("niah-ruler", 0),
        ("niah", 0),
        ("niah", 1),
    }


def test_resume_refuses_other_settings_and_keeps_only_complete_instances():
    from benchmarks.quality import SweepError, completed_instances, parser

    args = parser().parse_args(
        [
            "--methods",
            "kvzip",
            "--ratios",
            "0.1,0.05",
            "--instances",
            "3",
            "--seed",
            "5",
        ]
    )
    base = dict(
        model="smollm2-135m", tokens=2000, methods=["kvzip"], ratios=[0.1, 0.05]
    )

    def instance(seed, ratios=(0.1, 0.05)):
        rows = [dict(task="niah", seed=seed, ratio=r) for r in ratios]
        return rows, [
            dict(task="niah", seed=seed, method=m, prompt=f"p{seed}")
            for m in ("full-context", "no-context")
        ]

    rows, baselines = [], []
    # 6 unfinished, 9 outside the range
    for seed, ratios in (
        (5, (0.1, 0.05)),
        (6, (0.1,)),
        (9, (0.1, 0.05)),
    ):
        r, b = instance(seed, ratios)
        rows += r
        baselines += b
    done = completed_instances(dict(base, rows=rows, baselines=baselines), args)
    assert list(done) == [("niah", 5)] and done[("niah", 5)]["prompt"] == "p5"
    for key, other in (
        ("ratios", [0.1]),
        ("methods", ["h2o+"]),
        ("tokens", 1000),
        ("model", "gemma3-270m"),
    ):
        with pytest.raises(SweepError, match=key):
            completed_instances(
                dict(base, **{key: other}, rows=rows, baselines=baselines), args
            )


def _result(
    methods,
    seeds=(0, 1),
    ratios=(0.1,),
    prompt="p",
    full_score=1.0,
    task="niah",
    answered_by=None,
):
    baselines = [
        dict(
            task=task,
            seed=s,
            method=m,
            prompt=f"{prompt}{s}",
            score=full_score if m == "full-context" else 0.0,
        )
        for s in seeds
        for m in ("full-context", "no-context")
    ]
    rows = [
        dict(
            task=task,
            seed=s,
            method=m,
            ratio=r,
            score=1.0,
            compaction_s=1.0,
            log_ppl_full=1.0,
            log_ppl_compacted=1.5,
            kl=0.1,
        )
        for m in methods
        for s in seeds
        for r in ratios
    ]
    result = dict(
        model="smollm2-135m",
        tokens=2000,
        instances=len(seeds),
        seed=seeds[0],
        tasks=[task],
        ratios=list(ratios),
        methods=list(methods),
        baselines=baselines,
        rows=rows,
    )
    return result if answered_by is None else {**result, "answered_by": answered_by}


def test_combine_merges_runs_over_the_same_instances_only():
    from benchmarks.quality import SweepError, combine

    merged = combine(
        [
            _result(["kvzip"], ratios=(0.1, 0.05)),
            _result(["h2o+", "snapkv"], ratios=(0.2, 0.1)),
        ]
    )
    assert merged["methods"] == ["kvzip", "h2o+", "snapkv"] and merged["ratios"] == [
        0.2,
        0.1,
        0.05,
    ]
    summary = merged["summary"]["niah"]
    assert (
        summary["full-context"] == "2/2" and summary["snapkv"]["0.2"]["score"] == "2/2"
    )
    assert summary["kvzip"]["0.05"]["log_ppl_ratio"] == pytest.approx(1.5)
    for other, match in (
        (_result(["h2o+"], seeds=(0, 2)), "instances"),
        (_result(["h2o+"], prompt="q"), "instances"),
        (_result(["h2o+"], full_score=0.0), "instances"),
        (_result(["kvzip"]), "two of the runs"),
        ({**_result(["h2o+"]), "tokens": 1000}, "tokens"),
    ):
        with pytest.raises(SweepError, match=match):
            combine([_result(["kvzip"]), other])


def test_combine_joins_a_sweep_split_by_task_into_the_summary_of_one_run(tmp_path):
    from benchmarks.quality import SweepError, combine, plot, summarize

    # two processes, two families each in the real runs; here one task each
    facts = _result(["am"], task="chat-facts", answered_by="reference+vllm")
    copies = _result(
        ["am"], task="exact-copy", full_score=0.0, answered_by="reference+vllm"
    )
    joined = combine([facts, copies])
    assert joined["tasks"] == ["chat-facts", "exact-copy"]
    assert joined["answered_by"] == "reference+vllm"
    assert joined["summary"] == summarize(
        facts["rows"] + copies["rows"], facts["baselines"] + copies["baselines"]
    )
    assert joined["summary"]["exact-copy"]["full-context"] == "0/2"
    assert "partial" not in joined
    assert combine([facts, {**copies, "partial": True}])["partial"] is True
    # another method on one of the tasks joins too (and vLLM's answers are not everywhere)
    kvzip = _result(["kvzip"], task="exact-copy", full_score=0.0)
    three = combine([facts, copies, kvzip])
    assert three["methods"] == ["am", "kvzip"] and "answered_by" not in three
    assert "kvzip" not in three["summary"]["chat-facts"]
    assert three["summary"]["exact-copy"]["kvzip"]["0.1"]["score"] == "2/2"
    # and draws: each task with the methods and instances it has
    plot(three, tmp_path / "three.png")
    assert (tmp_path / "three.png").stat().st_size > 0
    # a task in two runs must have the same instances; a method at a ratio on a task once
    with pytest.raises(SweepError, match=r"differ on exact-copy instances \[0, 1\]"):
        combine([copies, _result(["kvzip"], task="exact-copy", prompt="q")])
    with pytest.raises(
        SweepError, match="am at 0.1 on chat-facts is in two of the runs"
    ):
        combine([facts, copies, _result(["am"], task="chat-facts")])


def test_combine_joins_a_method_across_runs_of_other_ratios_and_takes_the_first_instances():
    from benchmarks.quality import SweepError, combine, main

    # the default at 10% over 4 instances, at 5% and 2% over 2: merged over the first 2
    merged = combine(
        [
            _result(["am", "kvzip"], seeds=(0, 1, 2, 3)),
            _result(["am"], ratios=(0.05, 0.02)),
        ],
        instances=2,
    )
    assert merged["methods"] == ["am", "kvzip"] and merged["instances"] == 2
    assert merged["ratios"] == [0.1, 0.05, 0.02]
    assert {r["seed"] for r in merged["rows"]} == {0, 1}
    summary = merged["summary"]["niah"]
    assert [summary["am"][r]["score"] for r in ("0.1", "0.05", "0.02")] == ["2/2"] * 3
    # without the cut the instances differ; one method at one ratio twice is refused
    with pytest.raises(SweepError, match="instances"):
        combine([_result(["am"], seeds=(0, 1, 2, 3)), _result(["am"], ratios=(0.05,))])
    with pytest.raises(SweepError, match="am at 0.05 on niah is in two of the runs"):
        combine([_result(["am"], ratios=(0.1, 0.05)), _result(["am"], ratios=(0.05,))])
    with pytest.raises(SweepError, match="--first must be >= 1"):
        combine([_result(["am"])], instances=0)
    with pytest.raises(SystemExit, match="--first and --label go with --combine"):
        main(["--first", "2"])
    # a spec written out in one run is merged with its recipe name from another
    spec = "am:queries=repeat-prefill,min_layer_share=0.3"
    named = combine(
        [_result([spec]), _result(["am"], ratios=(0.05,))], labels={spec: "am"}
    )
    assert named["methods"] == ["am"] and {r["method"] for r in named["rows"]} == {"am"}
    with pytest.raises(SystemExit, match="--label takes METHOD=NAME"):
        main(["--combine", "x.json", "--label", "am"])


def test_free_form_task_is_not_scored_and_is_drawn_by_its_reconstruction(
    tokenizer, tmp_path
):
    from benchmarks.quality import combine, plot
    from vllm_compaction.eval.tasks import ESSAY_ANSWER_TOKENS, ESSAY_QUESTIONS

    inst = make_task("essay-questions", tokenizer, 600, seed=3)
    assert not inst.scored and inst.score("anything at all") is None
    assert (
        inst.question in ESSAY_QUESTIONS
        and inst.answer_tokens == ESSAY_ANSWER_TOKENS > 12
    )
    assert make_task("niah", tokenizer, 600, seed=3).scored

    def unscored(result):
        for entry in result["baselines"] + result["rows"]:
            entry.update(task="essay-questions", score=None)
        return {**result, "tasks": ["essay-questions"]}

    merged = combine(
        [unscored(_result(["kvzip"], ratios=(0.1, 0.05))), unscored(_result(["h2o+"]))]
    )
    summary = merged["summary"]["essay-questions"]
    assert summary["full-context"] is None and summary["no-context"] is None
    assert summary["kvzip"]["0.1"]["score"] is None and summary["kvzip"]["0.1"][
        "log_ppl_ratio"
    ] == pytest.approx(1.5)
    # the reconstruction panels draw without a score
    plot(merged, tmp_path / "free_form.png")
    assert (tmp_path / "free_form.png").stat().st_size > 0


def test_retention_splits_by_the_full_context_margin_and_old_results_get_margins(
    tmp_path,
):
    from benchmarks.quality import SweepError, add_margins, main, summarize

    result = _result(["am"], seeds=(0, 1, 2, 3, 4))
    margins = {0: 0.1, 1: 0.3, 2: 0.8, 3: 2.0}  # seed 4: saved before margins
    for b in result["baselines"]:
        if b["method"] == "full-context" and b["seed"] in margins:
            b["margin"] = margins[b["seed"]]
    for r in result["rows"]:
        r["score"] = float(r["seed"] in (1, 3, 4))
        r["margin"] = 0.2 if r["score"] else -0.4
    cell = summarize(result["rows"], result["baselines"])["niah"]["am"]["0.1"]
    assert cell["retention"] == 3 / 5
    assert cell["retention_by_margin"] == {"margin<0.5": "1/2", "margin>=0.5": "1/2"}
    assert cell["margin_median"] == pytest.approx(0.2)
    # a result from before margins has no split, and nothing to add where the full context
    # answered nothing right (no model is loaded for it)
    old = _result(["am"])
    assert (
        "retention_by_margin"
        not in summarize(old["rows"], old["baselines"])["niah"]["am"]["0.1"]
    )
    wrong = _result(["am"], full_score=0.0)
    assert add_margins(wrong, max_new_tokens=12)["baselines"] == wrong["baselines"]
    with pytest.raises(SweepError, match="not a result"):
        add_margins({"rows": []}, max_new_tokens=12)
    with pytest.raises(SystemExit, match="drop --combine and --resume"):
        main(["--add-margins", "--combine", "x.json"])
    with pytest.raises(SystemExit, match="there is no result at"):
        main(["--add-margins", "--out", str(tmp_path / "none.json")])
