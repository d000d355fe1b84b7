"""Protected spans: identifier tokens skip the fit and stay exact in every head, at the budget's
expense, so the prefix keeps its size."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.budgets.protect import (
    MAX_PROTECTED_SHARE,
    identifier_spans,
    protected_tokens,
)
from vllm_compaction.pipeline import compact
from vllm_compaction.recipes import resolve

IDENTIFIERS = ("524533559245", "AB1C-D2EF-GH3I", "531-354-7468", "a3f9c2e1b7d4")


def _spelled(pieces: list[str], spans: list[list[int]]) -> list[str]:
    return ["".join(pieces[i] for i in span).strip() for span in spans]


def test_identifier_spans_are_words_with_digits_of_six_characters_or_more():
    pieces = ["In", " 2", "0", "0", "5", " I", " moved", " to", " Krak", "ow", "; "]
    pieces += [
        "my",
        " key",
        " is",
        " AB",
        "1",
        "C",
        "-",
        "D",
        "2",
        "EF",
        "-",
        "GH",
        "3",
        "I",
        ".",
    ]
    pieces += [
        " Call",
        " 5",
        "3",
        "1",
        "-",
        "3",
        "5",
        "4",
        "-",
        "7",
        "4",
        "6",
        "8",
        " or",
        " mp",
        "3",
    ]
    assert _spelled(pieces, identifier_spans(pieces)) == [
        "AB1C-D2EF-GH3I",
        "531-354-7468",
    ]


def test_the_tokens_of_each_identifier_are_protected_and_nothing_else(smollm2):
    text = " ".join(
        f"Note {i}: the value is {value}, written in 2005 by a friend in Krakow."
        for i, value in enumerate(IDENTIFIERS)
    )
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    content = torch.ones(len(ids), dtype=torch.bool)
    mask = protected_tokens(
        ids, smollm2.tokenizer, "identifiers", content, slots=len(ids)
    )
    runs, run = [], []
    for i, keep in enumerate(mask.tolist()):
        if keep:
            run.append(ids[i])
        elif run:
            runs.append(smollm2.tokenizer.decode(run).strip())
            run = []
    assert runs == list(IDENTIFIERS)
    # template tokens are never protected; "none" protects nothing
    content[: len(ids) // 2] = False
    half = protected_tokens(ids, smollm2.tokenizer, "identifiers", content, len(ids))
    assert not half[: len(ids) // 2].any() and half.sum() < mask.sum()
    assert not protected_tokens(ids, smollm2.tokenizer, "none", content, len(ids)).any()
    # at most MAX_PROTECTED_SHARE of the slots, the longest identifiers first
    few = protected_tokens(
        ids, smollm2.tokenizer, "identifiers", torch.ones_like(content), 30
    )
    assert 0 < few.sum() <= MAX_PROTECTED_SHARE * 30


def test_unknown_rules_are_refused():
    with pytest.raises(ValueError, match="protect must be one of none, identifiers"):
        resolve("am:protect=digits")
    assert resolve("am:protect=identifiers").protect == "identifiers"
    assert resolve("am").protect == "none"


def test_protected_tokens_stay_exact_in_every_head_and_the_prefix_keeps_its_size(
    smollm2,
):
    messages = [
        {
            "role": "user",
            "content": "I keep notes on my accounts here. " * 6
            + "For the record, my account number is 524533559245. "
            + "The rest of this message is about the weather and the garden. " * 6,
        }
    ]
    common = dict(ratio=0.2, queries="context-prefill", on_policy=False)
    plain = compact(smollm2, messages, method="am-highest-attn", **common)
    kept = compact(
        smollm2, messages, method="am-highest-attn:protect=identifiers", **common
    )
    protected = kept.options["protected_tokens"]
    assert protected >= 6 and plain.options["protected_tokens"] == 0
    # the protected slots come out of the budget: the same size, up to rounding per head
    heads = sum(layer.num_heads for layer in kept.layers)
    assert abs(kept.physical_slots - plain.physical_slots) <= heads
    ids = kept.token_ids
    number = smollm2.tokenizer("524533559245", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(ids)) if ids[i : i + len(number)] == number)
    positions = torch.arange(start, start + len(number))
    kv = smollm2.prefill(ids, capture_queries=False)
    for layer, compacted in enumerate(kept.layers):
        for h in range(compacted.num_heads):
            keys, beta, _, idx = compacted.head(h)
            at = torch.isin(idx, positions)
            assert int(at.sum()) == len(number), (layer, h)
            assert not beta[at].any()
            torch.testing.assert_close(keys[at], kv.keys[layer][h, idx[at]])
