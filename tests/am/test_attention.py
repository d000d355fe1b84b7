"""Reference attention, key scores, and the mixture identity behind mass matching."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_compaction.am import attention_output_and_mass, score_keys
from vllm_compaction.am.attention import max_pool_scores, reference_attention, row_split


def _naive(q, k, v, scale, beta=None):
    """Softmax attention in float64 by the textbook formula: the check of the reference itself."""
    logits = scale * q.double() @ k.double().transpose(1, 2)
    if beta is not None:
        logits = logits + beta.double()[:, None, :]
    return torch.softmax(logits, -1) @ v.double(), torch.logsumexp(logits, -1)


def test_output_and_mass_match_naive_with_bias_and_large_logits():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 8, generator=gen) for n in (50, 30, 30))
    k[:, 0] *= 40.0  # logits far beyond exp's fp32 range without the max shift
    beta = torch.randn(2, 30, generator=gen)
    got = attention_output_and_mass(q, k, v, scale=0.5, beta=beta)
    out, lse = _naive(q, k, v, 0.5, beta)
    torch.testing.assert_close(got.output.double(), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.log_mass.double(), lse, rtol=1e-5, atol=1e-4)


def test_float64_reference_is_exact_to_float64_rounding():
    """``dtype=float64`` computes in float64 throughout, as the oracles need."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(3, n, 8, generator=gen, dtype=torch.float64) for n in (20, 30, 30)
    )
    beta = torch.randn(3, 30, generator=gen, dtype=torch.float64)
    beta[1, 5:] = float("-inf")
    got = attention_output_and_mass(q, k, v, scale=0.7, beta=beta, dtype=torch.float64)
    out, lse = _naive(q, k, v, 0.7, beta)
    assert got.output.dtype == torch.float64 and got.log_mass.dtype == torch.float64
    torch.testing.assert_close(got.output, out, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(got.log_mass, lse, rtol=1e-13, atol=1e-13)


def test_reference_pass_output_and_mass_equal_the_float_reference():
    """The fitting pass (log2 logits, in-place exp, row-split GEMMs) against the reference."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, n, 16, generator=gen) for n in (300, 120, 120))
    k[:, 3] *= 30.0  # logits past exp's range without the shift
    ref = attention_output_and_mass(q, k, v, scale=0.25, dtype=torch.float64)
    got = reference_attention(k, v, q, scale=0.25, aggregation="rms")
    torch.testing.assert_close(got.output.double(), ref.output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        got.log_mass.double(), ref.log_mass, rtol=1e-6, atol=1e-5
    )


def test_empty_block_has_zero_output_and_minus_inf_mass():
    q = torch.randn(1, 4, 8)
    keys = torch.randn(1, 3, 8)
    got = attention_output_and_mass(
        q, keys, keys, beta=torch.full((1, 3), float("-inf"))
    )
    assert torch.equal(got.output, torch.zeros(1, 4, 8))
    assert torch.isneginf(got.log_mass).all()


@pytest.mark.parametrize("aggregation", ["rms", "mean", "max"])
def test_scores_aggregate_softmax_weights(aggregation):
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(3, 700, 8, generator=gen), torch.randn(3, 40, 8, generator=gen)
    a = torch.softmax(q.double() @ k.double().transpose(1, 2) / math.sqrt(8), -1)
    want = {"rms": a.square().mean(1).sqrt(), "mean": a.mean(1), "max": a.amax(1)}[
        aggregation
    ]
    torch.testing.assert_close(
        score_keys(k, q, aggregation=aggregation).double(), want, rtol=1e-5, atol=1e-7
    )


def test_weighted_max_scales_each_querys_weights_by_its_share_of_the_largest_weight():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(3, 700, 8, generator=gen), torch.randn(3, 40, 8, generator=gen)
    w = torch.rand(3, 700, generator=gen) * 4 + 0.5
    a = torch.softmax(q.double() @ k.double().transpose(1, 2) / math.sqrt(8), -1)
    want = (a * (w.double() / w.double().amax(1, keepdim=True))[..., None]).amax(1)
    got = score_keys(k, q, aggregation="weighted-max", query_weights=w)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    # the weights changed the ranking scores
    assert not torch.allclose(got.double(), a.amax(1))
    # a common weight, or none, is KVzip's max; a plain max ignores weights (a repeat changes no max)
    plain = score_keys(k, q, aggregation="max")
    torch.testing.assert_close(
        score_keys(
            k, q, aggregation="weighted-max", query_weights=torch.full((700,), 3.0)
        ),
        plain,
    )
    torch.testing.assert_close(score_keys(k, q, aggregation="weighted-max"), plain)
    torch.testing.assert_close(
        score_keys(k, q, aggregation="max", query_weights=w), plain
    )


def test_pooling_is_a_centred_running_max():
    scores = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    assert max_pool_scores(scores, 3).tolist() == [[5.0, 5.0, 5.0, 0.0, 0.0, 1.0, 1.0]]
    assert torch.equal(max_pool_scores(scores, None), scores)


def test_reference_features_and_mass_are_shifted():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(2, 9, 4, generator=gen),
        torch.randn(2, 6, 4, generator=gen),
        torch.randn(2, 6, 4, generator=gen),
    )
    ref = reference_attention(k, v, q, scale=1.0, keep_features=True)
    phi = ref.features.float()  # [H, T, n] half precision
    assert torch.equal(phi.amax(1), torch.ones(2, 9))
    torch.testing.assert_close(ref.mass, phi.sum(1), rtol=2e-3, atol=0)
    torch.testing.assert_close(ref.log_mass, torch.logsumexp(q @ k.transpose(1, 2), -1))


def test_score_keys_rejects_bad_input():
    with pytest.raises(ValueError, match="keys must be"):
        score_keys(torch.randn(2, 5, 4), torch.randn(3, 5, 4))
    with pytest.raises(ValueError, match="aggregation"):
        score_keys(torch.randn(2, 5, 4), torch.randn(2, 5, 4), aggregation="median")
    with pytest.raises(ValueError, match="pool_kernel"):
        score_keys(torch.randn(2, 5, 4), torch.randn(2, 5, 4), pool_kernel=4)
    with pytest.raises(ValueError, match="query_weights"):
        score_keys(
            torch.randn(2, 5, 4),
            torch.randn(2, 5, 4),
            aggregation="weighted-max",
            query_weights=torch.zeros(5),
        )


@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(1, 12),
    s=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    shift=st.floats(-20.0, 20.0),
)
def test_mixture_identity(t, s, seed, shift):
    """A block matching the original block's local output and mass gives the same attention
    over its concatenation with any fixed block (paper Eq. concat_mixture).

    Each of 5 queries is its own head, compacted to one slot built to match exactly:
    ``beta = log Mass(q; K) - q.c`` and value ``Attn(q; K, V)`` for an arbitrary key ``c``.
    """
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, c = rand(5, 1, 4), rand(5, t, 4), rand(5, t, 4), rand(5, 1, 4)
    kf, vf = rand(5, s, 4) + shift / 4, rand(5, s, 4)
    block = attention_output_and_mass(q, k, v, scale=1.0)
    beta = block.log_mass - (q * c).sum(-1)  # [5, 1]
    compact_k, compact_v = torch.cat([c, kf], 1), torch.cat([block.output, vf], 1)
    bias = torch.cat([beta, torch.zeros(5, s, dtype=beta.dtype)], 1)
    full = attention_output_and_mass(
        q, torch.cat([k, kf], 1), torch.cat([v, vf], 1), scale=1.0
    )
    got = attention_output_and_mass(q, compact_k, compact_v, scale=1.0, beta=bias)
    torch.testing.assert_close(got.output, full.output, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.log_mass, full.log_mass, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_reference_pass_is_the_same_when_rows_are_split_for_threads(threads):
    """3 heads on 2 or 4 threads cut each chunk's rows into blocks (``row_split``); 256-row
    chunks over T = 2,048 keys, the last one odd (165 rows, not split), must still give the
    exact outputs, mass, features and every score."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, n, 8, generator=gen) for n in (421, 2048, 2048))
    want = attention_output_and_mass(q, k, v, scale=0.3, dtype=torch.float64)
    out, lse = want.output, want.log_mass
    a = torch.softmax(0.3 * q.double() @ k.double().transpose(1, 2), -1)
    want = {"rms": a.square().mean(1).sqrt(), "mean": a.mean(1), "max": a.amax(1)}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert (
            row_split(3, 256) == threads
            and row_split(4, 256) == 1
            and row_split(3, 100) == 1
        )
        # GPUs are not split (no CUDA needed to ask)
        assert row_split(3, 256, "cuda") == 1
        for aggregation in ("rms", "mean", "max"):
            ref = reference_attention(
                k, v, q, scale=0.3, aggregation=aggregation, keep_features=True
            )
            torch.testing.assert_close(
                ref.scores.double(), want[aggregation], rtol=1e-5, atol=1e-8
            )
            torch.testing.assert_close(ref.output.double(), out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ref.log_mass.double(), lse, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(
                ref.features.double().sum(1), ref.mass.double(), rtol=2e-3, atol=0
            )
    finally:
        torch.set_num_threads(before)
