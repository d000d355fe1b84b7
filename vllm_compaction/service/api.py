"""HTTP routes of the compaction service (FastAPI, no vLLM): ``/v1/compact`` for clients and
``/compaction/worker/v1/*`` for workers.

Clients are the API keys of the server (``--api-key``, enforced by vLLM on ``/v1``): each sees
only its own compactions. Workers present the worker token instead.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import json
import logging
import secrets
import time
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from vllm_compaction.service.jobs import JobError
from vllm_compaction.service.protocol import (
    ClaimRequest,
    Compaction,
    CompactionDeleted,
    CompactionList,
    CompactRequest,
    FailReport,
    Heartbeat,
    HeartbeatReply,
    WorkerInfo,
    WorkerJob,
)
from vllm_compaction.service.service import CompactionService

__all__ = [
    "router",
    "owner_of",
    "error_response",
    "RequestGuard",
    "RESERVED_SALT",
    "WORKER_PREFIX",
]

WORKER_PREFIX = "/compaction/worker/v1"
MAX_UPLOAD_BYTES = 16 << 30
#: Largest body ``POST /v1/compact`` takes (413 above): a long conversation is a few MiB of JSON.
MAX_COMPACT_BODY_BYTES = 64 << 20
#: Salts the server alone gives compacted prefixes: a client's could reach another key's cache.
RESERVED_SALT = "vllm-compaction:"

router = APIRouter()
logger = logging.getLogger(__name__)

#: A full store answers 503 with this hint: space comes back when caches expire or are deleted.
STORE_FULL_RETRY_S = 30


#: The error type of each status, as the ``openai`` client names its exceptions.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    410: "GoneError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    retry_after: float | None = None,
) -> JSONResponse:
    """An OpenAI-style error body, typed by its status; a 429 says when to retry (Retry-After)."""
    kind = ERROR_TYPES.get(
        status, "InternalServerError" if status >= 500 else "BadRequestError"
    )
    headers = (
        {"Retry-After": str(int(retry_after))} if retry_after is not None else None
    )
    return JSONResponse(
        status_code=status,
        headers=headers,
        content={
            "error": {"message": message, "type": kind, "param": param, "code": status}
        },
    )


def _bearer(request: Request) -> str:
    """The request's bearer token ('' without one)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else ""


def owner_of(request: Request) -> str:
    """Who is asking: a digest of the bearer API key ('' without one). On a server without API
    keys nobody's key is checked, so none partitions the compactions: every caller is ''."""
    service = getattr(request.app.state, "compaction_service", None)
    if service is not None and not service.keyed_owners:
        return ""
    token = _bearer(request)
    return hashlib.sha256(token.encode()).hexdigest()[:32] if token else ""


class RequestGuard:
    """ASGI middleware in front of every route of the server.

    * A JSON ``POST`` with a top-level ``cache_salt`` in the reserved namespace is refused (400),
      whatever the route (chat, completions, responses, messages, generate...): the server alone
      names compacted prefixes.
    * ``POST /v1/compact`` bodies over ``MAX_COMPACT_BODY_BYTES`` are refused (413) while they
      arrive, before anything is parsed or tokenized.

    Other requests (not JSON, not POST, websockets) pass untouched; a checked body is buffered and
    handed on unchanged.
    """

    def __init__(
        self, app, max_compact_body_bytes: int = MAX_COMPACT_BODY_BYTES
    ) -> None:
        self.app, self.max_compact_body_bytes = app, max_compact_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        headers = dict(scope.get("headers") or ()) if scope["type"] == "http" else {}
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or b"json" not in headers.get(b"content-type", b"")
        ):
            return await self.app(scope, receive, send)
        limit = (
            self.max_compact_body_bytes
            if scope["path"].rstrip("/") == "/v1/compact"
            else None
        )
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if limit is not None and size > limit:
                response = error_response(
                    413, f"the request body exceeds {limit} bytes"
                )
                return await response(scope, receive, send)
        body = b"".join(chunks)
        if b"cache_salt" in body and (refusal := _reserved_salt(body)) is not None:
            return await refusal(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _reserved_salt(body: bytes) -> JSONResponse | None:
    try:
        payload = json.loads(body)
    except ValueError:
        return None  # the route answers the malformed JSON itself
    salt = payload.get("cache_salt") if isinstance(payload, dict) else None
    if isinstance(salt, str) and salt.startswith(RESERVED_SALT):
        return error_response(
            400,
            f"cache_salt values starting with {RESERVED_SALT!r} are reserved",
            param="cache_salt",
        )
    return None


def service_of(request: Request) -> CompactionService:
    service = getattr(request.app.state, "compaction_service", None)
    if service is None:
        raise HTTPException(503, "the compaction service is not running on this server")
    return service


def _guard(func):
    """Turn JobError / ValueError into a 4xx with the sentence, and a full disk under the
    store into a 503 with a retry hint (on the client and the worker routes alike)."""

    @functools.wraps(func)
    async def wrapper(*args, **kwargs):
        try:
            return await func(*args, **kwargs)
        except JobError as exc:
            return error_response(
                exc.status, str(exc), param=exc.param, retry_after=exc.retry_after
            )
        except ValueError as exc:
            return error_response(400, str(exc))
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # the request changed nothing (every record is written before it counts); the
            # message names no path, the log has the whole error
            logger.error("compaction store full: %s", exc)
            return error_response(
                503,
                "the compaction store is out of disk space; nothing was changed, try again "
                "later (an operator can free space or lower --compaction-store-max-bytes)",
                retry_after=STORE_FULL_RETRY_S,
            )

    return wrapper


# ---------------------------------------------------------------------- clients
@router.post(
    "/v1/compact",
    status_code=202,
    response_model=Compaction,
    summary="Queue the compaction of a conversation, prompt or known conversation_id",
)
@_guard
async def create_compaction(body: CompactRequest, request: Request):
    service = service_of(request)
    record = await run_in_threadpool(
        service.submit, body, owner_of(request), request.headers.get("idempotency-key")
    )
    return JSONResponse(
        status_code=202, content=record.public().model_dump(mode="json")
    )


@router.get(
    "/v1/compact",
    response_model=CompactionList,
    summary="This API key's compactions, oldest first, a page at a time (after, limit)",
)
@_guard
async def list_compactions(
    request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)
):
    records, more = service_of(request).list(
        owner_of(request), after=after, limit=limit
    )
    return CompactionList(
        data=[r.public() for r in records],
        has_more=more,
        first_id=records[0].id if records else None,
        last_id=records[-1].id if records else None,
    )


