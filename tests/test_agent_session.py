"""The agent-session benchmark's seeded sessions: their facts, their seeds, the pooled plot."""

from __future__ import annotations

import argparse
import re

import pytest

from benchmarks import agent_session


def test_a_seed_draws_its_own_values_into_the_same_sentences_and_questions():
    fixed = agent_session.FACTS + agent_session.IDENTIFIER_FACTS
    drawn = agent_session.seeded_facts(3, identifiers=True)
    assert drawn == agent_session.seeded_facts(3, identifiers=True)
    assert [v for _, _, v in drawn] != [
        v for _, _, v in agent_session.seeded_facts(4, identifiers=True)
    ]
    assert [q for _, q, _ in drawn] == [q for _, q, _ in fixed]
    for (statement, _, value), (template, _, old) in zip(drawn, fixed):
        assert statement == template.replace(old, value)
    code, codename, room, account, key = (v for _, _, v in drawn)
    assert re.fullmatch(r"[1-9]\d{3}", code) and re.fullmatch(r"[1-9]\d", room)
    assert codename in agent_session.CODENAMES
    assert re.fullmatch(r"[1-9]\d{11}", account)
    assert re.fullmatch(r"[A-Z2-9]{4}-[A-Z2-9]{4}-[A-Z2-9]{4}", key)
    assert len(agent_session.seeded_facts(3, identifiers=False)) == 3
    assert agent_session.seeded_facts(None, identifiers=True) == fixed


@pytest.mark.parametrize("text", ["1,x", "2,2", "-1", ""])
def test_bad_seeds_are_refused_with_a_sentence(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--seeds"):
        agent_session._seeds(text)


def test_sessions_pool_into_one_retention_per_round(tmp_path):
    def turn(round_, compacted, full):
        return {
            "round": round_,
            "turn": 0,
            "probes": [
                {"compacted": c, "full": f}
                for c, f in zip(compacted, full, strict=True)
            ],
        }

    one = [turn(0, [1, 1], [1, 1]), turn(1, [0, 1], [1, 1])]
    two = [turn(1, [1, 0], [1, 0]), turn(2, [0, 0], [1, 0])]
    pooled = agent_session._by_round(one + two)
    assert pooled["1"] == {
        "turns": 2,
        "compacted": "2/4",
        "full": "3/4",
        "retention": 2 / 3,
    }
    assert agent_session._retention(one + two) == 4 / 6
    result = {
        "target_tokens": 192,
        "method": "am",
        "sessions": [{"turns": one}, {"turns": two}],
        "by_round": pooled,
        "retention": 4 / 6,
    }
    agent_session._plot(result, tmp_path / "pooled.png")
    assert (tmp_path / "pooled.png").stat().st_size > 0
