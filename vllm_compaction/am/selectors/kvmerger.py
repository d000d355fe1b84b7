"""KVMerger baseline (Wang et al., 2024; paper appendix "Baselines"): merge runs of similar keys.

Consecutive keys are grouped into clusters; to get exactly ``t_h`` clusters the sequence is cut
at the ``t_h - 1`` lowest cosine similarities between neighbouring keys (instead of a fixed
similarity threshold, so the budget is met exactly). Each cluster becomes one slot: its key is
the cluster's highest-attention token (the anchor), its value a Gaussian-kernel weighted
average of the cluster's values centred at the anchor,
``g_j = exp(-||k^_j - k^_anchor||^2 / (2 sigma^2))`` on unit-normalised keys ``k^``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vllm_compaction.am.selectors.base import (
    ScoredSelector,
    Selection,
    SelectionProblem,
)

__all__ = ["KVMergerSelector"]


@dataclass(frozen=True)
class KVMergerSelector(ScoredSelector):
    """Cluster consecutive keys, keep each cluster's anchor key and a merged value.

    Attributes:
        sigma: width of the Gaussian kernel on the distance between unit-normalised keys
            (distances lie in ``[0, 2]``).
        aggregation: attention aggregation (an ``AGGREGATIONS`` name) that picks the anchor.
    """

    name: ClassVar[str] = "kvmerger"
    provides_values: ClassVar[bool] = True
    sigma: float = 0.5
    aggregation: str = "mean"

    def __post_init__(self) -> None:
        if not (
            isinstance(self.sigma, (int, float))
            and math.isfinite(self.sigma)
            and self.sigma > 0
        ):
            raise ValueError(
                f"sigma must be a finite positive number, got {self.sigma!r}"
            )
        self._check_aggregation()

    def select(self, problem: SelectionProblem) -> Selection:
        """Anchors as indices and merged values, ``t_h`` clusters per head."""
        if problem.reference is None or problem.reference.scores is None:
            raise ValueError("kvmerger needs the reference scores to pick anchors")
        keys, values, budgets = problem.keys, problem.values, problem.budgets
        h, total, d = keys.shape
        t_max = int(budgets.max())
        unit = F.normalize(keys, dim=-1)
        sims = (unit[:, 1:] * unit[:, :-1]).sum(-1)  # [H, T-1] cosine of neighbours
        rank = sims.argsort(dim=-1, stable=True).argsort(dim=-1)
        # the t_h - 1 least similar neighbour pairs
        cuts = rank < (budgets - 1)[:, None]
        cluster = F.pad(cuts.long().cumsum(-1), (1, 0))  # [H, T] cluster id in [0, t_h)
        # [H, t_max]
        anchors = _cluster_argmax(problem.reference.scores, cluster, t_max)
        anchor_of = unit.gather(
            1, anchors.gather(1, cluster)[..., None].expand(h, total, d)
        )
        # [H, T]
        weight = torch.exp(-(unit - anchor_of).square().sum(-1) / (2 * self.sigma**2))
        num = values.new_zeros(h, t_max, d).scatter_add_(
            1, cluster[..., None].expand(h, total, d), weight[..., None] * values
        )
        den = values.new_zeros(h, t_max).scatter_add_(1, cluster, weight)
        merged = num / den.clamp_min(torch.finfo(values.dtype).tiny)[..., None]
        return Selection(indices=anchors, lengths=budgets.clone(), values=merged)


def _cluster_argmax(
    scores: torch.Tensor, cluster: torch.Tensor, t_max: int
) -> torch.Tensor:
    """``[H, t_max]`` position of the highest score in each cluster (first one on ties)."""
    h, total = scores.shape
    best = scores.new_full((h, t_max), float("-inf")).scatter_reduce(
        1, cluster, scores, "amax"
    )
    pos = torch.arange(total, device=scores.device).expand(h, total)
    candidate = torch.where(scores == best.gather(1, cluster), pos, total)
    first = torch.full((h, t_max), total, dtype=torch.long, device=scores.device)
    return first.scatter_reduce(1, cluster, candidate, "amin").clamp_max(total - 1)
