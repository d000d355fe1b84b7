"""Conversation-shaped evaluation tasks: what is compacted, where the facts sit, how answers
score, and how the quality benchmark reports them."""

from __future__ import annotations

from collections import Counter

import pytest

from vllm_compaction.eval.conversations import (
    CONVERSATION_TASKS,
    POSITIONS,
    TURNS,
    cut_short,
)
from vllm_compaction.eval.tasks import make_task, task_prompt


@pytest.mark.parametrize("task", sorted(CONVERSATION_TASKS))
def test_the_history_is_compacted_as_the_server_compacts_it(smollm2, task):
    """The compacted tokens are exactly the messages' contents (template tokens exact, as
    ``POST /v1/compact`` does); the question is a new user turn after the history and the
    answer prefix opens the assistant's reply."""
    inst = make_task(task, smollm2.tokenizer, 600, seed=5)
    prompt = task_prompt(smollm2, inst)
    ids, mask = smollm2.chat.chat_content(list(inst.messages))
    assert prompt.prefix_ids == ids and prompt.compact_mask.equal(mask)
    compacted = smollm2.tokenizer.decode(
        [t for t, m in zip(prompt.prefix_ids, prompt.compact_mask.tolist()) if m]
    )
    assert "".join(compacted.split()) == "".join(
        "".join(m["content"] for m in inst.messages).split()
    )
    kept = smollm2.tokenizer.decode(
        [t for t, m in zip(prompt.prefix_ids, prompt.compact_mask.tolist()) if not m]
    )
    assert kept.count("<|im_start|>") == len(inst.messages) + (
        inst.messages[0]["role"] != "system"  # SmolLM2's default system turn
    )
    after = smollm2.tokenizer.decode(prompt.continuation_ids)
    assert after.startswith("<|im_start|>user\n" + inst.question)
    assert after.endswith("<|im_start|>assistant\n" + inst.answer_prefix)
    assert all(answer in inst.context for answer in inst.answers)
    assert not any(answer in after for answer in inst.answers)


@pytest.mark.parametrize("task", ["chat-facts", "exact-copy"])
def test_48_instances_walk_every_turn_and_position(smollm2, task):
    """Each of the 12 (turn, position in the turn) pairs holds the fact four times in 48
    seeds, and the fact is where the instance says it is."""
    seen: Counter = Counter()
    for seed in range(48):
        inst = make_task(task, smollm2.tokenizer, 400, seed=seed)
        turn, position = inst.details["fact_turn"], inst.details["fact_position"]
        seen[(turn, position)] += 1
        users = [m["content"] for m in inst.messages if m["role"] == "user"]
        (answer,) = inst.answers
        assert [answer in u for u in users].index(True) == turn
        body = users[turn].split("\n\n", 1)[1]  # after the turn's opener
        # where the value sits in the turn: a statement is under 60 characters before its
        # value and under 25 after it
        before, after = body.index(answer), len(body) - body.index(answer) - len(answer)
        assert {
            "start": before < 60,
            "end": after < 25,
            "middle": before >= 60 and after >= 25,
        }[position], (position, body)
    assert set(seen) == {(t, p) for t in range(TURNS) for p in POSITIONS}
    assert set(seen.values()) == {4}


def test_multikey_distractors_are_near_duplicates(smollm2):
    for seed in range(8):
        inst = make_task("chat-multikey", smollm2.tokenizer, 600, seed=seed)
        (answer,) = inst.answers
        distractors = inst.distractors
        assert len(distractors) == 3 and answer not in distractors
        assert all(d[:3] == answer[:3] and d in inst.context for d in distractors)
        # one key per turn: the asked one is in the turn the details name
        users = [m["content"] for m in inst.messages if m["role"] == "user"]
        assert answer in users[inst.details["fact_turn"]]
        # naming every candidate is not picking the right one
        assert inst.score(f"The code is {answer}.") == 1.0
        assert inst.score(f"{answer}, or maybe {distractors[0]}") == 0.0


