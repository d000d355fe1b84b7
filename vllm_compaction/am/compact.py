"""``compact_heads``: select keys -> fit beta -> fit values, batched over KV heads, varlen out.

One chunked pass of the original attention (outputs, mass, key scores or OMP features) feeds
the selector and both fits. Heads with ``t_h = T`` are kept exactly (all keys, ``beta = 0``,
original values: the global optimum of both objectives) and heads with ``t_h = 0`` are empty;
only the others are compacted, in groups of heads of similar budget (each group is padded to
its widest head) small enough that OMP's ``[n, T]`` feature matrices stay under ``memory_limit``
(by default a share of the device's free memory, :mod:`.device`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from vllm_compaction.am.attention import (
    check_query_weights,
    feature_storage,
    reference_attention,
    resolve_scale,
)
from vllm_compaction.am.device import device_limits
from vllm_compaction.am.fit import SelectedFeatures, fit_beta, fit_values
from vllm_compaction.am.heads import CompactedHeads
from vllm_compaction.am.presets import (
    AM_HIGHEST_ATTENTION,
    MethodSpec,
    ResolvedMethod,
    resolve_method,
)
from vllm_compaction.am.refine import refine_slots
from vllm_compaction.am.selectors.base import (
    Selection,
    SelectionProblem,
    has_priority,
    priority_members,
    slot_mask,
)

__all__ = ["STAGES", "compact_heads"]

logger = logging.getLogger(__name__)

#: Heads padded to one width: a group's widest budget is at most this factor of its narrowest...
PAD_FACTOR = 1.25
#: ... unless it is at most this many slots, where the fits cost little next to the reference pass.
SMALL_BUDGET = 256
#: Keys of the ``timings`` dict filled by ``compact_heads`` (wall-clock seconds).
STAGES = ("reference_s", "select_s", "beta_s", "values_s", "refine_s", "total_s")


def _check_inputs(
    keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor
) -> None:
    for name, x in (("keys", keys), ("values", values), ("queries", queries)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
            raise ValueError(
                f"{name} must be a floating-point [H, *, d] tensor, got {getattr(x, 'shape', type(x))}"
            )
    if keys.shape != values.shape:
        raise ValueError(
            f"keys and values must have the same [H, T, d] shape, got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if queries.shape[0] != keys.shape[0] or queries.shape[2] != keys.shape[2]:
        raise ValueError(
            f"queries must be [H, n, d] matching keys {tuple(keys.shape)}, got {tuple(queries.shape)}"
        )


def _check_budgets(
    budget: int | float | Sequence[int] | torch.Tensor, num_heads: int, total: int
) -> torch.Tensor:
    """``[H]`` int64 CPU budgets, each in ``[0, T]`` (host bookkeeping: they size the groups)."""
    if isinstance(budget, bool) or (
        isinstance(budget, float) and not budget.is_integer()
    ):
        raise ValueError(f"budget must be an int or H ints, got {budget!r}")
    b = (
        budget.detach().cpu()
        if isinstance(budget, torch.Tensor)
        else torch.as_tensor(budget, device="cpu")
    )
    if b.is_floating_point() or b.is_complex() or b.dtype == torch.bool:
        raise ValueError(f"budget must hold integers, got dtype {b.dtype}")
    b = b.to(torch.int64).reshape(-1)
    if b.numel() == 1:
        b = b.expand(num_heads).clone()
    if b.numel() != num_heads:
        raise ValueError(
            f"budget must be one int or {num_heads} per-head ints, got {b.numel()} values"
        )
    if (b < 0).any() or (b > total).any():
        raise ValueError(
            f"every head budget must lie in [0, T={total}], got {b.tolist()}"
        )
    return b


def _check_positions(
    positions: torch.Tensor | None, total: int, device: torch.device
) -> torch.Tensor:
    if positions is None:
        return torch.arange(total, device=device)
    pos = torch.as_tensor(positions, device=device)
    if pos.shape != (total,) or pos.is_floating_point() or pos.dtype == torch.bool:
        raise ValueError(
            f"positions must be a [T={total}] integer tensor, got {tuple(pos.shape)} {pos.dtype}"
        )
    return pos.to(torch.int64)


def _head_groups(
    heads: torch.Tensor, budgets: torch.Tensor, bytes_per_head: int, memory_limit: int
) -> list[torch.Tensor]:
    """Split head ids into groups compacted together, padded to the group's widest budget.

    Heads are taken by increasing budget and a group is closed when the next head's budget
    exceeds ``PAD_FACTOR`` times the group's narrowest (above ``SMALL_BUDGET``) or when the
    group's large intermediates would exceed ``memory_limit``. Each fit costs ``n * t_max^2``
    per head of its group, so one head keeping nearly every key (global budgets give some heads
    2,000 slots and others 25) must not pad its neighbours to its width.
    """
    if heads.numel() == 0:
        return []
    size = (
        max(1, memory_limit // max(1, bytes_per_head))
        if bytes_per_head
        else heads.numel()
    )
    if bytes_per_head > memory_limit:
        logger.warning(
            "one head needs %d bytes of features, above memory_limit=%d",
            bytes_per_head,
            memory_limit,
        )
    head_budgets = budgets.to(heads.device)[heads]
    groups: list[list[int]] = []
    narrowest = 0
    order = head_budgets.argsort(stable=True)
    for head, budget in zip(heads[order].tolist(), head_budgets[order].tolist()):
        if (
            not groups
            or len(groups[-1]) >= size
            or budget > max(SMALL_BUDGET, PAD_FACTOR * narrowest)
        ):
            groups.append([])
            narrowest = budget
        groups[-1].append(head)
    if len(groups) > 1:
        logger.debug(
            "compacting %d heads in %d groups (budget widths, memory_limit=%d)",
            heads.numel(),
            len(groups),
            memory_limit,
        )
    return [torch.tensor(g, dtype=heads.dtype, device=heads.device) for g in groups]


def _clock(device: torch.device):
    """``time.perf_counter``, after the queued work of a CUDA device is done: the stages of a
    group are timed on the host, and CUDA kernels run asynchronously (a few syncs per group)."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def _check_key_tensor(
    name: str, value: Any, total: int, dtypes: tuple[torch.dtype, ...], kind: str
) -> None:
    """``ValueError`` with a sentence unless ``value`` is a ``[T]`` tensor of one of
    ``dtypes`` (``kind`` says which, in words)."""
    if (
        not isinstance(value, torch.Tensor)
        or value.dtype not in dtypes
        or value.shape != (total,)
    ):
        raise ValueError(
            f"{name} must be a [T] = [{total}] {kind}, got "
            f"{getattr(value, 'dtype', type(value).__name__)} "
            f"{tuple(getattr(value, 'shape', ()))}"
        )


