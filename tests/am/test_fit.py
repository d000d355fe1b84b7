"""Bounded NNLS for beta and least-squares values."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_compaction.am import fit as fit_module
from vllm_compaction.am import lstsq_values, nnls_pgd
from vllm_compaction.am.fit import (
    SelectedFeatures,
    fit_beta,
    fit_values,
    nnls_pgd_gram,
    solve_normal_equations,
)


def _features(seed: int, b: int = 3, n: int = 200, p: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(b, n, p, generator=gen))  # positive, like exp features


@pytest.mark.parametrize("iters", [0, 2, 50])
def test_nnls_respects_bounds(iters):
    m = _features(0)
    # infeasible target
    y = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)) * 10
    lo, hi = math.exp(-3), math.exp(3)
    w = nnls_pgd(m, y, lower=lo, upper=hi, iters=iters)
    assert w.shape == (3, 12)
    assert (w >= lo * (1 - 1e-6)).all() and (w <= hi * (1 + 1e-6)).all()


@pytest.mark.parametrize("iters", [0, 2])
def test_per_weight_lower_bounds_hold_and_a_uniform_one_is_the_scalar(iters):
    m = _features(0)
    y = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)) * 10
    gram = m.double().transpose(1, 2) @ m.double()
    rhs = (m.double().transpose(1, 2) @ y.double()[..., None])[..., 0]
    lo, hi = math.exp(-3), math.exp(3)
    scalar = nnls_pgd_gram(gram, rhs, lower=lo, upper=hi, iters=iters)
    uniform = torch.full((3, 12), lo, dtype=torch.float64)
    torch.testing.assert_close(
        nnls_pgd_gram(gram, rhs, lower=uniform, upper=hi, iters=iters), scalar
    )
    lifted = uniform.clone()
    lifted[:, ::2] = 1.0  # every other weight at least 1
    w = nnls_pgd_gram(gram, rhs, lower=lifted, upper=hi, iters=iters)
    assert (w >= lifted * (1 - 1e-9)).all() and (w <= hi).all()
    assert (scalar[:, ::2] < 1).any()  # the bound is active somewhere


def test_nnls_recovers_a_feasible_solution_and_all_ones():
    m = _features(2)
    w_true = torch.rand(3, 12, generator=torch.Generator().manual_seed(3)) + 0.5
    y = (m @ w_true[..., None])[..., 0]
    w = nnls_pgd(m, y, lower=math.exp(-3), upper=math.exp(3), iters=2)
    torch.testing.assert_close(w, w_true, rtol=1e-3, atol=1e-3)
    # t = T: all keys kept, the target is the row sum, so w = 1 (beta = 0)
    w = nnls_pgd(m, m.sum(-1), lower=math.exp(-3), upper=math.exp(3), iters=2)
    torch.testing.assert_close(w, torch.ones(3, 12), rtol=1e-4, atol=1e-4)


def test_pgd_steps_do_not_increase_the_objective():
    m = _features(4)
    y = torch.rand(3, 200, generator=torch.Generator().manual_seed(5)) * 30
    lo, hi = math.exp(-1), math.exp(1)
    loss = [
        ((m @ nnls_pgd(m, y, lower=lo, upper=hi, iters=i)[..., None])[..., 0] - y)
        .square()
        .sum(-1)
        for i in (0, 1, 5, 40)
    ]
    for before, after in zip(loss, loss[1:]):
        assert (after <= before * (1 + 1e-5)).all()


def test_padded_columns_are_decoupled():
    m = _features(6)
    y = m[..., :8].sum(-1)
    valid = torch.arange(12)[None, :] < 8
    w = nnls_pgd(m, y, lower=0.0, iters=3, valid=valid.expand(3, 12))
    assert torch.equal(w[:, 8:], torch.zeros(3, 4))
    torch.testing.assert_close(w[:, :8], torch.ones(3, 8), rtol=1e-4, atol=1e-4)


def test_lstsq_values_satisfy_the_normal_equations():
    gen = torch.Generator().manual_seed(7)
    x = torch.softmax(torch.randn(2, 300, 20, generator=gen) * 2, -1)
    y = torch.randn(2, 300, 6, generator=gen)
    cv = lstsq_values(x, y).double()
    xd, yd = x.double(), y.double()
    grad = xd.transpose(1, 2) @ (xd @ cv - yd)  # X^T (X C - Y)
    assert grad.abs().max() < 1e-4 * (xd.transpose(1, 2) @ yd).abs().max()
    ref = torch.linalg.lstsq(xd, yd).solution
    torch.testing.assert_close(cv, ref, rtol=1e-3, atol=1e-3)


def test_singular_normal_equations_fall_back():
    gram = torch.zeros(2, 3, 3, dtype=torch.float64)
    gram[0] = torch.eye(3)
    # indefinite: no Cholesky
    gram[1] = torch.diag(torch.tensor([2.0, -1.0, 0.0], dtype=torch.float64))
    x = solve_normal_equations(gram, torch.ones(2, 3, 1))
    torch.testing.assert_close(
        x[0, :, 0], torch.ones(3, dtype=torch.float64), rtol=1e-6, atol=1e-6
    )
    # pseudo-inverse
    assert torch.isfinite(x[1]).all() and abs(float(x[1, 0, 0]) - 0.5) < 1e-6


def test_bad_bounds_and_shapes_raise():
    with pytest.raises(ValueError, match="lower <= upper"):
        nnls_pgd_gram(torch.eye(2)[None], torch.ones(1, 2), lower=2.0, upper=1.0)
    with pytest.raises(ValueError, match="lower <= upper"):
        nnls_pgd_gram(
            torch.eye(2)[None],
            torch.ones(1, 2),
            lower=torch.full((1, 2), 2.0),
            upper=1.0,
        )
    with pytest.raises(ValueError, match=r"\[B, p\]"):
        nnls_pgd_gram(torch.eye(2)[None], torch.ones(1, 2), lower=torch.zeros(2))
    with pytest.raises(ValueError, match="matrix"):
        nnls_pgd(torch.ones(2, 3, 4), torch.ones(2, 4))


@pytest.mark.parametrize("n", [6000, 30001])
def test_fits_are_the_same_when_rows_are_split_for_threads(n, monkeypatch):
    """3 heads on 2 threads: the kept keys' features and the Gram products of ``fit_beta`` and
    ``fit_values`` cut each chunk's rows into blocks (``SelectedFeatures.split``). One even chunk,
    or two with an odd last one, must give the features, the NNLS objective and the fitted
    outputs of 1 thread (the fitted numbers themselves carry the normal equations'
    conditioning, so the test compares what they are fitted for)."""
    # chunks of 2 MiB of logits per head (26,214 rows of 20 keys), the size on a core with
    # 512 KiB of L2, whatever this machine's L2: the row counts above are chosen for it
    monkeypatch.setattr(fit_module, "chunk_bytes_per_head", lambda queries: 2 << 20)
    gen = torch.Generator().manual_seed(7)
    h, t, d = 3, 20, 8
    q, kept = torch.randn(h, n, d, generator=gen), torch.randn(h, t, d, generator=gen)
    valid = torch.ones(h, t, dtype=torch.bool)
    valid[1, 15:] = False
    mass = torch.rand(h, n, generator=gen) * 3 + 1
    shift, targets = (
        torch.randn(h, n, generator=gen),
        torch.randn(h, n, d, generator=gen),
    )
    naive = torch.where(
        valid[:, None], 0.3 * q.double() @ kept.double().transpose(1, 2), float("-inf")
    )
    phi = (naive - shift.double()[..., None]).exp()

    def objective(beta):  # the NNLS objective ||Phi w - m||^2 per head
        return (
            (
                (phi @ beta.double().exp().where(valid, 0.0)[..., None])[..., 0]
                - mass.double()
            )
            .square()
            .sum(-1)
        )

    def outputs(beta, values):
        return torch.softmax(naive + beta.double()[:, None], -1) @ values.double()

    before = torch.get_num_threads()
    fits = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            features = SelectedFeatures(
                q, kept, valid, shift, scale=0.3, budget_bytes=1 << 30
            )
            assert features.split == threads and len(features.chunks) == (
                1 if n == 6000 else 2
            )
            torch.testing.assert_close(
                torch.cat([c for _, c in features], 1).double(),
                phi,
                rtol=1e-5,
                atol=1e-6,
            )
            beta = fit_beta(features, mass, valid, bounds=(-3.0, 3.0), iters=2)
            same_beta = fits[1][0] if threads == 2 else beta
            fits[threads] = (
                beta,
                outputs(same_beta, fit_values(features, same_beta, targets, valid)),
            )
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(
        objective(fits[2][0]), objective(fits[1][0]), rtol=1e-4, atol=0
    )
    torch.testing.assert_close(fits[2][1], fits[1][1], rtol=1e-4, atol=1e-5)


def test_value_fit_is_the_softmax_least_squares_and_drops_rows_without_features():
    """``fit_values`` weighs the kept keys by ``phi e^beta`` over its row sum: the same normal
    equations as ``softmax(l + beta)`` (large betas included), and a query whose kept features
    all underflow (its max logit is far above every kept key's) adds nothing instead of NaN."""
    gen = torch.Generator().manual_seed(3)
    h, n, t, d = 2, 300, 12, 8
    q, kept = torch.randn(h, n, d, generator=gen), torch.randn(h, t, d, generator=gen)
    valid = torch.ones(h, t, dtype=torch.bool)
    valid[0, 9:] = False
    beta = torch.randn(h, t, generator=gen) * 2 + 100.0  # e^100 is inf in fp32
    shift, targets = torch.zeros(h, n), torch.randn(h, n, d, generator=gen)
    shift[:, :5] = 500.0  # these queries see no kept feature: 2^(-720) is 0 in fp32
    features = SelectedFeatures(q, kept, valid, shift, scale=0.4, budget_bytes=1 << 30)
    fitted = fit_values(features, beta, targets, valid)
    assert torch.isfinite(fitted).all() and (fitted[0, 9:] == 0).all()
    logits = torch.where(
        valid[:, None], 0.4 * q.double() @ kept.double().transpose(1, 2), float("-inf")
    )
    # the rows that have features
    x = torch.softmax(logits[:, 5:] + beta.double()[:, None], -1)
    expected = lstsq_values(x, targets[:, 5:].double(), valid)
    torch.testing.assert_close(fitted.double(), expected, rtol=1e-3, atol=1e-4)
