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


def test_fp16_operands_keep_tf32_accuracy_and_fall_back_beyond_their_range():
    """``"fp16"`` rounds the operands to 10-bit mantissas, as tf32 does: logits, mass and
    outputs within that rounding of float64; an input beyond fp16's range runs as tf32."""
    k, v, q = inputs(2, 70, 45, 64, seed=5)
    got = reference_attention_triton(
        k, v, q, scale=0.125, aggregation="mean", keep_features=False, precision="fp16"
    )
    shift, mass, out, weights, _ = float64_stats(k, v, q, 0.125)
    # |logits| reach ~10 here: 10 x 2^-11 per operand rounding, two operands, summed over d
    torch.testing.assert_close(got.shift.double(), shift, atol=2e-2, rtol=0)
    torch.testing.assert_close(got.mass.double(), mass, rtol=2e-2, atol=0)
    torch.testing.assert_close(got.output.double(), out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(
        got.scores.double() / 45, weights.mean(1), atol=2e-3, rtol=2e-2
    )
    huge = v * 1e5  # beyond FP16_INPUT_LIMIT
    fp16 = reference_attention_triton(
        k, huge, q, scale=0.125, aggregation=None, keep_features=False, precision="fp16"
    )
    tf32 = reference_attention_triton(
        k, huge, q, scale=0.125, aggregation=None, keep_features=False, precision="tf32"
    )
    assert torch.isfinite(fp16.output).all()
    torch.testing.assert_close(fp16.output, tf32.output, rtol=0, atol=0)


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to ``float8_e4m3fn`` the way the kernel's store rounds it: by torch (the
    GPU's conversion), or under the interpreter by Triton's own conversion, which loses the
    carry of a mantissa that rounds up (7.997 becomes 4, not 8)."""
    if not INTERPRET:
        return x.to(torch.float8_e4m3fn)
    import triton
    import triton.language as tl

    @triton.jit
    def convert(x_ptr, y_ptr, size, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < size
        value = tl.load(x_ptr + i, mask=ok)
        tl.store(y_ptr + i, value.to(y_ptr.dtype.element_ty), mask=ok)

    flat = x.float().contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.float8_e4m3fn, device=x.device)
    convert[(triton.cdiv(flat.numel(), 1024),)](flat, out, flat.numel(), BLOCK=1024)
    return out.view(x.shape)


def test_fp8_features_are_the_scaled_features_rounded_once():
    """With fp8 storage (OMP on CUDA) the pass writes ``exp(l - s) * scale`` rounded once to
    ``float8_e4m3fn``: the float64 features times the scale, rounded, up to one fp8 step where
    the fp32 logits' last bits put a value on the other side of a rounding boundary; compiled,
    within fp8's rounding (2^-4 relative, half the subnormal step) of the exact value. The
    torch pass stores the same."""
    k, v, q = inputs(2, 70, 45, 64, seed=4)
    got = reference_attention_triton(
        k,
        v,
        q,
        scale=0.125,
        aggregation=None,
        keep_features=True,
        precision="ieee",
        feature_dtype=torch.float8_e4m3fn,
        feature_scale=256.0,
    )
    assert got.features.dtype == torch.float8_e4m3fn and got.feature_scale == 256.0
    *_, features = float64_stats(k, v, q, 0.125)
    want = features.transpose(1, 2) * 256.0
    rounded = _to_fp8(want).double()
    step = rounded * 2.0**-3 + 2.0**-9  # one fp8 step at the value
    assert ((got.features.double() - rounded).abs() <= step).all()
    if not INTERPRET:
        err = (got.features.double() - want).abs()
        assert (err <= want * 2.0**-4 + 2.0**-10).all()
    attention.FEATURE_STORAGE = "fp8"
    try:
        attention.REFERENCE_BACKEND = "torch"
        ref = attention.reference_attention(k, v, q, scale=0.125, keep_features=True)
    finally:
        attention.FEATURE_STORAGE = "auto"
        attention.REFERENCE_BACKEND = "auto"
    assert ref.feature_scale == 256.0 and ref.features.dtype == torch.float8_e4m3fn
    exact = want.to(torch.float8_e4m3fn).double()  # torch rounds correctly
    assert ((ref.features.double() - exact).abs() <= exact * 2.0**-3 + 2.0**-9).all()


@pytest.mark.parametrize("aggregation", ["rms", "mean", "max", "weighted-max", None])
def test_fused_pass_equals_the_torch_pass(aggregation, monkeypatch):
    k, v, q = inputs(3, 90, 60, 32, seed=1)
    weights = (
        torch.rand(3, 60, generator=torch.Generator().manual_seed(2)).to(DEVICE) + 0.05
    )
    weights = weights / weights.amax(-1, keepdim=True)
    results = {}
    # both store fp16 features (on CUDA the fused pass would store fp8: tested above)
    monkeypatch.setattr(attention, "FEATURE_STORAGE", "fp16")
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
def test_compact_heads_with_the_fused_pass_equals_the_torch_pass(method, monkeypatch):
    k, v, q = inputs(2, 80, 120, 32, seed=3)
    results = {}
    # both store fp16 features (on CUDA the fused pass would store fp8: tested above)
    monkeypatch.setattr(attention, "FEATURE_STORAGE", "fp16")
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
for precision, has_v, aggregation, has_w, features, feat in (("tf32x3", True, 1, True, False, "*fp16"),
                                                             ("ieee", False, 3, False, True, "*fp16"),
                                                             ("tf32", False, 0, False, True, "*fp8e4nv"),
                                                             ("fp16", True, 1, False, True, "*fp8e4nv")):
    x = "*fp16" if precision == "fp16" else "*fp32"
    compile_sm90(forward, dict(q_ptr=x, k_ptr=x, v_ptr=x, shift_ptr="*fp32", mass_ptr="*fp32",
                               out_ptr="*fp32", qk_scale="fp32"),
                 dict(D=40, D_PAD=64, HAS_V=has_v, PRECISION=precision, BLOCK_M=32, BLOCK_N=32))
    compile_sm90(scores, dict(q_ptr=x, k_ptr=x, shift_ptr="*fp32", mass_ptr="*fp32",
                              weight_ptr="*fp32", scores_ptr="*fp32", feat_ptr=feat, qk_scale="fp32",
                              feat_scale="fp32"),
                 dict(D=40, D_PAD=64, AGGREGATION=aggregation, HAS_W=has_w, FEATURES=features,
                      PRECISION=precision, BLOCK_M=32, BLOCK_N=32))
"""


def test_kernels_compile_for_sm90(tmp_path):
    from kernels.sm90 import compile_for_sm90

    if DEVICE == "cuda":
        pytest.skip("compiled for this GPU by every other case here")

    compile_for_sm90(_COMPILE, tmp_path)
