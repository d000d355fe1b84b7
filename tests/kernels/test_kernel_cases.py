"""Runs each Triton kernel's cases (``*_cases.py``) in a fresh interpreter, one test per file.

The Triton interpreter (``TRITON_INTERPRET=1``, the only way to run the kernels on a CPU-only
machine) must be on before ``triton`` is first imported, and by the time this module runs, the
session has usually imported it already through vLLM or torch. A subprocess gets a clean start
and keeps the variable out of the engines other test modules launch; its failures are listed
by case name in the assertion message. On a CUDA machine ``tests/cuda`` runs the same cases
compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = sorted(p for p in Path(__file__).parent.glob("*_cases.py") if not p.name.startswith("test_"))


def run_cases(path: Path, *, interpret: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_COMPACTION_TUNE": "0"}  # one tile configuration per kernel: fewer compiles
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", str(path)],
                          cwd=path.parents[2], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("cases", CASES, ids=[p.stem for p in CASES])
def test_kernel_cases_in_the_interpreter(cases):
    proc = run_cases(cases, interpret=not torch.cuda.is_available())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], proc.stdout[-800:]
