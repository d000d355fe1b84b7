"""Kernel tests run the Triton kernels through the Triton interpreter on CPU-only machines.

``@triton.jit`` chooses interpreter or compiler from ``TRITON_INTERPRET`` when it decorates, so
the variable is set here, before any kernel module is imported or built (the kernels import
Triton lazily, on first call). On a CUDA machine it is left alone, so the same tests exercise the
compiled kernels unless the caller sets ``TRITON_INTERPRET=1`` explicitly.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
