"""Paged attention with a per-slot logit bias carried inside the KV cache (Triton, CUDA path).

Compacted prefixes give some KV slots a logit bias ``beta`` (see
:mod:`vllm_compaction.vllm.bias`). Stock kernels can apply it only through an augmented query
(``q[d] = q[d + 1] = 1 / scale``), which costs the extra coordinates in every ``q . k`` and
makes beta's precision depend on ``1 / scale`` being exact in the query dtype. This kernel
instead reads beta straight from the two bias coordinates of each key row and adds it to the
fp32 logit, so the query stays unaugmented and beta keeps the full precision of its hi + lo
encoding:

    logit[t, h, s] = scale * <q[t, h, :d], k[s, h', :d]>
                     + float(k[s, h', d]) + float(k[s, h', d + 1])

with ``h' = h // (Hq // Hkv)`` (GQA) and causal masking inside each request. Softmax is online
(flash-attention style) in fp32; the output is written in the query dtype, and on request the
log-sum-exp of each row's logits (fp32), which lets a caller merge this attention exactly with
attention over keys kept elsewhere (the packed prefixes of :mod:`vllm_compaction.vllm.paged_prefix`).

Layout. vLLM 0.32's ``TRITON_ATTN`` backend hands each layer a logical ``[B, H, N, 2 * hs]``
cache view (blocks, kv heads, slots, key and value side by side; its physical stride order is
set by ``KVCacheLayout``), then calls ``kv_cache.transpose(1, 2).split(hs, dim=-1)``. Its kernel
therefore sees ``key_cache`` / ``value_cache`` as ``[num_blocks, block_size, Hkv, hs]`` views
with arbitrary strides. This module takes exactly those views (``hs = D_aug`` here) and honours
all four strides, so the same split views can be passed in without a copy.

``import triton`` happens on first call, so this module imports (and its torch reference runs)
on machines without Triton; the kernel call then raises a clear ``RuntimeError``.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch

from vllm_compaction.vllm.bias import BIAS_COORDS, decode_beta

__all__ = ["paged_bias_attention", "paged_bias_attention_reference"]

logger = logging.getLogger(__name__)

_KERNELS: dict[bool, Any] = {}
"""Compiled kernel per interpreter mode: ``@triton.jit`` picks interpreter vs. compiler when it
decorates, so the kernel is built lazily (after tests set ``TRITON_INTERPRET``) and per mode."""

_BLOCK_N = 32
"""Keys per inner-loop tile. Independent of the page size: every key looks up its own page, so
any block size (vLLM allows multiples of 16, not only powers of two) works unchanged."""

_MAX_BLOCK_M = 64
"""Most (token, head) rows per program; 64 x 32 fp32 tiles keep register pressure modest."""


def _import_triton() -> tuple[Any, Any]:
    """Import Triton on demand so a CPU-only install can import this module."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise RuntimeError(
            "paged_bias_attention needs Triton (pip install triton); without it use "
            "paged_bias_attention_reference, the plain-torch version with the same signature."
        ) from exc
    return triton, tl


