"""The service under load, faults and abuse, without an engine: bounded and fair work, durable
records, one server per store, typed errors, ownership, reserved salts and body limits."""

from __future__ import annotations

import json
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient

from vllm_compaction.service.api import RequestGuard, error_response, router
from vllm_compaction.service.config import ServiceConfig
from vllm_compaction.service.conversations import Conversation, ConversationBook
from vllm_compaction.service.files import StoreLock
from vllm_compaction.service.jobs import JobBook, JobError, JobRecord, new_compaction_id
from vllm_compaction.service.protocol import JobStatus
from vllm_compaction.service.service import CompactionService

MODEL = "smollm2-135m"
HISTORY = [
    {"role": "user", "content": "The vault code is 7319. " * 20},
    {"role": "assistant", "content": "Noted."},
]


def record(owner: str = "a", **fields) -> JobRecord:
    fields = {"messages_covered": 1, **fields}
    return JobRecord(
        id=new_compaction_id(),
        status=JobStatus.queued,
        created=0,
        model="m",
        method="am",
        original_tokens=10,
        owner=owner,
        **fields,
    )


def test_queue_limits_answer_429_with_a_retry_hint(tmp_path):
    book = JobBook(tmp_path / "jobs", max_queued=3, max_queued_per_owner=2)
    book.submit(record("a")), book.submit(record("a"))
    with pytest.raises(JobError) as info:
        book.submit(record("a"))
    assert info.value.status == 429 and info.value.retry_after >= 1
    book.submit(record("b"))
    with pytest.raises(JobError, match="queued"):
        book.submit(record("c"))  # the server's limit
    assert len(book.list()) == 3


def test_workers_take_keys_in_turn(tmp_path):
    book = JobBook(tmp_path / "jobs")
    flood = [book.submit(record("a")) for _ in range(5)]
    single = book.submit(record("b"))
    order = [book.claim(f"w{i}").id for i in range(3)]
    # b's one job does not wait for a's five
    assert order == [
        flood[0].id,
        single.id,
        flood[1].id,
    ]


def test_an_idempotency_key_returns_the_first_job(tmp_path):
    book = JobBook(tmp_path / "jobs")
    first = book.submit(record("a", idempotency_key="k1", request_digest="x"))
    assert (
        book.submit(record("a", idempotency_key="k1", request_digest="x")).id
        == first.id
    )
    # keys are per owner
    assert (
        book.submit(record("b", idempotency_key="k1", request_digest="x")).id
        != first.id
    )
    with pytest.raises(JobError) as info:
        book.submit(record("a", idempotency_key="k1", request_digest="y"))
    assert info.value.status == 409 and info.value.param == "Idempotency-Key"
    assert len(book.list("a")) == 1


def test_pages_of_the_list(tmp_path):
    book = JobBook(tmp_path / "jobs")
    ids = [book.submit(record("a")).id for _ in range(5)]
    page, more = book.page("a", limit=2)
    assert [r.id for r in page] == ids[:2] and more
    page, more = book.page("a", after=ids[1], limit=10)
    assert [r.id for r in page] == ids[2:] and not more
    with pytest.raises(JobError, match="No compaction"):
        book.page("b", after=ids[0])


def test_unreadable_records_are_quarantined_and_reported(tmp_path):
    book = JobBook(tmp_path / "jobs")
    kept = book.submit(record("a"))
    broken = book.submit(record("a"))
    path = tmp_path / "jobs" / f"{broken.id}.json"
    # truncated, as a crash without fsync could leave it
    path.write_text(path.read_text()[:40])
    again = JobBook(tmp_path / "jobs")
    assert [r.id for r in again.list()] == [kept.id]
    assert again.quarantined == [broken.id]
    assert (
        tmp_path / "jobs" / "quarantine" / f"{broken.id}.json"
    ).is_file() and not path.exists()


def full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")


def test_a_failed_save_queues_nothing(tmp_path, monkeypatch):
    from vllm_compaction.service import jobs

    book = JobBook(tmp_path / "jobs")
    monkeypatch.setattr(jobs, "write_atomically", full_disk)
    with pytest.raises(OSError):
        book.submit(record("a"))
    assert book.list() == [] and not list((tmp_path / "jobs").iterdir())


