"""Greedy-swap solver: analytic optima on convex toy curves, constraints, determinism."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.budgets.solver import greedy_swap_shares, interpolate_curves

RATIOS = torch.tensor([0.0, 0.05, 0.1, 0.25, 1.0], dtype=torch.float64)


def _exp_curves(rates: list[float], ratios: torch.Tensor = RATIOS) -> torch.Tensor:
    """Convex decreasing toy curves ``J_h(rho) = exp(-a_h rho)``: ``[N, R]``."""
    return torch.stack([torch.exp(-a * ratios) for a in rates])


def test_interpolation_is_linear_and_clipped():
    curves = torch.tensor([[1.0, 0.5, 0.4, 0.1, 0.0]], dtype=torch.float64)
    rho = torch.tensor([0.025], dtype=torch.float64)
    assert float(interpolate_curves(curves, RATIOS, rho)) == pytest.approx(0.75)
    assert (
        float(
            interpolate_curves(
                curves, RATIOS, torch.tensor([-1.0], dtype=torch.float64)
            )
        )
        == 1.0
    )
    assert (
        float(
            interpolate_curves(curves, RATIOS, torch.tensor([2.0], dtype=torch.float64))
        )
        == 0.0
    )


def test_convex_toy_curves_give_the_analytic_optimum():
    # piecewise-linear slopes per head: the optimum fills the steepest segments first
    # (total ratio = 4 * 0.05 = 0.2): head 3 and head 2 take [0, .05], head 1 takes [0, .1]
    shares = greedy_swap_shares(
        _exp_curves([1.0, 10.0, 30.0, 100.0]), RATIOS, 0.05, 0.05 / 4
    )
    assert shares.tolist() == pytest.approx([0.0, 0.5, 0.25, 0.25], abs=1e-9)


def test_linear_curves_order_shares_by_sensitivity():
    # continuous version: J_h = -s_h * rho on a fine grid, diminishing returns from a square root
    ratios = torch.linspace(0, 1, 101, dtype=torch.float64)
    sens = torch.tensor([4.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    curves = -sens[:, None] * ratios.sqrt()[None, :]
    shares = greedy_swap_shares(curves, ratios, 0.1, 0.01 / 4)
    assert torch.argsort(shares, descending=True).tolist() == [0, 3, 2, 1]
    # Lagrange optimum of sum -s_h sqrt(rho_h): rho_h proportional to s_h^2
    expected = sens**2 / (sens**2).sum()
    assert shares.tolist() == pytest.approx(expected.tolist(), abs=0.03)


def test_insensitive_heads_lose_share():
    curves = _exp_curves([20.0, 20.0, 20.0])
    # flat heads
    curves = torch.cat([curves, torch.zeros(2, RATIOS.numel(), dtype=torch.float64)])
    shares = greedy_swap_shares(curves, RATIOS, 0.05, 0.01 / 5)
    assert (shares[3:] == 0).all() and (shares[:3] > 1 / 5).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constraints_on_random_curves(seed):
    gen = torch.Generator().manual_seed(seed)
    n, base = 40, 0.1
    curves = -torch.rand(n, RATIOS.numel(), generator=gen, dtype=torch.float64).cumsum(
        1
    ) * torch.rand(n, 1, generator=gen, dtype=torch.float64)
    shares = greedy_swap_shares(curves, RATIOS, base, 0.1 / n)
    assert shares.shape == (n,) and (shares >= 0).all()
    assert float(shares.sum()) == pytest.approx(1.0, abs=1e-12)
    assert float((shares * n * base).max()) <= 1.0 + 1e-9  # no head beyond ratio 1
    # deterministic
    assert torch.equal(shares, greedy_swap_shares(curves, RATIOS, base, 0.1 / n))


def test_ratio_one_cap_binds():
    # one head wants everything: it stops at ratio 1 (share 1 / (N * r0)), the rest is spread
    curves = torch.zeros(4, RATIOS.numel(), dtype=torch.float64)
    curves[0] = -RATIOS * 10
    curves[1:] = -RATIOS * 0.1
    shares = greedy_swap_shares(curves, RATIOS, 0.5, 0.01 / 4)
    assert float(shares[0] * 4 * 0.5) == pytest.approx(1.0, abs=1e-9)
    assert float(shares.sum()) == pytest.approx(1.0)


def test_flat_curves_stay_uniform():
    shares = greedy_swap_shares(torch.zeros(6, 5), RATIOS, 0.05, 0.01)
    assert shares.tolist() == pytest.approx([1 / 6] * 6)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="curves"):
        greedy_swap_shares(torch.zeros(5), RATIOS, 0.05, 0.01)
    with pytest.raises(ValueError, match="ratios"):
        greedy_swap_shares(torch.zeros(2, 5), RATIOS.flip(0), 0.05, 0.01)
    with pytest.raises(ValueError, match="base_ratio"):
        greedy_swap_shares(torch.zeros(2, 5), RATIOS, 0.0, 0.01)
    with pytest.raises(ValueError, match="step"):
        greedy_swap_shares(torch.zeros(2, 5), RATIOS, 0.05, 0.9)
    with pytest.raises(ValueError, match="finite"):
        greedy_swap_shares(torch.full((2, 5), float("nan")), RATIOS, 0.05, 0.01)
