"""Real vLLM engines (SmolLM2-135M-Instruct, CPU) and cache helpers for the serving tests."""

from __future__ import annotations

import gc

import torch

from vllm_compaction.am.heads import CompactedHeads
from vllm_compaction.cache import CompactedCache

ENGINE_OPTIONS = dict(enforce_eager=True, kv_cache_memory_bytes=1 << 30, max_model_len=4096,
                      max_num_seqs=16, seed=0)


def start_llm(dtype: str, *, store=None, compaction: bool = True, kv_snapshots: bool = False):
    from vllm import LLM

    from vllm_compaction.models import resolve
    from vllm_compaction.vllm import engine_kwargs

    extra = engine_kwargs(store=store, kv_snapshots=kv_snapshots) if compaction else {"enable_prefix_caching": True}
    return LLM(str(resolve("smollm2-135m")), dtype=dtype, **ENGINE_OPTIONS, **extra)


def stop_llm(llm) -> None:
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def exact_cache(adapter, token_ids) -> CompactedCache:
    """A cache that keeps every key with beta = 0: serving it must equal the full prompt."""
    prefix = adapter.prefill(token_ids, capture_queries=False)
    positions = torch.arange(len(token_ids))
    layers = [CompactedHeads.exact(prefix.keys[l], prefix.values[l], positions) for l in range(adapter.num_layers)]
    return CompactedCache(layers=layers, logical_length=len(token_ids), token_ids=list(token_ids),
                          compacted_span=(0, len(token_ids)), layer_compacted=[False] * adapter.num_layers,
                          model=adapter.fingerprint(), method="none", ratio=1.0)
