"""HTTP routes of the compaction service (FastAPI, no vLLM): ``/v1/compact`` for clients and
``/compaction/worker/v1/*`` for workers.

Clients are the API keys of the server (``--api-key``, enforced by vLLM on ``/v1``): each sees
only its own compactions. Workers present the worker token instead.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import secrets
import time
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from vllm_compaction.service.jobs import JobError
from vllm_compaction.service.protocol import (
    ClaimRequest, CompactionDeleted, CompactionList, CompactRequest, Compaction, FailReport,
    Heartbeat, HeartbeatReply, WorkerInfo, WorkerJob,
)
from vllm_compaction.service.service import CompactionService

__all__ = ["router", "owner_of", "error_response", "WORKER_PREFIX"]

WORKER_PREFIX = "/compaction/worker/v1"
MAX_UPLOAD_BYTES = 16 << 30

router = APIRouter()


def error_response(status: int, message: str) -> JSONResponse:
    """An OpenAI-style error body."""
    kind = "NotFoundError" if status == 404 else "BadRequestError" if status < 500 else "InternalServerError"
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind,
                                                               "param": None, "code": status}})


def _bearer(request: Request) -> str:
    """The request's bearer token ('' without one)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else ""


def owner_of(request: Request) -> str:
    """Who is asking: a digest of the bearer API key ('' without one)."""
    token = _bearer(request)
    return hashlib.sha256(token.encode()).hexdigest()[:32] if token else ""


def service_of(request: Request) -> CompactionService:
    service = getattr(request.app.state, "compaction_service", None)
    if service is None:
        raise HTTPException(503, "the compaction service is not running on this server")
    return service


def _guard(func):
    """Turn JobError / ValueError into a 4xx with the sentence."""

    @functools.wraps(func)
    async def wrapper(*args, **kwargs):
        try:
            return await func(*args, **kwargs)
        except JobError as exc:
            return error_response(exc.status, str(exc))
        except ValueError as exc:
            return error_response(400, str(exc))

    return wrapper


# ---------------------------------------------------------------------- clients
@router.post("/v1/compact", status_code=202, response_model=Compaction,
             summary="Queue the compaction of a conversation, prompt or known conversation_id")
@_guard
async def create_compaction(body: CompactRequest, request: Request):
    service = service_of(request)
    record = await run_in_threadpool(service.submit, body, owner_of(request))
    return JSONResponse(status_code=202, content=record.public().model_dump(mode="json"))


@router.get("/v1/compact", response_model=CompactionList, summary="This API key's compactions")
@_guard
async def list_compactions(request: Request):
    records = service_of(request).list(owner_of(request))
    return CompactionList(data=[r.public() for r in records])


@router.get("/v1/compact/{compaction_id}", response_model=Compaction, summary="One compaction")
@_guard
async def get_compaction(compaction_id: str, request: Request):
    return service_of(request).get(compaction_id, owner_of(request)).public()


@router.delete("/v1/compact/{compaction_id}", response_model=CompactionDeleted,
               summary="Cancel a queued or running compaction, or delete a finished one and its cache")
@_guard
async def delete_compaction(compaction_id: str, request: Request):
    record, deleted = service_of(request).cancel_or_delete(compaction_id, owner_of(request))
    return CompactionDeleted(id=record.id, deleted=deleted, status=record.status)


# ---------------------------------------------------------------------- workers
def worker_service(request: Request) -> CompactionService:
    service = service_of(request)
    if not secrets.compare_digest(_bearer(request).encode(), service.worker_token.encode()):
        raise HTTPException(401, "a compaction worker must present the worker token")
    return service


@router.get(f"{WORKER_PREFIX}/info", response_model=WorkerInfo, include_in_schema=False)
async def worker_info(service: CompactionService = Depends(worker_service)):
    return service.worker_info()


@router.post(f"{WORKER_PREFIX}/claim", response_model=WorkerJob | None, include_in_schema=False)
async def worker_claim(body: ClaimRequest, service: CompactionService = Depends(worker_service)):
    deadline = time.monotonic() + body.wait_s
    record = service.book.claim(body.worker_id)
    while record is None and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        record = service.book.claim(body.worker_id)
    return Response(status_code=204) if record is None else record.worker_job()


@router.post(f"{WORKER_PREFIX}/jobs/{{compaction_id}}/heartbeat", response_model=HeartbeatReply,
             include_in_schema=False)
async def worker_heartbeat(compaction_id: str, body: Heartbeat,
                           service: CompactionService = Depends(worker_service)):
    keep = service.book.heartbeat(compaction_id, body.worker_id, body.progress, body.stage)
    return HeartbeatReply(action="continue" if keep else "cancel")


@router.put(f"{WORKER_PREFIX}/jobs/{{compaction_id}}/result", response_model=Compaction, include_in_schema=False)
@_guard
async def worker_result(compaction_id: str, request: Request,
                        service: CompactionService = Depends(worker_service)):
    worker_id = request.headers.get("x-worker-id", "")
    upload = Path(service.store.root) / f".upload-{secrets.token_hex(8)}.tmp"
    size = 0
    try:
        with upload.open("wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_UPLOAD_BYTES:
                    raise JobError(413, f"the upload exceeds {MAX_UPLOAD_BYTES} bytes")
                f.write(chunk)
    except BaseException:
        upload.unlink(missing_ok=True)
        raise
    record = await run_in_threadpool(service.accept_result, compaction_id, worker_id, upload)
    return record.public()


@router.post(f"{WORKER_PREFIX}/jobs/{{compaction_id}}/fail", include_in_schema=False)
async def worker_fail(compaction_id: str, body: FailReport,
                      service: CompactionService = Depends(worker_service)):
    service.book.fail(compaction_id, body.worker_id, body.error)
    return {"ok": True}
