"""vLLM's CPU attention backend with a per-slot logit bias (see :mod:`.bias`).

When the compaction connector is configured, every decoder attention layer widens its KV pages
from ``d`` to ``augmented_head_size(d)`` coordinates; queries get ``1/scale`` in the bias
coordinates and the stock C++ kernels (``cpu_attn_reshape_and_cache``,
``cpu_attention_with_kv_cache``) do the rest, ISA packing included. Without the connector the
class behaves exactly like ``CPUAttentionBackend``.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_compaction.vllm.backend_common import AugmentedHeadSizes, compaction_enabled
from vllm_compaction.vllm.bias import augment_kv, augment_query, augmented_head_size

__all__ = ["CompactionCPUAttentionBackend", "CompactionCPUAttentionImpl", "cpu_augmented_head_size"]

_AUGMENTED = AugmentedHeadSizes("CPU_ATTN")


def cpu_augmented_head_size(head_size: int) -> int:
    """The widened page size of a head: the next size the CPU kernels support (64 -> 80)."""
    return augmented_head_size(head_size, CPUAttentionBackend.get_supported_head_sizes())


class CompactionCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type["CompactionCPUAttentionImpl"]:
        return CompactionCPUAttentionImpl

    @classmethod
    def customize_spec(cls, spec):
        return _AUGMENTED.widen_spec(super().customize_spec(spec))


class CompactionCPUAttentionImpl(CPUAttentionBackendImpl):
    """Pads q/k/v into the augmented head size around the stock kernels."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.augmented: int | None = None
        if self.attn_type == AttentionType.DECODER and compaction_enabled(get_current_vllm_config()):
            self.augmented = cpu_augmented_head_size(self.head_size)
            _AUGMENTED.record(self.head_size, self.augmented)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if self.augmented is None or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        n = attn_metadata.num_actual_tokens
        q = augment_query(query[:n].view(n, self.num_heads, self.head_size), self.augmented, self.scale)
        out = torch.empty_like(q)
        super().forward(layer, q, key, value, kv_cache, attn_metadata, out, output_scale, output_block_scale)
        output[:n].view(n, self.num_heads, self.head_size).copy_(out[..., : self.head_size])
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.augmented is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        key, value = augment_kv(key, value, self.augmented)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def write_slots(self, layer, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    keys: torch.Tensor, values: torch.Tensor, beta: torch.Tensor) -> None:
        """Write ``keys/values [N, H, d]`` with per-slot ``beta [N, H]`` at ``slot_mapping [N]``.

        Goes through the engine's own packing op, so the ISA-specific page layout is respected.
        """
        if self.augmented is None:
            raise RuntimeError("this attention layer was built without the compaction connector")
        dtype = kv_cache.dtype
        key_aug, value_aug = augment_kv(keys.to(dtype), values.to(dtype), self.augmented, beta)
        super().do_kv_cache_update(layer, key_aug, value_aug, kv_cache, slot_mapping)
