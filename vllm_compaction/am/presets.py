"""The parts a method's math is composed of: a selector with its options, and a fit.

A ``MethodSpec`` declares the math of one method: which selector keeps the keys (a
``SELECTORS`` name and its options) and how ``beta`` and ``C_v`` are obtained (``FitOptions``;
the fits the named methods share are constants here). The names live one layer up, in
``vllm_compaction.recipes.RECIPES``, where each recipe holds its ``MethodSpec`` with its query
source and budgets. ``resolve_method`` applies caller options on top of a spec (selector
fields, ``FitOptions`` fields, or ``selector=`` to swap the selector, which drops the spec's
selector options) and validates everything with a sentence.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vllm_compaction.am.selectors import SELECTORS, Selector

__all__ = [
    "AM_FIT",
    "AM_HIGHEST_ATTENTION",
    "BETA_MODES",
    "EVICTION_FIT",
    "MERGE_FIT",
    "OMP_FIT",
    "PRIORITY_VALUE_MODES",
    "VALUE_MODES",
    "FitOptions",
    "MethodSpec",
    "ResolvedMethod",
    "resolve_method",
]

BETA_MODES = ("nnls", "zero", "selector")
VALUE_MODES = ("lstsq", "direct", "selector")
#: how the kept priority keys' values are obtained when the others are fitted (``priority_values``)
PRIORITY_VALUE_MODES = ("lstsq", "direct", "exact")


def _check_count(name: str, value: Any, meaning: str = "") -> None:
    """``ValueError`` with a sentence unless ``value`` is an int >= 0 (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"{name} must be a non-negative integer{meaning}, got {value!r}"
        )


