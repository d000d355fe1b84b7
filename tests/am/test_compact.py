"""``compact_heads``: exactness at t = T, batched == looped oracle, every recipe's math x budget
shape, and input validation."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.am import (
    CompactedHeads,
    MethodSpec,
    attention_output_error,
    compact_heads,
    resolve_method,
)
from vllm_compaction.am.compact import STAGES
from vllm_compaction.recipes import RECIPES

#: The math of every recipe, by recipe name.
MATH = {name: recipe.math for name, recipe in RECIPES.items()}
#: One recipe name per distinct math (recipes that share math share the object).
DISTINCT = [
    name
    for name, math in MATH.items()
    if next(n for n, m in MATH.items() if m is math) == name
]
AM_PRESETS = ["am-highest-attn", "am-omp", "am-omp-fast"]
H, T, N, D = 4, 48, 160, 8


def _inputs(
    seed: int = 0, h: int = H, t: int = T, n: int = N, d: int = D
) -> tuple[torch.Tensor, ...]:
    """Random heads with a sink key and queries leaning on a few keys (continuous: no ties)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(h, t, d, generator=gen)
    keys[:, 0] *= 3.0
    values = torch.randn(h, t, d, generator=gen)
    targets = torch.randint(0, t, (n,), generator=gen)
    queries = 1.5 * keys[:, targets] + torch.randn(h, n, d, generator=gen)
    return keys, values, queries


def _assert_heads_equal(
    a: CompactedHeads, b: CompactedHeads, tol: float = 1e-4
) -> None:
    assert torch.equal(a.cu_seqlens, b.cu_seqlens)
    assert torch.equal(a.indices, b.indices)
    torch.testing.assert_close(a.keys, b.keys)
    torch.testing.assert_close(a.beta, b.beta, rtol=tol, atol=tol / 10)
    torch.testing.assert_close(a.values, b.values, rtol=tol, atol=tol)


@pytest.mark.parametrize("method", DISTINCT)
def test_budget_T_reproduces_attention_exactly(method):
    keys, values, queries = _inputs()
    heads = compact_heads(keys, values, queries, T, method=MATH[method])
    assert torch.equal(heads.keys.view(H, T, D), keys) and torch.equal(
        heads.values.view(H, T, D), values
    )
    assert torch.equal(heads.beta, torch.zeros(H * T))
    err = attention_output_error(heads, keys, values, queries)
    assert err.output_rel.max() < 1e-5 and err.mass_rel.max() < 1e-5


@pytest.mark.parametrize(
    "method",
    [
        "am-highest-attn",
        "am-omp",
        "am-omp-fast",
        "h2o+",
        "snapkv",
        "kvzip",
        "kvmerger",
        "truncate",
    ],
)
def test_batched_equals_per_head_loop(method):
    keys, values, queries = _inputs(1)
    budgets = [0, 5, T, 17]
    batched = compact_heads(keys, values, queries, budgets, method=MATH[method])
    looped = [
        compact_heads(
            keys[h : h + 1],
            values[h : h + 1],
            queries[h : h + 1],
            [t],
            method=MATH[method],
        )
        for h, t in enumerate(budgets)
    ]
    _assert_heads_equal(batched, _stack(looped))


