"""``context-prefill``: the queries of the prefix's own prefill (as H2O uses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm_compaction.queries.base import PrefixSpec, QueryPlan

__all__ = ["ContextPrefill"]


@dataclass
class ContextPrefill:
    name: str = "context-prefill"
    runs_probes: ClassVar[bool] = (
        False  # its queries need no run, so they take no weight
    )

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        return QueryPlan(prefix_queries=True)
