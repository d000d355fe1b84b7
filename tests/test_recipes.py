"""One way to name a configuration: ``name:key=value,...``, the same string everywhere."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.am import attention_output_error, compact_heads
from vllm_compaction.recipes import (
    DEFAULT_METHOD,
    RECIPES,
    check_method,
    parse_method,
    resolve,
    resolve_recipe,
)

LONG_FORM = (
    "am-highest-attn-fast:queries=repeat-prefill+surprise-number-quote/auto*4"
    "+surprise-name-quote/auto,"
    "min_layer_share=0.3,protect=identifiers,protect_by=selection"
)


def test_specs_parse_into_a_name_and_typed_overrides():
    assert parse_method("kvzip") == ("kvzip", {})
    name, overrides = parse_method(
        "am-omp-fast: seed_share=0.25, max_rounds=8, on_policy=false, values=direct"
    )
    assert name == "am-omp-fast"
    assert overrides == {
        "seed_share": 0.25,
        "max_rounds": 8,
        "on_policy": False,
        "values": "direct",
    }
    recipe, options = resolve_recipe(
        "am-omp-fast:on_policy=false,budgets=uniform,values=direct"
    )
    assert (recipe.on_policy, recipe.budgets, options) == (
        False,
        "uniform",
        {"values": "direct"},
    )


@pytest.mark.parametrize(
    "spec,match",
    [
        ("nope", "unknown method 'nope'"),
        ("", "a method is a name"),
        ("am:min_layer_share", "write key=value"),
        ("am:seed=1,seed=2", "given twice"),
        ("am:no_such_option=1", "unknown option"),
        ("h2o+:min_layer_share=0.3", "global budgets only"),
        ("am:queries=nonsense", "unknown query source"),
        ("kvzip:score_softmax=nope", "score_softmax must be"),
        (
            "kvzip:score_aggregation=max,score_weight_power=2",
            "needs score_aggregation='weighted-max'",
        ),
        ("snapkv:beta=selector", "needs a selector that fits weights"),
    ],
)
def test_bad_specs_are_refused_with_a_sentence(spec, match):
    with pytest.raises(ValueError, match=match):
        check_method(spec)


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_resolves_and_runs(name):
    """Every recipe's parts are checked together (its query source, budgets and math options)
    and its math compacts random heads to their budgets, exactly where the budget is T."""
    resolved = resolve(name)
    assert resolved.recipe == RECIPES[name] and resolved.method.name == name
    gen = torch.Generator().manual_seed(0)
    keys, values = (
        torch.randn(3, 40, 8, generator=gen),
        torch.randn(3, 40, 8, generator=gen),
    )
    queries = 1.5 * keys[:, torch.randint(0, 40, (60,), generator=gen)] + torch.randn(
        3, 60, 8, generator=gen
    )
    heads = compact_heads(keys, values, queries, [8, 0, 40], method=resolved.method)
    assert heads.head_budgets.tolist() == [8, 0, 40]
    exact = attention_output_error(heads, keys, values, queries).output_rel[2]
    assert exact < 1e-5


def test_no_two_recipes_are_the_same_and_shared_math_is_one_object():
    """A name earns its place by differing end to end (math, queries, budgets, on-policy,
    options); names that share math share the object, so the difference is visible."""
    ends = [
        (r.math, r.queries, r.budgets, r.on_policy, dict(r.options))
        for r in RECIPES.values()
    ]
    assert all(a != b for i, a in enumerate(ends) for b in ends[i + 1 :])
    for i, (a, ra) in enumerate(RECIPES.items()):
        for b, rb in list(RECIPES.items())[i + 1 :]:
            assert (ra.math == rb.math) == (ra.math is rb.math), (a, b)
    assert (
        RECIPES["am-highest-attn"].math
        is RECIPES["am-highest-attn-fast"].math
        is RECIPES["am"].math
    )
    assert RECIPES["snapkv"].math is RECIPES["pyramidkv"].math


def test_the_default_is_the_recommended_configuration():
    assert DEFAULT_METHOD == "am"
    short, long = resolve_recipe("am"), resolve_recipe(LONG_FORM)
    assert short == long
    # the layer floor belongs to global budgets; the protection does not
    assert resolve_recipe("am", budgets="uniform")[1] == {
        "protect": "identifiers",
        "protect_by": "selection",
    }
    plain = resolve("am:protect=none")
    assert (plain.protect, plain.protect_by) == ("none", "selection")
    assert (
        resolve_recipe("am:queries=repeat-prefill", queries="context-prefill")[
            0
        ].queries
        == "context-prefill"
    )


def test_compact_takes_the_spec_and_the_default_is_the_long_form():
    from benchmarks.synthetic_model import TINY, synthetic_llama, synthetic_messages
    from vllm_compaction.pipeline import compact

    adapter, messages = (
        synthetic_llama(TINY, layers=2, seed=1),
        synthetic_messages(200, seed=1),
    )
    by_default = compact(adapter, messages, ratio=0.2)
    by_name = compact(adapter, messages, ratio=0.2, method="am")
    by_spec = compact(adapter, messages, ratio=0.2, method=LONG_FORM)
    for other in (by_name, by_spec):
        for a, b in zip(by_default.layers, other.layers):
            assert torch.equal(a.indices, b.indices) and torch.equal(a.beta, b.beta)
    assert by_spec.method == LONG_FORM and by_default.options["min_layer_share"] == 0.3
    assert by_default.options["protect"] == "identifiers"
    assert by_default.options["protect_by"] == "selection"


def test_every_entry_point_takes_the_same_string(tmp_path):
    from vllm_compaction.cli import main
    from vllm_compaction.eval.variants import parse_variants
    from vllm_compaction.service.config import ServiceConfig
    from vllm_compaction.service.protocol import CompactRequest

    request = CompactRequest.model_validate(
        {"model": "m", "prompt": "x", "ratio": 0.1, "method": LONG_FORM}
    )
    assert request.method == LONG_FORM
    assert ServiceConfig(auto_compact_method=LONG_FORM).auto_compact_method == LONG_FORM
    [variant] = parse_variants(LONG_FORM, known=RECIPES)
    assert variant.method == "am-highest-attn-fast" and variant.options == {
        "min_layer_share": 0.3,
        "protect": "identifiers",
        "protect_by": "selection",
    }
    with pytest.raises(ValueError, match="unknown option"):
        CompactRequest.model_validate(
            {"model": "m", "prompt": "x", "ratio": 0.1, "method": "am:typo=1"}
        )
    text = tmp_path / "in.txt"
    text.write_text("words")
    assert (
        main(
            [
                "compact",
                "--input",
                str(text),
                "--ratio",
                "0.5",
                "--method",
                "am:typo=1",
                "--out",
                str(tmp_path / "o.safetensors"),
                "--quiet",
            ]
        )
        == 2
    )
