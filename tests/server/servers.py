"""The test server's settings and polling helpers."""

from __future__ import annotations

import os
import time
from pathlib import Path

from vllm_compaction.vllm.server_process import ServerProcess, cpu_engine_flags

API_KEYS = ("key-a", "key-b")
MODEL = "smollm2-135m"
AUTO_THRESHOLD_TOKENS = 500


def compaction_server(store: Path, log_path: Path) -> ServerProcess:
    """SmolLM2 with two API keys and auto-compaction above 500 tokens."""
    return ServerProcess(
        MODEL,
        [
            *cpu_engine_flags(),
            "--api-key",
            *API_KEYS,
            "--compaction-store",
            str(store),
            "--compaction-worker-lease-s",
            "20",
            "--auto-compact-threshold-tokens",
            str(AUTO_THRESHOLD_TOKENS),
            "--auto-compact-ratio",
            "0.25",
            "--auto-compact-method",
            "am-highest-attn",
            "--auto-compact-queries",
            "repeat-prefill",
        ],
        log_path,
    )


def open_server(
    store: Path, log_path: Path, *, store_max_bytes: int, serving_hold_s: float
) -> ServerProcess:
    """SmolLM2 without ``--api-key`` and with a store limit."""
    return ServerProcess(
        MODEL,
        [
            *cpu_engine_flags(),
            "--compaction-store",
            str(store),
            "--compaction-store-max-bytes",
            str(store_max_bytes),
            "--compaction-serving-hold-s",
            str(serving_hold_s),
        ],
        log_path,
    )


def wait_status(
    client, compaction_id: str, statuses: tuple[str, ...], timeout_s: float = 300.0
) -> dict:
    """Poll ``GET /v1/compact/{id}`` until its status is one of ``statuses``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/compact/{compaction_id}", cast_to=object)
        if job["status"] in statuses:
            return job
        time.sleep(0.25)
    raise TimeoutError(
        f"compaction {compaction_id} never reached {statuses} in {timeout_s:.0f} s"
    )


def wait_finished(client, compaction_id: str, timeout_s: float = 600.0) -> dict:
    return wait_status(
        client, compaction_id, ("succeeded", "failed", "cancelled"), timeout_s
    )


def all_compactions(client) -> list[dict]:
    """Every compaction the client's key sees, page after page (the list is paginated)."""
    jobs: list[dict] = []
    query = "limit=100"
    while True:
        page = client.get(f"/compact?{query}", cast_to=object)
        jobs += page["data"]
        if not page["has_more"]:
            return jobs
        query = f"limit=100&after={page['last_id']}"


def store_of(server: ServerProcess) -> Path:
    """The server's compaction store (its ``--compaction-store`` flag)."""
    return Path(server.flags[server.flags.index("--compaction-store") + 1])


def job_record(server: ServerProcess, compaction_id: str) -> dict:
    """The server's own record of a job, as stored (clients are not told its worker)."""
    import json

    return json.loads((store_of(server) / "jobs" / f"{compaction_id}.json").read_text())


def worker_pid(server: ServerProcess, compaction_id: str) -> int:
    """The pid of the local worker running the job (its id ends in ``:<pid>``)."""
    return int(job_record(server, compaction_id)["worker_id"].rsplit(":", 1)[1])


def compute_child(worker_pid: int) -> int:
    """The worker's compute process (multiprocessing spawn child holding the model)."""
    children = (
        Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    )
    for pid in map(int, children):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"worker {worker_pid} has no compute child among {children}")


def local_workers(server: ServerProcess) -> list[int]:
    """The pids of the server's local worker processes (its session's, by command line)."""
    assert server.process is not None
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            session = os.getsid(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
        if (
            b"vllm_compaction.service.worker" in cmdline
            and session == server.process.pid
        ):
            pids.append(int(entry.name))
    return pids
