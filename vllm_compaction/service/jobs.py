"""The job book: every compaction job, its state machine, worker leases and persistence.

One JSON file per job under ``<store>/jobs/`` (written durably: ``files.write_atomically``), so a
restarted server finds its compactions again; jobs that were queued or running when it stopped
are queued again, and an unreadable record is quarantined and reported.

Work is bounded and fair: a queue limit and a per-key limit (429 with a retry hint), workers take
the queued job of the key served longest ago (round-robin across keys, oldest first within one),
and a client's ``Idempotency-Key`` makes a retried submission return the job it already made.

States: queued -> running -> succeeded | failed; queued | running -> cancelled. A running job
belongs to one worker under a lease that each heartbeat renews. A claim counts once the worker's
first heartbeat acknowledges it: a job handed to a worker that has gone goes back to the queue
as if never claimed. A lapsed lease or a worker that exits puts the job back in the queue after a
backoff, up to ``max_attempts`` runs, then fails it with the reason; a job still running past
``deadline_s`` fails (its worker is told to stop at its next heartbeat and kills the computation).
Nothing here touches the engine or the cache store.
"""

from __future__ import annotations

import builtins
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field

from vllm_compaction.service.files import quarantine, write_atomically
from vllm_compaction.service.protocol import Compaction, JobStatus, WorkerJob

__all__ = ["JobBook", "JobRecord", "JobError", "new_compaction_id"]

logger = logging.getLogger(__name__)


class JobError(Exception):
    """A request about a job that cannot be honoured; ``status`` is the HTTP status to answer,
    ``param`` the request field at fault (if one is), ``retry_after`` seconds for a 429."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.retry_after = status, param, retry_after


def new_compaction_id() -> str:
    """Unguessable id (128 random bits) that is also a valid store entry id."""
    return "cmp_" + secrets.token_hex(16)


class JobRecord(Compaction):
    """A job as the server keeps it: the public object plus what only the server sees."""

    owner: str = ""
    submitted_at: float = Field(default_factory=time.time)
    messages: list[dict[str, str]] = Field(default_factory=list)
    lease_expires: float | None = None
    digest: str | None = (
        None  # tensors sha256 of the stored cache (names the prefix for vLLM)
    )
    idempotency_key: str | None = (
        None  # the client's, with the digest of the body it came with
    )
    request_digest: str | None = None
    acked: bool = False  # the claiming worker has heartbeated since the claim
    claim_token: str | None = (
        None  # the claiming worker's secret for this job (never shown to clients)
    )
    auto: bool = False  # queued by the server's auto-compaction, not by a client
    not_before: float | None = None  # a retried job waits for its backoff

    def public(self) -> Compaction:
        """What a client sees: no worker identity (the hosts and processes behind the server)."""
        return Compaction.model_validate(
            self.model_dump(include=set(Compaction.model_fields) - {"worker_id"})
        )

    def worker_job(self) -> WorkerJob:
        return WorkerJob(
            id=self.id,
            messages=self.messages,
            ratio=self.ratio_requested,
            target_tokens=self.target_tokens,
            method=self.method,
            queries=self.queries,
            keep_last_tokens=self.keep_last_tokens,
            max_head_ratio=self.max_head_ratio or 1.0,
            min_layer_share=self.min_layer_share or 0.0,
            summarize=self.summarize,
            summary_tokens=self.summary_tokens,
            token=self.claim_token or "",
        )

    def token_matches(self, token: str) -> bool:
        """Whether ``token`` is this running job's claim secret (constant time)."""
        if not self.claim_token:
            return False
        return secrets.compare_digest(token.encode(), self.claim_token.encode())


