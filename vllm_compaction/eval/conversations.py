"""Seeded conversations and agent traces: the product's own inputs as evaluation tasks.

Each builder returns a :class:`~vllm_compaction.eval.tasks.TaskInstance` whose ``messages`` are a
multi-turn history (compacted as the server compacts one: every message's content, the template
tokens exact) and whose question comes in a new user turn after it. Essay excerpts (the Paul
Graham corpus) make the long turns; the facts are stated in passing inside them.

- ``chat-facts``: a personal fact said in passing ("By the way, the city I moved to last year is
  Lisbon.") at the start, middle or end of one of four long user turns; the seed walks every
  (turn, position) pair, so 48 instances hold each of the 12 pairs four times (``details``).
- ``agent-trace``: an agent's tool calls and their outputs (a file listing with paths, sizes and
  ids; file contents; a ticket record); the question needs one value from one output.
- ``chat-multikey``: four facts with near-duplicate keys and values ("the door code for the back
  door is 481736", "... the side door is 481763"), each in its own turn; one is asked.
- ``exact-copy``: one long identifier (an account number, a licence key, a commit hash, a
  tracking code) stated in passing; scored on every character, and an answer that names only a
  prefix of it is reported as cut short (:func:`cut_short`).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable

from vllm_compaction.corpus import haystack_text
from vllm_compaction.eval.instance import TaskInstance, score_text

__all__ = ["CONVERSATION_TASKS", "TURNS", "POSITIONS", "cut_short"]

TURNS = 4
POSITIONS = ("start", "middle", "end")
_OPENERS = (
    "Here is a passage I was reading today.",
    "I found another part of the essay, tell me what you think.",
    "This is the next section I wanted to share with you.",
    "Here is more of the text I am going through.",
    "One more excerpt, it continues the previous one.",
)
_REPLIES = (
    "Thanks for sharing. The passage makes an interesting point about how good ideas develop.",
    "That is a thoughtful section; the author argues from his own experience.",
    "I see. The essay keeps returning to the same theme, which makes it persuasive.",
    "Interesting. It reads like advice for people starting something new.",
    "Got it. The examples make the argument concrete.",
)
_CITIES = (
    "Lisbon", "Montreal", "Osaka", "Valparaiso", "Tallinn", "Brisbane", "Nairobi",
    "Krakow", "Edinburgh", "Porto", "Seville", "Winnipeg", "Ljubljana", "Cusco",
)  # fmt: skip
_NAMES = (
    "Marguerite", "Thaddeus", "Ingrid", "Leopold", "Rosalind", "Bartholomew", "Philippa",
    "Cornelius", "Imogen", "Ambrose", "Beatrix", "Octavia", "Florian", "Wilhelmina",
)  # fmt: skip
_PETS = (
    "Biscuit", "Pickles", "Mochi", "Waffles", "Pumpkin", "Noodle", "Pepper", "Tofu",
    "Marmalade", "Sprocket", "Clementine", "Bramble", "Ziggy", "Juniper",
)  # fmt: skip
_COMPANIES = (
    "Northwind Robotics", "Bluefin Analytics", "Ironbark Systems", "Lumen Freight",
    "Quarry Labs", "Saltmarsh Energy", "Tidewater Health", "Copperleaf Media",
    "Granite Peak Software", "Harbor Light Insurance", "Redwood Circuits", "Silverline Bikes",
)  # fmt: skip
#: (statement in passing, question, answer prefix, values)
_FACTS = (
    (
        "By the way, last year I moved to {v}.",
        "Which city did I move to last year?",
        "Last year you moved to",
        _CITIES,
    ),
    (
        "Oh, and my sister's name is {v}.",
        "What is my sister's name?",
        "Your sister's name is",
        _NAMES,
    ),
    (
        "Also, my dog's name is {v}.",
        "What is my dog's name?",
        "Your dog's name is",
        _PETS,
    ),
    (
        "Side note: I work at {v}.",
        "Which company do I work at?",
        "You work at",
        _COMPANIES,
    ),
)
#: groups of near-duplicate keys: (statement, question, answer prefix) over {k} and {v}
_KEY_GROUPS = (
    (
        ("front door", "back door", "side door", "garage door"),
        "The door code for the {k} is {v}.",
        "What is the door code for the {k}?",
        "The door code for the {k} is",
    ),
    (
        ("staging server", "production server", "test server", "backup server"),
        "The port of the {k} is {v}.",
        "What is the port of the {k}?",
        "The port of the {k} is",
    ),
    (
        ("upstairs locker", "downstairs locker", "gym locker", "office locker"),
        "The combination of the {k} is {v}.",
        "What is the combination of the {k}?",
        "The combination of the {k} is",
    ),
)
#: kind -> (statement in passing, question, answer prefix, identifier generator)
_IDENTIFIERS = {
    "account number": (
        "For the record, my account number is {v}.",
        "What is my account number? Repeat it exactly.",
        "Your account number is",
        lambda rng: str(rng.randrange(10**11, 10**12)),
    ),
    "licence key": (
        "Before I forget, my licence key is {v}.",
        "What is my licence key? Repeat it exactly.",
        "Your licence key is",
        lambda rng: "-".join(
            "".join(
                rng.choice(string.ascii_uppercase + string.digits) for _ in range(4)
            )
            for _ in range(3)
        ),
    ),
    "commit hash": (
        "The fix landed in commit {v}, just so you know.",
        "Which commit did the fix land in? Repeat the hash exactly.",
        "The fix landed in commit",
        lambda rng: "".join(rng.choice("0123456789abcdef") for _ in range(12)),
    ),
    "phone number": (
        "If you need to reach me, my phone number is {v}.",
        "What is my phone number? Repeat it exactly.",
        "Your phone number is",
        lambda rng: (
            f"{rng.randrange(200, 1000)}-{rng.randrange(200, 1000)}-"
            f"{rng.randrange(1000, 10000)}"
        ),
    ),
}


def cut_short(text: str, answers: tuple[str, ...]) -> bool:
    """Whether ``text`` names a strict prefix (at least half) of an expected identifier instead
    of the whole: the exact-copy failure ("48553" for "485538"). An answer that names the whole
    identifier somewhere is not cut short, even where it goes on to repeat it and the repeat
    runs out of new tokens, or a list after it starts with a digit of it."""
    if score_text(text, answers, case_sensitive=True):
        return False
    words = [m.group() for m in re.finditer(r"[\w-]+", text)]
    return any(
        len(answer) // 2 <= len(word) < len(answer) and answer.startswith(word)
        for answer in answers
        for word in words
    )


def _turn_texts(tokenizer, n_tokens: int, seed: int, turns: int) -> list[str]:
    """About ``n_tokens`` of essay text cut into ``turns`` pieces at sentence ends."""
    text = haystack_text(n_tokens, tokenizer, seed=seed)
    cuts = [m.end() for m in re.finditer(r"[.!?]\s", text)]
    bounds = [0]
    for i in range(1, turns):
        target = i * len(text) / turns
        bounds.append(
            min((c for c in cuts if c > bounds[-1]), key=lambda c: abs(c - target))
        )
    bounds.append(len(text))
    return [text[a:b].strip() for a, b in zip(bounds, bounds[1:])]


def _place(piece: str, sentence: str, position: str, rng: random.Random) -> str:
    """``sentence`` at the start, in the middle (a sentence end inside the excerpt, never
    its first or last, else a space near the middle) or at the end of an excerpt."""
    if position == "start":
        return f"{sentence} {piece}"
    if position == "end":
        return f"{piece} {sentence}"
    target = rng.uniform(0.35, 0.65) * len(piece)
    inside = [
        m.end() for m in re.finditer(r"[.!?]\s", piece) if m.end() < len(piece) - 1
    ]
    cuts = inside or [m.end() for m in re.finditer(r"\s", piece)] or [len(piece) // 2]
    cut = min(cuts, key=lambda c: abs(c - target))
    return f"{piece[:cut].rstrip()} {sentence} {piece[cut:].lstrip()}"


def _chat(
    tokenizer,
    n_tokens: int,
    seed: int,
    statements: dict[int, list[tuple[str, str]]],
    rng: random.Random,
) -> tuple[dict, ...]:
    """A user/assistant history of ``TURNS`` long user turns; ``statements[turn]`` holds the
    (sentence, position) pairs said in passing in that turn."""
    overhead = 40 * TURNS  # openers and replies
    pieces = _turn_texts(tokenizer, n_tokens - overhead, seed, TURNS)
    messages: list[dict] = []
    for turn, piece in enumerate(pieces):
        for sentence, position in statements.get(turn, []):
            piece = _place(piece, sentence, position, rng)
        messages.append(
            {"role": "user", "content": f"{_OPENERS[turn % len(_OPENERS)]}\n\n{piece}"}
        )
        messages.append({"role": "assistant", "content": rng.choice(_REPLIES)})
    return tuple(messages)


def _task(
    name: str,
    seed: int,
    messages,
    question,
    prefix,
    answers,
    exact=False,
    distractors=(),
    **details,
) -> TaskInstance:
    return TaskInstance(
        name,
        seed,
        "\n\n".join(m["content"] for m in messages),
        question,
        prefix,
        tuple(answers),
        messages=tuple(messages),
        details=details,
        exact=exact,
        distractors=tuple(distractors),
    )


def _grid(seed: int) -> tuple[int, str]:
    """(turn, position) walking all TURNS x POSITIONS pairs as the seed grows."""
    turn, position = divmod(seed % (TURNS * len(POSITIONS)), len(POSITIONS))
    return turn, POSITIONS[position]


def _chat_facts(tokenizer, n_tokens: int, seed: int):
    rng = random.Random(seed)
    statement, question, prefix, values = _FACTS[rng.randrange(len(_FACTS))]
    value = rng.choice(values)
    turn, position = _grid(seed)
    messages = _chat(
        tokenizer, n_tokens, seed, {turn: [(statement.format(v=value), position)]}, rng
    )
    return _task(
        "chat-facts", seed, messages, question, prefix, [value],
        fact_turn=turn, fact_position=position,
    )  # fmt: skip


def _near_values(rng: random.Random, n: int) -> list[str]:
    """``n`` six-digit values sharing their first three digits (near-duplicates)."""
    stem = str(rng.randrange(100, 1000))
    tails: list[str] = []
    while len(tails) < n:
        tail = "".join(rng.choice(string.digits) for _ in range(3))
        if tail not in tails:
            tails.append(tail)
    return [stem + t for t in tails]


def _chat_multikey(tokenizer, n_tokens: int, seed: int):
    rng = random.Random(seed)
    keys, statement, question, prefix = _KEY_GROUPS[rng.randrange(len(_KEY_GROUPS))]
    values = _near_values(rng, len(keys))
    turns = rng.sample(range(TURNS), len(keys))  # one key per turn
    said = {
        t: [(statement.format(k=k, v=v), rng.choice(POSITIONS))]
        for t, k, v in zip(turns, keys, values)
    }
    asked = rng.randrange(len(keys))
    messages = _chat(tokenizer, n_tokens, seed, said, rng)
    return _task(
        "chat-multikey", seed, messages,
        question.format(k=keys[asked]), prefix.format(k=keys[asked]), [values[asked]],
        fact_turn=turns[asked], distractors=[v for i, v in enumerate(values) if i != asked],
    )  # fmt: skip


def _exact_copy(tokenizer, n_tokens: int, seed: int):
    rng = random.Random(seed)
    kind = list(_IDENTIFIERS)[seed % len(_IDENTIFIERS)]
    statement, question, prefix, make = _IDENTIFIERS[kind]
    value = make(rng)
    turn, position = _grid(seed // len(_IDENTIFIERS))
    messages = _chat(
        tokenizer, n_tokens, seed, {turn: [(statement.format(v=value), position)]}, rng
    )
    return _task(
        "exact-copy", seed, messages, question, prefix, [value], exact=True,
        fact_turn=turn, fact_position=position, kind=kind,
    )  # fmt: skip


_TOOLS_SYSTEM = (
    "You are a software agent. You work on the user's repository with the tools run_tests, "
    "git_log, read_file and search_tickets, and you answer the user's questions about what "
    "you found."
)
_TEST_WORDS = (
    "retry",
    "rounding",
    "currency",
    "timeout",
    "partial",
    "duplicate",
    "zero",
)


def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def _agent_trace(tokenizer, n_tokens: int, seed: int):
    """run_tests -> git_log -> read_file -> search_tickets -> read_file, each call answered by
    a tool turn (file contents are essay excerpts). The question needs the failing test's
    line, a commit's hash (beside another commit's) or the open ticket's id (beside a closed
    one)."""
    rng = random.Random(seed)
    word = rng.choice(_TEST_WORDS)
    line = rng.randrange(20, 400)
    commits = [_hex(rng, 12), _hex(rng, 12)]
    tickets = [f"TCK-{rng.randrange(10_000, 100_000)}" for _ in range(2)]
    files = _turn_texts(tokenizer, n_tokens - 300, seed, 3)
    calls = [
        (
            "run_tests()",
            f"collected {rng.randrange(150, 400)} items\n"
            f"FAILED tests/billing/test_refund.py::test_{word} at line {line}: "
            "AssertionError: refund counted twice\n1 failed, the rest passed",
        ),
        (
            "git_log(limit=2)",
            f"commit {commits[0]}: Add retry to the refund worker\n"
            f"commit {commits[1]}: Fix rounding in ledger totals",
        ),
        ("read_file(path='docs/design.md')", files[0]),
        (
            "search_tickets(query='refund')",
            f"Ticket {tickets[0]} (open): refund totals double-counted after retry.\n"
            f"Ticket {tickets[1]} (closed): login page slow on first load.",
        ),
        ("read_file(path='docs/notes.md')", files[1] + "\n\n" + files[2]),
    ]
    messages: list[dict] = [
        {"role": "system", "content": _TOOLS_SYSTEM},
        {
            "role": "user",
            "content": "Find out why refunds are counted twice and what changed recently.",
        },
    ]
    for call, output in calls:
        messages.append({"role": "assistant", "content": f"Calling {call}"})
        messages.append({"role": "tool", "content": output})
    asked = ("line", "commit", "ticket")[seed % 3]
    question, prefix, answer, other = {
        "line": (
            f"At which line did test_{word} fail?",
            f"test_{word} failed at line",
            str(line),
            (),
        ),
        "commit": (
            "What is the hash of the commit that added retry to the refund worker?",
            "The commit that added retry to the refund worker is",
            commits[0],
            (commits[1],),
        ),
        "ticket": (
            "Which ticket is the open one about refunds?",
            "The open ticket about refunds is ticket",
            tickets[0],
            (tickets[1],),
        ),
    }[asked]
    return _task(
        "agent-trace", seed, messages, question, prefix, [answer], exact=True,
        distractors=other, asked=asked,
    )  # fmt: skip


CONVERSATION_TASKS: dict[str, Callable] = {
    "chat-facts": _chat_facts,
    "agent-trace": _agent_trace,
    "chat-multikey": _chat_multikey,
    "exact-copy": _exact_copy,
}
