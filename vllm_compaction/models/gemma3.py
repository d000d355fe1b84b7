"""Gemma-3 adapter: sliding-window layers keep their exact KV; only global layers compact.

Gemma-3 uses separate RoPE bases for local and global layers (both standard RoPE, so a
constant rotation re-bases either) and scales queries by ``query_pre_attn_scalar``; the
runtime reads each module's own ``scaling`` and ``sliding_window``.
"""

from __future__ import annotations

from vllm_compaction.models.base import ModelAdapter

__all__ = ["Gemma3Adapter"]


class Gemma3Adapter(ModelAdapter):
    architectures = ("Gemma3ForCausalLM",)
