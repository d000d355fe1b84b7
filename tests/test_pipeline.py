"""compact_prefix end to end on a tiny random model: structure, exact spans, identities, errors."""

from __future__ import annotations

import functools

import pytest
import torch

from vllm_compaction.budgets import DEFAULT_SCORE_WEIGHT_POWER
from vllm_compaction.pipeline import (
    PreparedPrefix,
    compact_prefix,
    compact_prepared,
    prepare_prefix,
)
from vllm_compaction.queries import QueryCollector, QueryPlan
from vllm_compaction.queries.base import PrefixSpec
from vllm_compaction.reference import ReferenceDecoder

IDS = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(0)).tolist()
MASK = torch.zeros(60, dtype=torch.bool)
MASK[5:55] = True  # 5 exact template tokens before, 5 after


@pytest.mark.parametrize("budgets", ["uniform", "global", "pyramid"])
@pytest.mark.parametrize("on_policy", [False, True])
def test_structure_and_exact_spans(tiny_llama, budgets, on_policy):
    cache = compact_prefix(
        tiny_llama,
        IDS,
        MASK,
        ratio=0.2,
        method="am-highest-attn",
        queries="context-prefill",
        budgets=budgets,
        on_policy=on_policy,
    )
    assert cache.logical_length == 60 and cache.compacted_span == (5, 55)
    lengths = cache.head_lengths
    assert int(lengths.sum()) == 3 * 2 * 10 + round(0.2 * 50 * 6)
    kv = tiny_llama.prefill(IDS, capture_queries=False)
    for layer, heads in enumerate(cache.layers):
        for h in range(heads.num_heads):
            keys, beta, _, idx = heads.head(h)
            exact = ~MASK[idx]
            assert exact.sum() == 10 and not beta[exact].any()
            torch.testing.assert_close(keys[exact], kv.keys[layer][h, idx[exact]])
            assert torch.equal(idx, idx.sort().values)


def test_full_budget_reproduces_full_context_logits(tiny_llama):
    cache = compact_prefix(
        tiny_llama,
        IDS,
        MASK,
        ratio=1.0,
        method="am-highest-attn",
        queries="context-prefill",
        budgets="uniform",
        on_policy=False,
    )
    for heads in cache.layers:
        assert (heads.beta == 0).all()  # every head exact: no bias at all
    decoder = ReferenceDecoder(tiny_llama)
    cont = [7, 8, 9, 10]
    got = decoder.logits(cache, cont)
    with torch.inference_mode():
        want = (
            tiny_llama.model(input_ids=torch.tensor([IDS + cont]))
            .logits[0, 60:]
            .float()
        )
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("on_policy", [False, True])
def test_timings_name_every_stage_and_add_up(tiny_llama, on_policy):
    """Global budgets run the off-policy pass (``queries_s``) for their scores; on-policy runs a
    second, packed pass (``on_policy_queries_s``, its fits excluded); the total is the sum."""
    cache = compact_prefix(
        tiny_llama,
        IDS,
        MASK,
        ratio=0.2,
        method="kvzip",
        queries="context-prefill",
        on_policy=on_policy,
    )
    timings = cache.timings
    want = {"prefill_and_plan_s", "queries_s", "fit_s", "total_s"} | (
        {"on_policy_queries_s"} if on_policy else set()
    )
    assert set(timings) == want
    assert all(v >= 0 for v in timings.values()) and timings["fit_s"] > 0
    assert timings["total_s"] == pytest.approx(
        sum(v for k, v in timings.items() if k != "total_s")
    )
    assert timings["fit_s"] <= timings["total_s"]


def test_prepared_prefix_is_reused_across_ratios(tiny_llama):
    prepared = prepare_prefix(
        tiny_llama, IDS, MASK, queries="context-prefill+random-vectors"
    )
    a = compact_prepared(prepared, ratio=0.1, method="kvzip")
    b = compact_prepared(prepared, ratio=0.3, method="kvzip")
    assert a.physical_slots < b.physical_slots
    assert prepared._off_policy is not None  # computed once, kept


