"""Highest-attention keys (AM-HighestAttnKeys, H2O+, SnapKV, PyramidKV, KVzip-uniform).

Each key is scored by its softmax attention weights under the reference queries, aggregated
over queries (``rms`` for AM, ``mean`` for H2O/SnapKV, ``max`` for KVzip; paper appendix
"Mean vs. RMS vs. Max Aggregation"), optionally max-pooled along the sequence as SnapKV does
(kernel 7), and the top ``t_h`` keys of each head are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm_compaction.am.attention import max_pool_scores
from vllm_compaction.am.selectors.base import (
    ScoredSelector,
    Selection,
    SelectionProblem,
    top_by_score,
)

__all__ = ["HighestAttentionSelector"]


@dataclass(frozen=True)
class HighestAttentionSelector(ScoredSelector):
    """Top-``t_h`` keys by aggregated attention weight.

    Attributes:
        aggregation: ``"rms" | "mean" | "max" | "weighted-max"`` over the reference queries.
        pool_kernel: odd max-pooling kernel along T applied to the scores, or ``None``.
    """

    name: ClassVar[str] = "highest-attention"
    takes_priority: ClassVar[bool] = True
    aggregation: str = "rms"
    pool_kernel: int | None = None

    def __post_init__(self) -> None:
        self._check_aggregation()
        kernel = self.pool_kernel
        if kernel is not None and (
            not isinstance(kernel, int)
            or isinstance(kernel, bool)
            or kernel < 1
            or kernel % 2 == 0
        ):
            raise ValueError(
                f"pool_kernel must be a positive odd integer or None, got {kernel!r}"
            )

    def select(self, problem: SelectionProblem) -> Selection:
        """Keep the ``budgets[h]`` best-scored keys of each head (the priority keys first)."""
        if problem.reference is None or problem.reference.scores is None:
            raise ValueError("highest-attention selection needs the reference scores")
        raw = problem.reference.scores  # [H, T]
        if self.pool_kernel is None or self.pool_kernel == 1:
            return top_by_score(raw, problem.budgets, priority=problem.priority)
        return top_by_score(
            max_pool_scores(raw, self.pool_kernel),
            problem.budgets,
            tiebreak=raw,
            priority=problem.priority,
        )
