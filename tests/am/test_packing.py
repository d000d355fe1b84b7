"""CompactedHeads varlen packing: padding round trip, per-head access, slot concatenation."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.am.heads import CompactedHeads, cu_seqlens_from_lengths


def _heads(lengths, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    idx = torch.cat(
        [torch.randperm(50, generator=g)[:t].sort().values for t in lengths]
    )
    return CompactedHeads(
        torch.randn(n, d, generator=g),
        torch.randn(n, generator=g),
        torch.randn(n, d, generator=g),
        idx,
        cu_seqlens_from_lengths(lengths),
    )


def test_padded_round_trip_with_empty_and_full_heads():
    heads = _heads([0, 5, 50, 1])
    keys, beta, values, idx = heads.padded()
    assert keys.shape == (4, 50, 4) and torch.isinf(beta[0]).all()
    back = CompactedHeads.from_padded(keys, beta, values, idx, heads.head_budgets)
    for a, b in zip(
        (heads.keys, heads.beta, heads.values, heads.indices, heads.cu_seqlens),
        (back.keys, back.beta, back.values, back.indices, back.cu_seqlens),
    ):
        assert torch.equal(a, b)
    k2, b2, v2, i2 = heads.head(2)
    assert torch.equal(k2, keys[2, :50]) and torch.equal(i2, idx[2])


def test_concat_slots_orders_by_position_per_head():
    a, b = _heads([3, 0, 2], seed=1), _heads([1, 4, 2], seed=2)
    joined = CompactedHeads.concat_slots([a, b])
    assert joined.head_budgets.tolist() == [4, 4, 4]
    for h in range(3):
        _, _, _, idx = joined.head(h)
        expected = torch.cat([a.head(h)[3], b.head(h)[3]]).sort().values
        assert torch.equal(idx, expected)


def test_exact_keeps_everything_with_zero_bias():
    keys, values = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    heads = CompactedHeads.exact(keys, values, torch.arange(6))
    assert heads.head_budgets.tolist() == [6, 6] and not heads.beta.any()
    assert torch.equal(heads.head(1)[0], keys[1])


@pytest.mark.parametrize(
    "bad",
    [
        dict(cu_seqlens=torch.tensor([0, 2], dtype=torch.int32)),
        dict(beta=torch.zeros(2)),
    ],
)
def test_inconsistent_packing_is_refused(bad):
    fields = dict(
        keys=torch.zeros(3, 4),
        beta=torch.zeros(3),
        values=torch.zeros(3, 4),
        indices=torch.arange(3),
        cu_seqlens=torch.tensor([0, 3], dtype=torch.int32),
    )
    fields.update(bad)
    with pytest.raises(ValueError):
        CompactedHeads(**fields)


def test_negative_lengths_are_refused():
    with pytest.raises(ValueError, match=">= 0"):
        cu_seqlens_from_lengths([2, -1])
