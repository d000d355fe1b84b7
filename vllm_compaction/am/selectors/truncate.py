"""Truncation baseline: keep the first or the last ``t_h`` tokens of each head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_compaction.am.selectors.base import Selection, SelectionProblem, SelectorBase

__all__ = ["TruncateSelector"]


@dataclass(frozen=True)
class TruncateSelector(SelectorBase):
    """Keep a contiguous span of tokens.

    Attributes:
        keep: ``"last"`` (the most recent ``t_h`` tokens) or ``"first"``.
    """

    name: ClassVar[str] = "truncate"
    keep: str = "last"

    def __post_init__(self) -> None:
        if self.keep not in ("last", "first"):
            raise ValueError(f"keep must be 'last' or 'first', got {self.keep!r}")

    def select(self, problem: SelectionProblem) -> Selection:
        """Slots ``0..t_h-1`` (first) or ``T-t_h..T-1`` (last) of each head."""
        budgets = problem.budgets
        t_max, total = int(budgets.max()), problem.keys.shape[1]
        slot = torch.arange(t_max, device=budgets.device)[None, :]  # [1, t_max]
        offset = (
            (total - budgets)[:, None]
            if self.keep == "last"
            else torch.zeros_like(budgets)[:, None]
        )
        indices = (offset + slot).clamp_max(total - 1)  # padding slots clamped in range
        return Selection(indices=indices, lengths=budgets.clone())