def _stack(parts: list[CompactedHeads]) -> CompactedHeads:
    """Per-head results (one head each) packed head after head."""
    lengths = torch.cat([p.head_budgets for p in parts])
    cu = torch.zeros(len(parts) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    return CompactedHeads(cat("keys"), cat("beta"), cat("values"), cat("indices"), cu)


BUDGET_SHAPES = {
    "int": 12,
    "one": 1,
    "list": [3, 0, T, 20],
    "tensor": torch.tensor([T - 1, 1, 7, 0]),
    "zeros": 0,
}


@pytest.mark.parametrize(
    "budget", list(BUDGET_SHAPES.values()), ids=list(BUDGET_SHAPES)
)
@pytest.mark.parametrize("method", DISTINCT)
def test_every_preset_runs_on_every_budget_shape(method, budget):
    keys, values, queries = _inputs(2)
    positions = torch.arange(T) + 100
    heads = compact_heads(
        keys.bfloat16(),
        values.bfloat16(),
        queries,
        budget,
        method=MATH[method],
        positions=positions,
    )
    want = (
        torch.as_tensor(budget).expand(H)
        if torch.as_tensor(budget).dim() == 0
        else torch.as_tensor(budget)
    )
    assert heads.head_budgets.tolist() == want.tolist()
    assert (
        heads.keys.dtype == torch.bfloat16
        and heads.values.dtype == torch.bfloat16
        and heads.beta.dtype == torch.float32
    )
    assert (
        torch.isfinite(heads.beta).all() and torch.isfinite(heads.values.float()).all()
    )
    for h in range(H):
        k, _, _, idx = heads.head(h)
        assert (idx[1:] > idx[:-1]).all(), "slots sorted by position, no duplicates"
        assert ((idx >= 100) & (idx < 100 + T)).all()
        assert torch.equal(k, keys.bfloat16()[h, idx - 100]), (
            "kept keys are original keys"
        )


def test_options_override_preset_fields():
    keys, values, queries = _inputs(3)
    a = compact_heads(
        keys,
        values,
        queries,
        9,
        method=MATH["am-highest-attn"],
        beta="zero",
        values="direct",
    )
    b = compact_heads(keys, values, queries, 9, method=MATH["h2o+"], aggregation="rms")
    _assert_heads_equal(a, b)
    c = compact_heads(
        keys,
        values,
        queries,
        9,
        method=MATH["am-omp-fast"],
        keys_per_step=1,
        refit_interval=1,
    )
    _assert_heads_equal(
        c, compact_heads(keys, values, queries, 9, method=MATH["am-omp"])
    )


def test_beta_bounds_box_the_fitted_beta_and_parse_from_text():
    """``beta_bounds="lo:hi"`` (a command-line override) is the pair ``(lo, hi)``, and the NNLS
    beta stays inside it: a tight upper bound clips it, a wide one lets it grow."""
    keys, values, queries = _inputs(9)
    am = MATH["am-highest-attn"]
    wide = compact_heads(keys, values, queries, 3, method=am, beta_bounds="-3:8")
    _assert_heads_equal(
        wide, compact_heads(keys, values, queries, 3, method=am, beta_bounds=(-3, 8))
    )
    tight = compact_heads(keys, values, queries, 3, method=am, beta_bounds="-1:0.5")
    assert tight.beta.min() >= -1 - 1e-6 and tight.beta.max() <= 0.5 + 1e-6
    # 3 slots of 48 keys carry the others' mass: beta > 0.5
    assert wide.beta.max() > 0.5


def test_priority_beta_floor_bounds_only_the_kept_priority_keys():
    """``priority_beta_floor`` lifts the lower bound of the kept priority keys' ``beta`` and
    of no other slot; at the box's ``lo`` it is the plain fit."""
    keys, values, queries = _inputs(10)
    am = MATH["am-highest-attn"]
    priority = torch.zeros(T, dtype=torch.bool)
    priority[T // 2 :] = True  # half the keys, so every head keeps some of each kind
    kw = dict(method=am, priority=priority, beta_bounds=(-3, 3))
    plain = compact_heads(keys, values, queries, 12, **kw)
    floored = compact_heads(keys, values, queries, 12, priority_beta_floor=0.0, **kw)
    _assert_heads_equal(
        plain, compact_heads(keys, values, queries, 12, priority_beta_floor=-3, **kw)
    )
    assert torch.equal(floored.indices, plain.indices)  # the selection is the same
    kept_priority = priority[plain.indices]
    assert kept_priority.any() and (~kept_priority).any()
    # the plain fit mutes some kept priority keys; the floor keeps them at their own weight
    assert plain.beta[kept_priority].min() < -0.5
    assert floored.beta[kept_priority].min() >= -1e-6
    assert floored.beta[~kept_priority].min() < 0  # the others keep the whole box
    # span ids (whole identifiers) name the same keys as the mask
    spans = torch.where(priority, torch.arange(T) // 4, -1)
    by_span = compact_heads(
        keys, values, queries, 12, priority_beta_floor=0.0, **(kw | {"priority": spans})
    )
    assert by_span.beta[priority[by_span.indices]].min() >= -1e-6
    # floor_keys: only those priority keys are raised; the selection is the same, and every
    # priority key as floor_keys is the default
    _assert_heads_equal(
        floored,
        compact_heads(
            keys,
            values,
            queries,
            12,
            priority_beta_floor=0.0,
            floor_keys=priority,
            **kw,
        ),
    )
    some = priority & (torch.arange(T) % 2 == 0)
    part = compact_heads(
        keys, values, queries, 12, priority_beta_floor=0.0, floor_keys=some, **kw
    )
    assert torch.equal(part.indices, plain.indices)
    assert part.beta[some[part.indices]].min() >= -1e-6
    assert part.beta[(priority & ~some)[part.indices]].min() < -0.5
    with pytest.raises(ValueError, match=r"floor_keys must be a \[T\]"):
        compact_heads(keys, values, queries, 12, floor_keys=some.long(), **kw)


def test_value_anchor_interpolates_between_lstsq_and_direct_values():
    """``value_anchor=lam`` solves ``min ||X C - Y||^2 + lam g ||C - V||^2`` (its gradient is 0);
    0 is plain least squares, a huge ``lam`` gives the original values."""
    from vllm_compaction.am.attention import attention_output_and_mass

    keys, values, queries = _inputs(8)
    am = MATH["am-highest-attn"]
    lstsq = compact_heads(keys, values, queries, 9, method=am)
    _assert_heads_equal(
        compact_heads(keys, values, queries, 9, method=am, value_anchor=0.0), lstsq
    )
    direct = compact_heads(keys, values, queries, 9, method=am, values="direct")
    huge = compact_heads(keys, values, queries, 9, method=am, value_anchor=1e9)
    torch.testing.assert_close(huge.values, direct.values, rtol=1e-4, atol=1e-4)
    lam = 0.5
    anchored = compact_heads(keys, values, queries, 9, method=am, value_anchor=lam)
    assert torch.equal(anchored.indices, lstsq.indices) and torch.equal(
        anchored.beta, lstsq.beta
    )
    scale = D**-0.5
    for h in range(H):
        k, beta, c, idx = anchored.head(h)
        x = torch.softmax((queries[h] @ k.T * scale + beta).double(), -1)  # [n, t]
        y = attention_output_and_mass(
            queries[h : h + 1], keys[h : h + 1], values[h : h + 1], scale=scale
        )[0][0]
        g = (x.T @ x).diagonal().mean()
        grad = x.T @ (x @ c.double() - y.double()) + lam * g * (
            c.double() - values[h, idx].double()
        )
        assert grad.abs().max() < 1e-4 * (x.T @ y.double()).abs().max()
        # between the two: closer to the original values than lstsq, better fit than direct
        assert (c - values[h, idx]).norm() < (lstsq.head(h)[2] - values[h, idx]).norm()


def _half_priority(seed: int, priority_values: str) -> tuple:
    """Random heads with the second half of the keys as priority keys (every head keeps some
    of each kind): the inputs, the mask, the plain fit and the fit with ``priority_values``."""
    keys, values, queries = _inputs(seed)
    priority = torch.zeros(T, dtype=torch.bool)
    priority[T // 2 :] = True
    kw = dict(method=MATH["am-highest-attn"], priority=priority)
    plain = compact_heads(keys, values, queries, 12, **kw)
    fitted = compact_heads(
        keys, values, queries, 12, priority_values=priority_values, **kw
    )
    return keys, values, queries, priority, plain, fitted


def test_priority_values_direct_pins_the_kept_priority_values_and_fits_the_rest():
    """``priority_values="direct"``: the kept priority keys keep their original values
    exactly; the other slots are the least-squares fit around them (the gradient of
    ``||X C - Y||^2`` in the free slots' values is 0); selection and beta are unchanged. Without
    priority keys it is the plain fit."""
    from vllm_compaction.am.attention import attention_output_and_mass

    keys, values, queries, priority, plain, pinned = _half_priority(11, "direct")
    am = MATH["am-highest-attn"]
    assert torch.equal(pinned.indices, plain.indices)
    assert torch.equal(pinned.beta, plain.beta)
    _assert_heads_equal(
        compact_heads(keys, values, queries, 12, method=am),
        compact_heads(keys, values, queries, 12, method=am, priority_values="direct"),
    )
    scale = D**-0.5
    for h in range(H):
        k, beta, c, idx = pinned.head(h)
        kept = priority[idx]
        assert kept.any() and (~kept).any()
        assert torch.equal(c[kept], values[h, idx[kept]])
        # the plain fit moves them: pinning is not a no-op
        assert not torch.allclose(plain.head(h)[2][kept], values[h, idx[kept]])
        x = torch.softmax((queries[h] @ k.T * scale + beta).double(), -1)  # [n, t]
        y = attention_output_and_mass(
            queries[h : h + 1], keys[h : h + 1], values[h : h + 1], scale=scale
        )[0][0]
        grad = x.T @ (x @ c.double() - y.double())  # [t, d]
        assert grad[~kept].abs().max() < 1e-4 * (x.T @ y.double()).abs().max()


def test_priority_values_exact_keeps_the_kept_priority_keys_as_they_were():
    """``priority_values="exact"``: a kept priority key is the token as it was (``beta = 0``,
    its own value) in the slot the selection gave it; the other slots' biases are fitted in
    the box around them."""
    _, values, _, priority, plain, exact = _half_priority(12, "exact")
    assert torch.equal(exact.indices, plain.indices)
    kept = priority[exact.indices]
    assert kept.any() and (~kept).any()
    assert torch.equal(exact.beta[kept], torch.zeros(int(kept.sum())))
    assert plain.beta[kept].abs().max() > 0.1  # the plain fit moves them
    for h in range(H):
        _, _, c, idx = exact.head(h)
        assert torch.equal(c[priority[idx]], values[h, idx[priority[idx]]])
    others = exact.beta[~kept]
    assert others.min() >= -3 - 1e-6 and others.max() <= 3 + 1e-6
    assert not torch.equal(others, plain.beta[~kept])  # refitted around the exact slots


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"priority_values": "blend"},
            "priority_values must be one of lstsq, direct, exact",
        ),
        (
            {"priority_values": "exact", "priority_beta_floor": 0},
            "drop priority_beta_floor",
        ),
        (
            {"priority_values": "direct", "values": "direct"},
            "priority_values applies to values='lstsq' only",
        ),
    ],
)
def test_priority_values_is_checked(options, message):
    with pytest.raises(ValueError, match=message):
        resolve_method(MATH["am-highest-attn"], options)


