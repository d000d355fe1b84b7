"""Method variants on the command line of the benchmarks."""

from __future__ import annotations

import pytest

from vllm_compaction.eval.variants import parse_variant, parse_variants

RECIPES = ("am-highest-attn-fast", "am-omp-fast", "kvzip", "h2o+")


def test_overrides_go_to_the_pipeline_or_the_method():
    variant = parse_variant(
        "am-highest-attn-fast:queries=repeat-prefill+surprise-quote,values=direct,max_rounds=8,"
        "on_policy=false,value_anchor=0.5"
    )
    assert variant.method == "am-highest-attn-fast"
    assert variant.pipeline == {
        "queries": "repeat-prefill+surprise-quote",
        "on_policy": False,
    }
    assert variant.options == {"values": "direct", "max_rounds": 8, "value_anchor": 0.5}
    assert variant.kwargs()["method"] == "am-highest-attn-fast"
    with pytest.raises(ValueError, match="key=value"):
        parse_variant("kvzip:direct")


@pytest.mark.parametrize(
    "spec",
    [
        "am-omp-fast:seed_share=0.25,max_rounds=8,kvzip",
        "am-omp-fast:seed_share=0.25,max_rounds=8;kvzip",
        " am-omp-fast:seed_share=0.25,max_rounds=8 ; kvzip ;",
    ],
)
def test_commas_separate_methods_but_not_their_overrides(spec):
    variants = parse_variants(spec, known=RECIPES)
    assert [v.label for v in variants] == [
        "am-omp-fast:seed_share=0.25,max_rounds=8",
        "kvzip",
    ]
    assert variants[0].options == {"seed_share": 0.25, "max_rounds": 8}


def test_a_single_variant_with_several_overrides_stays_one():
    # the case that once crashed a sweep after its first instance
    (variant,) = parse_variants(
        "am-highest-attn-fast:queries=repeat-prefill+surprise-quote,min_head_slots=4"
    )
    assert variant.pipeline == {
        "queries": "repeat-prefill+surprise-quote"
    } and variant.options == {"min_head_slots": 4}


def test_unknown_methods_and_empty_lists_are_refused_before_any_work():
    with pytest.raises(ValueError, match="unknown method 'kvzipp'.*choose from"):
        parse_variants("am-omp-fast,kvzipp", known=RECIPES)
    with pytest.raises(ValueError, match="no method"):
        parse_variants(" ; ")
