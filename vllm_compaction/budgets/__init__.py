"""Head budgets: uniform, global (KVzip-style), pyramid, or a per-model schedule; how the
global ranking scores keys (``scoring``); which content tokens skip the fit and whether the
template's are ranked with them (``protect``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from vllm_compaction.budgets.allocate import (
    cap_and_fill,
    check_budget_options,
    global_budgets,
    pyramid_budgets,
    shares_to_budgets,
    total_budget,
    uniform_budgets,
)
from vllm_compaction.budgets.protect import (
    FLOOR_SETS,
    PROTECT_MODES,
    PROTECT_ROOMS,
    PROTECT_RULES,
    SINK_TOKENS,
    TEMPLATE_MODES,
    check_floor_on,
    check_priority_exact_depth,
    check_protect,
    check_protect_by,
    check_protect_room,
    check_template,
    depth_band,
    protected_tokens,
    ranked_template,
    singular_tokens,
    span_ids,
)
from vllm_compaction.budgets.schedule import Schedule, load_schedule, packaged_schedule
from vllm_compaction.budgets.scoring import (
    DEFAULT_SCORE_SOFTMAX,
    DEFAULT_SCORE_WEIGHT_POWER,
    SCORE_AGGREGATIONS,
    SCORE_OPTIONS,
    SCORE_SOFTMAXES,
    ScoreOptions,
    check_score_aggregation,
    check_score_softmax,
    check_score_weight_power,
    resolve_score_options,
)

__all__ = [
    "BUDGET_MODES",
    "FLOOR_SETS",
    "PROTECT_MODES",
    "PROTECT_ROOMS",
    "PROTECT_RULES",
    "SINK_TOKENS",
    "TEMPLATE_MODES",
    "DEFAULT_SCORE_SOFTMAX",
    "DEFAULT_SCORE_WEIGHT_POWER",
    "SCORE_AGGREGATIONS",
    "SCORE_OPTIONS",
    "SCORE_SOFTMAXES",
    "Schedule",
    "ScoreOptions",
    "cap_and_fill",
    "check_budget_options",
    "check_floor_on",
    "check_priority_exact_depth",
    "check_protect",
    "check_protect_by",
    "check_protect_room",
    "depth_band",
    "check_template",
    "check_score_aggregation",
    "check_score_softmax",
    "check_score_weight_power",
    "global_budgets",
    "load_schedule",
    "packaged_schedule",
    "protected_tokens",
    "pyramid_budgets",
    "ranked_template",
    "resolve_budgets",
    "resolve_score_options",
    "singular_tokens",
    "span_ids",
    "shares_to_budgets",
    "total_budget",
    "uniform_budgets",
]

BUDGET_MODES = ("uniform", "global", "pyramid", "schedule")


def resolve_budgets(
    mode: str,
    *,
    ratio: float,
    n: int,
    layers: torch.Tensor,
    num_heads: int,
    scores: Callable[[], list[torch.Tensor | None]],
    model_name: str = "",
    max_head_ratio: float = 1.0,
    min_head_slots: int = 0,
    min_layer_share: float = 0.0,
) -> torch.Tensor:
    """Budgets ``[L, H]`` for a mode name or a schedule file path.

    ``scores`` is called only by ``global`` (it costs an off-policy query pass), and only
    ``global`` takes ``min_layer_share``.
    """
    check_budget_options(mode, min_layer_share=min_layer_share)
    if mode == "uniform":
        budgets = uniform_budgets(ratio, n, layers, num_heads)
    elif mode == "global":
        budgets = global_budgets(scores(), ratio, n, min_layer_share=min_layer_share)
    elif mode == "pyramid":
        budgets = pyramid_budgets(ratio, n, layers, num_heads)
    elif mode == "schedule" or Path(mode).suffix == ".json":
        schedule = load_schedule(mode, model_name)
        if schedule.num_layers != len(layers) or schedule.num_kv_heads != num_heads:
            raise ValueError(
                f"schedule is for {schedule.num_layers} layers x {schedule.num_kv_heads} heads, "
                f"the model has {len(layers)} x {num_heads}"
            )
        budgets = shares_to_budgets(schedule.tensor(), ratio, n, layers)
    else:
        raise ValueError(
            f"unknown budgets {mode!r}; choose from {', '.join(BUDGET_MODES)} or a .json file"
        )
    return cap_and_fill(
        budgets, n, layers, max_head_ratio=max_head_ratio, min_head_slots=min_head_slots
    )
