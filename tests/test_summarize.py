"""Summarize + AM (the paper's extension): the summary stands in for the conversation, AM
compacts the summary's KV, and the cache's logical length is the summary's."""

from __future__ import annotations

import pytest

from vllm_compaction.pipeline import compact
from vllm_compaction.summarize import SUMMARY_HEADER, summarize

NOTES = [
    {
        "role": "user",
        "content": "Notes from the planning meeting. The launch moved to March 14. "
        "The budget is 40,000 euros. Ana leads the design review, Tom the rollout. "
        * 6,
    },
    {"role": "assistant", "content": "Understood, I have the notes."},
]


@pytest.mark.slow
def test_the_summary_is_compacted_in_place_of_the_conversation(smollm2):
    summary = summarize(smollm2, NOTES, max_new_tokens=24)
    assert 0 < len(smollm2.encode(summary)) <= 24
    cache = compact(
        smollm2,
        NOTES,
        ratio=0.5,
        method="am-highest-attn",
        queries="repeat-prefill",
        summarize=True,
        summary_tokens=24,
    )
    # greedy: the same summary, one user message under its header, compacted in place
    stand_in = [{"role": "user", "content": SUMMARY_HEADER + summary}]
    ids, mask = smollm2.chat_content(stand_in)
    original, _ = smollm2.chat_content(NOTES)
    assert cache.logical_length == len(ids) < len(original) / 3
    content = int(mask.sum())
    start, end = cache.compacted_span
    assert end - start == content
    kept = cache.head_lengths[cache.layer_compacted].float().mean()
    # half of the summary's content tokens per head, plus the template kept exact
    assert kept <= len(ids) - content / 2 + 1
    assert cache.timings["summarize_s"] > 0
    assert cache.timings["total_s"] >= cache.timings["summarize_s"]


def test_summarize_refuses_what_it_cannot_do(smollm2):
    with pytest.raises(ValueError, match="cannot be combined with summarize"):
        compact(smollm2, NOTES, ratio=0.5, summarize=True, keep_last_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        summarize(smollm2, [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        summarize(smollm2, NOTES, max_new_tokens=0)
