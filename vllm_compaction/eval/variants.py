"""Method variants on the command line: ``"am-highest-attn-fast:values=direct,budgets=uniform"``, several
joined by ``;`` (or ``,``), each in the method syntax of ``vllm_compaction.recipes``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm_compaction.recipes import RECIPE_KEYS, parse_method

__all__ = ["MethodVariant", "parse_variant", "parse_variants"]


@dataclass(frozen=True)
class MethodVariant:
    """A recipe name plus overrides; ``label`` is the spec as written."""

    label: str
    method: str
    pipeline: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        return {"method": self.method, **self.pipeline, **self.options}


def parse_variant(spec: str) -> MethodVariant:
    """One method spec (``vllm_compaction.recipes.parse_method``, the syntax every entry point
    takes), its recipe overrides split from its options."""
    method, overrides = parse_method(spec)
    pipeline = {k: overrides.pop(k) for k in RECIPE_KEYS if k in overrides}
    return MethodVariant(
        label=spec, method=method, pipeline=pipeline, options=overrides
    )


def parse_variants(
    spec: str, known: Iterable[str] | None = None
) -> list[MethodVariant]:
    """Variants separated by ``;``, or by ``,`` when there is no ``;``. With commas, a piece
    that is an override (``key=value``, never a method name) belongs to the variant before it,
    so ``"am-omp-fast:seed_share=0.25,max_rounds=8,kvzip"`` is two variants. ``known`` (the
    recipe names) turns an unknown method into an error here, before any work is done."""
    if ";" in spec:
        pieces = [s.strip() for s in spec.split(";") if s.strip()]
    else:
        pieces = []
        for piece in filter(None, (s.strip() for s in spec.split(","))):
            if pieces and "=" in piece.partition(":")[0]:
                pieces[-1] += "," + piece
            else:
                pieces.append(piece)
    variants = [parse_variant(piece) for piece in pieces]
    if not variants:
        raise ValueError("no method given")
    if known is not None:
        known = list(known)
        for variant in variants:
            if variant.method not in known:
                raise ValueError(
                    f"unknown method {variant.method!r} in {variant.label!r}; "
                    f"choose from {', '.join(known)}"
                )
    return variants
