"""What the kernels ask of the Triton runtime they run under."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["interpreting"]


def interpreting(triton: Any) -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
