"""Writing benchmark results: the JSON (the result) and an optional headless-matplotlib plot."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("benchmarks")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (logged) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot")
        return None
    return plt


def save_result(result: dict[str, Any], out: str | Path,
                plot: Callable[[dict[str, Any], Path], None] | None = None) -> Path:
    """Write ``result`` as JSON at ``out`` (folders created) and, given ``plot``, a PNG beside it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if plot is not None:
        plot(result, out.with_suffix(".png"))
    return out