def _check_priority(
    priority: torch.Tensor | None,
    plan: ResolvedMethod,
    total: int,
    device: torch.device,
) -> torch.Tensor | None:
    """``priority`` on ``device`` if it is a ``[T]`` bool mask or int64 span ids (``-1``:
    none) and the selector honours one; ``ValueError`` with a sentence otherwise; ``None`` when
    no key has priority."""
    if priority is None:
        return None
    _check_key_tensor(
        "priority",
        priority,
        total,
        (torch.bool, torch.int64),
        "bool mask or int64 span ids",
    )
    if not has_priority(priority):
        return None
    if not plan.selector.takes_priority:
        raise ValueError(
            f"method {plan.name!r} selects its keys with {plan.selector.name!r}, which cannot "
            "keep priority keys first; use a highest-attention or OMP method (am, "
            "am-highest-attn, am-omp, kvzip, ...)"
        )
    return priority.to(device)


def _check_floor_keys(
    floor_keys: torch.Tensor | None, priority: torch.Tensor | None, total: int
) -> torch.Tensor | None:
    """``floor_keys`` on the priority's device if it is a ``[T]`` bool mask given with a
    priority; ``ValueError`` with a sentence otherwise; ``None`` when not given (or no key has
    priority, so nothing is raised)."""
    if floor_keys is None:
        return None
    _check_key_tensor("floor_keys", floor_keys, total, (torch.bool,), "bool mask")
    return None if priority is None else floor_keys.to(priority.device)


