"""Split-KV paged attention over a packed compacted prefix and the tokens after it (Triton, CUDA).

One kernel serves every request of a step, with or without a compacted prefix:

* **prefix rows** (``HAS_PREFIX``): the request's compacted prefix, packed varlen in its prefix
  blocks (``vllm_compaction.cache.PagedPacking``): KV head ``h`` of layer ``l`` owns ``t_h`` rows
  starting at packed row ``g0`` (``head_rows[l, r, h] = (g0, t_h)``). Packed row ``g`` lies in
  region ``g // (H * bs)`` (a block of one layer's pages), lane ``(g % (H * bs)) // bs``, slot
  ``g % bs``; ``region_bases[r, region]`` is the element offset of that region from the key pages
  of layer 0, so rows of one layer may sit in the pages of another at no extra cost. Each row's
  ``beta`` is an fp32 in the beta rows (``header_rows + k // (d / 2)``, element ``k % (d / 2)``,
  ``k = g - data_start``), read through ``beta_words``, an fp32 alias of layer 0's key pages.
  Rows are read where they lie: no gather, no per-head padding. Values sit at the same offsets
  from layer 0's value pages (vLLM's CUDA pages keep each layer's keys and values in one tensor).
* **suffix**: the request's ordinary tokens through ``block_table`` (the prefix blocks cut
  off), causal; on widened pages (``SUFFIX_BIAS``) each key's coordinates ``d, d + 1`` add its
  beta (padded prefixes), else the suffix has none.

Logits are ``scale * <q, k> + beta`` in fp32 with an online softmax. Every (request, query tile,
KV head) program is cut along its keys into up to ``num_splits`` programs of ``split_keys`` keys
each (flash-decoding): a long request keeps every SM busy, and a head shorter than the longest
takes only the splits it fills (the per-head budgets are uneven; splits past a head's end write
just an empty ``(max, sum)``). Each split writes its normalised output and ``(max, sum)`` in
log2 units; ``_merge`` combines them by log-sum-exp into the output (query dtype) and the
row's natural-log LSE, reading only the splits that hold mass. With one split the first
kernel writes the output itself.

Pages are the views ``[num_blocks, H, block_size, D]`` of ``PagedPrefixPages`` (any strides,
the last dimension contiguous, keys and values with the same strides). ``import triton``
happens on first call; ``compacted_attention_reference`` is the plain-torch twin (tested against
``vllm_compaction.am.attention_output_and_mass``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_compaction_kernels.runtime import interpreting

__all__ = [
    "PrefixTables",
    "compacted_attention",
    "compacted_attention_reference",
    "choose_splits",
]

LOG2_E = 1.0 / math.log(2.0)
LN_2 = math.log(2.0)
_KERNELS: dict[bool, tuple[Any, Any]] = {}
#: Programs to aim for per streaming multiprocessor when choosing the number of splits. On an
#: H100 (decode, bf16, a 10% prefix with uneven heads at four shapes) this gave the fastest of
#: half, once, twice and four times its split count at every shape; 8 ran 1.1-2.7x slower.
PROGRAMS_PER_SM = 4
#: Fewest keys a split streams (smaller splits cost more in the merge than they gain).
MIN_SPLIT_KEYS = 128
MAX_SPLITS = 64


@dataclass
class PrefixTables:
    """Where each request's compacted prefix rows lie, for one layer (device tensors).

    Built once per step for all layers; a layer's call reads its ``head_rows[layer]`` and shifts
    the region offsets by ``layer_shifts[layer]`` (layer 0's pages minus this layer's, in elements).

    Attributes:
        region_bases: ``[R, M]`` int64 element offset of each prefix region's first row from the
            key pages of layer 0 (region ``i`` = block ``i // L`` of the prefix, layer page ``i % L``).
        head_rows: ``[L, R, H, 2]`` int32 ``(g0, t_h)``: first packed row and row count of each
            KV head (``t_h = 0`` for a request without a prefix).
        beta_rows: ``[R, 2]`` int32 ``(header_rows, data_start)`` of each request's packing.
        beta_words: fp32 tensor aliasing the memory from layer 0's key pages on
            (``beta_words[i]`` is the fp32 at byte ``4 * i`` of its first element).
        layer_shifts: per layer, the element offset from that layer's pages to layer 0's.
        total_rows: prefix rows over all requests and heads, per layer (sizes the splits).
        max_rows: the longest head's prefix rows over all requests, per layer.
        prefixed: how many of the requests have a prefix.
        offset_multiple: a power of two (at most 16) dividing every region base and shift.
    """

    region_bases: torch.Tensor
    head_rows: torch.Tensor
    beta_rows: torch.Tensor
    beta_words: torch.Tensor
    layer_shifts: list[int]
    total_rows: list[int]
    max_rows: list[int]
    prefixed: int
    offset_multiple: int = 1


def _build() -> tuple[Any, Any]:
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise RuntimeError(
            "compacted_attention needs Triton; without it use compacted_attention_reference"
        ) from exc
    interpret = interpreting(triton)
    if interpret in _KERNELS:
        return _KERNELS[interpret]

    @triton.jit
    def _attend(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        lse_ptr,
        part_ptr,
        stat_ptr,
        count_ptr,
        block_table_ptr,
        seq_lens_ptr,
        query_start_loc_ptr,
        region_base_ptr,
        head_rows_ptr,
        beta_rows_ptr,
        beta_ptr,
        scale_log2,
        prefix_shift,
        num_kv_heads,
        split_keys,
        window,
        s_qt,
        s_qh,
        s_kb,
        s_kh,
        s_ks,
        s_ot,
        s_oh,
        s_lt,
        s_bt,
        s_rb,
        BLOCK_SIZE: tl.constexpr,
        REGION_ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
        HAS_PREFIX: tl.constexpr,
        SUFFIX_BIAS: tl.constexpr,
        WINDOWED: tl.constexpr,
        ELEM_SIZE: tl.constexpr,
        ROW_MULTIPLE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        STORE_LSE: tl.constexpr,
        FUSED_MERGE: tl.constexpr,
    ):
        req = tl.program_id(0)
        q_tile = tl.program_id(1)
        kv_head = tl.program_id(2) // SPLITS
        split = tl.program_id(2) % SPLITS

        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + req)  # suffix tokens, this step's included
        ctx_len = seq_len - q_len
        tile_q0 = q_tile * BLOCK_Q
        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
        rows = tl.arange(0, BLOCK_M)
        tok = tile_q0 + rows // GROUP_PAD
        grp = rows % GROUP_PAD
        row_ok = (tok < q_len) & (grp < GROUP)
        head = kv_head * GROUP + grp
        q_pos = ctx_len + tok
        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_DIM
        q_row = (q_start + tok).to(tl.int64) * s_qt + head.to(tl.int64) * s_qh
        q = tl.load(
            q_ptr + q_row[:, None] + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )

        live = tile_q0 < q_len
        last_tok = tl.minimum(tile_q0 + BLOCK_Q, q_len)
        suffix_end = tl.where(live, tl.minimum(ctx_len + last_tok, seq_len), 0)
        g0 = 0
        t_h = 0
        header_rows = 0
        data_start = 0
        if HAS_PREFIX:
            g0 = tl.load(head_rows_ptr + (req * num_kv_heads + kv_head) * 2)
            t_h = tl.where(
                live, tl.load(head_rows_ptr + (req * num_kv_heads + kv_head) * 2 + 1), 0
            )
            header_rows = tl.load(beta_rows_ptr + req * 2)
            data_start = tl.load(beta_rows_ptr + req * 2 + 1)
        total = t_h + suffix_end
        if SPLITS == 1:
            lo = 0
            hi = total
        else:
            # every split streams split_keys keys: a short head takes few splits, and the splits
            # past its end write only their (empty) statistics
            lo = split * split_keys
            hi = tl.minimum(lo + split_keys, total)
        bases = region_base_ptr + req.to(tl.int64) * s_rb

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            i = start + tl.arange(0, BLOCK_N)
            ok = i < hi
            j = i - t_h  # suffix position (negative inside the prefix)
            in_suffix = ok & (j >= 0)
            s_pos = tl.maximum(j, 0)
            s_blk = tl.load(
                block_table_ptr + req.to(tl.int64) * s_bt + s_pos // BLOCK_SIZE,
                mask=in_suffix,
                other=0,
            ).to(tl.int64)
            row = (
                s_blk * s_kb
                + kv_head.to(tl.int64) * s_kh
                + (s_pos % BLOCK_SIZE).to(tl.int64) * s_ks
            )
            beta = tl.zeros([BLOCK_N], tl.float32)
            if HAS_PREFIX:
                in_prefix = ok & (j < 0)
                # int32 row arithmetic with constant divisors; one table load per row
                g = g0 + i
                region = g // REGION_ROWS
                off = g % REGION_ROWS
                base = tl.load(bases + region, mask=in_prefix, other=0)
                p_row = (
                    base
                    + prefix_shift
                    + ((off // BLOCK_SIZE) * s_kh + (off % BLOCK_SIZE) * s_ks).to(
                        tl.int64
                    )
                )
                row = tl.where(in_prefix, p_row, row)
                # beta of packed row g: fp32 number k % (d / 2) of beta row header_rows + k // (d / 2)
                k_idx = g - data_start
                bg = header_rows + k_idx // (HEAD_DIM // 2)
                b_off = bg % REGION_ROWS
                b_row = tl.load(bases + bg // REGION_ROWS, mask=in_prefix, other=0) + (
                    (b_off // BLOCK_SIZE) * s_kh + (b_off % BLOCK_SIZE) * s_ks
                ).to(tl.int64)
                beta = tl.load(
                    beta_ptr + b_row * ELEM_SIZE // 4 + k_idx % (HEAD_DIM // 2),
                    mask=in_prefix,
                    other=0.0,
                )
            if SUFFIX_BIAS:
                hi_b = tl.load(k_ptr + row + HEAD_DIM, mask=in_suffix, other=0.0).to(
                    tl.float32
                )
                lo_b = tl.load(
                    k_ptr + row + HEAD_DIM + 1, mask=in_suffix, other=0.0
                ).to(tl.float32)
                beta += hi_b + lo_b
            # every row starts on a multiple of this many elements: wide loads
            if ROW_MULTIPLE > 1:
                row = tl.multiple_of(row, ROW_MULTIPLE)
            k_t = tl.load(
                k_ptr + row[None, :] + d[:, None],
                mask=ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            if UPCAST_DOT:
                logits = tl.dot(
                    q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee"
                )
            else:
                logits = tl.dot(q, k_t, input_precision=DOT_PRECISION)
            logits = logits * scale_log2 + beta[None, :] * 1.4426950408889634
            visible = (
                ok[None, :]
                & row_ok[:, None]
                & ((j[None, :] < 0) | (j[None, :] <= q_pos[:, None]))
            )
            if WINDOWED:
                # key i (prefix row, or suffix position i - t_h) stands t_h + q_pos - i tokens
                # before the query: prefix rows of a sliding layer are its last keys in order
                visible = visible & ((t_h + q_pos[:, None] - i[None, :]) < window)
            logits = tl.where(visible, logits, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logits, 1))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_shift)
            p = tl.exp2(logits - m_shift[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + row[:, None] + d[None, :],
                mask=ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            p_v = p.to(v.dtype)
            if UPCAST_DOT:
                pv = tl.dot(
                    p_v.to(tl.float32), v.to(tl.float32), input_precision="ieee"
                )
            else:
                pv = tl.dot(p_v, v, input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        token = (q_start + tok).to(tl.int64)
        emit = row_ok  # the rows this program writes the output of
        if SPLITS > 1:
            # partials [tokens, Hq, SPLITS, HEAD_PAD] and [tokens, Hq, SPLITS, 2]
            first = (token * (num_kv_heads * GROUP) + head) * SPLITS
            slot = first + split
            # compared as a block: the interpreter's scalar comparison does not make a mask
            filled = row_ok & (rows * 0 + lo < hi)
            tl.store(
                part_ptr + slot[:, None] * HEAD_PAD + d[None, :],
                out,
                mask=filled[:, None],
            )
            tl.store(stat_ptr + slot * 2, m_i, mask=row_ok)
            tl.store(stat_ptr + slot * 2 + 1, l_i, mask=row_ok)
            emit = row_ok & False
            if FUSED_MERGE:
                # the last split of this (request, query tile, KV head) to finish merges them
                # all, which saves the merge's launch. Every thread's stores come before the
                # counter's release (the barrier; CUTLASS's semaphore does the same), the last
                # program's acquire comes before its reads, and those bypass L1 (.cg), which
                # may hold an earlier call's partials at these addresses.
                group_id = (req * tl.num_programs(1) + q_tile) * num_kv_heads + kv_head
                tl.debug_barrier()
                done = tl.atomic_add(
                    count_ptr + group_id, 1, sem="acq_rel", scope="gpu"
                )
                emit = row_ok & (rows * 0 + done == SPLITS - 1)
                if done == SPLITS - 1:
                    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                    l_i = tl.zeros([BLOCK_M], tl.float32)
                    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
                    for s in range(SPLITS):
                        m_s = tl.load(
                            stat_ptr + (first + s) * 2, mask=row_ok, other=float("-inf"),
                            cache_modifier=".cg",
                        )  # fmt: skip
                        l_s = tl.load(
                            stat_ptr + (first + s) * 2 + 1, mask=row_ok, other=0.0,
                            cache_modifier=".cg",
                        )  # fmt: skip
                        part = tl.load(
                            part_ptr + (first + s)[:, None] * HEAD_PAD + d[None, :],
                            mask=(l_s > 0.0)[:, None], other=0.0, cache_modifier=".cg",
                        )  # fmt: skip
                        m_new = tl.maximum(m_i, m_s)
                        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                        alpha = tl.exp2(m_i - m_shift)
                        # the split's mass at the new max
                        mass = l_s * tl.exp2(m_s - m_shift)
                        acc = acc * alpha[:, None] + part * mass[:, None]
                        l_i = l_i * alpha + mass
                        m_i = m_new
                    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
                    # ready for the next call: the counters are kept zero between calls
                    tl.store(count_ptr + group_id, 0)
        if SPLITS == 1 or FUSED_MERGE:
            tl.store(
                out_ptr
                + token[:, None] * s_ot
                + head.to(tl.int64)[:, None] * s_oh
                + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=emit[:, None] & d_ok[None, :],
            )
            if STORE_LSE:
                lse = tl.where(
                    l_i > 0.0,
                    (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * 0.6931471805599453,
                    float("-inf"),
                )
                tl.store(lse_ptr + token * s_lt + head, lse, mask=emit)

    @triton.jit
    def _merge(
        out_ptr,
        lse_ptr,
        part_ptr,
        stat_ptr,
        num_heads,
        s_ot,
        s_oh,
        s_lt,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        SPLITS: tl.constexpr,
        STORE_LSE: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, HEAD_PAD)
        slot = (token * num_heads + head) * SPLITS + s
        m = tl.load(stat_ptr + slot * 2)
        l = tl.load(stat_ptr + slot * 2 + 1)
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = l * tl.exp2(m - top)  # each split's mass, relative to the largest max
        total = tl.sum(w, 0)
        # an empty split (no mass) wrote no partial output: it is not read
        parts = tl.load(
            part_ptr + slot[:, None] * HEAD_PAD + d[None, :],
            mask=(w > 0.0)[:, None],
            other=0.0,
        )
        out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
        tl.store(
            out_ptr + token * s_ot + head * s_oh + d,
            out.to(out_ptr.dtype.element_ty),
            mask=d < HEAD_DIM,
        )
        if STORE_LSE:
            lse = tl.where(
                total > 0.0,
                (top + tl.log2(tl.where(total > 0.0, total, 1.0))) * 0.6931471805599453,
                float("-inf"),
            )
            tl.store(lse_ptr + token * s_lt + head, lse)

    _KERNELS[interpret] = (_attend, _merge)
    return _attend, _merge


_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


def _split_counters(groups: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters for the fused merge, one per program group, kept per device and
    stream (the last split of a group sets its counter back to zero; calls on one stream run
    in order, calls on two streams must not share counters)."""
    stream = (
        torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    )
    key = (str(device), stream)
    counts = _COUNTERS.get(key)
    if counts is None or counts.numel() < groups:
        counts = torch.zeros(_next_pow2(groups), dtype=torch.int32, device=device)
        _COUNTERS[key] = counts
    return counts


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _row_multiple(pages: torch.Tensor, tables: PrefixTables | None) -> int:
    """The largest power of two up to 16 dividing every row's element offset (the page strides,
    the pages' alignment and, with a prefix, its region offsets), so loads can be vectorised."""
    offsets = [*pages.stride()[:3], pages.data_ptr() // pages.element_size()]
    multiple = 16 if tables is None else tables.offset_multiple
    while multiple > 1 and any(o % multiple for o in offsets):
        multiple //= 2
    return multiple


def choose_splits(
    num_programs: int, max_keys: int, total_keys: int, device: torch.device
) -> int:
    """Splits per program (a power of two: the merge reduces them in one block).

    Work is as uneven as the per-head budgets: the longest program sets the step's time. So the
    splits aim at ``total_keys / (PROGRAMS_PER_SM * SMs)`` keys per split (at least
    ``MIN_SPLIT_KEYS``) for the longest program (``max_keys``), which fills the GPU when heads
    are even and shortens the longest head when they are not."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    del num_programs  # the keys, not the programs, set the work
    per_split = max(MIN_SPLIT_KEYS, -(-total_keys // (PROGRAMS_PER_SM * sms)))
    splits = max(1, min(-(-max_keys // per_split), MAX_SPLITS))
    return 1 << (splits - 1).bit_length()  # round up to a power of two


def _check_inputs(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    head_dim: int,
    suffix_bias: bool,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> None:
    """One sentence for each way a call could silently read the wrong memory."""
    if query.dim() != 3 or query.shape[-1] < head_dim or query.stride(-1) != 1:
        raise ValueError(
            f"query must be [tokens, Hq, >= head_dim] with a contiguous last dimension; "
            f"got {tuple(query.shape)}"
        )
    if key_pages.dim() != 4 or key_pages.shape != value_pages.shape:
        raise ValueError(
            "key_pages/value_pages must be equal [num_blocks, H, block_size, D] views"
        )
    if key_pages.stride() != value_pages.stride() or key_pages.stride(-1) != 1:
        raise ValueError(
            "key and value pages must share strides with a contiguous last dimension"
        )
    if key_pages.shape[-1] < head_dim + (2 if suffix_bias else 0):
        raise ValueError(
            f"pages of width {key_pages.shape[-1]} cannot hold head_dim={head_dim}"
            + (" plus the 2 bias coordinates" if suffix_bias else "")
        )
    if query.shape[1] % key_pages.shape[1]:
        raise ValueError(
            f"Hq={query.shape[1]} is not a multiple of Hkv={key_pages.shape[1]}"
        )
    if (
        query.dtype not in (torch.float32, torch.float16, torch.bfloat16)
        or key_pages.dtype != query.dtype
    ):
        raise ValueError(
            f"query ({query.dtype}) and pages ({key_pages.dtype}) must share one float dtype "
            "(quantized caches are not supported)"
        )
    num_reqs = seq_lens.shape[0]
    if (
        block_table.dim() != 2
        or block_table.shape[0] < num_reqs
        or query_start_loc.shape != (num_reqs + 1,)
    ):
        raise ValueError(
            "block_table must be [R, max_blocks] and query_start_loc [R + 1] for seq_lens [R]"
        )
    for name, t in (
        ("block_table", block_table),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")
    if out is not None and (
        out.shape != (query.shape[0], query.shape[1], head_dim)
        or out.dtype != query.dtype
        or out.stride(-1) != 1
    ):
        raise ValueError(
            f"out must be [tokens, Hq, head_dim] in the query dtype; got {out.dtype} {tuple(out.shape)}"
        )
    if lse is not None and (lse.shape != query.shape[:2] or lse.dtype != torch.float32):
        raise ValueError(
            f"lse must be float32 [tokens, Hq]; got {lse.dtype} {tuple(lse.shape)}"
        )


def compacted_attention(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    head_dim: int,
    max_query_len: int,
    max_keys: int,
    prefix: PrefixTables | None = None,
    layer: int = 0,
    total_keys: int | None = None,
    suffix_bias: bool = False,
    window: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fused_merge: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [tokens, Hq, >= d]`` over each request's compacted prefix rows and
    its suffix pages (module doc).

    Args:
        key_pages / value_pages: ``[num_blocks, H, block_size, D]`` views, the same strides.
        block_table: ``[R, max_blocks]`` suffix blocks of each request (prefix blocks cut off).
        seq_lens: ``[R]`` suffix tokens in the cache, this step's included; query token ``i``
            of request ``r`` sits at suffix position ``seq_lens[r] - q_len_r + i``.
        query_start_loc: ``[R + 1]`` cumulative query offsets.
        max_query_len / max_keys: the longest query and the most keys (prefix rows + suffix)
            any request has; they size the grid without reading the device.
        prefix: where the prefix rows lie (``None``: no request has one), and ``layer``, the
            layer these pages belong to.
        total_keys: the work the splits are sized by. The default counts the prefix rows
            exactly and every suffix at the longest it can be (``max_keys``, less the longest
            prefix head for a request with a prefix).
        suffix_bias: add the beta in key coordinates ``d, d + 1`` of suffix keys (widened pages).
        window: a sliding window (keys a query sees, itself included): a prefix head's rows are
            then the prefix's last keys in order, row ``k`` of ``t_h`` standing ``t_h + pos - k``
            tokens before the query at suffix position ``pos``.
        num_splits: splits along the keys (default: :func:`choose_splits`).
        fused_merge: with more than one split, the last split of each program merges them
            (one launch instead of two, through zeroed counters kept per device and stream);
            off by default until it is timed against the separate merge on a GPU.
        out / lse: ``[tokens, Hq, d]`` output in the query dtype and ``[tokens, Hq]`` fp32.
    """
    _check_inputs(
        query,
        key_pages,
        value_pages,
        block_table,
        seq_lens,
        query_start_loc,
        head_dim,
        suffix_bias,
        out,
        lse,
    )
    attend, merge = _build()
    import triton

    if query.device.type == "cpu" and not interpreting(triton):
        raise RuntimeError(
            "compacted_attention got CPU tensors: the Triton kernel needs a GPU, or TRITON_INTERPRET=1 "
            "for the (slow) interpreter; on a CPU use compacted_attention_reference"
        )
    num_tokens, num_q_heads = query.shape[:2]
    num_reqs = seq_lens.shape[0]
    num_kv_heads, block_size = key_pages.shape[1], key_pages.shape[2]
    if out is None:
        out = query.new_empty(num_tokens, num_q_heads, head_dim)
    if num_reqs == 0 or num_tokens == 0 or max_query_len <= 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = _next_pow2(group)
    block_m = min(max(group_pad * _next_pow2(max_query_len), 16), max(64, group_pad))
    block_q = block_m // group_pad
    q_tiles = -(-max_query_len // block_q)  # plain ints: triton.cdiv costs microseconds
    head_pad = max(16, _next_pow2(head_dim))
    if block_n is None:
        # the fastest tiles on an H100, with and without a prefix (benchmarks.decode_speed)
        block_n = 128 if head_pad <= 128 else 32
    if total_keys is None:
        # the prefix rows exactly; every suffix counted at the longest it can be: max_keys for
        # a plain request, max_keys less the longest prefix head for one with a prefix
        total_keys = num_reqs * num_kv_heads * max_keys
        if prefix is not None:
            prefixed_suffix = max(1, max_keys - prefix.max_rows[layer])
            total_keys += prefix.total_rows[layer] - prefix.prefixed * num_kv_heads * (
                max_keys - prefixed_suffix
            )
    splits = num_splits or choose_splits(
        num_reqs * q_tiles * num_kv_heads, max_keys, total_keys, query.device
    )
    if splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {splits}")
    # keys per split, a whole number of tiles: the longest program fills its splits
    split_keys = -(-max(max_keys, 1) // splits // block_n) * block_n
    interpret = interpreting(triton)
    part = stat = out
    if splits > 1:
        part = torch.empty(
            num_tokens,
            num_q_heads,
            splits,
            head_pad,
            dtype=torch.float32,
            device=query.device,
        )
        stat = torch.empty(
            num_tokens, num_q_heads, splits, 2, dtype=torch.float32, device=query.device
        )
    tables = prefix
    dummy = seq_lens
    fused = fused_merge and splits > 1
    counts = (
        _split_counters(num_reqs * q_tiles * num_kv_heads, query.device)
        if fused
        else dummy
    )
    launch: dict[str, Any] = {}
    if not interpret:
        launch = {"num_warps": num_warps or 4, "num_stages": num_stages or 2}
    attend[(num_reqs, q_tiles, num_kv_heads * splits)](
        query,
        key_pages,
        value_pages,
        out,
        lse if lse is not None else out,
        part,
        stat,
        counts,
        block_table,
        seq_lens,
        query_start_loc,
        tables.region_bases if tables else dummy,
        tables.head_rows[layer] if tables else dummy,
        tables.beta_rows if tables else dummy,
        tables.beta_words if tables else out,
        float(scale) * LOG2_E,
        tables.layer_shifts[layer] if tables else 0,
        num_kv_heads,
        split_keys,
        window or 0,
        query.stride(0),
        query.stride(1),
        key_pages.stride(0),
        key_pages.stride(1),
        key_pages.stride(2),
        out.stride(0),
        out.stride(1),
        lse.stride(0) if lse is not None else 0,
        block_table.stride(0),
        tables.region_bases.stride(0) if tables else 0,
        BLOCK_SIZE=block_size,
        REGION_ROWS=num_kv_heads * block_size,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        SPLITS=splits,
        HAS_PREFIX=tables is not None,
        SUFFIX_BIAS=suffix_bias,
        WINDOWED=bool(window),
        ELEM_SIZE=key_pages.element_size(),
        ROW_MULTIPLE=_row_multiple(key_pages, tables),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST_DOT=interpret and query.dtype == torch.bfloat16,
        STORE_LSE=lse is not None,
        FUSED_MERGE=fused,
        **launch,
    )
    if splits > 1 and not fused:
        merge[(num_tokens, num_q_heads)](
            out,
            lse if lse is not None else out,
            part,
            stat,
            num_q_heads,
            out.stride(0),
            out.stride(1),
            lse.stride(0) if lse is not None else 0,
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            SPLITS=splits,
            STORE_LSE=lse is not None,
        )
    return out


def compacted_attention_reference(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    head_dim: int,
    prefix_rows: list[
        tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    ]
    | None = None,
    suffix_bias: bool = False,
    window: int | None = None,
    dtype: torch.dtype = torch.float64,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense twin of :func:`compacted_attention` in ``dtype``: per request, its prefix rows
    (``prefix_rows[r] = (keys [N, d], beta [N], values [N, d], cu_seqlens [H + 1])``, already
    read out of the pages) and its suffix pages. Returns ``out [tokens, Hq, d]`` and ``lse``."""
    num_tokens, num_q_heads = query.shape[:2]
    num_kv_heads, block_size = key_pages.shape[1], key_pages.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(
        num_tokens, num_q_heads, head_dim, dtype=dtype, device=query.device
    )
    lse = torch.full(
        (num_tokens, num_q_heads), float("-inf"), dtype=dtype, device=query.device
    )
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[r], starts[r + 1]
        if q1 <= q0:
            continue
        pages = block_table[r, : -(-seq_len // block_size)].long()
        keys = (
            key_pages[pages]
            .permute(0, 2, 1, 3)
            .reshape(-1, num_kv_heads, key_pages.shape[-1])[:seq_len]
        )
        values = (
            value_pages[pages]
            .permute(0, 2, 1, 3)
            .reshape(-1, num_kv_heads, value_pages.shape[-1])[:seq_len]
        )
        suffix_beta = (
            keys[..., head_dim].to(dtype) + keys[..., head_dim + 1].to(dtype)
            if suffix_bias
            else torch.zeros(seq_len, num_kv_heads, dtype=dtype, device=query.device)
        )
        q_pos = torch.arange(seq_len - (q1 - q0), seq_len, device=query.device)
        # [q, S]
        visible = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        if window:
            visible &= (
                q_pos[:, None] - torch.arange(seq_len, device=query.device)[None, :]
                < window
            )
        q = query[q0:q1, :, :head_dim].to(dtype)
        for h in range(num_q_heads):
            kv = h // group
            logits = (
                q[:, h] @ keys[:, kv, :head_dim].to(dtype).T * scale
                + suffix_beta[:, kv]
            )
            logits = logits.masked_fill(~visible, float("-inf"))
            vals = values[:, kv, :head_dim].to(dtype)
            rows = prefix_rows[r] if prefix_rows is not None else None
            if rows is not None:
                pk, pb, pv, cu = rows
                a, b = int(cu[kv]), int(cu[kv + 1])
                pre = q[:, h] @ pk[a:b].to(dtype).T * scale + pb[a:b].to(dtype)
                if window:
                    # row k of the head's b - a stands (b - a) + pos - k tokens back
                    back = (b - a) + q_pos[:, None] - torch.arange(b - a)[None, :]
                    pre = pre.masked_fill(back >= window, float("-inf"))
                logits = torch.cat([pre, logits], dim=1)
                vals = torch.cat([pv[a:b].to(dtype), vals])
            lse[q0:q1, h] = torch.logsumexp(logits, dim=1)
            out[q0:q1, h] = torch.softmax(logits, dim=1).nan_to_num(0.0) @ vals
    return out, lse
