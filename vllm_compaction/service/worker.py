"""``vllm-compaction worker``: claims jobs from a server, computes caches, uploads them.

Protocol (HTTP + JSON under ``/compaction/worker/v1``, bearer worker token): ``GET info`` (the
model and its fingerprint), ``POST claim`` (204 when idle), ``POST jobs/{id}/heartbeat`` every
``heartbeat_s`` (renews the lease; answers ``cancel`` when the job was cancelled), ``PUT
jobs/{id}/result`` (the safetensors file), ``POST jobs/{id}/fail``.

The worker computes its own reference queries and keys/values with the model adapters (the
same forward pass yields both, so an engine KV snapshot would save nothing). Computation runs in
a child process that keeps the model loaded; cancelling a job, or the child dying (e.g. out of
memory), kills and restarts that child while the worker keeps its connection to the server.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import queue
import socket
import ssl
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_compaction.service.protocol import WorkerInfo, WorkerJob

__all__ = ["Worker", "WorkerError", "main"]

logger = logging.getLogger("vllm_compaction.worker")

TOKEN_ENV = "VLLM_COMPACTION_WORKER_TOKEN"
DEVICE_ENV = "VLLM_COMPACTION_DEVICE"
"""Default of a worker's ``--device`` (the server passes its ``--compaction-device`` to local workers)."""
NETWORK_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError)
"""What a call to an unreachable or vanished server raises."""
UPLOAD_ATTEMPTS = 4


def worker_id_for(pid: int) -> str:
    """A worker's id: ``host:pid`` (the supervisor derives it for the processes it starts)."""
    return f"{socket.gethostname()}:{pid}"


def describe_exit(code: int | None) -> str:
    """A process exit code as words: "was killed by signal 9" / "exited with code 1"."""
    return (
        f"was killed by signal {-code}"
        if code is not None and code < 0
        else f"exited with code {code}"
    )


