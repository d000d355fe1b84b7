"""The batched ``compact_heads`` against the paper's per-head algorithm on a real model's layer.

The oracle below is AM-HighestAttnKeys written the way the paper states it (section "Selecting
C_k", appendix "NNLS via Projected Gradient Descent"), one KV head at a time in float64 with
plain torch: keys ranked by the RMS over reference queries of their softmax weights; ``w =
exp(beta)`` by a least-squares start on the shifted mass, clamped to ``[e^-3, e^3]``, then two
projected-gradient steps of size ``1 / ||M||_2^2``; values by least squares on the compacted
attention weights. None of the batched code's machinery appears (chunking, log2 logits, head
groups, normal equations, Cholesky, power iteration).

The batched code departs from the paper in two declared numerical choices (``am.fit``): a
relative ridge ``JITTER`` on every least-squares solve, and Gram products in ``GRAM_DTYPE``
(float32). The oracle takes the ridge as an option. With the ridge mirrored and float64
products the two agree to float64 rounding of a conditioned problem (first test); with the
production float32 products against the paper's ridge-free solves they agree in what the fit
is for, the held-out error (second test). On this layer the value Gram's condition number is
~1e8, so the 1e-9 ridge alone moves the fitted values by up to ~2% of their largest entry.

The inputs are SmolLM2-135M-Instruct's post-RoPE keys, values and pooled queries of one layer
over an essay: the first ``PREFIX`` tokens are the block compacted; the queries of the tokens
after it (which attend to it in the real model) fit it, and those of the tokens after them are
held out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import vllm_compaction.am.fit as fit
from vllm_compaction.am import CompactedHeads, attention_output_and_mass, compact_heads
from vllm_compaction.corpus import haystack_text
from vllm_compaction.recipes import RECIPES

pytestmark = pytest.mark.slow

LAYER = 12
#: Block compacted, then the tokens whose queries fit it, then the held-out ones.
PREFIX, FIT_END, TOKENS = 250, 450, 600
RATIO = 0.1
#: The paper's NNLS box on beta and its projected-gradient steps for highest-attention keys.
BETA_BOUNDS, BETA_ITERS = (-3.0, 3.0), 2


@dataclass
class Layer:
    """One layer's block and queries, per KV head, float32: ``[H, PREFIX, d]`` keys and values,
    fitting queries ``[H, G * (FIT_END - PREFIX), d]`` and held-out ones
    ``[H, G * (TOKENS - FIT_END), d]``; the layer's softmax scale."""

    keys: torch.Tensor
    values: torch.Tensor
    fit_queries: torch.Tensor
    held_queries: torch.Tensor
    scale: float


@dataclass
class OracleHead:
    """One head compacted by the oracle: kept key indices (ascending), beta and values (float64)."""

    indices: torch.Tensor
    beta: torch.Tensor
    values: torch.Tensor


@pytest.fixture(scope="module")
def layer(smollm2) -> Layer:
    ids = smollm2.encode(haystack_text(TOKENS + 50, smollm2.tokenizer, seed=7))[:TOKENS]
    assert len(ids) == TOKENS
    kv = smollm2.prefill(ids)
    h, d = smollm2.num_kv_heads, smollm2.head_dim
    pooled = kv.queries[LAYER].view(h, -1, TOKENS, d)  # [H, G, tokens, d]
    return Layer(
        keys=kv.keys[LAYER][:, :PREFIX].float(),
        values=kv.values[LAYER][:, :PREFIX].float(),
        fit_queries=pooled[:, :, PREFIX:FIT_END].reshape(h, -1, d).float(),
        held_queries=pooled[:, :, FIT_END:].reshape(h, -1, d).float(),
        scale=smollm2.layer_scales()[LAYER],
    )


def _lstsq(a: torch.Tensor, b: torch.Tensor, ridge: float) -> torch.Tensor:
    """``argmin_x ||a x - b||^2 + r ||x||^2`` by QR of the stacked system, ``r = ridge`` times
    the mean diagonal of ``a^T a`` (the batched code's relative ridge; 0 is the paper's)."""
    if ridge:
        cols = a.shape[1]
        r = ridge * a.square().sum() / cols
        a = torch.cat([a, r.sqrt() * torch.eye(cols, dtype=a.dtype)])
        b = torch.cat([b, b.new_zeros(cols, b.shape[1])])
    return torch.linalg.lstsq(a, b, driver="gelsd").solution


def oracle_head(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    budget: int,
    scale: float,
    *,
    ridge: float = 0.0,
) -> OracleHead:
    """AM-HighestAttnKeys on one head (``[T, d]`` keys/values, ``[n, d]`` queries) in float64."""
    k, v, q = keys.double(), values.double(), queries.double()
    logits = scale * q @ k.T  # [n, T]
    weights = torch.softmax(logits, dim=1)
    scores = weights.square().mean(0).sqrt()  # RMS over the reference queries
    kept = scores.topk(budget).indices.sort().values
    # beta: mass matching, both sides shifted by each query's max logit over all keys
    shift = logits.amax(1, keepdim=True)
    features = torch.exp(logits[:, kept] - shift)  # M [n, t]
    mass = torch.exp(logits - shift).sum(1)  # y [n]
    lo, hi = math.exp(BETA_BOUNDS[0]), math.exp(BETA_BOUNDS[1])
    w = _lstsq(features, mass[:, None], ridge)[:, 0].clamp(lo, hi)
    step = 1.0 / torch.linalg.matrix_norm(features, ord=2).square()
    for _ in range(BETA_ITERS):
        w = (w - step * features.T @ (features @ w - mass)).clamp(lo, hi)
    beta = w.log()
    # values: least squares of the compacted weights onto the original outputs
    x = torch.softmax(logits[:, kept] + beta, dim=1)
    return OracleHead(kept, beta, _lstsq(x, weights @ v, ridge))


