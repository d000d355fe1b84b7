"""Compacted prefixes served by the real vLLM engine (fp32, CPU) agree with vanilla vLLM and with
the reference decoder; bad caches fail only their own request."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.cache import CacheError, CacheMismatchError
from vllm_compaction.corpus import haystack_text
from vllm_compaction.eval import score_answer
from vllm_compaction.pipeline import compact
from vllm_compaction.reference import ReferenceDecoder
from vllm_compaction.vllm import CompactedRef, compacted_prompt
from vllm_compaction.vllm.prompt import PLACEHOLDER_TOKEN_ID

from serving.engines import exact_cache

pytestmark = pytest.mark.slow

QUESTION = [
    {"role": "user", "content": "In two sentences, what is the essay above about?"}
]


def greedy(max_tokens: int, logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)


def essay_messages(adapter, tokens: int, seed: int) -> list[dict]:
    return [
        {
            "role": "user",
            "content": "Read this essay.\n\n"
            + haystack_text(tokens, adapter.tokenizer, seed=seed),
        }
    ]


@pytest.fixture(scope="module")
def essay(smollm2):
    ids = smollm2.chat_ids(essay_messages(smollm2, 600, seed=3))
    return ids, smollm2.turn_ids(QUESTION)


def top_logprobs(step: dict) -> dict[int, float]:
    return {token: lp.logprob for token, lp in step.items()}


def worst_logprob_gap(mine, theirs) -> float:
    """The largest difference of a token's logprob between two outputs, over the top tokens
    both list at each step."""
    worst = 0.0
    for a, b in zip(mine.logprobs, theirs.logprobs):
        a, b = top_logprobs(a), top_logprobs(b)
        for token in a.keys() & b.keys():
            worst = max(worst, abs(a[token] - b[token]))
    return worst


def test_identity_cache_matches_vanilla_vllm(llm, vanilla, smollm2, essay, store_dir):
    prefix_ids, question_ids = essay
    prompt = compacted_prompt(
        exact_cache(smollm2, prefix_ids), question_ids, llm=llm, store=store_dir
    )
    assert prompt["prompt_token_ids"][: len(prefix_ids)] == [
        PLACEHOLDER_TOKEN_ID
    ] * len(prefix_ids)
    served = llm.generate([prompt], greedy(64, logprobs=5))[0].outputs[0]
    plain = vanilla.generate(
        [{"prompt_token_ids": prefix_ids + question_ids}], greedy(64, logprobs=5)
    )[0].outputs[0]
    assert served.token_ids == plain.token_ids
    assert len(served.token_ids) >= 16
    assert worst_logprob_gap(served, plain) < 1e-4


def test_plain_prompts_unchanged_by_the_plugin(llm, vanilla, essay):
    """Stock-width pages: a plain request runs vLLM's own kernel on the same pages, bit for bit."""
    prefix_ids, question_ids = essay
    # a salt of its own: the whole prompt is prefilled in both engines (a prefix-cache hit would
    # split the prefill differently, and with it the fp32 rounding)
    prompt = {
        "prompt_token_ids": prefix_ids + question_ids,
        "cache_salt": "plain-traffic",
    }
    ours = llm.generate([prompt], greedy(32, logprobs=5))[0].outputs[0]
    theirs = vanilla.generate([prompt], greedy(32, logprobs=5))[0].outputs[0]
    assert ours.token_ids == theirs.token_ids
    assert [top_logprobs(step) for step in ours.logprobs] == [
        top_logprobs(step) for step in theirs.logprobs
    ]


def test_engine_kv_snapshot_is_what_the_model_computes(llm, smollm2, essay, store_dir):
    """A snapshot holds the engine's post-RoPE K/V of every prompt token, in layer/head order."""
    from vllm import SamplingParams

    from vllm_compaction.vllm.snapshot import snapshot_dir, snapshot_kv

    prefix_ids, _ = essay
    kv = snapshot_kv(llm, prefix_ids)
    reference = smollm2.prefill(prefix_ids, capture_queries=False)
    assert kv.keys.shape == (
        smollm2.num_layers,
        reference.keys[0].shape[0],
        len(prefix_ids),
        reference.keys[0].shape[2],
    )
    for layer in range(smollm2.num_layers):
        assert torch.allclose(
            kv.keys[layer], reference.keys[layer], atol=5e-4, rtol=1e-4
        ), layer
        assert torch.allclose(
            kv.values[layer], reference.values[layer], atol=5e-4, rtol=1e-4
        ), layer
    assert not list(snapshot_dir(store_dir).glob("*"))  # read and removed
    # a request that asks for one with an already cached prefix gets none, and decodes normally
    path = snapshot_dir(store_dir) / "asked.safetensors"
    asking = {"prompt_token_ids": prefix_ids, "cache_salt": "shared"}
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        extra_args={"kv_transfer_params": {"compaction_snapshot": path.stem}},
    )
    llm.generate([asking], params)  # computes the prefix: a snapshot is written
    assert path.is_file()
    path.unlink()
    # prefix from the prefix cache: refused
    again = llm.generate([asking], params)[0].outputs[0]
    assert not path.exists() and again.finish_reason == "length"


