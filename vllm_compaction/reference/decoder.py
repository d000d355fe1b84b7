"""Plain torch/transformers decoding from a ``CompactedCache``: the oracle for serving paths.

Compacted slots attend with their additive beta, exact slots with 0, and continuation tokens
take positions ``T, T+1, ...`` (the logical length), so with every key kept the logits equal
a plain full-context forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_compaction.cache import CompactedCache
from vllm_compaction.models import ModelAdapter, PrefixKV, PrefixLayer, load_adapter
from vllm_compaction.models.chat import Continuation

__all__ = ["ReferenceDecoder", "Generation", "prefix_layers", "Continuation"]


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    first_logits: torch.Tensor  # [vocab] float32 logits of the first generated token


def prefix_layers(cache: CompactedCache) -> list[PrefixLayer]:
    """Each layer's varlen heads padded to the layer's longest head (``-inf`` bias on padding)."""
    out = []
    for heads in cache.layers:
        keys, beta, values, indices = heads.padded()
        out.append(PrefixLayer(keys, values, beta, indices))
    return out


class ReferenceDecoder:
    """Generate or score continuations of a compacted (or full) prefix with a stock HF model."""

    def __init__(self, model: str | Path | ModelAdapter):
        self.adapter = model if isinstance(model, ModelAdapter) else load_adapter(model)

    def continuation_ids(self, continuation: Continuation) -> list[int]:
        """Chat messages -> their turn tokens with the generation prompt; text -> plain tokens."""
        return self.adapter.continuation_ids(continuation)

    def text(self, token_ids: Sequence[int]) -> str:
        """Generated tokens as the answer's text (special tokens dropped)."""
        return self.adapter.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _prefix(
        self, source: CompactedCache | PrefixKV
    ) -> tuple[list[PrefixLayer], int]:
        if isinstance(source, PrefixKV):
            return source.exact_prefix(), source.length
        source.model.check_compatible(self.adapter.fingerprint())
        return prefix_layers(source), source.logical_length

    def logits(
        self, source: CompactedCache | PrefixKV, continuation: Continuation
    ) -> torch.Tensor:
        """``[L, vocab]`` float32 logits at every continuation position."""
        ids = self.continuation_ids(continuation)
        prefix, length = self._prefix(source)
        positions = torch.arange(length, length + len(ids))
        logits = self.adapter.forward(
            ids, positions, prefix=prefix, logits_to_keep=len(ids)
        ).logits
        if logits is None:
            raise ValueError("the continuation is empty: there are no logits to score")
        return logits

    def generate(
        self,
        source: CompactedCache | PrefixKV,
        continuation: Continuation,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> Generation:
        ids = self.continuation_ids(continuation)
        prefix, length = self._prefix(source)
        new, first = self.adapter.generate(
            prefix,
            length,
            ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
        )
        return Generation(token_ids=new, text=self.text(new), first_logits=first)
