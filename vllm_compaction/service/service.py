"""``CompactionService``: what the API routes and the worker protocol do, without HTTP or vLLM.

Client side: submit / get / list / cancel / delete compactions, and ``plan_chat`` /
``plan_text``, which decide how a completion request's prefix is served (compacted or as sent)
and trigger automatic compaction. Worker side: ``claim``, ``heartbeat``, ``accept_result``,
``fail``. The engine-specific step (placeholder ids + ``cache_salt``) is the caller's.
"""

from __future__ import annotations

import builtins
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_compaction.cache import (
    CacheError,
    CompactedCache,
    LocalDiskStore,
    ModelFingerprint,
    json_digest,
    read_metadata,
)
from vllm_compaction.models.chat import ChatTokenizer
from vllm_compaction.service.config import ServiceConfig
from vllm_compaction.service.conversations import ConversationBook
from vllm_compaction.service.files import StoreLock, write_atomically
from vllm_compaction.service.jobs import JobBook, JobError, JobRecord, new_compaction_id
from vllm_compaction.service.metrics import ServiceMetrics
from vllm_compaction.service.protocol import (
    CompactRequest,
    JobStatus,
    WorkerInfo,
    expand_queries,
    normalize_messages,
)

__all__ = ["CompactionService", "PrefixPlan"]

logger = logging.getLogger(__name__)

#: Default store limit: what is there now plus half the free disk, at most 64 GiB.
DEFAULT_STORE_LIMIT_BYTES = 64 << 30