def test_memory_limit_groups_and_chunks_give_the_same_result():
    """Head groups (OMP) and query chunks (fits) change only the fp32 summation order."""
    keys, values, queries = _inputs(4)
    for method in ("am-omp-fast", "am-highest-attn"):
        small = compact_heads(
            keys,
            values,
            queries,
            [5, 9, 0, 30],
            method=MATH[method],
            memory_limit=60_000,
        )
        _assert_heads_equal(
            small,
            compact_heads(keys, values, queries, [5, 9, 0, 30], method=MATH[method]),
            tol=1e-2,
        )


def test_heads_of_very_different_budgets_are_not_padded_together():
    """Global budgets give one head ~T slots and others a few dozen: each fit costs n * t_max^2
    per head of its group, so groups hold heads of similar budgets only (same results)."""
    from vllm_compaction.am.compact import PAD_FACTOR, SMALL_BUDGET, _head_groups

    budgets = torch.tensor([590, 12, 300, 40, 0, 360, 599, 1000])
    groups = _head_groups(
        torch.tensor([0, 1, 2, 3, 5, 6, 7]),
        budgets,
        bytes_per_head=0,
        memory_limit=1 << 30,
    )
    assert sorted(torch.cat(groups).tolist()) == [0, 1, 2, 3, 5, 6, 7]
    for group in groups:
        widths = budgets[group]
        assert widths.max() <= max(SMALL_BUDGET, PAD_FACTOR * widths.min())
    assert [g.tolist() for g in groups] == [[1, 3], [2, 5], [0, 6], [7]]
    capped = _head_groups(
        torch.arange(4), torch.full((4,), 10), bytes_per_head=100, memory_limit=250
    )
    assert [g.tolist() for g in capped] == [[0, 1], [2, 3]]

    keys, values, queries = _inputs(9, h=3, t=640, n=96)
    spread = [630, 20, 300]
    together = compact_heads(
        keys, values, queries, spread, method=MATH["am-highest-attn"]
    )
    alone = [
        compact_heads(
            keys[h : h + 1],
            values[h : h + 1],
            queries[h : h + 1],
            [t],
            method=MATH["am-highest-attn"],
        )
        for h, t in enumerate(spread)
    ]
    _assert_heads_equal(together, _stack(alone))


