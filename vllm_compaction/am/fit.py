"""Closed-form fits of Attention Matching, batched over heads (paper, "Constructing beta and C_v").

* ``beta``: bounded non-negative least squares on ``w = exp(beta)`` so that the compacted
  block's attention mass matches the original one (``nnls_pgd``: unconstrained least-squares
  start, clamp to the box, a few projected-gradient steps with step ``1/L``).
* ``C_v``: ordinary least squares of the compacted attention weights ``X [n, t]`` onto the
  original attention outputs ``Y [n, d]`` (``lstsq_values``).

Both are solved through their normal equations: the Gram matrices are accumulated over query
chunks (so ``n`` can be large), factored in float64 by Cholesky with a tiny relative jitter,
and fall back to a pseudo-inverse for a batch entry that is not positive definite. Padded
slots (``valid`` False) get identity rows so that they solve to 0. The float64 is only the
``t x t`` solves: factoring in fp32 gave the same held-out errors on synthetic heads (to 5 digits
but one case, docs/experiments), but the 1e-9 relative ridge that keeps nearly singular Grams
factorable is below fp32's resolution, and the solves cost little next to the ``n x T`` passes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch

from vllm_compaction.am.attention import (
    LOG2_E,
    block_chunks,
    bmm_row_split,
    chunk_bytes_per_head,
    repeat_heads,
)

__all__ = [
    "SelectedFeatures",
    "fit_beta",
    "fit_values",
    "lstsq_values",
    "nnls_pgd",
    "nnls_pgd_gram",
    "regularized_normal_matrix",
    "solve_normal_equations",
]

logger = logging.getLogger(__name__)

#: Relative diagonal jitter of the normal equations (times the mean diagonal). The equations
#: are factored in fp64, the one place the fits use it: this ridge is below fp32's resolution
#: (2^-23), and on an H100 a batched fp64 Cholesky of ``[8, p, p]`` cost what fp32's did
#: (0.86 vs 0.81 ms at p = 600, 2.55 vs 2.27 ms at p = 1,200).
JITTER = 1e-9
#: Dtype of the Gram products. fp32 products, factored in fp64, gave the same held-out errors as
#: fp64 products (and as QR least squares) at half the cost.
GRAM_DTYPE = torch.float32
#: Fewest query rows per chunk of the Gram products. Each chunk adds ``X_c^T X_c`` into a
#: ``[t, t]`` accumulator that leaves the cache once t is large (16 MB at t = 2,000), and each
#: chunk reads and writes it once: for one head with t = 1,993 and n = 10,000, the two Grams
#: took 1.72 s in 256-row chunks and 1.53 s in 2,048-row ones.
MIN_GRAM_ROWS = 2048


def _masked_gram(gram: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """fp64 copy of ``gram [B, p, p]`` with invalid rows/columns zeroed."""
    g = gram.to(torch.float64)
    if valid is None:
        return g.clone()
    return torch.where(valid[..., :, None] & valid[..., None, :], g, 0.0)


def regularized_normal_matrix(
    gram: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    jitter: float = JITTER,
    ridge: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 matrix ``solve_normal_equations`` factors, and its ridge.

    Parameters
    ----------
    gram : ``[B, p, p]`` symmetric positive semi-definite matrices (any float dtype).
    valid : ``[B, p]`` bool; invalid slots get identity rows and columns.
    jitter : relative ridge: ``jitter * mean(diag G)`` over the valid slots.
    ridge : ``[B, 1]`` absolute ridge to use instead (an incremental factorisation keeps the
        ridge of the matrix it extends).

    Returns
    -------
    ``(G + ridge I [B, p, p] float64, ridge [B, 1] float64)``.
    """
    g = _masked_gram(gram, valid)
    diag = g.diagonal(dim1=-2, dim2=-1)
    if ridge is None:
        count = (
            valid.sum(-1, keepdim=True).clamp_min(1)
            if valid is not None
            else diag.shape[-1]
        )
        ridge = (
            jitter * diag.sum(-1, keepdim=True) / count
            + torch.finfo(torch.float64).tiny
        )
    diag += ridge if valid is None else torch.where(valid, ridge, 1.0)
    return g, ridge


