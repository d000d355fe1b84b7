"""Durable small files of the service: job records, conversations, the worker token, the lock.

A record is written to a temporary file in its directory, fsynced, renamed over the old one, and
the directory is fsynced: after a crash (or power loss) a reader sees the old record or the new
one, never a truncated one. A record that cannot be read anyway (a disk error, a hand edit) is
moved to ``quarantine/`` beside the store's other quarantined files and reported, never silently
dropped.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

__all__ = ["StoreLock", "quarantine", "write_atomically"]

logger = logging.getLogger(__name__)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str, *, mode: int = 0o644) -> None:
    """Replace ``path`` by ``text`` durably (temp file, fsync, rename, fsync of the directory).
    On an error (a full disk) the old file stays and the temp file is removed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def quarantine(path: Path, quarantine_root: Path, reason: str) -> Path:
    """Move an unreadable record into ``quarantine_root`` (keeping its name) and log why."""
    quarantine_root.mkdir(parents=True, exist_ok=True)
    target = quarantine_root / path.name
    os.replace(path, target)
    logger.warning(
        "quarantined unreadable record %s (%s); moved to %s", path.name, reason, target
    )
    return target


class StoreLock:
    """An exclusive lock on a store directory for one server process.

    Two servers on one store would each run a job book over the same files (two workers could
    run one job, one server's cleanup could delete the other's cache), so the second refuses to
    start. The lock is an ``flock`` on ``<store>/server.lock``: the kernel releases it when the
    process dies, so a killed server never leaves a stale lock behind.
    """

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / "server.lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (
                os.pread(self._fd, 32, 0).decode(errors="replace").strip()
                or "another process"
            )
            os.close(self._fd)
            raise ValueError(
                f"the compaction store {root} is in use by another server (pid {holder}); give "
                f"each server its own --compaction-store (and run vLLM with --api-server-count 1, "
                f"since the job book lives in one process)"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
