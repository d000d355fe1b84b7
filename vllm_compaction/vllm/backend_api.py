"""The door between the compaction connector and the attention backends.

The connector writes compacted prefixes into the engine's KV pages, and only the attention
layer knows how its pages are laid out (widened or stock width, the CPU's ISA packing, the
Triton ``[B, H, N, 2 * A]`` split). :class:`CompactionAttentionImpl` is everything the connector
may ask of a layer's ``impl``; both compaction backends implement it
(:class:`.backend_common.CompactionImplMixin`), and :func:`compaction_impl` turns any other
backend into one sentence that names it, instead of an ``AttributeError`` deep in a load.

No vLLM import: the connector, the backends and tests all import this module.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from vllm_compaction.cache import CacheError

__all__ = ["CompactionAttentionImpl", "compaction_impl"]


@runtime_checkable
class CompactionAttentionImpl(Protocol):
    """An attention impl that can hold compacted prefixes in its KV pages."""

    compaction: bool
    """Whether this layer was built by an engine with the compaction connector (and holds a KV cache)."""

    augmented: int | None
    """The widened page size (bias coordinates, :mod:`.bias`), ``None`` for stock-width pages."""

    @property
    def holds_bias(self) -> bool:
        """Whether the pages carry a per-slot bias (widened); stock-width pages hold beta = 0 only."""
        ...

    def write_slots(
        self,
        layer: Any,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        beta: torch.Tensor,
    ) -> None:
        """Write ``keys/values [N, Hkv, d]`` with per-slot ``beta [N, Hkv]`` at ``slot_mapping [N]``,
        through the engine's own KV write op (so its page layout is respected)."""
        ...

    @staticmethod
    def prefix_page_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value views ``[blocks, Hkv, block_size, D]`` of one layer's pages, where
        :class:`.paged_prefix.PagedPrefixPages` reads and writes packed prefix rows."""
        ...


def compaction_impl(impl: Any, needed_for: str) -> CompactionAttentionImpl:
    """``impl`` if it implements :class:`CompactionAttentionImpl`, else a ``CacheError`` saying
    which backend the engine runs and what it cannot do (``needed_for``, one clause)."""
    if not isinstance(impl, CompactionAttentionImpl):
        raise CacheError(
            f"the engine's attention backend ({type(impl).__name__}) {needed_for}"
        )
    return impl
