"""Method variants on the command line: ``"am-highest-attn-fast:values=direct,budgets=uniform"``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["MethodVariant", "parse_variant"]

_PIPELINE_KEYS = ("queries", "budgets", "on_policy")


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


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
    method, _, rest = spec.partition(":")
    pipeline, options = {}, {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"bad override {item!r} in {spec!r}: use key=value")
        (pipeline if key in _PIPELINE_KEYS else options)[key] = _value(value)
    return MethodVariant(label=spec, method=method.strip(), pipeline=pipeline, options=options)
