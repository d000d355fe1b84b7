"""``self-study`` (the paper's four prompts) and ``mock-question`` (SnapKV/PyramidKV made
question-agnostic): the model itself writes conversations about the prefix; their prefill and
decoding queries are recorded."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from vllm_compaction.queries.base import PrefixSpec, QueryPlan

__all__ = ["SelfStudy", "MockQuestion", "SELF_STUDY_PROMPTS"]

logger = logging.getLogger(__name__)

SELF_STUDY_PROMPTS = {
    "3-question": (
        "Write 3 questions that test understanding of different parts of the context. Answer with "
        "just the 3 questions and options (do not say the correct answer), each one separated with "
        "2 newlines."
    ),
    "summarize": "Summarize the main points of the context.",
    "structure_json": (
        "Structure the information in JSON form and include all important details like dates, "
        "times, names, and numerical values."
    ),
    "aggregate": "Aggregate all the key facts mentioned in the context.",
}


def _split_questions(text: str, limit: int) -> list[str]:
    parts = [
        p.strip() for p in re.split(r"\n\s*\n|\n(?=\s*\d+[.)])", text) if p.strip()
    ]
    return parts[:limit] or [text.strip() or SELF_STUDY_PROMPTS["summarize"]]


def _ask(
    adapter,
    prefix: PrefixSpec,
    question: str,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> tuple[list[int], list[int]]:
    """Turn ids of ``question`` and the model's sampled answer to it after the prefix."""
    turn = adapter.turn_ids([{"role": "user", "content": question}])
    answer, _ = adapter.generate(
        prefix.kv.exact_prefix(),
        prefix.length,
        turn,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
    )
    return turn, answer


@dataclass
class SelfStudy:
    name: str = "self-study"
    max_new_tokens: int = 96
    temperature: float = 0.7
    seed: int = 0

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        # Instance A writes conversation starters; instance B answers each one.
        turn, questions = _ask(
            adapter,
            prefix,
            SELF_STUDY_PROMPTS["3-question"],
            self.max_new_tokens,
            self.temperature,
            self.seed,
        )
        starters = _split_questions(
            adapter.tokenizer.decode(questions, skip_special_tokens=True), 3
        )
        starters += [
            SELF_STUDY_PROMPTS[k] for k in ("summarize", "structure_json", "aggregate")
        ]
        continuations = []
        for i, starter in enumerate(starters):
            turn, answer = _ask(
                adapter,
                prefix,
                starter,
                self.max_new_tokens,
                self.temperature,
                self.seed + 1 + i,
            )
            continuations.append(turn + answer)
        logger.info(
            "self-study: %d conversations, %d tokens",
            len(continuations),
            sum(map(len, continuations)),
        )
        return QueryPlan(
            continuations=continuations, record_from=[0] * len(continuations)
        )


@dataclass
class MockQuestion:
    name: str = "mock-question"
    max_new_tokens: int = 48
    seed: int = 0

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        _, questions = _ask(
            adapter,
            prefix,
            SELF_STUDY_PROMPTS["3-question"],
            self.max_new_tokens,
            0.0,
            self.seed,
        )
        question = _split_questions(
            adapter.tokenizer.decode(questions, skip_special_tokens=True), 1
        )[0]
        turn = adapter.turn_ids([{"role": "user", "content": question}])
        return QueryPlan(continuations=[turn], record_from=[0])
