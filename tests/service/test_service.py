"""``CompactionService`` without HTTP or an engine: submission checks, serving plans, automatic
compaction and result uploads, with the real SmolLM2 tokenizer and fingerprint."""

from __future__ import annotations

import pytest

from vllm_compaction.service.config import ServiceConfig
from vllm_compaction.service.jobs import JobError
from vllm_compaction.service.protocol import CompactRequest, JobStatus
from vllm_compaction.service.service import CompactionService

MODEL = "smollm2-135m"
HISTORY = [
    {"role": "user", "content": "The vault code is 7319. " * 20},
    {"role": "assistant", "content": "Noted."},
]
QUESTION = [{"role": "user", "content": "What is the vault code?"}]


@pytest.fixture
def service(tmp_path, checkpoint):
    path, tokenizer, fingerprint = checkpoint
    config = ServiceConfig(
        store=tmp_path / "store",
        auto_compact_threshold_tokens=150,
        auto_compact_ratio=0.2,
    )
    return CompactionService(
        config,
        model_path=path,
        served_model_names=[MODEL],
        fingerprint=fingerprint,
        tokenizer=tokenizer,
        kv_bytes_per_token=100,
        max_model_len=4096,
    )


def request(**body) -> CompactRequest:
    return CompactRequest.model_validate({"model": MODEL, "ratio": 0.2, **body})


def finish(service: CompactionService, job_id: str, slots: int = 40) -> None:
    """Mark a job succeeded as a worker would, with a stand-in store entry."""
    service.book.claim("w")
    service.store.path_for(job_id).write_bytes(b"stand-in")
    service.book.succeed(job_id, "w", {"compacted_tokens": slots, "digest": "ab" * 32})


def status_of(call) -> int:
    with pytest.raises(JobError) as info:
        call()
    return info.value.status


def test_submit_checks(service):
    job = service.submit(request(messages=HISTORY), "a")
    assert (
        job.original_tokens == len(service.chat.chat_ids(HISTORY))
        and job.messages_covered == 2
    )
    assert job.max_head_ratio == pytest.approx(0.6)  # 3 x ratio: padded serving
    service.layout = "varlen"  # each head its own slots: no cap by default
    assert service.submit(request(messages=HISTORY), "a").max_head_ratio == 1.0
    service.layout = "padded"
    assert (
        status_of(
            lambda: service.submit(
                CompactRequest(model="other", prompt="x", ratio=0.5), "a"
            )
        )
        == 404
    )
    assert (
        status_of(lambda: service.submit(request(messages=[{"role": "user"}]), "a"))
        == 400
    )
    assert (
        status_of(
            lambda: service.submit(request(prompt="one two", keep_last_tokens=10), "a")
        )
        == 400
    )
    # over the window
    assert status_of(lambda: service.submit(request(prompt="x " * 5000), "a")) == 400
    assert (
        status_of(
            lambda: service.submit(request(prompt="x y z", max_head_ratio=0.1), "a")
        )
        == 400
    )
    assert (
        status_of(lambda: service.submit(request(conversation_id="unknown"), "a"))
        == 404
    )
    floor = service.submit(
        request(messages=HISTORY, method="am-highest-attn-fast", min_layer_share=0.3),
        "a",
    )
    assert (
        floor.public().min_layer_share == 0.3
        and floor.worker_job().min_layer_share == 0.3
    )
    assert job.worker_job().min_layer_share == 0.0


def test_plans_follow_the_job(service):
    job = service.submit(request(messages=HISTORY), "a")
    # not ready: a request with the history is served as sent, one without it cannot be
    assert service.plan_chat("a", HISTORY + QUESTION, compaction_id=job.id) is None
    assert (
        status_of(lambda: service.plan_chat("a", QUESTION, compaction_id=job.id)) == 409
    )
    finish(service, job.id)
    stored = service.store.path_for(job.id)
    before = stored.stat().st_mtime_ns
    with_history = service.plan_chat("a", HISTORY + QUESTION, compaction_id=job.id)
    # serving counts as use for the store's LRU
    assert stored.stat().st_mtime_ns > before
    new_only = service.plan_chat("a", QUESTION, compaction_id=job.id)
    assert with_history == new_only
    assert (
        new_only.num_slots == 40
        and new_only.continuation_ids == service.chat.turn_ids(QUESTION)
    )
    assert new_only.logical_prompt_tokens == job.original_tokens + len(
        new_only.continuation_ids
    )
    assert (
        status_of(lambda: service.plan_chat("b", QUESTION, compaction_id=job.id)) == 404
    )
    # nothing follows
    assert (
        status_of(lambda: service.plan_chat("a", HISTORY, compaction_id=job.id)) == 400
    )
    assert (
        status_of(
            lambda: service.plan_chat(
                "a", [{"role": "user", "content": 3}], compaction_id=job.id
            )
        )
        == 400
    )
    text = service.plan_text("a", job.id, "What is the code?")
    assert text.continuation_ids == service.chat.encode("What is the code?")
    service.store.delete_id(job.id)  # evicted
    assert service.plan_chat("a", HISTORY + QUESTION, compaction_id=job.id) is None
    assert (
        status_of(lambda: service.plan_chat("a", QUESTION, compaction_id=job.id)) == 410
    )


