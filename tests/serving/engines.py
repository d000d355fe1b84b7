"""Real vLLM engines (SmolLM2-135M-Instruct, CPU) and cache helpers for the serving tests."""

from __future__ import annotations

import gc
import os

from vllm_compaction.cache import CompactedCache

ENGINE_OPTIONS = dict(
    enforce_eager=True,
    kv_cache_memory_bytes=1 << 30,
    max_model_len=4096,
    max_num_seqs=16,
    seed=0,
)


def start_llm(
    dtype: str,
    *,
    store=None,
    compaction: bool = True,
    kv_snapshots: bool = False,
    pages: str | None = None,
    model: str = "smollm2-135m",
):
    from vllm import LLM

    from vllm_compaction.models import resolve

    # vLLM's CPU executor reserves one core more whenever any KV connector is configured (meant for
    # NIXL): plugin and stock engines would then run different thread counts, whose fp32 sums
    # round differently. One reservation for all makes "the same computation" comparable.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm_compaction.vllm import engine_kwargs

    extra = (
        engine_kwargs(store=store, kv_snapshots=kv_snapshots, pages=pages)
        if compaction
        else {"enable_prefix_caching": True}
    )
    return LLM(str(resolve(model)), dtype=dtype, **ENGINE_OPTIONS, **extra)


def stop_llm(llm) -> None:
    from vllm_compaction.vllm.engine import shutdown_engine

    shutdown_engine(llm)
    del llm
    gc.collect()


def exact_cache(adapter, token_ids) -> CompactedCache:
    """A cache that keeps every key with beta = 0: serving it must equal the full prompt."""
    prefix = adapter.prefill(token_ids, capture_queries=False)
    return CompactedCache.identity(
        prefix.keys, prefix.values, token_ids, adapter.fingerprint()
    )
