"""One evaluation instance: what is compacted, the question after it, what answers score."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TaskInstance", "score_text"]


@dataclass(frozen=True)
class TaskInstance:
    task: str
    seed: int
    #: the compacted text (for a conversation, its messages' contents joined, for reading)
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    #: tokens the answers get (None: the caller's default); free-form answers need more than a number
    answer_tokens: int | None = None
    #: text before the context in the same user turn, never compacted (RULER's task instruction)
    instruction: str = ""
    #: a multi-turn history (chat messages) compacted as the server compacts one: every
    #: message's content, the template tokens exact; the question is a new user turn after it
    messages: tuple[dict, ...] = ()
    #: how the instance was built, reported beside its score (where the fact sits, ...)
    details: Mapping[str, Any] = field(default_factory=dict)
    #: score case-sensitively: identifiers must come back character for character
    exact: bool = False
    #: values beside the answer that the question rules out (near-duplicate keys, the other
    #: commit): an answer naming one scores 0, so listing every candidate is not a right answer
    distractors: tuple[str, ...] = ()

    @property
    def scored(self) -> bool:
        """Whether the task expects answers to score; a free-form task measures reconstruction only."""
        return bool(self.answers)

    def score(self, text: str) -> float | None:
        if not self.scored:
            return None
        if self.distractors and score_text(
            text, self.distractors, case_sensitive=self.exact
        ):
            return 0.0
        return score_text(text, self.answers, case_sensitive=self.exact)

    def answer_span(
        self, decode: Callable[[Sequence[int]], str], token_ids: Sequence[int]
    ) -> int | None:
        """How many of a generated answer's tokens it takes to give the answer: the fewest
        ``n`` after which every longer prefix of ``token_ids`` scores 1 (so a value is complete
        where its last token comes, not where a shorter prefix of it happens to be a whole
        word). None where the whole answer does not score 1 or the task scores nothing."""
        if not token_ids or self.score(decode(token_ids)) != 1:
            return None
        n = len(token_ids)
        while n > 1 and self.score(decode(token_ids[: n - 1])) == 1:
            n -= 1
        return n


def score_text(
    text: str, answers: tuple[str, ...], *, case_sensitive: bool = False
) -> float:
    """Fraction of ``answers`` that occur in ``text`` as whole words (case-insensitive unless
    ``case_sensitive``); a prefix of an answer ("48553" for "485538") does not count."""
    flags = 0 if case_sensitive else re.IGNORECASE
    found = sum(
        re.search(rf"(?<![\w-]){re.escape(a)}(?![\w-])", text, flags) is not None
        for a in answers
    )
    return found / len(answers)
