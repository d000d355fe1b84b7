"""Cases of the fused reference-pass kernels (``kernels/reference_attention.py``) against the
torch pass of ``vllm_compaction.am.attention`` (float32) and its float64 reference
``attention_output_and_mass``, run by
``test_kernel_cases.py`` in a fresh interpreter (``TRITON_INTERPRET=1`` on a CPU, compiled on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.source_tree import alias_kernels

alias_kernels()

import vllm_compaction.am.attention as attention  # noqa: E402
from vllm_compaction.am import attention_output_and_mass, compact_heads  # noqa: E402
from vllm_compaction.recipes import RECIPES  # noqa: E402
from vllm_compaction_kernels.reference_attention import reference_attention_triton  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def inputs(heads, keys, queries, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(heads, keys, dim, generator=gen)
    v = torch.randn(heads, keys, dim, generator=gen)
    q = 2.0 * torch.randn(heads, queries, dim, generator=gen)
    return k.to(DEVICE), v.to(DEVICE), q.to(DEVICE)


def float64_stats(k, v, q, scale):
    """Shift, shifted mass, output, attention weights and shifted features in float64, from
    the reference's output and log mass (the features only need the logits again)."""
    ref = attention_output_and_mass(q, k, v, scale=scale, dtype=torch.float64)
    logits = (q.double() @ k.double().transpose(1, 2)) * scale
    shift = logits.amax(-1)
    features = torch.exp(logits - shift[..., None])
    weights = torch.exp(logits - ref.log_mass[..., None])
    return shift, torch.exp(ref.log_mass - shift), ref.output, weights, features


@pytest.mark.parametrize("dim", [16, 40, 64, 256])
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_statistics_match_float64(dim, precision):
    k, v, q = inputs(2, 70, 45, dim)
    scale = dim**-0.5
    got = reference_attention_triton(
        k, v, q, scale=scale, aggregation="rms", keep_features=True, precision=precision
    )
    shift, mass, out, weights, features = float64_stats(k, v, q, scale)
    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.shift.double(), shift, **tol)
    torch.testing.assert_close(got.mass.double(), mass, **tol)
    torch.testing.assert_close(got.output.double(), out, **tol)
    torch.testing.assert_close(got.scores.double(), weights.square().sum(1), **tol)
    torch.testing.assert_close(
        got.features.double(), features.transpose(1, 2), atol=1e-3, rtol=1e-3
    )


@pytest.mark.parametrize("aggregation", ["rms", "mean", "max", "weighted-max", None])
def test_fused_pass_equals_the_torch_pass(aggregation):
    k, v, q = inputs(3, 90, 60, 32, seed=1)
    weights = (
        torch.rand(3, 60, generator=torch.Generator().manual_seed(2)).to(DEVICE) + 0.05
    )
    weights = weights / weights.amax(-1, keepdim=True)
    results = {}
    for backend in ("torch", "triton:ieee"):
        attention.REFERENCE_BACKEND = backend
        try:
            results[backend] = attention.reference_attention(
                k,
                v,
                q,
                scale=0.2,
                aggregation=aggregation,
                keep_features=True,
                query_weights=weights,
            )
        finally:
            attention.REFERENCE_BACKEND = "auto"
    ref, got = results["torch"], results["triton:ieee"]
    for name in ("shift", "mass", "output"):
        torch.testing.assert_close(
            getattr(got, name), getattr(ref, name), atol=1e-5, rtol=1e-5
        )
    torch.testing.assert_close(
        got.features.float(), ref.features.float(), atol=1e-3, rtol=1e-3
    )
    if aggregation is not None:
        torch.testing.assert_close(got.scores, ref.scores, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "method", ["am-highest-attn", "am-omp-fast", "kvzip", "snapkv"]
)
def test_compact_heads_with_the_fused_pass_equals_the_torch_pass(method):
    k, v, q = inputs(2, 80, 120, 32, seed=3)
    results = {}
    for backend in ("torch", "triton:ieee"):
        attention.REFERENCE_BACKEND = backend
        try:
            results[backend] = compact_heads(
                k, v, q, [7, 19], method=RECIPES[method].math
            )
        finally:
            attention.REFERENCE_BACKEND = "auto"
    ref, got = results["torch"], results["triton:ieee"]
    assert torch.equal(got.indices, ref.indices)
    torch.testing.assert_close(got.beta, ref.beta, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.values, ref.values, atol=1e-3, rtol=1e-3)


_COMPILE = """
from vllm_compaction_kernels.reference_attention import _build
forward, scores = _build()
# type checks and lowering do not depend on the head size: one case per branch, small tiles
for precision, has_v, aggregation, has_w, features in (("tf32x3", True, 1, True, False),
                                                       ("ieee", False, 3, False, True)):
    compile_sm90(forward, dict(q_ptr="*fp32", k_ptr="*fp32", v_ptr="*fp32", shift_ptr="*fp32", mass_ptr="*fp32",
                               out_ptr="*fp32", qk_scale="fp32"),
                 dict(D=40, D_PAD=64, HAS_V=has_v, PRECISION=precision, BLOCK_M=32, BLOCK_N=32))
    compile_sm90(scores, dict(q_ptr="*fp32", k_ptr="*fp32", shift_ptr="*fp32", mass_ptr="*fp32",
                              weight_ptr="*fp32", scores_ptr="*fp32", feat_ptr="*fp16", qk_scale="fp32"),
                 dict(D=40, D_PAD=64, AGGREGATION=aggregation, HAS_W=has_w, FEATURES=features,
                      PRECISION=precision, BLOCK_M=32, BLOCK_N=32))
"""


def test_kernels_compile_for_sm90(tmp_path):
    from kernels.sm90 import compile_for_sm90

    if DEVICE == "cuda":
        pytest.skip("compiled for this GPU by every other case here")

    compile_for_sm90(_COMPILE, tmp_path)
