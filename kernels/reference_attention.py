"""The reference pass of Attention Matching as two fused Triton kernels (the CUDA path).

Compaction starts with the original attention of ``n`` reference queries over ``T`` keys per KV
head: each query's max logit ``s`` and shifted mass ``sum_j exp(l_j - s)``, its output, and per
key an aggregate of its attention weights over the queries (or the whole shifted-feature matrix,
for OMP). In torch that is a chain of GEMMs and element-wise passes over ``[n, T]`` logits, whose
memory traffic dominates on a GPU. Here:

1. ``_forward`` (one program per block of queries and head): flash-attention style, keys and
   values streamed through an online softmax; writes the shift (log2 units), the shifted mass
   and the output. The ``[n, T]`` logits never leave the chip.
2. ``_scores`` (one program per block of keys and head): recomputes the logits of its keys
   against every query, turns them into attention weights with (1)'s shift and mass, and reduces
   them over the queries (``sum w a^2`` for rms, ``sum w a`` for mean, ``max w a`` for max and
   weighted-max); optionally stores the shifted features ``exp(l - s)`` key-major, times a
   scale, in the feature matrix's dtype (fp16, or fp8 for OMP on CUDA).

Logits use ``tl.dot`` with the given input precision on fp32 operands: ``"ieee"`` (exact fp32
products, slow on tensor-core GPUs), ``"tf32"`` (10-bit mantissas) or ``"tf32x3"`` (three tf32
products, about fp32 accuracy), or on fp16 operands (``"fp16"``: the same 10-bit mantissas as
tf32, twice the tensor-core rate and half the shared memory; inputs beyond ``FP16_INPUT_LIMIT``
fall back to tf32). Both kernels compute every logit with the same precision; sums are fp32.

``import triton`` happens on first call, so this module imports on machines without Triton.
Tests run it on the CPU with ``TRITON_INTERPRET=1`` against the torch pass.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from vllm_compaction_kernels.runtime import interpreting

__all__ = ["DOT_PRECISIONS", "ReferenceStats", "reference_attention_triton"]

DOT_PRECISIONS = ("ieee", "tf32", "tf32x3", "fp16")
#: Largest magnitude an input may have for ``"fp16"`` (fp16's largest finite is 65504); inputs
#: beyond it run with ``"tf32"`` instead.
FP16_INPUT_LIMIT = 3.0e4
AGGREGATION_CODES = {None: 0, "rms": 1, "mean": 2, "max": 3, "weighted-max": 3}
LOG2_E = 1.0 / math.log(2.0)
LN_2 = math.log(2.0)

_KERNELS: dict[bool, tuple[Any, Any]] = {}


@dataclass
class ReferenceStats:
    """What the two kernels return, as ``am.attention.ReferenceAttention`` needs it.

    Attributes:
        shift: ``[H, n]`` fp32 max logit per query (natural units).
        mass: ``[H, n]`` fp32 shifted mass.
        output: ``[H, n, d]`` fp32 outputs or ``None``.
        scores: ``[H, T]`` fp32 raw per-key reductions (sums, not yet divided or rooted), or ``None``.
        features: ``[H, T, n]`` key-major shifted features times ``feature_scale``, or ``None``.
        feature_scale: what the features were multiplied by before storing.
    """

    shift: torch.Tensor
    mass: torch.Tensor
    output: torch.Tensor | None
    scores: torch.Tensor | None
    features: torch.Tensor | None
    feature_scale: float = 1.0


#: Shared memory a configuration may need by ``_smem_estimate`` (Hopper has 227 KiB; the
#: estimate counts the fp32 tiles and undercounts Triton's scratch by ~30%, measured on an H100).
SMEM_BUDGET = 200 << 10
SMEM_SLACK = 1.3


def _configs(
    triton: Any, interpret: bool, pairs: list[tuple[int, int, int, int]]
) -> list[Any]:
    # one small configuration: the interpreter runs every program in Python
    if interpret:
        return [
            triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)
        ]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in pairs
    ]


def _smem_estimate(
    config: Any, d_pad: int, kernel: str, precision: str | None = None
) -> float:
    """Bytes of the tiles a configuration keeps in shared memory (fp32, or fp16 operands
    under ``"fp16"``), with slack."""
    m, n, stages = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_stages
    if kernel == "forward":  # the query tile stays; keys and values stream
        tiles = m * d_pad + stages * 2 * n * d_pad + m * n
    else:  # the key tile stays; queries stream
        tiles = n * d_pad + stages * m * d_pad + m * n
    return (2 if precision == "fp16" else 4) * tiles * SMEM_SLACK


def _pruner(kernel: str):
    """``early_config_prune`` for the autotuner: the configurations that fit the shared memory
    for this head size (the smallest one if none does), and only the first of them when
    ``VLLM_COMPACTION_TUNE=0`` (the tests set it: correctness does not depend on the tiles, and
    every candidate costs a compile)."""

    def prune(configs: list[Any], named_args: dict, **kwargs: Any) -> list[Any]:
        d_pad = kwargs.get("D_PAD", named_args.get("D_PAD"))
        precision = kwargs.get("PRECISION", named_args.get("PRECISION"))
        if d_pad is None:
            raise ValueError("the autotuner's pruner needs the kernel's D_PAD")

        def size(c: Any) -> float:
            return _smem_estimate(c, d_pad, kernel, precision)

        fits = [c for c in configs if size(c) <= SMEM_BUDGET]
        fits = fits or [min(configs, key=size)]
        return fits[:1] if os.environ.get("VLLM_COMPACTION_TUNE", "1") == "0" else fits

    return prune


def _build() -> tuple[Any, Any]:
    try:
        import triton
        import triton.language as tl
    except (
        ImportError
    ) as exc:  # pragma: no cover - the torch path is used without Triton
        raise RuntimeError(
            "the fused reference pass needs Triton; use the torch pass instead"
        ) from exc
    interpret = interpreting(triton)
    if interpret in _KERNELS:
        return _KERNELS[interpret]

    # (BLOCK_M, BLOCK_N, warps, stages), pruned per head size by the shared memory they need
    forward_configs = _configs(
        triton,
        interpret,
        [
            (64, 64, 4, 2),
            (64, 32, 4, 2),
            (128, 32, 8, 1),
            (64, 32, 4, 1),
            (32, 32, 4, 2),
            (64, 16, 4, 2),
            (128, 64, 8, 2),  # fp16 operands: twice the tiles fit
            (128, 32, 8, 2),
        ],
    )
    score_configs = _configs(
        triton,
        interpret,
        [
            (64, 64, 4, 2),
            (32, 128, 4, 2),
            (64, 128, 8, 1),
            (64, 32, 4, 2),
            (32, 64, 4, 2),
            (32, 32, 4, 2),
            (128, 64, 8, 2),  # fp16 operands
            (64, 128, 8, 2),
        ],
    )

    @triton.autotune(
        configs=forward_configs,
        key=["D_PAD", "HAS_V", "PRECISION"],
        prune_configs_by={"early_config_prune": _pruner("forward")},
    )
    @triton.jit
    def _forward(
        q_ptr,
        k_ptr,
        v_ptr,
        shift_ptr,
        mass_ptr,
        out_ptr,
        n,
        t,
        qk_scale,
        s_qh,
        s_qn,
        s_kh,
        s_kt,
        s_vh,
        s_vt,
        s_oh,
        s_on,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        HAS_V: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        head = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        q = tl.load(
            q_ptr + head * s_qh + rows[:, None].to(tl.int64) * s_qn + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for start in range(0, t, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < t
            # [D_PAD, BLOCK_N]
            k_t = tl.load(
                k_ptr + head * s_kh + cols[None, :].to(tl.int64) * s_kt + d[:, None],
                mask=col_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            # fp16 operands: 10-bit mantissas like tf32, twice its tensor-core rate
            if PRECISION == "fp16":
                logits = tl.dot(q, k_t) * qk_scale  # log2 units
            else:
                logits = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
            logits = tl.where(col_ok[None, :], logits, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logits, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(logits - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if HAS_V:
                v = tl.load(
                    v_ptr
                    + head * s_vh
                    + cols[:, None].to(tl.int64) * s_vt
                    + d[None, :],
                    mask=col_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )  # [BLOCK_N, D_PAD]
                if PRECISION == "fp16":
                    pv = tl.dot(p.to(tl.float16), v)
                else:
                    pv = tl.dot(p, v, input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
            m_i = m_new
        stat = head * n + rows
        tl.store(shift_ptr + stat, m_i, mask=row_ok)
        tl.store(mass_ptr + stat, l_i, mask=row_ok)
        if HAS_V:
            out = acc / l_i[:, None]
            tl.store(
                out_ptr + head * s_oh + rows[:, None].to(tl.int64) * s_on + d[None, :],
                out,
                mask=row_ok[:, None] & d_ok[None, :],
            )

    @triton.autotune(
        configs=score_configs,
        key=["D_PAD", "AGGREGATION", "HAS_W", "FEATURES", "PRECISION"],
        prune_configs_by={"early_config_prune": _pruner("scores")},
    )
    @triton.jit
    def _scores(
        q_ptr,
        k_ptr,
        shift_ptr,
        mass_ptr,
        weight_ptr,
        scores_ptr,
        feat_ptr,
        n,
        t,
        qk_scale,
        feat_scale,
        s_qh,
        s_qn,
        s_kh,
        s_kt,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        AGGREGATION: tl.constexpr,
        HAS_W: tl.constexpr,
        FEATURES: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        head = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < t
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        # [D_PAD, BLOCK_N]
        k_t = tl.load(
            k_ptr + head * s_kh + cols[None, :].to(tl.int64) * s_kt + d[:, None],
            mask=col_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        acc = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, n, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < n
            q = tl.load(
                q_ptr + head * s_qh + rows[:, None].to(tl.int64) * s_qn + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            shift = tl.load(shift_ptr + head * n + rows, mask=row_ok, other=0.0)
            if PRECISION == "fp16":
                logits = tl.dot(q, k_t) * qk_scale
            else:
                logits = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
            ok = row_ok[:, None] & col_ok[None, :]
            # shifted features exp(l - s)
            p = tl.where(ok, tl.exp2(logits - shift[:, None]), 0.0)
            if FEATURES:  # key-major [T, n]: store the transposed tile, so threads write along queries
                tl.store(
                    feat_ptr
                    + head * t * n
                    + cols[:, None].to(tl.int64) * n
                    + rows[None, :],
                    (tl.trans(p) * feat_scale).to(feat_ptr.dtype.element_ty),
                    mask=tl.trans(ok),
                )
            if AGGREGATION != 0:
                mass = tl.load(mass_ptr + head * n + rows, mask=row_ok, other=1.0)
                a = p / mass[:, None]  # attention weights
                if HAS_W:
                    w = tl.load(weight_ptr + head * n + rows, mask=row_ok, other=0.0)
                    if AGGREGATION == 1:
                        acc += tl.sum(a * a * w[:, None], 0)
                    elif AGGREGATION == 2:
                        acc += tl.sum(a * w[:, None], 0)
                    else:
                        acc = tl.maximum(acc, tl.max(a * w[:, None], 0))
                else:
                    if AGGREGATION == 1:
                        acc += tl.sum(a * a, 0)
                    elif AGGREGATION == 2:
                        acc += tl.sum(a, 0)
                    else:
                        acc = tl.maximum(acc, tl.max(a, 0))
        if AGGREGATION != 0:
            tl.store(scores_ptr + head * t + cols, acc, mask=col_ok)

    _KERNELS[interpret] = (_forward, _scores)
    return _forward, _scores


def reference_attention_triton(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    queries: torch.Tensor,
    *,
    scale: float,
    aggregation: str | None,
    keep_features: bool,
    row_weights: torch.Tensor | None = None,
    precision: str = "tf32x3",
    feature_dtype: torch.dtype = torch.float16,
    feature_scale: float = 1.0,
) -> ReferenceStats:
    """The reference pass over ``keys``/``values [H, T, d]`` and ``queries [H, n, d]`` (fp32).

    ``row_weights [H, n]`` weigh each query in the sums (rms, mean) or scale its weights before
    the max (weighted-max); ``None`` weighs every query 1. ``scores`` come back as the raw
    reductions: the caller divides by the weight total (and takes the root for rms). Kept
    features are ``exp(l - s) * feature_scale`` in ``feature_dtype`` (a power of two keeps fp8's
    few bits on the small entries: ``exp(l - s) <= 1``).
    """
    import triton

    if precision not in DOT_PRECISIONS:
        raise ValueError(
            f"precision must be one of {', '.join(DOT_PRECISIONS)}, got {precision!r}"
        )
    if aggregation not in AGGREGATION_CODES:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    h, t, d = keys.shape
    n = queries.shape[1]
    dtype = torch.float32
    if precision == "fp16":
        # one reduction decides: fp16 operands need every input within fp16's range
        inputs = [keys, queries] + ([values] if values is not None else [])
        # extremes without an |x| copy of each input, read back once
        ends = [end for x in inputs if x.numel() for end in torch.aminmax(x)]
        peak = float(torch.stack(ends).abs().max()) if ends else 0.0
        if peak <= FP16_INPUT_LIMIT:
            dtype = torch.float16
        else:
            precision = "tf32"
    keys, queries = keys.to(dtype).contiguous(), queries.to(dtype).contiguous()
    values = values.to(dtype).contiguous() if values is not None else None
    device = keys.device
    forward, scores_kernel = _build()
    shift = torch.empty(h, n, dtype=torch.float32, device=device)
    mass = torch.empty(h, n, dtype=torch.float32, device=device)
    output = (
        torch.empty(h, n, d, dtype=torch.float32, device=device)
        if values is not None
        else None
    )
    d_pad = max(16, 1 << (d - 1).bit_length())
    qk_scale = float(scale) * LOG2_E
    if n and t:
        v_arg = values if values is not None else keys
        o_arg = output if output is not None else shift
        forward[lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), h)](
            queries,
            keys,
            v_arg,
            shift,
            mass,
            o_arg,
            n,
            t,
            qk_scale,
            queries.stride(0),
            queries.stride(1),
            keys.stride(0),
            keys.stride(1),
            v_arg.stride(0),
            v_arg.stride(1),
            o_arg.stride(0) if output is not None else 0,
            o_arg.stride(1) if output is not None else 0,
            D=d,
            D_PAD=d_pad,
            HAS_V=values is not None,
            PRECISION=precision,
        )
    code = AGGREGATION_CODES[aggregation]
    scores = torch.zeros(h, t, dtype=torch.float32, device=device) if code else None
    features = (
        torch.empty(h, t, n, dtype=feature_dtype, device=device)
        if keep_features
        else None
    )
    if n and t and (code or keep_features):
        weights = (
            None
            if row_weights is None
            else row_weights.float().expand(h, n).contiguous()
        )
        scores_kernel[lambda meta: (triton.cdiv(t, meta["BLOCK_N"]), h)](
            queries,
            keys,
            shift,
            mass,
            weights if weights is not None else mass,
            scores if scores is not None else mass,
            features if features is not None else mass,
            n,
            t,
            qk_scale,
            float(feature_scale),
            queries.stride(0),
            queries.stride(1),
            keys.stride(0),
            keys.stride(1),
            D=d,
            D_PAD=d_pad,
            AGGREGATION=code,
            HAS_W=weights is not None,
            FEATURES=keep_features,
            PRECISION=precision,
        )
    return ReferenceStats(
        shift=shift * LN_2,
        mass=mass,
        output=output,
        scores=scores,
        features=features,
        feature_scale=float(feature_scale) if keep_features else 1.0,
    )
