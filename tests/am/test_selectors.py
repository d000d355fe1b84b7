"""Selector properties: OMP greedy mass fit, KVMerger clusters, truncation, random, top-k."""

from __future__ import annotations

import math

import pytest
import torch

import vllm_compaction.am.attention as attention
from vllm_compaction.am import (
    SELECTORS,
    MethodSpec,
    attention_output_error,
    compact_heads,
    resolve_method,
    score_keys,
)
from vllm_compaction.am.attention import reference_attention
from vllm_compaction.am.fit import regularized_normal_matrix, solve_normal_equations
from vllm_compaction.am.presets import EVICTION_FIT
from vllm_compaction.am.selectors import KVMergerSelector, OMPSelector, SelectionProblem
from vllm_compaction.am.selectors.base import PRIORITY_SHARE
from vllm_compaction.am.selectors.omp import _GreedyMassFit
from vllm_compaction.recipes import RECIPES


def _problem(
    seed: int,
    h: int = 3,
    t: int = 64,
    n: int = 300,
    d: int = 8,
    budget: int = 16,
    features: bool = False,
    aggregation: str | None = None,
) -> SelectionProblem:
    gen = torch.Generator().manual_seed(seed)
    keys, values = (
        torch.randn(h, t, d, generator=gen),
        torch.randn(h, t, d, generator=gen),
    )
    queries = 1.2 * keys[:, torch.randint(0, t, (n,), generator=gen)] + torch.randn(
        h, n, d, generator=gen
    )
    scale = 1 / math.sqrt(d)
    ref = reference_attention(
        keys,
        values,
        queries,
        scale=scale,
        aggregation=aggregation,
        keep_features=features,
    )
    return SelectionProblem(keys, values, queries, scale, torch.full((h,), budget), ref)


@pytest.mark.parametrize("name", list(SELECTORS))
def test_each_selector_resolves_by_its_name_and_runs(name):
    """A spec naming a selector resolves to that class with its defaults (the name a class
    declares is the one a ``MethodSpec`` gives), and ``selector=`` swaps to it from any spec,
    dropping the spec's own selector options; the result keeps its budgets."""
    cls = SELECTORS[name]
    resolved = resolve_method(MethodSpec(name), {})
    assert (
        type(resolved.selector) is cls
        and resolved.selector.name == name
        and resolved.selector == cls()
    )
    other = next(
        r.math
        for r in RECIPES.values()  # an eviction spec with options, of another selector
        if r.math.selector != name
        and r.math.selector_options
        and r.math.fit == EVICTION_FIT
    )
    swapped = resolve_method(other, {"selector": name})
    assert type(swapped.selector) is cls and swapped.selector == cls()
    p = _problem(
        6,
        aggregation=resolved.selector.score_aggregation,
        features=resolved.selector.needs_features,
    )
    sel = resolved.selector.select(p)
    assert sel.lengths.tolist() == [16, 16, 16]
    assert all(len(set(row.tolist())) == 16 for row in sel.indices), "no key kept twice"


def test_omp_mass_residual_never_increases():
    p = _problem(0, budget=24, features=True)
    state = _GreedyMassFit(p, per_round=1)
    norms = []
    while not state.done.all():
        state.add_keys()
        w = state.refit(lower=0.0)  # plain least squares on nested sets: monotone
        state.update_residual(w)
        resid = (
            p.reference.mass
            - torch.bmm(w.float()[:, None, :], state.phi_s[:, : state.t_max])[:, 0]
        )
        norms.append(torch.linalg.vector_norm(resid, dim=-1))
    norms = torch.stack(norms)  # [rounds, H]
    assert len(norms) == 24
    assert (norms[1:] <= norms[:-1] * (1 + 1e-4) + 1e-6).all()


