"""Headless matplotlib for the benchmark plots (optional: the JSON is the result)."""

from __future__ import annotations

import logging

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