class WorkerError(Exception):
    """The worker cannot go on (bad token, other model, server gone)."""


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so no worker outlives its server."""
    try:
        import ctypes
        import signal

        # PR_SET_PDEATHSIG
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    # not Linux: the supervisor's atexit still terminates its workers on shutdown
    except Exception:
        pass


# ---------------------------------------------------------------------- compute child
def _compute_main(
    model_path: str, nice: int, device: str, jobs: mp.Queue, events: mp.Queue
) -> None:
    _die_with_parent()
    if nice:
        # requests in the engine come first; compaction takes the idle cycles
        os.nice(nice)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s compute %(levelname)s %(message)s"
    )
    from vllm_compaction.models import load_adapter
    from vllm_compaction.pipeline import compact

    try:
        adapter = load_adapter(model_path, device=device)
    except (
        ValueError
    ) as exc:  # a device this host does not have: every job would fail the same way
        events.put(("fatal", str(exc)))
        return
    events.put(("ready", None))
    while True:
        item = jobs.get()
        if item is None:
            return
        job, out_path = WorkerJob.model_validate(item[0]), item[1]
        try:
            cache = compact(
                adapter,
                job.messages,
                ratio=job.ratio,
                target_tokens=job.target_tokens,
                method=job.method,
                queries=job.queries,
                keep_last_tokens=job.keep_last_tokens,
                max_head_ratio=job.max_head_ratio,
                min_layer_share=job.min_layer_share,
                summarize=job.summarize,
                summary_tokens=job.summary_tokens,
                on_progress=lambda f: events.put(("progress", f)),
            )
            cache.save(out_path)
            events.put(("done", out_path))
        except Exception as exc:  # reported to the server as the job's failure reason
            logger.exception("compaction %s failed", job.id)
            events.put(("error", f"{type(exc).__name__}: {exc}"))


class ComputeProcess:
    """A child process with the model loaded, running one job at a time."""

    def __init__(self, model_path: str, nice: int = 10, device: str = "cpu") -> None:
        self.model_path, self.nice, self.device = model_path, nice, device
        self._ctx = mp.get_context("spawn")
        self._start()

    def _start(self) -> None:
        self.jobs, self.events = self._ctx.Queue(), self._ctx.Queue()
        self.process = self._ctx.Process(
            target=_compute_main,
            args=(self.model_path, self.nice, self.device, self.jobs, self.events),
            daemon=True,
            name="compaction-compute",
        )
        self.process.start()
        self._ready = False

    @property
    def ready(self) -> bool:
        return self._ready

    def restart(self) -> None:
        self.kill()
        self._start()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)

    def submit(self, job: WorkerJob, out_path: str) -> None:
        self.jobs.put((job.model_dump(), out_path))

    def next_event(self, timeout: float) -> tuple[str, Any] | None:
        """The next event, None on timeout; ("died", reason) if the child is gone."""
        try:
            kind, value = self.events.get(timeout=timeout)
        except queue.Empty:
            if not self.process.is_alive():
                code = self.process.exitcode
                hint = " (out of memory?)" if code == -9 else ""
                return "died", f"the compaction process {describe_exit(code)}{hint}"
            return None
        if kind == "ready":
            self._ready = True
            return self.next_event(timeout)
        if kind == "fatal":
            raise WorkerError(value)
        return kind, value


# ---------------------------------------------------------------------- the worker
class Worker:
    def __init__(
        self,
        server: str,
        token: str,
        *,
        model: str | None = None,
        nice: int = 10,
        connect_timeout_s: float = 600.0,
        device: str = "auto",
        verify_tls: bool = True,
    ) -> None:
        self.server = server.rstrip("/")
        self.token = token
        # a local worker reaches its own server on the loopback address, which no certificate names
        self._tls = None if verify_tls else ssl._create_unverified_context()
        self.worker_id = worker_id_for(os.getpid())
        self.info = self._connect(connect_timeout_s)
        self.model_path = model or self.info.model
        self._check_model()
        from vllm_compaction.models import resolve_device

        try:
            device = str(resolve_device(device))
        except ValueError as exc:
            raise WorkerError(str(exc)) from None
        self.compute = ComputeProcess(self.model_path, nice, device)
        self.tmpdir = Path(tempfile.mkdtemp(prefix="vllm-compaction-worker-"))

    # ---------------------------------------------------------------- HTTP
    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, Any]:
        url = f"{self.server}/compaction/worker/v1{path}"
        all_headers = {"Authorization": f"Bearer {self.token}", **(headers or {})}
        if body is not None:
            data = json.dumps(body).encode()
            all_headers["Content-Type"] = "application/json"
        request = urllib.request.Request(
            url, data=data, method=method, headers=all_headers
        )
        try:
            with urllib.request.urlopen(
                request, timeout=timeout, context=self._tls
            ) as response:
                raw = response.read()
                return response.status, (json.loads(raw) if raw else None)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if exc.code == 401:
                raise WorkerError(
                    f"the server at {self.server} refused the worker token"
                ) from None
            return exc.code, detail

    def _connect(self, timeout_s: float) -> WorkerInfo:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status, body = self._call("GET", "/info")
                if status == 200:
                    return WorkerInfo.model_validate(body)
                raise WorkerError(
                    f"the server at {self.server} answered {status}: {body}"
                )
            except NETWORK_ERRORS as exc:
                if time.monotonic() > deadline:
                    raise WorkerError(
                        f"no compaction server at {self.server} after {timeout_s:.0f} s: {exc}"
                    ) from None
                time.sleep(1.0)

    def _check_model(self) -> None:
        from vllm_compaction.cache import CacheMismatchError, ModelFingerprint
        from vllm_compaction.models.fingerprint import checkpoint_fingerprint

        folder = Path(self.model_path)
        if not (folder / "config.json").is_file():
            raise WorkerError(
                f"the model folder {folder} does not exist here; give --model with a copy of "
                f"the checkpoint the server serves"
            )
        served = ModelFingerprint.from_dict(self.info.fingerprint)
        mine = checkpoint_fingerprint(folder, dtype=served.dtype)
        try:
            served.check_compatible(mine)
        except CacheMismatchError as exc:
            raise WorkerError(
                f"{folder} is not the checkpoint the server serves: {exc}"
            ) from None

    # ---------------------------------------------------------------- jobs
    def run(self, max_jobs: int | None = None) -> None:
        done = 0
        logger.info(
            "worker %s serving %s for %s", self.worker_id, self.model_path, self.server
        )
        while max_jobs is None or done < max_jobs:
            try:
                status, body = self._call(
                    "POST", "/claim", {"worker_id": self.worker_id, "wait_s": 10.0}
                )
            except NETWORK_ERRORS as exc:
                logger.warning("server unreachable (%s); retrying", exc)
                time.sleep(2.0)
                continue
            if status == 204 or body is None:
                continue  # the server held the claim for wait_s
            if status != 200:
                logger.warning("claim answered %s: %s", status, body)
                time.sleep(2.0)
                continue
            self._run_job(WorkerJob.model_validate(body))
            done += 1

    def _run_job(self, job: WorkerJob) -> None:
        out_path = self.tmpdir / f"{job.id}.safetensors"
        logger.info(
            "compaction %s: %d messages, method %s",
            job.id,
            len(job.messages),
            job.method,
        )
        self.compute.submit(job, str(out_path))
        progress, stage, last_beat = (
            0.0,
            "prefill" if self.compute.ready else "loading model",
            0.0,
        )
        while True:
            try:
                event = self.compute.next_event(timeout=self.info.heartbeat_s)
            except WorkerError as exc:  # the compute process cannot run any job here
                self._fail(job, str(exc))
                raise
            if event is not None:
                kind, value = event
                if kind == "progress":
                    progress, stage = float(value), "compacting layers"
                elif kind == "done":
                    self._upload(job, Path(value))
                    return
                else:  # "error" or "died"
                    self._fail(job, value, retryable=kind == "died")
                    if kind == "died":
                        self.compute.restart()
                    return
            if time.monotonic() - last_beat >= self.info.heartbeat_s:
                last_beat = time.monotonic()
                if not self._heartbeat(job, progress, stage):
                    logger.info("compaction %s was cancelled; stopping it", job.id)
                    self.compute.restart()
                    return

    def _heartbeat(self, job: WorkerJob, progress: float, stage: str | None) -> bool:
        try:
            status, body = self._call(
                "POST",
                f"/jobs/{job.id}/heartbeat",
                {
                    "worker_id": self.worker_id,
                    "progress": min(1.0, progress),
                    "stage": stage,
                },
                headers={"X-Job-Token": job.token},
            )
        except NETWORK_ERRORS:
            return True  # a blip: the lease is longer than one heartbeat
        # a 5xx is the server's trouble (a full disk), not a reason to drop the job
        if status >= 500:
            return True
        return status == 200 and body.get("action") == "continue"

    def _upload(self, job: WorkerJob, path: Path) -> None:
        """Upload the cache, heartbeating meanwhile (a large cache takes longer than a lease).
        A network error is retried with backoff; after the last try the job's lease lapses and
        the server runs it again, while this worker goes on to the next job."""
        stop = threading.Event()
        beats = threading.Thread(
            target=self._beat_until,
            args=(job, stop),
            daemon=True,
            name="upload-heartbeat",
        )
        beats.start()
        try:
            for attempt in range(UPLOAD_ATTEMPTS):
                try:
                    status, body = self._call(
                        "PUT",
                        f"/jobs/{job.id}/result",
                        data=path.read_bytes(),
                        headers={
                            "Content-Type": "application/octet-stream",
                            "X-Worker-Id": self.worker_id,
                            "X-Job-Token": job.token,
                        },
                        timeout=600.0,
                    )
                    break
                except NETWORK_ERRORS as exc:
                    if attempt + 1 == UPLOAD_ATTEMPTS:
                        logger.warning(
                            "compaction %s: the upload failed %d times (%s); leaving it to the "
                            "server's retry",
                            job.id,
                            UPLOAD_ATTEMPTS,
                            exc,
                        )
                        return
                    logger.warning(
                        "compaction %s: upload failed (%s); retrying", job.id, exc
                    )
                    time.sleep(2.0**attempt)
            if status == 200:
                logger.info(
                    "compaction %s stored: %s tokens -> %s",
                    job.id,
                    body.get("original_tokens"),
                    body.get("compacted_tokens"),
                )
            else:
                logger.warning(
                    "compaction %s: upload answered %s: %s", job.id, status, body
                )
        finally:
            stop.set()
            beats.join(timeout=30)
            path.unlink(missing_ok=True)

    def _beat_until(self, job: WorkerJob, stop: threading.Event) -> None:
        while not stop.wait(self.info.heartbeat_s):
            self._heartbeat(job, 1.0, "uploading")

    def _fail(self, job: WorkerJob, reason: str, *, retryable: bool = False) -> None:
        """Report the job failed; ``retryable`` when the computation died rather than failed
        (killed, out of memory), which the server may run again."""
        logger.warning("compaction %s failed: %s", job.id, reason)
        try:
            self._call(
                "POST",
                f"/jobs/{job.id}/fail",
                {
                    "worker_id": self.worker_id,
                    "error": reason[:4000],
                    "retryable": retryable,
                },
                headers={"X-Job-Token": job.token},
            )
        except NETWORK_ERRORS:
            pass  # the lease lapses and the server fails the job itself

    def close(self) -> None:
        self.compute.kill()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-compaction worker",
        description="Run compaction jobs for a vllm-compaction server.",
    )
    parser.add_argument(
        "--server", required=True, help="base URL of the server, e.g. http://host:8000"
    )
    parser.add_argument(
        "--token",
        default=None,
        help=f"worker token (default ${TOKEN_ENV}, or the "
        "worker-token file of --store)",
    )
    parser.add_argument(
        "--store", default=None, help="the server's store directory (to read its token)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="local copy of the served checkpoint (default: "
        "the server's path, valid on the same host)",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=10,
        help="niceness of the computation (default 10: "
        "serving on the same host keeps priority)",
    )
    parser.add_argument(
        "--device",
        default=os.environ.get(DEVICE_ENV, "auto"),
        help="where the model and every stage of a compaction run: cpu, cuda, cuda:N or auto "
        f"(default ${DEVICE_ENV}, else auto: cuda when a GPU is visible)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the server to come up (default 600)",
    )
    # local workers only
    parser.add_argument("--no-verify-tls", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-jobs", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--die-with-parent", action="store_true", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s"
    )
    if args.die_with_parent:
        _die_with_parent()
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token and args.store:
        token_file = Path(args.store) / "worker-token"
        token = token_file.read_text().strip() if token_file.is_file() else None
    if not token:
        print(
            f"vllm-compaction worker: no worker token: pass --token, set {TOKEN_ENV}, or --store with the "
            f"server's store directory",
            file=sys.stderr,
        )
        return 2
    try:
        worker = Worker(
            args.server,
            token,
            model=args.model,
            nice=args.nice,
            connect_timeout_s=args.connect_timeout,
            device=args.device,
            verify_tls=not args.no_verify_tls,
        )
    except WorkerError as exc:
        print(f"vllm-compaction worker: {exc}", file=sys.stderr)
        return 2
    try:
        worker.run(max_jobs=args.max_jobs)
    except WorkerError as exc:
        print(f"vllm-compaction worker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
