"""Head-budget schedules: per-(layer, KV head) shares of the total budget, stored as JSON.

A schedule is computed once per model (``vllm-compaction budgets compute``) and reused across
contexts and ratios, as in the paper. Packaged schedules live in ``budgets/schedules/``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = ["Schedule", "packaged_schedule", "load_schedule"]


@dataclass
class Schedule:
    """``shares[l][h]`` >= 0, summing to 1 over the compacted layers' heads."""

    model: str
    num_layers: int
    num_kv_heads: int
    shares: list[list[float]]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = torch.tensor(self.shares, dtype=torch.float64, device="cpu")
        if t.shape != (self.num_layers, self.num_kv_heads):
            raise ValueError(
                f"schedule shares have shape {tuple(t.shape)}, expected "
                f"({self.num_layers}, {self.num_kv_heads})"
            )
        if (t < 0).any() or not torch.isclose(
            t.sum(), torch.tensor(1.0, dtype=torch.float64, device="cpu"), atol=1e-6
        ):
            raise ValueError("schedule shares must be >= 0 and sum to 1")

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.shares, dtype=torch.float64, device="cpu")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path | Traversable) -> Schedule:
        """A schedule from a JSON file (a path, or a packaged resource)."""
        source = Path(path) if isinstance(path, str) else path
        try:
            data = json.loads(source.read_text())
            return cls(**data)
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise ValueError(
                f"cannot read head-budget schedule {path}: {exc}"
            ) from None


def packaged_schedule(model_name: str) -> Schedule | None:
    """The schedule shipped for a known model name, if any."""
    ref = resources.files("vllm_compaction.budgets").joinpath(
        "schedules", f"{model_name}.json"
    )
    return Schedule.load(ref) if ref.is_file() else None


def load_schedule(spec: str, model_name: str) -> Schedule:
    """``"schedule"`` -> the packaged schedule of ``model_name``; otherwise a file path."""
    if spec == "schedule":
        found = packaged_schedule(model_name)
        if found is None:
            raise ValueError(
                f"no packaged head-budget schedule for model {model_name!r}; "
                "compute one with `vllm-compaction budgets compute`"
            )
        return found
    return Schedule.load(spec)
