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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_compaction.queries.base import PrefixSpec, QueryPlan
from vllm_compaction.queries.quote_prefill import QUOTE_INSTRUCTION, quote_probe

__all__ = ["SurpriseQuote", "surprising_spans"]


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

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        content = prefix.content_ids
        # the prefill's, when kept
        hidden = prefix.kv.last_hidden if prefix.kv is not None else None
        # span picking is host bookkeeping, as the prefix's mask
        surprisal = adapter.token_surprisal(prefix.token_ids, hidden=hidden).cpu()[
            prefix.compact_mask
        ]
        count = self.spans or max(1, round(len(content) / self.tokens_per_span))
        continuations = [
            # at least one token of lead to quote, even for a span at the very start
            quote_probe(
                adapter,
                content,
                max(start - self.margin, 1),
                self.lead,
                self.window,
                self.instruction,
            )
            for start in surprising_spans(surprisal, self.span, count)
        ]
        return QueryPlan(
            continuations=continuations, record_from=[0] * len(continuations)
        )
