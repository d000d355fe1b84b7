"""Safetensors serialization of :class:`CompactedCache`.

File layout (format version 1): a plain safetensors file whose tensors are
``layers.{i}.keys`` / ``layers.{i}.values`` ``[N_i, d]`` (storage dtype),
``layers.{i}.beta`` ``[N_i]`` float32, ``layers.{i}.indices`` ``[N_i]`` int64,
``layers.{i}.cu_seqlens`` ``[H+1]`` int32 and ``token_ids`` ``[T]`` int64, and whose string
``__metadata__`` holds:

- ``format``: :data:`FORMAT_NAME`; ``format_version``: the decimal version;
- ``meta``: JSON of every other cache field and the model fingerprint;
- ``meta_sha256``: sha256 of the ``meta`` string;
- ``tensors_sha256``: sha256 over (name, dtype, shape, raw bytes) of every tensor, in the order
  of :func:`_tensor_names`.

Files are written atomically (temp file in the same directory, fsync, ``os.replace``). Every
failure to read one is a :class:`CacheCorruptError` or :class:`CacheMismatchError` whose
message names the path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from vllm_compaction.am.heads import CompactedHeads
from vllm_compaction.cache.format import (
    FORMAT_VERSION,
    CacheCorruptError,
    CacheMismatchError,
    CompactedCache,
    ModelFingerprint,
)

__all__ = [
    "FORMAT_NAME",
    "save_cache",
    "load_cache",
    "read_metadata",
    "tensors_digest",
]

logger = logging.getLogger(__name__)

FORMAT_NAME = "vllm_compaction.CompactedCache"
_PARTS = ("keys", "values", "beta", "indices", "cu_seqlens")
_MAX_HEADER = 256 * 1024 * 1024
_META_FIELDS = (
    "logical_length",
    "compacted_span",
    "layer_compacted",
    "method",
    "ratio",
    "options",
    "query_source",
    "budgets",
    "timings",
    "created",
)


def _tensor_names(num_layers: int) -> list[str]:
    return [f"layers.{i}.{part}" for i in range(num_layers) for part in _PARTS] + [
        "token_ids"
    ]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensors_sha256(tensors: dict[str, torch.Tensor], names: list[str]) -> str:
    digest = hashlib.sha256()
    for name in names:
        t = tensors[name].contiguous().reshape(-1)
        digest.update(
            f"{name}|{_dtype_name(t.dtype)}|{list(tensors[name].shape)}|".encode()
        )
        digest.update(t.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _cpu_tensors(cache: CompactedCache) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors by name; tensors sharing storage are cloned (safetensors refuses)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for i, layer in enumerate(cache.layers):
        for part in _PARTS:
            t = getattr(layer, part).detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            out[f"layers.{i}.{part}"] = t
    out["token_ids"] = torch.tensor(cache.token_ids, dtype=torch.int64, device="cpu")
    return out


def tensors_digest(cache: CompactedCache) -> str:
    """The ``tensors_sha256`` a file of ``cache`` records (what identifies its content)."""
    return _tensors_sha256(_cpu_tensors(cache), _tensor_names(cache.num_layers))


def save_cache(cache: CompactedCache, path: str | Path) -> Path:
    """Write ``cache`` to ``path`` atomically and return the path."""
    path = Path(path)
    tensors = _cpu_tensors(cache)
    meta = {name: getattr(cache, name) for name in _META_FIELDS}
    meta.update(
        format_version=FORMAT_VERSION,
        num_layers=cache.num_layers,
        dtype=_dtype_name(cache.dtype),
        model=cache.model.to_dict(),
    )
    meta["compacted_span"] = list(cache.compacted_span)
    meta_json = json.dumps(meta, sort_keys=True, allow_nan=False)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "meta": meta_json,
        "meta_sha256": hashlib.sha256(meta_json.encode()).hexdigest(),
        "tensors_sha256": _tensors_sha256(tensors, _tensor_names(cache.num_layers)),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.close(fd)
        safetensors.torch.save_file(tensors, tmp, metadata=metadata)
        # mkstemp makes it 0600; a cache is readable like other files
        os.chmod(tmp, 0o644)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    logger.debug("saved compacted cache (%d bytes packed) to %s", cache.nbytes, path)
    return path


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _parse_header(raw: bytes, file_size: int, path: Path) -> dict[str, str]:
    """The verified-format ``__metadata__`` from the first bytes of a file."""
    if len(raw) < 8:
        raise CacheCorruptError(
            f"{path} is not a compacted cache: it is only {file_size} bytes long."
        )
    n = int.from_bytes(raw[:8], "little")
    if n > _MAX_HEADER or 8 + n > file_size:
        raise CacheCorruptError(
            f"{path} is truncated or not a safetensors file (bad header length {n})."
        )
    try:
        header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise CacheCorruptError(
            f"{path} is corrupt: its safetensors header is not JSON."
        ) from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        raise CacheCorruptError(
            f"{path} is a safetensors file but not a vllm-compaction cache."
        )
    version = metadata.get("format_version", "")
    if not isinstance(version, str) or not version.isdigit() or int(version) < 1:
        raise CacheCorruptError(
            f"{path} is corrupt: unknown cache format version {version!r}."
        )
    if int(version) > FORMAT_VERSION:
        raise CacheMismatchError(
            f"{path} uses cache format version {version}, newer than the supported version "
            f"{FORMAT_VERSION}; upgrade vllm-compaction to read it."
        )
    return metadata


def _parse_meta(metadata: dict[str, str], path: Path) -> dict[str, Any]:
    meta_json = metadata.get("meta")
    if not isinstance(meta_json, str) or (
        hashlib.sha256(meta_json.encode()).hexdigest() != metadata.get("meta_sha256")
    ):
        raise CacheCorruptError(
            f"{path} is corrupt: its metadata checksum does not match."
        )
    try:
        meta = json.loads(meta_json)
        meta["model"] = ModelFingerprint.from_dict(meta["model"])
        dtype = getattr(torch, meta["dtype"])
        if not isinstance(dtype, torch.dtype) or not isinstance(
            meta["num_layers"], int
        ):
            raise ValueError("bad dtype or layer count")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CacheCorruptError(
            f"{path} is corrupt: its metadata is invalid ({exc})."
        ) from None
    meta["dtype"] = dtype
    return meta


def read_metadata(
    path: str | Path, *, expect_model: ModelFingerprint | None = None
) -> dict[str, Any]:
    """The verified metadata of a cache file without loading its tensors.

    Returns every :class:`CompactedCache` field except ``layers`` and ``token_ids``, plus
    ``format_version``, ``num_layers``, ``dtype`` (a ``torch.dtype``) and ``tensors_sha256``; ``model`` is a
    :class:`ModelFingerprint`. Raises like :func:`load_cache`.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            raw = head + (f.read(n) if 8 + n <= size and n <= _MAX_HEADER else b"")
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CacheCorruptError(
            f"{path} cannot be read: {exc.strerror or exc}."
        ) from None
    header = _parse_header(raw, size, path)
    meta = _parse_meta(header, path)
    meta["tensors_sha256"] = header.get("tensors_sha256", "")
    if expect_model is not None:
        _check_model(meta["model"], expect_model, path)
    return meta