@pytest.mark.parametrize(("storage", "rounding"), [("fp16", 2e-3), ("fp8", 7e-2)])
def test_omp_ranks_with_low_precision_features_but_fits_exact_columns(
    storage, rounding, monkeypatch
):
    """The correlation pass reads fp16 features (scaled residual: no overflow even for a huge
    residual) or fp8 ones (CUDA's storage, scaled by a power of two; fp32 residual), within
    their rounding of the fp32 product (fp16's relative 2^-11 on sums, fp8's 2^-4 per
    entry); the kept columns the fits use are the exact fp32 features, recomputed from the
    keys."""
    monkeypatch.setattr(attention, "FEATURE_STORAGE", storage)
    p = _problem(5, budget=24, features=True)
    stored = p.reference.features.dtype
    assert stored == (torch.float16 if storage == "fp16" else torch.float8_e4m3fn)
    # [H, n, T]
    phi = torch.exp(
        p.scale * p.queries @ p.keys.transpose(1, 2) - p.reference.shift[..., None]
    )
    state = _GreedyMassFit(p, per_round=4)
    gen = torch.Generator().manual_seed(0)
    for resid in (
        p.reference.mass,
        1e6 * torch.randn(3, 300, generator=gen),
        torch.randn(3, 300, generator=gen),
    ):
        exact = (phi * resid[..., None]).sum(1)
        err = (state._correlation(resid) - exact).abs()
        size = (phi * resid.abs()[..., None]).sum(1) if storage == "fp8" else None
        bound = (
            rounding * size + 1e-5 * resid.abs().sum(-1, keepdim=True)
            if size is not None
            else rounding * resid.abs().sum(-1, keepdim=True)
        )
        assert (err <= bound).all()
    state.add_keys()
    kept = state.idx[:, :4]
    torch.testing.assert_close(
        state.phi_s[:, :4],
        phi.gather(2, kept[:, None, :].expand(3, 300, 4)).transpose(1, 2),
    )


def test_omp_refits_solve_only_the_used_slots_and_agree_with_the_whole_budget():
    """A refit solves the normal equations of the slots filled so far; the free slots above
    them are decoupled in the budget-sized system and solve to 0, so both give one answer
    (with the ridge the kept factor was made with)."""
    p = _problem(8, budget=40, features=True)
    state = _GreedyMassFit(p, per_round=6)
    for _ in range(3):
        state.add_keys()
        t = state.t_max
        solved = state._solve()
        whole = solve_normal_equations(
            state.gram[:, :t, :t],
            state.rhs[:, :t, None],
            state.valid,
            ridge=state.ridge,
        )[..., 0]
        assert state.high == int(state.count.max()) < t
        torch.testing.assert_close(solved, whole, rtol=1e-10, atol=1e-12)
        state.update_residual(state.refit(lower=0.0))


@pytest.mark.parametrize("per_round", [1, (1, 3, 2)])
def test_omp_kept_factor_is_the_factor_of_the_current_equations(per_round):
    """The Cholesky factor a refit extends round by round equals a fresh factorisation of the
    equations of the slots kept now, through drops (a floor that many keys fall under), slots
    refilled below the factored ones, and heads taking different numbers of keys a round;
    and the refit's weights are those of a fresh solve."""
    p = _problem(3, budget=30, features=True)
    state = _GreedyMassFit(p, per_round=torch.tensor(per_round).expand(3))
    lower, extended = 1.0, 0
    while not state.done.all():
        state.add_keys()
        before = state.factor_size
        w = state.refit(lower)
        used = min(state.high, state.t_max)
        extended += 0 < before < used and state.factor_size == used
        assert state.factor_size == used
        matrix, _ = regularized_normal_matrix(
            state.gram[:, :used, :used], state.valid[:, :used], ridge=state.ridge
        )
        torch.testing.assert_close(
            state._lower(used), torch.linalg.cholesky(matrix), rtol=1e-9, atol=1e-12
        )
        fresh = solve_normal_equations(
            state.gram[:, :used, :used],
            state.rhs[:, :used, None],
            state.valid[:, :used],
            ridge=state.ridge,
        )[..., 0]
        torch.testing.assert_close(w[:, :used], fresh, rtol=1e-8, atol=1e-12)
        state.update_residual(torch.where(state.valid, w.clamp_min(lower), 0.0))
    assert extended > 5, "rounds extend the factor"
    assert int(state.excluded.sum() - state.count.sum()) > 0, "some keys were dropped"


@pytest.mark.parametrize("method", ["am-omp", "am-omp-fast"])
def test_omp_with_fp8_features_fits_as_well_as_with_fp16(method, monkeypatch):
    """CUDA ranks OMP's candidates with fp8 features; on the CPU the same storage (a torch
    correlation over the widened fp8 features) gives caches as good as fp16's on held-out
    queries."""
    p = _problem(3, h=2, t=400, n=900, d=32)
    keys, values, queries = p.keys, p.values, p.queries
    errors = {}
    for storage in ("fp16", "fp8"):
        monkeypatch.setattr(attention, "FEATURE_STORAGE", storage)
        heads = compact_heads(
            keys, values, queries[:, :600], [40, 25], method=RECIPES[method].math
        )
        assert heads.head_budgets.tolist() == [40, 25]
        errors[storage] = attention_output_error(
            heads, keys, values, queries[:, 600:]
        ).output_rel
    assert (errors["fp8"] <= errors["fp16"] * 1.05 + 1e-3).all(), errors