def _priority_bounds(
    plan: ResolvedMethod,
    priority: torch.Tensor | None,
    indices: torch.Tensor,
    floor_keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``[H, t_max]`` lower and upper bounds on the kept slots' ``beta`` (``None``: the box's):
    ``priority_beta_floor`` below the kept priority keys (those of ``floor_keys`` only, where
    given), or 0 both ways for ``priority_values="exact"``; the box on the others."""
    floor = plan.fit.priority_beta_floor
    exact = plan.fit.priority_values == "exact"
    if priority is None or (floor is None and not exact):
        return None, None
    kept = priority_members(priority)[indices]
    lo, hi = plan.fit.beta_bounds
    own = 0.0 if exact or floor is None else floor
    raised = kept if exact or floor_keys is None else kept & floor_keys[indices]
    lower = torch.where(raised, own, lo).to(torch.float32)
    upper = torch.where(kept, 0.0, hi).to(torch.float32) if exact else None
    return lower, upper


def _priority_pinned(
    plan: ResolvedMethod,
    priority: torch.Tensor | None,
    indices: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor | None:
    """``[H, t_max]`` the kept priority keys whose original values the value fit keeps
    (``priority_values`` ``"direct"`` or ``"exact"``), or ``None``."""
    if plan.fit.priority_values == "lstsq":
        return None
    return _kept_priority(priority, indices, valid)


def _kept_priority(
    priority: torch.Tensor | None, indices: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor | None:
    """``[H, t_max]`` the real slots that hold a priority key, or ``None`` without a priority."""
    return None if priority is None else priority_members(priority)[indices] & valid


def _compact_group(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    budgets: torch.Tensor,
    plan: ResolvedMethod,
    scale: float,
    memory_limit: int,
    clock: dict[str, float],
    weights: torch.Tensor | None,
    priority: torch.Tensor | None = None,
    floor_keys: torch.Tensor | None = None,
) -> Selection:
    """Compact fp32 heads with ``0 < t_h < T``: kept indices with their fitted (or selector-
    given, or zero) ``beta`` and values, padded to the group's ``t_max``. ``weights [H, n]``
    (largest 1) count each query that many times in the scores and every fit; ``priority
    [T]`` keys are kept first (``SelectionProblem.priority``), and ``floor_keys [T]`` (default:
    all of them) get ``priority_beta_floor``."""
    now = _clock(keys.device)
    start = now()
    ref = None
    if plan.needs_reference:
        ref = reference_attention(
            keys,
            values if plan.fit.values == "lstsq" else None,
            queries,
            scale=scale,
            aggregation=plan.selector.score_aggregation,
            keep_features=plan.selector.needs_features,
            query_weights=weights,
        )
    row_scale: torch.Tensor | None = None
    if weights is not None and ref is not None:
        row_scale = weights.sqrt()
        ref = ref.weighted_rows(row_scale)
    clock["reference_s"] += (mark := now()) - start
    sel = plan.selector.select(
        SelectionProblem(keys, values, queries, scale, budgets, ref, priority)
    )
    if ref is not None:
        ref.features = None  # release the [H, T, n] features early
    clock["select_s"] += (start := now()) - mark
    h, t_max = sel.indices.shape
    valid = slot_mask(sel.lengths, t_max)
    kept_keys = keys.gather(1, sel.indices[..., None].expand(h, t_max, keys.shape[-1]))
    features = None
    if ref is not None and (plan.fit.beta == "nnls" or plan.fit.values == "lstsq"):
        features = SelectedFeatures(
            queries, kept_keys, valid, ref.shift, scale=scale, budget_bytes=memory_limit
        )
    # per-slot bounds on beta (None: the box's), for the fit and for the refinement after it
    floor: torch.Tensor | None = None
    ceiling: torch.Tensor | None = None
    if plan.fit.beta == "nnls":
        if ref is None or features is None:
            raise ValueError(f"method {plan.name!r} fits beta without a reference pass")
        floor, ceiling = _priority_bounds(plan, priority, sel.indices, floor_keys)
        beta = fit_beta(
            features,
            ref.mass,
            valid,
            bounds=plan.fit.beta_bounds,
            iters=plan.fit.beta_iters,
            floor=floor,
            ceiling=ceiling,
        )
    elif plan.fit.beta == "selector":
        if sel.beta is None:
            raise ValueError(f"the selector of method {plan.name!r} fitted no beta")
        beta = sel.beta
    else:
        beta = torch.zeros(h, t_max, device=keys.device)
    clock["beta_s"] += (mark := now()) - start
    original = (
        None  # the kept keys' own values: the direct values, or the anchor of the fit
    )
    pinned = _priority_pinned(plan, priority, sel.indices, valid)
    if plan.fit.values == "direct" or plan.fit.value_anchor or pinned is not None:
        original = values.gather(
            1, sel.indices[..., None].expand(h, t_max, values.shape[-1])
        )
    if plan.fit.values == "lstsq":
        if ref is None or ref.output is None or features is None:
            raise ValueError(
                f"method {plan.name!r} fits values without a reference pass"
            )
        fitted = fit_values(
            features,
            beta,
            ref.output,
            valid,
            anchor=original,
            anchor_weight=plan.fit.value_anchor,
            row_scale=row_scale,
            pinned=pinned,
        )
    elif plan.fit.values == "selector":
        if sel.values is None:
            raise ValueError(f"the selector of method {plan.name!r} built no values")
        fitted = sel.values
    else:
        if original is None:
            raise ValueError(f"method {plan.name!r} keeps no values")
        fitted = original
    clock["values_s"] += (start := now()) - mark
    refined_keys = None
    if plan.fit.refine_steps:
        # fit_beta and fit_values ran (refine_steps needs both), so ref has outputs
        assert ref is not None and ref.output is not None
        box_lo, box_hi = plan.fit.beta_bounds
        frozen = _kept_priority(priority, sel.indices, valid)
        refined_keys, beta, fitted = refine_slots(
            queries,
            ref.log_mass,
            ref.output,
            kept_keys,
            beta,
            fitted,
            valid,
            scale=scale,
            steps=plan.fit.refine_steps,
            lr=plan.fit.refine_lr,
            lower=box_lo if floor is None else floor,
            upper=box_hi if ceiling is None else ceiling,
            query_weights=weights,
            frozen=frozen,
            batch=plan.fit.refine_batch or None,
            holdout=plan.fit.refine_holdout,
            key_radius=plan.fit.refine_key_radius,
            freeze_beta=plan.fit.refine_freeze_beta,
        )
        # timed only when it runs: on CUDA each reading of the clock synchronises
        clock["refine_s"] += now() - start
    return Selection(
        indices=sel.indices,
        lengths=sel.lengths,
        beta=beta,
        values=fitted,
        keys=refined_keys,
    )


def _resolve(
    method: MethodSpec | ResolvedMethod, options: dict[str, Any]
) -> ResolvedMethod:
    """The method to run; a name is refused with where its math is (the names are recipes, a
    layer above this package)."""
    if isinstance(method, ResolvedMethod):
        if options:
            raise ValueError(
                f"a ResolvedMethod is resolved already: give its options to resolve_method, "
                f"not to compact_heads ({', '.join(sorted(options))})"
            )
        return method
    if isinstance(method, str):
        raise TypeError(
            f"compact_heads takes the math of a method, a MethodSpec, not the name {method!r}: "
            f"use vllm_compaction.recipes.RECIPES[{method!r}].math"
        )
    return resolve_method(method, options)


def _pack(
    keys: torch.Tensor, padded: Selection, positions: torch.Tensor
) -> CompactedHeads:
    """Sort each head's slots by key index and pack them varlen (padding dropped)."""
    h, total, d = keys.shape
    t_max = padded.indices.shape[1]
    # compact_heads sets both
    assert padded.beta is not None and padded.values is not None
    valid = slot_mask(padded.lengths, t_max)
    # real slots first, by index
    order = torch.where(valid, padded.indices, total).argsort(dim=1)
    idx, beta = padded.indices.gather(1, order), padded.beta.gather(1, order)
    vals = padded.values.gather(1, order[..., None].expand(h, t_max, d))
    kept = (
        keys.gather(1, idx[..., None].expand(h, t_max, d))
        if padded.keys is None
        else padded.keys.gather(1, order[..., None].expand(h, t_max, d))
    )
    return CompactedHeads.from_padded(kept, beta, vals, positions[idx], padded.lengths)