def _check_model(
    built_for: ModelFingerprint, expect: ModelFingerprint, path: Path
) -> None:
    try:
        built_for.check_compatible(expect)
    except CacheMismatchError as exc:
        raise CacheMismatchError(f"{path}: {exc}") from None


def load_cache(
    path: str | Path,
    *,
    expect_model: ModelFingerprint | None = None,
    device: torch.device | str = "cpu",
) -> CompactedCache:
    """Read, verify and return the cache at ``path`` (tensors moved to ``device``).

    Raises:
        FileNotFoundError: no file at ``path``.
        CacheCorruptError: unreadable, truncated, damaged (checksum) or foreign file.
        CacheMismatchError: newer format version, or a model incompatible with ``expect_model``.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CacheCorruptError(
            f"{path} cannot be read: {exc.strerror or exc}."
        ) from None
    metadata = _parse_header(data, len(data), path)
    meta = _parse_meta(metadata, path)
    if expect_model is not None:
        _check_model(meta["model"], expect_model, path)
    try:
        tensors = safetensors.torch.load(data)
    except Exception as exc:  # safetensors raises its own untyped errors
        raise CacheCorruptError(
            f"{path} is corrupt: safetensors cannot read it ({exc})."
        ) from None
    names = _tensor_names(meta["num_layers"])
    if sorted(tensors) != sorted(names):
        raise CacheCorruptError(
            f"{path} is corrupt: its tensor names do not match its metadata."
        )
    if _tensors_sha256(tensors, names) != metadata.get("tensors_sha256"):
        raise CacheCorruptError(
            f"{path} is corrupt: its tensor checksum does not match."
        )
    cache = _build(tensors, meta, path)
    logger.debug("loaded compacted cache from %s", path)
    return cache if str(device) == "cpu" else cache.to(device=device)


def _build(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any], path: Path
) -> CompactedCache:
    expected = {
        "beta": torch.float32,
        "indices": torch.int64,
        "cu_seqlens": torch.int32,
        "keys": meta["dtype"],
        "values": meta["dtype"],
    }
    try:
        layers = []
        for i in range(meta["num_layers"]):
            parts = {part: tensors[f"layers.{i}.{part}"] for part in _PARTS}
            if any(parts[p].dtype != expected[p] for p in _PARTS):
                raise ValueError(f"layer {i} has unexpected tensor dtypes")
            layers.append(CompactedHeads(**parts))
        fields = {name: meta[name] for name in _META_FIELDS}
        return CompactedCache(
            layers=layers,
            token_ids=tensors["token_ids"].tolist(),
            model=meta["model"],
            **fields,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CacheCorruptError(
            f"{path} is corrupt: its contents are inconsistent ({exc})."
        ) from None