def _interpreting(triton: Any) -> bool:
    """Whether ``@triton.jit`` would build an interpreted kernel right now (read lazily)."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; older ones read the env directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _build_kernel() -> Any:
    """Define and ``@triton.jit`` the kernel (once per interpreter mode)."""
    triton, tl = _import_triton()
    interpret = _interpreting(triton)
    if interpret in _KERNELS:
        return _KERNELS[interpret]

    @triton.jit
    def _paged_bias_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        lse_ptr,
        block_table_ptr,
        seq_lens_ptr,
        query_start_loc_ptr,
        scale,
        block_size,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_lt,
        stride_lh,
        stride_bt,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        STORE_LSE: tl.constexpr,
    ):
        # One program: BLOCK_Q query tokens of one request x all GROUP query heads that share one
        # kv head. Packing the GQA group into the rows loads every K/V tile once per group and
        # fills the MMA's M dimension even for decode (one token per request).
        req = tl.program_id(0)
        q_tile = tl.program_id(1)
        kv_head = tl.program_id(2)

        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + req)
        ctx_len = seq_len - q_len  # cache slots written before this step
        tile_q0 = q_tile * BLOCK_Q

        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
        rows = tl.arange(0, BLOCK_M)
        tok = tile_q0 + rows // GROUP_PAD  # token index within the request
        grp = rows % GROUP_PAD
        row_ok = (tok < q_len) & (grp < GROUP)
        head = kv_head * GROUP + grp
        q_pos = ctx_len + tok  # absolute position = last cache slot it may see

        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_DIM

        q_row = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
        q = tl.load(
            q_ptr + q_row[:, None] + d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

        # Causality bounds the keys of the whole tile by its last valid token; tiles past the
        # request's query length (the grid is sized for the longest request) loop zero times.
        last_tok = tl.minimum(tile_q0 + BLOCK_Q, q_len)
        kv_end = tl.where(tile_q0 < q_len, tl.minimum(ctx_len + last_tok, seq_len), 0)

        kv_head_off = kv_head.to(tl.int64)
        for start in range(0, kv_end, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            k_ok = k_pos < kv_end
            page = tl.load(
                block_table_ptr + req.to(tl.int64) * stride_bt + k_pos // block_size,
                mask=k_ok,
                other=0,
            ).to(tl.int64)
            slot = (k_pos % block_size).to(tl.int64)

            k_row = page * stride_kb + slot * stride_ks + kv_head_off * stride_kh
            k_t = tl.load(
                k_ptr + k_row[None, :] + d[:, None] * stride_kd,
                mask=k_ok[None, :] & d_ok[:, None],
                other=0.0,
            )  # [HEAD_PAD, BLOCK_N]
            # beta = hi + lo, summed in fp32 (a bf16 cache keeps ~16 bits of beta this way)
            beta_hi = tl.load(k_ptr + k_row + HEAD_DIM * stride_kd, mask=k_ok, other=0.0)
            beta_lo = tl.load(k_ptr + k_row + (HEAD_DIM + 1) * stride_kd, mask=k_ok, other=0.0)
            beta = beta_hi.to(tl.float32) + beta_lo.to(tl.float32)

            if UPCAST_DOT:
                logits = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
            else:
                logits = tl.dot(q, k_t, input_precision=DOT_PRECISION)
            logits = logits * scale + beta[None, :]
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
            logits = tl.where(visible, logits, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(logits, 1))
            # Rows with nothing visible yet keep m = -inf; shift them by 0 so that no
            # (-inf) - (-inf) = NaN appears. Their p and alpha are then exactly 0.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_shift)
            p = tl.exp(logits - m_shift[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)

            v_row = page * stride_vb + slot * stride_vs + kv_head_off * stride_vh
            v = tl.load(
                v_ptr + v_row[:, None] + d[None, :] * stride_vd,
                mask=k_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [BLOCK_N, HEAD_PAD]
            # p is rounded to the cache dtype before P @ V, as the tensor-core path needs
            p_v = p.to(v.dtype)
            if UPCAST_DOT:
                pv = tl.dot(p_v.to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p_v, v, input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_row = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(
            out_ptr + o_row[:, None] + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
        if STORE_LSE:
            lse = tl.where(l_i > 0.0, m_i + tl.log(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
            l_row = (q_start + tok).to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh
            tl.store(lse_ptr + l_row, lse, mask=row_ok)

    _KERNELS[interpret] = _paged_bias_attention_kernel
    logger.debug("built paged_bias_attention kernel (interpret=%s)", interpret)
    return _paged_bias_attention_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    head_dim: int,
    out: torch.Tensor | None,
) -> tuple[int, int]:
    """Validate shapes/dtypes once for both implementations; returns ``(Hq, Hkv)``.

    Checked here rather than left to the kernel because a wrong layout would silently read the
    wrong slots (e.g. a ``[B, H, N, D]`` cache passed where ``[B, N, H, D]`` is expected).
    """
    if query.dim() != 3 or query.shape[-1] < head_dim:
        raise ValueError(f"query must be [num_tokens, Hq, >= head_dim]; got {tuple(query.shape)}")
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError("key_cache/value_cache must be [num_blocks, block_size, Hkv, D_aug]")
    if key_cache.shape[:3] != value_cache.shape[:3]:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} "
            "disagree on [num_blocks, block_size, Hkv]"
        )
    if key_cache.shape[-1] < head_dim + BIAS_COORDS:
        raise ValueError(
            f"key_cache head size {key_cache.shape[-1]} cannot hold head_dim={head_dim} plus "
            f"{BIAS_COORDS} bias coordinates"
        )
    if value_cache.shape[-1] < head_dim:
        raise ValueError(f"value_cache head size {value_cache.shape[-1]} < head_dim={head_dim}")
    num_q_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported query dtype {query.dtype}")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(
            f"query ({query.dtype}), key_cache ({key_cache.dtype}) and value_cache "
            f"({value_cache.dtype}) must share one dtype (quantized caches are not supported)"
        )
    num_reqs = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table must be [num_reqs, max_blocks]; got {tuple(block_table.shape)}"
        )
    if query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"query_start_loc must be [num_reqs + 1] = [{num_reqs + 1}]; "
            f"got {tuple(query_start_loc.shape)}"
        )
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")
    if out is not None:
        if out.shape != (query.shape[0], num_q_heads, head_dim):
            raise ValueError(
                f"out must be [num_tokens, Hq, head_dim] = "
                f"{(query.shape[0], num_q_heads, head_dim)}; got {tuple(out.shape)}"
            )
        if out.dtype != query.dtype:
            raise ValueError(f"out dtype {out.dtype} != query dtype {query.dtype}")
    return num_q_heads, num_kv_heads


def paged_bias_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    head_dim: int,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal paged attention whose keys carry a per-slot logit bias (Triton kernel).

    Args:
        query: ``[num_tokens, Hq, head_dim]`` (a wider last dim is accepted; only the first
            ``head_dim`` coordinates are read, so an augmented query works too).
        key_cache / value_cache: ``[num_blocks, block_size, Hkv, D_aug]``, any strides (the
            views vLLM 0.32's ``TRITON_ATTN`` builds with ``transpose(1, 2).split``).
            ``D_aug >= head_dim + BIAS_COORDS``; key coordinates ``head_dim`` and
            ``head_dim + 1`` hold beta's hi and lo parts, values beyond ``head_dim`` are ignored.
        block_table: ``[num_reqs, max_blocks]`` page ids (int32), row ``r`` for request ``r``.
        seq_lens: ``[num_reqs]`` tokens in the cache per request, this step's tokens included.
        query_start_loc: ``[num_reqs + 1]`` cumulative query offsets (cu_seqlens); token ``i``
            of request ``r`` sits at position ``seq_lens[r] - q_len_r + i`` and sees cache
            positions ``<=`` its own.
        scale: softmax scale applied to ``<q, k>`` (not to beta).
        head_dim: the model's head size ``d`` (unaugmented).
        max_query_len: longest ``q_len`` in the batch; sizes the grid. ``None`` computes it
            from ``query_start_loc``, which costs a device-to-host sync (pass it from the
            attention metadata on the hot path, and under CUDA graphs).
        out: optional ``[num_tokens, Hq, head_dim]`` buffer in the query dtype (any strides,
            e.g. a ``[..., :head_dim]`` slice of a wider output).
        lse: optional ``[num_tokens, Hq]`` float32 buffer for each row's log-sum-exp of its
            visible logits (``-inf`` when it sees none).

    Returns:
        ``out`` (allocated as zeros if not given). Rows past ``query_start_loc[-1]``
        (padding tokens) are left untouched.
    """
    triton, _ = _import_triton()
    num_q_heads, num_kv_heads = _check_inputs(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, head_dim, out
    )
    interpret = _interpreting(triton)
    if query.device.type == "cpu" and not interpret:
        raise RuntimeError(
            "paged_bias_attention got CPU tensors: the Triton kernel needs a GPU, or "
            "TRITON_INTERPRET=1 for the (slow) interpreter; the CPU path should call "
            "paged_bias_attention_reference."
        )
    if out is None:
        out = query.new_zeros((query.shape[0], num_q_heads, head_dim))
    _check_lse(lse, query.shape[0], num_q_heads)
    num_reqs = seq_lens.shape[0]
    if max_query_len is None and num_reqs:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if num_reqs == 0 or not max_query_len or max_query_len <= 0 or query.shape[0] == 0:
        return out

    group = num_q_heads // num_kv_heads
    group_pad = _next_pow2(group)
    # tl.dot wants every tile dim >= 16 on GPUs; pad the (token, head) rows up to 16, and cap
    # them so long prefills split into several programs along the query axis.
    block_m = min(max(group_pad * _next_pow2(max_query_len), 16), max(_MAX_BLOCK_M, group_pad))
    block_q = block_m // group_pad
    head_pad = max(16, _next_pow2(head_dim))

    kernel = _build_kernel()
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        lse if lse is not None else out,  # never written without STORE_LSE
        block_table,
        seq_lens,
        query_start_loc,
        float(scale),
        key_cache.shape[1],
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *out.stride(),
        *(lse.stride() if lse is not None else (0, 0)),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=_BLOCK_N,
        # fp32 caches get true fp32 products (tf32 would cost ~1e-3 relative error)
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # The interpreter keeps bf16 as raw uint16 bits and its tl.dot multiplies those bits
        # (triton-lang/triton#11584, "not supported yet"); exact fp32 products of the same bf16
        # values give the GPU's result there. Compiled kernels use the native bf16 MMA.
        UPCAST_DOT=interpret and query.dtype == torch.bfloat16,
        STORE_LSE=lse is not None,
    )
    return out


