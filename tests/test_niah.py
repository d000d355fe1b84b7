"""Needle-in-a-haystack quality floor on the real model (a few seeded instances; the full
count is `python -m benchmarks.niah`)."""

from __future__ import annotations

import pytest

from vllm_compaction.eval import score_answer
from vllm_compaction.reference import ReferenceDecoder

pytestmark = pytest.mark.slow


def test_full_context_answers_every_instance(smollm2, niah_cases):
    decoder = ReferenceDecoder(smollm2)
    for inst, prompt, _ in niah_cases:
        full = decoder.generate(smollm2.prefill(prompt.prefix_ids, capture_queries=False),
                                prompt.continuation_ids, max_new_tokens=12)
        assert score_answer(inst, full.text), (inst.value, full.text)


def test_am_at_ten_percent_keeps_the_needle(smollm2, niah_cases):
    decoder = ReferenceDecoder(smollm2)
    correct = []
    for inst, prompt, cache in niah_cases:
        assert cache.physical_slots <= 0.1 * cache.logical_length * 90 + 90 * 30
        correct.append(score_answer(inst, decoder.generate(cache, prompt.continuation_ids,
                                                           max_new_tokens=12).text))
    assert all(correct), correct
