"""Compacted caches: the value, its safetensors file format and stores."""

from vllm_compaction.cache.format import (
    FORMAT_VERSION,
    CacheCorruptError,
    CacheError,
    CacheMismatchError,
    CompactedCache,
    ModelFingerprint,
    config_hash,
    json_digest,
    prefix_hash,
)
from vllm_compaction.cache.paged import PREFIX_LAYOUTS, PagedPacking
from vllm_compaction.cache.serialize import (
    load_cache,
    read_metadata,
    save_cache,
    tensors_digest,
)
from vllm_compaction.cache.store import (
    CacheKey,
    CacheStore,
    LocalDiskStore,
    validate_entry_id,
)

__all__ = [
    "FORMAT_VERSION",
    "CacheError",
    "CacheCorruptError",
    "CacheMismatchError",
    "CompactedCache",
    "ModelFingerprint",
    "PagedPacking",
    "PREFIX_LAYOUTS",
    "CacheKey",
    "CacheStore",
    "LocalDiskStore",
    "config_hash",
    "json_digest",
    "prefix_hash",
    "load_cache",
    "read_metadata",
    "save_cache",
    "tensors_digest",
    "validate_entry_id",
]
