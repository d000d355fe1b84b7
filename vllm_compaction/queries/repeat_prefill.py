"""``repeat-prefill`` (KVzip's probe): "{C} Repeat the previous context. {C}" under the chat
template; queries are recorded from the instruction through the repeated context.

``repeat-chat`` repeats the conversation as it stands, its role headers and separators between
the messages included (from the first message's content to the last one's), as kvpress's KVzip
repeats its context: ``repeat-prefill`` joins the messages' contents with nothing between them,
so a turn's first words follow the previous turn's last ones, a text the model never saw."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_compaction.queries.base import PrefixSpec, QueryPlan

__all__ = ["RepeatChat", "RepeatPrefill", "REPEAT_INSTRUCTION"]

REPEAT_INSTRUCTION = "Repeat the previous context."


@dataclass
class RepeatPrefill:
    name: str = "repeat-prefill"
    instruction: str = REPEAT_INSTRUCTION
    #: repeat the template tokens between the first and last content tokens too
    with_template: bool = False

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        turn = adapter.turn_ids([{"role": "user", "content": self.instruction}])
        if self.with_template and prefix.compact_mask.any():
            content = prefix.compact_mask.nonzero().flatten()
            repeated = prefix.token_ids[int(content[0]) : int(content[-1]) + 1].tolist()
        else:
            repeated = prefix.content_ids
        return QueryPlan(continuations=[turn + repeated], record_from=[0])


@dataclass
class RepeatChat(RepeatPrefill):
    """``repeat-prefill`` with the messages' template tokens repeated too (module doc)."""

    name: str = "repeat-chat"
    with_template: bool = True
