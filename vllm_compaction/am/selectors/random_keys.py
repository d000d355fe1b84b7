"""Random baseline: keep ``t_h`` keys drawn uniformly without replacement (seeded)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_compaction.am.selectors.base import Selection, SelectionProblem, SelectorBase

__all__ = ["RandomSelector"]


@dataclass(frozen=True)
class RandomSelector(SelectorBase):
    """Uniformly random keys; reproducible for a given ``seed`` and shape.

    Attributes:
        seed: seed of the generator (on the keys' device) drawing the permutation of every head.
    """

    name: ClassVar[str] = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    def select(self, problem: SelectionProblem) -> Selection:
        """The first ``t_h`` entries of a seeded random permutation of each head's keys."""
        h, total = problem.keys.shape[:2]
        device = problem.keys.device
        gen = torch.Generator(device=device).manual_seed(self.seed)
        # [H, T]
        perm = torch.rand(h, total, generator=gen, device=device).argsort(dim=-1)
        t_max = int(problem.budgets.max())
        return Selection(
            indices=perm[:, :t_max].to(problem.budgets.device),
            lengths=problem.budgets.clone(),
        )
