"""Seeded evaluation tasks on the Paul Graham essays; the question always follows the context.

Every task builds a :class:`TaskInstance` from ``(tokenizer, n_tokens, seed)``: the context
(compacted), the question and a forced answer prefix (never compacted), and the expected
answers. ``score`` is the fraction of expected answers the model's text names (whole words; for
single-answer tasks 0 or 1). Same seed, same instance, for every method.

- ``niah``: one 7-digit needle at a seeded depth (see :mod:`vllm_compaction.eval.niah`).
- ``niah-ruler``: the same instance after RULER's instruction ("Some special magic numbers are
  hidden within the following text. Make sure to memorize it. ..."), kept exact before the
  context: the prompt on which the needle targets were measured (51-token header).
- ``niah-multikey``: four needles with different keys; the question names one (distractors).
- ``niah-multivalue``: three needles with the same key; all three values are expected.
- ``variable-tracking``: ``VAR A = 12345`` then a chain ``VAR B = VAR A`` ... hidden in the text,
  plus a distractor chain; every variable of the chain is expected (RULER).
- ``common-words``: a numbered word list in which ten words recur far more often; the ten are
  expected (RULER's common-words extraction).
- ``essay-questions``: an open question about the essays (summarise them, explain their
  argument, ...), answered freely at length. Nothing is expected, so nothing is scored: the task
  measures reconstruction only, as the paper does on QuALITY, by the log-perplexity of the full
  context's long answer under the compacted cache (``answer_tokens`` sets that answer's length).
- ``chat-facts``, ``agent-trace``, ``chat-multikey``, ``exact-copy``: multi-turn conversations
  and agent traces with facts stated in passing (:mod:`vllm_compaction.eval.conversations`).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import replace

from vllm_compaction.corpus import haystack_text
from vllm_compaction.eval.conversations import CONVERSATION_TASKS
from vllm_compaction.eval.instance import TaskInstance, score_text
from vllm_compaction.eval.niah import (
    ANSWER_PREFIX,
    INSTRUCTION,
    KEYS,
    NEEDLE,
    QUESTION,
    NeedlePrompt,
    context_prompt,
    insert_sentences,
    make_needle,
)

__all__ = ["TaskInstance", "TASKS", "make_task", "task_prompt", "score_text"]


def _keys(rng: random.Random, n: int) -> list[str]:
    return rng.sample(list(KEYS), n)


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _niah(tokenizer, n_tokens: int, seed: int) -> TaskInstance:
    inst = make_needle(tokenizer, n_tokens, seed=seed)
    return TaskInstance(
        "niah",
        seed,
        inst.context,
        QUESTION.format(key=inst.key),
        ANSWER_PREFIX.format(key=inst.key),
        (inst.value,),
    )


def _niah_ruler(tokenizer, n_tokens: int, seed: int) -> TaskInstance:
    return replace(
        _niah(tokenizer, n_tokens, seed), task="niah-ruler", instruction=INSTRUCTION
    )


def _niah_multikey(tokenizer, n_tokens: int, seed: int) -> TaskInstance:
    rng = random.Random(seed)
    keys = _keys(rng, 4)
    values = [_number(rng) for _ in keys]
    hay = haystack_text(n_tokens - 80, tokenizer, seed=seed)
    context = insert_sentences(
        hay,
        [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)],
        [rng.uniform(0.1, 0.9) for _ in keys],
    )
    asked = rng.randrange(len(keys))
    return TaskInstance(
        "niah-multikey",
        seed,
        context,
        QUESTION.format(key=keys[asked]),
        ANSWER_PREFIX.format(key=keys[asked]),
        (values[asked],),
    )


def _niah_multivalue(tokenizer, n_tokens: int, seed: int) -> TaskInstance:
    rng = random.Random(seed)
    (key,) = _keys(rng, 1)
    values = [_number(rng) for _ in range(3)]
    hay = haystack_text(n_tokens - 60, tokenizer, seed=seed)
    context = insert_sentences(
        hay,
        [NEEDLE.format(key=key, value=v) for v in values],
        [rng.uniform(0.1, 0.9) for _ in values],
    )
    return TaskInstance(
        "niah-multivalue",
        seed,
        context,
        f"What are all the special magic numbers for {key} mentioned in the provided text?",
        f"The special magic numbers for {key} mentioned in the provided text are",
        tuple(values),
    )


def _var_names(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []  # a list, not a set: set order varies with PYTHONHASHSEED
    while len(names) < n:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def _variable_tracking(
    tokenizer, n_tokens: int, seed: int, hops: int = 3
) -> TaskInstance:
    rng = random.Random(seed)
    names = _var_names(rng, 2 * (hops + 1))
    chain, distractor = names[: hops + 1], names[hops + 1 :]
    value, other = (
        str(rng.randrange(10_000, 100_000)),
        str(rng.randrange(10_000, 100_000)),
    )
    statements = []
    for vars_, val in ((chain, value), (distractor, other)):
        statements.append(f"VAR {vars_[0]} = {val}.")
        statements += [
            f"VAR {vars_[i]} = VAR {vars_[i - 1]}." for i in range(1, len(vars_))
        ]
    depths = sorted(rng.uniform(0.05, 0.95) for _ in statements)
    hay = haystack_text(n_tokens - 15 * len(statements), tokenizer, seed=seed)
    # interleave the two chains, each in its own order
    chain_slots = set(rng.sample(range(len(statements)), hops + 1))
    chain_statements, distractor_statements = (
        iter(statements[: hops + 1]),
        iter(statements[hops + 1 :]),
    )
    placed = [
        next(chain_statements if slot in chain_slots else distractor_statements)
        for slot in range(len(statements))
    ]
    context = insert_sentences(hay, placed, depths)
    return TaskInstance(
        "variable-tracking",
        seed,
        context,
        f"Find all variables that are assigned the value {value} in the text above.",
        f"Answer: the variables assigned the value {value} are",
        tuple(chain),
    )


def _common_words(tokenizer, n_tokens: int, seed: int, top: int = 10) -> TaskInstance:
    rng = random.Random(seed)
    vocabulary = sorted(
        {
            w.lower()
            for w in re.findall(
                r"\b[a-zA-Z]{5,10}\b", haystack_text(4000, tokenizer, seed=seed)
            )
        }
    )
    rng.shuffle(vocabulary)
    common, rare = vocabulary[:top], vocabulary[top:]
    words: list[str] = []
    text = ""
    rare_left = iter(rare)
    # rounds of every common word once plus two rare words, until n_tokens is full
    while True:
        batch = common + [next(rare_left, rng.choice(rare)) for _ in range(2)]
        rng.shuffle(batch)
        candidate = words + batch
        candidate_text = " ".join(f"{i + 1}. {w}" for i, w in enumerate(candidate))
        if (
            len(tokenizer(candidate_text, add_special_tokens=False)["input_ids"])
            > n_tokens - 20
        ):
            break
        words, text = candidate, candidate_text
    context = "Below is a numbered list of words.\n" + text
    return TaskInstance(
        "common-words",
        seed,
        context,
        f"What are the {top} most common words in the list above?",
        f"Answer: the {top} most common words in the list are",
        tuple(common),
    )


#: open questions about the context, each answered at length by the model (never scored)
ESSAY_QUESTIONS = (
    "Summarize the text above in a few sentences.",
    "What is the main argument of the text above? Explain it with examples from the text.",
    "What advice does the author of the text above give, and why?",
    "Which ideas in the text above are the most surprising? Explain each one.",
)
ESSAY_ANSWER_TOKENS = 96


def _essay_questions(tokenizer, n_tokens: int, seed: int) -> TaskInstance:
    rng = random.Random(seed)
    return TaskInstance(
        "essay-questions",
        seed,
        haystack_text(n_tokens, tokenizer, seed=seed),
        ESSAY_QUESTIONS[rng.randrange(len(ESSAY_QUESTIONS))],
        "",
        (),
        answer_tokens=ESSAY_ANSWER_TOKENS,
    )


TASKS: dict[str, Callable[..., TaskInstance]] = {
    "niah": _niah,
    "niah-ruler": _niah_ruler,
    "niah-multikey": _niah_multikey,
    "niah-multivalue": _niah_multivalue,
    "variable-tracking": _variable_tracking,
    "common-words": _common_words,
    "essay-questions": _essay_questions,
    **CONVERSATION_TASKS,
}


def make_task(task: str, tokenizer, n_tokens: int = 2000, *, seed: int) -> TaskInstance:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    return TASKS[task](tokenizer, n_tokens, seed)


def task_prompt(adapter, instance: TaskInstance) -> NeedlePrompt:
    """Split the chat prompt of an instance at the end of its context (the compacted span).

    A conversation is split as the server splits one: its messages' contents are compacted,
    their template tokens kept exact; the question is a new user turn and the answer prefix
    starts the assistant's reply."""
    if instance.messages:
        ids, mask = adapter.chat_content(list(instance.messages))
        question = adapter.turn_ids(
            [{"role": "user", "content": instance.question}], add_generation_prompt=True
        )
        return NeedlePrompt(
            prefix_ids=ids,
            compact_mask=mask,
            continuation_ids=question + adapter.encode(instance.answer_prefix),
        )
    return context_prompt(
        adapter,
        instance.context,
        instance.question,
        instance.answer_prefix,
        instance.instruction,
    )
