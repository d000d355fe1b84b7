"""CacheKey and LocalDiskStore: put/get, LRU eviction, persistence, ids, threads."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import pytest
import torch

from vllm_compaction.cache import (
    CacheKey,
    CacheMismatchError,
    CacheStore,
    LocalDiskStore,
    validate_entry_id,
)

from .test_format import make_cache
from .test_serialize import assert_same, rewrite_metadata


def key_of(seed: int) -> CacheKey:
    return CacheKey.for_cache(make_cache(seed=seed))


# ---------------------------------------------------------------------- keys
def test_cache_key_for_request_matches_for_cache() -> None:
    cache = make_cache()
    key = CacheKey.for_request(
        cache.model,
        cache.token_ids,
        method=cache.method,
        ratio=cache.ratio,
        options=cache.options,
        query_source=cache.query_source,
        budgets=cache.budgets,
    )
    assert key == CacheKey.for_cache(cache)
    assert key.digest() == cache.fingerprint_key() and len(key.digest()) == 64
    assert key.digest() != CacheKey.for_cache(make_cache(ratio=0.5)).digest()
    assert (
        key.digest()
        != CacheKey(key.model_digest, key.prefix_hash, key.config_hash, 2).digest()
    )
    # The model dtype and name do not change the key (a cache can be cast).
    renamed = dataclasses.replace(cache.model, name="x", dtype="bfloat16")
    assert (
        CacheKey.for_request(
            renamed,
            cache.token_ids,
            method=cache.method,
            ratio=cache.ratio,
            options=cache.options,
            query_source=cache.query_source,
            budgets=cache.budgets,
        )
        == key
    )


# ---------------------------------------------------------------------- basic store
def test_put_get_contains_delete(tmp_path: Path) -> None:
    store = LocalDiskStore(tmp_path / "store")
    assert isinstance(store, CacheStore)
    cache, key = make_cache(torch.bfloat16), key_of(0)
    assert store.get(key) is None and not store.contains(key) and store.keys() == []
    store.put(key, cache)
    assert store.contains(key) and store.keys() == [key.digest()] and len(store) == 1
    assert_same(cache, store.get(key))
    assert store.total_bytes == store.path_for(key.digest()).stat().st_size
    assert store.delete(key) and not store.delete(key)
    assert store.get(key) is None and store.keys() == []


def test_ids_and_persistence(tmp_path: Path) -> None:
    cache = make_cache()
    LocalDiskStore(tmp_path).put_id("session_42-a", cache)
    reopened = LocalDiskStore(tmp_path)
    assert reopened.contains_id("session_42-a") and reopened.keys() == ["session_42-a"]
    assert_same(cache, reopened.get_id("session_42-a"))
    assert reopened.get_id("other") is None and not reopened.delete_id("other")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "../escape",
        "a/b",
        "..",
        ".hidden",
        "a.b",
        "x" * 129,
        "nul\x00",
        "sp ace",
        "/abs",
        "é",
    ],
)
def test_path_traversal_ids_rejected(tmp_path: Path, bad: str) -> None:
    store = LocalDiskStore(tmp_path / "s")
    for op in (store.get_id, store.contains_id, store.delete_id, store.path_for):
        with pytest.raises(ValueError, match="must match"):
            op(bad)
    with pytest.raises(ValueError):
        store.put_id(bad, make_cache())
    assert list(tmp_path.rglob("*.safetensors")) == []
    assert validate_entry_id("x" * 128) == "x" * 128


def test_max_bytes_validation(tmp_path: Path) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            LocalDiskStore(tmp_path, max_bytes=bad)


# ---------------------------------------------------------------------- eviction
def test_lru_eviction_order(tmp_path: Path) -> None:
    probe = LocalDiskStore(tmp_path / "probe")
    probe.put_id("p", make_cache())
    size = probe.total_bytes  # every entry below has the same size
    store = LocalDiskStore(tmp_path / "lru", max_bytes=3 * size)
    for name in "abc":
        store.put_id(name, make_cache())
    assert store.keys() == ["a", "b", "c"]
    assert store.get_id("a") is not None  # a is now the most recently used
    store.put_id("d", make_cache())
    assert store.keys() == ["a", "c", "d"]  # b was least recently used
    store.get_id("c")
    store.put_id("e", make_cache())
    assert store.keys() == ["c", "d", "e"] and store.total_bytes <= 3 * size
    # The LRU order lives in the directory: a new instance continues it.
    reopened = LocalDiskStore(tmp_path / "lru", max_bytes=3 * size)
    reopened.put_id("f", make_cache())
    assert reopened.keys() == ["c", "e", "f"]  # use order was d, c, e
    # served without a read
    assert reopened.touch_id("c") and not reopened.touch_id("gone")
    reopened.put_id("g", make_cache())
    assert reopened.keys() == ["c", "f", "g"]


def test_entry_larger_than_budget_is_kept(tmp_path: Path, caplog) -> None:
    store = LocalDiskStore(tmp_path, max_bytes=10)
    store.put_id("a", make_cache())
    with caplog.at_level(logging.WARNING, logger="vllm_compaction.cache.store"):
        store.put_id("b", make_cache())
    assert store.keys() == ["b"] and "over max_bytes" in caplog.text


# ---------------------------------------------------------------------- damaged entries
def test_corrupt_entry_is_quarantined(tmp_path: Path, caplog) -> None:
    store = LocalDiskStore(tmp_path)
    store.put_id("a", make_cache())
    path = store.path_for("a")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="vllm_compaction.cache.store"):
        assert store.get_id("a") is None
    assert "quarantined" in caplog.text and "checksum" in caplog.text
    assert (
        not store.contains_id("a")
        and len(list((tmp_path / "quarantine").iterdir())) == 1
    )
    store.put_id("a", make_cache())  # the id is usable again
    assert store.get_id("a") is not None


def test_newer_format_entry_raises_and_stays(tmp_path: Path) -> None:
    store = LocalDiskStore(tmp_path)
    store.put_id("a", make_cache())
    rewrite_metadata(store.path_for("a"), format_version="99")
    with pytest.raises(CacheMismatchError, match="version 99"):
        store.get_id("a")
    assert store.contains_id("a")


# ---------------------------------------------------------------------- threads
def test_concurrent_puts_and_gets(tmp_path: Path) -> None:
    store = LocalDiskStore(tmp_path)
    caches = [make_cache(seed=s) for s in range(4)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(6):
                store.put_id(f"shared{j % 2}", caches[(i + j) % 4])
                store.put_id(f"own{i}", caches[i % 4])
                got = store.get_id(f"shared{(i + j) % 2}")
                assert got is None or got.token_ids in [c.token_ids for c in caches]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.keys() == [
        "own0",
        "own1",
        "own2",
        "own3",
        "own4",
        "own5",
        "own6",
        "own7",
        "shared0",
        "shared1",
    ]
    for i in range(8):
        assert_same(caches[i % 4], store.get_id(f"own{i}"))
    for name in ("shared0", "shared1"):
        assert any(store.get_id(name).token_ids == c.token_ids for c in caches)
    assert not list(tmp_path.glob(".*"))  # no temp files left behind
