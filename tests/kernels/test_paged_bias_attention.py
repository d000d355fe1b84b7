"""Runs the Triton kernel cases (``paged_bias_cases.py``) in a fresh interpreter.

The Triton interpreter (``TRITON_INTERPRET=1``, the only way to run the kernels on a CPU-only
machine) must be on before ``triton`` is first imported, and by the time this module runs, the
session has usually imported it already through vLLM or torch. A subprocess gets a clean start
and keeps the variable out of the engines other test modules launch. On a CUDA machine the
cases run compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

CASES = Path(__file__).with_name("paged_bias_cases.py")


def test_triton_kernel_cases_in_a_fresh_interpreter():
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        cwd=CASES.parents[2], env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], proc.stdout[-800:]
