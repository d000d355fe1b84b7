"""Needle-in-a-haystack instances on the Paul Graham essays, generated from a seed.

The question always comes after the context, so compaction never sees it: the prefix is the
chat-template header plus the haystack; the continuation is the question, the end of the user
turn, the assistant header and a forced answer prefix.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from vllm_compaction.corpus import haystack_text

__all__ = [
    "INSTRUCTION",
    "NeedleInstance",
    "NeedlePrompt",
    "context_prompt",
    "insert_sentences",
    "make_needle",
    "needle_prompt",
    "score_answer",
]

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
#: RULER's instruction before the haystack (uncompacted, like the chat-template header); with it the
#: SmolLM2 prompt's header is 51 tokens, the prompt on which the needle targets were measured
INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
KEYS = (
    "bright-river",
    "silent-harbor",
    "amber-forest",
    "crimson-valley",
    "hollow-meadow",
    "frozen-canyon",
    "golden-orchard",
    "misty-lagoon",
    "quiet-summit",
    "rapid-delta",
    "scarlet-dune",
    "velvet-grove",
)


@dataclass(frozen=True)
class NeedleInstance:
    seed: int
    key: str
    value: str
    depth: float
    context: str


@dataclass
class NeedlePrompt:
    """Token-level split of an instance: ``prefix_ids`` (compacted where ``compact_mask``) and
    the uncompacted ``continuation_ids`` after it."""

    prefix_ids: list[int]
    compact_mask: torch.Tensor
    continuation_ids: list[int]


def insert_sentences(hay: str, sentences: list[str], depths: list[float]) -> str:
    """Put each sentence at the sentence boundary nearest its depth (fraction of the text)."""
    cuts = [m.end() for m in re.finditer(r"[.!?]\s", hay)] or [len(hay)]
    placed = sorted(
        (
            (min(cuts, key=lambda c: abs(c - d * len(hay))), s)
            for s, d in zip(sentences, depths)
        ),
        key=lambda x: x[0],
    )
    out, last = [], 0
    for cut, sentence in placed:
        out += [hay[last:cut].rstrip(), " ", sentence, " "]
        last = cut
    out.append(hay[last:].lstrip())
    return "".join(out)


def make_needle(tokenizer, n_tokens: int = 2000, *, seed: int) -> NeedleInstance:
    """A haystack of about ``n_tokens`` tokens with one 7-digit needle at a seeded depth."""
    rng = random.Random(seed)
    key = KEYS[rng.randrange(len(KEYS))]
    value = str(rng.randrange(1_000_000, 10_000_000))
    depth = rng.uniform(0.1, 0.9)
    context = insert_sentences(
        haystack_text(n_tokens, tokenizer, seed=seed),
        [NEEDLE.format(key=key, value=value)],
        [depth],
    )
    return NeedleInstance(seed=seed, key=key, value=value, depth=depth, context=context)


def needle_prompt(adapter, instance: NeedleInstance) -> NeedlePrompt:
    """Split the chat prompt of an instance at the end of the haystack."""
    return context_prompt(
        adapter,
        instance.context,
        QUESTION.format(key=instance.key),
        ANSWER_PREFIX.format(key=instance.key),
    )


def context_prompt(
    adapter, context: str, question: str, answer_prefix: str, instruction: str = ""
) -> NeedlePrompt:
    """One user turn ``instruction + context + question``, the assistant header and
    ``answer_prefix``, split at the end of ``context``: the prefix's context tokens are the ones to
    compact (the instruction before them stays exact, as the chat-template header does)."""
    messages = [{"role": "user", "content": instruction + context + "\n\n" + question}]
    # the chat template, or for a base model (Gemma-3-270M) plain text after a BOS
    text = adapter.render(messages, add_generation_prompt=True) + answer_prefix
    enc = adapter.tokenizer(
        text,
        add_special_tokens=not adapter.has_chat_template,
        return_offsets_mapping=True,
    )
    start = text.index(instruction + context) + len(instruction)
    end = start + len(context)
    offsets = enc["offset_mapping"]
    split = next(i for i, (a, _) in enumerate(offsets) if a >= end)
    ids = [int(i) for i in enc["input_ids"]]
    mask = torch.tensor([a >= start and b <= end and b > a for a, b in offsets[:split]])
    return NeedlePrompt(
        prefix_ids=ids[:split], compact_mask=mask, continuation_ids=ids[split:]
    )


def score_answer(instance: NeedleInstance, answer: str) -> bool:
    """Correct when the first number in the answer is the needle's value."""
    numbers = re.findall(r"\d[\d,]*", answer)
    return bool(numbers) and numbers[0].replace(",", "") == instance.value
