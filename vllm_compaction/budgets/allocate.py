"""Per-head budgets t_{l,h}: uniform, global (KVzip-style), pyramid, schedules; caps and floors.

Every function returns an int64 CPU tensor ``[L, H]`` (host bookkeeping: budgets size the work
and are read on the host) of slots per (layer, KV head) for the
compacted span of ``n`` tokens; rows of layers that are not compacted are 0 and ignored.
The totals are exact: ``sum == round(ratio * n * number of compacted heads)``.
"""

from __future__ import annotations

import torch

__all__ = [
    "total_budget",
    "uniform_budgets",
    "global_budgets",
    "pyramid_budgets",
    "shares_to_budgets",
    "cap_and_fill",
]


def _check_ratio(ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")


def total_budget(ratio: float, n: int, layers: torch.Tensor, num_heads: int) -> int:
    """Slots over all compacted heads: ``round(ratio * n)`` per head on average (>= 1 each)."""
    _check_ratio(ratio)
    heads = int(layers.sum()) * num_heads
    return max(heads, round(ratio * n * heads)) if n > 0 else 0


def _round_to_total(weights: torch.Tensor, total: int) -> torch.Tensor:
    """Integer allocation proportional to ``weights`` (>= 0) summing exactly to ``total``."""
    weights = weights.double().clamp_min(0)
    if weights.sum() <= 0:
        weights = torch.ones_like(weights)
    exact = weights / weights.sum() * total
    base = exact.floor().long()
    remainder = total - int(base.sum())
    if remainder > 0:  # largest remainders get the leftover slots
        order = torch.argsort((exact - base).flatten(), descending=True)[:remainder]
        base.view(-1)[order] += 1
    return base


def uniform_budgets(
    ratio: float, n: int, layers: torch.Tensor, num_heads: int
) -> torch.Tensor:
    """Same t for every compacted head (the total is spread with at most 1 slot difference)."""
    total = total_budget(ratio, n, layers, num_heads)
    weights = layers.double()[:, None].expand(-1, num_heads)
    return cap_and_fill(_round_to_total(weights, total), n, layers)


def check_budget_options(mode: str, *, min_layer_share: float | None = None) -> None:
    """ValueError with one sentence unless the options suit budgets ``mode``.

    The one place the rule lives: ``min_layer_share`` is a number in ``[0, 1]``, and anything
    but 0 needs ``global`` budgets (the other modes have no global ranking to put a floor under).
    """
    if min_layer_share is None:
        return
    if (
        isinstance(min_layer_share, bool)
        or not isinstance(min_layer_share, (int, float))
        or not 0.0 <= min_layer_share <= 1.0
    ):
        raise ValueError(
            f"min_layer_share must be a number in [0, 1], got {min_layer_share!r}"
        )
    if min_layer_share and mode != "global":
        raise ValueError(
            f"min_layer_share applies to global budgets only, not {mode!r}"
        )


def global_budgets(
    scores: list[torch.Tensor | None],
    ratio: float,
    n: int,
    *,
    min_layer_share: float = 0.0,
) -> torch.Tensor:
    """KVzip's global selection: rank every (layer, head, key) score together, keep the top.

    Args:
        scores: per layer ``[H, n]`` key importance (comparable across heads, e.g. max
            attention weight), or None for layers that are not compacted.
        min_layer_share: in ``[0, 1]``; every compacted layer first keeps its own top
            ``min_layer_share`` of an equal split of the total (ranked within the layer), and the
            rest is ranked globally. Max attention gives the lower layers, whose attention is
            local and broad, few slots, and the question's tokens read the prefix through them.
    """
    check_budget_options("global", min_layer_share=min_layer_share)
    layers = torch.tensor([s is not None for s in scores], device="cpu")
    num_heads = next(s.shape[0] for s in scores if s is not None)
    total = total_budget(ratio, n, layers, num_heads)
    # [L_c, H n]
    per_layer = torch.stack([s.flatten() for s in scores if s is not None])
    keep = torch.zeros_like(per_layer, dtype=torch.bool)
    floor = min(per_layer.shape[1], int(min_layer_share * total / per_layer.shape[0]))
    if floor:
        keep.scatter_(1, torch.topk(per_layer, floor, dim=1).indices, True)
    rest = per_layer.masked_fill(keep, float("-inf")).flatten()
    extra = min(total - int(keep.sum()), int((~keep).sum()))
    keep.view(-1)[torch.topk(rest, extra).indices] = True
    counts = keep.view(-1, num_heads, n).sum(-1)
    budgets = torch.zeros(len(scores), num_heads, dtype=torch.long, device="cpu")
    budgets[layers] = counts.cpu()
    return budgets


def pyramid_budgets(
    ratio: float, n: int, layers: torch.Tensor, num_heads: int, *, beta: float = 20.0
) -> torch.Tensor:
    """PyramidKV: layer budgets decrease linearly with depth (heads equal within a layer):
    the last compacted layer gets ``mean / beta``, the first ``2 * mean - mean / beta``."""
    compacted = torch.nonzero(layers).flatten()
    mean = ratio * n
    last = mean / beta
    first = 2 * mean - last
    steps = torch.linspace(
        first, last, len(compacted), dtype=torch.float64, device="cpu"
    )
    weights = torch.zeros(len(layers), num_heads, dtype=torch.float64, device="cpu")
    weights[compacted] = steps[:, None]
    return cap_and_fill(
        _round_to_total(weights, total_budget(ratio, n, layers, num_heads)), n, layers
    )


def shares_to_budgets(
    shares: torch.Tensor, ratio: float, n: int, layers: torch.Tensor
) -> torch.Tensor:
    """A schedule's per-head shares ``[L, H]`` (summing to 1 over compacted heads) -> budgets."""
    shares = shares.double() * layers.double()[:, None]
    total = total_budget(ratio, n, layers, shares.shape[1])
    return cap_and_fill(_round_to_total(shares, total), n, layers)


def cap_and_fill(
    budgets: torch.Tensor,
    n: int,
    layers: torch.Tensor,
    *,
    max_head_ratio: float = 1.0,
    min_head_slots: int = 0,
) -> torch.Tensor:
    """Clip every compacted head to ``[min_head_slots, ceil(max_head_ratio * n)]`` and hand the
    slots cut from capped heads to the others in proportion to their budgets (water-filling),
    keeping the total whenever it fits under the caps."""
    if not 0.0 < max_head_ratio <= 1.0:
        raise ValueError(f"max_head_ratio must be in (0, 1], got {max_head_ratio}")
    if not 0 <= min_head_slots <= n:
        raise ValueError(f"min_head_slots must be in [0, {n}], got {min_head_slots}")
    cap = min(n, -(-int(max_head_ratio * n * 1e6) // int(1e6)))
    mask = layers[:, None].expand_as(budgets)
    out = torch.where(mask, budgets, torch.zeros_like(budgets))
    total = min(int(out.sum()), cap * int(mask.sum()))
    out = torch.where(mask, out.clamp(min_head_slots, cap), out)
    # each round saturates at least one head, so this converges quickly
    for _ in range(64):
        missing = total - int(out.sum())
        room = torch.where(mask, cap - out, torch.zeros_like(out))
        if missing <= 0 or int(room.sum()) == 0:
            break
        weights = torch.where(
            room > 0, out.double() + 1.0, torch.zeros_like(out, dtype=torch.float64)
        )
        out = out + torch.minimum(
            _round_to_total(weights, min(missing, int(room.sum()))), room
        )
    excess = int(out.sum()) - total
    if excess > 0:  # floors pushed the total up: take slots back from the largest heads
        spare = torch.where(mask, out - min_head_slots, torch.zeros_like(out))
        out = out - torch.minimum(_round_to_total(spare.double(), excess), spare)
    return out
