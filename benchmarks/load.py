"""Many sessions at once through a real server with auto-compaction, its worker killed on purpose.

Run ``python -m benchmarks.load [--sessions 64] [--minutes 10] [--kills 2]``. A ``vllm-compaction
serve`` process (SmolLM2-135M, CPU, two API keys, auto-compaction above ``--threshold`` physical
prompt tokens, one local worker) serves ``--sessions`` concurrent conversations for ``--minutes``:
each adds an essay excerpt per turn and asks for a short reply (streamed, so the time to the first
token is measured), then pauses as a person would (``--think-s``, exponential); a tenth of the
sessions send plain prompts without a conversation. The local worker is SIGKILLed ``--kills``
times, evenly spaced. Reports, per kind of request (plain, served from a compacted prefix,
conversation not yet compacted) and per phase (while a compaction runs or not), p50/p99 TTFT,
every status code, and at the end checks every succeeded compaction's cache in the store
(present, checksums sound): zero 5xx and zero lost or corrupt caches are the acceptance. Writes
``benchmarks/results/load.json`` and a plot of TTFT over time with the kills.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.output import pyplot, save_figure, save_result

logger = logging.getLogger("benchmarks.load")

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m"
KEYS = ("load-key-a", "load-key-b")


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Recorder:
    """Thread-safe list of request outcomes."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, **row: Any) -> None:
        with self._lock:
            self.rows.append(row)


def _running_jobs(store: Path) -> int:
    count = 0
    for path in (store / "jobs").glob("cmp_*.json"):
        try:
            count += json.loads(path.read_text()).get("status") == "running"
        except (OSError, ValueError):
            continue
    return count


def session(
    index: int,
    args: argparse.Namespace,
    url: str,
    store: Path,
    text: str,
    stop: threading.Event,
    rec: Recorder,
    start: float,
) -> None:
    import openai

    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key=KEYS[index % 2], max_retries=0, timeout=600
    )
    rng = random.Random(index)
    plain = index % 10 == 9
    history: list[dict[str, str]] = []
    cursor = rng.randrange(0, max(1, len(text) - 4000))
    turn = 0
    while not stop.is_set():
        chunk = text[cursor : cursor + args.turn_chars]
        cursor = (cursor + args.turn_chars) % max(1, len(text) - args.turn_chars)
        messages = [
            {
                "role": "user",
                "content": f"Note {turn}: {chunk}\nReply with one short sentence.",
            }
        ]
        extra = None
        if not plain:
            history += messages
            messages, extra = list(history), {"conversation_id": f"load-{index}"}
        busy = _running_jobs(store) > 0
        sent = time.monotonic()
        status, ttft, usage, reply = 200, None, {}, ""
        try:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=args.max_tokens,
                temperature=0,
                stream=True,
                extra_body=extra,
                stream_options={"include_usage": True},
            )
            for event in stream:
                if ttft is None and event.choices and event.choices[0].delta.content:
                    ttft = time.monotonic() - sent
                if event.choices and event.choices[0].delta.content:
                    reply += event.choices[0].delta.content
                if getattr(event, "usage", None) is not None:
                    usage = event.usage.model_dump()
        except openai.APIStatusError as exc:
            status = exc.status_code
        except openai.APIConnectionError:
            status = -1
        physical = usage.get("physical_prompt_tokens")
        logical = usage.get("logical_prompt_tokens")
        kind = (
            "plain"
            if plain
            else (
                "compacted"
                if physical is not None and logical and physical < logical
                else "uncompacted"
            )
        )
        rec.add(
            session=index,
            turn=turn,
            t=sent - start,
            status=status,
            ttft=ttft,
            kind=kind,
            busy=busy,
            physical=physical,
            logical=logical or usage.get("prompt_tokens"),
        )
        if not plain:
            history.append({"role": "assistant", "content": reply or "Noted."})
            if (logical or 0) > args.max_logical:  # start over before the model window
                history, turn = [], -1
        turn += 1
        # a person reads the reply and types the next turn (exponential, mean --think-s)
        stop.wait(rng.expovariate(1.0 / args.think_s) if args.think_s > 0 else 0.0)