@pytest.mark.parametrize("method", AM_PRESETS + ["h2o+", "kvzip"])
def test_query_weights_equal_repeating_the_rows(method):
    """Integer ``query_weights`` give what repeating each query that many times gives: the same
    kept keys, beta and values (the scores, the NNLS, OMP and the value fit all weigh rows);
    per-head weights too, and a common factor changes nothing."""
    keys, values, queries = _inputs(8)
    gen = torch.Generator().manual_seed(8)
    weights = torch.randint(1, 5, (H, N), generator=gen)
    budgets = [6, 12, T, 20]
    repeated = [
        compact_heads(
            keys[h : h + 1],
            values[h : h + 1],
            queries[h : h + 1].repeat_interleave(weights[h], 1),
            [t],
            method=MATH[method],
        )
        for h, t in enumerate(budgets)
    ]
    weighted = compact_heads(
        keys,
        values,
        queries,
        budgets,
        method=MATH[method],
        query_weights=weights.float(),
    )
    _assert_heads_equal(weighted, _stack(repeated), tol=2e-3)
    scaled = compact_heads(
        keys, values, queries, budgets, method=MATH[method], query_weights=3.0 * weights
    )
    _assert_heads_equal(weighted, scaled)
    ones = compact_heads(
        keys, values, queries, budgets, method=MATH[method], query_weights=torch.ones(N)
    )
    _assert_heads_equal(
        ones, compact_heads(keys, values, queries, budgets, method=MATH[method])
    )


