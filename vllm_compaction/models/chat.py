"""Conversations as token ids, from a tokenizer alone (no model weights).

Shared by the model adapters (offline compaction) and the serving path (prompts for vLLM), so
both render turns identically.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ChatTokenizer", "ChatTemplateError", "Continuation"]

Continuation = str | Sequence[int] | Sequence[dict]
"""What follows a prefix: text, token ids, or chat messages."""


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used the way compaction needs."""


class ChatTokenizer:
    """Chat rendering over an HF tokenizer; base models without a template get plain text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = False
    ) -> str:
        """The conversation as text: the chat template, or for base models without one,
        the contents separated by blank lines (a BOS is added when tokenizing)."""
        if self.has_chat_template:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        return "".join(f"{m['content']}\n\n" for m in messages)

    def chat_ids(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = False
    ) -> list[int]:
        if not self.has_chat_template:
            return self._tokenize(self.render(messages), special=True)
        ids = self.tokenizer.apply_chat_template(
            list(messages), tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def _tokenize(self, text: str, *, special: bool) -> list[int]:
        return [
            int(i)
            for i in self.tokenizer(text, add_special_tokens=special)["input_ids"]
        ]

    def encode(self, text: str) -> list[int]:
        """Plain text -> token ids, without special tokens."""
        return self._tokenize(text, special=False)

    def turn_ids(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``messages`` as they continue an existing conversation.

        Rendered after a fixed system turn and stripped of it, so no default system prompt or
        BOS is repeated mid-conversation.
        """
        check_messages(messages)
        if not self.has_chat_template:  # base model: plain text continuing the prefix
            return self.encode(self.render(messages))
        anchor = [{"role": "system", "content": "."}]
        base = self.chat_ids(anchor)
        full = self.chat_ids(
            anchor + list(messages), add_generation_prompt=add_generation_prompt
        )
        if full[: len(base)] != base:
            raise ChatTemplateError(
                "the chat template does not render turns incrementally"
            )
        return full[len(base) :]

    def continuation_ids(self, continuation: Continuation) -> list[int]:
        """What follows a prefix: text -> plain tokens; chat messages -> their turn tokens with
        the generation prompt; token ids -> themselves. ValueError for anything else."""
        if isinstance(continuation, str):
            return self.encode(continuation)
        items = list(continuation)
        messages = [m for m in items if isinstance(m, dict)]
        if items and len(messages) == len(items):
            return self.turn_ids(messages, add_generation_prompt=True)
        ids = [
            t
            for t in items
            if isinstance(t, int) and not isinstance(t, bool) and t >= 0
        ]
        if items and len(ids) == len(items):
            return [int(t) for t in ids]
        raise ValueError(
            "the continuation must be text, a non-empty list of token ids, or chat messages"
        )

    def chat_content(self, messages: Sequence[dict]) -> tuple[list[int], torch.Tensor]:
        """Token ids of a conversation and a ``[T]`` bool mask of its message-content tokens.

        Template tokens (role headers, separators, default system prompt) are False: they stay
        exact when the content is compacted.
        """
        check_messages(messages)
        text = self.render(messages)
        enc = self.tokenizer(
            text,
            add_special_tokens=not self.has_chat_template,
            return_offsets_mapping=True,
        )
        ids = [int(i) for i in enc["input_ids"]]
        if ids != self.chat_ids(messages):
            raise ChatTemplateError(
                "the tokenizer does not reproduce the chat template's tokens"
            )
        spans, cursor = [], 0
        for m in messages:
            start = text.find(m["content"], cursor)
            if start < 0:
                raise ChatTemplateError(
                    "a message's content is not verbatim in the chat template"
                )
            spans.append((start, start + len(m["content"])))
            cursor = start + len(m["content"])
        mask = torch.zeros(len(ids), dtype=torch.bool, device="cpu")
        for i, (a, b) in enumerate(enc["offset_mapping"]):
            mask[i] = b > a and any(a >= s and b <= e for s, e in spans)
        return ids, mask


def check_messages(messages: Sequence[dict]) -> None:
    """ValueError unless every message is a dict with a 'role' and a string 'content'."""
    if isinstance(messages, (str, bytes)) or not len(messages):
        raise ValueError(
            "messages must be a non-empty list of {'role', 'content'} dicts"
        )
    for m in messages:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("content"), str)
            or "role" not in m
        ):
            raise ValueError("each message needs a 'role' and a string 'content'")