@dataclass(frozen=True)
class FitOptions:
    """How the biases and values of the kept keys are obtained.

    Attributes:
        beta: ``"nnls"`` (bounded mass-matching fit), ``"zero"``, or ``"selector"`` (the
            selector's own weights, e.g. OMP's).
        beta_bounds: ``(lo, hi)`` box on ``beta`` for ``"nnls"`` (paper: ``[-3, 3]``), or the
            string ``"lo:hi"`` (as a command-line override gives it).
        beta_iters: projected-gradient steps of the ``"nnls"`` fit (paper: 2).
        values: ``"lstsq"`` (output-matching least squares), ``"direct"`` (original values of
            the kept keys), or ``"selector"`` (the selector's own, e.g. merged values).
        value_anchor: ``lam >= 0``, for ``"lstsq"`` only: pull the fitted values toward the kept
            keys' original ones, ``min ||X C - Y||^2 + lam * g ||C - V||^2`` with ``g`` the mean
            diagonal of ``X^T X`` (so ``lam`` is scale-free). 0 is plain least squares; large
            ``lam`` tends to ``"direct"``. Slots the reference queries barely attend stay near
            their original values (they cannot be fitted from those queries anyway), so exact
            copying of rarely-probed tokens survives the refit.
        priority_beta_floor: for ``"nnls"`` only: the lowest ``beta`` a kept priority key (an
            identifier ``compact_heads`` was told to keep first) may get, inside
            ``beta_bounds``; ``None`` gives it the box's ``lo`` like every other slot. ``0``
            means no kept identifier weighs less than it did in the full context, so the mass
            fit cannot mute the digits the selection kept on purpose.
        priority_values: for ``"lstsq"`` only: ``"lstsq"`` fits the kept priority keys' values
            with the rest; ``"direct"`` keeps their original values and fits the other slots'
            values around them (least squares on what the priority slots leave unexplained).
            A kept name or number is then read back as it was written: the output-matching fit
            would otherwise turn its value into a blend of the dropped keys it stands in for,
            and the answer drifts to the model's guess ("Emily" for "Rosalind"). ``"exact"``
            also keeps their ``beta`` at 0 (with ``beta="nnls"``): each is then the token as
            it was, in the slot the selection gave it, and the other slots' biases and values
            carry the dropped keys' mass and output around them. A pinned value on a slot
            whose bias stands for its dropped neighbours would speak for all of them. With
            ``protect=identifiers-names`` it gave a lost chat fact back and lost a commit hash
            on the conversation tasks at 10%: level with the plain fit, not the default
            (benchmarks/README.md).
        refine_steps: Adam steps refining the kept keys, ``beta`` and the values jointly on
            the Attention Matching objective after the closed-form fits (``am.refine``), so a
            slot's key may leave the original key set; 0 (the paper's method) refines nothing.
            Kept priority keys keep their key and value as the closed-form fit gave them (their
            ``beta`` moves inside its bounds and floor).
        refine_lr: the refinement's Adam step size.
        refine_batch: reference queries per refinement step, drawn afresh each step; 0 takes
            all of them every step.
        refine_holdout: share of the reference queries the refinement sets aside (0 to 0.5):
            each head keeps the iterate, the closed form included, that does best on them, so
            heads with many slots do not trade unseen queries for the fitted ones. 0 returns
            the last step's.
        refine_freeze_beta: ``True`` keeps the kept priority keys' ``beta`` as the closed form
            gave it too (their key and value stay in any case).
        refine_key_radius: how far the refinement may move a kept key, as a share of the
            key's norm (``None``, the default: anywhere); ``0`` keeps the keys as selected
            (only ``beta`` and the values move), so every slot stays an original token at its
            position.
    """

    beta: str = "zero"
    beta_bounds: tuple[float, float] = (-3.0, 3.0)
    beta_iters: int = 2
    values: str = "direct"
    value_anchor: float = 0.0
    priority_beta_floor: float | None = None
    priority_values: str = "lstsq"
    refine_steps: int = 0
    refine_lr: float = 0.01
    refine_batch: int = 0
    refine_holdout: float = 0.0
    refine_key_radius: float | None = None
    refine_freeze_beta: bool = False

    def __post_init__(self) -> None:
        if self.beta not in BETA_MODES:
            raise ValueError(
                f"beta must be one of {', '.join(BETA_MODES)}, got {self.beta!r}"
            )
        if self.values not in VALUE_MODES:
            raise ValueError(
                f"values must be one of {', '.join(VALUE_MODES)}, got {self.values!r}"
            )
        bounds = (
            self.beta_bounds.split(":")
            if isinstance(self.beta_bounds, str)
            else self.beta_bounds
        )
        try:
            lo, hi = (float(b) for b in bounds)
        except (TypeError, ValueError):
            lo, hi = math.nan, math.nan
        if not lo <= hi:  # also refuses NaN
            raise ValueError(
                f"beta_bounds must be a pair (lo, hi) or 'lo:hi' with lo <= hi, got {self.beta_bounds!r}"
            )
        object.__setattr__(self, "beta_bounds", (lo, hi))
        _check_count("beta_iters", self.beta_iters)
        if (
            isinstance(self.value_anchor, bool)
            or not isinstance(self.value_anchor, (int, float))
            or not math.isfinite(self.value_anchor)
            or self.value_anchor < 0
        ):
            raise ValueError(
                f"value_anchor must be a finite number >= 0, got {self.value_anchor!r}"
            )
        if self.value_anchor and self.values != "lstsq":
            raise ValueError(
                f"value_anchor applies to values='lstsq' only, not {self.values!r}"
            )
        object.__setattr__(self, "value_anchor", float(self.value_anchor))
        if self.priority_values not in PRIORITY_VALUE_MODES:
            raise ValueError(
                f"priority_values must be one of {', '.join(PRIORITY_VALUE_MODES)}, "
                f"got {self.priority_values!r}"
            )
        if self.priority_values != "lstsq" and self.values != "lstsq":
            raise ValueError(
                f"priority_values applies to values='lstsq' only, not {self.values!r}"
            )
        if self.priority_values == "exact" and self.priority_beta_floor is not None:
            raise ValueError(
                "priority_values='exact' keeps the kept priority keys' beta at 0: "
                "drop priority_beta_floor"
            )
        _check_count("refine_steps", self.refine_steps)
        if self.refine_steps and (self.beta != "nnls" or self.values != "lstsq"):
            raise ValueError(
                "refine_steps refines Attention Matching's fits: it needs beta='nnls' and "
                f"values='lstsq', not beta={self.beta!r}, values={self.values!r}"
            )
        if (
            isinstance(self.refine_lr, bool)
            or not isinstance(self.refine_lr, (int, float))
            or not math.isfinite(self.refine_lr)
            or self.refine_lr <= 0
        ):
            raise ValueError(
                f"refine_lr must be a finite number > 0, got {self.refine_lr!r}"
            )
        object.__setattr__(self, "refine_lr", float(self.refine_lr))
        _check_count("refine_batch", self.refine_batch, " (0: every query each step)")
        if (
            isinstance(self.refine_holdout, bool)
            or not isinstance(self.refine_holdout, (int, float))
            or not 0 <= self.refine_holdout < 0.5
        ):
            raise ValueError(
                f"refine_holdout must be a share in [0, 0.5), got {self.refine_holdout!r}"
            )
        object.__setattr__(self, "refine_holdout", float(self.refine_holdout))
        radius = self.refine_key_radius
        if radius is not None:
            if (
                isinstance(radius, bool)
                or not isinstance(radius, (int, float))
                or not 0 <= radius < math.inf
            ):
                raise ValueError(
                    "refine_key_radius must be a finite number >= 0 (leave it out for no "
                    f"limit), got {radius!r}"
                )
            object.__setattr__(self, "refine_key_radius", float(radius))
        if not isinstance(self.refine_freeze_beta, bool):
            raise ValueError(
                f"refine_freeze_beta must be true or false, got {self.refine_freeze_beta!r}"
            )
        floor = self.priority_beta_floor
        if floor is not None:
            if (
                isinstance(floor, bool)
                or not isinstance(floor, (int, float))
                or not lo <= floor <= hi
            ):
                raise ValueError(
                    f"priority_beta_floor must be a number inside beta_bounds [{lo}, {hi}], "
                    f"got {floor!r}"
                )
            if self.beta != "nnls":
                raise ValueError(
                    f"priority_beta_floor applies to beta='nnls' only, not {self.beta!r}"
                )
            object.__setattr__(self, "priority_beta_floor", float(floor))


