"""Summarize, then compact: the paper's "Summarization plus Attention Matching" extension.

The model first writes a summary of the conversation (greedy, with the paper's
``summarize_keypoints_questions`` prompt); the summary then stands in for the conversation as
one user message, and Attention Matching compacts that message's KV. The compacted prefix's
logical length is the summary's: what follows it continues the summary, not the original
positions. Summaries lose what they leave out (needles among them); the point is size: the
paper reports about 200x with the accuracy of the summary alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_compaction.models import ModelAdapter

__all__ = [
    "SUMMARY_HEADER",
    "SUMMARY_PROMPT",
    "summarize",
    "summary_messages",
]

#: The paper's ``summarize_keypoints_questions`` prompt (its appendix, "Summarization prompts").
SUMMARY_PROMPT = (
    "Summarize the following text, providing all key points that might be necessary to "
    "answer comprehension questions:\n\n{text}\n\nSummary:"
)
#: What the summary message says it is, so the model reads what follows as a continuation.
SUMMARY_HEADER = "Summary of the conversation so far:\n"
DEFAULT_SUMMARY_TOKENS = 256


def _transcript(messages: Sequence[dict]) -> str:
    """One text of the conversation: a single message is its content; several are labelled by
    role, one paragraph each."""
    if len(messages) == 1:
        return str(messages[0]["content"])
    return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)


def summarize(
    adapter: ModelAdapter,
    messages: Sequence[dict],
    *,
    max_new_tokens: int = DEFAULT_SUMMARY_TOKENS,
) -> str:
    """The model's greedy summary of ``messages`` (at most ``max_new_tokens`` tokens)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not messages:
        raise ValueError("nothing to summarize: messages is empty")
    request = [
        {"role": "user", "content": SUMMARY_PROMPT.format(text=_transcript(messages))}
    ]
    ids = adapter.chat_ids(request, add_generation_prompt=True)
    prompt = adapter.prefill(ids[:-1], capture_queries=False)
    new, _ = adapter.generate(
        prompt.exact_prefix(), prompt.length, ids[-1:], max_new_tokens=max_new_tokens
    )
    summary = adapter.tokenizer.decode(new, skip_special_tokens=True).strip()
    if not summary:
        raise ValueError("the model wrote an empty summary; compact without summarize")
    return summary


def summary_messages(
    adapter: ModelAdapter,
    messages: Sequence[dict],
    *,
    max_new_tokens: int = DEFAULT_SUMMARY_TOKENS,
) -> list[dict]:
    """``messages`` replaced by one user message holding their summary."""
    text = summarize(adapter, messages, max_new_tokens=max_new_tokens)
    return [{"role": "user", "content": SUMMARY_HEADER + text}]
