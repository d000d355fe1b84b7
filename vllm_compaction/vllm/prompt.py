"""Prompts that start from a compacted prefix: ``compacted_prompt(cache, continuation)``.

A compacted prompt is ``P`` placeholder token ids followed by the continuation's ids, plus a
``cache_salt`` naming the store entry and the layout. ``P`` is what the prefix occupies in the
engine: for the ``varlen`` layout about ``sum(t) / (L * H)`` rounded up to whole blocks, for the
``padded`` one the longest head (:mod:`.layout`). The connector reads the
salt, claims the placeholders as already computed and writes the cache's slots into their pages,
so placeholders are never prefilled as text. The salt also keys vLLM's prefix cache: requests on
the same cache share the loaded pages, and different caches (or a changed entry) never do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from vllm_compaction.cache import (
    CacheError,
    CompactedCache,
    LocalDiskStore,
    json_digest,
    read_metadata,
    tensors_digest,
)
from vllm_compaction.cache.format import ModelFingerprint
from vllm_compaction.models.chat import ChatTokenizer, Continuation
from vllm_compaction.vllm.backend_common import page_width
from vllm_compaction.vllm.layout import DEFAULT_LAYOUT, LAYOUTS, bias_free

__all__ = [
    "CompactedRef",
    "PLACEHOLDER_TOKEN_ID",
    "compacted_prompt",
    "default_store_dir",
    "open_store",
]

PLACEHOLDER_TOKEN_ID = 0
"""Token id of the placeholder positions; never embedded, since the connector claims them."""

_SALT_RE = re.compile(
    r"vllm-compaction:3:(varlen|padded):([A-Za-z0-9_-]{1,128}):(\d{1,9}):([0-9a-f]{32})"
)


def default_store_dir() -> Path:
    """``$VLLM_COMPACTION_HOME/store`` (default ``~/.cache/vllm-compaction/store``)."""
    from vllm_compaction.models.prepare import home

    return home() / "store"


def open_store(root: str | Path | None = None) -> LocalDiskStore:
    return LocalDiskStore(root or default_store_dir())


@dataclass(frozen=True)
class CompactedRef:
    """What a request's ``cache_salt`` says about its compacted prefix."""

    entry_id: str
    num_slots: int
    digest: str  # first 32 hex of the entry's tensors_sha256: a changed entry is a new prefix
    layout: str = (
        "padded"  # "varlen" (packed heads) or "padded" (every head at the longest)
    )

    @property
    def salt(self) -> str:
        return f"vllm-compaction:3:{self.layout}:{self.entry_id}:{self.num_slots}:{self.digest}"

    @classmethod
    def parse(cls, salt: str | None) -> CompactedRef | None:
        """The reference in ``salt``, or None for an ordinary request."""
        if not salt or not salt.startswith("vllm-compaction:"):
            return None
        match = _SALT_RE.fullmatch(salt)
        if match is None:
            raise ValueError(f"malformed compaction cache_salt {salt!r}")
        return cls(match.group(2), int(match.group(3)), match.group(4), match.group(1))


def _entry_for(
    cache: CompactedCache | str,
    store: LocalDiskStore,
    expect_model: ModelFingerprint | None,
) -> tuple[str, CompactedCache]:
    if isinstance(cache, CompactedCache):
        if expect_model is not None:
            cache.model.check_compatible(expect_model)
        key = cache.fingerprint_key()
        entry_id = key[:40]
        if store.contains_id(entry_id):
            digest = tensors_digest(cache)
            if read_metadata(store.path_for(entry_id))["tensors_sha256"] != digest:
                # the same prefix and settings, other content (fitted again, or edited): an
                # entry of its own, never the stored one in its place
                entry_id = json_digest([key, digest])[:40]
        if not store.contains_id(entry_id):
            store.put_id(entry_id, cache)
        return entry_id, cache
    if not isinstance(cache, str):
        raise TypeError(
            f"cache must be a CompactedCache or a store entry id, not {type(cache).__name__}"
        )
    path = store.path_for(cache)
    if not path.is_file():
        raise CacheError(f"No compacted cache {cache!r} in the store at {store.root}.")
    return cache, CompactedCache.load(path, expect_model=expect_model)


