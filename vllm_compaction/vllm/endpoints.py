"""The ``vllm.endpoint_plugins`` entry point: the compaction API inside vLLM's OpenAI server.

Loaded only when named in ``VLLM_PLUGINS`` (``vllm-compaction serve`` sets it). It adds
``/v1/compact`` and the worker protocol (``service.api``), starts the local workers, and wraps
``POST /v1/chat/completions`` and ``/v1/completions``: a request with ``compaction_id`` or
``conversation_id`` (``extra_body``) is planned by the service, and when its prefix is served
compacted, the stock handler receives the placeholder ids (through the decode-side
``kv_transfer_params.prompt_token_ids`` of chat requests, or the prompt of completions) and the
prefix's ``cache_salt``. ``usage`` then also reports logical and physical prompt tokens.
"""

import json
import logging
from argparse import Namespace
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from vllm_compaction.service.api import RequestGuard, error_response, owner_of
from vllm_compaction.service.api import router as service_router
from vllm_compaction.service.jobs import JobError
from vllm_compaction.service.service import PrefixPlan
from vllm_compaction.vllm.prompt import PLACEHOLDER_TOKEN_ID, CompactedRef

__all__ = ["CompactionEndpoints", "ENDPOINT_PLUGIN_NAME"]

logger = logging.getLogger(__name__)

ENDPOINT_PLUGIN_NAME = "vllm_compaction_api"


def _stock():
    from vllm.entrypoints.openai.chat_completion import api_router as chat_api
    from vllm.entrypoints.openai.completion import api_router as completion_api

    return chat_api, completion_api


def _build_router() -> APIRouter:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import validate_json_request

    chat_api, completion_api = _stock()
    router = APIRouter()

    @router.post(
        "/v1/chat/completions",
        dependencies=[Depends(validate_json_request)],
        summary="Chat completion; extra_body compaction_id / conversation_id serve a compacted prefix",
    )
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        extra = request.model_extra or {}
        compaction_id, conversation_id = (
            extra.get("compaction_id"),
            extra.get("conversation_id"),
        )
        if compaction_id is None and conversation_id is None:
            return await chat_api.create_chat_completion(request, raw_request)
        service = getattr(raw_request.app.state, "compaction_service", None)
        if service is None:
            return error_response(
                503, "compacted prefixes are not enabled on this server"
            )
        try:
            plan = await run_in_threadpool(
                service.plan_chat,
                owner_of(raw_request),
                request.messages,
                compaction_id=compaction_id,
                conversation_id=conversation_id,
            )
        except JobError as exc:
            return error_response(exc.status, str(exc))
        if plan is not None:
            if request.echo:
                return error_response(
                    400, "echo is not supported with a compacted prefix"
                )
            request.kv_transfer_params = {
                **(request.kv_transfer_params or {}),
                "prompt_token_ids": _prompt_ids(plan),
            }
            request.cache_salt = _salt(plan)
        response = await _serve(
            chat_api.create_chat_completion(request, raw_request), plan, service
        )
        return _with_usage(response, plan)

    @router.post(
        "/v1/completions",
        dependencies=[Depends(validate_json_request)],
        summary="Completion; extra_body compaction_id makes the prompt continue a compacted prefix",
    )
    async def completions(request: CompletionRequest, raw_request: Request):
        compaction_id = (request.model_extra or {}).get("compaction_id")
        if compaction_id is None:
            return await completion_api.create_completion(request, raw_request)
        service = getattr(raw_request.app.state, "compaction_service", None)
        if service is None:
            return error_response(
                503, "compacted prefixes are not enabled on this server"
            )
        prompt = request.prompt
        if (
            isinstance(prompt, list)
            and len(prompt) == 1
            and isinstance(prompt[0], (str, list))
        ):
            prompt = prompt[0]
        if not isinstance(prompt, (str, list)) or request.echo:
            return error_response(
                400,
                "with compaction_id, prompt must be one text or one list of token "
                "ids, and echo is not supported",
            )
        try:
            plan = await run_in_threadpool(
                service.plan_text, owner_of(raw_request), compaction_id, prompt
            )
        except JobError as exc:
            return error_response(exc.status, str(exc))
        request.prompt = _prompt_ids(plan)
        request.cache_salt = _salt(plan)
        response = await _serve(
            completion_api.create_completion(request, raw_request), plan, service
        )
        return _with_usage(response, plan)

    return router


