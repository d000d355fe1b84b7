"""OMP's correlation pass over 8-bit features: ``c[h, j] = sum_i Phi_t[h, j, i] r[h, i] / scale``.

OMP ranks keys by the correlation of their shifted features with the residual, once per round,
and that pass reads the whole ``[H, T, n]`` feature matrix: at the paper's setting (60,000 keys,
40,000 fitting queries, 8 heads) 38 GB in fp16 per round, which made it the largest part of
OMP's time on a GPU. The ranking only needs a few significant bits, so the CUDA path keeps the
features as ``float8_e4m3fn`` times a power-of-two ``scale`` (half the bytes of fp16), and this
kernel reads them with an fp32 residual and fp32 accumulation. cuBLAS has no GEMV for an fp8
matrix with an fp32 vector, and ``torch._scaled_mm`` would round the residual to fp8 too.

One program per block of keys and head streams its keys' rows (contiguous: the features are
key-major) against the head's residual, which stays in L2. ``import triton`` happens on first
call; ``feature_correlation_reference`` is the torch twin the tests compare against (and the
path off CUDA when Triton is not interpreting).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from vllm_compaction_kernels.runtime import interpreting

__all__ = ["feature_correlation", "feature_correlation_reference"]

_KERNEL: dict[bool, Any] = {}


def _build() -> Any:
    import triton
    import triton.language as tl

    interpret = interpreting(triton)
    if interpret in _KERNEL:
        return _KERNEL[interpret]
    # (keys per program, queries per step, warps): a tile is 8-16 KiB of features
    shapes = [(16, 512, 4), (32, 256, 4), (8, 1024, 4), (32, 512, 8), (64, 256, 8)]
    if interpret:  # the interpreter runs every program in Python
        shapes = [(16, 32, 1)]
    configs = [
        triton.Config({"BLOCK_T": bt, "BLOCK_N": bn}, num_warps=w)
        for bt, bn, w in shapes
    ]
    if os.environ.get("VLLM_COMPACTION_TUNE", "1") == "0":
        configs = configs[:1]  # the tests: correctness does not depend on the tiles

    @triton.autotune(configs=configs, key=["ITEM_BYTES"])
    @triton.jit
    def _correlation(
        feat_ptr,
        resid_ptr,
        out_ptr,
        t,
        n,
        inv_scale,
        ITEM_BYTES: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        head = tl.program_id(1).to(tl.int64)
        keys = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        key_ok = keys < t
        rows = feat_ptr + head * t * n + keys[:, None].to(tl.int64) * n
        acc = tl.zeros([BLOCK_T], tl.float32)
        for start in range(0, n, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < n
            phi = tl.load(
                rows + cols[None, :], mask=key_ok[:, None] & col_ok[None, :], other=0.0
            ).to(tl.float32)
            r = tl.load(resid_ptr + head * n + cols, mask=col_ok, other=0.0)
            acc += tl.sum(phi * r[None, :], 1)
        tl.store(out_ptr + head * t + keys, acc * inv_scale, mask=key_ok)

    _KERNEL[interpret] = _correlation
    return _correlation


def feature_correlation_reference(
    features: torch.Tensor, resid: torch.Tensor, scale: float = 1.0, chunk: int = 4096
) -> torch.Tensor:
    """``[H, T]`` fp32 ``features [H, T, n] @ resid [H, n] / scale``, a chunk of keys at a time
    (the float copy of a chunk is all that is ever widened)."""
    h, t, _ = features.shape
    out = torch.empty(h, t, dtype=torch.float32, device=features.device)
    for start in range(0, t, chunk):
        part = features[:, start : start + chunk].float()
        out[:, start : start + chunk] = torch.bmm(part, resid.float()[..., None])[
            ..., 0
        ]
    return out.div_(scale)


def feature_correlation(
    features: torch.Tensor, resid: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """``[H, T]`` fp32 correlations of key-major ``features [H, T, n]`` (any float dtype, holding
    ``Phi * scale``) with ``resid [H, n]``, accumulated in fp32."""
    if features.dim() != 3 or resid.shape != (features.shape[0], features.shape[2]):
        raise ValueError(
            f"need features [H, T, n] and resid [H, n], got {tuple(features.shape)} and "
            f"{tuple(resid.shape)}"
        )
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    import triton

    if features.device.type != "cuda" and not interpreting(triton):
        return feature_correlation_reference(features, resid, scale)
    h, t, n = features.shape
    features = features.contiguous()
    resid = resid.float().contiguous()
    out = torch.empty(h, t, dtype=torch.float32, device=features.device)
    if h and t:
        kernel = _build()
        kernel[lambda meta: ((t + meta["BLOCK_T"] - 1) // meta["BLOCK_T"], h)](
            features, resid, out, t, n, 1.0 / scale, ITEM_BYTES=features.element_size()
        )
    return out