def _continuation_ids(continuation: Continuation, tokenizer) -> list[int]:
    # a one-shot iterable of ids or messages is read once, here
    items = (
        continuation
        if isinstance(continuation, str)
        else cast(Continuation, list(continuation))
    )
    if tokenizer is None and (
        isinstance(items, str) or any(isinstance(m, dict) for m in items)
    ):
        raise ValueError(
            "a text or chat continuation needs the tokenizer (pass llm= or tokenizer=)"
        )
    return ChatTokenizer(tokenizer).continuation_ids(items)


def compacted_prompt(
    cache: CompactedCache | str,
    continuation: Continuation,
    *,
    llm: Any = None,
    tokenizer: Any = None,
    store: LocalDiskStore | str | Path | None = None,
    layout: str | None = None,
    block_size: int | None = None,
    tensor_parallel_size: int = 1,
) -> dict:
    """A vLLM ``TokensPrompt`` dict that continues ``cache`` with ``continuation``.

    Args:
        cache: a ``CompactedCache`` (stored on the fly under a content-derived id) or the id of
            an entry already in ``store``.
        continuation: text, token ids, or chat messages (rendered as turns that continue the
            cached conversation, ending with the assistant generation prompt).
        llm: a ``vllm.LLM``; supplies the tokenizer and the model the cache is checked against.
        store: the store the engine's connector reads (default :func:`default_store_dir`).
        layout: ``"varlen"`` (each head stores only its own slots) or ``"padded"`` (every head
            padded to the longest). Default: ``varlen`` when the block size is known (from
            ``llm`` or ``block_size``), else ``padded``. On stock-width pages ``padded`` takes
            only bias-free caches (every head the same length, beta = 0), which the stock
            kernels then read like ordinary tokens.
        block_size: the engine's KV block size, needed by ``varlen`` when ``llm`` is not given.
        tensor_parallel_size: the engine's, when ``llm`` is not given (each rank packs its own
            KV heads; the rank with the most rows sets the placeholder count).

    Raises:
        CacheError: missing, corrupt or wrong-model cache (one sentence saying which).
        ValueError: an empty or malformed continuation, or a layout this engine cannot hold.
    """
    from vllm_compaction.vllm.engine import engine_fingerprint

    store = store if isinstance(store, LocalDiskStore) else open_store(store)
    expect = None
    if llm is not None:
        tokenizer = tokenizer or llm.get_tokenizer()
        config = llm.llm_engine.vllm_config
        expect = engine_fingerprint(config.model_config)
        block_size = block_size or config.cache_config.block_size
        tensor_parallel_size = config.parallel_config.tensor_parallel_size
    layout = layout or (DEFAULT_LAYOUT if block_size else "padded")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if layout == "varlen" and not block_size:
        raise ValueError(
            "a varlen prefix needs the engine's block size (pass llm= or block_size=)"
        )
    entry_id, loaded = _entry_for(cache, store, expect)
    if (
        layout == "padded"
        and llm is not None
        and page_width(llm.llm_engine.vllm_config) != "widened"
        and not bias_free(loaded)
    ):
        raise ValueError(
            "this engine runs stock-width KV pages, which hold a padded prefix only when it needs "
            "no bias (every head the same length, beta = 0); use layout='varlen', or start the "
            "engine with engine_kwargs(..., pages='widened')"
        )
    ids = _continuation_ids(continuation, tokenizer)
    if not ids:
        raise ValueError(
            "the continuation is empty: at least one token must follow the compacted prefix"
        )
    digest = read_metadata(store.path_for(entry_id))["tensors_sha256"][:32]
    ref = CompactedRef(
        entry_id,
        loaded.physical_tokens(layout, block_size, tensor_parallel_size),
        digest,
        layout,
    )
    return {
        "prompt_token_ids": [PLACEHOLDER_TOKEN_ID] * ref.num_slots + ids,
        "cache_salt": ref.salt,
    }