def test_stock_width_pages_cost_no_kv_memory(llm, vanilla):
    from vllm_compaction.vllm.engine import kv_bytes_per_token

    layers_heads_fp32 = 30 * 3 * 2 * 4
    assert kv_bytes_per_token(llm.llm_engine.vllm_config) == layers_heads_fp32 * 64
    assert kv_bytes_per_token(vanilla.llm_engine.vllm_config) == layers_heads_fp32 * 64
    spec = llm.llm_engine.vllm_config.cache_config
    # same pages
    assert (
        spec.num_gpu_blocks
        == vanilla.llm_engine.vllm_config.cache_config.num_gpu_blocks
    )


def test_padded_prefixes_are_refused_on_stock_pages(
    llm, smollm2, niah_cases, store_dir
):
    """Padded prefixes need the bias coordinates: the prompt builder says so, and a hand-made
    request fails alone while the rest of its batch is served."""
    _, prompt, cache = niah_cases[0]
    with pytest.raises(ValueError, match="stock-width KV pages"):
        compacted_prompt(
            cache, prompt.continuation_ids, llm=llm, store=store_dir, layout="padded"
        )
    varlen = compacted_prompt(cache, prompt.continuation_ids, llm=llm, store=store_dir)
    padded_slots = cache.physical_tokens("padded", None)
    ref = CompactedRef.parse(varlen["cache_salt"])
    forged = {
        "prompt_token_ids": [PLACEHOLDER_TOKEN_ID] * padded_slots
        + prompt.continuation_ids,
        "cache_salt": CompactedRef(
            ref.entry_id, padded_slots, ref.digest, "padded"
        ).salt,
    }
    bad, good = llm.generate([forged, varlen], greedy(8))
    assert _failed(bad) and not _failed(good)


def _first_logprob_gap(output, reference_logits: torch.Tensor) -> float:
    reference = torch.log_softmax(reference_logits.float(), dim=-1)
    step = top_logprobs(output.logprobs[0])
    return max(abs(lp - float(reference[token])) for token, lp in step.items())


def test_niah_caches_agree_with_reference_decoder(llm, smollm2, niah_cases, store_dir):
    """am-highest-attn-fast at 10% with global (nonuniform) budgets: same answer, same logits."""
    decoder = ReferenceDecoder(smollm2)
    for inst, prompt, cache in niah_cases:
        lengths = cache.head_lengths
        assert lengths.min() < lengths.max()  # per-head budgets really differ
        reference = decoder.generate(cache, prompt.continuation_ids, max_new_tokens=12)
        served = llm.generate(
            [
                compacted_prompt(
                    cache, prompt.continuation_ids, llm=llm, store=store_dir
                )
            ],
            greedy(12, logprobs=5),
        )[0].outputs[0]
        assert served.token_ids == reference.token_ids, (served.text, reference.text)
        assert _first_logprob_gap(served, reference.first_logits) < 1e-3
        assert score_answer(inst, served.text) == score_answer(inst, reference.text)


def test_uniform_budget_cache_agrees_with_reference_decoder(llm, smollm2, store_dir):
    messages = essay_messages(smollm2, 700, seed=5)
    cache = compact(
        smollm2, messages, ratio=0.1, method="am-highest-attn-fast", budgets="uniform"
    )
    decoder = ReferenceDecoder(smollm2)
    reference = decoder.generate(cache, QUESTION, max_new_tokens=24)
    served = llm.generate(
        [compacted_prompt(cache, QUESTION, llm=llm, store=store_dir)],
        greedy(24, logprobs=5),
    )[0].outputs[0]
    assert served.token_ids == reference.token_ids, (served.text, reference.text)
    assert _first_logprob_gap(served, reference.first_logits) < 1e-3


def test_conversation_cache_agrees_with_reference_decoder(llm, smollm2, store_dir):
    """A multi-turn history with a fact said in passing, compacted as the server compacts it
    (message contents, template tokens exact): vLLM and the reference decoder give the same
    tokens for the question after it, and the full context's answer survives 10%."""
    from vllm_compaction.eval.tasks import make_task, task_prompt
    from vllm_compaction.pipeline import compact_prepared, prepare_prefix

    inst = make_task("chat-facts", smollm2.tokenizer, 800, seed=1)
    prompt = task_prompt(smollm2, inst)
    prepared = prepare_prefix(
        smollm2, prompt.prefix_ids, prompt.compact_mask, queries="repeat-prefill"
    )
    cache = compact_prepared(prepared, ratio=0.1, method="am-highest-attn-fast")
    reference = ReferenceDecoder(smollm2).generate(
        cache, prompt.continuation_ids, max_new_tokens=12
    )
    served = llm.generate(
        [compacted_prompt(cache, prompt.continuation_ids, llm=llm, store=store_dir)],
        greedy(12, logprobs=5),
    )[0].outputs[0]
    assert served.token_ids == reference.token_ids, (served.text, reference.text)
    assert _first_logprob_gap(served, reference.first_logits) < 1e-3
    full = llm.generate(
        [{"prompt_token_ids": prompt.prefix_ids + prompt.continuation_ids}], greedy(12)
    )[0].outputs[0]
    assert inst.score(full.text) == 1.0 and inst.score(served.text) == 1.0, (
        full.text,
        served.text,
    )


