"""A method against a saved agent session, compaction by compaction, without a server.

    python -m benchmarks.agent_replay \
        --against benchmarks/results/agent_session_rounds_seeds3-5.json \
        --method 'am:protect=identifiers-names' --limit 8 --resume \
        --out benchmarks/results/agent_replay_names_seeds3-5.json

A saved ``benchmarks.agent_session`` run holds each session's messages and, per turn, how many
compactions the conversation had been served from and the fact answers of the compacted state
and of the full history. The server compacts the request's whole history each time (the turn
``k`` request holds the first ``2k + 1`` messages), and the probes of a turn read the newest
compaction, the assistant's reply after it and the question. This recomputes exactly that
compaction with another method (``vllm_compaction.compact``, ``--target-tokens`` or the saved
run's) and answers the same questions with the reference decoder, so a method is paired with the
saved one on the same states: the compactions where the saved method lost an answer the full
history gets right first, then the others in a seeded shuffle. A run cut short (``--limit``, or
stopped and ``--resume``d) has measured every loss and an unbiased sample of the rest.

One compaction of about 2,000 tokens takes one to three minutes here, where a whole session
through the server (eight of them, plus vLLM's own turns) takes about eight. ``--method`` of the
saved run replays its answers (the reference decoder and vLLM agreed on every prompt compared),
which checks the replay itself.
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.agent_session import MODEL, said_at, says
from benchmarks.output import pyplot, save_figure, save_result

logger = logging.getLogger("benchmarks.agent_replay")


class ReplayError(ValueError):
    """A saved run that cannot be replayed, with the sentence that says why."""


def compaction_states(saved: dict) -> list[dict]:
    """Every state a saved run's probes read from a compacted prefix: per session and turn, the
    messages the newest compaction covered, the messages after it, and the saved probes."""
    sessions = saved.get("sessions") or [saved]
    states = []
    for index, session in enumerate(sessions):
        history = session.get("history")
        if not history:
            raise ReplayError(
                f"session {index} of the saved run has no history: it predates the "
                "benchmark saving its messages, so it cannot be replayed"
            )
        covered, rounds = 0, 0
        for turn in session["turns"]:
            if turn["round"] > rounds:
                # the request of turn k (its first 2k + 1 messages) queued the new compaction
                covered, rounds = 2 * turn["turn"] + 1, turn["round"]
            if not rounds:
                continue
            states.append(
                {
                    "session": session.get("seed", "fixed"),
                    "turn": turn["turn"],
                    "round": rounds,
                    "covered": history[:covered],
                    "after": history[covered : 2 * turn["turn"] + 2],
                    "probes": [
                        p | {"answer": answer}
                        for p, answer in zip(
                            turn["probes"], session["facts"], strict=True
                        )
                    ],
                }
            )
        last = [c for c in session.get("compactions", []) if c["status"] == "succeeded"]
        newest = max((c["messages_covered"] for c in last), default=covered)
        if newest != covered:
            raise ReplayError(
                f"session {index}: the server's newest compaction covered {newest} messages, "
                f"the turns say {covered}; the saved run does not replay"
            )
    return states


def state_order(states: list[dict], seed: int) -> list[dict]:
    """The states with a probe the full history gets right: those where the saved compacted
    state lost one first (in order), then the rest in a seeded shuffle."""
    scored = [s for s in states if any(p["full"] for p in s["probes"])]
    lost = [
        s for s in scored if any(p["full"] and not p["compacted"] for p in s["probes"])
    ]
    kept = [s for s in scored if s not in lost]
    random.Random(seed).shuffle(kept)
    return lost + kept


def answer_logprob(
    decoder: Any, cache: Any, asked: list[dict], full_answer: str, answer: str
) -> float | None:
    """The log-probability of ``answer``'s tokens where the full history's answer says it
    (``"The secret code of the vault is 7319."``), teacher-forced after ``asked`` from
    ``cache``: how far a compacted state is from the edge a greedy answer flips on. ``None``
    where the full history's answer does not say it."""
    from vllm_compaction.eval.reconstruction import answer_logits

    found = said_at(full_answer, answer)
    if found is None:
        return None
    tokenizer = decoder.adapter.tokenizer
    spoken = full_answer[: found.end()]
    encoded = tokenizer(spoken, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    # the tokens that end inside the value (a leading space may share its first token)
    value = [
        i for i, (_, end) in enumerate(encoded["offset_mapping"]) if end > found.start()
    ]
    logits = answer_logits(decoder, cache, decoder.continuation_ids(asked), ids)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return float(sum(logprobs[i, ids[i]] for i in value))


def _key(state: dict) -> str:
    return f"{state['session']}/{state['turn']}"


def summarize(rows: list[dict], total_states: int) -> dict:
    """Answers given back and lost, the retention of the saved and the new method over the
    states run (the full history's right answers only), and the new method's mean answer
    log-probability over those of them it was measured on."""
    right = [p for row in rows for p in row["probes"] if p["full"]]
    pairs = [(p["saved"], p["new"]) for p in right]
    logprobs = [
        p["answer_logprob"] for p in right if p.get("answer_logprob") is not None
    ]
    return {
        "states_run": len(rows),
        "states_with_a_right_answer": total_states,
        "full_right": len(pairs),
        "saved_kept": sum(s for s, _ in pairs),
        "new_kept": sum(n for _, n in pairs),
        "given_back": sum(n and not s for s, n in pairs),
        "lost": sum(s and not n for s, n in pairs),
        "answer_logprobs": len(logprobs),
        "mean_answer_logprob": sum(logprobs) / len(logprobs) if logprobs else None,
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rounds = sorted({row["round"] for row in result["rows"]})
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label in ("saved", "new"):
        shares = []
        for r in rounds:
            probes = [
                p for row in result["rows"] if row["round"] == r for p in row["probes"]
            ]
            right = [p[label] for p in probes if p["full"]]
            shares.append(sum(right) / len(right) if right else float("nan"))
        method = result[f"{label}_method"]
        name = method if isinstance(method, str) else ", ".join(method)
        ax.plot(rounds, shares, marker="o", label=f"{label}: {name}")
    ax.set_xlabel("round (compactions so far)")
    ax.set_ylabel("full history's right answers kept")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    ax.set_title("Agent session replayed (states run)", fontsize=9)
    save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--against",
        required=True,
        nargs="+",
        help="saved benchmarks.agent_session JSONs (their sessions are pooled)",
    )
    p.add_argument("--method", required=True, help="the method spec to replay with")
    p.add_argument(
        "--target-tokens",
        type=int,
        default=None,
        help="slots per head (default: the saved run's --target-tokens)",
    )
    p.add_argument(
        "--probe-tokens",
        type=int,
        default=32,
        help="answer length of each fact question",
    )
    p.add_argument(
        "--limit", type=int, default=None, help="run at most this many states"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="shuffle of the states without a loss"
    )
    p.add_argument(
        "--resume", action="store_true", help="keep the states --out already has"
    )
    p.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from benchmarks.quality import load_result

    runs = [load_result(path) for path in args.against]
    targets = {run.get("target_tokens") for run in runs}
    if args.target_tokens is None and (len(targets) != 1 or None in targets):
        raise SystemExit(
            f"the saved runs compacted to {sorted(map(str, targets))} slots; pass "
            "--target-tokens (a replay compacts every state to one slot count)"
        )
    target = args.target_tokens or targets.pop()
    try:
        order = state_order(
            [state for run in runs for state in compaction_states(run)], args.seed
        )
    except ReplayError as exc:
        raise SystemExit(str(exc)) from None

    from vllm_compaction import compact
    from vllm_compaction.models import load_adapter
    from vllm_compaction.reference import ReferenceDecoder

    out = Path(args.out)
    rows: list[dict] = []
    if args.resume and out.exists():
        previous = load_result(out)
        if previous["new_method"] != args.method or previous["target_tokens"] != target:
            raise SystemExit(
                f"{out} holds {previous['new_method']!r} at {previous['target_tokens']} "
                "slots; --resume needs the same method and target"
            )
        rows = previous["rows"]
    done = {row["state"] for row in rows}
    todo = [s for s in order if _key(s) not in done][
        : None if args.limit is None else max(0, args.limit - len(rows))
    ]
    adapter = load_adapter(MODEL)
    decoder = ReferenceDecoder(adapter)

    def result() -> dict:
        return {
            "against": args.against,
            "saved_method": sorted({run["method"] for run in runs}),
            "new_method": args.method,
            "target_tokens": target,
            "probe_tokens": args.probe_tokens,
            "summary": summarize(rows, len(order)),
            "rows": rows,
        }

    for state in tqdm(todo, desc="states"):
        cache = compact(
            adapter, state["covered"], target_tokens=target, method=args.method
        )
        probes = []
        for saved_probe in state["probes"]:
            asked = state["after"] + [
                {"role": "user", "content": saved_probe["question"]}
            ]
            text = decoder.generate(cache, asked, max_new_tokens=args.probe_tokens).text
            answer = saved_probe["answer"]
            probes.append(
                {
                    "question": saved_probe["question"],
                    "answer": answer,
                    "full": saved_probe["full"],
                    "saved": saved_probe["compacted"],
                    "new": says(text, answer),
                    "saved_answer": saved_probe["compacted_answer"],
                    "new_answer": text,
                    "answer_logprob": answer_logprob(
                        decoder, cache, asked, saved_probe["full_answer"], answer
                    ),
                }
            )
        rows.append(
            {
                "state": _key(state),
                "session": state["session"],
                "turn": state["turn"],
                "round": state["round"],
                "probes": probes,
            }
        )
        save_result(result(), out, plot=plot)
    final = result()
    save_result(final, out, plot=plot)
    s = final["summary"]
    print(
        f"wrote {out}: {s['states_run']} of {s['states_with_a_right_answer']} states; of the "
        f"full history's {s['full_right']} right answers the saved method kept "
        f"{s['saved_kept']}, {args.method} {s['new_kept']} ({s['given_back']} given back, "
        f"{s['lost']} lost)"
    )
    return final


if __name__ == "__main__":
    main()