def paged_bias_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    head_dim: int,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch twin of :func:`paged_bias_attention` (same signature and semantics).

    Gathers each request's pages, then does a dense masked softmax in fp32. It is the oracle of
    the kernel tests and a CPU fallback: exact but O(q_len x seq_len) memory per request and one
    host sync per request. ``max_query_len`` is accepted for signature parity and ignored.
    """
    del max_query_len
    num_q_heads, num_kv_heads = _check_inputs(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, head_dim, out
    )
    if out is None:
        out = query.new_zeros((query.shape[0], num_q_heads, head_dim))
    _check_lse(lse, query.shape[0], num_q_heads)
    group = num_q_heads // num_kv_heads
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        q_start, q_end = starts[r], starts[r + 1]
        q_len = q_end - q_start
        if q_len <= 0:
            continue
        pages = block_table[r, : math.ceil(seq_len / block_size)].long()
        keys = key_cache[pages].flatten(0, 1)[:seq_len]  # [S, Hkv, D_aug]
        values = value_cache[pages].flatten(0, 1)[:seq_len, :, :head_dim].float()
        beta = decode_beta(keys[..., head_dim : head_dim + BIAS_COORDS])  # [S, Hkv]
        keys = keys[..., :head_dim].float()
        # GQA: query head h reads kv head h // group
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        beta = beta.repeat_interleave(group, dim=1)

        q = query[q_start:q_end, :, :head_dim].float()
        logits = torch.einsum("thd,shd->hts", q, keys) * scale + beta.T[:, None, :]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        logits = logits.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out[q_start:q_end] = torch.einsum("hts,shd->thd", probs, values).to(out.dtype)
        if lse is not None:
            lse[q_start:q_end] = torch.logsumexp(logits, dim=-1).T
    return out


def _check_lse(lse: torch.Tensor | None, num_tokens: int, num_q_heads: int) -> None:
    if lse is not None and (lse.shape != (num_tokens, num_q_heads) or lse.dtype != torch.float32):
        raise ValueError(f"lse must be float32 [num_tokens, Hq] = {(num_tokens, num_q_heads)}; "
                         f"got {lse.dtype} {tuple(lse.shape)}")