@router.get(
    "/v1/compact/{compaction_id}", response_model=Compaction, summary="One compaction"
)
@_guard
async def get_compaction(compaction_id: str, request: Request):
    return service_of(request).get(compaction_id, owner_of(request)).public()


@router.delete(
    "/v1/compact/{compaction_id}",
    response_model=CompactionDeleted,
    summary="Cancel a queued or running compaction, or delete a finished one and its cache",
)
@_guard
async def delete_compaction(compaction_id: str, request: Request):
    record, deleted = service_of(request).cancel_or_delete(
        compaction_id, owner_of(request)
    )
    return CompactionDeleted(id=record.id, deleted=deleted, status=record.status)


# ---------------------------------------------------------------------- workers
def _claimed(service: CompactionService, compaction_id: str, request: Request) -> bool:
    """Whether the request carries the claim secret of the job (``X-Job-Token``): the worker
    token lets a worker claim jobs, only a claim lets it report on or upload one."""
    try:
        record = service.book.get(compaction_id)
    except JobError:
        return False
    return record.token_matches(request.headers.get("x-job-token", ""))


def worker_service(request: Request) -> CompactionService:
    service = service_of(request)
    if not secrets.compare_digest(
        _bearer(request).encode(), service.worker_token.encode()
    ):
        raise HTTPException(401, "a compaction worker must present the worker token")
    return service


@router.get(f"{WORKER_PREFIX}/info", response_model=WorkerInfo, include_in_schema=False)
async def worker_info(service: CompactionService = Depends(worker_service)):
    return service.worker_info()


@router.post(
    f"{WORKER_PREFIX}/claim", response_model=WorkerJob | None, include_in_schema=False
)
@_guard
async def worker_claim(
    body: ClaimRequest,
    request: Request,
    service: CompactionService = Depends(worker_service),
):
    deadline = time.monotonic() + body.wait_s
    record = service.book.claim(body.worker_id)
    while record is None and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        # a worker that went away during its long poll must not be handed a job: the job would
        # sit claimed by nobody until its unacknowledged lease ran out
        if await request.is_disconnected():
            return Response(status_code=204)
        record = service.book.claim(body.worker_id)
    return Response(status_code=204) if record is None else record.worker_job()


@router.post(
    f"{WORKER_PREFIX}/jobs/{{compaction_id}}/heartbeat",
    response_model=HeartbeatReply,
    include_in_schema=False,
)
@_guard
async def worker_heartbeat(
    compaction_id: str,
    body: Heartbeat,
    request: Request,
    service: CompactionService = Depends(worker_service),
):
    keep = _claimed(service, compaction_id, request) and service.book.heartbeat(
        compaction_id, body.worker_id, body.progress, body.stage
    )
    return HeartbeatReply(action="continue" if keep else "cancel")


@router.put(
    f"{WORKER_PREFIX}/jobs/{{compaction_id}}/result",
    response_model=Compaction,
    include_in_schema=False,
)
@_guard
async def worker_result(
    compaction_id: str,
    request: Request,
    service: CompactionService = Depends(worker_service),
):
    worker_id = request.headers.get("x-worker-id", "")
    if not _claimed(service, compaction_id, request):
        raise JobError(
            403,
            f"this worker holds no claim on compaction {compaction_id!r}",
            param="X-Job-Token",
        )
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
    record = await run_in_threadpool(
        service.accept_result, compaction_id, worker_id, upload
    )
    return record.public()


@router.post(f"{WORKER_PREFIX}/jobs/{{compaction_id}}/fail", include_in_schema=False)
@_guard
async def worker_fail(
    compaction_id: str,
    body: FailReport,
    request: Request,
    service: CompactionService = Depends(worker_service),
):
    if not _claimed(service, compaction_id, request):
        return error_response(
            403,
            f"this worker holds no claim on compaction {compaction_id!r}",
            param="X-Job-Token",
        )
    if body.retryable:
        service.book.retry_or_fail(compaction_id, body.worker_id, body.error)
    else:
        service.book.fail(compaction_id, body.worker_id, body.error)
    return {"ok": True}