def test_a_full_disk_neither_loses_a_claim_nor_drops_a_running_job(
    tmp_path, monkeypatch
):
    """A claim that cannot be written leaves the job queued as it was (no attempt counted);
    a heartbeat whose acknowledgement cannot be written still renews the lease."""
    from vllm_compaction.service import jobs

    book = JobBook(tmp_path / "jobs")
    job = book.submit(record("a"))
    real_write = jobs.write_atomically
    monkeypatch.setattr(jobs, "write_atomically", full_disk)
    with pytest.raises(OSError):
        book.claim("w1")
    unchanged = book.get(job.id)
    assert unchanged.status == JobStatus.queued and unchanged.attempts == 0
    assert unchanged.worker_id is None and unchanged.claim_token is None
    monkeypatch.setattr(jobs, "write_atomically", real_write)
    assert book.claim("w1").attempts == 1
    monkeypatch.setattr(jobs, "write_atomically", full_disk)
    assert book.heartbeat(job.id, "w1", 0.2, "layers")  # the disk filled up meanwhile
    assert book.get(job.id).status == JobStatus.running
    monkeypatch.setattr(jobs, "write_atomically", real_write)
    done = book.succeed(job.id, "w1", {"compacted_tokens": 3, "digest": "ab"})
    assert done.status == JobStatus.succeeded


def test_a_corrupt_conversation_starts_over(tmp_path):
    book = ConversationBook(tmp_path / "conversations")
    book.save(Conversation(owner="a", conversation_id="c1", messages=HISTORY))
    path = book._path("a", "c1")
    path.write_text("{not json")
    assert ConversationBook(tmp_path / "conversations").get("a", "c1") is None
    assert (tmp_path / "conversations" / "quarantine" / path.name).is_file()


def test_one_server_per_store(tmp_path):
    lock = StoreLock(tmp_path)
    with pytest.raises(ValueError, match="in use by another server"):
        StoreLock(tmp_path)
    lock.release()
    StoreLock(tmp_path).release()


# ---------------------------------------------------------------------- over HTTP, no engine
@pytest.fixture
def app(tmp_path, checkpoint):
    path, tokenizer, fingerprint = checkpoint
    config = ServiceConfig(
        store=tmp_path / "store", max_queued_jobs=4, max_queued_per_key=2
    )
    service = CompactionService(
        config,
        model_path=path,
        served_model_names=[MODEL],
        fingerprint=fingerprint,
        tokenizer=tokenizer,
        kv_bytes_per_token=100,
        max_model_len=4096,
        layout="varlen",
    )
    app = FastAPI()
    # vLLM's server answers invalid bodies 400 with the field as param; the same here
    app.add_exception_handler(
        RequestValidationError,
        lambda request, exc: error_response(
            400,
            str(exc.errors()[0]["msg"]),
            param=".".join(map(str, exc.errors()[0]["loc"])),
        ),
    )
    app.include_router(router)
    app.add_middleware(RequestGuard, max_compact_body_bytes=200_000)
    app.state.compaction_service = service

    @app.post("/v1/responses")  # stands in for every route that takes a cache_salt
    async def responses(request: Request):
        return {"echo": json.loads(await request.body())}

    yield app
    service.lock.release()


def body(**extra) -> dict:
    return {"model": MODEL, "messages": HISTORY, "ratio": 0.2, **extra}


def test_without_api_keys_every_caller_sees_every_compaction(app):
    client = TestClient(app)
    app.state.compaction_service.keyed_owners = False  # vLLM started without --api-key
    job = client.post("/v1/compact", json=body()).json()
    seen = client.get(
        f"/v1/compact/{job['id']}", headers={"Authorization": "Bearer EMPTY"}
    )
    assert seen.status_code == 200 and seen.json()["id"] == job["id"]


def test_with_api_keys_another_key_sees_nothing(app):
    client = TestClient(app)
    job = client.post(
        "/v1/compact", json=body(), headers={"Authorization": "Bearer key-a"}
    ).json()
    for method in ("get", "delete"):
        other = getattr(client, method)(
            f"/v1/compact/{job['id']}", headers={"Authorization": "Bearer key-b"}
        )
        assert (
            other.status_code == 404
            and other.json()["error"]["type"] == "NotFoundError"
        )
    assert (
        client.get(
            f"/v1/compact/{job['id']}", headers={"Authorization": "Bearer key-a"}
        ).json()["status"]
        == "queued"
    )


def test_errors_are_typed_by_status_with_the_field(app):
    client = TestClient(app)
    key = {"Authorization": "Bearer key-a"}
    first = client.post(
        "/v1/compact", json=body(), headers={**key, "Idempotency-Key": "once"}
    )
    assert (
        client.post(
            "/v1/compact", json=body(), headers={**key, "Idempotency-Key": "once"}
        ).json()["id"]
        == first.json()["id"]
    )
    conflict = client.post(
        "/v1/compact", json=body(ratio=0.3), headers={**key, "Idempotency-Key": "once"}
    ).json()
    assert (
        conflict["error"]["type"] == "ConflictError"
        and conflict["error"]["param"] == "Idempotency-Key"
    )
    client.post("/v1/compact", json=body(), headers=key)
    limited = client.post("/v1/compact", json=body(), headers=key)
    assert (
        limited.status_code == 429
        and limited.json()["error"]["type"] == "RateLimitError"
    )
    assert int(limited.headers["Retry-After"]) >= 1
    page = client.get("/v1/compact?limit=1", headers=key).json()
    assert (
        len(page["data"]) == 1
        and page["has_more"]
        and page["first_id"] == first.json()["id"]
    )


