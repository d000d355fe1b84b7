"""The compacted-attention kernel's torch twin (``compacted_attention_reference``, which the
kernel's cases and the CUDA backend's tests trust) against the float reference
``attention_output_and_mass``, token by token: the twin's paging, prefix rows, GQA groups,
causal suffix and suffix bias are the parts checked, the softmax itself is the reference's."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_compaction.am import attention_output_and_mass
from vllm_compaction_kernels.compacted_attention import compacted_attention_reference

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 2, 3, 8, 4


def _batch(seed: int, *, suffix_bias: bool):
    """Three requests: a compacted prefix with uneven heads (one empty) and a chunk of several
    queries, a plain decode, and a prefix with a single query; pages shuffled."""
    gen = torch.Generator().manual_seed(seed)
    suffix_lens, q_lens = [9, 6, 3], [4, 1, 1]
    head_lengths = [[5, 0], None, [2, 7]]
    width = HEAD_DIM + (2 if suffix_bias else 0)
    blocks = [-(-s // BLOCK) for s in suffix_lens]
    order = torch.randperm(sum(blocks) + 2, generator=gen)
    key_pages = torch.randn(
        len(order), KV_HEADS, BLOCK, width, generator=gen, dtype=torch.float64
    )
    value_pages = torch.randn(
        len(order), KV_HEADS, BLOCK, width, generator=gen, dtype=torch.float64
    )
    table = torch.zeros(len(suffix_lens), max(blocks), dtype=torch.int64)
    start = 0
    for r, count in enumerate(blocks):
        table[r, :count] = order[start : start + count]
        start += count
    prefix_rows = []
    for lengths in head_lengths:
        if lengths is None:
            prefix_rows.append(None)
            continue
        n = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        prefix_rows.append(
            (
                torch.randn(n, HEAD_DIM, generator=gen, dtype=torch.float64),
                2.0 * torch.randn(n, generator=gen, dtype=torch.float64),
                torch.randn(n, HEAD_DIM, generator=gen, dtype=torch.float64),
                cu,
            )
        )
    query = torch.randn(
        sum(q_lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen, dtype=torch.float64
    )
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    return dict(
        query=query,
        key_pages=key_pages,
        value_pages=value_pages,
        block_table=table,
        seq_lens=torch.tensor(suffix_lens),
        query_start_loc=starts,
        scale=1 / math.sqrt(HEAD_DIM),
        head_dim=HEAD_DIM,
        prefix_rows=prefix_rows,
        suffix_bias=suffix_bias,
    )


def _expected(batch, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token of each request over its prefix rows and the suffix keys up to its own
    position, by ``attention_output_and_mass`` (KV heads as heads, a group's query heads as queries).
    With a sliding ``window`` only the last ``window`` keys count, prefix rows standing in order
    right before the suffix."""
    query, keys, values = batch["query"], batch["key_pages"], batch["value_pages"]
    out = torch.zeros(query.shape, dtype=torch.float64)
    lse = torch.zeros(query.shape[:2], dtype=torch.float64)
    starts = batch["query_start_loc"].tolist()
    for r, seq_len in enumerate(batch["seq_lens"].tolist()):
        pages = batch["block_table"][r]
        # suffix keys in order: [seq_len, H, width]
        k_suffix = (
            keys[pages].transpose(1, 2).reshape(-1, KV_HEADS, keys.shape[-1])[:seq_len]
        )
        v_suffix = (
            values[pages]
            .transpose(1, 2)
            .reshape(-1, KV_HEADS, keys.shape[-1])[:seq_len]
        )
        bias = (
            k_suffix[..., HEAD_DIM] + k_suffix[..., HEAD_DIM + 1]
            if batch["suffix_bias"]
            else torch.zeros(seq_len, KV_HEADS, dtype=torch.float64)
        )
        q_len = starts[r + 1] - starts[r]
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            for h in range(KV_HEADS):
                k, b, v = (
                    k_suffix[:visible, h, :HEAD_DIM],
                    bias[:visible, h],
                    v_suffix[:visible, h, :HEAD_DIM],
                )
                rows = batch["prefix_rows"][r]
                if rows is not None:
                    pk, pb, pv, cu = rows
                    a, e = int(cu[h]), int(cu[h + 1])
                    k, b, v = (
                        torch.cat([pk[a:e], k]),
                        torch.cat([pb[a:e], b]),
                        torch.cat([pv[a:e], v]),
                    )
                if window is not None:
                    k, b, v = k[-window:], b[-window:], v[-window:]
                token = starts[r] + i
                q = query[token, h * GROUP : (h + 1) * GROUP]
                ref = attention_output_and_mass(
                    q[None],
                    k[None],
                    v[None],
                    scale=batch["scale"],
                    beta=b[None],
                    dtype=torch.float64,
                )
                out[token, h * GROUP : (h + 1) * GROUP] = ref.output[0]
                lse[token, h * GROUP : (h + 1) * GROUP] = ref.log_mass[0]
    return out, lse


@pytest.mark.parametrize("suffix_bias", [False, True])
def test_twin_equals_the_float_reference(suffix_bias):
    batch = _batch(0, suffix_bias=suffix_bias)
    out, lse = compacted_attention_reference(**batch)
    want_out, want_lse = _expected(batch)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_twin_with_a_sliding_window_sees_only_the_last_keys(window):
    """Hybrid models: a sliding layer's prefix rows are the prefix's last keys, so the window
    runs back over the suffix into them (window 1: the query's own key only)."""
    batch = _batch(1, suffix_bias=False)
    out, lse = compacted_attention_reference(**batch, window=window)
    want_out, want_lse = _expected(batch, window)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
