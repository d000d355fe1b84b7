"""``repeat-prefill`` (KVzip's probe): "{C} Repeat the previous context. {C}" under the chat
template; queries are recorded from the instruction through the repeated context."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_compaction.queries.base import PrefixSpec, QueryPlan

__all__ = ["RepeatPrefill", "REPEAT_INSTRUCTION"]

REPEAT_INSTRUCTION = "Repeat the previous context."


@dataclass
class RepeatPrefill:
    name: str = "repeat-prefill"
    instruction: str = REPEAT_INSTRUCTION

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        turn = adapter.turn_ids([{"role": "user", "content": self.instruction}])
        return QueryPlan(continuations=[turn + prefix.content_ids], record_from=[0])
