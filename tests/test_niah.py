"""Needle-in-a-haystack quality floor on the real model (a few seeded instances; the full
count is `python -m benchmarks.niah`)."""

from __future__ import annotations

import pytest

from vllm_compaction.eval import make_needle, needle_prompt, score_answer
from vllm_compaction.pipeline import compact_prepared, prepare_prefix
from vllm_compaction.reference import ReferenceDecoder

pytestmark = pytest.mark.slow

SEEDS = (0, 1)


@pytest.fixture(scope="module")
def instances(smollm2):
    out = []
    for seed in SEEDS:
        inst = make_needle(smollm2.tokenizer, 2000, seed=seed)
        out.append((inst, needle_prompt(smollm2, inst)))
    return out


def test_full_context_answers_every_instance(smollm2, instances):
    decoder = ReferenceDecoder(smollm2)
    for inst, prompt in instances:
        full = decoder.generate(smollm2.prefill(prompt.prefix_ids, capture_queries=False),
                                prompt.continuation_ids, max_new_tokens=12)
        assert score_answer(inst, full.text), (inst.value, full.text)


def test_am_at_ten_percent_keeps_the_needle(smollm2, instances):
    decoder = ReferenceDecoder(smollm2)
    correct = []
    for inst, prompt in instances:
        prepared = prepare_prefix(smollm2, prompt.prefix_ids, prompt.compact_mask, queries="repeat-prefill")
        cache = compact_prepared(prepared, ratio=0.1, method="am-highest-attn-fast")
        assert cache.physical_slots <= 0.1 * cache.logical_length * 90 + 90 * 30
        correct.append(score_answer(inst, decoder.generate(cache, prompt.continuation_ids,
                                                           max_new_tokens=12).text))
    assert all(correct), correct