def test_probe_softmax_without_probes_scores_over_the_prefix(tiny_llama):
    """Prefix queries have no probe pass: both score normalisations rank keys identically."""
    prepared = prepare_prefix(tiny_llama, IDS, MASK, queries="context-prefill")
    by_prefix = compact_prepared(
        prepared, ratio=0.2, method="kvzip", score_softmax="prefix"
    )
    by_probe = compact_prepared(
        prepared, ratio=0.2, method="kvzip", score_softmax="probe"
    )
    assert torch.equal(by_prefix.head_lengths, by_probe.head_lengths)
    assert by_probe.options["score_softmax"] == "probe"
    # the probe pass's scores take no weight
    assert by_probe.options["score_aggregation"] == "max"


def _prepared_with_weights(adapter, weights):
    """Prefix queries plus two probes weighted ``weights`` (``None``: unweighted)."""
    spec = PrefixSpec(torch.tensor(IDS), MASK, adapter.prefill(IDS))
    plan = QueryPlan(
        [[1, 2, 3, 4], [5, 6, 7]], [0, 0], prefix_queries=True, weights=weights
    )
    return PreparedPrefix(
        adapter, spec, "context-prefill", QueryCollector(adapter, spec, plan), {}
    )


def _attention_over_prefix(prepared, layer, scale):
    """``[H, n, T]`` float64 softmax of the layer's reference queries over the prefix keys."""
    queries, keys = prepared.off_policy_queries()[layer], prepared.spec.kv.keys[layer]
    return torch.softmax(scale * queries.double() @ keys.double().transpose(1, 2), -1)


def test_weighted_max_ranks_keys_by_each_sources_share_of_the_largest_weight(
    tiny_llama,
):
    """``score_aggregation="weighted-max"`` (the default): a key's global score is its largest
    attention weight with every query's weight scaled by its source's weight over the largest
    (``score_weight_power=1``); without weighted sources it is KVzip's max."""
    prepared_with = functools.partial(_prepared_with_weights, tiny_llama)
    prepared = prepared_with([1, 3])
    scale, layer = tiny_llama.layer_scales()[1], 1
    weights = prepared.collector.weights(layer)
    assert weights is not None and set(weights.tolist()) == {1.0, 3.0}
    a = _attention_over_prefix(prepared, layer, scale)
    want = (a * (weights.double() / 3.0)[None, :, None]).amax(1)
    got = prepared.key_scores(layer, scale, "prefix", "weighted-max", 1.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(
        got, prepared.key_scores(layer, scale, "prefix", "max", None)
    )
    # the default under the prefix softmax: a weighted source counts in the ranking too
    default = compact_prepared(prepared, ratio=0.2, method="kvzip")
    weighted_max = compact_prepared(
        prepared, ratio=0.2, method="kvzip", score_aggregation="weighted-max"
    )
    plain_max = compact_prepared(
        prepared, ratio=0.2, method="kvzip", score_aggregation="max"
    )
    assert default.options["score_aggregation"] == "weighted-max"
    assert torch.equal(default.head_lengths, weighted_max.head_lengths)
    assert plain_max.options["score_aggregation"] == "max"
    assert int(plain_max.head_lengths.sum()) == int(weighted_max.head_lengths.sum())
    assert not torch.equal(plain_max.head_lengths, weighted_max.head_lengths)
    unweighted = prepared_with(None)
    torch.testing.assert_close(
        unweighted.key_scores(
            layer, scale, "prefix", "weighted-max", DEFAULT_SCORE_WEIGHT_POWER
        ),
        unweighted.key_scores(layer, scale, "prefix", "max", None),
    )


def test_score_weight_power_raises_the_ranking_weights(tiny_llama):
    """``score_weight_power=p`` ranks by ``max_i (w_i / max w)^p a_ij``: 1 counts the weights
    as the fits do, 0 is the plain max."""
    prepared = _prepared_with_weights(tiny_llama, [1, 3])
    scale, layer = tiny_llama.layer_scales()[1], 1
    weights = prepared.collector.weights(layer).double()
    a = _attention_over_prefix(prepared, layer, scale)
    for power in (0.0, 0.5, 2.0):
        want = (a * ((weights / 3.0) ** power)[None, :, None]).amax(1)
        got = prepared.key_scores(layer, scale, "prefix", "weighted-max", power)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(
        prepared.key_scores(layer, scale, "prefix", "weighted-max", 0.0),
        prepared.key_scores(layer, scale, "prefix", "max", None),
    )
    default = compact_prepared(prepared, ratio=0.2, method="kvzip")
    assert default.options["score_weight_power"] == DEFAULT_SCORE_WEIGHT_POWER
    squared = compact_prepared(
        prepared, ratio=0.2, method="kvzip", score_weight_power=2
    )
    assert squared.options["score_weight_power"] == 2.0
    # power 0 reaches the budgets as the plain max; a power of 2 ranks otherwise at the same total
    flat = compact_prepared(prepared, ratio=0.2, method="kvzip", score_weight_power=0)
    plain_max = compact_prepared(
        prepared, ratio=0.2, method="kvzip", score_aggregation="max"
    )
    assert plain_max.options["score_weight_power"] is None  # no weight to raise
    assert torch.equal(flat.head_lengths, plain_max.head_lengths)
    assert int(squared.head_lengths.sum()) == int(flat.head_lengths.sum())
    assert not torch.equal(squared.head_lengths, flat.head_lengths)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ratio=0.0), "ratio"),
        (dict(ratio=1.5), "ratio"),
        (dict(ratio=0.1, target_tokens=5), "exactly one"),
        (dict(ratio=0.1, method="nope"), "unknown method"),
        (dict(ratio=0.1, queries="nope"), "unknown query source"),
        (dict(ratio=0.1, budgets="nope"), "unknown budgets"),
        (dict(ratio=0.1, score_softmax="nope"), "score_softmax"),
        (dict(ratio=0.1, score_aggregation="mean"), "score_aggregation"),
        (dict(ratio=0.1, score_aggregation=""), "score_aggregation"),
        (
            dict(ratio=0.1, score_aggregation="weighted-max", score_softmax="probe"),
            "needs score_softmax='prefix'",
        ),
        (dict(ratio=0.1, score_weight_power=-1), "score_weight_power must be"),
        (
            dict(ratio=0.1, score_weight_power=float("nan")),
            "score_weight_power must be",
        ),
        (dict(ratio=0.1, score_weight_power="2"), "score_weight_power must be"),
        (dict(ratio=0.1, score_weight_power=True), "score_weight_power must be"),
        (
            dict(ratio=0.1, score_aggregation="max", score_weight_power=2),
            "needs score_aggregation='weighted-max'",
        ),
    ],
)
def test_bad_arguments_are_refused(tiny_llama, kwargs, match):
    kwargs.setdefault("queries", "context-prefill")
    with pytest.raises(ValueError, match=match):
        compact_prefix(tiny_llama, IDS, MASK, **kwargs)