def kill_worker(store: Path) -> int | None:
    """SIGKILL a local worker: the pid from a running job's record, else any worker process."""
    import subprocess

    found = subprocess.run(
        ["pgrep", "-f", "vllm_compaction.service.worker"],
        capture_output=True,
        text=True,
    )
    pids = [int(p) for p in found.stdout.split()]
    if not pids:
        return None
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def check_store(store: Path) -> dict[str, Any]:
    """Every succeeded compaction's cache present and sound."""
    from vllm_compaction.cache import LocalDiskStore

    cache_store = LocalDiskStore(store)
    jobs = []
    for path in (store / "jobs").glob("cmp_*.json"):
        try:
            jobs.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    succeeded = [j for j in jobs if j["status"] == "succeeded"]
    missing = [j["id"] for j in succeeded if not cache_store.contains_id(j["id"])]
    broken = [
        j["id"]
        for j in succeeded
        if j["id"] not in missing and cache_store.verify_id(j["id"]) is not None
    ]
    return {
        "jobs": len(jobs),
        "succeeded": len(succeeded),
        "failed": sum(j["status"] == "failed" for j in jobs),
        "retried": sum(j.get("attempts", 0) > 1 for j in jobs),
        "missing_caches": missing,
        "corrupt_caches": broken,
        "temp_files": [p.name for p in store.rglob("*.tmp")],
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(rows), "status_counts": {}}
    for row in rows:
        out["status_counts"][str(row["status"])] = (
            out["status_counts"].get(str(row["status"]), 0) + 1
        )
    out["errors_5xx"] = sum(1 for r in rows if r["status"] >= 500)
    for kind in ("plain", "compacted", "uncompacted"):
        for busy in (False, True):
            ttfts = [
                r["ttft"]
                for r in rows
                if r["kind"] == kind and r["busy"] == busy and r["ttft"] is not None
            ]
            out[f"{kind}_{'busy' if busy else 'idle'}"] = {
                "n": len(ttfts),
                "ttft_p50_s": _percentile(ttfts, 0.5),
                "ttft_p99_s": _percentile(ttfts, 0.99),
                "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            }
    return out


def plot(rows: list[dict[str, Any]], kills: list[float], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    for kind, color in (
        ("plain", "tab:gray"),
        ("uncompacted", "tab:orange"),
        ("compacted", "tab:blue"),
    ):
        pts = [
            (r["t"], r["ttft"])
            for r in rows
            if r["kind"] == kind and r["ttft"] is not None
        ]
        if pts:
            ax.scatter(*zip(*pts), s=6, label=kind, color=color, alpha=0.6)
    for t in kills:
        ax.axvline(t, color="red", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds since start (red: worker killed)")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument(
        "--threshold",
        type=int,
        default=700,
        help="auto-compaction threshold (physical tokens)",
    )
    parser.add_argument(
        "--target-tokens", type=int, default=192, help="content slots per head kept"
    )
    parser.add_argument(
        "--method",
        default="am-highest-attn-fast",
        help="method of the automatic compactions",
    )
    parser.add_argument(
        "--think-s",
        type=float,
        default=20.0,
        help="mean pause of a session between a reply and its next turn (0: none)",
    )
    parser.add_argument("--turn-chars", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--max-logical",
        type=int,
        default=3000,
        help="a session starts over above this length",
    )
    parser.add_argument(
        "--kv-gib", type=float, default=2.0, help="the engine's KV cache (GiB)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "load.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoTokenizer

    from vllm_compaction.corpus import haystack_text
    from vllm_compaction.models import resolve
    from vllm_compaction.vllm.server_process import ServerProcess, cpu_engine_flags

    text = haystack_text(20_000, AutoTokenizer.from_pretrained(resolve(MODEL)), seed=3)
    root = Path(tempfile.mkdtemp(prefix="load-"))
    store = root / "store"
    server = ServerProcess(
        MODEL,
        [
            *cpu_engine_flags(
                kv_cache_bytes=int(args.kv_gib * (1 << 30)),
                max_num_seqs=min(args.sessions, 64),
            ),
            "--api-key",
            *KEYS,
            "--compaction-store",
            str(store),
            "--auto-compact-threshold-tokens",
            str(args.threshold),
            "--auto-compact-target-tokens",
            str(args.target_tokens),
            "--auto-compact-method",
            args.method,
        ],
        root / "server.log",
    )
    server.start()
    rec, stop, start = Recorder(), threading.Event(), time.monotonic()
    threads = [
        threading.Thread(
            target=session,
            args=(i, args, server.url, store, text, stop, rec, start),
            daemon=True,
        )
        for i in range(args.sessions)
    ]
    kills: list[float] = []
    try:
        for thread in threads:
            thread.start()
        duration = args.minutes * 60
        moments = [duration * (k + 1) / (args.kills + 1) for k in range(args.kills)]
        for moment in moments:
            time.sleep(max(0.0, start + moment - time.monotonic()))
            pid = kill_worker(store)
            kills.append(time.monotonic() - start)
            logger.info("killed worker pid %s at %.0f s", pid, kills[-1])
        time.sleep(max(0.0, start + duration - time.monotonic()))
        stop.set()
        for thread in threads:
            thread.join(timeout=900)
    finally:
        stop.set()
        server.stop()
    command = " ".join(
        ["python -m benchmarks.load", *(sys.argv[1:] if argv is None else argv)]
    )
    result = {
        "command": command,
        "args": {k: str(v) for k, v in vars(args).items()},
        "kills_s": kills,
        "summary": summarize(rec.rows),
        "store": check_store(store),
        "rows": rec.rows,
    }
    save_result(
        result, args.out, plot=lambda r, png: plot(r["rows"], r["kills_s"], png)
    )
    logger.info(
        "summary: %s",
        json.dumps({k: v for k, v in result["summary"].items()}, indent=1),
    )
    logger.info("store: %s", result["store"])
    return result


if __name__ == "__main__":
    main()