@pytest.mark.parametrize(
    "change",
    [
        dict(ratio=float("nan")),
        dict(ratio=0),
        dict(ratio=1.0001),
        dict(ratio=None, target_tokens=10**400),
        dict(ratio=None, target_tokens=0),
        dict(queries="surprise-quote/1"),
        dict(messages=[{"role": "user", "content": "x"}] * 10_001),
    ],
)
def test_out_of_range_requests_are_4xx(app, change):
    client = TestClient(app)
    payload = json.dumps(body(**change), allow_nan=True)
    response = client.post(
        "/v1/compact", content=payload, headers={"Content-Type": "application/json"}
    )
    assert 400 <= response.status_code < 500, response.text


def test_bodies_over_the_limit_and_reserved_salts_are_refused(app):
    client = TestClient(app)
    big = client.post(
        "/v1/compact", json=body(messages=[{"role": "user", "content": "x" * 300_000}])
    )
    assert (
        big.status_code == 413 and big.json()["error"]["type"] == "RequestTooLargeError"
    )
    salted = client.post(
        "/v1/responses", json={"input": "hi", "cache_salt": "vllm-compaction:cmp_x"}
    )
    assert salted.status_code == 400 and salted.json()["error"]["param"] == "cache_salt"
    plain = client.post("/v1/responses", json={"input": "hi", "cache_salt": "mine"})
    # passed on unchanged
    assert plain.status_code == 200 and plain.json()["echo"]["cache_salt"] == "mine"


def test_eviction_spares_held_entries_and_counts_every_file(tmp_path):
    from vllm_compaction.cache import LocalDiskStore

    store = LocalDiskStore(tmp_path / "store", max_bytes=3500)
    for name in ("old", "held", "newer"):
        (store.root / f"{name}.safetensors").write_bytes(b"x" * 1000)
        store._touch(store.path_for(name))
    (store.root / "quarantine").mkdir()
    (store.root / "quarantine" / "bad.1.safetensors").write_bytes(b"q" * 500)
    (store.root / "jobs").mkdir()
    (store.root / "jobs" / "cmp_x.json").write_text("j" * 400)  # records count too
    store.hold("held", 60)
    (store.root / "incoming.safetensors").write_bytes(b"n" * 1000)
    store._evict(keep=store.path_for("incoming"))
    left = sorted(p.stem for p in store.root.glob("*.safetensors"))
    # quarantine, then the oldest unheld entry went
    assert left == [
        "held",
        "incoming",
        "newer",
    ]
    assert not list((store.root / "quarantine").iterdir())


def test_a_superseded_automatic_compaction_is_collected(app):
    service = app.state.compaction_service
    jobs = []
    for covered in (2, 3):
        job = record("a", conversation_id="c1", auto=True, messages_covered=covered)
        service.book.submit(job)
        service.book.claim("w")
        service.store.path_for(job.id).write_bytes(b"stand-in")
        service.book.succeed(job.id, "w", {"compacted_tokens": 8, "digest": "ab" * 32})
        jobs.append(job)
    assert service.conversations.get("a", "c1").compaction_id == jobs[1].id
    assert not service.store.contains_id(jobs[0].id)
    with pytest.raises(JobError):
        service.book.get(jobs[0].id)
    assert service.store.max_bytes is not None  # a default limit


def test_only_the_claim_lets_a_worker_report_on_a_job(app):
    client = TestClient(app)
    service = app.state.compaction_service
    worker = {"Authorization": f"Bearer {service.worker_token}"}
    assert (
        client.post("/compaction/worker/v1/claim", json={"worker_id": "w"}).status_code
        == 401
    )
    job = client.post("/v1/compact", json=body()).json()
    claimed = client.post(
        "/compaction/worker/v1/claim", json={"worker_id": "w"}, headers=worker
    ).json()
    assert claimed["id"] == job["id"] and len(claimed["token"]) > 20
    beat = {"worker_id": "w", "progress": 0.5}
    url = f"/compaction/worker/v1/jobs/{job['id']}"
    assert (
        client.post(f"{url}/heartbeat", json=beat, headers=worker).json()["action"]
        == "cancel"
    )
    own = {**worker, "X-Job-Token": claimed["token"]}
    assert (
        client.post(f"{url}/heartbeat", json=beat, headers=own).json()["action"]
        == "continue"
    )
    forged = {**worker, "X-Worker-Id": "w", "Content-Type": "application/octet-stream"}
    assert (
        client.put(f"{url}/result", content=b"poison", headers=forged).status_code
        == 403
    )
    assert (
        client.post(
            f"{url}/fail", json={"worker_id": "w", "error": "x"}, headers=worker
        ).status_code
        == 403
    )
    assert client.get(f"/v1/compact/{job['id']}").json()["status"] == "running"
    assert (
        client.post(
            f"{url}/fail", json={"worker_id": "w", "error": "x"}, headers=own
        ).status_code
        == 200
    )


