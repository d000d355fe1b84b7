"""Named compaction methods, the one registry of them, and the one way to write a configuration.

Each recipe is one small declaration composing parts: its math (a ``MethodSpec`` of
``am.presets``: a selector with its options and a fit), its reference-query source, its
budgets, whether queries are collected on-policy, and default options. Recipes that share math
share one ``MethodSpec`` object (``am-highest-attn`` and ``am-highest-attn-fast`` differ only in
their queries, ``snapkv`` and ``pyramidkv`` only in their budgets).

A method is a recipe name, optionally followed by overrides: ``"am"``,
``"am-highest-attn-fast:queries=repeat-prefill+surprise-number-quote/auto*4,min_layer_share=0.3"``.
The same string is accepted by ``compact()``, the CLI's ``--method``, ``POST /v1/compact``'s
``method``, the server's ``--auto-compact-method`` and the benchmarks' ``--methods``.

Overrides are ``key=value`` pairs separated by commas: the recipe's ``queries``, ``budgets`` and
``on_policy``, budget options (``min_layer_share``, ``max_head_ratio``, ``min_head_slots``), the
global ranking's ``score_*`` options, which tokens stay exact (``protect``, ``protect_by``,
``protect_room``, ``template``, ``priority_exact_depth``, ``band_protect``, ``floor_on``), and any option of the math preset (``values``,
``value_anchor``, ``seed_share``, ...; see ``am.presets``). Values are parsed as booleans
(``true``/``false``), numbers, or text. Every check of a method string (its syntax, the recipe
name, the query source, the budget and ranking options, the math options) is made here, by
``resolve``, before any work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from vllm_compaction.am.presets import (
    AM_HIGHEST_ATTENTION,
    EVICTION_FIT,
    MERGE_FIT,
    OMP_FIT,
    MethodSpec,
    ResolvedMethod,
    resolve_method,
)
from vllm_compaction.budgets import (
    FLOOR_SETS,
    PROTECT_MODES,
    PROTECT_ROOMS,
    PROTECT_RULES,
    SCORE_OPTIONS,
    TEMPLATE_MODES,
    ScoreOptions,
    check_budget_options,
    check_floor_on,
    check_priority_exact_depth,
    check_protect,
    check_protect_by,
    check_protect_room,
    check_template,
    depth_band,
    resolve_score_options,
)
from vllm_compaction.queries import parse_sources, resolve_spacing

__all__ = [
    "BUDGET_OPTIONS",
    "DEFAULT_METHOD",
    "PIPELINE_OPTIONS",
    "RECIPES",
    "Recipe",
    "ResolvedRecipe",
    "check_method",
    "parse_method",
    "resolve",
    "resolve_recipe",
]


@dataclass(frozen=True)
class Recipe:
    """What a named method means end to end: its math (``MethodSpec``), query source, budgets,
    on-policy, and default options (overridable like any other; any mapping, kept read-only)."""

    math: MethodSpec
    queries: str
    budgets: str
    on_policy: bool
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


# The math, each once. Highest-attention keys score by RMS attention for AM (the paper's
# AM-HighestAttnKeys), by mean attention for H2O+ and SnapKV (with a max-pool of 7), by max
# attention for KVzip.
_OMP = MethodSpec("omp", {"keys_per_step": 1, "refit_interval": 1}, OMP_FIT)
_OMP_FAST = MethodSpec(
    "omp", {"keys_per_step": 4, "refit_interval": 2, "max_rounds": 32}, OMP_FIT
)
_H2O = MethodSpec("highest-attention", {"aggregation": "mean"}, EVICTION_FIT)
_SNAPKV = MethodSpec(
    "highest-attention", {"aggregation": "mean", "pool_kernel": 7}, EVICTION_FIT
)
_KVZIP = MethodSpec("highest-attention", {"aggregation": "max"}, EVICTION_FIT)

_SS_RP = "self-study+repeat-prefill"
#: The recommended configuration (``DEFAULT_METHOD``): highest-attention keys with AM's beta and
#: value fits, reference queries from a repeat of the context plus quote probes on its most
#: surprising spans and on each number those probes miss (weighted 4, spaced by the ratio) and on
#: each name inside a sentence they miss (weighted 1), global (KVzip-style) budgets with a 30%
#: floor per layer, and identifiers (numbers, codes, hashes) kept first in each head's selection,
#: up to half its budget (``protect_by="selection"``). It keeps the most needles measured here
#: (12/12/9 of 12 at 10/5/2% on RULER's prompt) and the most of the full context's answers on the
#: conversation families (chat facts, near-duplicate keys, exact copies, agent traces) of every
#: configuration tried: 87% at 10% and 83% at 5%, where the same without the name probes
#: (``am:queries=repeat-prefill+surprise-number-quote/auto*4``) keeps 85% and 76%, and without
#: the number probes as well (``am:queries=repeat-prefill+surprise-quote/auto*4``) 82% and 54%.
#: Results in benchmarks/README.md.
AM = Recipe(
    AM_HIGHEST_ATTENTION,
    "repeat-prefill+surprise-number-quote/auto*4+surprise-name-quote/auto",
    "global",
    True,
    {"min_layer_share": 0.3, "protect": "identifiers", "protect_by": "selection"},
)
DEFAULT_METHOD = "am"

RECIPES: Mapping[str, Recipe] = MappingProxyType(
    {
        "am": AM,
        "am-omp": Recipe(_OMP, _SS_RP, "global", True),
        "am-omp-fast": Recipe(_OMP_FAST, _SS_RP, "global", True),
        "am-highest-attn": Recipe(AM_HIGHEST_ATTENTION, _SS_RP, "global", True),
        "am-highest-attn-fast": Recipe(
            AM_HIGHEST_ATTENTION, "repeat-prefill", "global", True
        ),
        "h2o+": Recipe(_H2O, "context-prefill", "uniform", False),
        "snapkv": Recipe(_SNAPKV, "mock-question", "uniform", False),
        # PyramidKV is SnapKV per head; its layer-decreasing budgets are its own.
        "pyramidkv": Recipe(_SNAPKV, "mock-question", "pyramid", False),
        # KVzip's cross-head, cross-layer budgets are the global ones.
        "kvzip": Recipe(_KVZIP, "repeat-prefill", "global", False),
        "kvmerger": Recipe(
            MethodSpec("kvmerger", fit=MERGE_FIT), "repeat-prefill", "uniform", False
        ),
        "random": Recipe(
            MethodSpec("random", fit=EVICTION_FIT), "context-prefill", "uniform", False
        ),
        "truncate": Recipe(
            MethodSpec("truncate", {"keep": "last"}, EVICTION_FIT),
            "context-prefill",
            "uniform",
            False,
        ),
    }
)

#: Overrides that set the recipe itself rather than an option.
RECIPE_KEYS = ("queries", "budgets", "on_policy")
#: Options of the head budgets, and with the global ranking's, the options the pipeline takes;
#: every other option goes to the math, which refuses unknown ones.
BUDGET_OPTIONS = ("max_head_ratio", "min_head_slots", "min_layer_share")
PIPELINE_OPTIONS = (
    *BUDGET_OPTIONS,
    *SCORE_OPTIONS,
    "protect",
    "protect_by",
    "protect_room",
    "template",
    "priority_exact_depth",
    "band_protect",
    "floor_on",
)


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
        raise ValueError(
            f"a method is a name (choose from {', '.join(RECIPES)}), optionally with "
            f"':key=value,...' overrides; got {spec!r}"
        )
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in RECIPES:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(RECIPES)}")
    overrides: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(
                f"bad override {item!r} in method {spec!r}: write key=value"
            )
        if key.strip() in overrides:
            raise ValueError(f"{key.strip()!r} is given twice in method {spec!r}")
        overrides[key.strip()] = _value(value)
    return name, overrides


@dataclass(frozen=True)
class ResolvedRecipe:
    """A method string resolved and checked: what the pipeline runs.

    Attributes:
        name: the recipe's name.
        recipe: the recipe with its overrides applied (``options``: every option, merged).
        method: the math, resolved with ``math_options`` (``compact_heads(method=)``).
        math_options: the options that went to the math, as given.
        budget_options: the ``BUDGET_OPTIONS`` given, for ``resolve_budgets``.
        scoring: the global ranking, resolved (defaults filled in).
        protect: which content tokens are protected (``budgets.protect``, one of
            ``PROTECT_RULES``), ``protect_by`` how (one of ``PROTECT_MODES``), and
            ``protect_room`` how many the rule may mark (one of ``PROTECT_ROOMS``).
        template: whether the tokens outside the content stay exact or are ranked with it
            (one of ``TEMPLATE_MODES``; see ``budgets.protect``).
        priority_exact_depth: the band of depth ``(lo, hi)`` whose layers keep the kept
            protected tokens as they were, or ``None`` (``budgets.protect``); ``band_method``
            is the math those layers run (``method`` with ``priority_values="exact"``), and
            ``band_protect`` the rule that picks their protected tokens (``protect`` unless
            given).
        floor_on: which kept protected tokens the fit's ``priority_beta_floor`` raises (one
            of ``FLOOR_SETS``: every one, or the words with no look-alike in the prefix).
    """

    name: str
    recipe: Recipe
    method: ResolvedMethod
    math_options: Mapping[str, Any]
    budget_options: Mapping[str, Any]
    scoring: ScoreOptions
    protect: str = PROTECT_RULES[0]
    protect_by: str = PROTECT_MODES[0]
    protect_room: str = PROTECT_ROOMS[0]
    template: str = TEMPLATE_MODES[0]
    priority_exact_depth: tuple[float, float] | None = None
    band_method: ResolvedMethod | None = None
    band_protect: str | None = None
    floor_on: str = FLOOR_SETS[0]

    def band_layers(self, num_layers: int) -> list[bool]:
        """Per layer of a ``num_layers``-deep model, whether it is in the
        ``priority_exact_depth`` band (runs ``band_method``, protects by ``band_protect``)."""
        if self.priority_exact_depth is None:
            return [False] * num_layers
        return depth_band(self.priority_exact_depth, num_layers)


def resolve(
    method: str,
    *,
    queries: str | None = None,
    budgets: str | None = None,
    on_policy: bool | None = None,
    options: Mapping[str, Any] | None = None,
) -> ResolvedRecipe:
    """The recipe a method spec names, with its overrides applied and every part checked (query
    source, budget options, ranking options, math options); ``ValueError`` with a sentence
    otherwise. The options are the recipe's defaults, then the spec's overrides, then
    ``options`` (explicit arguments win, as ``queries``/``budgets``/``on_policy`` given here win
    over the spec's)."""
    name, overrides = parse_method(method)
    base = RECIPES[name]
    picked = {key: overrides.pop(key, None) for key in RECIPE_KEYS}
    given: dict[str, Any] = {
        "queries": queries,
        "budgets": budgets,
        "on_policy": on_policy,
    }
    chosen = {
        key: given[key] if given[key] is not None else picked[key]
        for key in RECIPE_KEYS
    }
    defaults = dict(base.options)
    budget_mode = chosen["budgets"] or base.budgets
    if budget_mode != "global":  # a recipe's layer floor belongs to its global budgets
        defaults.pop("min_layer_share", None)
    merged = {**defaults, **overrides, **dict(options or {})}
    recipe = replace(
        base,
        queries=chosen["queries"] or base.queries,
        budgets=budget_mode,
        on_policy=base.on_policy
        if chosen["on_policy"] is None
        else bool(chosen["on_policy"]),
        options=merged,
    )
    parse_sources(resolve_spacing(recipe.queries, 0.1))  # any ratio checks an '/auto'
    budget_options = {k: merged[k] for k in BUDGET_OPTIONS if k in merged}
    check_budget_options(
        recipe.budgets, min_layer_share=budget_options.get("min_layer_share")
    )
    scoring = resolve_score_options(merged)
    protect = check_protect(merged.get("protect", PROTECT_RULES[0]))
    protect_by = check_protect_by(merged.get("protect_by", PROTECT_MODES[0]))
    protect_room = check_protect_room(
        merged.get("protect_room", PROTECT_ROOMS[0]), protect_by
    )
    template = check_template(merged.get("template", TEMPLATE_MODES[0]))
    math_options = {k: v for k, v in merged.items() if k not in PIPELINE_OPTIONS}
    method_math = resolve_method(base.math, math_options, name=name)
    if protect != "none" and protect_by != "exact":
        if not method_math.selector.takes_priority:
            raise ValueError(
                f"protect_by={protect_by} needs a selector that can keep keys first; method "
                f"{method!r} selects with {method_math.selector.name!r} (use "
                "protect_by=exact, or a highest-attention or OMP method such as am)"
            )
    band = check_priority_exact_depth(merged.get("priority_exact_depth"))
    band_method, band_protect = None, None
    if "band_protect" in merged and band is None:
        raise ValueError(
            "band_protect is the protect rule inside the priority_exact_depth band: give "
            "priority_exact_depth too"
        )
    if band is not None:
        if protect == "none" or protect_by == "exact":
            raise ValueError(
                "priority_exact_depth keeps the protected tokens a head's selection keeps as "
                "they were in a band of layers: it needs protect (not 'none') and protect_by "
                f"selection or whole, got protect={protect}, protect_by={protect_by}"
            )
        band_protect = check_protect(merged.get("band_protect", protect))
        if band_protect == "none":
            raise ValueError(
                "band_protect=none protects nothing inside the band: drop priority_exact_depth"
            )
        if math_options.get("priority_values", "lstsq") != "lstsq":
            raise ValueError(
                "priority_exact_depth sets priority_values='exact' inside its band and leaves "
                "the fit as it is outside: drop priority_values"
            )
        try:
            band_method = resolve_method(
                base.math, {**math_options, "priority_values": "exact"}, name=name
            )
        except ValueError as err:
            raise ValueError(f"priority_exact_depth: {err}") from None
    floor_on = check_floor_on(merged.get("floor_on", FLOOR_SETS[0]))
    if floor_on != FLOOR_SETS[0] and (
        method_math.fit.priority_beta_floor is None
        or protect == "none"
        or protect_by == "exact"
    ):
        raise ValueError(
            f"floor_on={floor_on} picks the kept protected tokens that priority_beta_floor "
            "raises: give priority_beta_floor, with protect and protect_by selection or whole"
        )
    return ResolvedRecipe(
        name,
        recipe,
        method_math,
        MappingProxyType(math_options),
        MappingProxyType(budget_options),
        scoring,
        protect,
        protect_by,
        protect_room,
        template,
        band,
        band_method,
        band_protect,
        floor_on,
    )


def resolve_recipe(
    method: str,
    *,
    queries: str | None = None,
    budgets: str | None = None,
    on_policy: bool | None = None,
    options: Mapping[str, Any] | None = None,
) -> tuple[Recipe, dict[str, Any]]:
    """``resolve``'s recipe (its ``options`` the resolved ones) and the options to run it with,
    checked as ``resolve`` checks them."""
    resolved = resolve(
        method, queries=queries, budgets=budgets, on_policy=on_policy, options=options
    )
    return resolved.recipe, dict(resolved.recipe.options)


def check_method(method: str) -> str:
    """``method`` unchanged if it names a recipe with overrides that exist and fit together
    (the checks ``compact()`` makes before any work); ``ValueError`` otherwise."""
    resolve(method)
    return method
