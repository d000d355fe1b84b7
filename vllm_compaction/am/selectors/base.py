"""The key-selector protocol: which original keys (columns of ``[H, T, d]``) each head keeps.

A selector is a dataclass whose fields are its hyperparameters (validated in
``__post_init__``); it subclasses ``SelectorBase`` (or ``ScoredSelector``) and overrides only
the declarations that differ from their defaults. ``compact_heads`` runs one chunked pass of
the original attention first and hands the selector what it declared it needs (per-key scores
with some aggregation, or the full shifted-feature matrix), so no selector recomputes attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from vllm_compaction.am.attention import AGGREGATIONS, ReferenceAttention

__all__ = [
    "ScoredSelector",
    "Selection",
    "SelectionProblem",
    "Selector",
    "SelectorBase",
    "has_priority",
    "priority_lift",
    "priority_members",
    "top_by_score",
    "PRIORITY_SHARE",
    "slot_mask",
]


@dataclass
class SelectionProblem:
    """Everything a selector may look at, for ``H`` heads (all float32).

    Attributes:
        keys, values: ``[H, T, d]`` original keys (post-RoPE) and values.
        queries: ``[H, n, d]`` reference queries.
        scale: softmax scale.
        budgets: ``[H]`` int64 slots per head, ``0 < t_h < T``.
        reference: the original attention's statistics (``scores`` / ``features`` present
            when the selector asked for them).
        priority: the keys each head keeps before any other, up to ``PRIORITY_SHARE`` of
            its budget, or ``None``: a ``[T]`` bool mask (the best-scored of them, key by
            key) or ``[T]`` int64 span ids, ``-1`` for none (the best whole spans: a span is
            kept whole or not at all). Only selectors that declare ``takes_priority`` are
            given one.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    scale: float
    budgets: torch.Tensor
    reference: ReferenceAttention | None
    priority: torch.Tensor | None = None


@dataclass
class Selection:
    """Kept slots of ``H`` heads, padded to ``t_max = max_h t_h``.

    Attributes:
        indices: ``[H, t_max]`` int64 key index in ``[0, T)`` of each slot; slots
            ``>= lengths[h]`` are padding (their index is arbitrary but in range).
        lengths: ``[H]`` int64 number of real slots (equals the budget).
        beta: ``[H, t_max]`` float32 biases fitted by the selector itself (OMP), or ``None``.
        values: ``[H, t_max, d]`` float32 values built by the selector (merging), or ``None``.
        keys: ``[H, t_max, d]`` float32 keys where they are not the original keys at
            ``indices`` (refined slots), or ``None``.
    """

    indices: torch.Tensor
    lengths: torch.Tensor
    beta: torch.Tensor | None = None
    values: torch.Tensor | None = None
    keys: torch.Tensor | None = None


@runtime_checkable
class Selector(Protocol):
    """Chooses ``budgets[h]`` keys per head.

    Class attributes declare the inputs: ``score_aggregation`` (an ``AGGREGATIONS`` name or
    ``None``) asks for ``reference.scores``; ``needs_features`` for ``reference.features``;
    ``needs_reference`` for any reference pass at all. ``provides_beta`` / ``provides_values``
    say whether ``select`` also returns fitted biases / built values; ``takes_priority``
    whether it honours ``SelectionProblem.priority``.
    """

    name: ClassVar[str]
    provides_beta: ClassVar[bool]
    provides_values: ClassVar[bool]
    takes_priority: ClassVar[bool]

    @property
    def score_aggregation(self) -> str | None: ...

    @property
    def needs_features(self) -> bool: ...

    @property
    def needs_reference(self) -> bool: ...

    def select(self, problem: SelectionProblem) -> Selection: ...


class SelectorBase:
    """Default ``Selector`` declarations, so that a selector states only what differs.

    By default a selector returns neither biases nor values, needs no reference pass (so
    neither scores nor features) and takes no priority keys.
    """

    name: ClassVar[str]
    provides_beta: ClassVar[bool] = False
    provides_values: ClassVar[bool] = False
    takes_priority: ClassVar[bool] = False
    needs_features: ClassVar[bool] = False
    needs_reference: ClassVar[bool] = False

    @property
    def score_aggregation(self) -> str | None:
        return None


class ScoredSelector(SelectorBase):
    """A selector driven by ``reference.scores`` aggregated by its ``aggregation`` field
    (``"rms" | "mean" | "max" | "weighted-max"``), which ``_check_aggregation`` validates."""

    needs_reference: ClassVar[bool] = True
    aggregation: str

    @property
    def score_aggregation(self) -> str | None:
        return self.aggregation

    def _check_aggregation(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}"
            )