def test_omp_refit_interval_equals_bigger_steps():
    """The correlation only changes at refits, so (k=4, tau=2) selects as (k=8, tau=1)."""
    p = _problem(1, budget=20, features=True)
    a = OMPSelector(keys_per_step=4, refit_interval=2).select(p)
    b = OMPSelector(keys_per_step=8, refit_interval=1).select(p)
    assert torch.equal(a.indices.sort(-1).values, b.indices.sort(-1).values)


def test_omp_betas_within_the_stabiliser_bounds():
    p = _problem(2, budget=30, features=True)
    sel = OMPSelector(
        keys_per_step=2, refit_interval=1, min_beta=-2.0, max_beta=1.0
    ).select(p)
    assert sel.lengths.tolist() == [30, 30, 30]
    assert (sel.beta >= -2.0 - 1e-6).all() and (sel.beta <= 1.0 + 1e-6).all()
    assert all(len(set(row.tolist())) == 30 for row in sel.indices), "no key kept twice"


def test_kvmerger_clusters_are_consecutive_runs_with_anchor_and_merged_value():
    p = _problem(3, budget=10, aggregation="mean")
    sel = KVMergerSelector(sigma=0.5).select(p)
    scores = p.reference.scores
    for h in range(3):
        anchors = sel.indices[h]
        assert (anchors[1:] > anchors[:-1]).all() and len(anchors) == 10
        # the cuts are the 9 least similar neighbour pairs; each anchor is its run's top score
        unit = torch.nn.functional.normalize(p.keys[h], dim=-1)
        sims = (unit[1:] * unit[:-1]).sum(-1)
        cuts = torch.sort(torch.topk(-sims, 9).indices + 1).values.tolist()
        bounds = [0, *cuts, 64]
        for c, (a, b) in enumerate(zip(bounds, bounds[1:])):
            assert a <= int(anchors[c]) < b
            assert int(anchors[c]) == a + int(scores[h, a:b].argmax())
            g = torch.exp(
                -(unit[a:b] - unit[anchors[c]]).square().sum(-1) / (2 * 0.5**2)
            )
            torch.testing.assert_close(
                sel.values[h, c], (g[:, None] * p.values[h, a:b]).sum(0) / g.sum()
            )


@pytest.mark.parametrize("keep", ["first", "last"])
def test_truncate_keeps_a_contiguous_span(keep):
    keys = torch.randn(2, 10, 4)
    heads = compact_heads(
        keys,
        keys,
        torch.empty(2, 0, 4),
        [3, 0],
        method=RECIPES["truncate"].math,
        keep=keep,
    )
    assert heads.head(0)[3].tolist() == ([0, 1, 2] if keep == "first" else [7, 8, 9])
    assert heads.head(1)[3].numel() == 0


def test_random_is_seeded():
    keys = torch.randn(2, 50, 4)
    pick = lambda seed: (
        compact_heads(
            keys,
            keys,
            torch.empty(2, 0, 4),
            10,
            method=RECIPES["random"].math,
            seed=seed,
        ).indices
    )  # noqa: E731
    assert torch.equal(pick(1), pick(1)) and not torch.equal(pick(1), pick(2))


@pytest.mark.parametrize(
    "method,aggregation",
    [("am-highest-attn", "rms"), ("h2o+", "mean"), ("kvzip", "max")],
)
def test_highest_attention_keeps_the_top_scored_keys(method, aggregation):
    p = _problem(4)
    heads = compact_heads(p.keys, p.values, p.queries, 12, method=RECIPES[method].math)
    scores = score_keys(p.keys, p.queries, aggregation=aggregation)
    for h in range(3):
        want = torch.topk(scores[h], 12).indices.sort().values
        assert torch.equal(heads.head(h)[3], want)


