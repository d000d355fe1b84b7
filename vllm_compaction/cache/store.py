"""Cache stores: the :class:`CacheKey`, the :class:`CacheStore` protocol and a local-disk store.

A key carries everything that makes two caches incompatible: the model fingerprint digest,
the prefix hash, the hash of how it was compacted and the format version. Stores also accept
opaque entry ids (``[A-Za-z0-9_-]{1,128}``); a key is stored under the id ``key.digest()``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from vllm_compaction.cache.format import (
    FORMAT_VERSION,
    CacheCorruptError,
    CacheError,
    CompactedCache,
    ModelFingerprint,
    config_hash,
    json_digest,
    prefix_hash,
)

__all__ = ["CacheKey", "CacheStore", "LocalDiskStore", "validate_entry_id"]

logger = logging.getLogger(__name__)

_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_SUFFIX = ".safetensors"
_STALE_TMP_S = 3600.0


def validate_entry_id(entry_id: str) -> str:
    """Return ``entry_id`` if it matches ``[A-Za-z0-9_-]{1,128}``, else raise ValueError."""
    if not isinstance(entry_id, str) or not _ID_RE.fullmatch(entry_id):
        raise ValueError(
            f"Cache entry id {entry_id!r} must match [A-Za-z0-9_-]{{1,128}}."
        )
    return entry_id


@dataclass(frozen=True)
class CacheKey:
    """Identity of a compacted cache: (model, prefix, compaction config, format version)."""

    model_digest: str
    prefix_hash: str
    config_hash: str
    format_version: int = FORMAT_VERSION

    def digest(self) -> str:
        """Hex sha256 of all fields; equals ``CompactedCache.fingerprint_key()``."""
        return json_digest(
            [self.format_version, self.model_digest, self.prefix_hash, self.config_hash]
        )

    @classmethod
    def for_cache(cls, cache: CompactedCache) -> CacheKey:
        """The key of an existing cache."""
        return cls(cache.model.digest(), cache.prefix_hash, cache.config_hash)

    @classmethod
    def for_request(
        cls,
        model: ModelFingerprint,
        token_ids: Sequence[int],
        *,
        method: str,
        ratio: float,
        options: dict[str, Any] | None = None,
        query_source: str = "",
        budgets: str = "",
    ) -> CacheKey:
        """The key a cache compacted with these settings would get (to look it up first)."""
        return cls(
            model.digest(),
            prefix_hash(token_ids),
            config_hash(method, ratio, options or {}, query_source, budgets),
        )


@runtime_checkable
class CacheStore(Protocol):
    """Where compacted caches live between the compaction worker and the engine."""

    def put(self, key: CacheKey, cache: CompactedCache) -> None: ...

    def get(self, key: CacheKey) -> CompactedCache | None: ...

    def contains(self, key: CacheKey) -> bool: ...

    def delete(self, key: CacheKey) -> bool: ...

    def keys(self) -> list[str]: ...


def _size(path: Path) -> int:
    """Bytes of a regular file; 0 for a directory or a file removed meanwhile."""
    try:
        return path.stat().st_size if path.is_file() else 0
    except FileNotFoundError:
        return 0


class LocalDiskStore:
    """One safetensors file per entry under ``root``; survives restarts (it is the directory).

    Writes are atomic. ``get`` verifies checksums: a corrupt entry is logged, moved to
    ``root/quarantine/`` and reported as a miss (``None``), so the caller recompacts; a
    cache of a newer format version raises :class:`CacheMismatchError` and stays in place.
    With ``max_bytes``, least recently used entries (file mtime, bumped on every ``get``) are
    evicted after a ``put`` until the total fits, never the entry just written nor an entry held
    (``hold``: in use by a request, or just finished). The total counts every file under ``root``
    (records and quarantined files beside the entries); quarantined files go first. All methods
    are thread-safe.
    """

    def __init__(self, root: str | Path, max_bytes: int | None = None) -> None:
        valid_int = (
            isinstance(max_bytes, int)
            and not isinstance(max_bytes, bool)
            and max_bytes >= 0
        )
        if max_bytes is not None and not valid_int:
            raise ValueError(
                f"max_bytes must be None or an int >= 0, got {max_bytes!r}."
            )
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._last_ns = 0
        self._held: dict[
            str, float
        ] = {}  # entry id -> monotonic time until which it is not evicted
        self._remove_stale_temps()

    def hold(self, entry_id: str, seconds: float, *, replace: bool = False) -> None:
        """Keep the entry from eviction for ``seconds`` (a request is reading it, or it was just
        made and nobody has read it yet); a later hold extends an earlier one, or with
        ``replace`` takes its place (the first use of a new entry ends its longer hold)."""
        with self._lock:
            until = time.monotonic() + seconds
            self._held[entry_id] = (
                until if replace else max(until, self._held.get(entry_id, 0.0))
            )

    # ------------------------------------------------------------------ keyed access
    def put(self, key: CacheKey, cache: CompactedCache) -> None:
        self.put_id(key.digest(), cache)

    def get(self, key: CacheKey) -> CompactedCache | None:
        return self.get_id(key.digest())

    def contains(self, key: CacheKey) -> bool:
        return self.contains_id(key.digest())

    def delete(self, key: CacheKey) -> bool:
        return self.delete_id(key.digest())

    def keys(self) -> list[str]:
        """Ids of all entries (a key's entry id is ``key.digest()``), sorted."""
        with self._lock:
            return sorted(p.name[: -len(_SUFFIX)] for p in self._entries())

    # ------------------------------------------------------------------ id access
    def put_id(self, entry_id: str, cache: CompactedCache) -> None:
        """Store ``cache`` under ``entry_id`` (replacing any entry), then evict if over budget."""
        path = self.path_for(entry_id)
        with self._lock:
            cache.save(path)
            self._touch(path)
            self._evict(keep=path)

    def put_file(
        self,
        entry_id: str,
        source: str | Path,
        *,
        expect_model: ModelFingerprint | None = None,
        check: Callable[[CompactedCache], None] | None = None,
    ) -> CompactedCache:
        """Verify the cache file ``source`` (checksums, model, ``check``) and move it in as ``entry_id``.

        ``source`` must be on the store's file system (the move is an atomic rename). Raises
        :class:`CacheError` and leaves the store untouched if the file is not a valid cache.
        """
        cache = CompactedCache.load(source, expect_model=expect_model)
        if check is not None:
            check(cache)
        path = self.path_for(entry_id)
        with self._lock:
            os.replace(source, path)
            self._touch(path)
            self._evict(keep=path)
        return cache

    def get_id(self, entry_id: str) -> CompactedCache | None:
        """The entry, or ``None`` if absent or corrupt (then quarantined); marks it as used."""
        path = self.path_for(entry_id)
        with self._lock:
            try:
                cache = self._load(path)
            except (FileNotFoundError, CacheCorruptError):
                return None
            self._touch(path)
            return cache

    def contains_id(self, entry_id: str) -> bool:
        return self.path_for(entry_id).is_file()

    def verify_id(
        self, entry_id: str, *, expect_model: ModelFingerprint | None = None
    ) -> str | None:
        """Read an entry fully: None if it is sound, else the reason (a corrupt entry is moved to
        ``quarantine/``; a wrong-model one stays)."""
        path = self.path_for(entry_id)
        with self._lock:
            try:
                self._load(path, expect_model)
            except FileNotFoundError:
                return f"no entry {entry_id!r} in the store at {self.root}"
            except CacheCorruptError as exc:
                return f"{exc} (moved to {self.root / 'quarantine'})"
            except CacheError as exc:
                return str(exc)
        return None

    def touch_id(self, entry_id: str) -> bool:
        """Mark an entry as used without reading it (a server serving it); False if absent."""
        path = self.path_for(entry_id)
        with self._lock:
            if not path.is_file():
                return False
            self._touch(path)
            return True

    def delete_id(self, entry_id: str) -> bool:
        """Remove the entry; True if it existed."""
        path = self.path_for(entry_id)
        with self._lock:
            try:
                path.unlink()
            except FileNotFoundError:
                return False
            return True

    def path_for(self, entry_id: str) -> Path:
        """File of an entry (ValueError for an id outside ``[A-Za-z0-9_-]{1,128}``)."""
        return self.root / f"{validate_entry_id(entry_id)}{_SUFFIX}"

    @property
    def total_bytes(self) -> int:
        """Bytes of all entry files."""
        with self._lock:
            return sum(size for _, _, size in self._stats())

    def __len__(self) -> int:
        return len(self.keys())

    # ------------------------------------------------------------------ internals
    def _load(
        self, path: Path, expect_model: ModelFingerprint | None = None
    ) -> CompactedCache:
        """Load an entry; a corrupt one is quarantined before its CacheCorruptError propagates."""
        try:
            return CompactedCache.load(path, expect_model=expect_model)
        except CacheCorruptError as exc:
            self._quarantine(path, exc)
            raise

    def _entries(self) -> list[Path]:
        return [
            p
            for p in self.root.glob(f"*{_SUFFIX}")
            if _ID_RE.fullmatch(p.name[: -len(_SUFFIX)]) and p.is_file()
        ]

    def _stats(self) -> list[tuple[int, Path, int]]:
        """``(mtime_ns, path, size)`` of existing entries, oldest first."""
        out = []
        for p in self._entries():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out.append((st.st_mtime_ns, p, st.st_size))
        return sorted(out)

    def _touch(self, path: Path) -> None:
        """Set the mtime to a strictly increasing now (coarse fs clocks would tie)."""
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        try:
            os.utime(path, ns=(self._last_ns, self._last_ns))
        except FileNotFoundError:
            pass

    def _evict(self, keep: Path) -> None:
        if self.max_bytes is None:
            return
        now = time.monotonic()
        self._held = {k: until for k, until in self._held.items() if until > now}
        held = {self.path_for(k) for k in self._held}
        total = sum(_size(f) for f in self.root.rglob("*"))
        quarantined = sorted(
            (self.root / "quarantine").glob(f"*{_SUFFIX}"), key=lambda f: f.name
        )
        victims = [(q, _size(q)) for q in quarantined] + [
            (p, size) for _, p, size in self._stats()
        ]
        for path, size in victims:
            if total <= self.max_bytes:
                break
            if path == keep or path in held:
                continue
            path.unlink(missing_ok=True)
            total -= size
            logger.info("evicted %s (%d bytes) from %s", path.name, size, self.root)
        if total > self.max_bytes:
            logger.warning(
                "cache store %s holds %d bytes, over max_bytes=%d, because the newest "
                "entry alone exceeds it",
                self.root,
                total,
                self.max_bytes,
            )

    def _quarantine(self, path: Path, exc: Exception) -> None:
        target_dir = self.root / "quarantine"
        target_dir.mkdir(exist_ok=True)
        target = target_dir / f"{path.stem}.{time.time_ns()}{_SUFFIX}"
        try:
            os.replace(path, target)
        except FileNotFoundError:
            return
        logger.warning(
            "quarantined corrupt cache entry %s to %s: %s", path.name, target, exc
        )

    def _remove_stale_temps(self) -> None:
        """Remove temp files left by writers that crashed more than an hour ago."""
        now = time.time()
        for tmp in self.root.glob(".*.tmp"):
            try:
                if now - tmp.stat().st_mtime > _STALE_TMP_S:
                    tmp.unlink()
            except FileNotFoundError:
                continue
