"""Real vLLM engines (SmolLM2-135M-Instruct, CPU) and cache helpers for the serving tests."""

from __future__ import annotations

import gc
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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
    tensor_parallel_size: int = 1,
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
    if tensor_parallel_size == 1:
        return LLM(str(resolve(model)), dtype=dtype, **ENGINE_OPTIONS, **extra)
    from vllm_compaction.vllm.engine import cpu_rank_binding

    previous = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_rank_binding(tensor_parallel_size)
    try:
        return LLM(
            str(resolve(model)),
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="mp",
            **ENGINE_OPTIONS,
            **extra,
        )
    finally:
        if previous is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = previous


def start_llms(*specs: dict[str, Any]) -> list:
    """Start engines side by side (``start_llm``'s arguments, one dict each), in order.

    Most of a start is the engine's two processes importing vLLM and torch, one core each, so on
    two cores three engines start in about the time of two. Engines that set the process
    environment while they start (tensor parallelism's rank binding) cannot start beside others.
    If one fails, the others are stopped and its error raised.
    """
    if any(spec.get("tensor_parallel_size", 1) != 1 for spec in specs):
        raise ValueError(
            "tensor-parallel engines set the environment: start them alone"
        )
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start_llm, **spec) for spec in specs]
    engines, errors = [], []
    for future in futures:
        try:
            engines.append(future.result())
        except Exception as error:  # re-raised below, once the others are stopped
            errors.append(error)
    if errors:
        stop_llms(*engines)
        raise errors[0]
    return engines


def stop_llms(*engines) -> None:
    """Stop engines side by side (each waits seconds for its processes to exit)."""
    if engines:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(stop_llm, engines))


def random_llama_checkpoint(path, *, num_kv_heads: int = 2, seed: int = 0):
    """A small random-weight Llama (SmolLM2's tokenizer) saved where vLLM can load it: 4 query
    heads and ``num_kv_heads`` KV heads of 64, 2 layers; weights scaled up so that its next-token
    distributions are peaked, not near-uniform."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_compaction.models import resolve

    source = resolve("smollm2-135m")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        initializer_range=0.08,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    LlamaForCausalLM(config).float().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, path)
    return path


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
