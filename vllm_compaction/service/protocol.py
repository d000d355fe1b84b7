"""Wire types of the compaction API (``/v1/compact``) and of the worker protocol.

Everything a client or a worker sends or receives is one of these pydantic models, so the
server's OpenAPI schema documents them and bad input is refused with a 4xx and a sentence.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ChatMessage",
    "CompactRequest",
    "Compaction",
    "CompactionList",
    "CompactionDeleted",
    "JobStatus",
    "MethodName",
    "QUERY_SOURCES",
    "QuerySources",
    "expand_queries",
    "WorkerInfo",
    "WorkerJob",
    "ClaimRequest",
    "Heartbeat",
    "HeartbeatReply",
    "FailReport",
    "normalize_messages",
]

QUERY_SOURCES = (
    "repeat-prefill",
    "repeat-chat",
    "surprise-quote",
    "surprise-number-quote",
    "surprise-entity-quote",
    "surprise-name-quote",
    "surprise-cloze",
    "surprise-recap",
    "quote-prefill",
    "context-prefill",
    "self-study",
    "mix",
)
"""The query sources the API accepts, alone or joined by ``+`` (``repeat-prefill+surprise-quote``),
each optionally weighted (``surprise-quote*4``) and, for the surprise sources, spaced (``surprise-quote/80``:
one probe per 80 content tokens; ``surprise-quote/auto``: by the ratio); ``mix`` is self-study plus
repeat-prefill."""
_QUERY_ALIASES = {"mix": "self-study+repeat-prefill"}


def check_method(method: str) -> str:
    """``method`` unchanged if it is a method spec ``compact()`` takes (``vllm_compaction.recipes``)."""
    # torch only once a method is checked
    from vllm_compaction.recipes import (
        check_method as check,
    )

    return check(method)


def check_queries(queries: str) -> str:
    """``queries`` unchanged if it names API query sources, alone or joined by '+' (each once),
    each optionally weighted as ``name*k`` (its queries count k times in the fits)."""
    from vllm_compaction.queries import parse_sources, resolve_spacing, split_source

    # ValueError for a bad weight or spacing
    parts = [split_source(p) for p in queries.split("+")]
    names = [name for name, _, _ in parts]
    if any(n not in QUERY_SOURCES for n in names) or len(set(names)) != len(names):
        raise ValueError(
            f"queries must be one of {', '.join(QUERY_SOURCES)} or several joined by '+' "
            f"(each once, optionally weighted as name*k), got {queries!r}"
        )
    aliases = [
        n for n, per, w in parts if (w > 1 or per is not None) and n in _QUERY_ALIASES
    ]
    if aliases:
        raise ValueError(
            f"a weight (*k) or spacing (/n) applies to sources that run probes, not to the alias "
            f"{aliases[0]!r}; weight or space its parts ({_QUERY_ALIASES[aliases[0]]})"
        )
    # the library's own refusals (a weight on context-prefill); any ratio checks an '/auto'
    expanded = expand_queries(queries)
    assert expanded is not None  # an empty spec names no source and was refused above
    parse_sources(resolve_spacing(expanded, 0.1))
    return queries


def check_layer_share(method: str, min_layer_share: float | None) -> None:
    """ValueError unless ``min_layer_share`` is unset, 0, or used with a global-budget method."""
    from vllm_compaction.recipes import RECIPES, resolve

    if min_layer_share is None:
        return
    try:
        resolve(method, options={"min_layer_share": min_layer_share})
    except (
        ValueError
    ) as error:  # name the methods: API users choose a method, not a budget mode
        global_methods = ", ".join(
            m for m, r in RECIPES.items() if r.budgets == "global"
        )
        raise ValueError(
            f"{error} (method {method!r}; methods with global budgets: {global_methods})"
        ) from None


#: A compaction method spec (``vllm_compaction.recipes``), checked (requests and server flags).
MethodName = Annotated[str, AfterValidator(check_method)]
#: API query sources, alone or joined by '+' (requests and server flags).
QuerySources = Annotated[str, AfterValidator(check_queries)]


def expand_queries(queries: str | None) -> str | None:
    """The pipeline's query source for API names (aliases expanded, each source once)."""
    if not queries:
        return None
    expanded = "+".join(_QUERY_ALIASES.get(p, p) for p in queries.split("+")).split("+")
    # "mix+repeat-prefill" names repeat-prefill once
    return "+".join(dict.fromkeys(expanded))