def test_second_request_reuses_loaded_blocks(llm, niah_cases, store_dir):
    _, prompt, cache = niah_cases[0]
    request = compacted_prompt(cache, prompt.continuation_ids, llm=llm, store=store_dir)
    first, second = (llm.generate([request], greedy(8))[0] for _ in range(2))
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    full_blocks = (len(request["prompt_token_ids"]) - 1) // 128 * 128
    assert second.num_cached_tokens >= full_blocks > 0


def test_mixed_batch_matches_solo_requests(llm, smollm2, niah_cases, essay, store_dir):
    prefix_ids, question_ids = essay
    batch = [{"prompt_token_ids": prefix_ids + question_ids}]
    batch += [
        compacted_prompt(cache, prompt.continuation_ids, llm=llm, store=store_dir)
        for _, prompt, cache in niah_cases
    ]
    batch.append(
        {"prompt_token_ids": smollm2.chat_ids(QUESTION, add_generation_prompt=True)}
    )
    together = [o.outputs[0].token_ids for o in llm.generate(batch, greedy(16))]
    alone = [llm.generate([p], greedy(16))[0].outputs[0].token_ids for p in batch]
    assert together == alone


def _failed(output) -> bool:
    return (
        output.outputs[0].finish_reason not in ("stop", "length")
        or not output.outputs[0].token_ids
    )


def test_bad_caches_fail_only_their_request(llm, smollm2, niah_cases, store_dir):
    _, prompt, cache = niah_cases[0]
    good = compacted_prompt(cache, prompt.continuation_ids, llm=llm, store=store_dir)
    ref = CompactedRef.parse(good["cache_salt"])
    n = ref.num_slots
    missing = dict(good, cache_salt=CompactedRef("no-such-entry", n, ref.digest).salt)
    changed = dict(good, cache_salt=CompactedRef(ref.entry_id, n, "0" * 32).salt)
    wrong_count = {
        "prompt_token_ids": good["prompt_token_ids"][1:],
        "cache_salt": CompactedRef(ref.entry_id, n - 1, ref.digest).salt,
    }
    as_text = {
        "prompt_token_ids": [1] * n + prompt.continuation_ids,
        "cache_salt": ref.salt,
    }
    outputs = llm.generate([missing, good, changed, wrong_count, as_text], greedy(8))
    assert [_failed(o) for o in outputs] == [True, False, True, True, True]
    # the engine keeps serving
    again = llm.generate([good], greedy(8))[0]
    assert again.outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_corrupt_and_foreign_caches_are_refused(
    llm, smollm2, niah_cases, store_dir, tmp_path
):
    import dataclasses

    from vllm_compaction.cache import LocalDiskStore

    _, prompt, cache = niah_cases[0]
    store = LocalDiskStore(store_dir)
    foreign = dataclasses.replace(
        cache, model=dataclasses.replace(cache.model, weights_digest="0" * 64)
    )
    with pytest.raises(CacheMismatchError, match="weights_digest"):
        compacted_prompt(foreign, prompt.continuation_ids, llm=llm, store=store)
    with pytest.raises(CacheError, match="No compacted cache"):
        compacted_prompt("absent-entry", prompt.continuation_ids, llm=llm, store=store)
    # an entry damaged after the prompt was built fails in the engine, not silently
    good = compacted_prompt(cache, prompt.continuation_ids, llm=llm, store=store)
    entry = CompactedRef.parse(good["cache_salt"]).entry_id
    store.put_id("damaged", cache)
    damaged_prompt = compacted_prompt(
        "damaged", prompt.continuation_ids, llm=llm, store=store
    )
    path = store.path_for("damaged")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    outputs = llm.generate([damaged_prompt, good], greedy(8))
    assert _failed(outputs[0]) and not _failed(outputs[1])
    with pytest.raises(CacheError):
        compacted_prompt("damaged", prompt.continuation_ids, llm=llm, store=store)
    assert store.contains_id(entry)


def test_continuations_as_text_ids_and_messages(llm, smollm2, niah_cases, store_dir):
    _, prompt, cache = niah_cases[0]
    text = smollm2.tokenizer.decode(prompt.continuation_ids)
    by_ids = compacted_prompt(cache, prompt.continuation_ids, llm=llm, store=store_dir)
    by_text = compacted_prompt(cache, "Hello there", llm=llm, store=store_dir)
    by_chat = compacted_prompt(cache, QUESTION, llm=llm, store=store_dir)
    assert by_text["prompt_token_ids"][-2:] == smollm2.encode("Hello there")[-2:]
    turn = smollm2.turn_ids(QUESTION)
    assert by_chat["prompt_token_ids"][-len(turn) :] == turn
    assert (
        text and by_ids["cache_salt"] == by_text["cache_salt"] == by_chat["cache_salt"]
    )
    for bad in ([], "", [{"role": "user"}], [-1]):
        with pytest.raises(ValueError):
            compacted_prompt(cache, bad, llm=llm, store=store_dir)
