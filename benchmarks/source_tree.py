"""Running from a source tree that is not pip-installed (the GPU machines have no registry).

``pyproject.toml`` maps the top-level ``kernels/`` folder to the import name
``vllm_compaction_kernels``; an installed package has that mapping, a bare checkout does not.
:func:`alias_kernels` gives a bare checkout the same name, so ``python -m benchmarks.gpu_check``
and ``pytest -m cuda`` run from the repository root with nothing installed but torch and Triton.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__all__ = ["alias_kernels"]

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def alias_kernels() -> None:
    """Make ``import vllm_compaction_kernels`` load ``kernels/`` when it is not installed."""
    if "vllm_compaction_kernels" in sys.modules or importlib.util.find_spec(
        "vllm_compaction_kernels"
    ):
        return
    spec = importlib.util.spec_from_file_location(
        "vllm_compaction_kernels",
        KERNELS / "__init__.py",
        submodule_search_locations=[str(KERNELS)],
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_compaction_kernels"] = module
    spec.loader.exec_module(module)