class JobStatus(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


class ChatMessage(BaseModel):
    """One OpenAI chat message with text content (a string or a list of text parts)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text message content can be compacted")
            parts.append(part["text"])
        return "".join(parts)


def normalize_messages(messages: list[Any]) -> list[dict[str, str]]:
    """OpenAI messages (dicts or models, string or text-part content) -> ``[{role, content}]``.

    ValueError (one sentence) for anything that is not a non-empty list of text messages.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, raw in enumerate(messages):
        if isinstance(raw, BaseModel):
            raw = raw.model_dump()
        try:
            message = ChatMessage.model_validate(raw)
            out.append({"role": message.role, "content": message.text()})
        except ValueError as exc:
            raise ValueError(
                f"messages[{i}] is not a text chat message: {_first_error(exc)}"
            ) from None
    return out


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    return str(exc)


#: Bounds of a compaction request: more tokens than any model's context, more messages and text
#: than a conversation holds (a request over them is a 400 naming the field, before any work).
MAX_TOKENS = 1 << 20
MAX_MESSAGES = 10_000
MAX_TEXT_CHARS = 8_000_000


def _check_size(messages: list[dict[str, Any]] | None, prompt: str | None) -> None:
    if messages is not None and len(messages) > MAX_MESSAGES:
        raise ValueError(
            f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}"
        )
    chars = len(prompt or "") + sum(
        len(str(m.get("content", ""))) for m in messages or () if isinstance(m, dict)
    )
    if chars > MAX_TEXT_CHARS:
        raise ValueError(
            f"{'messages' if messages is not None else 'prompt'}: at most {MAX_TEXT_CHARS} characters "
            f"of text, got {chars}"
        )