def test_priority_keys_are_kept_first_up_to_their_share_then_the_best_scored_others():
    p = _problem(5)
    scores = score_keys(p.keys, p.queries, aggregation="rms")
    # the 6 lowest-scored keys of head 0 have priority: with 12 slots every head keeps them
    # all (half its budget), and its other slots are its best-scored other keys
    priority = torch.zeros(p.keys.shape[1], dtype=torch.bool)
    priority[scores[0].argsort()[:6]] = True
    method = RECIPES["am-highest-attn"].math

    def kept(budget: int, keys: torch.Tensor = priority) -> torch.Tensor:
        return compact_heads(
            p.keys, p.values, p.queries, budget, method=method, priority=keys
        ).indices.view(3, budget)

    assert PRIORITY_SHARE == 0.5
    for h in range(3):
        others = scores[h].masked_fill(priority, -1.0)
        want = torch.cat([priority.nonzero()[:, 0], torch.topk(others, 6).indices])
        assert torch.equal(kept(12)[h], want.sort().values)
    # with 6 slots, the 3 best-scored priority keys and the 3 best of the rest
    for h in range(3):
        first = torch.topk(scores[h].masked_fill(~priority, -1.0), 3).indices
        rest = torch.topk(scores[h].index_fill(0, first, -1.0), 3).indices
        assert torch.equal(kept(6)[h], torch.cat([first, rest]).sort().values)
    # no priority key: the plain selection
    plain = compact_heads(p.keys, p.values, p.queries, 12, method=method)
    assert torch.equal(kept(12, torch.zeros_like(priority)).flatten(), plain.indices)


def test_priority_spans_are_kept_whole_best_first_while_they_fit():
    """Span ids: each head ranks the spans by their best-scored key and takes each whole while
    it fits half its budget (skipping one that no longer fits), then its best other keys; the
    same choice as a plain Python greedy over the spans."""
    p = _problem(4, t=64)
    scores = score_keys(p.keys, p.queries, aggregation="rms")
    spans = torch.full((64,), -1, dtype=torch.int64)
    for i, (start, size) in enumerate([(3, 5), (12, 2), (20, 6), (40, 3), (50, 1)]):
        spans[start : start + size] = i
    method = RECIPES["am-highest-attn"].math
    for budget in (4, 9, 16, 40):
        kept = compact_heads(
            p.keys, p.values, p.queries, budget, method=method, priority=spans
        ).indices.view(3, budget)
        room = int(budget * PRIORITY_SHARE)
        for h in range(3):
            best = {
                int(i): float(scores[h][spans == i].max()) for i in spans.unique()[1:]
            }
            lifted: list[int] = []
            for i in sorted(best, key=lambda i: -best[i]):
                members = (spans == i).nonzero()[:, 0].tolist()
                if len(lifted) + len(members) <= room:
                    lifted += members
            others = scores[h].clone()
            others[lifted] = -1.0
            rest = torch.topk(others, budget - len(lifted)).indices.tolist()
            assert kept[h].tolist() == sorted(lifted + rest), (budget, h)
            assert 0 < len(lifted) <= room
    # no span: the plain selection
    plain = compact_heads(p.keys, p.values, p.queries, 12, method=method)
    none = torch.full_like(spans, -1)
    assert torch.equal(
        compact_heads(
            p.keys, p.values, p.queries, 12, method=method, priority=none
        ).indices,
        plain.indices,
    )


def test_omp_round_bound_only_changes_large_heads():
    p = _problem(3, budget=16, features=True)
    plain = OMPSelector(keys_per_step=2, refit_interval=1).select(p)
    # 16 <= 8 * 2
    bounded = OMPSelector(keys_per_step=2, refit_interval=1, max_rounds=8).select(p)
    assert torch.equal(plain.indices, bounded.indices)
    big = SelectionProblem(
        p.keys, p.values, p.queries, p.scale, torch.tensor([4, 60, 16]), p.reference
    )
    fast = OMPSelector(keys_per_step=1, refit_interval=1, max_rounds=4).select(big)
    assert fast.lengths.tolist() == [4, 60, 16]
    for h in range(3):  # distinct keys per head
        kept = fast.indices[h, : fast.lengths[h]]
        assert kept.unique().numel() == kept.numel()


def test_omp_seed_share_keeps_the_sharpest_keys_then_fits_the_mass():
    """``seed_share``: the first round takes each head's keys of highest attention from any
    query; OMP then fills the budget. A refit drops only keys whose weight is below
    ``e^min_beta``; with ``min_beta = -50`` no seed of this problem is dropped, so all stay."""
    assert (
        OMPSelector(seed_share=0.25).score_aggregation == "max"
        and OMPSelector().score_aggregation is None
    )
    # what compact_heads builds for it
    p = _problem(4, budget=20, features=True, aggregation="max")
    # [H, T]
    sharpest = torch.softmax(p.scale * p.queries @ p.keys.transpose(1, 2), -1).amax(1)
    seeded = OMPSelector(
        keys_per_step=2, refit_interval=1, seed_share=0.25, min_beta=-50.0
    ).select(p)
    assert seeded.lengths.tolist() == [20, 20, 20]
    for h in range(3):
        kept = set(seeded.indices[h].tolist())
        assert len(kept) == 20
        # ceil(0.25 * 20) seeds
        assert set(torch.topk(sharpest[h], 5).indices.tolist()) <= kept
    plain = OMPSelector(keys_per_step=2, refit_interval=1, seed_share=0.0).select(p)
    assert torch.equal(
        plain.indices, OMPSelector(keys_per_step=2, refit_interval=1).select(p).indices
    )
    with pytest.raises(ValueError, match="seed_share"):
        OMPSelector(seed_share=1.5)


