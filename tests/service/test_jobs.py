"""The job book's state machine, leases and persistence (no server, no model)."""

from __future__ import annotations

import time

import pytest

from vllm_compaction.service.jobs import JobBook, JobError, JobRecord, new_compaction_id
from vllm_compaction.service.protocol import JobStatus


def record(owner: str = "a", **fields) -> JobRecord:
    return JobRecord(
        id=new_compaction_id(),
        status=JobStatus.queued,
        created=int(time.time()),
        model="m",
        method="am-omp-fast",
        original_tokens=10,
        messages_covered=1,
        owner=owner,
        messages=[{"role": "user", "content": "hi"}],
        ratio_requested=0.5,
        **fields,
    )


def test_ids_are_unguessable_store_ids():
    from vllm_compaction.cache import validate_entry_id

    ids = {new_compaction_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(validate_entry_id(i) and len(i) == 36 for i in ids)


def test_lifecycle_and_owner_isolation(tmp_path):
    changes = []
    book = JobBook(tmp_path, on_change=lambda r: changes.append(r.status))
    job = book.submit(record())
    with pytest.raises(JobError) as info:
        book.get(job.id, owner="b")
    assert info.value.status == 404
    assert book.list("b") == [] and [r.id for r in book.list("a")] == [job.id]
    claimed = book.claim("w1")
    assert (
        claimed.id == job.id
        and claimed.status == JobStatus.running
        and "queued_s" in claimed.timings
    )
    assert book.claim("w2") is None
    assert book.heartbeat(job.id, "w1", 0.5, "layers") and not book.heartbeat(
        job.id, "w2", 0.5, None
    )
    done = book.succeed(job.id, "w1", {"compacted_tokens": 3, "digest": "ab"})
    assert (
        done.status == JobStatus.succeeded
        and done.progress == 1.0
        and "run_s" in done.timings
    )
    assert changes == [JobStatus.queued, JobStatus.running, JobStatus.succeeded]
    with pytest.raises(JobError) as info:
        book.cancel(job.id, "a")
    assert info.value.status == 409
    assert book.delete(job.id, "a").id == job.id and book.list("a") == []


def test_cancel_stops_the_worker_and_a_late_result_is_refused(tmp_path):
    book = JobBook(tmp_path)
    job = book.submit(record())
    book.claim("w1")
    book.cancel(job.id, "a")
    assert not book.heartbeat(job.id, "w1", 0.3, None)  # the worker is told to stop
    with pytest.raises(JobError):
        book.succeed(job.id, "w1", {})
    with pytest.raises(JobError) as info:
        book.delete(book.submit(record()).id, "a")  # queued: cancel first
    assert info.value.status == 409


def test_delete_cancels_a_live_job_and_forgets_a_finished_one(tmp_path):
    """One step: a job that finished just before the client's DELETE is deleted, not 409."""
    changes = []
    book = JobBook(tmp_path, on_change=lambda r: changes.append(r.status))
    running, done = book.submit(record()), book.submit(record())
    book.claim("w1"), book.claim("w2")
    book.succeed(done.id, "w2", {})
    cancelled, deleted = book.cancel_or_delete(running.id, "a")
    assert cancelled.status == JobStatus.cancelled and not deleted
    assert changes[-1] == JobStatus.cancelled
    assert (tmp_path / f"{done.id}.json").exists()
    assert book.cancel_or_delete(done.id, "a")[1]
    assert [r.id for r in book.list("a")] == [running.id]
    assert not (tmp_path / f"{done.id}.json").exists()
    with pytest.raises(JobError) as info:
        book.cancel_or_delete(done.id, "b")  # another key's job stays unknown to it
    assert info.value.status == 404


def test_a_claim_no_worker_acknowledges_goes_back_to_the_queue(tmp_path):
    book = JobBook(tmp_path, lease_s=0.05)
    job = book.submit(record())
    # handed out, but w1 never heartbeats (it had gone)
    assert book.claim("w1").attempts == 1
    time.sleep(0.1)
    book.expire_leases()
    again = book.get(job.id)
    assert (
        again.status == JobStatus.queued and again.attempts == 0 and again.error is None
    )
    # at once: a claim that never reached a worker costs nothing
    assert book.claim("w2").id == job.id


def test_lapsed_lease_and_lost_worker_fail_the_job_after_its_attempts(tmp_path):
    book = JobBook(tmp_path, lease_s=0.05)
    first, second = book.submit(record()), book.submit(record())
    book.claim("w1")
    assert book.heartbeat(first.id, "w1", 0.1, "layers")  # acknowledged
    time.sleep(0.1)
    book.expire_leases()
    failed = book.get(first.id)
    assert (
        failed.status == JobStatus.failed
        and "no heartbeat" in failed.error
        and "after 1 attempts" in failed.error
    )
    book.lease_s = 60
    book.claim("w2")
    book.heartbeat(second.id, "w2", 0.1, None)
    book.fail_worker("w2", "the compaction worker (pid 1) was killed by signal 9")
    assert (
        book.get(second.id).status == JobStatus.failed
        and "signal 9" in book.get(second.id).error
    )


def test_a_dead_worker_s_job_runs_again_after_a_backoff(tmp_path):
    book = JobBook(tmp_path, max_attempts=2, retry_backoff_s=0.2)
    job = book.submit(record())
    book.claim("w1"), book.heartbeat(job.id, "w1", 0.5, "layers")
    book.fail_worker("w1", "the compaction worker (pid 1) was killed by signal 9")
    waiting = book.get(job.id)
    assert (
        waiting.status == JobStatus.queued
        and waiting.attempts == 1
        and "signal 9" in waiting.error
    )
    assert book.claim("w2") is None  # its backoff
    time.sleep(0.25)
    assert book.claim("w2").id == job.id and book.get(job.id).attempts == 2
    book.heartbeat(job.id, "w2", 0.5, None)
    book.fail_worker("w2", "the compaction worker (pid 2) was killed by signal 9")
    assert (
        book.get(job.id).status == JobStatus.failed
        and "after 2 attempts" in book.get(job.id).error
    )


def test_a_job_past_its_deadline_fails_and_its_worker_is_told_to_stop(tmp_path):
    book = JobBook(tmp_path, deadline_s=0.05)
    job = book.submit(record())
    book.claim("w1"), book.heartbeat(job.id, "w1", 0.5, None)
    time.sleep(0.1)
    book.expire_leases()
    assert (
        book.get(job.id).status == JobStatus.failed
        and "deadline" in book.get(job.id).error
    )
    # the worker's next heartbeat: stop (kill the computation)
    assert not book.heartbeat(job.id, "w1", 0.6, None)


def test_restart_keeps_finished_jobs_and_requeues_running_ones(tmp_path):
    book = JobBook(tmp_path)
    done, running, queued = (
        book.submit(record()),
        book.submit(record()),
        book.submit(record()),
    )
    book.claim("w1")
    book.succeed(done.id, "w1", {"compacted_tokens": 4})
    book.claim("w1")  # running stays running: the server "stops" here
    (tmp_path / "cmp_garbage.json").write_text("{not json")
    again = JobBook(tmp_path)
    assert (
        again.get(done.id).status == JobStatus.succeeded
        and again.get(done.id).compacted_tokens == 4
    )
    assert (
        again.get(running.id).status == JobStatus.queued
        and again.get(running.id).worker_id is None
    )
    assert again.get(queued.id).status == JobStatus.queued
    assert again.claim("w9").id == running.id  # oldest first


def test_active_job_per_conversation(tmp_path):
    book = JobBook(tmp_path)
    job = book.submit(record(conversation_id="c1"))
    assert book.active_for_conversation("c1", "a").id == job.id
    assert book.active_for_conversation("c1", "b") is None
    book.cancel(job.id)
    assert book.active_for_conversation("c1", "a") is None