def oracle(layer: Layer, budget: int, *, ridge: float = 0.0) -> list[OracleHead]:
    return [
        oracle_head(
            layer.keys[h],
            layer.values[h],
            layer.fit_queries[h],
            budget,
            layer.scale,
            ridge=ridge,
        )
        for h in range(layer.keys.shape[0])
    ]


def batched(
    layer: Layer, budget: int, recipe: str = "am-highest-attn", **options
) -> CompactedHeads:
    """``compact_heads`` with the math of a named recipe, however the recipe spells it."""
    return compact_heads(
        layer.keys,
        layer.values,
        layer.fit_queries,
        budget,
        method=RECIPES[recipe].math,
        scale=layer.scale,
        **options,
    )


def _oracle_heads(layer: Layer, heads: list[OracleHead]) -> CompactedHeads:
    """The oracle's heads packed like ``compact_heads`` packs its own (float64)."""
    lengths = torch.tensor([len(o.indices) for o in heads])
    return CompactedHeads(
        keys=torch.cat(
            [layer.keys[h, o.indices].double() for h, o in enumerate(heads)]
        ),
        beta=torch.cat([o.beta for o in heads]),
        values=torch.cat([o.values for o in heads]),
        indices=torch.cat([o.indices for o in heads]),
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(
            torch.int32
        ),
    )


def held_out_error(heads: CompactedHeads, layer: Layer) -> torch.Tensor:
    """``[H]`` relative error of the compacted block's attention output against the original
    block's under the held-out queries, both in float64."""
    ref = attention_output_and_mass(
        layer.held_queries,
        layer.keys,
        layer.values,
        scale=layer.scale,
        dtype=torch.float64,
    ).output
    ck, cbeta, cv, _ = heads.padded()
    got = attention_output_and_mass(
        layer.held_queries, ck, cv, scale=layer.scale, beta=cbeta, dtype=torch.float64
    ).output
    return torch.linalg.vector_norm(got - ref, dim=(1, 2)) / torch.linalg.vector_norm(
        ref, dim=(1, 2)
    )


def _assert_heads_equal(
    got: CompactedHeads, want: list[OracleHead], *, beta_atol: float, values_rtol: float
) -> None:
    """Same kept keys per head; betas within ``beta_atol``; values within ``values_rtol`` of
    the head's largest fitted value."""
    for h, head in enumerate(want):
        _, beta, values, indices = got.head(h)
        assert torch.equal(indices, head.indices), f"head {h}: different keys kept"
        torch.testing.assert_close(
            beta.double(),
            head.beta,
            rtol=0,
            atol=beta_atol,
            msg=lambda m: f"head {h}: {m}",
        )
        size = head.values.abs().max()
        torch.testing.assert_close(
            values.double() / size,
            head.values / size,
            rtol=0,
            atol=values_rtol,
            msg=lambda m: f"head {h}: {m}",
        )


def test_batched_code_is_the_per_head_algorithm(layer, monkeypatch):
    """With float64 products and the ridge mirrored, what is left is the fp32 features and the
    float64 rounding of a problem whose value Gram has a condition number near 1e8: betas agree
    to 1e-5 (9.6e-6 measured), values to 4e-6 of the largest."""
    budget = round(RATIO * PREFIX)
    monkeypatch.setattr(fit, "GRAM_DTYPE", torch.float64)
    got = batched(layer, budget)
    assert (got.head_budgets == budget).all()
    _assert_heads_equal(
        got, oracle(layer, budget, ridge=fit.JITTER), beta_atol=2e-5, values_rtol=2e-5
    )


def test_held_out_error_equals_the_papers_and_beats_truncation_and_eviction(layer):
    """The production fit (float32 products, ridge) against the paper's ridge-free float64 fit:
    the same keys, betas within 2e-3 (4.6e-4 measured), values within 15% of the largest (8.4%
    measured: the ridge, in one weakly determined direction), and held-out errors equal to 1e-3
    (1.5e-4 measured); well below those of evicting the other keys (same keys, no beta, original
    values) or truncating the block to its last keys."""
    budget = round(RATIO * PREFIX)
    got, paper = batched(layer, budget), oracle(layer, budget)
    _assert_heads_equal(got, paper, beta_atol=2e-3, values_rtol=0.15)
    err, err_paper = (
        held_out_error(got, layer),
        held_out_error(_oracle_heads(layer, paper), layer),
    )
    err_evict = held_out_error(
        batched(layer, budget, beta="zero", values="direct"), layer
    )
    err_truncate = held_out_error(batched(layer, budget, "truncate"), layer)
    torch.testing.assert_close(err, err_paper, rtol=1e-3, atol=0)
    assert (err < err_evict).all() and err.mean() < 0.7 * err_evict.mean(), (
        err,
        err_evict,
    )
    assert (err < 0.1 * err_truncate).all(), (err, err_truncate)
