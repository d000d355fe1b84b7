"""Varlen (packed) prefixes through the real engine with widened pages (which hold padded prefixes
too): the same answers as the padded layout and the reference decoder, the memory the engine
reserves, prefix reuse, and refusals. (The session engine, stock-width pages, serves varlen
prefixes in tests/serving/test_engine.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_compaction.am.heads import CompactedHeads
from vllm_compaction.cache import CacheMismatchError, CompactedCache, LocalDiskStore
from vllm_compaction.pipeline import compact
from vllm_compaction.reference import ReferenceDecoder
from vllm_compaction.vllm import CompactedRef, compacted_prompt

from serving.engines import exact_cache, start_llm, stop_llm
from serving.test_engine import (
    QUESTION,
    _failed,
    _first_logprob_gap,
    essay_messages,
    greedy,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(store_dir):
    """A widened-page fp32 engine (this module's tests compare varlen with padded prefixes)."""
    engine = start_llm("float32", store=store_dir, pages="widened")
    yield engine
    stop_llm(engine)


def test_widened_pages_cost_a_quarter_more_kv_memory(llm):
    from vllm_compaction.vllm.engine import kv_bytes_per_token

    # d = 64 -> 80
    assert kv_bytes_per_token(llm.llm_engine.vllm_config) == 30 * 3 * 2 * 4 * 80


@pytest.fixture(scope="module")
def extreme_cache(smollm2) -> CompactedCache:
    """A 10% nonuniform AM cache whose layer 3 has an empty head and a head with every slot (t = T)."""
    messages = essay_messages(smollm2, 700, seed=11)
    cache = compact(smollm2, messages, ratio=0.1, method="am-highest-attn-fast")
    full = exact_cache(smollm2, cache.token_ids)
    keys, beta, values, indices = cache.layers[3].padded()
    every_keys, _, every_values, every_indices = full.layers[3].padded()
    length = cache.logical_length
    width = max(keys.shape[1], length)
    pad = lambda x, v: torch.nn.functional.pad(
        x,
        (0, 0, 0, width - x.shape[1])
        if x.dim() == 3  # noqa: E731
        else (0, width - x.shape[1]),
        value=v,
    )
    keys, values, beta, indices = (
        pad(keys, 0.0),
        pad(values, 0.0),
        pad(beta, 0.0),
        pad(indices, 0),
    )
    keys[1], values[1], beta[1], indices[1] = (
        every_keys[1],
        every_values[1],
        0.0,
        every_indices[1],
    )
    lengths = cache.layers[3].head_budgets.clone()
    lengths[0], lengths[1] = 0, length
    layers = list(cache.layers)
    layers[3] = CompactedHeads.from_padded(keys, beta, values, indices, lengths)
    return dataclasses.replace(cache, layers=layers)


def test_varlen_equals_padded_and_reference_with_empty_and_full_heads(
    llm, smollm2, extreme_cache, store_dir
):
    lengths = extreme_cache.head_lengths
    assert (
        int(lengths.min()) == 0 and int(lengths.max()) == extreme_cache.logical_length
    )
    reference = ReferenceDecoder(smollm2).generate(
        extreme_cache, QUESTION, max_new_tokens=16
    )
    outputs = {}
    for layout in ("varlen", "padded"):
        prompt = compacted_prompt(
            extreme_cache, QUESTION, llm=llm, store=store_dir, layout=layout
        )
        outputs[layout] = llm.generate([prompt], greedy(16, logprobs=5))[0].outputs[0]
        assert outputs[layout].token_ids == reference.token_ids, (
            layout,
            outputs[layout].text,
            reference.text,
        )
        assert _first_logprob_gap(outputs[layout], reference.first_logits) < 1e-3
    mine = {t: lp.logprob for t, lp in outputs["varlen"].logprobs[0].items()}
    theirs = {t: lp.logprob for t, lp in outputs["padded"].logprobs[0].items()}
    assert max(abs(mine[t] - theirs[t]) for t in mine.keys() & theirs.keys()) < 1e-3


def test_engine_reserves_the_packed_size_and_reuses_it(llm, niah_cases, store_dir):
    """At 10% the prefix takes its packed rows in whole blocks, not its longest head."""
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    _, prompt, cache = niah_cases[0]
    packed = compacted_prompt(
        cache, prompt.continuation_ids, llm=llm, store=store_dir, layout="varlen"
    )
    padded = compacted_prompt(
        cache, prompt.continuation_ids, llm=llm, store=store_dir, layout="padded"
    )
    placeholders = CompactedRef.parse(packed["cache_salt"]).num_slots
    assert len(packed["prompt_token_ids"]) == placeholders + len(
        prompt.continuation_ids
    )
    layers, heads = cache.num_layers, cache.model.num_kv_heads
    # token slots' worth of the kept rows
    exact_rows = cache.physical_slots / (layers * heads)
    assert (
        placeholders % block_size == 0
        and exact_rows <= placeholders < exact_rows + block_size + 8
    )
    assert placeholders < 0.3 * CompactedRef.parse(padded["cache_salt"]).num_slots
    first, second = (llm.generate([packed], greedy(8))[0] for _ in range(2))
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # the packed blocks are prefix-cache hits
    assert second.num_cached_tokens >= placeholders


def test_batch_mixing_plain_padded_and_varlen(llm, smollm2, niah_cases, store_dir):
    batch = [
        {"prompt_token_ids": smollm2.chat_ids(QUESTION, add_generation_prompt=True)}
    ]
    for (_, prompt, cache), layout in zip(niah_cases, ["varlen", "padded", "varlen"]):
        batch.append(
            compacted_prompt(
                cache, prompt.continuation_ids, llm=llm, store=store_dir, layout=layout
            )
        )
    together = [o.outputs[0].token_ids for o in llm.generate(batch, greedy(12))]
    alone = [llm.generate([p], greedy(12))[0].outputs[0].token_ids for p in batch]
    assert together == alone


def test_prefix_of_another_geometry_is_refused(llm, smollm2, niah_cases, store_dir):
    _, prompt, cache = niah_cases[0]
    store = LocalDiskStore(store_dir)
    shallow = dataclasses.replace(
        cache,
        model=dataclasses.replace(cache.model, num_layers=29),
        layers=cache.layers[:29],
        layer_compacted=cache.layer_compacted[:29],
    )
    with pytest.raises(CacheMismatchError, match="num_layers"):
        compacted_prompt(shallow, prompt.continuation_ids, llm=llm, store=store)
    good = compacted_prompt(cache, prompt.continuation_ids, llm=llm, store=store)
    ref = CompactedRef.parse(good["cache_salt"])
    # a salt that promises a block count the cache does not have, or a part of a block
    wrong = {
        "prompt_token_ids": good["prompt_token_ids"][128:],
        "cache_salt": dataclasses.replace(ref, num_slots=ref.num_slots - 128).salt,
    }
    ragged = {
        "prompt_token_ids": good["prompt_token_ids"][1:],
        "cache_salt": dataclasses.replace(ref, num_slots=ref.num_slots - 1).salt,
    }
    outputs = llm.generate([wrong, good, ragged], greedy(8))
    assert [_failed(o) for o in outputs] == [True, False, True]
