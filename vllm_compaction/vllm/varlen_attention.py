"""Attention over a varlen-packed compacted prefix plus the request's ordinary tokens (pure torch).

A request whose prefix is packed varlen (:mod:`.paged_prefix`) attends in two parts:

* the prefix, here (:func:`prefixes_attention`, batched over requests; one request is a batch of
  one): each KV head ``h`` scores its own ``t_h`` rows (keys, beta, values) for the query heads of
  its GQA group, giving a normalised output ``o_p`` and its log-sum-exp ``lse_p``;
* the tokens after the prefix (the suffix), in the engine's stock paged kernel, over the request's
  block table with the prefix blocks cut off.

The stock kernel returns normalised outputs only, so two of its features recover what the merge
needs. Every value row carries a 1 in coordinate ``d`` (:data:`.bias.VALUE_ONES_COORD`), and the
call gets an attention *sink* ``s`` per query head (a logit with no value, added to the
denominator). With ``Z`` and ``S`` the suffix's softmax mass and weighted value sum,

    o = S / (Z + e^s),   o[d] = Z / (Z + e^s),   1 - o[d] = e^s / (Z + e^s),

and the exact result over prefix and suffix, ``(S + e^{lse_p} o_p) / (Z + e^{lse_p})``, divided
through by ``Z + e^s``, is

    (o + w (1 - o[d]) o_p) / (o[d] + w (1 - o[d])),   w = exp(lse_p - s).

Choosing ``s = max lse_p`` over the batch keeps ``w <= 1``, so no term is divided by a small
number and the error stays at the kernel's output precision (tests/serving/test_varlen_math.py).

Stock-width pages have no spare coordinate for the ones, so there the kernel runs twice over the
same rows, without and with the sink: ``o_0 = S / Z`` and ``o = S / (Z + e^s) = o[d] o_0``. The
share ``o[d]`` is the one scalar relating two parallel vectors, ``<o, o_0> / <o_0, o_0>``
(:func:`merge_two_calls`). It is well determined unless ``o_0`` nearly vanishes (the suffix's
values cancel out); such rows are reported, and the caller attends them in torch instead
(:func:`masked_attention`, from the pages read back).
A kernel that returns its log-sum-exp (the CUDA Triton one) merges directly: :func:`merge_by_lse`.
"""

from __future__ import annotations

import torch

from vllm_compaction.vllm.bias import VALUE_ONES_COORD

__all__ = [
    "masked_attention",
    "merge_by_lse",
    "merge_two_calls",
    "merge_with_prefix",
    "prefixes_attention",
    "sink_for",
]


