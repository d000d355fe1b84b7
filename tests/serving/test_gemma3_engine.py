"""Gemma-3-270M through the real engine: a hybrid model whose 15 sliding-window layers keep their
last keys exact and whose 3 global layers are compacted, served from one KV cache group (vLLM
runs hybrid models with its hybrid KV cache manager off on the CPU and with this connector).
Continuations longer than the window check that the window leaves the prefix behind."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.corpus import haystack_text
from vllm_compaction.pipeline import compact_prefix
from vllm_compaction.reference import ReferenceDecoder
from vllm_compaction.vllm import CompactedRef, compacted_prompt

from serving.engines import exact_cache, start_llm, stop_llm
from serving.test_engine import _first_logprob_gap, greedy, worst_logprob_gap

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_llm(store_dir):
    engine = start_llm("float32", store=store_dir, model="gemma3-270m")
    yield engine
    stop_llm(engine)


@pytest.fixture(scope="module")
def essay_ids(gemma3) -> list[int]:
    # longer than the 512-token window, so sliding layers hold only the prefix's end
    return gemma3.tokenizer(haystack_text(900, gemma3.tokenizer, seed=5))["input_ids"]


@pytest.fixture(scope="module")
def compacted(gemma3, essay_ids):
    mask = torch.ones(len(essay_ids), dtype=torch.bool)
    mask[0] = False  # BOS stays exact
    return compact_prefix(
        gemma3,
        essay_ids,
        mask,
        ratio=0.1,
        method="am-highest-attn",
        queries="context-prefill",
        budgets="uniform",
        on_policy=False,
    )


def test_identity_cache_equals_the_plain_prompt(
    gemma_llm, gemma3, essay_ids, store_dir
):
    """t = T in every layer (varlen and, bias-free, padded) serves what the full prompt does,
    batched with a plain request that stays as it is alone."""
    continuation = gemma3.encode(" In summary, the essay")
    cache = exact_cache(gemma3, essay_ids)
    plain_prompt = {"prompt_token_ids": essay_ids + continuation, "cache_salt": "plain"}
    other = {"prompt_token_ids": essay_ids[:200], "cache_salt": "other"}
    alone = gemma_llm.generate([other], greedy(24, logprobs=5))[0].outputs[0]
    outputs = gemma_llm.generate(
        [
            compacted_prompt(cache, continuation, llm=gemma_llm, store=store_dir),
            compacted_prompt(
                cache, continuation, llm=gemma_llm, store=store_dir, layout="padded"
            ),
            plain_prompt,
            other,
        ],
        greedy(40, logprobs=5),
    )
    varlen, padded, plain, beside = (o.outputs[0] for o in outputs)
    assert (
        CompactedRef.parse(
            compacted_prompt(cache, continuation, llm=gemma_llm, store=store_dir)[
                "cache_salt"
            ]
        ).layout
        == "varlen"
    )
    assert len(plain.token_ids) >= 16
    for served in (varlen, padded):
        assert served.token_ids == plain.token_ids
        # measured 7.7e-5 (the prefix attended in torch, the rest by the stock kernel)
        assert worst_logprob_gap(served, plain) < 2e-4
    assert beside.token_ids[:24] == alone.token_ids


def _agrees_with_the_reference_decoder(llm, adapter, cache, continuation, steps, store):
    reference = ReferenceDecoder(adapter).generate(
        cache, continuation, max_new_tokens=steps
    )
    served = llm.generate(
        [compacted_prompt(cache, continuation, llm=llm, store=store)],
        greedy(steps, logprobs=5),
    )[0].outputs[0]
    assert served.token_ids == reference.token_ids
    assert _first_logprob_gap(served, reference.first_logits) < 1e-3


def test_compacted_cache_agrees_with_the_reference_decoder(
    gemma_llm, gemma3, compacted, store_dir
):
    """10%: only the global layers are compacted; sliding layers hold their last 511 keys."""
    lengths = compacted.head_lengths[:, 0]
    layers = torch.tensor(compacted.layer_compacted)
    assert layers.sum() == 3 and (lengths[~layers] == 511).all()
    assert (lengths[layers] < compacted.logical_length // 5).all()
    continuation = gemma3.encode(" In summary, the essay")
    _agrees_with_the_reference_decoder(
        gemma_llm, gemma3, compacted, continuation, 24, store_dir
    )


def test_a_continuation_longer_than_the_window_leaves_the_prefix_behind(
    gemma_llm, gemma3, compacted, store_dir
):
    """600 continuation tokens (prefilled in chunks): the last queries' windows no longer reach
    the prefix in sliding layers, while global layers still read the compacted prefix."""
    continuation = gemma3.encode(haystack_text(600, gemma3.tokenizer, seed=8))
    assert len(continuation) > 520
    _agrees_with_the_reference_decoder(
        gemma_llm, gemma3, compacted, continuation, 8, store_dir
    )
