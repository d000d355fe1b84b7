"""Writing benchmark results: the JSON (the result) and an optional headless-matplotlib plot."""

from __future__ import annotations

import json
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def save_figure(fig, path: str | Path) -> None:
    """Lay out matplotlib ``fig``, write it as a PNG at ``path`` and free it."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    if plt is not None:
        plt.close(fig)


def save_result(
    result: dict[str, Any],
    out: str | Path,
    plot: Callable[[dict[str, Any], Path], None] | None = None,
) -> Path:
    """Write ``result`` as JSON at ``out`` (folders created) and, given ``plot``, a PNG beside it.

    The JSON starts with the command that produced it (``python -m benchmarks.<script> ...``)
    unless ``result`` names one itself."""
    command = command_line()
    if command is not None and "command" not in result:
        result = {"command": command, **result}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if plot is not None:
        plot(result, out.with_suffix(".png"))
    return out


def command_line() -> str | None:
    """This process's command as a person would type it, when it runs a benchmark script
    (``python -m benchmarks.quality --instances 12``); None otherwise (a test calling ``main``)."""
    script = Path(sys.argv[0])
    if script.parent.name != "benchmarks" or script.suffix != ".py":
        return None
    return shlex.join(["python", "-m", f"benchmarks.{script.stem}", *sys.argv[1:]])


def log_scale(ax, which: str = "x") -> None:
    """Put axis ``which`` ("x" or "y") of matplotlib ``ax`` on a log scale labelled at 1, 2, 5 per decade.

    Matplotlib labels the minor ticks of a log axis that spans less than about a decade (ratios
    0.02-0.1, times 2-60 s), and those labels overlap; plain numbers at 1, 2 and 5 stay readable.
    """
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_formatter(NullFormatter())