def test_an_agent_answer_that_names_both_commits_or_both_tickets_is_wrong(smollm2):
    from benchmarks.quality import _about

    for seed in (1, 2):  # the commit, then the ticket
        inst = make_task("agent-trace", smollm2.tokenizer, 600, seed=seed)
        (answer,) = inst.answers
        (other,) = inst.distractors
        assert other != answer and other in inst.context
        assert inst.score(f"commit {answer}: Add retry") == 1.0
        assert inst.score(f"{other} or {answer}") == 0.0
        # the benchmark's record names them beside where the fact sits
        assert _about(inst, answer)["details"]["distractors"] == [other]
    line = make_task("agent-trace", smollm2.tokenizer, 600, seed=0)
    assert line.details["asked"] == "line" and line.distractors == ()


def test_agent_traces_hold_their_tool_outputs(smollm2):
    asked = Counter()
    for seed in range(6):
        inst = make_task("agent-trace", smollm2.tokenizer, 800, seed=seed)
        roles = [m["role"] for m in inst.messages]
        assert (
            roles[:2] == ["system", "user"] and roles[2:] == ["assistant", "tool"] * 5
        )
        (answer,) = inst.answers
        tools = [m["content"] for m in inst.messages if m["role"] == "tool"]
        assert sum(answer in t for t in tools) == 1
        asked[inst.details["asked"]] += 1
    assert asked == {"line": 2, "commit": 2, "ticket": 2}


def test_identifiers_score_on_every_character():
    inst = make_task_exact("485538")
    assert inst.score("Your code is 485538.") == 1.0
    assert inst.score("Your code is 48553.") == 0.0 and cut_short("48553.", ("485538",))
    assert inst.score("4855381") == 0.0 and not cut_short("4855381", ("485538",))
    key = make_task_exact("QW7B-3PDK-HX4P")
    assert key.score("qw7b-3pdk-hx4p") == 0.0  # case counts for identifiers
    assert key.score('"QW7B-3PDK-HX4P-YA"') == 0.0  # a longer key is another key
    assert cut_short("QW7B-3PDK was it", ("QW7B-3PDK-HX4P",))
    assert not cut_short("QW7B", ("QW7B-3PDK-HX4P",))  # under half: not a copy at all
    # the whole copy, then a repeat that runs out of tokens: not cut short
    assert not cut_short(
        "30877432d102. The original was 30877432d10", ("30877432d102",)
    )
    assert not cut_short("168: refund counted twice\n1. The test", ("168",))


def make_task_exact(value: str):
    from vllm_compaction.eval.instance import TaskInstance

    return TaskInstance("exact-copy", 0, value, "?", "", (value,), exact=True)


def test_the_summary_reports_retention_positions_and_cut_short_copies():
    from benchmarks.quality import summarize

    def record(seed, method, score, **extra):
        return dict(
            task="exact-copy",
            seed=seed,
            method=method,
            score=score,
            vllm_score=score,
            **extra,
        )

    baselines = [
        record(0, "full-context", 1.0),
        record(1, "full-context", 1.0),
        record(2, "full-context", 0.0),
    ] + [record(s, "no-context", 0.0) for s in range(3)]
    cell = dict(ratio=0.1, compaction_s=1.0, log_ppl_full=1.0, log_ppl_compacted=1.2)
    rows = [
        record(0, "am", 1.0, details={"fact_position": "end"}, cut_short=False, **cell),
        record(
            1, "am", 0.0, details={"fact_position": "start"}, cut_short=True, **cell
        ),
        record(2, "am", 1.0, details={"fact_position": "end"}, cut_short=False, **cell),
    ]
    for r in rows:
        r["kl"] = 0.1
    summary = summarize(rows, baselines)["exact-copy"]
    assert summary["vllm:full-context"] == "2/3"
    am = summary["am"]["0.1"]
    # retention counts only what the full context got right: seed 2 is not among them
    assert am["vllm_score"] == "2/3" and am["retention"] == 0.5
    assert am["cut_short"] == 1
    assert am["by"] == {"fact_position=end": "2/2", "fact_position=start": "0/1"}
