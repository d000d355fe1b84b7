"""Safetensors save/load: bit-exact round trips and clear errors for bad files."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from vllm_compaction.am.heads import CompactedHeads
from vllm_compaction.cache import (
    FORMAT_VERSION,
    CacheCorruptError,
    CacheError,
    CacheMismatchError,
    CompactedCache,
    read_metadata,
    serialize,
)

from .test_format import LENGTHS, D, H, T, make_cache, make_fingerprint

SCALARS = (
    "logical_length",
    "token_ids",
    "compacted_span",
    "layer_compacted",
    "model",
    "method",
    "ratio",
    "options",
    "query_source",
    "budgets",
    "timings",
    "created",
)


def assert_same(a: CompactedCache, b: CompactedCache) -> None:
    """Every field equal; tensors bit-exact with the same dtype."""
    for name in SCALARS:
        assert getattr(a, name) == getattr(b, name), name
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        for part in ("keys", "beta", "values", "indices", "cu_seqlens"):
            ta, tb = getattr(la, part), getattr(lb, part)
            assert ta.dtype == tb.dtype and ta.shape == tb.shape, part
            assert torch.equal(
                ta.view(torch.uint8) if ta.numel() else ta,
                tb.view(torch.uint8) if tb.numel() else tb,
            ), part


@pytest.fixture
def saved(tmp_path: Path) -> tuple[CompactedCache, Path]:
    cache = make_cache(torch.bfloat16)
    return cache, cache.save(tmp_path / "prefix.safetensors")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    cache = make_cache(dtype)
    cache.layers[0].keys[0, 0] = float("nan")  # NaN payloads survive too
    path = cache.save(tmp_path / "c.safetensors")
    loaded = CompactedCache.load(path)
    assert_same(cache, loaded)
    assert loaded.summary() == cache.summary()
    assert loaded.fingerprint_key() == cache.fingerprint_key()
    # no temp files left
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


def test_round_trip_shared_storage_and_zero_length(tmp_path: Path) -> None:
    kv = torch.randn(2, H, T, D)  # keys and values are views of one tensor
    layers = [CompactedHeads.exact(kv[0], kv[1], torch.arange(T)) for _ in range(2)]
    cache = make_cache(lengths=[[T] * H] * 2, layers=layers)
    assert_same(cache, CompactedCache.load(cache.save(tmp_path / "shared.safetensors")))
    empty = make_cache(
        lengths=[[0, 0, 0]] * 2, token_ids=[], logical_length=0, compacted_span=(0, 0)
    )
    assert_same(empty, CompactedCache.load(empty.save(tmp_path / "empty.safetensors")))


def test_tensor_names_and_metadata(saved) -> None:
    cache, path = saved
    with safetensors.safe_open(str(path), "pt") as f:
        names, metadata = set(f.keys()), f.metadata()
    assert (
        "layers.0.keys" in names
        and "layers.3.cu_seqlens" in names
        and "token_ids" in names
    )
    assert metadata["format_version"] == str(FORMAT_VERSION)
    meta = read_metadata(path, expect_model=cache.model)
    assert meta["model"] == cache.model and meta["dtype"] == torch.bfloat16
    assert meta["method"] == cache.method and meta["num_layers"] == 4


def test_save_overwrites_atomically_and_failure_keeps_old(saved, monkeypatch) -> None:
    cache, path = saved
    newer = make_cache(torch.bfloat16, seed=7)
    newer.save(path)
    assert_same(newer, CompactedCache.load(path))

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(serialize.safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        cache.save(path)
    assert_same(newer, CompactedCache.load(path))
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def _header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


@pytest.mark.parametrize("mask", [0x01, 0x80])
def test_flipped_data_byte_is_corrupt(saved, mask: int) -> None:
    _, path = saved
    data = path.read_bytes()
    start = _header_end(data)
    for pos in range(start, len(data), max(1, (len(data) - start) // 97)):
        flipped = bytearray(data)
        flipped[pos] ^= mask
        path.write_bytes(flipped)
        with pytest.raises(CacheCorruptError, match="checksum") as info:
            CompactedCache.load(path)
        assert str(path) in str(info.value)


@pytest.mark.parametrize("mask", [0x01, 0xFF])
def test_flipped_header_byte_is_rejected(saved, mask: int) -> None:
    _, path = saved
    data = path.read_bytes()
    for pos in range(mask % 5, _header_end(data), 5):  # every 5th byte, offset per mask
        flipped = bytearray(data)
        flipped[pos] ^= mask
        path.write_bytes(flipped)
        with pytest.raises(CacheError) as info:
            CompactedCache.load(path)
        assert str(path) in str(info.value), pos


def test_truncated_file_is_corrupt(saved) -> None:
    _, path = saved
    data = path.read_bytes()
    end = _header_end(data)
    for size in [0, 3, 8, 20, end - 1, end, end + 10, len(data) - 1]:
        path.write_bytes(data[:size])
        with pytest.raises(CacheCorruptError, match="truncated|corrupt|bytes long"):
            CompactedCache.load(path)
        if size < end:
            with pytest.raises(CacheCorruptError):
                read_metadata(path)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"hello world, this is not a cache\n" * 10,
        os.urandom(4096),
        b"\x02\x00\x00\x00\x00\x00\x00\x00{}",
        json.dumps({"__metadata__": {}}).encode(),
    ],
)
def test_garbage_file_is_corrupt(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(content)
    with pytest.raises(CacheCorruptError) as info:
        CompactedCache.load(path)
    assert str(path) in str(info.value)


def test_foreign_safetensors_file_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "weights.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(3)}, path, metadata={"format": "pt"})
    with pytest.raises(CacheCorruptError, match="not a vllm-compaction cache"):
        CompactedCache.load(path)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        CompactedCache.load(tmp_path / "absent.safetensors")
    with pytest.raises(CacheCorruptError, match="cannot be read"):
        CompactedCache.load(tmp_path)


def rewrite_metadata(path: Path, **changes: str) -> None:
    with safetensors.safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a file, not a dict)
        metadata = {**f.metadata(), **changes}
    safetensors.torch.save_file(tensors, path, metadata=metadata)


def test_future_format_version_is_mismatch(saved) -> None:
    _, path = saved
    rewrite_metadata(path, format_version=str(FORMAT_VERSION + 1))
    with pytest.raises(
        CacheMismatchError, match=f"version {FORMAT_VERSION + 1}.*upgrade"
    ) as info:
        CompactedCache.load(path)
    assert str(path) in str(info.value)
    rewrite_metadata(path, format_version="v1")
    with pytest.raises(CacheCorruptError, match="unknown cache format version"):
        CompactedCache.load(path)


def test_tampered_checksum_fields(saved) -> None:
    _, path = saved
    rewrite_metadata(path, meta_sha256="0" * 64)
    with pytest.raises(CacheCorruptError, match="metadata checksum"):
        CompactedCache.load(path)


def test_wrong_model_is_mismatch(saved) -> None:
    cache, path = saved
    other = dataclasses.replace(cache.model, weights_digest="f" * 64)
    with pytest.raises(CacheMismatchError, match="weights_digest") as info:
        CompactedCache.load(path, expect_model=other)
    assert str(path) in str(info.value)
    with pytest.raises(CacheMismatchError, match="num_layers"):
        read_metadata(path, expect_model=make_fingerprint(num_layers=2))
    # A dtype difference alone is allowed: the cache can be cast.
    loaded = CompactedCache.load(
        path, expect_model=dataclasses.replace(cache.model, dtype="bfloat16")
    )
    assert_same(cache, loaded)


def test_load_device_cpu_and_cast(saved) -> None:
    cache, path = saved
    loaded = CompactedCache.load(path, device="cpu").to(torch.float32)
    assert loaded.dtype == torch.float32 and loaded.layers[0].keys.device.type == "cpu"
    assert loaded.head_lengths.tolist() == LENGTHS and loaded.logical_length == T