def solve_normal_equations(
    gram: torch.Tensor,
    rhs: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    jitter: float = JITTER,
    ridge: torch.Tensor | None = None,
) -> torch.Tensor:
    """Solve ``(G + jitter * mean(diag G) I) x = b`` for a batch of small SPD systems.

    Parameters
    ----------
    gram : ``[B, p, p]`` symmetric positive semi-definite matrices (any float dtype).
    rhs : ``[B, p, k]`` right-hand sides.
    valid : ``[B, p]`` bool; invalid slots are decoupled and solve to exactly 0.
    jitter : relative ridge keeping a numerically singular Gram factorable.
    ridge : ``[B, 1]`` absolute ridge instead of the relative one.

    Returns
    -------
    ``[B, p, k]`` float64 solution.
    """
    g, _ = regularized_normal_matrix(gram, valid, jitter=jitter, ridge=ridge)
    b = rhs.to(torch.float64)
    if valid is not None:
        b = torch.where(valid[..., None], b, 0.0)
    factor, info = torch.linalg.cholesky_ex(g)
    x = torch.cholesky_solve(b, factor)
    bad = info != 0
    if bad.any():
        logger.debug(
            "normal equations not positive definite in %d of %d systems; using pinv",
            int(bad.sum()),
            len(bad),
        )
        x[bad] = torch.linalg.pinv(g[bad], hermitian=True) @ b[bad]
    return x


def _power_lmax(gram: torch.Tensor, iters: int) -> torch.Tensor:
    """``[B, 1]`` largest-eigenvalue estimate of SPD ``gram [B, p, p]`` by power iteration."""
    v = torch.ones(gram.shape[:-1], dtype=gram.dtype, device=gram.device)
    for _ in range(iters):
        v = torch.nn.functional.normalize((gram @ v[..., None])[..., 0], dim=-1)
    return torch.linalg.vector_norm((gram @ v[..., None])[..., 0], dim=-1, keepdim=True)


def nnls_pgd_gram(
    gram: torch.Tensor,
    rhs: torch.Tensor,
    *,
    lower: float | torch.Tensor = 0.0,
    upper: float | torch.Tensor | None = None,
    iters: int = 0,
    valid: torch.Tensor | None = None,
    power_iters: int = 8,
) -> torch.Tensor:
    """Box-constrained least squares from the normal equations ``G = M^T M``, ``b = M^T y``.

    Unconstrained solution clamped to ``[lower, upper]``, then ``iters`` projected-gradient
    steps on ``1/2 ||M w - y||^2`` (gradient ``G w - b``) with step ``1/L``, ``L ~ ||M||_2^2``
    by power iteration (paper, Algorithm "NNLS via Projected Gradient Descent").

    Parameters
    ----------
    gram : ``[B, p, p]``; rhs : ``[B, p]``; valid : ``[B, p]`` bool (invalid slots -> 0).
    lower, upper : one bound for every weight, or ``[B, p]`` bounds, one per weight
        (``upper=None``: none).

    Returns
    -------
    ``[B, p]`` float64 weights, inside the box on valid slots.
    """
    hi: float | torch.Tensor = float("inf") if upper is None else upper
    for bound in (lower, hi):
        if isinstance(bound, torch.Tensor) and bound.shape != rhs.shape:
            raise ValueError(
                f"per-weight NNLS bounds must be [B, p] = {tuple(rhs.shape)}, got {tuple(bound.shape)}"
            )
    if isinstance(lower, torch.Tensor):
        lower = lower.to(torch.float64)
    if isinstance(hi, torch.Tensor):
        hi = hi.to(torch.float64)
    ordered = lower <= hi
    if not (bool(ordered.all()) if isinstance(ordered, torch.Tensor) else ordered):
        raise ValueError(f"NNLS bounds must satisfy lower <= upper = {upper}")

    def project(x: torch.Tensor) -> torch.Tensor:
        return x.clamp(min=lower).clamp(max=hi)

    w = project(solve_normal_equations(gram, rhs[..., None], valid)[..., 0])
    if iters > 0:
        g = _masked_gram(gram, valid)
        b = rhs.to(torch.float64)
        step = 1.0 / _power_lmax(g, power_iters).clamp_min(
            torch.finfo(torch.float64).tiny
        )
        for _ in range(iters):
            grad = (g @ w[..., None])[..., 0] - b
            w = project(w - step * grad)
    return w if valid is None else torch.where(valid, w, 0.0)


