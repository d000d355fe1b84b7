"""Cases of OMP's fp8 correlation kernel (``kernels/feature_correlation.py``) against a float64
product of the same stored features, run by ``test_kernel_cases.py`` in a fresh interpreter
(``TRITON_INTERPRET=1`` on a CPU, compiled on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.source_tree import alias_kernels

alias_kernels()

from vllm_compaction_kernels.feature_correlation import (  # noqa: E402
    feature_correlation,
    feature_correlation_reference,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def stored(h, t, n, dtype, scale, seed=0):
    """Shifted-feature-like entries in [0, 1] (many tiny), stored times ``scale``."""
    gen = torch.Generator().manual_seed(seed)
    phi = torch.rand(h, t, n, generator=gen) ** 6
    return (phi * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize(
    ("dtype", "scale"), [(torch.float8_e4m3fn, 256.0), (torch.float16, 1.0)]
)
@pytest.mark.parametrize("shape", [(3, 37, 70), (2, 16, 64), (1, 5, 1)])
def test_correlation_is_the_float64_product_of_the_stored_features(dtype, scale, shape):
    """Keys and queries that fill no whole tile, one query, the residual's sign mixed: the
    kernel's fp32 sums equal the float64 product of what is stored, divided by the scale."""
    h, t, n = shape
    features = stored(h, t, n, dtype, scale)
    resid = torch.randn(h, n, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = feature_correlation(features, resid, scale)
    want = (features.double() @ resid.double()[..., None])[..., 0] / scale
    size = (features.double().abs() @ resid.double().abs()[..., None])[..., 0] / scale
    assert got.dtype == torch.float32 and got.shape == (h, t)
    assert ((got.double() - want).abs() <= 1e-5 * size + 1e-7).all()
    twin = feature_correlation_reference(features, resid, scale)
    torch.testing.assert_close(twin, got, rtol=1e-5, atol=1e-6)


def test_empty_heads_and_keys_and_bad_shapes():
    features = stored(2, 0, 8, torch.float8_e4m3fn, 256.0)
    assert feature_correlation(
        features, torch.ones(2, 8, device=DEVICE), 256.0
    ).shape == (2, 0)
    with pytest.raises(ValueError, match="resid"):
        feature_correlation(features, torch.ones(3, 8, device=DEVICE), 256.0)
    with pytest.raises(ValueError, match="scale"):
        feature_correlation(features, torch.ones(2, 8, device=DEVICE), 0.0)


_COMPILE = """
from vllm_compaction_kernels.feature_correlation import _build
kernel = _build()
for feat in ("*fp8e4nv", "*fp16"):
    compile_sm90(kernel, dict(feat_ptr=feat, resid_ptr="*fp32", out_ptr="*fp32", inv_scale="fp32"),
                 dict(ITEM_BYTES=1 if "fp8" in feat else 2, BLOCK_T=16, BLOCK_N=512))
"""


def test_kernel_compiles_for_sm90(tmp_path):
    from kernels.sm90 import compile_for_sm90

    if DEVICE == "cuda":
        pytest.skip("compiled for this GPU by every other case here")

    compile_for_sm90(_COMPILE, tmp_path)