def default_store_limit(root: Path) -> int:
    """The store's size limit when none is given: its current size plus half the free space of
    its disk, at most ``DEFAULT_STORE_LIMIT_BYTES``."""
    import shutil

    used = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    return min(DEFAULT_STORE_LIMIT_BYTES, used + shutil.disk_usage(root).free // 2)


#: Wait after an automatic compaction of a conversation failed before queuing another (doubling
#: with each failure in a row).
AUTO_RETRY_BACKOFF_S = 60.0

HEAD_CAP_FACTOR = 3.0
"""Default cap of one head's slots, as a multiple of the average ratio, when the engine holds
prefixes padded (the longest head sets their length). Varlen prefixes are not capped: caps cost
needle accuracy (benchmarks/results/head_caps.json) and save no memory there."""


@dataclass(frozen=True)
class PrefixPlan:
    """A request served from a compacted prefix: ``num_slots`` placeholders, then ``continuation_ids``."""

    compaction_id: str
    num_slots: int
    digest: str
    continuation_ids: list[int]
    logical_prefix_tokens: int
    layout: str = "padded"

    @property
    def physical_prompt_tokens(self) -> int:
        return self.num_slots + len(self.continuation_ids)

    @property
    def logical_prompt_tokens(self) -> int:
        return self.logical_prefix_tokens + len(self.continuation_ids)


class CompactionService:
    def __init__(
        self,
        config: ServiceConfig,
        *,
        model_path: str | Path,
        served_model_names: Sequence[str],
        fingerprint: ModelFingerprint,
        tokenizer: Any,
        kv_bytes_per_token: int,
        max_model_len: int,
        layout: str = "padded",
        block_size: int | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        if config.store is None:
            raise ValueError("the compaction service needs a store directory")
        self.config = config
        self.model_path = str(model_path)
        self.served_model_names = list(served_model_names)
        self.fingerprint = fingerprint
        self.chat = ChatTokenizer(tokenizer)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.max_model_len = max_model_len
        # how the engine holds prefixes
        self.layout, self.block_size, self.tensor_parallel_size = (
            layout,
            block_size,
            tensor_parallel_size,
        )
        self.store = LocalDiskStore(config.store, max_bytes=config.store_max_bytes)
        # unbounded by default would fill the disk in the end
        if self.store.max_bytes is None:
            self.store.max_bytes = default_store_limit(self.store.root)
        self.metrics = ServiceMetrics()
        self.conversations = ConversationBook(
            self.store.root / "conversations",
            quarantine_root=self.store.root / "quarantine" / "conversations",
        )
        # a second server on this store refuses to start
        self.lock = StoreLock(self.store.root)
        self._remove_leftovers()
        self.book = JobBook(
            self.store.root / "jobs",
            lease_s=config.worker_lease_s,
            on_change=self._job_changed,
            max_queued=config.max_queued_jobs,
            max_queued_per_owner=config.max_queued_per_key,
            quarantine_root=self.store.root / "quarantine" / "jobs",
            deadline_s=config.job_timeout_s,
            max_attempts=config.max_attempts,
            retry_backoff_s=config.retry_backoff_s,
        )
        self._results = threading.Lock()  # guards _result_locks
        self._result_locks: dict[str, threading.Lock] = {}
        # automatic compactions that failed, per (owner, conversation): (count, when); each failure
        # doubles the wait before the next try, so one that always fails is not re-queued every turn
        self._auto_failures: dict[tuple[str, str], tuple[int, float]] = {}
        # without --api-key every caller is one tenant: the Authorization header is not checked there,
        # so it must not partition compactions either (set by whoever starts the service)
        self.keyed_owners = True
        self.worker_token = config.worker_token or self._store_token()
        self.supervisor: Any = None  # the local workers, set by whoever starts them
        self.metrics.job_counts(self.book)  # jobs found in the store after a restart

    # ------------------------------------------------------------------ compactions
    def submit(
        self, request: CompactRequest, owner: str, idempotency_key: str | None = None
    ) -> JobRecord:
        """Queue a compaction; ``idempotency_key`` makes a retried request return the same job."""
        self.check_model(request.model)
        if idempotency_key is not None and not 0 < len(idempotency_key) <= 256:
            raise JobError(
                400,
                "Idempotency-Key must be 1 to 256 characters",
                param="Idempotency-Key",
            )
        if idempotency_key is None:
            # refused before the body is tokenized: a flood of 429s costs the server little
            self.book.check_room(owner)
        if request.messages is not None:
            messages = self._messages(request.messages)
        elif request.prompt is not None:
            messages = [{"role": "user", "content": request.prompt}]
        else:
            # CompactRequest asks for one of messages, prompt or conversation_id
            assert request.conversation_id is not None
            conversation = self.conversations.get(owner, request.conversation_id)
            if conversation is None or not conversation.messages:
                raise JobError(
                    404,
                    f"No conversation with id {request.conversation_id!r}: send a chat "
                    f"completion with this conversation_id first, or give messages.",
                )
            messages = conversation.messages
        record = self._record(
            messages,
            owner,
            model=request.model,
            method=request.method,
            queries=request.query_source(),
            ratio=request.ratio,
            target_tokens=request.target_tokens,
            keep_last_tokens=request.keep_last_tokens,
            max_head_ratio=request.max_head_ratio,
            min_layer_share=request.min_layer_share,
            conversation_id=request.conversation_id,
            summarize=request.summarize,
            summary_tokens=request.summary_tokens,
        )
        if idempotency_key is not None:
            record.idempotency_key = idempotency_key
            record.request_digest = json_digest(request.model_dump(mode="json"))
        return self.book.submit(record)

    def _record(
        self,
        messages: list[dict[str, str]],
        owner: str,
        *,
        model: str,
        method: str,
        queries: str | None,
        ratio: float | None,
        target_tokens: int | None,
        keep_last_tokens: int,
        conversation_id: str | None,
        max_head_ratio: float | None = None,
        min_layer_share: float | None = None,
        least_content: int = 0,
        summarize: bool = False,
        summary_tokens: int = 256,
    ) -> JobRecord:
        try:
            ids, mask = self.chat.chat_content(messages)
        except ValueError as exc:  # ChatTemplateError included
            raise JobError(
                400, f"cannot render the messages with the model's chat template: {exc}"
            ) from None
        if len(ids) > self.max_model_len:
            raise JobError(
                400,
                f"the conversation has {len(ids)} tokens, more than the model's "
                f"window of {self.max_model_len}",
            )
        content = int(mask.sum()) - keep_last_tokens
        if content <= least_content:
            raise JobError(
                400,
                f"nothing to compact: {int(mask.sum())} content tokens and "
                f"keep_last_tokens={keep_last_tokens}"
                + (
                    f" leave no more than the {least_content} to keep"
                    if least_content
                    else ""
                ),
            )
        if ratio is not None:
            average = ratio
        elif target_tokens is not None:
            average = min(1.0, target_tokens / content)
        else:
            raise JobError(400, "give exactly one of ratio or target_tokens")
        if max_head_ratio is None:
            max_head_ratio = (
                1.0 if self.layout == "varlen" else min(1.0, HEAD_CAP_FACTOR * average)
            )
        elif max_head_ratio < average:
            raise JobError(
                400,
                f"max_head_ratio={max_head_ratio} is below the average ratio {average:.4g}",
            )
        return JobRecord(
            id=new_compaction_id(),
            status=JobStatus.queued,
            created=int(time.time()),
            model=model,
            method=method,
            queries=queries,
            ratio_requested=ratio,
            target_tokens=target_tokens,
            keep_last_tokens=keep_last_tokens,
            max_head_ratio=max_head_ratio,
            min_layer_share=min_layer_share,
            conversation_id=conversation_id,
            original_tokens=len(ids),
            messages_covered=len(messages),
            owner=owner,
            messages=messages,
            summarize=summarize,
            summary_tokens=summary_tokens,
        )

    def get(self, compaction_id: str, owner: str) -> JobRecord:
        return self.book.get(compaction_id, owner)

    def list(
        self, owner: str, *, after: str | None = None, limit: int | None = None
    ) -> tuple[list[JobRecord], bool]:
        return self.book.page(owner, after=after, limit=limit)

    def cancel_or_delete(
        self, compaction_id: str, owner: str
    ) -> tuple[JobRecord, bool]:
        """Cancel a queued/running job; delete a finished one (and its cache). -> (job, deleted)."""
        record, deleted = self.book.cancel_or_delete(compaction_id, owner)
        if deleted:
            self.store.delete_id(compaction_id)
        return record, deleted

    def check_model(self, model: str) -> None:
        if model not in self.served_model_names:
            raise JobError(
                404,
                f"The model `{model}` does not exist; this server serves "
                f"{', '.join(self.served_model_names)}.",
            )

    # ------------------------------------------------------------------ serving plans
    def plan_chat(
        self,
        owner: str,
        raw_messages: builtins.list[Any],
        *,
        compaction_id: str | None = None,
        conversation_id: str | None = None,
    ) -> PrefixPlan | None:
        """How to serve a chat request: from a compacted prefix (a plan) or as sent (None).

        ``compaction_id``: the request's messages continue that compaction; if they start with
        the messages it covers, those are dropped. While the compaction is not (or no longer)
        usable, a request that carries the full conversation is served as sent; one that does
        not gets a 409/410. ``conversation_id``: the conversation's newest compaction is used
        when the messages start with what it covers, and a new one is queued once the prompt
        grows past the auto-compaction threshold.
        """
        if compaction_id is None and conversation_id is None:
            return None
        messages = self._messages(raw_messages)
        conversation = None
        if conversation_id is not None:
            _check_id(conversation_id, "conversation_id")
            conversation = self.conversations.get_or_create(owner, conversation_id)
        record = None
        if compaction_id is not None:
            _check_id(compaction_id, "compaction_id")
            record = self.book.get(compaction_id, owner)
        elif conversation is not None and conversation.compaction_id is not None:
            try:
                record = self.book.get(conversation.compaction_id, owner)
            except JobError:  # deleted since: serve as sent
                record = None
        plan = None
        if record is not None:
            plan = self._plan_from(record, messages, explicit=compaction_id is not None)
        if conversation_id is not None and conversation is not None:
            conversation.messages = messages
            self.conversations.save(conversation)
            self._maybe_auto_compact(owner, conversation_id, messages, plan)
        self.metrics.request("compacted" if plan else "original")
        return plan

    def plan_text(
        self, owner: str, compaction_id: str, continuation: str | builtins.list[int]
    ) -> PrefixPlan:
        """A completions request whose prompt (text or token ids) continues a compaction."""
        _check_id(compaction_id, "compaction_id")
        record = self.book.get(compaction_id, owner)
        if (unusable := self._unusable(record)) is not None:
            raise unusable
        try:
            ids = self.chat.continuation_ids(continuation)
        except ValueError as exc:
            raise JobError(400, str(exc)) from None
        if not ids:
            raise JobError(
                400,
                "the prompt is empty: at least one token must follow the compacted prefix",
            )
        self.metrics.request("compacted")
        return self._plan(record, ids)

    def _plan_from(
        self,
        record: JobRecord,
        messages: builtins.list[dict[str, str]],
        *,
        explicit: bool,
    ) -> PrefixPlan | None:
        covered = record.messages
        has_history = messages[: len(covered)] == covered
        if (unusable := self._unusable(record)) is not None:
            if has_history or not explicit:
                return None  # served from the messages as sent until the compaction is ready
            raise unusable
        rest = (
            messages[len(covered) :]
            if has_history
            else (messages if explicit else None)
        )
        if rest is None:
            return None  # the conversation diverged from what was compacted
        if not rest:
            raise JobError(
                400,
                f"no message follows the {len(covered)} messages that compaction "
                f"{record.id} covers",
            )
        try:
            ids = self.chat.turn_ids(rest, add_generation_prompt=True)
        except ValueError as exc:  # ChatTemplateError included
            raise JobError(
                400, f"cannot render the messages with the model's chat template: {exc}"
            ) from None
        return self._plan(record, ids)

    def _unusable(self, record: JobRecord) -> JobError | None:
        """Why ``record`` cannot serve a request now (409 not ready or failed, 410 evicted), or None."""
        if record.status == JobStatus.succeeded:
            if not self.store.contains_id(record.id):
                return JobError(
                    410,
                    f"The compacted cache of {record.id} is no longer in the store "
                    f"(evicted or deleted); send the full conversation instead.",
                )
            return None
        if record.status.finished:
            return JobError(
                409,
                f"Compaction {record.id} {record.status.value}"
                f"{': ' + record.error if record.error else ''}; send the full "
                f"conversation to be served without it.",
            )
        return JobError(
            409,
            f"Compaction {record.id} is {record.status.value} ({record.progress:.0%}); "
            f"until it succeeds, send the full conversation to be served without it.",
        )

    def _plan(
        self, record: JobRecord, continuation_ids: builtins.list[int]
    ) -> PrefixPlan:
        # the engine reads the file itself: keep LRU order by use
        self.store.touch_id(record.id)
        # not evicted while the engine loads it; its first use ends the hold it had as new,
        # so a used cache competes by recency like every other
        self.store.hold(record.id, self.config.serving_hold_s, replace=True)
        return PrefixPlan(
            record.id,
            int(record.compacted_tokens or 0),
            (record.digest or "")[:32],
            continuation_ids,
            record.prefix_tokens or record.original_tokens,
            record.layout or "padded",
        )

    def _maybe_auto_compact(
        self,
        owner: str,
        conversation_id: str,
        messages: builtins.list[dict[str, str]],
        plan: PrefixPlan | None,
    ) -> None:
        threshold = self.config.auto_compact_threshold_tokens
        if threshold is None:
            return
        if plan is not None:
            physical = plan.physical_prompt_tokens
        else:
            physical = len(self.chat.chat_ids(messages, add_generation_prompt=True))
        if physical <= threshold or self.book.active_for_conversation(
            conversation_id, owner
        ):
            return
        failures, when = self._auto_failures.get((owner, conversation_id), (0, 0.0))
        if failures and time.time() < when + AUTO_RETRY_BACKOFF_S * 2 ** (failures - 1):
            return
        cfg = self.config
        target = cfg.auto_compact_target_tokens
        try:
            record = self._record(
                messages,
                owner,
                model=self.served_model_names[0],
                method=cfg.auto_compact_method,
                queries=expand_queries(cfg.auto_compact_queries),
                ratio=None if target else cfg.auto_compact_ratio,
                target_tokens=target,
                keep_last_tokens=cfg.auto_compact_keep_last_tokens,
                min_layer_share=cfg.auto_compact_min_layer_share,
                conversation_id=conversation_id,
                least_content=target or 0,
            )
            record.auto = True
            self.book.submit(record)
        except (
            JobError,
            OSError,
        ) as exc:  # a full queue or disk: the request is served all the same
            logger.warning(
                "no automatic compaction of conversation %s: %s", conversation_id, exc
            )
            return
        logger.info(
            "conversation %s has %d physical prompt tokens (> %d): queued compaction %s",
            conversation_id,
            physical,
            threshold,
            record.id,
        )

    def diagnose(self, compaction_id: str) -> str | None:
        """After the engine failed a request on this compaction: the reason, if its cache is bad.

        A corrupt cache is quarantined, so later requests are served from the full messages (or
        get a 410) instead of failing again.
        """
        problem = self.store.verify_id(compaction_id, expect_model=self.fingerprint)
        if problem is not None:
            logger.error(
                "compacted cache of %s is unusable: %s", compaction_id, problem
            )
            # clients see no server paths
            problem = problem.replace(str(self.store.root), "the store")
        return problem

    # ------------------------------------------------------------------ worker protocol
    def worker_info(self) -> WorkerInfo:
        return WorkerInfo(
            model=self.model_path,
            served_model_name=self.served_model_names[0],
            fingerprint=self.fingerprint.to_dict(),
            lease_s=self.config.worker_lease_s,
            heartbeat_s=self.config.heartbeat_s,
        )

    def accept_result(
        self, compaction_id: str, worker_id: str, upload: Path
    ) -> JobRecord:
        """Verify a worker's cache file, move it into the store and finish the job. Uploads for
        one job are taken one at a time: a second (a retry) finds the job finished and gets a 409,
        and nothing of the first is touched."""
        with self._results:
            lock = self._result_locks.setdefault(compaction_id, threading.Lock())
        try:
            with lock:
                return self._accept_result(compaction_id, worker_id, upload)
        finally:
            with self._results:
                if not lock.locked():
                    self._result_locks.pop(compaction_id, None)

    def _accept_result(
        self, compaction_id: str, worker_id: str, upload: Path
    ) -> JobRecord:
        try:
            record = self.book.get(compaction_id)
            if record.status != JobStatus.running or record.worker_id != worker_id:
                raise JobError(
                    409,
                    f"Compaction {compaction_id!r} is not running on worker {worker_id!r} "
                    f"(it is {record.status.value}).",
                )

            def check(cache: CompactedCache) -> None:
                # a summary's length is the model's to choose, within the window
                if record.summarize:
                    if not 0 < cache.logical_length <= self.max_model_len:
                        raise CacheError(
                            f"the summarized cache covers {cache.logical_length} tokens, "
                            f"outside the model's window of {self.max_model_len}"
                        )
                elif cache.logical_length != record.original_tokens:
                    raise CacheError(
                        f"the cache covers {cache.logical_length} tokens, the job "
                        f"{record.original_tokens}"
                    )

            try:
                cache = self.store.put_file(
                    compaction_id, upload, expect_model=self.fingerprint, check=check
                )
            except CacheError as exc:
                self.book.fail(
                    compaction_id, worker_id, f"the worker's cache was rejected: {exc}"
                )
                raise JobError(422, f"the uploaded cache was rejected: {exc}") from None
        finally:
            upload.unlink(missing_ok=True)
        digest = read_metadata(self.store.path_for(compaction_id))["tensors_sha256"]
        # sizes against the conversation the prefix stands in for (a summary's is shorter)
        physical, original = (
            cache.physical_tokens(
                self.layout, self.block_size, self.tensor_parallel_size
            ),
            record.original_tokens,
        )
        result = {
            "compacted_tokens": physical,
            "prefix_tokens": cache.logical_length,
            "layout": self.layout,
            "compacted_slots": cache.physical_slots,
            "ratio": physical / original,
            "bytes_original": original * self.kv_bytes_per_token,
            "bytes_compacted": physical * self.kv_bytes_per_token,
            "bytes_saved": (original - physical) * self.kv_bytes_per_token,
            "timings": {
                **record.timings,
                **{k: float(v) for k, v in cache.timings.items()},
            },
            "digest": digest,
            "stage": "done",
        }
        try:
            return self.book.succeed(compaction_id, worker_id, result)
        except JobError:
            # cancelled while uploading: keep nothing
            self.store.delete_id(compaction_id)
            raise

    # ------------------------------------------------------------------ internals
    def _messages(self, raw: builtins.list[Any]) -> builtins.list[dict[str, str]]:
        try:
            return normalize_messages(
                list(raw) if isinstance(raw, (list, tuple)) else raw
            )
        except ValueError as exc:
            raise JobError(400, str(exc)) from None

    def _job_changed(self, record: JobRecord) -> None:
        self.metrics.job_changed(self.book, record)
        if record.status == JobStatus.succeeded:
            # made for a client who has not read it yet
            self.store.hold(record.id, self.config.fresh_hold_s)
        if record.auto and record.conversation_id and record.status.finished:
            key = (record.owner, record.conversation_id)
            if record.status == JobStatus.failed:
                self._auto_failures[key] = (
                    self._auto_failures.get(key, (0, 0.0))[0] + 1,
                    time.time(),
                )
            else:
                self._auto_failures.pop(key, None)
        if record.status == JobStatus.succeeded and record.conversation_id:
            replaced = self.conversations.adopt(
                record.owner, record.conversation_id, record.id, record.messages_covered
            )
            self._collect(replaced)

    def _remove_leftovers(self) -> None:
        """Temporary files of a server that died here (uploads, half-written records): with the
        store's lock held nobody else writes them, so they can never complete."""
        root = self.store.root
        for pattern in (
            ".upload-*.tmp",
            "jobs/.*.tmp",
            "conversations/.*.tmp",
            ".worker-token.*.tmp",
        ):
            for leftover in root.glob(pattern):
                leftover.unlink(missing_ok=True)
                logger.info(
                    "removed %s, left by a server that stopped mid-write", leftover.name
                )

    def _collect(self, compaction_id: str | None) -> None:
        """Delete a conversation's previous automatic compaction (its cache and record) once a
        newer one stands in for it: nobody asked for it by id, and nothing serves it any more."""
        if compaction_id is None:
            return
        try:
            record = self.book.get(compaction_id)
        except JobError:
            return
        if record.auto and record.status.finished:
            self.book.delete(compaction_id)
            self.store.delete_id(compaction_id)
            logger.info(
                "collected compaction %s, superseded in conversation %s",
                compaction_id,
                record.conversation_id,
            )

    def _store_token(self) -> str:
        """The worker token shared through the store directory (mode 0600), made on first use."""
        path = self.store.root / "worker-token"
        if not path.is_file():
            write_atomically(path, secrets.token_urlsafe(32), mode=0o600)
        return path.read_text().strip()


def _check_id(value: Any, what: str) -> None:
    if not isinstance(value, str) or not value or len(value) > 128:
        raise JobError(
            400, f"{what} must be a non-empty string of at most 128 characters"
        )