def test_timings_are_the_stages_within_the_total():
    """Every stage is timed, and the stages lie inside the total (they are its parts)."""
    keys, values, queries = _inputs(5)
    timings: dict[str, float] = {}
    compact_heads(
        keys, values, queries, 10, method=MATH["am-omp-fast"], timings=timings
    )
    assert (
        set(timings)
        == set(STAGES)
        == {"reference_s", "select_s", "beta_s", "values_s", "refine_s", "total_s"}
    )
    assert all(v >= 0 for v in timings.values())
    # OMP and the value fit did work
    assert timings["select_s"] > 0 and timings["values_s"] > 0
    assert sum(v for k, v in timings.items() if k != "total_s") <= timings["total_s"]


BAD_CALLS = {
    "shape mismatch": (dict(values=torch.randn(H, T + 1, D)), "same"),
    "queries dim": (dict(queries=torch.randn(H, N, D + 1)), "queries"),
    "not 3-D": (dict(keys=torch.randn(T, D), values=torch.randn(T, D)), "tensor"),
    "budget > T": (dict(budget=T + 1), r"\[0, T="),
    "negative": (dict(budget=[1, -1, 2, 3]), r"\[0, T="),
    "wrong count": (dict(budget=[1, 2]), "per-head"),
    "float budget": (dict(budget=2.5), "int"),
    "unknown option": (dict(topk=3), "valid options"),
    "bad option value": (dict(aggregation="median"), "aggregation"),
    "bad keys_per_step": (
        dict(method=MATH["am-omp"], keys_per_step=0),
        "keys_per_step",
    ),
    "beta from a selector without": (dict(beta="selector"), "omp"),
    "no queries": (dict(queries=torch.randn(H, 0, D)), "query"),
    "positions": (dict(positions=torch.arange(T - 1)), "positions"),
    "scale": (dict(scale=-1.0), "scale"),
    "unknown selector": (dict(selector="oracle"), "valid selectors"),
    "negative value_anchor": (
        dict(method=MATH["am-highest-attn"], value_anchor=-1.0),
        "value_anchor",
    ),
    "value_anchor without lstsq": (
        dict(method=MATH["h2o+"], value_anchor=1.0),
        "lstsq",
    ),
    "priority_beta_floor outside the box": (
        dict(method=MATH["am-highest-attn"], priority_beta_floor=4.0),
        "priority_beta_floor",
    ),
    "priority_beta_floor without nnls": (
        dict(method=MATH["h2o+"], priority_beta_floor=0.0),
        "nnls",
    ),
    "priority_beta_floor nan": (
        dict(method=MATH["am-highest-attn"], priority_beta_floor=float("nan")),
        "priority_beta_floor",
    ),
    "beta_bounds reversed": (
        dict(method=MATH["am-highest-attn"], beta_bounds="3:-3"),
        "beta_bounds",
    ),
    "beta_bounds not numbers": (
        dict(method=MATH["am-highest-attn"], beta_bounds="low:high"),
        "beta_bounds",
    ),
    "beta_bounds three": (
        dict(method=MATH["am-highest-attn"], beta_bounds=(1, 2, 3)),
        "beta_bounds",
    ),
    "query_weights shape": (dict(query_weights=torch.ones(N + 1)), "query_weights"),
    "query_weights zero": (dict(query_weights=torch.zeros(N)), "positive"),
    "query_weights nan": (
        dict(query_weights=torch.full((H, N), float("nan"))),
        "positive",
    ),
    "query_weights bool": (
        dict(query_weights=torch.ones(N, dtype=torch.bool)),
        "query_weights",
    ),
    "priority not bool": (dict(priority=torch.ones(T)), "priority"),
    "priority shape": (dict(priority=torch.ones(T - 1, dtype=torch.bool)), "priority"),
    "priority with kvmerger": (
        dict(method=MATH["kvmerger"], priority=torch.ones(T, dtype=torch.bool)),
        "cannot keep priority keys",
    ),
}


