"""``surprise-cloze``: a fill-in-the-blank question for each name and number of the content.

A quote probe ('Continue the text above from "{lead}"') fetches a fact the way a copy does: the
tokens before it are repeated, and the heads that follow a repeat find what came next. A later
question fetches it another way: it names what the fact is about in other words ("What is my
sister's name?") and the answer's first token must be found from that alone. With the real
question among the probes, 12 of the 22 answers the default lost at 10% came back, where quote
probes on the same facts did not ("Would the question's own queries keep them?" in
docs/experiments). The model cannot write such questions at 135M, so this source builds one by
rule: the sentence holding the word, with the word blanked out, and the word (then the rest of
its sentence) teacher-forced as the answer::

    user:      Fill in the blank from the conversation above: "Oh, and my sister's name is ___."
    assistant: Bartholomew.

The words are those ``surprise-number-quote`` and ``surprise-name-quote`` look for (numbers and
codes, names inside a sentence), up to ``count`` of each: the numbers in order, the names the least
predictable first. ``/n`` sets the count as the quote sources do (one per ``tokens_per_span``
content tokens).

Not the default: at weight 1 beside the default's probes (10%, 12 instances per family) it kept
28 of the full context's 35 right answers against the default's 29, with compaction 49% longer
("Fill-in-the-blank questions as probes" in docs/experiments). A probe that asks for a fact's
own sentence does not do what the real question did; the source stays for measuring other forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_compaction.queries.base import PrefixSpec, QueryPlan
from vllm_compaction.queries.surprise_quote import (
    name_words,
    number_words,
    probe_count,
)
from vllm_compaction.text import token_pieces

__all__ = [
    "CLOZE_INSTRUCTION",
    "SentenceProbes",
    "SurpriseCloze",
    "sentence_bounds",
]

CLOZE_INSTRUCTION = 'Fill in the blank from the conversation above: "{sentence}"'
BLANK = "___"
#: a token ending with one of these ends a sentence (or a line: a tool output's row)
_SENTENCE_ENDS = (".", "!", "?", "\n")


@dataclass
class SentenceProbes:
    """What the sentence-level sources share: which words they probe, and how much of the
    sentence around each word they take."""

    name: str = ""
    spans: int | None = None
    tokens_per_span: int = 160
    #: most tokens of the sentence taken before the word, and after it
    lead: int = 12
    tail: int = 8

    def __post_init__(self) -> None:
        if min(self.lead, self.tail, self.tokens_per_span) < 1:
            raise ValueError(f"{self.name} needs lead, tail and tokens_per_span >= 1")
        if self.spans is not None and self.spans < 1:
            raise ValueError(f"{self.name} needs spans >= 1, got {self.spans}")

    def probed_words(
        self, adapter, prefix: PrefixSpec
    ) -> tuple[list[int], list[str], list[range]]:
        """The content's tokens, their text pieces and the words to probe (``fact_words``, up
        to one of each kind per ``tokens_per_span`` content tokens)."""
        content = prefix.content_ids
        count = probe_count(self.spans, self.tokens_per_span, len(content))
        pieces = token_pieces(adapter.tokenizer, content)
        return (
            content,
            pieces,
            fact_words(pieces, prefix.content_surprisal(adapter), count),
        )


@dataclass
class SurpriseCloze(SentenceProbes):
    name: str = "surprise-cloze"
    instruction: str = CLOZE_INSTRUCTION

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        content, pieces, words = self.probed_words(adapter, prefix)
        continuations = [self._probe(adapter, content, pieces, word) for word in words]
        return QueryPlan(
            continuations=continuations, record_from=[0] * len(continuations)
        )

    def _probe(
        self, adapter, content: list[int], pieces: list[str], word: range
    ) -> list[int]:
        """The user turn with ``word``'s sentence blanked, then the word and the rest of its
        sentence teacher-forced as the answer."""
        first, end = sentence_bounds(pieces, word, self.lead, self.tail)
        if first == word.start:
            # the word opens its sentence (a row of a tool output): the tokens before it say
            # where it stands
            first = max(0, word.start - self.lead)
        tokenizer = adapter.tokenizer
        # one line: a newline inside the quote would read as the end of the instruction
        sentence = " ".join(
            f"{tokenizer.decode(content[first : word.start])} {BLANK}"
            f"{tokenizer.decode(content[word.stop : end])}".split()
        )
        turn = adapter.turn_ids(
            [{"role": "user", "content": self.instruction.format(sentence=sentence)}]
        )
        return turn + content[word.start : end]


def fact_words(pieces: list[str], surprisal: torch.Tensor, count: int) -> list[range]:
    """The tokens of the words a question may ask for, in order: the first ``count`` numbers and
    codes (``number_words``) and the ``count`` least predictable names inside a sentence
    (``name_words``, ranked by their first token's ``surprisal [C]``)."""
    numbers = number_words(pieces)[:count]
    names = sorted(name_words(pieces), key=lambda word: -float(surprisal[word[0]]))
    return sorted({*numbers, *names[:count]}, key=lambda word: word.start)


def _ends_sentence(piece: str) -> bool:
    return piece.rstrip(" ").endswith(_SENTENCE_ENDS)


def sentence_bounds(
    pieces: list[str], word: range, lead: int, tail: int
) -> tuple[int, int]:
    """``(first, end)``: the token range of the sentence holding ``word``, at most ``lead``
    tokens before it and ``tail`` after it."""
    first = word.start
    while first > max(0, word.start - lead) and not _ends_sentence(pieces[first - 1]):
        first -= 1
    end = word.stop
    while end < min(len(pieces), word.stop + tail) and not _ends_sentence(
        pieces[end - 1]
    ):
        end += 1
    return first, end