async def _serve(handler: Any, plan: PrefixPlan | None, service: Any) -> Any:
    """Await the stock handler; when it fails on a compacted prefix (an exception or a 5xx), say
    so if the cache is the cause (and quarantine it) instead of a bare internal error."""
    try:
        response = await handler
    except Exception:
        if (explained := await _cache_error(plan, service)) is None:
            raise
        return explained
    if isinstance(response, JSONResponse) and response.status_code >= 500:
        return await _cache_error(plan, service) or response
    return response


async def _cache_error(plan: PrefixPlan | None, service: Any) -> JSONResponse | None:
    """A 500 naming what is wrong with the plan's cache, or None when the cache is sound."""
    if (
        plan is None
        or (problem := await run_in_threadpool(service.diagnose, plan.compaction_id))
        is None
    ):
        return None
    return error_response(
        500,
        f"The compacted cache of {plan.compaction_id} could not be loaded: {problem}. "
        f"Send the full conversation to be served without it.",
    )


def _prompt_ids(plan: PrefixPlan) -> list[int]:
    return [PLACEHOLDER_TOKEN_ID] * plan.num_slots + list(plan.continuation_ids)


def _salt(plan: PrefixPlan) -> str:
    return CompactedRef(
        plan.compaction_id, plan.num_slots, plan.digest, plan.layout
    ).salt


def _usage_fields(plan: PrefixPlan) -> dict[str, Any]:
    return {
        "logical_prompt_tokens": plan.logical_prompt_tokens,
        "physical_prompt_tokens": plan.physical_prompt_tokens,
        "compaction_id": plan.compaction_id,
    }


def _patch_usage(payload: dict, plan: PrefixPlan) -> dict:
    if isinstance(payload.get("usage"), dict):
        payload["usage"].update(_usage_fields(plan))
    return payload


def _with_usage(response: Any, plan: PrefixPlan | None) -> Any:
    """Add logical/physical prompt tokens to ``usage`` (the body, or the streamed usage chunk)."""
    if plan is None:
        return response
    if isinstance(response, JSONResponse) and response.status_code == 200:
        payload = _patch_usage(json.loads(bytes(response.body)), plan)
        headers = {
            k: v
            for k, v in response.headers.items()
            if k.lower() not in ("content-length", "content-type")
        }
        return JSONResponse(
            payload, status_code=200, headers=headers, background=response.background
        )
    if isinstance(response, StreamingResponse):
        original = response.body_iterator

        async def patched():
            async for chunk in original:
                text = chunk.decode() if isinstance(chunk, bytes) else chunk
                if '"usage":{' in text.replace(" ", ""):
                    text = "".join(
                        _patch_sse_line(line, plan)
                        for line in text.splitlines(keepends=True)
                    )
                yield text

        response.body_iterator = patched()
    return response


def _patch_sse_line(line: str, plan: PrefixPlan) -> str:
    if not line.startswith("data: ") or line.strip() == "data: [DONE]":
        return line
    end = line[len(line.rstrip("\r\n")) :]
    try:
        payload = json.loads(line[6:])
    except ValueError:
        return line
    return "data: " + json.dumps(_patch_usage(payload, plan)) + end


class CompactionEndpoints:
    """``vllm.endpoint_plugins`` factory result (see vLLM's ``EndpointPlugin`` protocol)."""

    name = ENDPOINT_PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(service_router)
        app.include_router(_build_router())
        # reserved salts on every route, body limits on /v1/compact
        app.add_middleware(RequestGuard)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        state.compaction_service = None
        if engine_client is None:
            return
        from vllm_compaction.vllm.service_setup import start_service

        try:
            state.compaction_service = await start_service(
                engine_client.vllm_config, args
            )
        except (
            Exception
        ) as exc:  # the OpenAI server keeps serving; compaction routes answer 503
            logger.error(
                "vllm-compaction: the compaction service did not start: %s", exc
            )