def prefixes_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    beta: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    query_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``R`` requests over ``R`` different varlen prefixes in one batched call.

    ``query [R, n, Hq, d]``; ``keys``/``values [R, N, d]`` and ``beta [R, N]``: request ``r``'s
    prefix rows, head after head, padded to the longest prefix's ``N`` rows; ``cu_seqlens
    [R, H+1]``: head ``h`` of request ``r`` is rows ``cu_seqlens[r, h]:cu_seqlens[r, h+1]``, rows
    past ``cu_seqlens[r, H]`` are padding. Query head ``j`` reads the rows of KV head
    ``j // (Hq / H)``. Returns fp32 ``out [R, n, Hq, d]`` (0 for an empty head) and ``lse
    [R, n, Hq]`` (``-inf`` there).

    Decode steps of sessions on different compacted prefixes each bring one query row: one call
    per prefix would be a few tiny GEMMs and some twenty small ops per request and layer, which
    is what bounds their decode speed on a CPU. Here the GEMMs are batched over requests; the
    price is the padding of ``N`` (caches of one geometry have about the same row count) and
    scoring every query head against every row of its request. Within a request the rows are
    never padded per head: heads are very uneven (one may keep nearly every token while the
    others keep a few), and a ``[H, max t_h]`` layout would cost ``H * max(t_h)`` rows where the
    prefix has ``N``.

    ``window`` (a sliding-window layer of a hybrid model): each head's rows are the prefix's last
    ``t_h`` keys in order, and the query ``i`` tokens after the prefix (``query_offsets [R, n]``)
    sees row ``j`` only while ``t_h + i - j < window``, as the model's window sees positions.
    """
    num_reqs, n, num_q_heads, d = query.shape
    num_kv_heads = cu_seqlens.shape[1] - 1
    group = num_q_heads // num_kv_heads
    num_rows = keys.shape[1]
    if num_rows == 0:  # every prefix is empty in this layer
        return (
            query.new_zeros(query.shape, dtype=torch.float32),
            query.new_full(query.shape[:3], float("-inf"), dtype=torch.float32),
        )
    device = keys.device
    rows = torch.arange(num_rows, device=device).expand(num_reqs, -1).contiguous()
    # the head each row belongs to; padding rows get head H, a bin of their own that is dropped
    # [R, N]
    head_of_row = torch.searchsorted(
        cu_seqlens[:, 1:].to(torch.int64).contiguous(), rows, right=True
    )
    # every query head against every row (one GEMM), then each row keeps its own group's heads:
    # the softmax works on [n, group, N], not [n, Hq, N]
    # [R, n, Hq, N]
    scores = torch.matmul(query.float(), keys.float().transpose(1, 2)[:, None])
    # [R, group, N]
    head = head_of_row.clamp_max(num_kv_heads - 1)  # padding rows read the last head's
    own = head[:, None, :] * group + torch.arange(group, device=device)[None, :, None]
    scores = (
        scores.gather(2, own[:, None].expand(num_reqs, n, group, num_rows)) * scale
        + beta.float()[:, None, None, :]
    )
    if window is not None:
        if query_offsets is None:
            raise ValueError("a sliding-window prefix needs the queries' offsets")
        starts = cu_seqlens[:, :-1].to(torch.int64)
        lengths = cu_seqlens.diff().to(torch.int64)
        # row j of head h stands at logical position T - t_h + j; the query at T + i sees it
        # while t_h + i - j < window
        distance = (lengths.gather(1, head) - (rows - starts.gather(1, head)))[
            :, None, :
        ] + query_offsets.to(device, torch.int64)[:, :, None]  # [R, n, N]
        scores = scores.masked_fill((distance >= window)[:, :, None, :], float("-inf"))
    index = head_of_row[:, None, None, :].expand(num_reqs, n, group, num_rows)
    top = torch.full(
        (num_reqs, n, group, num_kv_heads + 1), float("-inf"), device=device
    )
    top = top.scatter_reduce(3, index, scores, reduce="amax", include_self=True)
    # empty heads: no rows anyway
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top.gather(3, index))  # [R, n, group, N]
    # [R, n, group, H]
    mass = torch.zeros_like(top).scatter_add(3, index, weights)[..., :num_kv_heads]
    # per head: the weights masked to its rows, times the values (one GEMM per request)
    member = (
        head_of_row[:, None, :]
        == torch.arange(num_kv_heads, device=device)[None, :, None]
    ).float()  # [R, H, N]
    per_head = weights[:, :, :, None, :] * member[:, None, None]  # [R, n, group, H, N]
    out = torch.matmul(
        per_head.view(num_reqs, n * group * num_kv_heads, num_rows), values.float()
    )
    out = out.view(num_reqs, n, group, num_kv_heads, d)
    tiny = torch.finfo(torch.float32).tiny
    out = out / mass.clamp_min(tiny)[..., None]
    lse = torch.where(
        mass > 0,
        top[..., :num_kv_heads] + torch.log(mass.clamp_min(tiny)),
        torch.full_like(mass, float("-inf")),
    )
    # [R, n, group, H, ...] -> query-head order h * group + g
    out = out.permute(0, 1, 3, 2, 4).reshape(num_reqs, n, num_q_heads, d)
    lse = lse.permute(0, 1, 3, 2).reshape(num_reqs, n, num_q_heads)
    return out, lse


def masked_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    last_key: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``R`` requests at once: ``query [R, n, Hq, d]`` over ``keys``/``values
    [R, S, H, d]`` (GQA: query head ``j`` reads KV head ``j // (Hq / H)``), row ``(r, i)`` seeing
    keys ``0..last_key[r, i]`` (causal prefill chunks, or decode steps over padded suffixes),
    and with a sliding ``window`` only the last ``window`` of them.

    Returns fp32 ``out [R, n, Hq, d]`` and ``lse [R, n, Hq]``, batched over requests and heads.
    """
    num_reqs, n, num_q_heads, d = query.shape
    num_kv_heads = keys.shape[2]
    group = num_q_heads // num_kv_heads
    q = query.float().view(num_reqs, n, num_kv_heads, group, d)
    scores = torch.einsum("rnhgd,rshd->rhgns", q, keys.float()) * scale
    # [R, n, S]
    key_index = torch.arange(keys.shape[1], device=keys.device)
    last = last_key.to(keys.device)[..., None]
    hidden = key_index > last
    if window is not None:
        hidden |= key_index <= last - window
    scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [R, H, group, n]
    out = torch.einsum(
        "rhgns,rshd->rnhgd", torch.exp(scores - lse[..., None]), values.float()
    )
    return out.reshape(num_reqs, n, num_q_heads, d), lse.permute(0, 3, 1, 2).reshape(
        num_reqs, n, num_q_heads
    )


