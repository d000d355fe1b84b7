"""Engine-side helpers: the model fingerprint of a running engine and the engine arguments that
turn compaction on."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from vllm_compaction.cache.format import ModelFingerprint
from vllm_compaction.models.fingerprint import checkpoint_fingerprint
from vllm_compaction.vllm.plugin import CONNECTOR_NAME

__all__ = [
    "engine_fingerprint",
    "kv_transfer_config",
    "engine_kwargs",
    "kv_bytes_per_token",
    "shutdown_engine",
]


@functools.lru_cache(maxsize=4)
def _fingerprint(model: str, dtype: str) -> ModelFingerprint:
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"compacted prefixes need the model as a local checkpoint folder (got {model!r}); "
            f"pass the folder, e.g. the one `vllm-compaction models prepare` prints"
        )
    return checkpoint_fingerprint(folder, dtype=dtype)


def engine_fingerprint(model_config) -> ModelFingerprint:
    """Fingerprint of the checkpoint a vLLM ``ModelConfig`` serves (caches are checked against it)."""
    return _fingerprint(
        str(model_config.model), str(model_config.dtype).removeprefix("torch.")
    )


def kv_transfer_config(
    store: str | Path | None = None,
    *,
    kv_snapshots: bool = False,
    pages: str | None = None,
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value that enables compacted prefixes.

    ``kv_snapshots`` lets requests ask for the K/V the engine computed (:mod:`.snapshot`); they
    write files under the store, so it is off unless asked for (never on a public server).
    ``pages`` is ``"stock"`` (the model's head size: plain requests run vLLM's kernel untouched,
    prefixes must be varlen) or ``"widened"`` (bias coordinates: padded prefixes too); default
    stock (:func:`.backend_common.page_width`).
    """
    from vllm_compaction.vllm.backend_common import check_page_width
    from vllm_compaction.vllm.prompt import default_store_dir

    extra: dict[str, Any] = {"store": str(store or default_store_dir())}
    if kv_snapshots:
        extra["kv_snapshots"] = True
    if pages is not None:
        extra["pages"] = check_page_width(pages)
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": "vllm_compaction.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def engine_kwargs(
    store: str | Path | None = None,
    *,
    kv_snapshots: bool = False,
    pages: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``EngineArgs`` with compaction enabled.

    Prefix caching stays on: it is what lets requests on the same cache share loaded pages. On
    CUDA the compaction backend is selected (``attention_backend="CUSTOM"``).
    """
    kwargs: dict[str, Any] = {
        "kv_transfer_config": kv_transfer_config(
            store, kv_snapshots=kv_snapshots, pages=pages
        ),
        "enable_prefix_caching": True,
    }
    if torch.cuda.is_available():
        kwargs["attention_backend"] = (
            "CUSTOM"  # the compacted-attention backend; the CPU platform has no choice
        )
    kwargs.update(overrides)
    return kwargs


def cpu_rank_binding(tensor_parallel_size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tensor_parallel_size`` CPU workers: this process's
    cores split evenly, one slice per rank (``"0|1"`` on two cores). vLLM 0.32 binds its CPU
    ranks to NUMA nodes on its own and refuses more ranks than nodes, so on a one-node machine
    tensor parallelism needs the cores named."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // tensor_parallel_size)
    return "|".join(
        ",".join(map(str, cores[r * share : (r + 1) * share] or cores[-1:]))
        for r in range(tensor_parallel_size)
    )


def kv_bytes_per_token(vllm_config) -> int:
    """KV cache bytes per token over all layers, as the engine allocates them (more with widened
    pages). For full-attention models with one head size."""
    from vllm_compaction.vllm.backend_common import page_width

    model = vllm_config.model_config
    head = model.get_head_size()
    # the same test the backends use to widen their pages
    if page_width(vllm_config) == "widened":
        from vllm.platforms import current_platform

        if current_platform.is_cuda():
            from vllm_compaction.vllm.cuda_backend import (
                triton_augmented_head_size as widen,
            )
        else:
            from vllm_compaction.vllm.cpu_backend import (
                cpu_augmented_head_size as widen,
            )
        head = widen(head)
    layers = model.get_num_layers(vllm_config.parallel_config)
    kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
    return (
        layers * kv_heads * 2 * head * torch.empty((), dtype=model.dtype).element_size()
    )


def shutdown_engine(llm: Any) -> None:
    """Stop an in-process ``vllm.LLM``'s engine-core process now (it would outlive its owner
    until the interpreter exits, holding its KV memory)."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