def compact_heads(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    budget: int | Sequence[int] | torch.Tensor,
    /,
    *,
    method: MethodSpec | ResolvedMethod = AM_HIGHEST_ATTENTION,
    scale: float | None = None,
    positions: torch.Tensor | None = None,
    memory_limit: int | None = None,
    timings: dict[str, float] | None = None,
    query_weights: torch.Tensor | None = None,
    priority: torch.Tensor | None = None,
    floor_keys: torch.Tensor | None = None,
    **options: Any,
) -> CompactedHeads:
    """Compact ``H`` KV heads to ``t_h`` slots each by Attention Matching or a baseline.

    The four tensors are positional-only, so that ``values=`` names the value-fit option.

    Parameters
    ----------
    keys, values : ``[H, T, d]`` post-RoPE keys and values (any float dtype).
    queries : ``[H, n, d]`` reference queries; for GQA, all query heads of a group pooled
        per KV head. May be empty (``n = 0``) only for methods that never look at them.
    budget : one int ``t`` for every head, or ``H`` ints ``t_h`` (a sequence or tensor),
        each in ``[0, T]``.
    method : the math, a ``MethodSpec`` (default: AM-HighestAttnKeys); a named method's is
        ``vllm_compaction.recipes.RECIPES[name].math`` (``"am-omp-fast"``, ``"snapkv"``...).
        Or a ``ResolvedMethod`` (``resolve_method``), resolved once for many calls, which
        takes no ``options``.
    scale : softmax scale, default ``1/sqrt(d)``.
    positions : ``[T]`` int64 original positions reported as ``indices`` (default ``0..T-1``).
    memory_limit : bytes allowed for large intermediates (head groups, OMP's features, cached
        fit features); default: what the keys' device has room for (``device_limits``).
    timings : a dict to fill with the wall-clock seconds of each stage (``STAGES``).
    query_weights : ``[n]`` or ``[H, n]`` positive weights: query ``i`` counts ``w_i`` times
        in the key scores (rms, mean), the beta fit, OMP and the value fit, exactly as if its
        row were repeated ``w_i`` times (integer weights), at the cost of one row.
    priority : keys every head keeps before any other, up to half its budget
        (``PRIORITY_SHARE``), then fitted as any kept key: a ``[T]`` bool mask (the
        best-scored of them) or ``[T]`` int64 span ids, ``-1`` for none (the best whole
        spans); for selectors that rank keys by score (``takes_priority``).
    floor_keys : ``[T]`` bool, the priority keys that ``priority_beta_floor`` raises when kept
        (default: every one); the others are fitted in the box as any kept key.
    **options : overrides of the ``MethodSpec``: selector fields (``aggregation``, ``pool_kernel``,
        ``keys_per_step``, ``refit_interval``, ``seed``, ``keep``, ``sigma``...), fit fields
        (``beta``, ``beta_bounds``, ``beta_iters``, ``values``) or ``selector``.

    Returns
    -------
    ``CompactedHeads`` with ``t_h`` slots per head, sorted by position within a head: keys
    and values in the input dtype, ``beta`` float32, ``indices`` from ``positions``.
    """
    _check_inputs(keys, values, queries)
    h, total, d = keys.shape
    budgets = _check_budgets(budget, h, total)
    weights = check_query_weights(query_weights, queries)
    pos = _check_positions(positions, total, keys.device)
    plan = _resolve(method, options)
    priority = _check_priority(priority, plan, total, keys.device)
    floor_keys = _check_floor_keys(floor_keys, priority, total)
    scale = resolve_scale(scale, d)
    if memory_limit is None:
        memory_limit = device_limits(keys.device).memory_limit
    if (
        isinstance(memory_limit, bool)
        or not isinstance(memory_limit, int)
        or memory_limit <= 0
    ):
        raise ValueError(
            f"memory_limit must be a positive number of bytes, got {memory_limit!r}"
        )
    work = ((budgets > 0) & (budgets < total)).nonzero()[:, 0]
    if plan.needs_reference and queries.shape[1] == 0 and work.numel():
        raise ValueError(
            f"method {plan.name!r} needs at least one reference query per head"
        )
    clock = dict.fromkeys(STAGES, 0.0)
    start = time.perf_counter()
    dev, t_max = keys.device, int(budgets.max()) if h else 0
    lengths = budgets.to(dev)
    # exact heads: all keys
    idx = torch.arange(t_max, device=dev).expand(h, t_max).clone()
    beta = torch.zeros(h, t_max, device=dev)
    vals = values[:, :t_max].float().clone()
    # the kept keys themselves, where a refinement moved them off the original ones
    kept_keys = keys[:, :t_max].float().clone() if plan.fit.refine_steps else None
    n, per_head = queries.shape[1], 0
    if plan.selector.needs_features:
        # features [T, n], kept fp32 columns [t + 1, n], fp64 Gram and its factor [t + 1]^2
        per_head = n * (total * feature_storage(dev)[0].itemsize + 4 * (t_max + 1))
        per_head += 2 * 8 * (t_max + 1) ** 2
    for group in _head_groups(work.to(dev), budgets, per_head, memory_limit):
        # fmt: skip
        fitted = _compact_group(
            keys[group].float(),
            values[group].float(),
            queries[group].float(),
            lengths[group],
            plan,
            scale,
            memory_limit,
            clock,
            None if weights is None else weights[group],
            priority,
            floor_keys,
        )
        width = fitted.indices.shape[1]
        # _compact_group fits (or takes from its selector) both
        assert fitted.beta is not None and fitted.values is not None
        idx[group, :width], beta[group, :width] = fitted.indices, fitted.beta
        vals[group, :width], lengths[group] = fitted.values, fitted.lengths
        if kept_keys is not None and fitted.keys is not None:
            kept_keys[group, :width] = fitted.keys
    heads = _pack(
        keys,
        Selection(
            idx,
            lengths,
            beta,
            vals.to(values.dtype),
            None if kept_keys is None else kept_keys.to(keys.dtype),
        ),
        pos,
    )
    clock["total_s"] = _clock(keys.device)() - start
    if timings is not None:
        timings.update(clock)
    logger.debug(
        "compact_heads %s H=%d T=%d n=%d budgets=%s: %s",
        plan.name,
        h,
        total,
        n,
        budgets.tolist(),
        clock,
    )
    return heads
