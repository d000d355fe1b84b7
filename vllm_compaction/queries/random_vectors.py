"""``random-vectors``: i.i.d. N(0, I) queries scaled to each KV head's mean query norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm_compaction.queries.base import PrefixSpec, QueryPlan

__all__ = ["RandomVectors"]


@dataclass
class RandomVectors:
    name: str = "random-vectors"
    runs_probes: ClassVar[bool] = (
        False  # its queries need no run, so they take no weight
    )
    count: int = 4096

    def __post_init__(self) -> None:
        if self.count <= 0:
            raise ValueError(f"random-vectors needs a positive count, got {self.count}")

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        return QueryPlan(random_vectors=self.count)
