"""Local compaction workers started by the server, and the lease clock of the job book.

The supervisor runs on the server's event loop: it starts ``local_workers`` worker processes
(``python -m vllm_compaction.service.worker``), fails the job of a worker that exits at once
(no need to wait for its lease), restarts it, and expires the leases of remote workers.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import subprocess
import sys
import time

from vllm_compaction.service.service import CompactionService
from vllm_compaction.service.worker import TOKEN_ENV, describe_exit, worker_id_for

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)

_CRASH_WINDOW_S = 30.0
_MAX_QUICK_CRASHES = 5


class Supervisor:
    def __init__(self, service: CompactionService, server_url: str, count: int) -> None:
        self.service = service
        self.server_url = server_url
        self.count = count
        self.processes: list[tuple[subprocess.Popen, float]] = []
        self._quick_crashes = 0
        self._task: asyncio.Task | None = None
        atexit.register(self.stop)

    def start(self) -> None:
        for _ in range(self.count):
            self.processes.append(self._spawn())
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def _spawn(self) -> tuple[subprocess.Popen, float]:
        env = {**os.environ, TOKEN_ENV: self.service.worker_token}
        cmd = [
            sys.executable,
            "-m",
            "vllm_compaction.service.worker",
            "--server",
            self.server_url,
            "--device",
            self.service.config.device,
            "--die-with-parent",
        ]
        # its own server, on loopback: no certificate names it
        if self.server_url.startswith("https://127.0.0.1"):
            cmd.append("--no-verify-tls")
        process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        logger.info(
            "started compaction worker pid %d for %s", process.pid, self.server_url
        )
        return process, time.monotonic()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                self._check()
            # a full disk, say: log it and keep watching, never end the task
            except Exception:
                logger.exception(
                    "compaction supervisor: checking leases and workers failed"
                )

    def _check(self) -> None:
        """Lapsed leases and deadlines, then the local workers: a dead one has its job retried or
        failed, and is restarted unless it keeps dying at once."""
        self.service.book.expire_leases()
        alive = []
        for process, started in self.processes:
            code = process.poll()
            if code is None:
                alive.append((process, started))
                continue
            how = describe_exit(code)
            self.service.book.fail_worker(
                worker_id_for(process.pid),
                f"the compaction worker (pid {process.pid}) {how}",
            )
            quick = time.monotonic() - started < _CRASH_WINDOW_S
            self._quick_crashes = self._quick_crashes + 1 if quick else 0
            if self._quick_crashes > _MAX_QUICK_CRASHES:
                logger.error(
                    "compaction worker pid %d %s; %d quick crashes in a row, not restarting "
                    "it (see its log above)",
                    process.pid,
                    how,
                    self._quick_crashes,
                )
                continue
            logger.warning(
                "compaction worker pid %d %s; restarting it", process.pid, how
            )
            alive.append(self._spawn())
        self.processes = alive
        self.service.metrics.workers_alive(len(alive))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for process, _ in self.processes:
            if process.poll() is None:
                process.terminate()
        for process, _ in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
        self.processes = []
