"""Compiling a kernel to an sm_90 cubin without a GPU (ptxas ships with Triton).

The interpreter skips Triton's type checks and lowering, so each kernel's cases also compile it
for Hopper: a kernel that would only fail on a GPU fails here. The compile runs in a subprocess:
once Triton is imported with ``TRITON_INTERPRET=1`` its own library functions are interpreter
objects, and compiling in the same process fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PRELUDE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from benchmarks.source_tree import alias_kernels
alias_kernels()

def compile_sm90(kernel, signature, constexprs):
    fn = kernel
    while not isinstance(fn, JITFunction):  # an autotuned kernel wraps the JIT function
        fn = fn.fn
    signature = {name: signature.get(name, "constexpr" if name in constexprs else "i32") for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm, sorted(compiled.asm)
    return compiled
"""


def compile_for_sm90(script: str, tmp_path: Path) -> None:
    """Run ``script`` (after ``PRELUDE``, which defines ``compile_sm90``) compiled, not interpreted."""
    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "TRITON_CACHE_DIR": str(tmp_path),
        "TRITON_DEFAULT_FP_FUSION": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