class JobBook:
    """Thread-safe registry of jobs, persisted under ``root``.

    ``on_change(record)`` is called after every state change, outside the lock, for metrics and
    conversation bookkeeping. Leases lapse only when ``expire_leases`` runs: the server's
    supervisor calls it on its clock.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        lease_s: float = 15.0,
        on_change: Callable[[JobRecord], None] | None = None,
        max_queued: int | None = None,
        max_queued_per_owner: int | None = None,
        quarantine_root: Path | None = None,
        deadline_s: float | None = None,
        max_attempts: int = 1,
        retry_backoff_s: float = 5.0,
        ack_s: float | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lease_s = lease_s
        self.deadline_s, self.max_attempts, self.retry_backoff_s = (
            deadline_s,
            max_attempts,
            retry_backoff_s,
        )
        self.ack_s = ack_s if ack_s is not None else lease_s
        self.max_queued, self.max_queued_per_owner = max_queued, max_queued_per_owner
        self.quarantine_root = quarantine_root or self.root / "quarantine"
        self.quarantined: list[str] = []  # records found unreadable at start-up
        self._on_change = on_change
        self._lock = threading.RLock()
        self._jobs: dict[str, JobRecord] = {}
        self._served: dict[
            str, float
        ] = {}  # owner -> when a worker last took one of its jobs
        self._load()

    # ------------------------------------------------------------------ client side
    def submit(self, record: JobRecord) -> JobRecord:
        """Queue ``record`` (saved before it is visible). With an idempotency key already used
        by its owner: the job made then (the same body) or a 409 (another body). Over a queue
        limit: 429 with a retry hint, and nothing queued."""
        with self._lock:
            if record.idempotency_key is not None:
                earlier = next(
                    (
                        r
                        for r in self._jobs.values()
                        if r.owner == record.owner
                        and r.idempotency_key == record.idempotency_key
                    ),
                    None,
                )
                if earlier is not None:
                    if earlier.request_digest != record.request_digest:
                        raise JobError(
                            409,
                            "this Idempotency-Key was used for another request body",
                            param="Idempotency-Key",
                        )
                    return earlier
            self._check_room(record.owner)
            self._save(record)  # a failed save (full disk) leaves nothing half-made
            self._jobs[record.id] = record
        self._changed(record)
        return record

    def check_room(self, owner: str) -> None:
        """JobError 429 if ``owner`` (or the server) has as many jobs queued as it may."""
        with self._lock:
            self._check_room(owner)

    def _check_room(self, owner: str) -> None:
        queued = [r for r in self._jobs.values() if r.status == JobStatus.queued]
        mine = sum(r.owner == owner for r in queued)
        if self.max_queued_per_owner is not None and mine >= self.max_queued_per_owner:
            raise JobError(
                429,
                f"this API key has {mine} compactions queued, the most one key may have; "
                f"retry when some have run",
                retry_after=self._retry_hint(mine),
            )
        if self.max_queued is not None and len(queued) >= self.max_queued:
            raise JobError(
                429,
                f"{len(queued)} compactions are queued, the most this server takes; retry later",
                retry_after=self._retry_hint(len(queued)),
            )

    def _retry_hint(self, ahead: int) -> float:
        """Seconds until a place is likely free: the mean run time of recent jobs per job ahead
        of one in the queue, at least 1 s (10 s per job before any has finished)."""
        runs = [
            r.timings["run_s"] for r in self._jobs.values() if r.timings.get("run_s")
        ]
        mean = sum(runs[-20:]) / len(runs[-20:]) if runs else 10.0
        return max(1.0, round(mean))

    def get(self, job_id: str, owner: str | None = None) -> JobRecord:
        """The job, or JobError 404 (also for another owner's job: ids do not leak)."""
        with self._lock:
            record = self._jobs.get(job_id)
            if record is None or (owner is not None and record.owner != owner):
                raise JobError(404, f"No compaction with id {job_id!r}.")
            return record

    def list(self, owner: str | None = None) -> list[JobRecord]:
        """``owner``'s jobs (everyone's for ``None``), oldest first."""
        with self._lock:
            return sorted(
                (r for r in self._jobs.values() if owner is None or r.owner == owner),
                key=lambda r: (r.submitted_at, r.id),
            )

    def page(
        self, owner: str, *, after: str | None = None, limit: int | None = None
    ) -> tuple[builtins.list[JobRecord], bool]:
        """``owner``'s jobs from the one after ``after`` on, at most ``limit``, and whether more
        follow. An ``after`` that is not one of the owner's jobs is a 404."""
        records = self.list(owner)
        if after is not None:
            ids = [r.id for r in records]
            if after not in ids:
                raise JobError(404, f"No compaction with id {after!r}.", param="after")
            records = records[ids.index(after) + 1 :]
        if limit is None:
            return records, False
        return records[:limit], len(records) > limit

    def counts(self) -> dict[JobStatus, int]:
        with self._lock:
            out = {s: 0 for s in JobStatus}
            for r in self._jobs.values():
                out[r.status] += 1
            return out

    def active_for_conversation(
        self, conversation_id: str, owner: str
    ) -> JobRecord | None:
        with self._lock:
            for r in self._jobs.values():
                if (
                    r.conversation_id == conversation_id
                    and r.owner == owner
                    and r.status in (JobStatus.queued, JobStatus.running)
                ):
                    return r
        return None

    def cancel(self, job_id: str, owner: str | None = None) -> JobRecord:
        """Cancel a queued or running job (a running worker stops at its next heartbeat)."""
        with self._lock:
            record = self.get(job_id, owner)
            if record.status.finished:
                raise JobError(
                    409, f"Compaction {job_id!r} already {record.status.value}."
                )
            self._finish(record, JobStatus.cancelled, error="cancelled by the client")
        self._changed(record)
        return record

    def cancel_or_delete(
        self, job_id: str, owner: str | None = None
    ) -> tuple[JobRecord, bool]:
        """Cancel the job if it is queued or running, else forget it: one step under the lock,
        so a job finishing meanwhile is deleted, never answered 409. -> (job, deleted)."""
        with self._lock:
            record = self.get(job_id, owner)
            if record.status.finished:
                return self.delete(job_id, owner), True
            self._finish(record, JobStatus.cancelled, error="cancelled by the client")
        self._changed(record)  # outside the lock, as every transition's hook
        return record, False

    def delete(self, job_id: str, owner: str | None = None) -> JobRecord:
        """Forget a finished job (the caller removes its store entry)."""
        with self._lock:
            record = self.get(job_id, owner)
            if not record.status.finished:
                raise JobError(
                    409,
                    f"Compaction {job_id!r} is {record.status.value}; cancel it first.",
                )
            del self._jobs[job_id]
            (self.root / f"{job_id}.json").unlink(missing_ok=True)
        return record

    # ------------------------------------------------------------------ worker side
    def claim(self, worker_id: str) -> JobRecord | None:
        """Give a queued job to ``worker_id`` under a fresh lease: the oldest job of the key with
        the fewest running jobs, served longest ago (one key's thousand submissions cannot starve
        another key's single one)."""
        with self._lock:
            now = time.time()
            queued = [
                r
                for r in self._jobs.values()
                if r.status == JobStatus.queued and (r.not_before or 0.0) <= now
            ]
            if not queued:
                return None
            running: dict[str, int] = {}
            for r in self._jobs.values():
                if r.status == JobStatus.running:
                    running[r.owner] = running.get(r.owner, 0) + 1
            record = min(
                queued,
                key=lambda r: (
                    running.get(r.owner, 0),
                    self._served.get(r.owner, 0.0),
                    r.submitted_at,
                    r.id,
                ),
            )
            before = record.model_copy(deep=True)
            record.status, record.worker_id, record.started_at = (
                JobStatus.running,
                worker_id,
                now,
            )
            record.lease_expires, record.acked, record.not_before = (
                now + self.ack_s,
                False,
                None,
            )
            record.claim_token = secrets.token_urlsafe(24)
            record.attempts += 1
            record.progress, record.stage = 0.0, "starting"
            record.timings["queued_s"] = now - record.submitted_at
            self._commit(record, before)
            # a claim the disk refused leaves the key's turn where it was
            self._served[record.owner] = now
        self._changed(record)
        return record

    def heartbeat(
        self, job_id: str, worker_id: str, progress: float, stage: str | None
    ) -> bool:
        """Renew the lease; False if the worker must stop (cancelled, failed or not its job)."""
        with self._lock:
            record = self._owned(job_id, worker_id)
            if record is None:
                return False
            record.progress, record.stage = progress, stage
            record.lease_expires = time.time() + self.lease_s
            if not record.acked:  # the claim reached a live worker
                record.acked = True
                try:
                    self._save(record)
                except OSError as exc:
                    # the lease is renewed in memory all the same; the acknowledgement only
                    # matters after a restart, and the next write of the record carries it
                    logger.warning(
                        "job %s: acknowledgement not written: %s", job_id, exc
                    )
            return True

    def running_for(self, worker_id: str) -> JobRecord | None:
        with self._lock:
            return next(
                (
                    r
                    for r in self._jobs.values()
                    if r.status == JobStatus.running and r.worker_id == worker_id
                ),
                None,
            )

    def succeed(self, job_id: str, worker_id: str, result: dict[str, Any]) -> JobRecord:
        with self._lock:
            record = self._owned(job_id, worker_id)
            if record is None:
                raise JobError(
                    409,
                    f"Compaction {job_id!r} is not running on worker {worker_id!r}.",
                )
            for key, value in result.items():
                setattr(record, key, value)
            # a retried job's earlier death is history now
            record.progress, record.error = (
                1.0,
                None,
            )
            self._finish(record, JobStatus.succeeded)
        self._changed(record)
        return record

    def fail(self, job_id: str, worker_id: str | None, error: str) -> JobRecord | None:
        """Fail a running job (``worker_id=None``: whoever runs it). None if not running."""
        with self._lock:
            record = self._owned(job_id, worker_id)
            if record is None:
                return None
            self._finish(record, JobStatus.failed, error=error)
        logger.warning("compaction %s failed: %s", job_id, error)
        self._changed(record)
        return record

    def fail_worker(self, worker_id: str, error: str) -> None:
        """A worker is gone: its job runs again (after a backoff, while attempts remain) or fails."""
        record = self.running_for(worker_id)
        if record is not None:
            self.retry_or_fail(record.id, worker_id, error)

    def retry_or_fail(
        self, job_id: str, worker_id: str | None, error: str
    ) -> JobRecord | None:
        """The worker of a running job died: queue it again after ``retry_backoff_s * 2^(n-1)``
        while it has run fewer than ``max_attempts`` times, else fail it saying how often it ran.
        A claim no worker acknowledged goes back to the queue at once, as if never made."""
        with self._lock:
            record = self._owned(job_id, worker_id)
            if record is None:
                return None
            before = record.model_copy(deep=True)
            if not record.acked:
                record.attempts -= 1
            elif record.attempts >= self.max_attempts:
                record = None
            if record is not None:
                delay = (
                    self.retry_backoff_s * 2 ** max(0, record.attempts - 1)
                    if record.acked
                    else 0.0
                )
                record.status, record.worker_id, record.lease_expires = (
                    JobStatus.queued,
                    None,
                    None,
                )
                record.progress, record.stage, record.started_at = 0.0, None, None
                record.not_before, record.error = (
                    time.time() + delay,
                    error if record.acked else record.error,
                )
                self._commit(record, before)
        if record is None:  # out of attempts
            return self.fail(
                job_id, worker_id, f"{error} (after {self.max_attempts} attempts)"
            )
        logger.warning("compaction %s: %s; queued again", job_id, error)
        self._changed(record)
        return record

    def expire_leases(self) -> None:
        """Leases that lapsed (the worker died or hangs) and jobs past their deadline."""
        now = time.time()
        with self._lock:
            lapsed = [
                r
                for r in self._jobs.values()
                if r.status == JobStatus.running and (r.lease_expires or 0) < now
            ]
            late = [
                r
                for r in self._jobs.values()
                if r.status == JobStatus.running
                and self.deadline_s
                and r.started_at is not None
                and now - r.started_at > self.deadline_s
                and r not in lapsed
            ]
        for record in lapsed:
            silence = self.lease_s if record.acked else self.ack_s
            self.retry_or_fail(
                record.id,
                record.worker_id,
                f"worker {record.worker_id} stopped answering (no heartbeat for {silence:.0f} s)",
            )
        for record in late:
            self.fail(
                record.id,
                record.worker_id,
                f"the compaction ran past its deadline of {self.deadline_s:.0f} s",
            )

    # ------------------------------------------------------------------ internals
    def _owned(self, job_id: str, worker_id: str | None) -> JobRecord | None:
        """The job if it is running on ``worker_id`` (None: on any worker)."""
        record = self._jobs.get(job_id)
        if record is None or record.status != JobStatus.running:
            return None
        if worker_id is not None and record.worker_id != worker_id:
            return None
        return record

    def _finish(
        self, record: JobRecord, status: JobStatus, error: str | None = None
    ) -> None:
        before = record.model_copy(deep=True)
        record.status, record.finished_at, record.lease_expires = (
            status,
            time.time(),
            None,
        )
        if error is not None:
            record.error = error
        if record.started_at is not None:
            record.timings["run_s"] = record.finished_at - record.started_at
        self._commit(record, before)

    def _commit(self, record: JobRecord, before: JobRecord) -> None:
        """Write a changed record; when the disk refuses it (full), ``before`` goes back in
        its place, so the book never says what its files do not (the caller gets the error)."""
        try:
            self._save(record)
        except OSError:
            self._jobs[record.id] = before
            raise

    def _changed(self, record: JobRecord) -> None:
        if self._on_change is not None:
            try:
                self._on_change(record)
            except Exception:  # bookkeeping must never break the job's own transition
                logger.exception("job change hook failed for %s", record.id)

    def _save(self, record: JobRecord) -> None:
        write_atomically(self.root / f"{record.id}.json", record.model_dump_json())

    def _load(self) -> None:
        for path in sorted(self.root.glob("cmp_*.json")):
            try:
                record = JobRecord.model_validate_json(path.read_text())
            except (OSError, ValueError) as exc:
                quarantine(path, self.quarantine_root, str(exc)[:200])
                self.quarantined.append(path.stem)
                continue
            # the server stopped under it: run it again
            if record.status == JobStatus.running:
                # the stop was the server's, not the job's
                record.attempts = max(0, record.attempts - 1)
                record.status, record.worker_id, record.lease_expires = (
                    JobStatus.queued,
                    None,
                    None,
                )
                record.progress, record.stage, record.started_at = 0.0, None, None
                self._save(record)
            self._jobs[record.id] = record
        if self._jobs:
            logger.info("found %d compaction jobs under %s", len(self._jobs), self.root)
