"""OMP key selection (paper, Algorithm "OMP Key Selection (Periodic Refit)"), batched over heads.

Greedy mass matching on the shifted features ``Phi [n, T]`` (``Phi_ij = exp(l_ij - s_i)``) and
the shifted mass ``m = Phi 1``: every round picks the ``k * tau`` keys with the largest
correlation ``c = Phi^T r`` with the residual (the correlation only changes at a refit, so
``tau`` steps of top-``k`` equal one top-``k tau``), then refits ``w >= 0`` on all kept keys
and updates ``r = m - Phi_S w``. ``k = tau = 1`` is plain OMP.

Host syncs: a round reads nothing back from the device until the rounds every head needs
without drops are done; the refit still asks once per round whether any kept key fell under the
floor (a sync is cheaper than the extra Cholesky solve a device-side decision would cost).

Speed: the Gram matrix ``Phi_S^T Phi_S`` and ``Phi_S^T m`` grow by the new columns only
(fp32 products kept in float64), each refit extends the Cholesky factor of the last one by the
new slots' rows (a drop or a refilled slot refactors from its row on) and solves with it,
instead of a least-squares solve from scratch (``t`` refits of plain OMP cost ``O(t^3)``, not
``O(t^4)``; 1.7x faster in all on a layer of 2,000 keys whose heads keep 1,400, 400 and 100),
and the only pass over the whole ``Phi`` per round is the
correlation ``Phi^T r`` (a memory-bound GEMV: OMP costs about ``t / (k tau)`` reads of
``Phi``). That pass reads the reference's key-major low-precision copy of ``Phi`` (fp16 on the
CPU, fp8 on CUDA: it only ranks candidates), while the kept columns that every fit uses are
recomputed in fp32 from their keys. Each refit solves only the slots used so far (the Gram
grows by ``k tau`` columns a round), not the head's whole budget.

Priority keys (``SelectionProblem.priority``, the protected identifiers) are the first round:
each head takes its best of them (by their attention mass, up to ``PRIORITY_SHARE`` of its
budget, as the highest-attention selector keeps them) before any greedy step, and the greedy
rounds fit the mass around them. They are never dropped: one whose weight falls below the
floor is frozen instead, its slot kept at ``beta = min_beta`` and its column taken out of the
equations (as a drop takes it out), so the other weights do not lean on a negative weight that
the floor then removes.

Stabilisers (paper, "Stabilizing beta"): a refit drops kept keys whose unconstrained weight
is below ``e^min_beta`` (they are banned and selection continues until every kept key has
``beta >= min_beta``), and weights are capped at ``e^max_beta``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_compaction.am.fit import regularized_normal_matrix, solve_normal_equations
from vllm_compaction.am.selectors.base import (
    Selection,
    SelectionProblem,
    SelectorBase,
    has_priority,
    priority_lift,
    slot_mask,
)

__all__ = ["OMPSelector"]

logger = logging.getLogger(__name__)

#: ``sum |r|`` of the residual in the half-precision correlation pass (fp16 max is 65504).
CORRELATION_RANGE = 3.0e4
#: Re-solves a refit may spend on dropping keys under the floor; keys a re-solve pushes under
#: it in turn are dropped at the next round's refit (the rounds go on until every head is
#: full), and a key left under it at the very end has its weight clamped to the floor.
DROP_SOLVES = 4


@dataclass(frozen=True)
class OMPSelector(SelectorBase):
    """Orthogonal matching pursuit on the attention mass; yields ``beta = log w`` too.

    Attributes:
        keys_per_step: ``k``, keys added per greedy step.
        refit_interval: ``tau``, greedy steps between weight refits.
        min_beta: kept keys must end with ``beta >= min_beta`` (smaller ones are dropped).
        max_beta: weights are capped at ``exp(max_beta)``.
        max_rounds: if set, a head whose budget would need more than this many refits takes
            ``ceil(t_h / max_rounds)`` keys per round instead of ``k * tau``. Global budgets give
            some heads almost every key; without a bound their refits (one Cholesky of size
            t_h each) dominate the whole compaction. Heads with ``t_h <= max_rounds * k * tau``
            run the paper's algorithm unchanged.
        seed_share: share of each head's budget taken, before the greedy rounds, as the keys
            with the highest attention weight from any reference query (0 = the paper's OMP).
            The mass residual sums over all queries, so a key that a few queries attend sharply
            (a fact fetched by one question) loses to keys many queries attend a little; the
            seed keeps such keys and OMP fits the mass around them.
    """

    name: ClassVar[str] = "omp"
    provides_beta: ClassVar[bool] = True
    takes_priority: ClassVar[bool] = True
    needs_features: ClassVar[bool] = True
    needs_reference: ClassVar[bool] = True
    keys_per_step: int = 1
    refit_interval: int = 1
    min_beta: float = -7.0
    max_beta: float = 7.0
    max_rounds: int | None = None
    seed_share: float = 0.0

    @property
    def score_aggregation(self) -> str | None:
        # the seed round ranks keys by max attention, computed in the reference pass itself
        return "max" if self.seed_share > 0 else None

    def __post_init__(self) -> None:
        if not (
            isinstance(self.seed_share, (int, float)) and 0.0 <= self.seed_share <= 1.0
        ):
            raise ValueError(f"seed_share must be in [0, 1], got {self.seed_share!r}")
        if self.max_rounds is not None and (
            not isinstance(self.max_rounds, int) or self.max_rounds < 1
        ):
            raise ValueError(
                f"max_rounds must be a positive integer or None, got {self.max_rounds!r}"
            )
        for field in ("keys_per_step", "refit_interval"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if not (
            math.isfinite(self.min_beta)
            and math.isfinite(self.max_beta)
            and self.min_beta < self.max_beta
        ):
            raise ValueError(
                f"need finite min_beta < max_beta, got {self.min_beta}, {self.max_beta}"
            )

    def select(self, problem: SelectionProblem) -> Selection:
        """Greedy selection of ``budgets[h]`` keys and their mass weights."""
        ref = problem.reference
        if ref is None or ref.features is None:
            raise ValueError(
                "OMP needs the shifted feature matrix of the reference pass"
            )
        per_round = torch.full_like(
            problem.budgets, self.keys_per_step * self.refit_interval
        )
        if self.max_rounds is not None:
            per_round = torch.maximum(per_round, -(-problem.budgets // self.max_rounds))
        state = _GreedyMassFit(problem, per_round)
        lower, upper = math.exp(self.min_beta), math.exp(self.max_beta)
        if problem.priority is not None and has_priority(problem.priority):
            state.add_priority(problem.priority)
            state.refit_step(lower, upper)
        # one first round on the max-attention scores of the reference pass
        if self.seed_share > 0:
            seeds = (
                torch.ceil(problem.budgets.double() * self.seed_share)
                .long()
                .clamp(0, None)
            )
            state.add_keys(ref.scores, torch.minimum(seeds, problem.budgets))
            state.refit_step(lower, upper)
        # Without drops every head is done after ceil(t_h / per_round) rounds: run those without
        # asking the device, then check once per round (a drop bans a key, so this ends).
        sure = (
            int((-(-(problem.budgets - state.count) // state.per_round)).max())
            if problem.budgets.numel()
            else 0
        )
        for round_ in range(sure + 2 * ref.features.shape[1] + 2):
            if round_ >= sure and bool(state.done.all()):
                break
            state.add_keys()
            state.refit_step(lower, upper)
        indices, weights, lengths = state.packed()
        beta = torch.where(
            slot_mask(lengths, state.t_max), weights.clamp(lower, upper).log(), 0.0
        ).float()
        return Selection(indices=indices, lengths=lengths, beta=beta)


class _GreedyMassFit:
    """Mutable state of batched OMP over slots ``[H, t_max]`` (+ one scratch slot for discarded
    writes). A dropped key frees its slot (``occupied`` False, weight 0); new keys fill free
    slots first, so nothing is ever repacked."""

    def __init__(self, problem: SelectionProblem, per_round: torch.Tensor | int):
        ref = problem.reference
        assert ref is not None and ref.features is not None
        phi_t, budgets = ref.features, problem.budgets
        self.feature_scale = ref.feature_scale
        h, total, n = phi_t.shape
        # [H, T, n], [H, n] x2
        self.phi_t, self.mass, self.shift, self.budgets = (
            phi_t,
            ref.mass,
            ref.shift,
            budgets,
        )
        self.keys, self.queries_scaled = problem.keys, problem.queries * problem.scale
        self.t_max = int(budgets.max())
        per_round = torch.as_tensor(per_round, device=budgets.device).expand(h)
        # [H] keys per round
        self.per_round = per_round.clamp(1, max(1, min(total, self.t_max)))
        self.max_per_round = int(self.per_round.max())  # host copy: no sync per round
        dev, slots = phi_t.device, self.t_max + 1
        self.idx = torch.zeros(h, slots, dtype=torch.long, device=dev)
        self.occupied = torch.zeros(h, slots, dtype=torch.bool, device=dev)
        self.excluded = torch.zeros(h, total, dtype=torch.bool, device=dev)
        # kept columns, as rows
        self.phi_s = torch.zeros(h, slots, n, dtype=torch.float32, device=dev)
        self.gram = torch.zeros(h, slots, slots, dtype=torch.float64, device=dev)
        # Cholesky factor L of the regularised normal equations of slots [0, factor_size), kept
        # while those slots' keys stay; factor_size is a host int (0: nothing to extend). Stored
        # transposed (L^T row-major): a leading block of it, transposed back, is L in the
        # column-major layout LAPACK reads in place (a row-major block is copied per solve).
        self.factor_t = torch.zeros_like(self.gram)
        self.factor_size = 0
        self.ridge = self.gram.new_zeros(h, 1)
        self.rhs = torch.zeros(h, slots, dtype=torch.float64, device=dev)
        self.final_w = torch.zeros(h, self.t_max, dtype=torch.float64, device=dev)
        self.done = budgets <= 0
        # [H, T] keys a refit may not drop (the priority keys), or None; [H, slots] the slots
        # of those frozen at the floor (out of the equations, kept)
        self.pinned: torch.Tensor | None = None
        self.frozen = torch.zeros(h, slots, dtype=torch.bool, device=dev)
        self.high = 0  # slots [high, t_max) have never been used
        self.corr = self._correlation(self.mass)  # [H, T] correlation with r = m

    def _correlation(self, resid: torch.Tensor) -> torch.Tensor:
        """``[H, T]`` fp32 ``Phi^T r`` for ``resid [H, n]``, from the stored features: fp8 ones
        by the Triton GEMV (fp32 residual and sums); fp16 ones by a half GEMV with ``r``
        scaled so that ``sum |r| = CORRELATION_RANGE``: since ``0 <= Phi <= 1`` every product
        then fits the half range, and most entries stay normal numbers."""
        if self.phi_t.dtype != torch.float16:
            from vllm_compaction_kernels.feature_correlation import feature_correlation

            return feature_correlation(self.phi_t, resid, self.feature_scale)
        # [H, 1]
        norm = (
            resid.abs().sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        )
        scaled = (resid * (CORRELATION_RANGE / norm)).to(self.phi_t.dtype)
        # r^T Phi as a row vector times Phi^T: CPU torch runs this layout as a half-precision GEMV
        # (fp32 accumulation); Phi^T @ r[..., None] takes a generic GEMM path 5x slower
        corr = torch.bmm(scaled[:, None, :], self.phi_t.transpose(1, 2))[:, 0]
        return corr.float() * (norm / (CORRELATION_RANGE * self.feature_scale))

    @property
    def count(self) -> torch.Tensor:
        """``[H]`` number of kept keys."""
        return self.occupied.sum(1)

    @property
    def valid(self) -> torch.Tensor:
        """``[H, t_max]`` occupied slots."""
        return self.occupied[:, : self.t_max]

    def add_keys(
        self, scores: torch.Tensor | None = None, counts: torch.Tensor | None = None
    ) -> None:
        """Put the best candidates (up to ``per_round``) in free slots of every unfinished head
        and extend the Gram matrix by their columns. Best means the highest correlation with the
        residual, or the highest ``scores [H, T]`` with ``counts [H]`` keys (a seed round)."""
        h, n = self.mass.shape
        if counts is None:
            scores, counts, r = self.corr, self.per_round, self.max_per_round
        elif scores is None:
            raise ValueError("a seed round needs the keys' scores with its counts")
        else:
            r = int(counts.max())
        if r == 0:
            return
        take = torch.where(
            self.done, 0, torch.minimum(self.budgets - self.count, counts).clamp_min(0)
        )
        top = torch.topk(scores.masked_fill(self.excluded, float("-inf")), r, dim=-1)
        ok = (torch.arange(r, device=take.device) < take[:, None]) & (
            top.values > float("-inf")
        )
        # first free slots
        free = torch.argsort(self.valid.to(torch.int8), dim=1, stable=True)[:, :r]
        # discarded picks go to the scratch slot
        slots = torch.where(ok, free, self.t_max)
        # A slot below the factored ones filled (one a drop freed, or one a head taking fewer
        # keys than the round's widest left free) changes the factor from its row on: keep the
        # rows above it. One host sync a round, as the refit's check for drops.
        if self.factor_size:
            self.factor_size = min(self.factor_size, int(slots.min()))
        heads = torch.arange(h, device=slots.device)[:, None]
        self.idx[heads, slots] = top.indices
        self.occupied[heads, slots] = ok
        self.occupied[:, self.t_max] = False
        self.excluded[heads, top.indices] |= ok
        # [H, r, d]
        picked = self.keys.gather(
            1, top.indices[..., None].expand(h, r, self.keys.shape[-1])
        )
        new = (
            torch.bmm(picked, self.queries_scaled.transpose(1, 2))
            .sub_(self.shift[:, None, :])
            .exp_()
        )
        # [H, r, n] exact fp32 columns of the kept keys, as rows
        new.mul_(ok[..., None])
        self.phi_s[heads, slots] = new
        # the first r free slots lie below high + r (every slot from high on is free): a bound
        # kept on the host instead of reading the largest slot back; rows past the real ones are 0
        self.high = min(self.t_max + 1, self.high + r)
        used = self.high
        # [H, used, r]
        cols = torch.bmm(self.phi_s[:, :used], new.transpose(1, 2)).to(torch.float64)
        self.gram[:, :used].scatter_(2, slots[:, None, :].expand(h, used, r), cols)
        self.gram[:, :, :used].scatter_(
            1, slots[:, :, None].expand(h, r, used), cols.transpose(1, 2)
        )
        self.rhs[heads, slots] = torch.bmm(new, self.mass[..., None])[..., 0].to(
            torch.float64
        )

    def add_priority(self, priority: torch.Tensor) -> None:
        """Keep each head's best ``priority`` keys (bool mask or span ids) first: the best by
        attention mass (the correlation with the whole mass, before any key is kept), up to
        ``PRIORITY_SHARE`` of its budget; a refit never drops them (``pinned``)."""
        lift = priority_lift(self.corr, self.budgets, priority)
        self.pinned = lift
        self.add_keys(self.corr.masked_fill(~lift, float("-inf")), lift.sum(1))

    def refit_step(self, lower: float, upper: float) -> None:
        """Refit the kept keys' weights (dropping or freezing those under ``lower``) and move
        the residual to the weights clamped to ``[lower, upper]``."""
        w = self.refit(lower)
        self.update_residual(torch.where(self.valid, w.clamp(lower, upper), 0.0))

    def _solve(self) -> torch.Tensor:
        """Weights ``[H, t_max]``: the normal equations of the slots below ``high`` (the free
        slots above it are decoupled and would solve to 0), padded with zeros.

        The Cholesky factor of those equations is kept between rounds: a round that only
        fills slots above the factored ones extends it by their rows (a triangular solve and
        a factorisation of ``k tau`` rows) instead of factoring ``high`` rows anew. A drop or
        a slot refilled below the factored ones keeps the rows above it (the factor of a
        leading block depends on that block only); an extension that is not positive definite
        factors anew, with a fresh ridge.
        """
        used = min(self.high, self.t_max)
        w = self.rhs.new_zeros(self.rhs.shape[0], self.t_max)
        if used == 0:
            return w
        valid = self.valid[:, :used]
        if not (0 < self.factor_size <= used and self._extend_factor(used)):
            matrix, ridge = regularized_normal_matrix(self.gram[:, :used, :used], valid)
            factor, info = torch.linalg.cholesky_ex(matrix)
            if bool((info != 0).any()):
                # a numerically singular system: the pseudo-inverse, and no factor to extend
                self.factor_size = 0
                w[:, :used] = solve_normal_equations(
                    self.gram[:, :used, :used],
                    self.rhs[:, :used, None],
                    valid,
                    ridge=ridge,
                )[..., 0]
                return w
            self.factor_t[:, :used, :used] = factor.transpose(1, 2)
            self.ridge, self.factor_size = ridge, used
        rhs = torch.where(valid, self.rhs[:, :used], 0.0)[..., None]
        w[:, :used] = torch.cholesky_solve(rhs, self._lower(used))[..., 0]
        return w

    def _lower(self, size: int) -> torch.Tensor:
        """``[H, size, size]`` view of the factor ``L`` of the first ``size`` slots."""
        return self.factor_t[:, :size, :size].transpose(1, 2)

    def _extend_factor(self, used: int) -> bool:
        """Extend the factor of the first ``factor_size`` slots to ``used`` slots (the block
        rows of the new slots, with the ridge it was factored with); False if the new block's
        Schur complement is not positive definite (the caller factors anew)."""
        known = self.factor_size
        if known == used:
            return True
        valid = self.valid[:, :used]
        corner, _ = regularized_normal_matrix(
            self.gram[:, known:used, known:used], valid[:, known:], ridge=self.ridge
        )
        cross = torch.where(
            valid[:, :known, None] & valid[:, None, known:],
            self.gram[:, :known, known:used],
            0.0,
        )
        # [H, known, m]: L11^-1 G12, the new rows' part left of the diagonal, transposed
        left = torch.linalg.solve_triangular(self._lower(known), cross, upper=False)
        corner -= left.transpose(1, 2) @ left
        block, info = torch.linalg.cholesky_ex(corner)
        if bool((info != 0).any()):
            return False
        self.factor_t[:, :known, known:used] = left
        self.factor_t[:, known:used, known:used] = block.transpose(1, 2)
        self.factor_size = used
        return True

    def refit(self, lower: float) -> torch.Tensor:
        """Unconstrained least-squares weights ``[H, t_max]`` (0 on free slots); frees the
        slots of keys whose weight falls below ``lower`` (they stay excluded; ``pinned`` keys
        stay) and re-solves."""
        w = self._solve()
        for _ in range(DROP_SOLVES):
            drop = self.valid & (w < lower) & ~self.done[:, None]
            freeze = torch.zeros_like(drop)
            if self.pinned is not None:
                pinned = self.pinned.gather(1, self.idx[:, : self.t_max])
                freeze = drop & pinned & ~self.frozen[:, : self.t_max]
                drop &= ~pinned
            remaining = (~self.excluded).sum(1)
            # only if enough keys can replace them
            drop &= (drop.sum(1) <= remaining)[:, None]
            changed = drop | freeze
            if not changed.any():
                break
            logger.debug(
                "OMP drops %d keys with beta below the floor, freezes %d priority keys",
                int(drop.sum()),
                int(freeze.sum()),
            )
            self.occupied[:, : self.t_max] &= ~drop
            if freeze.any():
                self._freeze(freeze)
            # the factor's rows above the first changed slot stay
            first = int(changed.any(0).nonzero()[0, 0])
            self.factor_size = min(self.factor_size, first)
            w = self._solve()
        return w

    def _freeze(self, slots: torch.Tensor) -> None:
        """Take the columns of ``slots [H, t_max]`` out of the equations (zero Gram rows and
        columns, right-hand side and features: their weight solves to 0 and is floored at the
        end) while they keep their keys."""
        mask = torch.nn.functional.pad(slots, (0, 1))  # [H, slots]
        self.frozen |= mask
        self.gram.masked_fill_(mask[:, :, None] | mask[:, None, :], 0.0)
        self.rhs.masked_fill_(mask, 0.0)
        self.phi_s.masked_fill_(mask[..., None], 0.0)

    def update_residual(self, w: torch.Tensor) -> None:
        """Record ``w`` for unfinished heads, mark finished ones, refresh the correlation."""
        self.final_w = torch.where(self.done[:, None], self.final_w, w)
        self.done = self.done | (self.count >= self.budgets)
        used = min(self.high, self.t_max)  # weights above are 0
        # [H, n]
        resid = (
            self.mass - torch.bmm(w[:, None, :used].float(), self.phi_s[:, :used])[:, 0]
        )
        self.corr = self._correlation(resid)

    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(indices [H, t_max], weights [H, t_max], lengths [H])`` with kept slots first."""
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)
        return (
            self.idx[:, : self.t_max].gather(1, order),
            self.final_w.gather(1, order),
            self.count,
        )
