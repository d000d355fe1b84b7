"""Replaying a saved agent session: which messages each state's compaction covered, the order
the states run in, and what the summary counts."""

from __future__ import annotations

import json

import pytest

from benchmarks import agent_replay


def _turn(turn: int, round_: int, compacted: list[bool], full: list[bool]) -> dict:
    return {
        "turn": turn,
        "round": round_,
        "probes": [
            {
                "question": f"q{i}",
                "compacted": c,
                "full": f,
                "compacted_answer": f"a{i}",
                "full_answer": f"f{i}",
            }
            for i, (c, f) in enumerate(zip(compacted, full, strict=True))
        ],
    }


def _session(seed: int, covered: int | None = 7) -> dict:
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
        for i in range(10)
    ]
    return {
        "seed": seed,
        "facts": ["7319", "Bluebird"],
        # no compaction at turns 0-1, one queued by turn 2's request, the next by turn 3's,
        # and turn 4 still served from it
        "turns": [
            _turn(0, 0, [True, True], [True, True]),
            _turn(1, 0, [True, True], [True, True]),
            _turn(2, 1, [True, True], [True, False]),
            _turn(3, 2, [False, True], [True, True]),
            _turn(4, 2, [True, False], [False, False]),
        ],
        "compactions": [
            {"status": "succeeded", "messages_covered": covered},
        ],
        "history": history,
    }


def test_each_state_reads_the_newest_compaction_of_the_request_that_queued_it():
    states = agent_replay.compaction_states({"sessions": [_session(3)]})
    assert [(s["turn"], s["round"]) for s in states] == [(2, 1), (3, 2), (4, 2)]
    covered = [[m["content"] for m in s["covered"]] for s in states]
    after = [[m["content"] for m in s["after"]] for s in states]
    # turn k's request holds the first 2k + 1 messages; a state reads the rest through its reply
    assert covered == [[f"m{i}" for i in range(n)] for n in (5, 7, 7)]
    assert after == [["m5"], ["m7"], ["m7", "m8", "m9"]]
    assert [p["answer"] for p in states[0]["probes"]] == ["7319", "Bluebird"]


def test_losses_run_first_and_states_without_a_right_answer_not_at_all():
    states = agent_replay.compaction_states({"sessions": [_session(3)]})
    order = agent_replay.state_order(states, seed=0)
    # turn 3 lost the first fact; turn 4's full history is wrong on both, so it cannot score
    assert [s["turn"] for s in order] == [3, 2]


def test_a_run_that_does_not_replay_is_refused_with_a_sentence():
    with pytest.raises(agent_replay.ReplayError, match="covered 9 messages"):
        agent_replay.compaction_states({"sessions": [_session(3, covered=9)]})
    no_history = _session(3) | {"history": []}
    with pytest.raises(agent_replay.ReplayError, match="no history"):
        agent_replay.compaction_states(no_history)


def test_the_summary_counts_the_full_historys_right_answers_only():
    def probe(full: bool, saved: bool, new: bool, logprob: float | None = None) -> dict:
        return {"full": full, "saved": saved, "new": new, "answer_logprob": logprob}

    rows = [
        {"probes": [probe(True, False, True, -0.5), probe(True, True, True, -1.5)]},
        {"probes": [probe(True, True, False), probe(False, False, True, -9.0)]},
    ]
    assert agent_replay.summarize(rows, total_states=5) == {
        "states_run": 2,
        "states_with_a_right_answer": 5,
        "full_right": 3,
        "saved_kept": 2,
        "new_kept": 2,
        "given_back": 1,
        "lost": 1,
        "answer_logprobs": 2,
        "mean_answer_logprob": -1.0,
    }


def test_a_resume_with_another_method_is_refused(tmp_path):
    saved = tmp_path / "saved.json"
    saved.write_text(
        json.dumps({"method": "am", "target_tokens": 192, "sessions": [_session(3)]})
    )
    out = tmp_path / "replay.json"
    out.write_text(json.dumps({"new_method": "am", "target_tokens": 192, "rows": []}))
    with pytest.raises(SystemExit, match="--resume needs the same method"):
        agent_replay.main(
            [
                "--against",
                str(saved),
                "--method",
                "kvzip",
                "--resume",
                "--out",
                str(out),
            ]
        )
    by_ratio = tmp_path / "by_ratio.json"
    by_ratio.write_text(
        json.dumps({"method": "am", "target_tokens": None, "sessions": []})
    )
    with pytest.raises(SystemExit, match="pass --target-tokens"):
        agent_replay.main(
            ["--against", str(by_ratio), "--method", "am", "--out", str(out)]
        )


def test_the_answers_log_probability_counts_the_values_tokens_alone(smollm2):
    import torch

    from vllm_compaction import compact
    from vllm_compaction.reference import ReferenceDecoder

    decoder = ReferenceDecoder(smollm2)
    messages = [
        {"role": "user", "content": "The vault code is 7319. " + "We talk. " * 30},
        {"role": "assistant", "content": "OK."},
    ]
    cache = compact(
        smollm2, messages, ratio=0.5, queries="context-prefill", on_policy=False
    )
    asked = [{"role": "user", "content": "What is the vault code?"}]
    spoken = "The vault code is 7319."
    got = agent_replay.answer_logprob(decoder, cache, asked, spoken, "7319")
    # by hand: the digits are the last four tokens before the full stop
    prompt = decoder.continuation_ids(asked)
    ids = smollm2.tokenizer("The vault code is 7319", add_special_tokens=False)[
        "input_ids"
    ]
    assert smollm2.tokenizer.decode(ids[-4:]) == "7319"
    logprobs = torch.log_softmax(decoder.logits(cache, prompt + ids), dim=-1)
    expected = sum(
        float(logprobs[len(prompt) + i - 1, ids[i]])
        for i in range(len(ids) - 4, len(ids))
    )
    assert got == pytest.approx(expected, abs=1e-5) and got < 0
    assert (
        agent_replay.answer_logprob(decoder, cache, asked, "I do not know.", "7319")
        is None
    )