def test_a_restarted_server_leaves_no_temp_files(tmp_path, checkpoint):
    path, tokenizer, fingerprint = checkpoint
    store = tmp_path / "store"
    (store / "jobs").mkdir(parents=True)
    leftovers = [store / ".upload-0123.tmp", store / "jobs" / ".cmp_x.json.77.tmp"]
    for leftover in leftovers:
        leftover.write_text("half")
    service = CompactionService(
        ServiceConfig(store=store),
        model_path=path,
        served_model_names=[MODEL],
        fingerprint=fingerprint,
        tokenizer=tokenizer,
        kv_bytes_per_token=100,
        max_model_len=4096,
    )
    assert not any(p.exists() for p in leftovers)
    service.lock.release()


def test_worker_routes_answer_a_full_disk_with_503(app, monkeypatch):
    """The worker's claim and failure report meet a full disk: a 503 with a retry hint and
    no path, the job untouched (queued, then running), never a bare 500."""
    from vllm_compaction.service import jobs

    client = TestClient(app)
    service = app.state.compaction_service
    worker = {"Authorization": f"Bearer {service.worker_token}"}
    job = client.post("/v1/compact", json=body()).json()
    claim = {"worker_id": "w", "wait_s": 0}
    monkeypatch.setattr(jobs, "write_atomically", full_disk)
    refused = client.post("/compaction/worker/v1/claim", json=claim, headers=worker)
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert "disk space" in refused.json()["error"]["message"]
    assert "/" not in refused.json()["error"]["message"].split("--")[0]
    assert client.get(f"/v1/compact/{job['id']}").json()["status"] == "queued"
    monkeypatch.undo()
    claimed = client.post("/compaction/worker/v1/claim", json=claim, headers=worker)
    own = {**worker, "X-Job-Token": claimed.json()["token"]}
    monkeypatch.setattr(jobs, "write_atomically", full_disk)
    failed = client.post(
        f"/compaction/worker/v1/jobs/{job['id']}/fail",
        json={"worker_id": "w", "error": "x"},
        headers=own,
    )
    assert failed.status_code == 503
    assert client.get(f"/v1/compact/{job['id']}").json()["status"] == "running"


def test_a_long_poll_whose_worker_went_away_claims_nothing(app):
    """A worker killed during its long poll: the job submitted meanwhile stays queued for the
    next worker instead of being claimed for the dead one (it would sit unacknowledged)."""
    import asyncio

    from vllm_compaction.service.api import worker_claim
    from vllm_compaction.service.protocol import ClaimRequest

    service = app.state.compaction_service

    async def gone() -> dict:  # the ASGI server's word that the connection closed
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "headers": []}, gone)

    async def poll_then_submit():
        polling = asyncio.create_task(
            worker_claim(ClaimRequest(worker_id="dead", wait_s=5.0), request, service)
        )
        await asyncio.sleep(0.05)
        job = service.book.submit(record("a"))
        return await polling, job

    answer, job = asyncio.run(poll_then_submit())
    assert answer.status_code == 204
    assert service.book.get(job.id).status == JobStatus.queued
    assert service.book.claim("alive").id == job.id


def test_a_new_cache_is_held_until_its_first_use_then_by_recency(app):
    """A cache nobody has read is kept from eviction (its client is about to); its first use
    ends that hold, after which only the short hold of a request being loaded protects it."""
    service = app.state.compaction_service
    store = service.store
    job = record("a")
    service.book.submit(job)
    service.book.claim("w")
    store.path_for(job.id).write_bytes(b"stand-in")
    service.book.succeed(job.id, "w", {"compacted_tokens": 8, "digest": "ab" * 32})
    fresh = store._held[job.id] - time.monotonic()
    assert fresh > service.config.fresh_hold_s - 5
    service.plan_text("a", job.id, "and then?")
    serving = store._held[job.id] - time.monotonic()
    assert 0 < serving <= service.config.serving_hold_s < service.config.fresh_hold_s
