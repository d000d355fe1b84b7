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


@pytest.mark.parametrize("freeze_beta", [False, True])
def test_frozen_slots_keep_their_key_and_value(freeze_beta):
    """Frozen slots keep key and value; with ``freeze_beta`` their ``beta`` too, while the
    other slots' biases still move."""
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
        freeze_beta=freeze_beta,
    )
    keep = frozen | ~valid
    assert torch.equal(k[keep], kept_k[keep]) and torch.equal(v[keep], kept_v[keep])
    assert (k[~keep] != kept_k[~keep]).any()
    assert (b[~valid] == 0).all()
    assert (b[~keep] != 0).any()
    assert ((b[frozen] == 0).all()) == freeze_beta


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
        ("am:refine_holdout=0.5", "refine_holdout must be a share in \\[0, 0.5\\)"),
        ("am:refine_key_radius=-0.1", "refine_key_radius must be a finite number >= 0"),
        ("am:refine_key_radius=inf", "leave it out for no limit"),
        ("am:refine_freeze_beta=yes", "refine_freeze_beta must be true or false"),
    ],
)
def test_bad_refinement_options_are_refused_with_a_sentence(method, sentence):
    with pytest.raises(ValueError, match=sentence):
        resolve(method)


def test_a_key_radius_bounds_how_far_each_key_moves():
    """``refine_key_radius``: no kept key ends further from the one selected than that share
    of its norm, and the bound binds (without it the keys go further)."""
    keys, values, queries = _inputs(3)
    plain = compact_heads(keys, values, queries, 8, method=AM)
    moved = {
        radius: compact_heads(
            keys,
            values,
            queries,
            8,
            method=AM,
            refine_steps=100,
            refine_lr=0.05,
            refine_key_radius=radius,
        ).keys
        for radius in (0.1, None)
    }
    start = plain.keys.float()
    reach = start.norm(dim=-1)
    shift = {r: (k.float() - start).norm(dim=-1) / reach for r, k in moved.items()}
    assert shift[0.1].max() <= 0.1 + 1e-5
    assert shift[None].max() > 0.2


def test_a_zero_key_radius_keeps_the_selected_tokens_while_beta_and_values_refit():
    """``refine_key_radius=0``: every slot keeps the original key it was selected as, and
    the steps on ``beta`` and the values alone still lower both errors on every head."""
    keys, values, queries = _inputs(2)
    plain = compact_heads(keys, values, queries, 8, method=AM)
    fixed = compact_heads(
        keys, values, queries, 8, method=AM, refine_steps=100, refine_key_radius=0
    )
    assert torch.equal(fixed.keys, plain.keys)
    assert torch.equal(fixed.indices, plain.indices)
    assert not torch.equal(fixed.values, plain.values)
    before = attention_output_error(plain, keys, values, queries)
    after = attention_output_error(fixed, keys, values, queries)
    assert (after.output_rel < before.output_rel).all(), (before, after)
    assert (after.log_mass_abs < before.log_mass_abs).all(), (before, after)


def test_it_runs_under_inference_mode_as_the_pipeline_compacts():
    keys, values, queries = _inputs(4)
    with torch.inference_mode():
        plain = compact_heads(keys, values, queries, 8, method=AM)
        refined = compact_heads(keys, values, queries, 8, method=AM, refine_steps=20)
    assert not torch.equal(plain.keys, refined.keys)


def test_holdout_never_ends_a_head_worse_on_the_queries_it_set_aside():
    """Each head returns the best iterate on the held-out share, the start included: its
    objective there is never above the start's (recomputed on the same seeded split). A share
    outside [0, 0.5) is refused."""
    from vllm_compaction.am.refine import _head_losses

    keys, values, queries = _inputs(2)
    t = 24
    start = (keys[:, :t].clone(), torch.zeros(H, t), values[:, :t].clone())
    valid = torch.ones(H, t, dtype=torch.bool)
    with torch.no_grad():
        reference = torch.softmax(0.5 * queries @ keys.transpose(-1, -2), -1)
        target_output = reference @ values
        target_log_mass = torch.logsumexp(0.5 * queries @ keys.transpose(-1, -2), -1)
    args = (queries, target_log_mass, target_output, *start, valid)
    options = {"scale": 0.5, "steps": 80, "lr": 0.05, "lower": -3.0, "upper": 3.0}
    refined = refine_slots(*args, **options, holdout=0.25, seed=3)
    with pytest.raises(ValueError, match=r"holdout must be in \[0, 0.5\)"):
        refine_slots(*args, **options, holdout=0.7)
    with pytest.raises(ValueError, match=r"key_radius must be >= 0"):
        refine_slots(*args, **options, key_radius=float("nan"))
    split = torch.randperm(N, generator=torch.Generator().manual_seed(3))[: N // 4]
    fitted = split.new_ones(N, dtype=torch.bool)
    fitted[split] = False
    norm = target_output[:, fitted].pow(2).sum(-1).mean(-1)
    held_out = (
        queries[:, split],
        target_log_mass[:, split],
        target_output[:, split],
        torch.ones(H, N // 4),
        norm,
    )
    before = _head_losses(*held_out, *start, valid, 0.5)
    after = _head_losses(*held_out, *refined, valid, 0.5)
    assert (after <= before).all(), (before, after)
    assert (after < 0.9 * before).any(), (before, after)


def test_holdout_keeps_heads_with_many_slots_from_fitting_their_queries_only():
    """A head keeping 32 of 64 keys under 48 queries: 300 steps on all of them raise its error
    on fresh queries of the same kind by about a third; with a quarter held out, no head ends
    more than a few percent above the closed form there."""
    keys, values, _ = _inputs(2)
    gen = torch.Generator().manual_seed(7)

    def draw(n: int) -> torch.Tensor:
        targets = torch.randint(0, T, (n,), generator=gen)
        return 1.5 * keys[:, targets] + torch.randn(H, n, D, generator=gen)

    fitted, fresh = draw(48), draw(2000)
    plain = compact_heads(keys, values, fitted, 32, method=AM)
    before = attention_output_error(plain, keys, values, fresh).output_rel
    worst = {}
    for holdout in (0.0, 0.25):
        refined = compact_heads(
            keys,
            values,
            fitted,
            32,
            method=AM,
            refine_steps=300,
            refine_lr=0.05,
            refine_holdout=holdout,
        )
        after = attention_output_error(refined, keys, values, fresh).output_rel
        worst[holdout] = (after / before).max().item()
    assert worst[0.0] > 1.15, worst
    assert worst[0.25] < 1.05, worst
