"""Tensor parallelism: ``tensor_parallel_size=2`` on the CPU engine (one core per rank) serving
compacted prefixes, each rank loading and attending its own KV heads.

The model is a small random-weight Llama whose 2 KV heads split across the ranks (the packaged
models have 3 and 1 KV heads: 3 does not split over 2 ranks, 1 is replicated); its tokenizer is
SmolLM2's. A cache whose heads are very uneven makes the ranks' packed prefixes of different
sizes: the prompt's placeholder count is the larger one's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_compaction.am.heads import CompactedHeads, cu_seqlens_from_lengths
from vllm_compaction.corpus import haystack_text
from vllm_compaction.pipeline import compact_prefix
from vllm_compaction.reference import ReferenceDecoder
from vllm_compaction.vllm import CompactedRef, compacted_prompt

from serving.engines import exact_cache, random_llama_checkpoint, start_llm, stop_llm
from serving.test_engine import _first_logprob_gap, greedy, worst_logprob_gap

pytestmark = pytest.mark.slow

STEPS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_llama_checkpoint(tmp_path_factory.mktemp("random-llama-kv2"))


@pytest.fixture(scope="module")
def adapter(model_dir):
    from vllm_compaction.models import load_adapter

    return load_adapter(model_dir)


@pytest.fixture(scope="module")
def prompts(adapter):
    """The prefix, its continuation, an AM cache and a cache whose head 0 keeps every token."""
    ids = adapter.tokenizer(haystack_text(400, adapter.tokenizer, seed=5))["input_ids"]
    continuation = adapter.encode(" In summary, the essay")
    mask = torch.ones(len(ids), dtype=torch.bool)
    compacted = compact_prefix(
        adapter,
        ids,
        mask,
        ratio=0.2,
        method="am-highest-attn",
        queries="context-prefill",
        budgets="global",
        on_policy=False,
    )
    full = exact_cache(adapter, ids)
    uneven = dataclasses.replace(
        compacted,
        layers=[
            _join(whole.select([0]), part.select([1]))
            for whole, part in zip(full.layers, compacted.layers)
        ],
    )
    return ids, continuation, compacted, uneven, full


def _join(first: CompactedHeads, second: CompactedHeads) -> CompactedHeads:
    return CompactedHeads(
        keys=torch.cat([first.keys, second.keys]),
        beta=torch.cat([first.beta, second.beta]),
        values=torch.cat([first.values, second.values]),
        indices=torch.cat([first.indices, second.indices]),
        cu_seqlens=cu_seqlens_from_lengths(
            [first.total_slots, second.total_slots], device=first.keys.device
        ),
    )


def _serve(llm, prompts, store_dir):
    ids, continuation, compacted, uneven, full = prompts
    requests = [
        compacted_prompt(cache, continuation, llm=llm, store=store_dir)
        for cache in (compacted, uneven, full)
    ]
    requests.append({"prompt_token_ids": ids + continuation, "cache_salt": "plain"})
    outputs = llm.generate(requests, greedy(STEPS, logprobs=5))
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    return requests, [o.outputs[0] for o in outputs], block_size


@pytest.fixture(scope="module")
def served(model_dir, prompts, store_dir):
    """Every request through a TP=2 engine, then through a TP=1 engine (one at a time: each
    takes both cores)."""
    results = {}
    for size in (2, 1):
        engine = start_llm(
            "float32", store=store_dir, model=str(model_dir), tensor_parallel_size=size
        )
        try:
            results[size] = _serve(engine, prompts, store_dir)
        finally:
            stop_llm(engine)
    return results


def test_identity_cache_under_tp2_equals_the_plain_prompt(served):
    _, (compacted, uneven, identity, plain), _ = served[2]
    assert len(plain.token_ids) == STEPS
    assert identity.token_ids == plain.token_ids
    assert worst_logprob_gap(identity, plain) < 1e-4  # measured 1.1e-5


def test_tp2_serves_what_tp1_and_the_reference_decoder_do(served, prompts, adapter):
    """The same compacted caches (one even, one whose ranks pack different sizes) through TP=2
    and TP=1: same tokens, logprobs within 1e-4; and the reference decoder's answer."""
    _, continuation, compacted, uneven, _ = prompts
    requests, tp2, block_size = served[2]
    _, tp1, _ = served[1]
    # the rank holding the long head fills more blocks: the placeholders follow it
    slots = CompactedRef.parse(requests[1]["cache_salt"]).num_slots
    assert slots == uneven.physical_tokens("varlen", block_size, tp_size=2)
    assert slots > uneven.physical_tokens("varlen", block_size)
    decoder = ReferenceDecoder(adapter)
    for index, cache in enumerate((compacted, uneven)):
        assert tp2[index].token_ids == tp1[index].token_ids
        assert worst_logprob_gap(tp2[index], tp1[index]) < 1e-4  # measured 4.8e-6
        reference = decoder.generate(cache, continuation, max_new_tokens=STEPS)
        assert list(tp2[index].token_ids) == list(reference.token_ids)
        assert _first_logprob_gap(tp2[index], reference.first_logits) < 1e-3
