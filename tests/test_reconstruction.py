"""Reconstruction metrics: exact identities on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.eval.instance import TaskInstance
from vllm_compaction.eval.reconstruction import (
    answer_logits,
    answer_margin,
    reconstruction,
)
from vllm_compaction.pipeline import compact_prefix
from vllm_compaction.reference import ReferenceDecoder, prefix_layers

IDS = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(1)).tolist()
MASK = torch.zeros(60, dtype=torch.bool)
MASK[5:55] = True


def test_full_budget_reconstructs_exactly_and_a_small_one_does_not(tiny_llama):
    decoder = ReferenceDecoder(tiny_llama)
    full = tiny_llama.prefill(IDS, capture_queries=False)
    cont, answer = [3, 4, 5], [9, 10, 11, 12]
    same = reconstruction(decoder, full, full, cont, answer)
    assert (
        same.kl == pytest.approx(0.0, abs=1e-9)
        and same.log_ppl_full == same.log_ppl_compacted > 0
    )
    exact = compact_prefix(
        tiny_llama,
        IDS,
        MASK,
        ratio=1.0,
        method="am-highest-attn",
        queries="context-prefill",
        budgets="uniform",
        on_policy=False,
    )
    assert reconstruction(decoder, full, exact, cont, answer).kl < 1e-5
    small = compact_prefix(
        tiny_llama, IDS, MASK, ratio=0.1, method="truncate", queries="context-prefill"
    )
    lossy = reconstruction(decoder, full, small, cont, answer)
    assert lossy.kl > 1e-4 and lossy.answer_tokens == 4
    with pytest.raises(ValueError, match="empty"):
        reconstruction(decoder, full, full, cont, [])


def test_margins_tell_where_greedy_decoding_gives_the_full_answer(tiny_llama):
    """The full cache's margin on its own greedy answer is positive; a compacted cache's margin
    on that answer is positive over a span exactly where its own greedy answer starts with
    the same tokens."""
    decoder = ReferenceDecoder(tiny_llama)
    full = tiny_llama.prefill(IDS, capture_queries=False)
    cont = [3, 4, 5]

    def greedy(source):
        # the tiny model has no tokenizer (so no stop token): 8 tokens, teacher-free
        layers, length = (
            (source.exact_prefix(), source.length)
            if source is full
            else (prefix_layers(source), source.logical_length)
        )
        return tiny_llama.generate(layers, length, cont, max_new_tokens=8, stop_ids=[])[
            0
        ]

    answer = greedy(full)
    full_logits = answer_logits(decoder, full, cont, answer)
    agreed = []
    # truncated to 30% this prefix gives the answer's first 3 tokens of 8 (measured), so
    # the margin is seen changing sign along one answer
    for ratio in (0.1, 0.3):
        small = compact_prefix(
            tiny_llama,
            IDS,
            MASK,
            ratio=ratio,
            method="truncate",
            queries="context-prefill",
        )
        own = greedy(small)
        small_logits = answer_logits(decoder, small, cont, answer)
        for span in range(1, len(answer) + 1):
            assert answer_margin(full_logits, answer, span) > 0
            margin = answer_margin(small_logits, answer, span)
            assert (margin > 0) == (own[:span] == answer[:span])
            agreed.append(margin > 0)
    assert 0 < sum(agreed) < len(agreed)
    same = reconstruction(decoder, full, full, cont, answer, margin_tokens=len(answer))
    assert same.margin_full == same.margin_compacted > 0
    assert reconstruction(decoder, full, full, cont, answer).margin_full is None
    with pytest.raises(ValueError, match="continuation is empty"):
        answer_logits(decoder, full, [], answer)
    for bad in (0, len(answer) + 1):
        with pytest.raises(ValueError, match="span"):
            answer_margin(full_logits, answer, bad)


def _asking(*answers: str, **about) -> TaskInstance:
    """An instance expecting ``answers`` (its text does not matter to the span)."""
    return TaskInstance(
        task="t",
        seed=0,
        context="",
        question="",
        answer_prefix="",
        answers=answers,
        **about,
    )


def test_answer_span_ends_where_the_answer_is_given_for_good():
    pieces = [" The", " code", " is", " 485", "538", ".", " Or", " 4"]
    decode = "".join  # tokens are their own text here
    assert _asking("485538", exact=True).answer_span(decode, pieces) == 5
    # "48" is a whole word after " 48" and not after "5" comes: the span ends at the last "48"
    short = _asking("48")
    assert short.answer_span(decode, [" 48", "5", " or", " 48"]) == 4
    assert short.answer_span(decode, [" 48", "5"]) is None
    assert short.answer_span(decode, []) is None
    # a distractor named after the answer makes the answer wrong
    keyed = _asking("48", distractors=("49",))
    assert keyed.answer_span(decode, [" 48", " or", " 49"]) is None
    assert _asking().answer_span(decode, [" 48"]) is None
