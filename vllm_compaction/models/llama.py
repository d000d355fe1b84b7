"""Llama family adapter: Llama, SmolLM2, Mistral, Qwen2 and Qwen3 (q/k norm is applied by the
stock modules before RoPE, so the runtime sees final keys; no special case is needed)."""

from __future__ import annotations

from vllm_compaction.models.base import ModelAdapter

__all__ = ["LlamaAdapter"]


class LlamaAdapter(ModelAdapter):
    architectures = (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    )
