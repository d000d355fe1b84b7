"""Reference-query sources (one file each) and their registry."""

from __future__ import annotations

from vllm_compaction.queries.base import PrefixSpec, QueryPlan, QuerySource
from vllm_compaction.queries.collect import DEFAULT_QUERY_CAP, QueryCollector
from vllm_compaction.queries.context_prefill import ContextPrefill
from vllm_compaction.queries.quote_prefill import QuotePrefill
from vllm_compaction.queries.random_vectors import RandomVectors
from vllm_compaction.queries.repeat_prefill import RepeatPrefill
from vllm_compaction.queries.self_study import MockQuestion, SelfStudy
from vllm_compaction.queries.surprise_quote import SurpriseQuote

__all__ = [
    "DEFAULT_QUERY_CAP",
    "PrefixSpec",
    "QUERY_SOURCES",
    "QueryCollector",
    "QueryPlan",
    "QuerySource",
    "parse_sources",
]

QUERY_SOURCES: dict[str, type] = {
    cls.name: cls for cls in (ContextPrefill, RepeatPrefill, QuotePrefill, SurpriseQuote, SelfStudy, MockQuestion,
                          RandomVectors)
}


def parse_sources(spec: str) -> list[QuerySource]:
    """``"self-study+repeat-prefill"`` -> source instances (a ``+`` joins a mixture)."""
    names = [part.strip() for part in spec.split("+") if part.strip()]
    if not names:
        raise ValueError("empty query source; choose from " + ", ".join(QUERY_SOURCES))
    unknown = [n for n in names if n not in QUERY_SOURCES]
    if unknown:
        raise ValueError(f"unknown query source {unknown[0]!r}; choose from {', '.join(QUERY_SOURCES)}")
    return [QUERY_SOURCES[n]() for n in names]
