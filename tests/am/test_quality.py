"""Attention Matching on structured synthetic heads: it beats its no-bias / direct-value
counterparts on held-out queries, and its output + mass errors bound the error of attention
over the compacted block concatenated with any appended block."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_compaction.am import (
    attention_output_and_mass,
    attention_output_error,
    compact_heads,
)
from vllm_compaction.recipes import RECIPES

H, T, N_FIT, N_EVAL, D, BUDGET = 6, 256, 1000, 250, 16, 26


def _structured(
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Topic segments of similar keys, a sink, low-rank values, queries aiming at a key + sink."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    topics = rand(H, 12, D)
    seg = torch.cumsum((torch.rand(T, generator=gen) < 1 / 16).long(), 0) % 12
    keys = 0.5 * rand(H, 1, D) + topics[:, seg] + 0.5 * rand(H, T, D)
    keys[:, 0] = 3.0 * rand(H, D)
    values = topics[:, seg] @ rand(H, D, D) / math.sqrt(D) + 0.3 * rand(H, T, D)
    n = N_FIT + N_EVAL
    target = torch.randint(0, T, (n,), generator=gen)
    k_t, k_s = keys[:, target], keys[:, :1]
    scale = 1 / math.sqrt(D)
    a = (
        6.0
        * (0.4 + 0.8 * torch.rand(H, n, 1, generator=gen))
        / (k_t.square().sum(-1, keepdim=True) * scale)
    )
    b = (
        6.0
        * (0.5 + 0.7 * torch.rand(H, n, 1, generator=gen))
        / (k_s.square().sum(-1, keepdim=True) * scale)
    )
    queries = a * k_t + b * k_s + 0.5 * rand(H, n, D)
    return keys, values, queries[:, :N_FIT], queries[:, N_FIT:]


@pytest.mark.parametrize("method", ["am-highest-attn", "am-omp-fast"])
def test_am_beats_its_no_bias_direct_value_counterpart(method):
    keys, values, fit_q, eval_q = _structured(0)
    math = RECIPES[method].math
    am = compact_heads(keys, values, fit_q, BUDGET, method=math)
    plain = compact_heads(
        keys, values, fit_q, BUDGET, method=math, beta="zero", values="direct"
    )
    assert torch.equal(am.indices, plain.indices), (
        "same keys, only beta and values differ"
    )
    err_am = attention_output_error(am, keys, values, eval_q)
    err_plain = attention_output_error(plain, keys, values, eval_q)
    assert (err_am.output_rel < err_plain.output_rel).sum() >= H - 1
    assert (err_am.log_mass_abs < err_plain.log_mass_abs).sum() >= H - 1
    h2o_heads = compact_heads(keys, values, fit_q, BUDGET, method=RECIPES["h2o+"].math)
    h2o = attention_output_error(h2o_heads, keys, values, eval_q)
    assert (err_am.output_rel < h2o.output_rel).sum() >= H - 1


def test_concatenated_attention_error_is_bounded_by_output_and_mass_errors():
    """With y/m the block's output/mass, f/M the appended block's and a = m / (m + M):
    ||Attn([C; K_f]) - Attn([K; K_f])|| <= a ||y_hat - y|| + |log m_hat - log m| / 4 * ||y_hat - f||."""
    keys, values, fit_q, eval_q = _structured(1)
    heads = compact_heads(
        keys, values, fit_q, BUDGET, method=RECIPES["am-highest-attn"].math
    )
    ck, cbeta, cv, _ = heads.padded()
    gen = torch.Generator().manual_seed(2)
    kf, vf = (
        1.5 * torch.randn(H, 40, D, generator=gen),
        torch.randn(H, 40, D, generator=gen),
    )
    zeros = torch.zeros(H, 40)
    full = attention_output_and_mass(
        eval_q, torch.cat([keys, kf], 1), torch.cat([values, vf], 1)
    )
    approx = attention_output_and_mass(
        eval_q,
        torch.cat([ck, kf], 1),
        torch.cat([cv, vf], 1),
        beta=torch.cat([cbeta, zeros], 1),
    )
    block = attention_output_and_mass(eval_q, keys, values)
    compact = attention_output_and_mass(eval_q, ck, cv, beta=cbeta)
    fixed = attention_output_and_mass(eval_q, kf, vf)
    a = torch.sigmoid(block.log_mass - fixed.log_mass)
    bound = a * (compact.output - block.output).norm(dim=-1) + (
        compact.log_mass - block.log_mass
    ).abs() / 4 * (compact.output - fixed.output).norm(dim=-1)
    err = (approx.output - full.output).norm(dim=-1)
    assert (err <= bound + 1e-4).all()
    assert err.mean() < 0.5 * (full.output - fixed.output).norm(dim=-1).mean(), (
        "the bound is not vacuous here"
    )
