"""Prometheus metrics of the compaction service, exported on the server's ``/metrics``.

They live in the default registry, which vLLM's ``/metrics`` route serves in a single API-server
process. Created once per process; :class:`ServiceMetrics` feeds them from job transitions.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from vllm_compaction.service.protocol import JobStatus

if TYPE_CHECKING:
    from vllm_compaction.service.jobs import JobBook, JobRecord

__all__ = ["ServiceMetrics"]

_STAGE_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


@functools.lru_cache(maxsize=1)
def _collectors():
    from prometheus_client import Counter, Gauge, Histogram

    return {
        "jobs": Gauge(
            "vllm_compaction_jobs",
            "Compaction jobs known to the server, by status",
            ["status"],
        ),
        "finished": Counter(
            "vllm_compaction_jobs_finished",
            "Compaction jobs that ended, by status",
            ["status"],
        ),
        "queue": Gauge(
            "vllm_compaction_queue_length", "Compaction jobs waiting for a worker"
        ),
        "stage": Histogram(
            "vllm_compaction_stage_seconds",
            "Duration of each compaction stage",
            ["stage"],
            buckets=_STAGE_BUCKETS,
        ),
        "ratio": Histogram(
            "vllm_compaction_ratio",
            "Physical / logical prefix tokens of finished compactions",
            buckets=_RATIO_BUCKETS,
        ),
        "bytes_saved": Counter(
            "vllm_compaction_bytes_saved",
            "KV-cache bytes per request saved by "
            "compacted prefixes, summed over finished compactions",
        ),
        "requests": Counter(
            "vllm_compaction_requests",
            "Completion requests by how their prefix was served",
            ["prefix"],
        ),
        "workers": Gauge(
            "vllm_compaction_local_workers", "Local compaction worker processes alive"
        ),
    }


class ServiceMetrics:
    """Updates the collectors from one job book."""

    def __init__(self) -> None:
        self.collectors = _collectors()

    def job_counts(self, book: JobBook) -> None:
        counts = book.counts()
        for status, n in counts.items():
            self.collectors["jobs"].labels(status=status.value).set(n)
        self.collectors["queue"].set(counts[JobStatus.queued])

    def job_changed(self, book: JobBook, record: JobRecord) -> None:
        self.job_counts(book)
        if not record.status.finished:
            return
        self.collectors["finished"].labels(status=record.status.value).inc()
        for stage, seconds in record.timings.items():
            self.collectors["stage"].labels(stage=stage.removesuffix("_s")).observe(
                seconds
            )
        if record.status == JobStatus.succeeded:
            if record.ratio is not None:
                self.collectors["ratio"].observe(record.ratio)
            # a short prompt's cache can outgrow it (block padding): nothing saved, not a loss
            if record.bytes_saved and record.bytes_saved > 0:
                self.collectors["bytes_saved"].inc(record.bytes_saved)

    def request(self, prefix: str) -> None:
        """``prefix``: compacted | original (a conversation served uncompacted) | plain."""
        self.collectors["requests"].labels(prefix=prefix).inc()

    def workers_alive(self, n: int) -> None:
        self.collectors["workers"].set(n)
