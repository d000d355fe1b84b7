"""Greedy-swap head-budget solver (the paper's "Nonuniform KV Allocation via Greedy Swaps").

Given per-head sensitivity curves ``J_h(rho)`` (loss as a function of the head's compaction
ratio, measured with every other head at the base ratio ``r0``), find per-head shares ``p_h``
of the total budget (``sum_h p_h = 1``, ``p_h >= 0``) that minimise ``sum_h J_h(p_h * N * r0)``
under the separability assumption. Start uniform and repeatedly move one unit ``step`` of share
from the head that loses least by giving it up to the head that gains most by receiving it,
while that strictly lowers the predicted loss.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["greedy_swap_shares", "interpolate_curves"]

logger = logging.getLogger(__name__)

_EPS = 1e-9  # slack on ratio bounds against float rounding of k * step
_MIN_GAIN = 1e-12  # a swap must lower the predicted loss by more than this


def _check(
    curves: torch.Tensor, ratios: torch.Tensor, base_ratio: float, step: float
) -> None:
    if curves.dim() != 2 or curves.shape[0] < 1:
        raise ValueError(
            f"curves must be a [N, R] tensor with N >= 1 heads, got shape {tuple(curves.shape)}"
        )
    if ratios.dim() != 1 or ratios.numel() != curves.shape[1] or ratios.numel() < 2:
        raise ValueError(
            f"ratios must be [R] with R >= 2 matching curves' columns, got {tuple(ratios.shape)}"
        )
    if not torch.isfinite(curves).all():
        raise ValueError("curves must be finite")
    if (ratios.diff() <= 0).any() or ratios[0] < 0 or ratios[-1] > 1:
        raise ValueError(
            f"ratios must increase strictly within [0, 1], got {ratios.tolist()}"
        )
    if not 0.0 < base_ratio <= 1.0:
        raise ValueError(f"base_ratio must be in (0, 1], got {base_ratio}")
    n = curves.shape[0]
    if not 0.0 < step <= 1.0 / n:
        raise ValueError(
            f"step must be in (0, 1/N] = (0, {1.0 / n:.3g}] share units, got {step}"
        )


def interpolate_curves(
    curves: torch.Tensor, ratios: torch.Tensor, rho: torch.Tensor
) -> torch.Tensor:
    """``J_h(rho_h)`` for every head: piecewise-linear in the measured ``ratios [R]``.

    ``curves [N, R]``, ``rho [N]`` -> ``[N]``. ``rho`` is clipped to ``[0, 1]`` and then to the
    measured range (constant beyond the first and last measured ratio).
    """
    r = ratios.shape[0]
    rho = rho.clamp(0.0, 1.0).clamp(float(ratios[0]), float(ratios[-1]))
    hi = torch.searchsorted(ratios, rho, right=True).clamp(1, r - 1)
    lo = hi - 1
    weight = (rho - ratios[lo]) / (ratios[hi] - ratios[lo])
    j_lo = curves.gather(1, lo[:, None])[:, 0]
    j_hi = curves.gather(1, hi[:, None])[:, 0]
    return j_lo + weight * (j_hi - j_lo)


def _best_swap(g_plus: torch.Tensor, g_minus: torch.Tensor) -> tuple[int, int, float]:
    """``(donor a, receiver b, predicted loss decrease g+_b - g-_a)`` over pairs with a != b."""
    b1 = int(torch.argmax(g_plus))
    a1 = int(torch.argmin(g_minus.index_fill(0, torch.tensor([b1]), float("inf"))))
    a2 = int(torch.argmin(g_minus))
    b2 = int(torch.argmax(g_plus.index_fill(0, torch.tensor([a2]), float("-inf"))))
    gain1 = float(g_plus[b1] - g_minus[a1])
    gain2 = float(g_plus[b2] - g_minus[a2])
    return (a1, b1, gain1) if gain1 >= gain2 else (a2, b2, gain2)


def greedy_swap_shares(
    curves: torch.Tensor,
    ratios: torch.Tensor,
    base_ratio: float,
    step: float,
    max_iters: int = 100_000,
) -> torch.Tensor:
    """Per-head shares of the KV budget from sensitivity curves (paper, Algorithm 2).

    Args:
        curves: ``[N, R]`` loss (or change in loss; offsets do not matter) of head ``h`` when
            it alone is compacted to ``ratios[r]`` and every other head to ``base_ratio``.
        ratios: ``[R]`` strictly increasing measured ratios in ``[0, 1]``; ``J_h`` is linear in
            between and constant outside (include 0 and 1 to cover the whole range).
        base_ratio: ``r0``, the overall ratio at which shares map to ratios
            (``rho_h = p_h * N * r0``).
        step: ``eta``, the share moved per swap (``(0, 1/N]``; ``eta' = eta * N * r0`` in ratio).
        max_iters: safety bound on the number of swaps.

    Returns:
        ``[N]`` float64 shares, ``>= 0``, summing to 1, with ``p_h * N * r0 <= 1``. Deterministic
        (ties go to the lowest head index).
    """
    curves = torch.as_tensor(curves, dtype=torch.float64)
    ratios = torch.as_tensor(ratios, dtype=torch.float64)
    _check(curves, ratios, base_ratio, step)
    n = curves.shape[0]
    units = torch.zeros(n, dtype=torch.float64)  # signed swap units received per head
    eta_r = step * n * base_ratio
    moves = 0
    for _ in range(max_iters):
        rho = (1.0 / n + units * step) * n * base_ratio
        j = interpolate_curves(curves, ratios, rho)
        g_plus = j - interpolate_curves(curves, ratios, rho + eta_r)
        g_plus = g_plus.masked_fill(rho + eta_r > 1.0 + _EPS, float("-inf"))
        g_minus = interpolate_curves(curves, ratios, rho - eta_r) - j
        g_minus = g_minus.masked_fill(rho < eta_r - _EPS, float("inf"))
        donor, receiver, gain = _best_swap(g_plus, g_minus)
        if not gain > _MIN_GAIN:
            break
        units[donor] -= 1
        units[receiver] += 1
        moves += 1
    else:
        logger.warning(
            "greedy swaps stopped at max_iters=%d before converging", max_iters
        )
    shares = (1.0 / n + units * step).clamp_min(0.0)
    logger.info("greedy swaps: %d moves of %.3g share over %d heads", moves, step, n)
    return shares / shares.sum()
