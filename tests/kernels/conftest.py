"""Kernel tests run the Triton kernels through the Triton interpreter on CPU-only machines.

``@triton.jit`` chooses interpreter or compiler from ``TRITON_INTERPRET`` when it decorates (the
kernels import Triton lazily, on first call), so the variable is set around these tests only: it
must not leak into the vLLM engine processes other test modules start in the same session. On a
CUDA machine it is left alone, so the same tests exercise the compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