@dataclass(frozen=True)
class MethodSpec:
    """The math of a method: ``selector`` (a ``SELECTORS`` key) with ``selector_options`` (its
    fields; any mapping, kept read-only), and its ``fit``. A declaration: ``resolve_method``
    checks it, with a caller's options on top, before any work."""

    selector: str
    selector_options: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({})
    )
    fit: FitOptions = FitOptions()

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "selector_options", MappingProxyType(dict(self.selector_options))
        )


#: Attention Matching's fits: bounded NNLS for ``beta`` (paper: ``[-3, 3]``, 2 steps) and
#: output-matching least squares for the values.
AM_FIT = FitOptions(beta="nnls", beta_bounds=(-3.0, 3.0), beta_iters=2, values="lstsq")
#: AM with OMP: OMP's own weights are the biases; the values are fitted as in ``AM_FIT``.
OMP_FIT = FitOptions(beta="selector", values="lstsq")
#: Eviction (the baselines): the kept keys as they were, no bias, their original values.
EVICTION_FIT = FitOptions(beta="zero", values="direct")
#: Merging (KVMerger): no bias, the values the selector merged.
MERGE_FIT = FitOptions(beta="zero", values="selector")
#: The paper's AM-HighestAttnKeys (keys of highest RMS attention, then ``AM_FIT``), the math
#: ``compact_heads`` runs when no method is given.
AM_HIGHEST_ATTENTION = MethodSpec("highest-attention", {"aggregation": "rms"}, AM_FIT)


@dataclass(frozen=True)
class ResolvedMethod:
    """A method ready to run: the selector instance and the fit options; ``name`` says which
    method it is in messages and logs."""

    name: str
    selector: Selector
    fit: FitOptions

    @property
    def needs_reference(self) -> bool:
        """Whether the original attention must be computed (any step looks at queries)."""
        return (
            self.selector.needs_reference
            or self.fit.beta == "nnls"
            or self.fit.values == "lstsq"
        )


def resolve_method(
    spec: MethodSpec,
    options: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
) -> ResolvedMethod:
    """``spec`` with ``options`` applied on top; ``ValueError`` with a sentence on bad input.

    ``name`` (default: the selector's) names the method in messages and in the result."""
    if not isinstance(spec, MethodSpec):
        raise TypeError(
            f"a method's math is a MethodSpec (named ones: vllm_compaction.recipes.RECIPES[name].math), "
            f"got {spec!r}"
        )
    name = spec.selector if name is None else name
    options = dict(options or {})
    selector_name = options.pop("selector", spec.selector)
    if selector_name not in SELECTORS:
        raise ValueError(
            f"unknown selector {selector_name!r}; valid selectors: {', '.join(SELECTORS)}"
        )
    selector_cls = SELECTORS[selector_name]
    selector_fields = {f.name for f in dataclasses.fields(selector_cls)}
    fit_fields = {f.name for f in dataclasses.fields(FitOptions)}
    base_selector = (
        dict(spec.selector_options) if selector_name == spec.selector else {}
    )
    unknown = sorted((set(options) | set(base_selector)) - selector_fields - fit_fields)
    if unknown:
        valid = sorted(selector_fields | fit_fields | {"selector"})
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for method {name!r}; valid options: {', '.join(valid)}"
        )
    base_selector.update({k: v for k, v in options.items() if k in selector_fields})
    selector = selector_cls(**base_selector)
    fit = dataclasses.replace(
        spec.fit, **{k: v for k, v in options.items() if k in fit_fields}
    )
    if fit.beta == "selector" and not getattr(selector_cls, "provides_beta", False):
        raise ValueError(
            f"beta='selector' needs a selector that fits weights (omp), not {selector_name!r}"
        )
    if fit.values == "selector" and not getattr(selector_cls, "provides_values", False):
        raise ValueError(
            f"values='selector' needs a selector that builds values (kvmerger), not {selector_name!r}"
        )
    return ResolvedMethod(name=name, selector=selector, fit=fit)
