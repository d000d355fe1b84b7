"""Reference-query sources (one file each) and their registry."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_compaction.queries.base import PrefixSpec, QueryPlan, QuerySource
from vllm_compaction.queries.collect import DEFAULT_QUERY_CAP, QueryCollector
from vllm_compaction.queries.context_prefill import ContextPrefill
from vllm_compaction.queries.quote_prefill import QuotePrefill
from vllm_compaction.queries.random_vectors import RandomVectors
from vllm_compaction.queries.repeat_prefill import RepeatChat, RepeatPrefill
from vllm_compaction.queries.self_study import MockQuestion, SelfStudy
from vllm_compaction.queries.surprise_cloze import SurpriseCloze
from vllm_compaction.queries.surprise_quote import (
    SurpriseEntityQuote,
    SurpriseNameQuote,
    SurpriseNumberQuote,
    SurpriseQuote,
)
from vllm_compaction.queries.surprise_recap import SurpriseRecap

__all__ = [
    "DEFAULT_QUERY_CAP",
    "PrefixSpec",
    "QUERY_SOURCES",
    "QueryCollector",
    "QueryPlan",
    "QuerySource",
    "AUTO_SPACING",
    "Weighted",
    "auto_spacing",
    "parse_sources",
    "resolve_spacing",
    "split_source",
    "split_weight",
]

QUERY_SOURCES: dict[str, type] = {
    cls.name: cls
    for cls in (
        ContextPrefill,
        RepeatPrefill,
        RepeatChat,
        QuotePrefill,
        SurpriseQuote,
        SurpriseNumberQuote,
        SurpriseEntityQuote,
        SurpriseNameQuote,
        SurpriseCloze,
        SurpriseRecap,
        SelfStudy,
        MockQuestion,
        RandomVectors,
    )
}


MAX_SOURCE_WEIGHT = 16


def split_weight(part: str) -> tuple[str, int]:
    """``"surprise-quote*4"`` -> ``("surprise-quote", 4)``; no ``*`` means weight 1."""
    name, star, weight = part.strip().partition("*")
    if not star:
        return name.strip(), 1
    if not weight.strip().isdigit() or not 1 <= int(weight) <= MAX_SOURCE_WEIGHT:
        raise ValueError(
            f"a query source's weight is an integer from 1 to {MAX_SOURCE_WEIGHT} "
            f"after '*', got {part.strip()!r}"
        )
    return name.strip(), int(weight)


AUTO_SPACING = "auto"
#: Fewest content tokens per probe: a probe quotes a span of 16 tokens, and closer spacings would
#: ask for more probes than non-overlapping spans exist (each probe runs a continuation of its own).
MIN_SPACING = 16
"""``surprise-quote/auto``: the probes' spacing follows the compaction ratio (``auto_spacing``)."""

#: ``/auto`` spaces the probes so that each has about this many slots per head of the budget ...
PROBE_SLOTS = 4
#: ... within the two spacings measured on 48 needles (docs/experiments/2026-11-25-needle-probes.md, "Probe spacing tied to the budget").
AUTO_SPACING_RANGE = (80, 160)


