"""``surprise-quote``: answer-mode quote probes (as ``quote-prefill``) on the most surprising
spans of the content only.

The model's own surprisal (per-token negative log-likelihood, from the prefill's final hidden
states, so it costs only the vocabulary projection) marks what it could not predict from its
prior: numbers, names, facts stated once. Those are what a later question asks for and what a
repeat cannot teach every head to keep: a head that copies the digits of a number while
answering may idle while the context is repeated (see ``quote_prefill``). Each of the
``spans`` highest-surprisal windows of ``span`` tokens (summed nats, non-overlapping) gets one
probe: 'Continue the text above from "{lead}"', then the next ``window`` content tokens
teacher-forced, starting ``margin`` tokens before the span.

``spans`` defaults to one per ``tokens_per_span`` content tokens, so the probes add about a
third of the content's length whatever the context length; ``surprise-quote/80`` in a query
spec sets ``tokens_per_span`` ("Denser probes" in docs/experiments), ``surprise-quote/auto`` sets it from the
compaction ratio (``queries.auto_spacing``, "Probe spacing tied to the budget"). Measured on SmolLM2-135M
(2,000-token needles, "Quote probes on the most surprising spans"). Beside a repeat,
its rows are about a quarter of the fits' rows; ``repeat-prefill+surprise-quote*4`` counts
them 4 times ("Weighting the probes in the fits"; all in docs/experiments).

``surprise-number-quote`` adds one more probe at the start of each number no span's probe
covers (a word of letters, digits, ``-``, ``.``, ``:`` and ``_`` with at least two digits: a
line number, a time, an account number), at most as many as the spans. Summed surprisal ranks a
number in a predictable line low (a failing test's line number in a tool output sat 300th-600th
of the windows), yet a later question asks for exactly it ("A probe for each number the spans
miss" in docs/experiments). With it (``repeat-prefill+surprise-number-quote/auto*4``) the
conversation families keep 85% of the full context's answers at 10% and 76% at 5%, against 82%
and 54% without the number probes (benchmarks/README.md).

``surprise-entity-quote`` adds, after those, one probe at the start of each name inside a sentence
(capitalised words after a lower-case word or a comma: "my sister's name is Thaddeus", "I moved
to Ljubljana") that no earlier probe covers, at most as many as the spans, the least predictable
first (surprisal of the name's first token). A name said once in a long turn sums to less than an
essay's dense windows and went unprobed in every chat fact lost at 5%; the model guesses a
common name in its place. Not the default: at 5% it keeps three more chat facts and loses six
numbers ("A probe for each name the spans miss" in docs/experiments).

``surprise-name-quote`` runs only those name probes (the spans and numbers it skips are the ones
``surprise-number-quote`` with the same spacing probes), so that a spec can count them apart:
the default's ``repeat-prefill+surprise-number-quote/auto*4+surprise-name-quote/auto`` weighs the
names once and the spans and numbers four times, 87% of the full context's answers at 10% and
83% at 5%; at weight 4 the name probes cost numbers ("Name probes at weight 1" in
docs/experiments).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_compaction.queries.base import PrefixSpec, QueryPlan
from vllm_compaction.queries.quote_prefill import QUOTE_INSTRUCTION, quote_probe
from vllm_compaction.text import name_words, number_words, token_pieces

__all__ = [
    "SurpriseEntityQuote",
    "SurpriseNameQuote",
    "SurpriseNumberQuote",
    "SurpriseQuote",
    "name_starts",
    "name_words",
    "number_starts",
    "probe_count",
    "number_words",
    "surprising_spans",
]


def number_starts(pieces: Sequence[str]) -> list[int]:
    """Index of the token where each number-like word begins, in order (``number_words``)."""
    return [word.start for word in number_words(pieces)]


def name_starts(pieces: Sequence[str]) -> list[int]:
    """Index of the token where each name inside a sentence begins, in order (``name_words``)."""
    return [word.start for word in name_words(pieces)]


def probe_count(spans: int | None, tokens_per_span: int, content_tokens: int) -> int:
    """How many probes a surprise source plans: ``spans`` when set, else one per
    ``tokens_per_span`` content tokens (the ``/n`` of a query spec), at least one."""
    return spans or max(1, round(content_tokens / tokens_per_span))


def surprising_spans(surprisal: torch.Tensor, span: int, count: int) -> list[int]:
    """Start offsets (ascending) of up to ``count`` non-overlapping windows of ``span`` tokens
    with the highest summed ``surprisal [n]``, chosen greedily from the highest."""
    n = surprisal.numel()
    span = max(1, min(span, n))
    sums = surprisal.float().unfold(0, span, 1).sum(-1)  # [n - span + 1]
    taken = torch.zeros(n, dtype=torch.bool, device=surprisal.device)
    starts: list[int] = []
    for start in torch.argsort(sums, descending=True, stable=True).tolist():
        if len(starts) >= count:
            break
        if not taken[start : start + span].any():
            taken[start : start + span] = True
            starts.append(start)
    return sorted(starts)


@dataclass
class SurpriseQuote:
    name: str = "surprise-quote"
    spans: int | None = None
    tokens_per_span: int = 160
    span: int = 16
    window: int = 32
    lead: int = 8
    margin: int = 4
    instruction: str = QUOTE_INSTRUCTION
    #: also probe each number the spans' probes miss (``surprise-number-quote``)
    numbers: bool = False
    #: also probe each name inside a sentence the other probes miss (``surprise-entity-quote``)
    names: bool = False
    #: run only the name probes; the others only mark what is covered (``surprise-name-quote``)
    only_names: bool = False

    def __post_init__(self) -> None:
        if (
            min(self.span, self.window, self.lead, self.tokens_per_span) < 1
            or self.margin < 0
        ):
            raise ValueError(
                "surprise-quote needs span, window, lead, tokens_per_span >= 1 and margin >= 0"
            )
        if self.spans is not None and self.spans < 1:
            raise ValueError(f"surprise-quote needs spans >= 1, got {self.spans}")
        if self.only_names and not self.names:
            # the flag picks among the name probes: without them it would quietly mean nothing
            raise ValueError("surprise-quote needs names=True for only_names=True")

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        content = prefix.content_ids
        # span picking is host bookkeeping, as the prefix's mask
        surprisal = prefix.content_surprisal(adapter)
        count = probe_count(self.spans, self.tokens_per_span, len(content))
        # at least one token of lead to quote, even for a span at the very start
        starts = [
            max(start - self.margin, 1)
            for start in surprising_spans(surprisal, self.span, count)
        ]
        if self.numbers or self.names:
            pieces = token_pieces(adapter.tokenizer, content)
        if self.numbers:
            # the first ones: a number's surprisal says little (a line number is predictable)
            numbers = self._unquoted(number_starts(pieces), starts)[:count]
            starts += [max(at - self.margin, 1) for at in numbers]
        if self.names:
            names = self._unquoted(name_starts(pieces), starts)
            # the least predictable ones: the model can guess a famous name, not a user's sister's
            names.sort(key=lambda at: -float(surprisal[at]))
            name_probes = sorted(max(at - self.margin, 1) for at in names[:count])
            starts = name_probes if self.only_names else starts + name_probes
        continuations = [
            quote_probe(
                adapter, content, start, self.lead, self.window, self.instruction
            )
            for start in starts
        ]
        return QueryPlan(
            continuations=continuations, record_from=[0] * len(continuations)
        )

    def _unquoted(self, word_starts: list[int], probe_starts: list[int]) -> list[int]:
        """The tokens of ``word_starts`` (in order) that no probe from ``probe_starts`` quotes."""
        quoted = torch.zeros(max(word_starts, default=0) + 1, dtype=torch.bool)
        for start in probe_starts:
            quoted[start : start + self.window] = True
        return [at for at in word_starts if not quoted[at]]


@dataclass
class SurpriseNumberQuote(SurpriseQuote):
    """``surprise-quote`` plus a probe at each number its spans miss (module doc)."""

    name: str = "surprise-number-quote"
    numbers: bool = True


@dataclass
class SurpriseEntityQuote(SurpriseQuote):
    """``surprise-number-quote`` plus a probe at each name inside a sentence the others miss
    (module doc)."""

    name: str = "surprise-entity-quote"
    numbers: bool = True
    names: bool = True


@dataclass
class SurpriseNameQuote(SurpriseQuote):
    """Only ``surprise-entity-quote``'s name probes: each name inside a sentence that the spans'
    and numbers' probes of ``surprise-number-quote`` miss (module doc)."""

    name: str = "surprise-name-quote"
    numbers: bool = True
    names: bool = True
    only_names: bool = True
