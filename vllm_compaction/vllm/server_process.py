"""Run ``vllm-compaction serve`` as a child process (tests, benchmarks, scripts)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from vllm_compaction.service.worker import NETWORK_ERRORS

__all__ = ["ServerProcess", "cpu_engine_flags", "free_port"]


def cpu_engine_flags(
    *, max_model_len: int = 4096, kv_cache_bytes: int = 1 << 30, max_num_seqs: int = 8
) -> list[str]:
    """The engine flags of the CPU test and benchmark servers: fp32, eager (no compile wait),
    a fixed KV budget and seed, so runs compare."""
    return [
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        "0",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``vllm-compaction serve MODEL --host 127.0.0.1 --port <free> *flags``, logging to ``log_path``.

    ``stop`` ends the whole process group (API server, engine core, local workers).
    """

    def __init__(self, model: str, flags: Sequence[str], log_path: str | Path) -> None:
        self.model, self.flags, self.log_path = model, list(flags), Path(log_path)
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> None:
        cmd = [
            sys.executable,
            "-m",
            "vllm_compaction.cli",
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.flags,
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(
                    f"{self.url}/health", timeout=2
                ) as response:
                    if response.status == 200:
                        return
            except NETWORK_ERRORS:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(
            f"the server did not come up in {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log_tail(self, n: int = 60) -> str:
        lines = (
            self.log_path.read_text(errors="replace").splitlines()
            if self.log_path.exists()
            else []
        )
        return "\n".join(lines[-n:])