def auto_spacing(ratio: float) -> int:
    """Content tokens per probe for ``/auto`` at ``ratio``: ``PROBE_SLOTS / ratio`` (a probe per
    as many tokens as hold about 4 slots per head), clamped to ``AUTO_SPACING_RANGE``: 80 at 5%
    and above, 133 at 3%, 160 at 2.5% and below. Dense probes won 10% and 5% on 48 needles and
    lost 2%, where 26 probes share about 40 slots per head."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    low, high = AUTO_SPACING_RANGE
    return min(high, max(low, round(PROBE_SLOTS / ratio)))


def split_source(part: str) -> tuple[str, int | str | None, int]:
    """``"surprise-quote/80*4"`` -> ``("surprise-quote", 80, 4)``: the name, the spacing (one probe
    per 80 content tokens, ``tokens_per_span``; ``AUTO_SPACING`` for ``/auto``, set by the ratio in
    ``resolve_spacing``; ``None`` without ``/``: the source's default) and the weight
    (``split_weight``)."""
    name, weight = split_weight(part)
    base, slash, per = name.partition("/")
    if not slash:
        return base.strip(), None, weight
    if per.strip() == AUTO_SPACING:
        return base.strip(), AUTO_SPACING, weight
    if not per.strip().isdigit() or int(per) < MIN_SPACING:
        raise ValueError(
            f"a query source's spacing is a whole number of content tokens >= {MIN_SPACING} or "
            f"'auto' after '/', got {part.strip()!r}"
        )
    return base.strip(), int(per), weight


def resolve_spacing(spec: str, ratio: float) -> str:
    """``spec`` with every ``/auto`` replaced by the spacing for ``ratio`` (``auto_spacing``):
    ``"repeat-prefill+surprise-quote/auto*4"`` -> ``"repeat-prefill+surprise-quote/80*4"`` at 0.1.
    A spec without ``/auto`` comes back unchanged; other parts are not checked here."""
    resolved = []
    for part in spec.split("+"):
        name, per, weight = split_source(part)
        if per == AUTO_SPACING:
            part = f"{name}/{auto_spacing(ratio)}" + (
                f"*{weight}" if weight > 1 else ""
            )
        resolved.append(part)
    return "+".join(resolved)


@dataclass(frozen=True)
class Weighted:
    """A source whose recorded queries each count ``weight`` times (``name*weight`` in a spec)."""

    source: QuerySource
    weight: int

    @property
    def name(self) -> str:
        return f"{self.source.name}*{self.weight}"

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        return self.source.plan(adapter, prefix).weighted(self.weight)


def parse_sources(spec: str) -> list[QuerySource]:
    """``"repeat-prefill+surprise-quote/80*4"`` -> source instances (a ``+`` joins a mixture; a
    ``/n`` spaces a span-probing source's probes one per n content tokens, ``/auto`` must be
    resolved for a ratio first, ``resolve_spacing``; a ``*k`` counts that source's queries k times
    in the fits)."""
    parts = [split_source(part) for part in spec.split("+") if part.strip()]
    if not parts:
        raise ValueError("empty query source; choose from " + ", ".join(QUERY_SOURCES))
    unknown = [n for n, _, _ in parts if n not in QUERY_SOURCES]
    if unknown:
        raise ValueError(
            f"unknown query source {unknown[0]!r}; choose from {', '.join(QUERY_SOURCES)}"
        )
    static = [
        n
        for n, _, w in parts
        if w > 1 and not getattr(QUERY_SOURCES[n], "runs_probes", True)
    ]
    if static:
        raise ValueError(
            f"a weight (*k) applies to sources that run probes, not to {static[0]!r}"
        )
    unspaced = [
        n
        for n, per, _ in parts
        if per is not None and not hasattr(QUERY_SOURCES[n], "tokens_per_span")
    ]
    if unspaced:
        raise ValueError(
            f"a spacing (/n) applies to sources that probe spans (surprise-quote), not to {unspaced[0]!r}"
        )
    if any(per == AUTO_SPACING for _, per, _ in parts):
        # compact() knows its ratio and resolves it; a prepared prefix is planned for one spacing
        raise ValueError(
            f"'/{AUTO_SPACING}' takes the spacing from the compaction ratio: compact() resolves it, "
            f"elsewhere call resolve_spacing(spec, ratio) first; got {spec!r}"
        )
    sources = [
        QUERY_SOURCES[n]() if per is None else QUERY_SOURCES[n](tokens_per_span=per)
        for n, per, _ in parts
    ]
    return [
        source if w == 1 else Weighted(source, w)
        for source, (_, _, w) in zip(sources, parts)
    ]