def nnls_pgd(
    matrix: torch.Tensor,
    target: torch.Tensor,
    *,
    lower: float = 0.0,
    upper: float | None = None,
    iters: int = 0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bounded least squares ``min_{lower <= w <= upper} ||M w - y||_2`` by projected gradient.

    Parameters
    ----------
    matrix : ``[B, n, p]`` design matrix ``M`` (e.g. shifted features of the kept keys).
    target : ``[B, n]`` target ``y`` (e.g. shifted attention mass).
    lower, upper : box bounds on ``w`` (``lower >= 0`` makes it NNLS).
    iters : projected-gradient steps after the clamped least-squares start.
    valid : ``[B, p]`` bool mask of real (non-padding) columns.

    Returns
    -------
    ``[B, p]`` weights in ``matrix.dtype`` (0 on invalid columns).
    """
    if matrix.dim() != 3 or target.shape != matrix.shape[:2]:
        raise ValueError(
            f"nnls_pgd needs matrix [B, n, p] and target [B, n], got {tuple(matrix.shape)}, {tuple(target.shape)}"
        )
    m = matrix.to(GRAM_DTYPE)
    gram = m.transpose(1, 2) @ m
    rhs = (m.transpose(1, 2) @ target.to(GRAM_DTYPE)[..., None])[..., 0]
    return nnls_pgd_gram(
        gram, rhs, lower=lower, upper=upper, iters=iters, valid=valid
    ).to(matrix.dtype)


def lstsq_values(
    weights: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Least-squares values ``argmin_C ||X C - Y||_F`` through the normal equations.

    Parameters
    ----------
    weights : ``[B, n, t]`` compacted attention weights ``X`` (rows sum to 1).
    targets : ``[B, n, d]`` original attention outputs ``Y``.
    valid : ``[B, t]`` bool mask of real slots (others get value 0).

    Returns
    -------
    ``[B, t, d]`` values in ``targets.dtype``.
    """
    x = weights.to(GRAM_DTYPE)
    xt = x.transpose(1, 2)
    return solve_normal_equations(xt @ x, xt @ targets.to(GRAM_DTYPE), valid).to(
        targets.dtype
    )


class SelectedFeatures:
    """Shifted features ``phi = exp(l - s)`` of the kept keys, by chunks of query rows: ``l``
    the scaled logits ``scale * Q C_k^T``, ``s`` each query's max logit over the original keys.

    Both fits read them: the mass fit of ``beta`` is a least-squares problem in ``phi``, and the
    compacted attention weights are ``X = phi e^beta / (phi e^beta) 1``, a softmax of ``l + beta``
    without another exp. Computed like the reference pass, in log2 units with ``exp2``. Padded
    slots hold 0. Chunks are sized for the device (``chunk_bytes_per_head``), but at least
    ``MIN_GRAM_ROWS`` rows, so that the consumers' temporaries stay small and their Gram
    products stay efficient; all chunks are computed once and kept when they fit in
    ``budget_bytes``, otherwise every pass recomputes them. Consumers must not modify the
    yielded chunks in place. Every chunk but the last holds whole ``split`` blocks of rows
    (``row_split``), which the products here and in the consumers use.
    """

    def __init__(
        self,
        queries: torch.Tensor,
        kept_keys: torch.Tensor,
        valid: torch.Tensor,
        shift: torch.Tensor,
        *,
        scale: float,
        budget_bytes: int,
    ):
        h, n, _ = queries.shape
        t = max(1, kept_keys.shape[1])
        rows = max(chunk_bytes_per_head(queries), 4 * t * MIN_GRAM_ROWS) // (4 * t)
        self.chunks, self.split = block_chunks(n, rows, h, queries.device)
        self._q = queries * (scale * LOG2_E)  # [H, n, d], logits in log2 units
        self._shift = shift[..., None] * LOG2_E  # [H, n, 1]
        # [H * split, d, t]
        self._kt = repeat_heads(kept_keys.transpose(1, 2), self.split)
        self._mask = (
            None
            if bool(valid.all())
            else torch.where(valid, 0.0, float("-inf")).to(queries.dtype)
        )
        self._cached = (
            [self._compute(sl) for sl in self.chunks]
            if 3 * 4 * h * n * t <= budget_bytes
            else None
        )

    def _compute(self, sl: slice) -> torch.Tensor:
        logits = bmm_row_split(self._q[:, sl], self._kt, self.split).sub_(
            self._shift[:, sl]
        )
        if self._mask is not None:
            logits.add_(self._mask[:, None, :])
        return logits.exp2_()

    def __iter__(self) -> Iterator[tuple[slice, torch.Tensor]]:
        for i, sl in enumerate(self.chunks):
            yield (
                sl,
                (self._cached[i] if self._cached is not None else self._compute(sl)),
            )


class _NormalEquations:
    """``X^T X`` and ``X^T Y`` summed over query chunks ``X [H, c, t]``, ``Y [H, c, k]``.

    Each chunk's rows are cut into ``split`` blocks, each block a batch entry with an
    accumulator of its own, so that the batched products keep every thread busy
    (``row_split``); the blocks are summed at the end.
    """

    def __init__(self, heads: int, t: int, k: int, split: int, device: torch.device):
        self.split = split
        self.gram = torch.zeros(heads, split, t, t, dtype=GRAM_DTYPE, device=device)
        self.rhs = torch.zeros(heads, split, t, k, dtype=GRAM_DTYPE, device=device)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        h, c, t = x.shape
        blocks = self.split if c % self.split == 0 else 1
        x, y = (
            x.reshape(h * blocks, c // blocks, t),
            y.reshape(h * blocks, c // blocks, -1),
        )
        gram, rhs = (
            (self.gram, self.rhs) if blocks > 1 else (self.gram[:, :1], self.rhs[:, :1])
        )
        gram.view(h * blocks, t, t).baddbmm_(x.transpose(1, 2), x)
        rhs.view(h * blocks, t, -1).baddbmm_(x.transpose(1, 2), y)

    def sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[H, t, t]`` Gram matrices and ``[H, t, k]`` right-hand sides."""
        return self.gram.sum(1), self.rhs.sum(1)


def fit_beta(
    features: SelectedFeatures,
    mass: torch.Tensor,
    valid: torch.Tensor,
    *,
    bounds: tuple[float, float],
    iters: int,
    floor: torch.Tensor | None = None,
    ceiling: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mass-matching biases: bounded NNLS of shifted features onto the shifted mass.

    Parameters
    ----------
    features : shifted features ``[H, n, t]`` of the kept keys, by chunk.
    mass : ``[H, n]`` shifted mass of the original keys (the same shift).
    valid : ``[H, t]`` bool real slots.
    bounds : ``(lo, hi)`` bounds on ``beta`` (``w = exp(beta)`` in ``[e^lo, e^hi]``).
    iters : projected-gradient steps.
    floor, ceiling : ``[H, t]`` per-slot lower / upper bounds on ``beta`` in ``bounds``
        (replacing ``lo`` / ``hi``), or ``None``; a slot with both at 0 keeps ``beta = 0``
        and the others are fitted around it.

    Returns
    -------
    ``[H, t]`` float32 ``beta`` (0 on padded slots).
    """
    h, t = valid.shape
    sums = _NormalEquations(h, t, 1, features.split, mass.device)
    for sl, phi in features:
        sums.add(phi.to(GRAM_DTYPE), mass[:, sl, None].to(GRAM_DTYPE))
    gram, rhs = sums.sums()
    lo, hi = bounds
    w = nnls_pgd_gram(
        gram,
        rhs[..., 0],
        lower=math.exp(lo) if floor is None else floor.to(GRAM_DTYPE).exp(),
        upper=math.exp(hi) if ceiling is None else ceiling.to(GRAM_DTYPE).exp(),
        iters=iters,
        valid=valid,
    )
    return torch.where(
        valid, w.clamp_min(torch.finfo(torch.float64).tiny).log(), 0.0
    ).float()


def fit_values(
    features: SelectedFeatures,
    beta: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    *,
    anchor: torch.Tensor | None = None,
    anchor_weight: float = 0.0,
    row_scale: torch.Tensor | None = None,
    pinned: torch.Tensor | None = None,
) -> torch.Tensor:
    """Least-squares values for kept keys with biases ``beta [H, t]`` onto ``targets [H, n, d]``.

    ``row_scale [H, n]`` weighs query ``i``'s squared error by ``row_scale_i^2`` (its rows of
    ``X`` and ``Y`` are scaled after ``X`` is normalised; the features' own row scale cancels
    in that normalisation).

    With ``anchor [H, t, d]`` (the kept keys' original values) and ``anchor_weight = lam > 0``
    the fit is ``min ||X C - Y||^2 + lam * g ||C - anchor||^2``, ``g`` the mean diagonal of
    ``X^T X`` per head: ``(X^T X + lam g I) C = X^T Y + lam g anchor``.

    With ``pinned [H, t]`` bool (and ``anchor``), the pinned slots keep their ``anchor`` values
    exactly and the others are the least-squares fit given them: ``min ||X_f C_f - (Y - X_p
    A_p)||^2``, i.e. ``G_ff C_f = (X^T Y - G A_p)_f`` with ``A_p`` the anchor on the pinned
    slots and 0 elsewhere.

    Returns ``[H, t, d]`` float32 values (0 on padded slots).
    """
    h, t = valid.shape
    sums = _NormalEquations(h, t, targets.shape[-1], features.split, targets.device)
    # e^beta up to a per-head constant, which the row normalisation cancels (no overflow)
    # [H, 1, t]
    weight = (beta - beta.amax(-1, keepdim=True)).exp()[:, None, :].to(GRAM_DTYPE)
    for sl, phi in features:
        # [H, c, t]: softmax(l + beta) up to each row's sum
        x = torch.mul(phi.to(GRAM_DTYPE), weight)
        total = x.sum(-1, keepdim=True)
        # a row with no feature left (every kept key > ~100 nats below the max) weighs nothing
        x.div_(torch.where(total > 0, total, torch.inf))
        y = targets[:, sl].to(GRAM_DTYPE)
        if row_scale is not None:
            scale = row_scale[:, sl, None].to(GRAM_DTYPE)
            x, y = x.mul_(scale), y * scale
        sums.add(x, y)
    gram, rhs = sums.sums()
    if anchor is not None and anchor_weight > 0:
        diag = torch.where(valid, gram.diagonal(dim1=1, dim2=2), 0.0)
        pull = anchor_weight * diag.sum(-1) / valid.sum(-1).clamp_min(1)  # [H]
        gram.diagonal(dim1=1, dim2=2).add_(pull[:, None])
        rhs.add_(pull[:, None, None] * anchor.to(GRAM_DTYPE))
    if pinned is None or not bool(pinned.any()):
        return solve_normal_equations(gram, rhs, valid).float()
    if anchor is None:
        raise ValueError("pinned slots need their anchor values")
    pinned = pinned & valid
    fixed = torch.where(pinned[..., None], anchor.to(GRAM_DTYPE), 0.0)
    # the pinned slots' share of every row's output moves to the right-hand side
    free = solve_normal_equations(gram, rhs - gram @ fixed, valid & ~pinned)
    return torch.where(pinned[..., None], fixed, free.to(GRAM_DTYPE)).float()
