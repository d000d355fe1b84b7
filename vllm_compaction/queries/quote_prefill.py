"""``quote-prefill``: every window of the context, fetched back in answer mode.

The content is cut into windows of ``window`` tokens. For each window a user turn asks
'Continue the text above from "{lead}"', where the lead is the window's first ``lead`` tokens,
and the assistant turn is the next ``window`` tokens of the content, teacher-forced (so it ends
where the next probe's lead begins: every content token after the first lead is answered once).
Queries are recorded over the whole probe, as repeat-prefill records its instruction too.

Why beside repeat-prefill: in one long repeat, most tokens are predictable from the repeat's
own recent tokens, so heads that fetch a fact from far back when a question is answered may
stay idle. A short quote after an instruction must be fetched from the context, the way an
answer is. Measured on SmolLM2-135M (2,000-token needle, seed 8): layer 8, KV head 0 puts
0.8-0.99 of its attention on the needle's digits while answering the needle question and while
quoting the needle's sentence, and at most 0.16 while repeating the context; with
repeat-prefill queries alone those digits rank 78th-668th in that head, are dropped at 5%, and
the answer loses its last digit. Mixed with repeat-prefill it keeps them. It is no universal
fix: which heads idle during a repeat varies with the context (docs/experiments, "Reference queries
for needles").
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_compaction.queries.base import PrefixSpec, QueryPlan

__all__ = ["QuotePrefill", "QUOTE_INSTRUCTION", "quote_probe"]

QUOTE_INSTRUCTION = 'Continue the text above from "{lead}"'


def quote_probe(
    adapter,
    content: list[int],
    start: int,
    lead: int,
    window: int,
    instruction: str = QUOTE_INSTRUCTION,
) -> list[int]:
    """The user turn quoting ``content[start - lead:start]``, then ``content[start:start + window]``
    teacher-forced as the answer."""
    # one line: a newline inside the quote would read as the end of the instruction
    quote = " ".join(
        adapter.tokenizer.decode(content[max(0, start - lead) : start]).split()
    )
    turn = adapter.turn_ids(
        [{"role": "user", "content": instruction.format(lead=quote)}]
    )
    return turn + content[start : start + window]


@dataclass
class QuotePrefill:
    name: str = "quote-prefill"
    window: int = 32
    lead: int = 8
    instruction: str = QUOTE_INSTRUCTION

    def __post_init__(self) -> None:
        if self.window < 1 or self.lead < 1:
            raise ValueError(
                f"quote-prefill needs window >= 1 and lead >= 1, got {self.window} and {self.lead}"
            )

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        content = prefix.content_ids
        continuations = [
            quote_probe(
                adapter,
                content,
                start + self.lead,
                self.lead,
                self.window,
                self.instruction,
            )
            for start in range(0, max(1, len(content) - self.lead), self.window)
        ]
        return QueryPlan(
            continuations=continuations, record_from=[0] * len(continuations)
        )
