"""How ``global`` budgets rank keys: the options of the key scores, resolved and checked.

The global ranking compares every (layer, head, key) by its attention under the reference
queries. ``score_softmax`` says over which keys a probe's attention is normalised,
``score_aggregation`` how a key's attention over the queries becomes one score, and
``score_weight_power`` how much a weighted query source counts in that score. The rules live
here, beside the budgets they rank for, so the method check and the pipeline refuse the same
combinations with the same sentence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_SCORE_SOFTMAX",
    "DEFAULT_SCORE_WEIGHT_POWER",
    "SCORE_AGGREGATIONS",
    "SCORE_OPTIONS",
    "SCORE_SOFTMAXES",
    "ScoreOptions",
    "check_score_aggregation",
    "check_score_softmax",
    "check_score_weight_power",
    "resolve_score_options",
]

#: How global budgets normalise a probe query's attention when ranking keys.
SCORE_SOFTMAXES = ("prefix", "probe")
DEFAULT_SCORE_SOFTMAX = "prefix"
#: How global budgets aggregate a key's attention over the reference queries: KVzip's ``max``,
#: or ``weighted-max``, where each query's weight scales its attention (``score_keys``). The
#: default is ``weighted-max`` under the ``prefix`` softmax, which is ``max`` for unweighted
#: queries: a source weighted ``*k`` weighs in the ranking too (measured on 48 needles:
#: 46/44/35 at 10/5/2% with the default power 2, 46/41/37 with power 1, 46/40/32 with ``max``).
SCORE_AGGREGATIONS = ("max", "weighted-max")
#: ``weighted-max`` raises each source's weight to this power in the ranking only (the fits keep
#: the weights as given): 0 is the plain max, 1 the weights as the fits count them, and larger
#: powers let the heaviest source decide the ranking more alone. 2 measured best on 48 needles
#: (docs/experiments/2026-11-25-needle-probes.md: "Sharper weights in the ranking").
DEFAULT_SCORE_WEIGHT_POWER = 2.0
#: The option names of the ranking, as a method string or ``compact()`` gives them.
SCORE_OPTIONS = ("score_softmax", "score_aggregation", "score_weight_power")


def check_score_softmax(softmax: str) -> None:
    """ValueError with a sentence unless ``softmax`` is a ``SCORE_SOFTMAXES`` name."""
    if softmax not in SCORE_SOFTMAXES:
        raise ValueError(
            f"score_softmax must be one of {', '.join(SCORE_SOFTMAXES)}, got {softmax!r}"
        )


def check_score_aggregation(aggregation: str, softmax: str) -> None:
    """ValueError with a sentence unless ``aggregation`` is a ``SCORE_AGGREGATIONS`` name that
    works under ``softmax``."""
    if aggregation not in SCORE_AGGREGATIONS:
        raise ValueError(
            f"score_aggregation must be one of {', '.join(SCORE_AGGREGATIONS)}, got {aggregation!r}"
        )
    if aggregation == "weighted-max" and softmax != "prefix":
        # the probe pass's own scores are a max taken inside the model run, before any weight
        raise ValueError(
            "score_aggregation='weighted-max' needs score_softmax='prefix'"
        )


def check_score_weight_power(power: float | None, aggregation: str) -> float | None:
    """The resolved power of the ranking weights: ``DEFAULT_SCORE_WEIGHT_POWER`` when ``None``
    under ``weighted-max``; ``None`` under ``max``, which has no weight to raise."""
    if power is None:
        return DEFAULT_SCORE_WEIGHT_POWER if aggregation == "weighted-max" else None
    if aggregation != "weighted-max":
        # the plain max uses no weight, so a power would be silently ignored
        raise ValueError(
            f"score_weight_power needs score_aggregation='weighted-max', got {aggregation!r}"
        )
    if (
        isinstance(power, bool)
        or not isinstance(power, (int, float))
        or not math.isfinite(power)
        or power < 0
    ):
        raise ValueError(
            f"score_weight_power must be a finite number >= 0, got {power!r}"
        )
    return float(power)


@dataclass(frozen=True)
class ScoreOptions:
    """The ranking of ``global`` budgets, resolved: ``softmax`` (a ``SCORE_SOFTMAXES`` name),
    ``aggregation`` (a ``SCORE_AGGREGATIONS`` name) and ``weight_power`` (``None`` under
    ``max``)."""

    softmax: str
    aggregation: str
    weight_power: float | None

    def as_options(self) -> dict[str, Any]:
        """The resolved values under their option names (what a cache records)."""
        return {
            "score_softmax": self.softmax,
            "score_aggregation": self.aggregation,
            "score_weight_power": self.weight_power,
        }


def resolve_score_options(options: Mapping[str, Any]) -> ScoreOptions:
    """The ranking that ``options`` (any mapping; only ``SCORE_OPTIONS`` keys are read) asks for,
    with the defaults filled in; ValueError with a sentence for a value or a combination that
    does not exist. A missing ``score_aggregation`` follows the softmax (``weighted-max`` under
    ``prefix``, ``max`` under ``probe``); an explicit one, even an empty one, is checked."""
    softmax = options.get("score_softmax", DEFAULT_SCORE_SOFTMAX)
    aggregation = options.get("score_aggregation")
    if aggregation is None:
        aggregation = "weighted-max" if softmax == "prefix" else "max"
    check_score_softmax(softmax)
    check_score_aggregation(aggregation, softmax)
    power = check_score_weight_power(options.get("score_weight_power"), aggregation)
    return ScoreOptions(softmax, aggregation, power)