#: the largest share of a head's budget that priority keys take, so that a head with a small
#: budget keeps its own best keys too (the sink among them)
PRIORITY_SHARE = 0.5


def slot_mask(lengths: torch.Tensor, t_max: int) -> torch.Tensor:
    """``[H, t_max]`` bool: slot ``i`` of head ``h`` is real iff ``i < lengths[h]``."""
    return torch.arange(t_max, device=lengths.device)[None, :] < lengths[:, None]


def priority_members(priority: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: the keys a ``SelectionProblem.priority`` (bool mask or int64 span ids,
    ``-1`` for none) names."""
    return priority if priority.dtype == torch.bool else priority >= 0


def has_priority(priority: torch.Tensor) -> bool:
    """Whether a ``SelectionProblem.priority`` (bool mask or int64 span ids) names any key."""
    return bool(priority_members(priority).any())


def priority_lift(
    scores: torch.Tensor, budgets: torch.Tensor, priority: torch.Tensor
) -> torch.Tensor:
    """``[H, T]`` bool: the priority keys each head keeps first, at most ``PRIORITY_SHARE`` of
    its budget. A bool ``priority`` ranks keys one by one (the best-scored first); int64 span
    ids rank whole spans by their best key and take each one whole while it fits the room left,
    so a head that keeps part of a number keeps all of it."""
    room = (budgets.to(scores.device) * PRIORITY_SHARE).long()
    priority = priority.to(scores.device)
    if priority.dtype == torch.bool:
        prio = priority.expand_as(scores)
        by_score = torch.sort(
            scores.masked_fill(~prio, -math.inf), dim=-1, descending=True, stable=True
        ).indices
        rank = torch.empty_like(by_score).scatter_(
            -1,
            by_score,
            torch.arange(scores.shape[-1], device=scores.device).expand_as(by_score),
        )
        return prio & (rank < room[:, None])
    member = priority >= 0
    spans, inverse = torch.unique(priority[member], return_inverse=True)
    heads = scores.shape[0]
    span_of = inverse.expand(heads, -1)
    sizes = torch.bincount(inverse, minlength=spans.numel())
    best = torch.full(
        (heads, spans.numel()), -math.inf, device=scores.device
    ).scatter_reduce(-1, span_of, scores[:, member], "amax")
    order = torch.sort(best, dim=-1, descending=True, stable=True).indices
    taken = torch.zeros_like(best, dtype=torch.bool)
    used = torch.zeros_like(room)
    rows = torch.arange(heads, device=scores.device)
    # greedy over spans in each head's order, skipping one that no longer fits (a loop over
    # the spans, batched over heads: a prefix holds tens of identifiers)
    for k in range(spans.numel()):
        size = sizes[order[:, k]]
        fits = used + size <= room
        taken[rows, order[:, k]] = fits
        used += size * fits
    lift = torch.zeros_like(scores, dtype=torch.bool)
    lift[:, member] = taken.gather(-1, span_of)
    return lift


def top_by_score(
    scores: torch.Tensor,
    budgets: torch.Tensor,
    tiebreak: torch.Tensor | None = None,
    priority: torch.Tensor | None = None,
) -> Selection:
    """Keep the ``budgets[h]`` highest-scoring keys of each head (``scores [H, T]``).

    Keys in ``priority [T]`` rank above every other key, up to ``PRIORITY_SHARE`` of each
    head's budget: a bool mask lifts the best-scored of them, int64 span ids (``-1``: none)
    the best whole spans (``SelectionProblem.priority``); the rest of the budget goes to the
    best-scored keys left. Ties (e.g. the plateaus of max-pooled scores) go to the higher
    ``tiebreak [H, T]`` score, then to the earlier position, so the result never depends on
    the batch shape.
    """
    t_max = int(budgets.max()) if budgets.numel() else 0
    if priority is not None and has_priority(priority):
        # the lifted keys rank above the best other key, keeping their own order
        lift = priority_lift(scores, budgets, priority)
        span = (scores.amax(-1, keepdim=True) - scores.amin(-1, keepdim=True)) + 1
        scores = torch.where(lift, scores + span, scores)
    order = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
    if tiebreak is not None:
        order = torch.sort(tiebreak, dim=-1, descending=True, stable=True).indices
    ranked = torch.sort(
        scores.gather(-1, order), dim=-1, descending=True, stable=True
    ).indices
    return Selection(
        indices=order.gather(-1, ranked[:, :t_max]), lengths=budgets.clone()
    )
