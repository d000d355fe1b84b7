"""Gemma-3-270M: sliding-window layers stay exact, only global layers are compacted."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.corpus import haystack_text
from vllm_compaction.pipeline import compact_prefix
from vllm_compaction.reference import ReferenceDecoder

pytestmark = pytest.mark.slow


def test_gemma3_compacts_only_global_layers_and_decodes_exactly(gemma3):
    kinds = gemma3.layer_kinds
    assert kinds.count("sliding") == 15 and kinds.count("global") == 3
    text = haystack_text(700, gemma3.tokenizer, seed=5)
    ids = gemma3.tokenizer(text)["input_ids"]  # BOS first: it stays exact
    mask = torch.ones(len(ids), dtype=torch.bool)
    mask[0] = False
    cache = compact_prefix(
        gemma3,
        ids,
        mask,
        ratio=0.1,
        method="am-highest-attn",
        queries="context-prefill",
        budgets="uniform",
        on_policy=False,
    )
    assert cache.layer_compacted == [k == "global" for k in kinds]
    lengths = cache.head_lengths
    assert (lengths[torch.tensor(cache.layer_compacted)] < len(ids) // 5).all()
    # a sliding layer keeps what its window still sees: the last W - 1 keys
    window = gemma3.config.sliding_window
    assert (lengths[~torch.tensor(cache.layer_compacted)] == window - 1).all()

    # full budget: the reference path reproduces the stock model through the sliding window
    full = compact_prefix(
        gemma3,
        ids,
        mask,
        ratio=1.0,
        method="truncate",
        queries="context-prefill",
        budgets="uniform",
    )
    cont = gemma3.encode(" In summary,")
    got = ReferenceDecoder(gemma3).logits(full, cont)
    with torch.inference_mode():
        want = (
            gemma3.model(input_ids=torch.tensor([ids + cont]))
            .logits[0, len(ids) :]
            .float()
        )
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    gen = ReferenceDecoder(gemma3).generate(cache, cont, max_new_tokens=8)
    assert len(gen.token_ids) > 0


def test_gemma3_base_model_runs_repeat_prefill_without_chat_template(gemma3):
    """Gemma-3-270M is a base model: turns render as plain text, so the default recipes run."""
    from vllm_compaction.pipeline import compact

    text = haystack_text(300, gemma3.tokenizer, seed=6)
    ids, mask = gemma3.chat_content([{"role": "user", "content": text}])
    assert ids[0] == gemma3.tokenizer.bos_token_id and not mask[0] and mask.sum() > 250
    cache = compact(
        gemma3, text, ratio=0.2, method="am-highest-attn-fast", budgets="uniform"
    )
    assert (
        cache.query_source == "repeat-prefill"
        and cache.layer_compacted.count(True) == 3
    )


def test_gemma3_needle_prompt_without_chat_template(gemma3):
    """The evaluation tasks build base-model prompts too: BOS, the haystack (the compacted
    part), then the question and the forced answer prefix as plain text."""
    from vllm_compaction.eval import make_needle, needle_prompt
    from vllm_compaction.eval.niah import ANSWER_PREFIX, QUESTION

    inst = make_needle(gemma3.tokenizer, 300, seed=3)
    prompt = needle_prompt(gemma3, inst)
    assert (
        prompt.prefix_ids[0] == gemma3.tokenizer.bos_token_id
        and not prompt.compact_mask[0]
    )
    assert prompt.compact_mask[1:].all()
    assert (
        gemma3.tokenizer.decode(prompt.prefix_ids[1:]).strip() == inst.context.strip()
    )
    tail = gemma3.tokenizer.decode(prompt.continuation_ids)
    assert tail.strip() == QUESTION.format(
        key=inst.key
    ) + "\n\n" + ANSWER_PREFIX.format(key=inst.key)
