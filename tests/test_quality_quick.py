"""The evaluation suite's quick mode (CI size) with quality floors, on the real SmolLM2."""

from __future__ import annotations

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
    a, b = make_task(task, tokenizer, 600, seed=3), make_task(task, tokenizer, 600, seed=3)
    assert a == b and a != make_task(task, tokenizer, 600, seed=4)
    assert all(answer in a.context for answer in a.answers) and a.question not in a.context
    assert 450 < len(tokenizer(a.context, add_special_tokens=False)["input_ids"]) <= 620


def test_scoring_is_whole_word():
    assert score_text("room 42.", ("42",)) == 1.0 and score_text("room 423", ("42",)) == 0.0
    assert score_text("ABCDE and FGHIJ", ("ABCDE", "FGHIJ", "KLMNO")) == pytest.approx(2 / 3)


def test_quick_mode_meets_its_floors():
    from benchmarks.quality import parser, run

    args = parser().parse_args(["--quick", "--tasks", "niah", "--methods", "am-highest-attn-fast,kvzip"])
    args.instances, args.tokens, args.ratios = 2, 600, "0.2"
    partial: list[dict] = []
    result = run(args, on_instance=partial.append)
    # a long sweep keeps what it measured: the result so far after every instance
    assert [len(p["baselines"]) for p in partial] == [2, 4] and all(p["partial"] for p in partial)
    assert partial[-1]["rows"] == result["rows"] and "partial" not in result
    summary = result["summary"]["niah"]
    assert summary["full-context"] == "2/2" and summary["no-context"] == "0/2"
    am, kvzip = summary["am-highest-attn-fast"]["0.2"], summary["kvzip"]["0.2"]
    assert am["score"] == "2/2"
    # AM reproduces the full cache better than the eviction baseline it starts from (the paper's claim)
    assert am["kl"] < kvzip["kl"] and am["log_ppl_ratio"] < 1.10
    hashes = {(r["seed"], r["prompt"]) for r in result["rows"] + result["baselines"]}
    assert len(hashes) == 2  # one prompt per seed, shared by every method and baseline