def sink_for(prefix_lse: torch.Tensor) -> torch.Tensor:
    """Per query head sink logit ``[Hq]``: the largest finite ``lse_p`` over tokens (0 if none)."""
    sink = (
        prefix_lse.amax(dim=0)
        if prefix_lse.shape[0]
        else prefix_lse.new_zeros(prefix_lse.shape[1])
    )
    return torch.where(torch.isfinite(sink), sink, torch.zeros_like(sink)).float()


def merge_with_prefix(
    suffix_out: torch.Tensor,
    head_size: int,
    sink: torch.Tensor,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
) -> torch.Tensor:
    """Exact attention over prefix and suffix from the sink-kernel output (see the module doc).

    ``suffix_out [n, Hq, D]`` is the stock kernel's output with sink ``sink [Hq]`` over value rows
    whose coordinate ``head_size + VALUE_ONES_COORD`` is 1; returns fp32 ``[n, Hq, head_size]``.
    """
    return _merge_shares(
        suffix_out[..., :head_size].float(),
        suffix_out[..., head_size + VALUE_ONES_COORD].float(),
        sink,
        prefix_out,
        prefix_lse,
    )


#: ``merge_two_calls`` trusts a share when the sink-free output is at least this fraction of the
#: prefix output's norm (both are averages of one head's values): the kernel's rounding is then
#: ~1e-7 (fp32) of the share, where a vanishing ``o_0`` would leave it undetermined.
SHARE_MIN_NORM_RATIO = 1e-2


def merge_two_calls(
    plain_out: torch.Tensor,
    sunk_out: torch.Tensor,
    sink: torch.Tensor,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over prefix and suffix from two stock-kernel outputs over the suffix (module doc).

    ``plain_out`` / ``sunk_out [n, Hq, d]``: without and with the sink ``sink [Hq]``. Returns fp32
    ``merged [n, Hq, d]`` and ``trusted [n]``: False for a token whose share is undetermined
    in some head (its ``merged`` row must be recomputed another way).
    """
    plain, sunk = plain_out.float(), sunk_out.float()
    norm = (plain * plain).sum(-1)
    share = (
        (sunk * plain).sum(-1) / norm.clamp_min(torch.finfo(torch.float32).tiny)
    ).clamp(0.0, 1.0)
    prefix_norm = (prefix_out.float() * prefix_out.float()).sum(-1)
    # an empty prefix head needs no share: w = 0
    has_prefix = torch.isfinite(prefix_lse)
    trusted = (
        ~has_prefix | ((norm > 0) & (norm >= SHARE_MIN_NORM_RATIO**2 * prefix_norm))
    ).all(-1)
    return _merge_shares(sunk, share, sink, prefix_out, prefix_lse), trusted


def _merge_shares(
    suffix_out: torch.Tensor,
    suffix_share: torch.Tensor,
    sink: torch.Tensor,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
) -> torch.Tensor:
    """``(o + w (1 - o[d]) o_p) / (o[d] + w (1 - o[d]))`` with ``suffix_share = o[d]``."""
    sink_share = (1.0 - suffix_share).clamp_min(0.0)
    # exp(-inf) = 0: empty prefix
    prefix_weight = torch.exp(prefix_lse - sink[None, :]) * sink_share
    return (suffix_out + prefix_weight[..., None] * prefix_out) / (
        suffix_share + prefix_weight
    )[..., None]


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over two disjoint key sets from each one's output ``[n, Hq, d]`` and ``lse [n, Hq]``."""
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = (weight_a + weight_b).clamp_min(torch.finfo(torch.float32).tiny)
    return (
        out_a.float() * weight_a[..., None] + out_b.float() * weight_b[..., None]
    ) / total[..., None]
