"""Named compaction methods and the one way to write a configuration.

A method is a recipe name, optionally followed by overrides: ``"am"``,
``"am-highest-attn-fast:queries=repeat-prefill+surprise-quote/auto*4,min_layer_share=0.3"``.
The same string is accepted by ``compact()``, the CLI's ``--method``, ``POST /v1/compact``'s
``method``, the server's ``--auto-compact-method`` and the benchmarks' ``--methods``.

Overrides are ``key=value`` pairs separated by commas: the recipe's ``queries``, ``budgets`` and
``on_policy``, budget options (``min_layer_share``, ``max_head_ratio``, ``min_head_slots``), the
global ranking's ``score_*`` options, and any option of the math preset (``values``,
``value_anchor``, ``seed_share``, ...; see ``am.presets``). Values are parsed as booleans
(``true``/``false``), numbers, or text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["BUDGET_OPTIONS", "DEFAULT_METHOD", "PIPELINE_OPTIONS", "RECIPES", "Recipe", "check_method", "parse_method",
           "resolve_recipe"]


@dataclass(frozen=True)
class Recipe:
    """What a named method means end to end: math preset, query source, budgets, on-policy,
    and default options (overridable like any other)."""

    math: str
    queries: str
    budgets: str
    on_policy: bool
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


_SS_RP = "self-study+repeat-prefill"
#: The recommended configuration (``DEFAULT_METHOD``): highest-attention keys with AM's beta and
#: value fits, reference queries from a repeat of the context plus quote probes on its most
#: surprising spans (weighted 4, spaced by the ratio), global (KVzip-style) budgets with a 30% floor
#: per layer. It keeps the most needles measured here (12/11/8 of 12 at 10/5/2% on RULER's prompt,
#: 47/46/35 of 48 on the bare one); results in benchmarks/README.md.
AM = Recipe("am-highest-attn-fast", "repeat-prefill+surprise-quote/auto*4", "global", True,
            MappingProxyType({"min_layer_share": 0.3}))
DEFAULT_METHOD = "am"

RECIPES: Mapping[str, Recipe] = MappingProxyType({
    "am": AM,
    "am-omp": Recipe("am-omp", _SS_RP, "global", True),
    "am-omp-fast": Recipe("am-omp-fast", _SS_RP, "global", True),
    "am-highest-attn": Recipe("am-highest-attn", _SS_RP, "global", True),
    "am-highest-attn-fast": Recipe("am-highest-attn-fast", "repeat-prefill", "global", True),
    "h2o+": Recipe("h2o+", "context-prefill", "uniform", False),
    "snapkv": Recipe("snapkv", "mock-question", "uniform", False),
    "pyramidkv": Recipe("pyramidkv", "mock-question", "pyramid", False),
    "kvzip": Recipe("kvzip", "repeat-prefill", "global", False),
    "kvmerger": Recipe("kvmerger", "repeat-prefill", "uniform", False),
    "random": Recipe("random", "context-prefill", "uniform", False),
    "truncate": Recipe("truncate", "context-prefill", "uniform", False),
})

#: Overrides that set the recipe itself rather than an option.
RECIPE_KEYS = ("queries", "budgets", "on_policy")
#: Options of the head budgets, and with the global ranking's, the options the pipeline takes;
#: every other option goes to the math preset, which refuses unknown ones.
BUDGET_OPTIONS = ("max_head_ratio", "min_head_slots", "min_layer_share")
PIPELINE_OPTIONS = (*BUDGET_OPTIONS, "score_softmax", "score_aggregation", "score_weight_power")


def _value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def parse_method(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value,..."`` -> ``(name, {key: value})``; ``ValueError`` with a sentence for a
    malformed spec or an unknown name."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a method is a name (choose from {', '.join(RECIPES)}), optionally with "
                         f"':key=value,...' overrides; got {spec!r}")
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in RECIPES:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(RECIPES)}")
    overrides: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"bad override {item!r} in method {spec!r}: write key=value")
        if key.strip() in overrides:
            raise ValueError(f"{key.strip()!r} is given twice in method {spec!r}")
        overrides[key.strip()] = _value(value)
    return name, overrides


def resolve_recipe(method: str, *, queries: str | None = None, budgets: str | None = None,
                   on_policy: bool | None = None, options: Mapping[str, Any] | None = None
                   ) -> tuple[Recipe, dict[str, Any]]:
    """The recipe a method spec names, with its overrides applied (its ``options`` the resolved
    ones), and the options to run it with: the recipe's defaults, then the spec's overrides, then
    ``options`` (explicit arguments win, as ``queries``/``budgets``/``on_policy`` given here win
    over the spec's)."""
    name, overrides = parse_method(method)
    base = RECIPES[name]
    picked = {key: overrides.pop(key, None) for key in RECIPE_KEYS}
    given = {"queries": queries, "budgets": budgets, "on_policy": on_policy}
    chosen = {key: given[key] if given[key] is not None else picked[key] for key in RECIPE_KEYS}
    recipe = replace(base, queries=chosen["queries"] or base.queries, budgets=chosen["budgets"] or base.budgets,
                     on_policy=base.on_policy if chosen["on_policy"] is None else bool(chosen["on_policy"]))
    defaults = dict(base.options)
    if recipe.budgets != "global":  # a recipe's layer floor belongs to its global budgets
        defaults.pop("min_layer_share", None)
    merged = {**defaults, **overrides, **dict(options or {})}
    return replace(recipe, options=MappingProxyType(dict(merged))), merged


def check_method(method: str) -> str:
    """``method`` unchanged if it names a recipe with overrides that exist and fit together
    (the checks ``compact()`` would make before any work); ``ValueError`` otherwise."""
    from vllm_compaction.am.presets import resolve_method
    from vllm_compaction.budgets import check_budget_options
    from vllm_compaction.queries import parse_sources, resolve_spacing

    recipe, options = resolve_recipe(method)
    check_budget_options(recipe.budgets, min_layer_share=options.get("min_layer_share"))
    parse_sources(resolve_spacing(recipe.queries, 0.1))
    resolve_method(recipe.math, {k: v for k, v in options.items() if k not in PIPELINE_OPTIONS})
    return method