class CompactRequest(BaseModel):
    """``POST /v1/compact``: what to compact and how far."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    conversation_id: str | None = Field(
        None, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$"
    )
    ratio: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="slots kept per head / content tokens",
    )
    target_tokens: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="slots kept per head, absolute"
    )
    method: MethodName = Field(
        "am",
        max_length=300,
        description="a method, optionally with ':key=value,...' "
        "overrides; am (default) is the recommended configuration",
    )
    queries: QuerySources | None = Field(
        None, max_length=200, description="query source, or several joined by '+'"
    )
    keep_last_tokens: int = Field(
        0, ge=0, le=MAX_TOKENS, description="the last content tokens stay exact"
    )
    max_head_ratio: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="cap on any one head's slots / content tokens (default: none where the engine holds "
        "prefixes varlen; 3 x ratio where it pads every head to the longest)",
    )
    min_layer_share: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="global-budget methods: every layer first keeps this share of an equal split of "
        "the slots, the rest is ranked across layers (default 0; 0.3 measured best for needles)",
    )
    summarize: bool = Field(
        False,
        description="the model summarizes the conversation first and the summary is compacted "
        "(summarize + AM): far smaller, and it loses what the summary leaves out",
    )
    summary_tokens: int = Field(
        256, ge=1, le=4096, description="with summarize: the summary's most tokens"
    )

    @model_validator(mode="after")
    def _one_source_one_size(self) -> CompactRequest:
        _check_size(self.messages, self.prompt)
        if self.summarize and self.keep_last_tokens:
            raise ValueError(
                "keep_last_tokens cannot be combined with summarize: the summary replaces "
                "every message"
            )
        sources = [
            x is not None for x in (self.messages, self.prompt, self.conversation_id)
        ]
        if sum(sources) == 0:
            raise ValueError("give one of messages, prompt or conversation_id")
        if self.messages is not None and self.prompt is not None:
            raise ValueError("give messages or prompt, not both")
        if (self.ratio is None) == (self.target_tokens is None):
            raise ValueError(
                "give exactly one of ratio (0 < ratio <= 1) or target_tokens"
            )
        check_layer_share(self.method, self.min_layer_share)
        return self

    def query_source(self) -> str | None:
        return expand_queries(self.queries)


class Compaction(BaseModel):
    """The compaction object returned by every ``/v1/compact`` route."""

    id: str
    object: Literal["compaction"] = "compaction"
    status: JobStatus
    created: int
    model: str
    method: str
    queries: str | None = None
    ratio_requested: float | None = None
    target_tokens: int | None = None
    keep_last_tokens: int = 0
    max_head_ratio: float | None = None
    min_layer_share: float | None = None
    conversation_id: str | None = None
    original_tokens: int = Field(
        description="tokens of the conversation the prefix stands in for: its logical length "
        "T, unless summarized"
    )
    summarize: bool = False
    summary_tokens: int = 256
    prefix_tokens: int | None = Field(
        None,
        description="logical length of the served prefix once made: original_tokens, or the "
        "summary's with summarize",
    )
    messages_covered: int = Field(
        description="how many leading messages the prefix stands in for"
    )
    progress: float = 0.0
    stage: str | None = None
    worker_id: str | None = None
    attempts: int = Field(
        0,
        description="times a worker started the job (a job whose worker died runs again, "
        "a bounded number of times)",
    )
    compacted_tokens: int | None = Field(
        None,
        description="physical prompt tokens P the prefix takes in the "
        "engine (its layout: packed heads, or the longest head)",
    )
    layout: str | None = Field(
        None,
        description="how the prefix sits in the engine's KV blocks: varlen "
        "(each head only its own slots) or padded",
    )
    compacted_slots: int | None = Field(
        None, description="KV slots kept, summed over layers and heads"
    )
    ratio: float | None = Field(None, description="compacted_tokens / original_tokens")
    bytes_original: int | None = None
    bytes_compacted: int | None = None
    bytes_saved: int | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None


class CompactionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Compaction]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class CompactionDeleted(BaseModel):
    id: str
    object: Literal["compaction.deleted"] = "compaction.deleted"
    deleted: bool
    status: JobStatus


# ---------------------------------------------------------------------- worker protocol
class WorkerInfo(BaseModel):
    """``GET /compaction/worker/v1/info``: what a worker needs to compute compatible caches."""

    model: str = Field(
        description="checkpoint folder the engine serves (on the server's host)"
    )
    served_model_name: str
    fingerprint: dict[str, Any]
    lease_s: float
    heartbeat_s: float


class ClaimRequest(BaseModel):
    worker_id: str = Field(min_length=1, max_length=200)
    wait_s: float = Field(
        0.0, ge=0.0, le=30.0, description="long poll: wait this long for a job"
    )


class WorkerJob(BaseModel):
    """A claimed job: the inputs of ``pipeline.compact``."""

    id: str
    messages: list[dict[str, str]]
    ratio: float | None
    target_tokens: int | None
    method: str
    queries: str | None
    keep_last_tokens: int
    max_head_ratio: float = 1.0
    min_layer_share: float = 0.0
    summarize: bool = False
    summary_tokens: int = 256
    token: str = Field(
        "",
        description="the claim's secret: heartbeats, the result and a failure report of "
        "this job must carry it (X-Job-Token)",
    )


class Heartbeat(BaseModel):
    worker_id: str
    progress: float = Field(0.0, ge=0.0, le=1.0)
    stage: str | None = None


class HeartbeatReply(BaseModel):
    action: Literal["continue", "cancel"]


class FailReport(BaseModel):
    """``POST jobs/{id}/fail``: ``retryable`` when the computation died (killed, out of memory)
    rather than failed; the server then runs the job again while attempts remain."""

    worker_id: str
    error: str = Field(max_length=4000)
    retryable: bool = False
