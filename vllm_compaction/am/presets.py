"""Method presets: a selector with its options plus how ``beta`` and ``C_v`` are obtained.

``METHODS`` maps a method name to a frozen ``MethodSpec``; ``resolve_method`` applies caller
options on top (selector fields, ``FitOptions`` fields, or ``selector=`` to swap the selector,
which drops the preset's selector options) and validates everything with a sentence.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vllm_compaction.am.selectors import SELECTORS, Selector

__all__ = ["BETA_MODES", "METHODS", "VALUE_MODES", "FitOptions", "MethodSpec", "ResolvedMethod", "resolve_method"]

BETA_MODES = ("nnls", "zero", "selector")
VALUE_MODES = ("lstsq", "direct", "selector")


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
    """

    beta: str = "zero"
    beta_bounds: tuple[float, float] = (-3.0, 3.0)
    beta_iters: int = 2
    values: str = "direct"
    value_anchor: float = 0.0

    def __post_init__(self) -> None:
        if self.beta not in BETA_MODES:
            raise ValueError(f"beta must be one of {', '.join(BETA_MODES)}, got {self.beta!r}")
        if self.values not in VALUE_MODES:
            raise ValueError(f"values must be one of {', '.join(VALUE_MODES)}, got {self.values!r}")
        bounds = self.beta_bounds.split(":") if isinstance(self.beta_bounds, str) else self.beta_bounds
        try:
            lo, hi = (float(b) for b in bounds)
        except (TypeError, ValueError):
            lo, hi = math.nan, math.nan
        if not lo <= hi:  # also refuses NaN
            raise ValueError(f"beta_bounds must be a pair (lo, hi) or 'lo:hi' with lo <= hi, got {self.beta_bounds!r}")
        object.__setattr__(self, "beta_bounds", (lo, hi))
        if not isinstance(self.beta_iters, int) or isinstance(self.beta_iters, bool) or self.beta_iters < 0:
            raise ValueError(f"beta_iters must be a non-negative integer, got {self.beta_iters!r}")
        if isinstance(self.value_anchor, bool) or not isinstance(self.value_anchor, (int, float)) \
                or not math.isfinite(self.value_anchor) or self.value_anchor < 0:
            raise ValueError(f"value_anchor must be a finite number >= 0, got {self.value_anchor!r}")
        if self.value_anchor and self.values != "lstsq":
            raise ValueError(f"value_anchor applies to values='lstsq' only, not {self.values!r}")
        object.__setattr__(self, "value_anchor", float(self.value_anchor))


@dataclass(frozen=True)
class MethodSpec:
    """A named method: ``selector`` (a ``SELECTORS`` key) with options, and its fit."""

    selector: str
    selector_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    fit: FitOptions = FitOptions()


def _spec(selector: str, fit: FitOptions, **selector_options: Any) -> MethodSpec:
    return MethodSpec(selector, MappingProxyType(selector_options), fit)


_AM_HAK = FitOptions(beta="nnls", beta_bounds=(-3.0, 3.0), beta_iters=2, values="lstsq")
_AM_OMP = FitOptions(beta="selector", values="lstsq")
_EVICT = FitOptions(beta="zero", values="direct")

METHODS: Mapping[str, MethodSpec] = MappingProxyType(
    {
        "am-highest-attn": _spec("highest-attention", _AM_HAK, aggregation="rms"),
        "am-highest-attn-fast": _spec("highest-attention", _AM_HAK, aggregation="rms"),
        "am-omp": _spec("omp", _AM_OMP, keys_per_step=1, refit_interval=1),
        "am-omp-fast": _spec("omp", _AM_OMP, keys_per_step=4, refit_interval=2, max_rounds=32),
        "h2o+": _spec("highest-attention", _EVICT, aggregation="mean"),
        "snapkv": _spec("highest-attention", _EVICT, aggregation="mean", pool_kernel=7),
        # PyramidKV's layer-decreasing budgets are decided upstream; per head it is SnapKV.
        "pyramidkv": _spec("highest-attention", _EVICT, aggregation="mean", pool_kernel=7),
        # KVzip's global (cross-head, cross-layer) budgets are decided upstream.
        "kvzip": _spec("highest-attention", _EVICT, aggregation="max"),
        "kvmerger": _spec("kvmerger", FitOptions(beta="zero", values="selector")),
        "random": _spec("random", _EVICT),
        "truncate": _spec("truncate", _EVICT, keep="last"),
    }
)


@dataclass(frozen=True)
class ResolvedMethod:
    """A method ready to run: the selector instance and the fit options."""

    name: str
    selector: Selector
    fit: FitOptions

    @property
    def needs_reference(self) -> bool:
        """Whether the original attention must be computed (any step looks at queries)."""
        return self.selector.needs_reference or self.fit.beta == "nnls" or self.fit.values == "lstsq"


def resolve_method(method: str, options: Mapping[str, Any]) -> ResolvedMethod:
    """The preset ``method`` with ``options`` applied on top; ``ValueError`` on bad input."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")
    spec = METHODS[method]
    options = dict(options)
    selector_name = options.pop("selector", spec.selector)
    if selector_name not in SELECTORS:
        raise ValueError(f"unknown selector {selector_name!r}; valid selectors: {', '.join(SELECTORS)}")
    selector_cls = SELECTORS[selector_name]
    selector_fields = {f.name for f in dataclasses.fields(selector_cls)}
    fit_fields = {f.name for f in dataclasses.fields(FitOptions)}
    unknown = sorted(set(options) - selector_fields - fit_fields)
    if unknown:
        valid = sorted(selector_fields | fit_fields | {"selector"})
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for method {method!r}; valid options: {', '.join(valid)}"
        )
    base_selector = dict(spec.selector_options) if selector_name == spec.selector else {}
    base_selector.update({k: v for k, v in options.items() if k in selector_fields})
    selector = selector_cls(**base_selector)
    fit = dataclasses.replace(spec.fit, **{k: v for k, v in options.items() if k in fit_fields})
    if fit.beta == "selector" and not getattr(selector_cls, "provides_beta", False):
        raise ValueError(f"beta='selector' needs a selector that fits weights (omp), not {selector_name!r}")
    if fit.values == "selector" and not getattr(selector_cls, "provides_values", False):
        raise ValueError(f"values='selector' needs a selector that builds values (kvmerger), not {selector_name!r}")
    return ResolvedMethod(name=method, selector=selector, fit=fit)