def test_cancel_or_delete(service):
    job = service.submit(request(messages=HISTORY), "a")
    record, deleted = service.cancel_or_delete(job.id, "a")
    assert record.status == JobStatus.cancelled and not deleted
    assert (
        status_of(lambda: service.plan_chat("a", QUESTION, compaction_id=job.id)) == 409
    )
    done = service.submit(request(messages=HISTORY), "a")
    finish(service, done.id)
    assert service.cancel_or_delete(done.id, "a")[1] and not service.store.contains_id(
        done.id
    )


def test_auto_compaction_by_conversation(service):
    short = [{"role": "user", "content": "hello"}]
    assert service.plan_chat("a", short, conversation_id="c") is None
    assert service.book.list("a") == []  # under the threshold
    long = HISTORY + QUESTION
    # served as sent, job queued
    assert service.plan_chat("a", long, conversation_id="c") is None
    (job,) = service.book.list("a")
    assert (
        job.conversation_id == "c"
        and job.messages == long
        and job.ratio_requested == 0.2
    )
    service.plan_chat("a", long, conversation_id="c")
    assert len(service.book.list("a")) == 1  # one pending job per conversation
    finish(service, job.id)
    later = long + [
        {"role": "assistant", "content": "7319"},
        {"role": "user", "content": "Thanks"},
    ]
    plan = service.plan_chat("a", later, conversation_id="c")
    assert (
        plan.compaction_id == job.id
        and plan.continuation_ids == service.chat.turn_ids(later[3:])
    )
    diverged = [{"role": "user", "content": "Another story"}] + later[1:]
    assert service.plan_chat("a", diverged, conversation_id="c") is None
    # compact the conversation by id: its latest messages
    by_id = service.submit(request(conversation_id="c"), "a")
    assert by_id.messages == diverged


def test_auto_compaction_to_a_target_size(tmp_path, checkpoint):
    path, tokenizer, fingerprint = checkpoint
    config = ServiceConfig(
        store=tmp_path / "store",
        auto_compact_threshold_tokens=20,
        auto_compact_target_tokens=16,
        auto_compact_min_layer_share=0.3,
    )
    service = CompactionService(
        config,
        model_path=path,
        served_model_names=[MODEL],
        fingerprint=fingerprint,
        tokenizer=tokenizer,
        kv_bytes_per_token=100,
        max_model_len=4096,
    )
    long = HISTORY + QUESTION
    assert service.plan_chat("a", long, conversation_id="c") is None
    (job,) = service.book.list("a")
    assert job.target_tokens == 16 and job.ratio_requested is None
    # the configured floor reaches the worker
    assert job.worker_job().min_layer_share == 0.3
    # content no longer than the target: nothing to gain, so no job
    config.auto_compact_target_tokens = 10_000
    assert service.plan_chat("a", long, conversation_id="d") is None
    assert [j.conversation_id for j in service.book.list("a")] == ["c"]


def test_uploads_are_verified(service, tmp_path):
    job = service.submit(request(messages=HISTORY), "a")
    service.book.claim("w")
    bad = service.store.root / ".upload-x.tmp"
    bad.write_bytes(b"not a cache")
    assert status_of(lambda: service.accept_result(job.id, "other-worker", bad)) == 409
    bad.write_bytes(b"not a cache")
    assert status_of(lambda: service.accept_result(job.id, "w", bad)) == 422
    failed = service.get(job.id, "a")
    assert failed.status == JobStatus.failed and "rejected" in failed.error
    assert not bad.exists() and not service.store.contains_id(job.id)


def test_a_corrupt_cache_is_diagnosed_and_quarantined(service):
    job = service.submit(request(messages=HISTORY), "a")
    finish(service, job.id)  # its store entry is stand-in bytes, not a cache
    problem = service.diagnose(job.id)
    assert problem and "quarantine" in problem
    assert not service.store.contains_id(job.id)
    # served as sent
    assert service.plan_chat("a", HISTORY + QUESTION, compaction_id=job.id) is None
    assert (
        status_of(lambda: service.plan_chat("a", QUESTION, compaction_id=job.id)) == 410
    )


@pytest.mark.slow
def test_a_summarized_job_is_served_from_the_summary_s_shorter_prefix(service, smollm2):
    """``summarize``: the worker is told to summarize, the shorter cache it makes is accepted
    (its length is the summary's, not the conversation's), sizes count against the
    conversation, and requests are planned on the summary's logical length."""
    from vllm_compaction.pipeline import compact

    with pytest.raises(ValueError, match="cannot be combined with summarize"):
        request(messages=HISTORY, summarize=True, keep_last_tokens=2)
    job = service.submit(
        request(messages=HISTORY, ratio=0.5, summarize=True, summary_tokens=16), "a"
    )
    work = job.worker_job()
    assert work.summarize and work.summary_tokens == 16
    service.book.claim("w")
    cache = compact(
        smollm2,
        work.messages,
        ratio=work.ratio,
        method="am-highest-attn",
        queries="repeat-prefill",
        summarize=work.summarize,
        summary_tokens=work.summary_tokens,
    )
    upload = service.store.root / ".upload-summary.tmp"
    cache.save(upload)
    done = service.accept_result(job.id, "w", upload)
    assert done.status == JobStatus.succeeded
    assert done.prefix_tokens == cache.logical_length < done.original_tokens
    assert done.ratio == pytest.approx(done.compacted_tokens / done.original_tokens)
    plan = service.plan_chat("a", QUESTION, compaction_id=job.id)
    assert plan is not None and plan.logical_prefix_tokens == cache.logical_length