def _least_massive_priority(
    p: SelectionProblem, count: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mass_score [H, T], priority [T])``: each key's attention mass (``Phi^T m``) and a
    priority mask on the ``count`` keys of least mass in head 0."""
    assert p.reference is not None and p.reference.features is not None
    mass_score = torch.bmm(p.reference.features.float(), p.reference.mass[..., None])[
        ..., 0
    ]
    priority = torch.zeros(p.keys.shape[1], dtype=torch.bool)
    priority[mass_score[0].argsort()[:count]] = True
    return mass_score, priority


def test_omp_keeps_priority_keys_first_by_mass_then_fits_the_mass_around_them():
    """Priority keys are OMP's first round: each head takes its best of them by attention mass
    (``Phi^T m``), up to half its budget, then the greedy rounds fill the rest. With
    ``min_beta = -50`` no key is dropped, so the lifted ones all stay; no priority key gives the
    paper's OMP."""
    p = _problem(6, budget=12, features=True)
    # the 8 keys of least mass in head 0: more than half a budget of 12
    mass_score, priority = _least_massive_priority(p)
    omp = OMPSelector(keys_per_step=2, refit_interval=1, min_beta=-50.0)
    plain = omp.select(p)
    chosen = omp.select(
        SelectionProblem(
            p.keys, p.values, p.queries, p.scale, p.budgets, p.reference, priority
        )
    )
    assert chosen.lengths.tolist() == [12, 12, 12]
    for h in range(3):
        kept = set(chosen.indices[h].tolist())
        best = torch.topk(mass_score[h].masked_fill(~priority, -1.0), 6).indices
        assert set(best.tolist()) <= kept and len(kept) == 12
        assert len(kept & set(priority.nonzero()[:, 0].tolist())) == 6
        # the paper's OMP would not keep them: they have the least mass
        assert len(set(plain.indices[h].tolist()) & set(best.tolist())) < 6
    none = torch.zeros_like(priority)
    again = omp.select(
        SelectionProblem(
            p.keys, p.values, p.queries, p.scale, p.budgets, p.reference, none
        )
    )
    assert torch.equal(again.indices, plain.indices)


def test_omp_freezes_priority_keys_at_the_floor_and_fits_the_others_without_them():
    """With the paper's floor (``beta >= -7``) the least-massive priority keys get a negative
    unconstrained weight: they stay (frozen at ``beta = -7``) and the other kept keys' weights
    are the least-squares fit of the mass without their columns, not one leaning on a negative
    weight that the floor then removes."""
    p = _problem(6, budget=12, features=True)
    mass_score, priority = _least_massive_priority(p)
    chosen = OMPSelector(keys_per_step=2, refit_interval=1).select(
        SelectionProblem(
            p.keys, p.values, p.queries, p.scale, p.budgets, p.reference, priority
        )
    )
    assert chosen.beta is not None
    frozen_any = False
    for h in range(3):
        idx, beta = chosen.indices[h], chosen.beta[h].double()
        lifted = torch.topk(mass_score[h].masked_fill(~priority, -1.0), 6).indices
        assert set(lifted.tolist()) <= set(idx.tolist())
        frozen = beta <= -7.0 + 1e-6
        frozen_any |= bool(frozen.any())
        assert set(idx[frozen].tolist()) <= set(lifted.tolist())
        # the others: the mass fit on their exact columns alone
        logits = p.queries[h] @ p.keys[h, idx[~frozen]].T * p.scale
        phi = torch.exp(logits - p.reference.shift[h][:, None]).double()
        want = torch.linalg.lstsq(phi, p.reference.mass[h].double()[:, None]).solution
        assert torch.allclose(
            beta[~frozen].exp(), want[:, 0].clamp(math.exp(-7)), rtol=1e-3
        )
    assert frozen_any  # the case this test is about occurs