@pytest.mark.parametrize("change,match", list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_bad_input_raises_value_error(change, match):
    keys, values, queries = _inputs(6)
    call = dict(keys=keys, values=values, queries=queries, budget=8) | change
    with pytest.raises(ValueError, match=match):
        compact_heads(
            call.pop("keys"),
            call.pop("values"),
            call.pop("queries"),
            call.pop("budget"),
            **call,
        )


def test_a_method_is_its_math_not_a_name():
    """Names are recipes, a layer above ``am``: a name is refused with where its math is; a
    resolved method runs as its spec does and takes no further options."""
    keys, values, queries = _inputs(6)
    with pytest.raises(TypeError, match=r"RECIPES\['am-omp'\]\.math"):
        compact_heads(keys, values, queries, 8, method="am-omp")
    resolved = resolve_method(MATH["am-omp-fast"], {"values": "direct"})
    _assert_heads_equal(
        compact_heads(keys, values, queries, 8, method=resolved),
        compact_heads(
            keys, values, queries, 8, method=MATH["am-omp-fast"], values="direct"
        ),
    )
    with pytest.raises(ValueError, match="resolved already"):
        compact_heads(keys, values, queries, 8, method=resolved, values="lstsq")
    with pytest.raises(ValueError, match="unknown option.*for method 'custom'"):
        resolve_method(MethodSpec("omp", {"aggregation": "rms"}), {}, name="custom")


def test_methods_without_queries_accept_none():
    keys, values, _ = _inputs(7)
    heads = compact_heads(
        keys, values, torch.empty(H, 0, D), 6, method=MATH["truncate"]
    )
    assert heads.indices.view(H, 6)[0].tolist() == list(range(T - 6, T))
