"""``refine_steps``: the joint gradient refinement of ``(C_k, beta, C_v)`` after the closed-form
fits lowers the Attention Matching objective it descends, keeps exact heads exact, frozen slots
as they were and ``beta`` in its bounds, and changes nothing at 0 steps."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.am import attention_output_error, compact_heads
from vllm_compaction.am.refine import refine_slots
from vllm_compaction.recipes import RECIPES, resolve

AM = RECIPES["am"].math
H, T, N, D = 3, 64, 240, 8


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random heads whose queries lean on a few keys each (as test_compact builds them)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(H, T, D, generator=gen)
    values = torch.randn(H, T, D, generator=gen)
    targets = torch.randint(0, T, (N,), generator=gen)
    queries = 1.5 * keys[:, targets] + torch.randn(H, N, D, generator=gen)
    return keys, values, queries


def test_zero_steps_is_the_closed_form_fit():
    keys, values, queries = _inputs()
    plain = compact_heads(keys, values, queries, 8, method=AM)
    zero = compact_heads(keys, values, queries, 8, method=AM, refine_steps=0)
    for field in ("keys", "beta", "values", "indices", "cu_seqlens"):
        assert torch.equal(getattr(plain, field), getattr(zero, field)), field


def test_refinement_lowers_both_errors_on_the_fitted_queries():
    """The objective it descends is the one the closed form solves in parts: on the queries it
    was fitted on, the outputs' and the log masses' errors both fall on every head."""
    keys, values, queries = _inputs()
    plain = compact_heads(keys, values, queries, 8, method=AM)
    refined = compact_heads(keys, values, queries, 8, method=AM, refine_steps=100)
    before = attention_output_error(plain, keys, values, queries)
    after = attention_output_error(refined, keys, values, queries)
    assert (after.output_rel < before.output_rel).all(), (before, after)
    assert (after.log_mass_abs < 0.8 * before.log_mass_abs).all(), (before, after)
    # the keys left the original key set: a slot may now stand for several keys
    assert not torch.equal(refined.keys, plain.keys)
    assert torch.equal(refined.indices, plain.indices)


def test_steps_on_a_draw_of_the_queries_lower_the_errors_too_and_repeat():
    """``refine_batch``: each step sees a seeded draw of the queries; the errors over all of
    them still fall, and the same call gives the same slots."""
    keys, values, queries = _inputs(5)
    plain = compact_heads(keys, values, queries, 8, method=AM)
    runs = [
        compact_heads(
            keys, values, queries, 8, method=AM, refine_steps=100, refine_batch=48
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0].keys, runs[1].keys)
    before = attention_output_error(plain, keys, values, queries)
    after = attention_output_error(runs[0], keys, values, queries)
    assert (after.log_mass_abs < before.log_mass_abs).all(), (before, after)
    assert (after.output_rel < before.output_rel).all(), (before, after)


def test_exact_heads_stay_exact_and_beta_stays_in_its_box():
    keys, values, queries = _inputs(1)
    budgets = [T, 6, 0]
    heads = compact_heads(
        keys,
        values,
        queries,
        budgets,
        method=AM,
        refine_steps=60,
        refine_lr=0.2,
        beta_bounds=(-1.0, 0.5),
    )
    assert heads.head_budgets.tolist() == budgets
    ck, beta, cv, _ = heads.padded()
    assert torch.equal(ck[0], keys[0]) and torch.equal(cv[0], values[0])
    assert torch.equal(beta[0], torch.zeros(T))
    fitted = beta[1, :6]
    assert (fitted >= -1.0).all() and (fitted <= 0.5).all(), fitted


def test_frozen_slots_keep_their_key_and_value():
    gen = torch.Generator().manual_seed(2)
    keys, values = (
        torch.randn(2, 12, 4, generator=gen),
        torch.randn(2, 12, 4, generator=gen),
    )
    queries = torch.randn(2, 40, 4, generator=gen)
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    frozen = torch.zeros(2, 5, dtype=torch.bool)
    frozen[0, 1] = frozen[1, 2] = True
    kept_k, kept_v = keys[:, :5].clone(), values[:, :5].clone()
    ref_logits = queries @ keys.transpose(-1, -2) / 2
    k, b, v = refine_slots(
        queries,
        torch.logsumexp(ref_logits, -1),
        torch.softmax(ref_logits, -1) @ values,
        kept_k,
        torch.zeros(2, 5),
        kept_v,
        valid,
        scale=0.5,
        steps=20,
        lr=0.1,
        lower=-3.0,
        upper=3.0,
        frozen=frozen,
    )
    keep = frozen | ~valid
    assert torch.equal(k[keep], kept_k[keep]) and torch.equal(v[keep], kept_v[keep])
    assert (k[~keep] != kept_k[~keep]).any()
    assert (b[~valid] == 0).all()


def test_the_kept_identifiers_keep_their_own_keys():
    """Priority keys (kept identifiers) are frozen: their slots hold the original keys."""
    keys, values, queries = _inputs(3)
    priority = torch.zeros(T, dtype=torch.bool)
    priority[[5, 17, 40]] = True
    heads = compact_heads(
        keys, values, queries, 10, method=AM, refine_steps=40, priority=priority
    )
    ck, _, _, idx = heads.padded()
    for h in range(H):
        slots = [s for s, index in enumerate(idx[h].tolist()) if index in (5, 17, 40)]
        assert len(slots) == 3, idx[h]
        for slot in slots:
            assert torch.equal(ck[h, slot], keys[h, idx[h, slot]])
    # the other slots did move
    assert not torch.equal(
        ck, keys.gather(1, idx.clamp_min(0)[..., None].expand_as(ck))
    )


@pytest.mark.parametrize(
    ("method", "sentence"),
    [
        ("am:refine_steps=-1", "refine_steps must be a non-negative integer"),
        ("am:refine_lr=0", "refine_lr must be a finite number > 0"),
        ("kvzip:refine_steps=5", "needs beta='nnls' and values='lstsq'"),
        ("am:refine_batch=-4", "refine_batch must be a non-negative integer"),
    ],
)
def test_bad_refinement_options_are_refused_with_a_sentence(method, sentence):
    with pytest.raises(ValueError, match=sentence):
        resolve(method)


def test_it_runs_under_inference_mode_as_the_pipeline_compacts():
    keys, values, queries = _inputs(4)
    with torch.inference_mode():
        plain = compact_heads(keys, values, queries, 8, method=AM)
        refined = compact_heads(keys, values, queries, 8, method=AM, refine_steps=20)
    assert not torch.equal(plain.keys, refined.keys)
