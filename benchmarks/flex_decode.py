"""One decode step through PyTorch's FlexAttention with a per-key bias, beside SDPA (flash).

The ``flex`` section of ``benchmarks.gpu_check``, the other design for the compacted decode path:
FlexAttention with a ``score_mod`` that adds beta (as vLLM's FlexAttention backend could), at the
shapes of ``benchmarks.decode_speed`` (bf16, compiled):

* ``flex_dense``: over the same dense K/V as SDPA, every key with a bias, against SDPA's time;
* ``flex_10pct``: over a prefix compacted to 10% with the same uneven per-head lengths as
  ``decode_speed``'s ``prefix_10pct``, held densely, each KV head padded to the longest and
  masked past its own length by a block mask (so padding blocks are skipped), against SDPA over
  the whole uncompacted prefix. Dense padded rows are FlexAttention's best case: reading paged
  rows adds a table lookup per block on top.

Each row also gives the largest difference from a float32 reference. Timing is
``decode_speed.gpu_ms`` (CUDA graphs after an L2 flush). A shape that fails to compile or
capture records its error and the next one runs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from benchmarks.decode_speed import (
    _flash,
    _uneven_lengths,
    gpu_ms,
    host_us,
    run_shapes,
)

logger = logging.getLogger("benchmarks.flex_decode")


def _reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """float32 attention of ``query [R, Hq, 1, d]`` over ``keys/values [R, Hkv, N, d]`` with the
    bias ``beta [R, Hkv, N]`` and ``lengths [R, Hkv]`` keys per head."""
    group = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    logits = query.float() @ k.transpose(-1, -2) * query.shape[-1] ** -0.5
    logits = logits + beta.float().repeat_interleave(group, 1)[:, :, None, :]
    keep = torch.arange(keys.shape[2], device=keys.device) < lengths.repeat_interleave(
        group, 1
    ).unsqueeze(-1)
    logits = logits.masked_fill(~keep[:, :, None, :], float("-inf"))
    return torch.softmax(logits, -1) @ v


def _flex_call(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    lengths: torch.Tensor | None,
):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    group = query.shape[1] // keys.shape[1]

    def add_beta(score, b, h, q_idx, kv_idx):
        return score + beta[b, h // group, kv_idx].float()

    block_mask = None
    if lengths is not None:

        def within(b, h, q_idx, kv_idx):
            return kv_idx < lengths[b, h // group]

        block_mask = create_block_mask(
            within,
            query.shape[0],
            query.shape[1],
            query.shape[2],
            keys.shape[2],
            device=query.device,
        )
    compiled = torch.compile(flex_attention, dynamic=False)

    def call() -> torch.Tensor:
        return compiled(
            query,
            keys,
            values,
            score_mod=add_beta,
            block_mask=block_mask,
            enable_gqa=True,
        )

    return call


def _shape_row(shape: tuple, smoke: bool, device: torch.device) -> dict:
    import torch.nn.functional as F

    reqs, tokens, num_q, num_kv, dim = shape
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(tokens)
    row: dict[str, Any] = dict(
        zip(("requests", "tokens", "q_heads", "kv_heads", "d"), shape)
    )
    query = torch.randn(reqs, num_q, 1, dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(
        reqs, num_kv, tokens, dim, device=device, dtype=dtype, generator=gen
    )
    v = torch.randn_like(k)

    def sdpa() -> torch.Tensor:
        with _flash():
            return F.scaled_dot_product_attention(query, k, v, enable_gqa=True)

    row["sdpa_ms"] = sdpa_ms = gpu_ms(sdpa, device)
    kv_bytes = 2 * reqs * tokens * num_kv * dim * 2
    row["sdpa_GBps"] = kv_bytes / sdpa_ms / 1e6

    full = torch.full((reqs, num_kv), tokens, device=device)
    beta = torch.randn(reqs, num_kv, tokens, device=device, generator=gen) * 0.5
    _measure("flex_dense", (query, k, v, beta, full), kv_bytes, sdpa_ms, device, row)
    row["flex_dense_vs_sdpa"] = row.pop("flex_dense_speedup")

    lengths = torch.stack([t[1] for t in _uneven_lengths(reqs, 2, num_kv, tokens, 0.1)])
    lengths = lengths.to(device)
    longest = -(-int(lengths.max()) // 128) * 128  # whole blocks of the block mask
    k10 = torch.randn(
        reqs, num_kv, longest, dim, device=device, dtype=dtype, generator=gen
    )
    v10 = torch.randn_like(k10)
    beta10 = torch.randn(reqs, num_kv, longest, device=device, generator=gen) * 0.5
    rows_bytes = 2 * int(lengths.sum()) * dim * 2
    _measure(
        "flex_10pct",
        (query, k10, v10, beta10, lengths),
        rows_bytes,
        sdpa_ms,
        device,
        row,
    )
    row["flex_10pct_speedup_vs_sdpa_full"] = row.pop("flex_10pct_speedup")
    return row


def _measure(
    label: str,
    inputs: tuple,
    kv_bytes: int,
    sdpa_ms: float,
    device: torch.device,
    row: dict,
) -> None:
    """FlexAttention over ``inputs`` (query, keys, values, beta, lengths): its largest difference
    from the float32 reference, GPU and host time, bandwidth and speedup over ``sdpa_ms``."""
    query, keys, values, beta, lengths = inputs
    full = bool((lengths == keys.shape[2]).all())
    call = _flex_call(query, keys, values, beta, None if full else lengths)
    row[f"{label}_max_abs_diff"] = float(
        (call().float() - _reference(*inputs)).abs().max()
    )
    row[f"{label}_ms"] = ms = gpu_ms(call, device)
    row[f"{label}_host_us"] = host_us(call, device)
    row[f"{label}_GBps"] = kv_bytes / ms / 1e6
    row[f"{label}_speedup"] = sdpa_ms / ms


def flex_section(
    smoke: bool, device: torch.device, deadline: float | None = None
) -> dict:
    """Every shape's row (module doc) until ``deadline`` (a ``time.time()``) has passed."""
    import torch._dynamo

    # one compile per shape and variant: more than dynamo's default recompile limit
    torch._dynamo.config.cache_size_limit = max(
        64, torch._dynamo.config.cache_size_limit
    )
    return {
        "dtype": "bfloat16",
        "timing": "GPU ms from CUDA graphs after an L2 flush; host us per eager launch",
        "shapes": run_shapes("flex", _shape_row, smoke, device, deadline, catch=True),
    }