def test_empty_mask_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="no content"):
        compact_prefix(
            tiny_llama,
            IDS,
            torch.zeros(60, dtype=torch.bool),
            ratio=0.1,
            queries="context-prefill",
        )


def test_content_chunks():
    from vllm_compaction.pipeline import content_chunks

    # 50 content tokens: 22 + 28 (a last 6 joins the one before)
    chunks = content_chunks(MASK, 22)
    assert [int(c.sum()) for c in chunks] == [22, 28]
    assert torch.equal(sum(c.int() for c in chunks).bool(), MASK)
    assert torch.nonzero(chunks[0]).max() < torch.nonzero(chunks[1]).min()
    assert [int(c.sum()) for c in content_chunks(MASK, 10)] == [10] * 5
    assert len(content_chunks(MASK, None)) == 1
    with pytest.raises(ValueError, match="chunk_tokens"):
        content_chunks(MASK, 0)


@pytest.mark.parametrize("budgets", ["uniform", "global"])
def test_chunked_compaction_budgets_every_chunk(tiny_llama, budgets):
    cache = compact_prefix(
        tiny_llama,
        IDS,
        MASK,
        ratio=0.2,
        method="am-highest-attn",
        queries="context-prefill",
        budgets=budgets,
        chunk_tokens=25,
    )
    assert cache.options["chunk_tokens"] == 25
    # content positions 5..29 are the first chunk, 30..54 the second: each keeps 20% of its own
    # tokens (per layer with uniform budgets, over all layers with global ones)
    per_layer = []
    for heads in cache.layers:
        content = heads.indices[MASK[heads.indices]]
        per_layer.append((int((content < 30).sum()), int((content >= 30).sum())))
    first, second = (sum(c) for c in zip(*per_layer))
    assert first == second == round(0.2 * 25 * 2) * len(per_layer)
    if budgets == "uniform":
        assert set(per_layer) == {(10, 10)}
