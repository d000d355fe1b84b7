"""A long agent-style session with auto-compaction through the OpenAI API.

Run ``python -m benchmarks.agent_session [--threshold 512] [--ratio 0.1 | --target-tokens N]
[--rounds 8 | --target-multiple 4]``.
A ``vllm-compaction serve`` process (SmolLM2-135M, CPU) runs with auto-compaction above
``--threshold`` physical prompt tokens (the KV cap of the session). Turn 0 plants three facts
(and two identifiers with ``--identifiers``);
every later turn adds an essay excerpt (a tool output) and the model's one-line reply. After every
turn the benchmark asks each fact question on the current state: compacted (the conversation's
newest compaction + the turns after it) and, while it fits the model window, with the full history.
It waits for a pending compaction before the next turn, and stops after ``--rounds`` compactions
(the server compacts the whole message history again each time, from its messages, not from the
previous compacted prefix), or when the logical length reaches ``--target-multiple`` times the
threshold. Each probe records its round (how many compacted prefixes the conversation has been
served from); ``by_round`` reports how the facts of turn 0 survive each round, and
``retention`` the share of the full history's right answers the compacted state keeps. Writes ``benchmarks/results/agent_session.json`` + PNG.

One session answers about 39 questions, so one answer moves its retention by 2.6 points.
``--seeds 0,1,2`` runs one session per seed on the same server, one after another, each its own
conversation with its own fact values (drawn from the seed) and essay excerpts; the result then
holds every session and the retention and rounds pooled over them. Without ``--seeds`` the
session is the fixed one of the earlier results (the facts as listed, essay seed 7).
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.output import pyplot, save_result
from vllm_compaction.recipes import DEFAULT_METHOD

logger = logging.getLogger("benchmarks.agent_session")

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m"
FACTS = [
    (
        "The secret code of the vault is 7319.",
        "What is the secret code of the vault?",
        "7319",
    ),
    (
        "The project's codename is Bluebird.",
        "What is the project's codename?",
        "Bluebird",
    ),
    ("The team meets in room 42.", "In which room does the team meet?", "42"),
]
#: ``--identifiers``: facts an agent reads from tool outputs, copied exactly (every character)
IDENTIFIER_FACTS = [
    (
        "The customer's account number is 524533559245.",
        "What is the customer's account number?",
        "524533559245",
    ),
    (
        "The deploy key is QW7B-3PDK-HX4P.",
        "What is the deploy key?",
        "QW7B-3PDK-HX4P",
    ),
]
#: the essay seed of the fixed session (no ``--seeds``)
FIXED_ESSAY_SEED = 7
#: codenames a seeded session draws from
CODENAMES = (
    "Bluebird", "Kestrel", "Marigold", "Juniper", "Halcyon", "Tamarind", "Osprey",
    "Larkspur", "Quillon", "Saffron", "Wolverine", "Cobalt", "Nightjar", "Peregrine",
)  # fmt: skip


def seeded_facts(seed: int | None, identifiers: bool) -> list[tuple[str, str, str]]:
    """The fixed facts' sentences and questions with values drawn from ``seed``: a 4-digit vault
    code, a codename, a 2-digit room, and with ``identifiers`` a 12-digit account number and a
    deploy key of three 4-character groups. ``None``: the fixed facts as listed."""
    facts = FACTS + (IDENTIFIER_FACTS if identifiers else [])
    if seed is None:
        return facts
    rng = random.Random(seed)
    code = str(rng.randint(1000, 9999))
    codename = rng.choice(CODENAMES)
    room = str(rng.randint(10, 99))
    values = [code, codename, room]
    if identifiers:
        alphabet = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
        values += [
            str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(11)),
            "-".join("".join(rng.choice(alphabet) for _ in range(4)) for _ in range(3)),
        ]
    return [
        (statement.replace(old, new), question, new)
        for (statement, question, old), new in zip(facts, values)
    ]


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds takes comma-separated integers, got {text!r}"
        ) from None
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(
            f"--seeds takes distinct non-negative integers, got {text!r}"
        )
    return seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threshold", type=int, default=512, help="auto-compaction threshold (tokens)"
    )
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument(
        "--target-tokens",
        type=int,
        default=None,
        help="compact to this many content slots per head instead of --ratio",
    )
    parser.add_argument("--method", default=DEFAULT_METHOD)
    parser.add_argument(
        "--queries", default=None, help="query source (default: the method's own)"
    )
    parser.add_argument(
        "--turn-tokens", type=int, default=150, help="essay tokens added per turn"
    )
    parser.add_argument(
        "--rounds", type=int, default=8, help="stop after this many compactions"
    )
    parser.add_argument(
        "--target-multiple",
        type=float,
        default=None,
        help="stop instead when the logical length reaches this multiple of the threshold",
    )
    parser.add_argument("--max-turns", type=int, default=40)
    parser.add_argument(
        "--identifiers",
        action="store_true",
        help="plant two identifiers too (an account number, a deploy key), asked exactly",
    )
    parser.add_argument(
        "--probe-tokens",
        type=int,
        default=16,
        help="answer length of each fact question",
    )
    parser.add_argument(
        "--seeds",
        type=_seeds,
        default=None,
        help="comma-separated seeds: one session per seed, each with its own fact values "
        "and essay excerpts, pooled in the result (default: the fixed session)",
    )
    parser.add_argument("--out", default=str(RESULTS / "agent_session.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # a stopped run (SIGTERM) still stops its server: the exit unwinds through `finally`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import openai
    from transformers import AutoTokenizer

    from vllm_compaction.corpus import haystack_text
    from vllm_compaction.models import resolve
    from vllm_compaction.vllm.server_process import ServerProcess, cpu_engine_flags

    tokenizer = AutoTokenizer.from_pretrained(resolve(MODEL))
    work = Path(tempfile.mkdtemp(prefix="agent-session-"))
    server = ServerProcess(
        MODEL,
        [
            *cpu_engine_flags(max_model_len=8192),
            "--compaction-store",
            str(work / "store"),
            "--auto-compact-threshold-tokens",
            str(args.threshold),
            "--auto-compact-ratio",
            str(args.ratio),
            "--auto-compact-method",
            args.method,
            *(["--auto-compact-queries", args.queries] if args.queries else []),
            *(
                ["--auto-compact-target-tokens", str(args.target_tokens)]
                if args.target_tokens
                else []
            ),
        ],
        work / "server.log",
    )
    server.start()
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="bench", max_retries=0, timeout=600
    )
    sessions: list[dict] = []
    try:
        for seed in args.seeds or [None]:
            facts = seeded_facts(seed, args.identifiers)
            essay = haystack_text(
                args.turn_tokens * (args.max_turns + 2),
                tokenizer,
                seed=FIXED_ESSAY_SEED if seed is None else seed,
            )
            session = _session(
                client,
                facts,
                _chunks(essay, tokenizer, args.turn_tokens),
                "agent-session" if seed is None else f"agent-session-{seed}",
                args,
            )
            sessions.append({"seed": seed} | session if seed is not None else session)
            # saved after every session: a long run stopped keeps the sessions it finished
            result = _result(args, sessions)
            out = save_result(result, args.out, plot=_plot)
    finally:
        server.stop()
    for session in sessions:
        logger.warning(
            "session %s: logical %d tokens = %.1f x the %d-token cap; fact answers compacted "
            "%s, full history %s; retention %s",
            session.get("seed", "fixed"),
            session["turns"][-1]["logical_tokens"],
            session["final_logical_over_threshold"],
            args.threshold,
            session["compacted_probe_accuracy"],
            session["full_probe_accuracy"],
            session["retention"],
        )
    print(
        f"wrote {out}: fact answers compacted {result['compacted_probe_accuracy']}, "
        f"full history {result['full_probe_accuracy']}; retention {result['retention']}"
    )


def _result(args: argparse.Namespace, sessions: list[dict]) -> dict:
    """The result of the sessions run so far: one session's fields at the top without
    ``--seeds``, else every session and the pooled retention and rounds."""
    result = {
        "command": "python -m benchmarks.agent_session "
        + " ".join(
            f"--{k.replace('_', '-')}"
            + (
                ""
                if v is True
                else f" {','.join(map(str, v)) if isinstance(v, list) else v}"
            )
            for k, v in vars(args).items()
            if k != "out" and v is not None and v is not False
        ),
        "model": MODEL,
        "threshold_tokens": args.threshold,
        "ratio": None if args.target_tokens else args.ratio,
        "target_tokens": args.target_tokens,
        "method": args.method,
        "queries": args.queries,
    }
    if args.seeds is None:
        result |= sessions[0]
    else:
        turns = [t for s in sessions for t in s["turns"]]
        result |= {
            "seeds": args.seeds,
            "sessions": sessions,
            "compacted_probe_accuracy": _accuracy(turns, "compacted"),
            "full_probe_accuracy": _accuracy(turns, "full"),
            "retention": _retention(turns),
            "by_round": _by_round(turns),
        }
    return result


def _session(
    client,
    facts: list[tuple[str, str, str]],
    chunks: list[str],
    conversation: str,
    args: argparse.Namespace,
) -> dict:
    """One conversation: turn 0 plants ``facts``, every later turn adds a chunk; the facts are
    asked after every turn until ``--rounds`` compactions (or ``--target-multiple``)."""
    history = [
        {
            "role": "user",
            "content": "Remember these facts: "
            + " ".join(f for f, _, _ in facts)
            + " Then we will read some essays together.",
        }
    ]
    turns = []
    served: list[str] = []
    for turn in tqdm(range(args.max_turns), desc=conversation):
        reply = _chat(client, history, conversation_id=conversation)
        usage = reply.usage.model_dump()
        history.append(
            {"role": "assistant", "content": reply.choices[0].message.content or "OK."}
        )
        compaction_id, waited = _wait_for_compaction(client, conversation)
        # the server collects superseded automatic compactions, so rounds are counted
        # here: each new compacted prefix the conversation is served from is one
        if compaction_id is not None and compaction_id not in served:
            served.append(compaction_id)
        rounds = len(served)
        record = {
            "round": rounds,
            "turn": turn,
            "logical_tokens": usage.get(
                "logical_prompt_tokens", usage["prompt_tokens"]
            ),
            "physical_tokens": usage.get(
                "physical_prompt_tokens", usage["prompt_tokens"]
            ),
            "served_from": usage.get("compaction_id"),
            "compaction_wait_s": waited,
            "probes": _probe(client, history, compaction_id, facts, args.probe_tokens),
        }
        turns.append(record)
        logger.warning(
            "%s turn %d: logical %d, physical %d, compacted probes %s, full %s",
            conversation,
            turn,
            record["logical_tokens"],
            record["physical_tokens"],
            [p["compacted"] for p in record["probes"]],
            [p["full"] for p in record["probes"]],
        )
        if (
            args.target_multiple is not None
            and record["logical_tokens"] >= args.target_multiple * args.threshold
        ) or (args.target_multiple is None and rounds >= args.rounds):
            break
        history.append(
            {
                "role": "user",
                "content": f"Tool output:\n{chunks[turn]}\n\nSummarize it in one line.",
            }
        )
    jobs = [
        j
        for j in client.get("/compact", cast_to=object)["data"]
        if j["conversation_id"] == conversation
    ]
    return {
        "facts": [answer for _, _, answer in facts],
        "turns": turns,
        "compactions": [
            {
                k: j[k]
                for k in (
                    "id",
                    "status",
                    "original_tokens",
                    "compacted_tokens",
                    "ratio",
                    "messages_covered",
                    "timings",
                    "error",
                )
            }
            for j in jobs
        ],
        "final_logical_over_threshold": turns[-1]["logical_tokens"] / args.threshold,
        "compacted_probe_accuracy": _accuracy(turns, "compacted"),
        "history": history,
        "full_probe_accuracy": _accuracy(turns, "full"),
        "retention": _retention(turns),
        "by_round": _by_round(turns),
    }


def _chunks(text: str, tokenizer, n_tokens: int) -> list[str]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [
        tokenizer.decode(ids[i : i + n_tokens])
        for i in range(0, len(ids) - n_tokens + 1, n_tokens)
    ]


def _chat(client, messages, max_tokens: int = 32, **extra):
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra or None,
    )


def _wait_for_compaction(client, conversation: str) -> tuple[str | None, float]:
    """Wait until no compaction of the conversation is pending; the newest succeeded one's id
    and the seconds waited."""
    start = time.perf_counter()
    while True:
        jobs = [
            j
            for j in client.get("/compact", cast_to=object)["data"]
            if j["conversation_id"] == conversation
        ]
        if not any(j["status"] in ("queued", "running") for j in jobs):
            done = [j for j in jobs if j["status"] == "succeeded"]
            newest = (
                max(done, key=lambda j: j["messages_covered"])["id"] if done else None
            )
            return newest, time.perf_counter() - start
        time.sleep(1.0)


def _probe(
    client,
    history,
    compaction_id: str | None,
    facts: list[tuple[str, str, str]],
    max_tokens: int,
) -> list[dict]:
    probes = []
    for _, question, answer in facts:
        messages = history + [{"role": "user", "content": question}]
        compacted = _chat(
            client,
            messages,
            max_tokens,
            **({"compaction_id": compaction_id} if compaction_id else {}),
        )
        try:
            full = _chat(client, messages, max_tokens).choices[0].message.content
        except (
            Exception
        ) as exc:  # longer than the model window: only the compacted prefix can answer
            full = f"<{type(exc).__name__}>"
        text = compacted.choices[0].message.content
        probes.append(
            {
                "question": question,
                "compacted": says(text, answer),
                "full": says(full, answer),
                "compacted_answer": text,
                "full_answer": full,
            }
        )
    return probes


def said_at(text: str, answer: str) -> re.Match[str] | None:
    """Where ``text`` says ``answer`` as a whole word (room 423 is not room 42), or None."""
    return re.search(rf"\b{re.escape(answer)}\b", text)


def says(text: str, answer: str) -> bool:
    """Whether ``text`` says ``answer`` as a whole word (``said_at``)."""
    return said_at(text, answer) is not None


def _retention(turns: list[dict]) -> float | None:
    """Of the probes the full history answers right, the share the compacted state answers."""
    kept = [p["compacted"] for t in turns for p in t["probes"] if p["full"]]
    return sum(kept) / len(kept) if kept else None


def _by_round(turns: list[dict]) -> dict[str, dict]:
    """Per round (compactions so far): the facts right from the compacted state and from the
    full history, over every probe of the turns in that round."""
    out: dict[str, dict] = {}
    for round_ in sorted({t["round"] for t in turns}):
        these = [t for t in turns if t["round"] == round_]
        out[str(round_)] = {
            "turns": len(these),
            "compacted": _accuracy(these, "compacted"),
            "full": _accuracy(these, "full"),
            "retention": _retention(these),
        }
    return out


def _accuracy(turns: list[dict], key: str) -> str:
    hits = sum(p[key] for t in turns for p in t["probes"])
    return f"{hits}/{sum(len(t['probes']) for t in turns)}"


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    if "sessions" in result:
        _plot_pooled(plt, result, path)
        return
    turns = result["turns"]
    x = [t["turn"] for t in turns]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1]
    )
    top.plot(
        x, [t["logical_tokens"] for t in turns], "o-", label="logical prompt tokens"
    )
    top.plot(
        x,
        [t["physical_tokens"] for t in turns],
        "s-",
        label="physical prompt tokens (KV)",
    )
    top.axhline(
        result["threshold_tokens"],
        color="gray",
        ls="--",
        label="auto-compaction threshold",
    )
    top.set_ylabel("tokens")
    top.legend()
    size = _size(result)
    # a method string with options runs long: wrapped, not cut at the figure's edge
    top.set_title(
        textwrap.fill(
            f"Agent session, auto-compaction {size} ({result['method']})", 80
        ),
        fontsize=10,
    )
    bottom.plot(
        x,
        [sum(p["compacted"] for p in t["probes"]) for t in turns],
        "o-",
        label="compacted",
    )
    bottom.plot(
        x,
        [sum(p["full"] for p in t["probes"]) for t in turns],
        "x--",
        label="full history",
    )
    # a dotted line where a compaction round begins (older results carry no rounds)
    for before, after in zip(turns, turns[1:]):
        if after.get("round", 0) > before.get("round", 0):
            for ax in (top, bottom):
                ax.axvline(after["turn"] - 0.5, color="gray", ls=":", lw=0.8)
    bottom.set_ylabel(f"facts right / {len(turns[0]['probes'])}")
    bottom.set_xlabel("turn (dotted: a new compaction round)")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _size(result: dict) -> str:
    return (
        f"to {result['target_tokens']} slots per head"
        if result.get("target_tokens")
        else f"at {result['ratio']:.0%}"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _plot_pooled(plt, result: dict, path: Path) -> None:
    """Several sessions: per round, the share of facts right from the compacted state and from
    the full history, pooled over the sessions."""
    rounds = sorted(result["by_round"], key=int)

    def share(key: str) -> list[float]:
        parts = [result["by_round"][r][key].split("/") for r in rounds]
        return [int(a) / int(b) if int(b) else float("nan") for a, b in parts]

    fig, ax = plt.subplots(figsize=(8, 4))
    x = [int(r) for r in rounds]
    ax.plot(x, share("compacted"), "o-", label="compacted")
    ax.plot(x, share("full"), "x--", label="full history")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("round (compactions so far)")
    ax.set_ylabel("facts right")
    ax.set_title(
        textwrap.fill(
            f"{_count(len(result['sessions']), 'agent session')}, auto-compaction "
            f"{_size(result)} "
            f"({result['method']}): retention {result['retention']:.1%}",
            80,
        ),
        fontsize=10,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
