"""The compacted-cache value: ``CompactedCache``, ``ModelFingerprint`` and the cache errors.

A ``CompactedCache`` holds one varlen-packed :class:`CompactedHeads` per attention layer of a
model, each covering the *whole* prefix of ``T`` original tokens: exact template slots with
``beta = 0`` plus the compacted slots of ``compacted_span``. Slot ``indices`` are original
token positions, so new tokens continue at position ``T`` (``logical_length``).
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_compaction.am.heads import CompactedHeads
from vllm_compaction.cache.paged import PagedPacking, tensor_parallel_heads

__all__ = [
    "FORMAT_VERSION",
    "CacheError",
    "CacheCorruptError",
    "CacheMismatchError",
    "ModelFingerprint",
    "CompactedCache",
    "json_digest",
    "prefix_hash",
    "config_hash",
]

FORMAT_VERSION = 1
"""Version of the on-disk layout written by :mod:`vllm_compaction.cache.serialize`."""


class CacheError(Exception):
    """Base class of every error raised for a compacted cache file or store entry."""


class CacheCorruptError(CacheError):
    """The file is not a readable compacted cache (damaged, truncated or foreign)."""


class CacheMismatchError(CacheError):
    """The cache is intact but cannot be used here (other model or newer format version)."""


def json_digest(obj: Any) -> str:
    """Hex sha256 of the canonical JSON of ``obj`` (sorted keys, no whitespace, no NaN)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def prefix_hash(token_ids: Sequence[int]) -> str:
    """Hex sha256 of the prefix token ids, hashed as little-endian int64."""
    packed = array.array("q", [int(t) for t in token_ids])
    if sys.byteorder != "little":
        packed.byteswap()
    return hashlib.sha256(packed.tobytes()).hexdigest()


def config_hash(
    method: str, ratio: float, options: dict, query_source: str, budgets: str
) -> str:
    """Hex sha256 of everything about *how* a prefix was compacted."""
    return json_digest(
        {
            "method": method,
            "ratio": float(ratio),
            "options": options,
            "query_source": query_source,
            "budgets": budgets,
        }
    )


def _json_normalized(value: Any, what: str) -> Any:
    """``value`` after a JSON round trip (tuples become lists); ValueError if impossible."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be JSON-serialisable: {exc}") from None


@dataclass(frozen=True)
class ModelFingerprint:
    """What makes a compacted cache valid for one model and not another.

    ``name`` is informational and ignored by :meth:`check_compatible` and :meth:`digest`;
    ``config_digest`` is the sha256 of the canonical model config JSON (see
    :func:`json_digest`), ``weights_digest`` identifies the checkpoint weights.
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    config_digest: str
    weights_digest: str
    dtype: str
    name: str = ""

    _COMPARED = (
        "architecture",
        "num_layers",
        "num_kv_heads",
        "num_q_heads",
        "head_dim",
        "config_digest",
        "weights_digest",
        "dtype",
    )

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "num_q_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"ModelFingerprint.{name} must be a positive int, got {value!r}."
                )
        for name in (
            "architecture",
            "config_digest",
            "weights_digest",
            "dtype",
            "name",
        ):
            if not isinstance(getattr(self, name), str):
                raise ValueError(
                    f"ModelFingerprint.{name} must be a str, got {getattr(self, name)!r}."
                )
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} must be a multiple of num_kv_heads={self.num_kv_heads}."
            )

    def check_compatible(
        self, other: ModelFingerprint, *, allow_dtype_cast: bool = True
    ) -> None:
        """Raise :class:`CacheMismatchError` naming the first field where ``other`` differs.

        ``self`` is the model the cache was built for, ``other`` the model it is used with. A
        dtype difference alone passes when ``allow_dtype_cast`` (the cache can be cast).
        """
        for name in self._COMPARED:
            if name == "dtype" and allow_dtype_cast:
                continue
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise CacheMismatchError(
                    f"The cache was built for a model with {name}={mine!r} "
                    f"({self.name or self.architecture}), but the model in use has "
                    f"{name}={theirs!r} ({other.name or other.architecture})."
                )

    def digest(self, *, include_dtype: bool = False) -> str:
        """Hex sha256 of the compared fields (``dtype`` only if ``include_dtype``)."""
        data = self.to_dict()
        data.pop("name")
        if not include_dtype:
            data.pop("dtype")
        return json_digest(data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict of every field."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelFingerprint:
        """Inverse of :meth:`to_dict`; ValueError on missing or unknown fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        required = names - {"name"}
        if not isinstance(data, dict):
            raise ValueError(
                f"A model fingerprint must be a dict, got {type(data).__name__}."
            )
        if missing := sorted(required - data.keys()):
            raise ValueError(f"The model fingerprint lacks the fields {missing}.")
        if unknown := sorted(data.keys() - names):
            raise ValueError(f"The model fingerprint has unknown fields {unknown}.")
        return cls(**data)


@dataclass(eq=False)
class CompactedCache:
    """A compacted prefix of one model, ready to save, store or inject.

    Attributes:
        layers: one :class:`CompactedHeads` per attention layer (``model.num_layers``), each
            with ``H = model.num_kv_heads`` heads of ``d = model.head_dim`` and covering the
            whole prefix; keys/values ``[N_l, d]`` share one dtype, beta ``[N_l]`` float32,
            indices ``[N_l]`` int64 in ``[0, T)``. Uncompacted layers hold every token with
            ``beta = 0``.
        logical_length: ``T``, the number of original prefix tokens.
        token_ids: the ``T`` original prefix token ids.
        compacted_span: ``[start, end)`` of the token range that was compacted.
        layer_compacted: per layer, whether it was compacted.
        model: the fingerprint of the model the cache was built for.
        method, ratio, options, query_source, budgets: how it was compacted; ``options`` is
            normalised through JSON.
        timings: seconds spent per pipeline stage.
        created: unix time of creation.
    """

    layers: list[CompactedHeads]
    logical_length: int
    token_ids: list[int]
    compacted_span: tuple[int, int]
    layer_compacted: list[bool]
    model: ModelFingerprint
    method: str
    ratio: float
    options: dict[str, Any] = field(default_factory=dict)
    query_source: str = ""
    budgets: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    created: float = field(default_factory=time.time)

    @classmethod
    def identity(
        cls,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        token_ids: Sequence[int],
        model: ModelFingerprint,
    ) -> CompactedCache:
        """Every key kept at its position with ``beta = 0`` (t = T), from per-layer keys/values
        ``[H, T, d]`` (post-RoPE): served or decoded, it must reproduce the uncompacted prompt."""
        length = len(token_ids)
        positions = torch.arange(length, device=keys[0].device if len(keys) else "cpu")
        layers = [CompactedHeads.exact(k, v, positions) for k, v in zip(keys, values)]
        return cls(
            layers=layers,
            logical_length=length,
            token_ids=list(token_ids),
            compacted_span=(0, length),
            layer_compacted=[False] * len(layers),
            model=model,
            method="none",
            ratio=1.0,
        )

    def __post_init__(self) -> None:
        self.layers = list(self.layers)
        self.token_ids = [int(t) for t in self.token_ids]
        self.compacted_span = tuple(int(x) for x in self.compacted_span)  # type: ignore[assignment]
        self.layer_compacted = [bool(x) for x in self.layer_compacted]
        self.options = _json_normalized(dict(self.options), "options")
        self.timings = {str(k): float(v) for k, v in self.timings.items()}
        self.ratio, self.created = float(self.ratio), float(self.created)
        if not math.isfinite(self.ratio) or self.ratio <= 0:
            raise ValueError(
                f"ratio must be a finite positive number, got {self.ratio}."
            )
        self._check_lengths()
        for i, layer in enumerate(self.layers):
            self._check_layer(i, layer)

    def _check_lengths(self) -> None:
        if not isinstance(self.model, ModelFingerprint):
            raise ValueError(
                f"model must be a ModelFingerprint, got {type(self.model).__name__}."
            )
        t, n = self.logical_length, self.model.num_layers
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"logical_length must be an int >= 0, got {t!r}.")
        if len(self.token_ids) != t:
            raise ValueError(
                f"token_ids has {len(self.token_ids)} ids but logical_length is {t}."
            )
        if len(self.layers) != n:
            raise ValueError(
                f"The cache has {len(self.layers)} layers but the model has {n}."
            )
        if len(self.layer_compacted) != n:
            raise ValueError(
                f"layer_compacted has {len(self.layer_compacted)} flags for {n} layers."
            )
        start, end = self.compacted_span if len(self.compacted_span) == 2 else (-1, -1)
        if not 0 <= start <= end <= t:
            raise ValueError(
                f"compacted_span {self.compacted_span} must satisfy 0 <= start <= end <= T={t}."
            )

    def _check_layer(self, i: int, layer: CompactedHeads) -> None:
        if not isinstance(layer, CompactedHeads):
            raise ValueError(
                f"Layer {i} is a {type(layer).__name__}, not CompactedHeads."
            )
        if (
            layer.num_heads != self.model.num_kv_heads
            or layer.head_dim != self.model.head_dim
        ):
            raise ValueError(
                f"Layer {i} has {layer.num_heads} heads of dim {layer.head_dim}, but the model has "
                f"{self.model.num_kv_heads} KV heads of dim {self.model.head_dim}."
            )
        first = self.layers[0]
        if (
            layer.keys.dtype != first.keys.dtype
            or layer.values.dtype != first.keys.dtype
        ):
            raise ValueError(
                f"Layer {i} keys/values are not all {first.keys.dtype} like layer 0's."
            )
        if layer.beta.dtype != torch.float32 or layer.indices.dtype != torch.int64:
            raise ValueError(f"Layer {i} must have float32 beta and int64 indices.")
        idx = layer.indices
        if layer.total_slots and (
            int(idx.min()) < 0 or int(idx.max()) >= self.logical_length
        ):
            raise ValueError(
                f"Layer {i} has slot indices outside [0, {self.logical_length})."
            )

    # ------------------------------------------------------------------ sizes
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        """Storage dtype of keys and values."""
        return self.layers[0].keys.dtype

    @property
    def head_lengths(self) -> torch.Tensor:
        """``[L, H]`` int64 slots per layer and head."""
        return torch.stack([layer.head_budgets.cpu() for layer in self.layers])

    @property
    def physical_slots(self) -> int:
        return sum(layer.total_slots for layer in self.layers)

    @property
    def max_head_length(self) -> int:
        return int(self.head_lengths.max()) if self.layers else 0

    def paged_packing(
        self, block_size: int, heads: Sequence[int] | None = None
    ) -> PagedPacking:
        """Where this cache's rows (of ``heads`` only: one tensor-parallel rank's) go in paged KV
        blocks of ``block_size`` when packed varlen."""
        lengths = (
            self.head_lengths if heads is None else self.head_lengths[:, list(heads)]
        )
        return PagedPacking(lengths, self.model.head_dim, block_size)

    def physical_tokens(
        self,
        layout: str = "padded",
        block_size: int | None = None,
        tp_size: int = 1,
    ) -> int:
        """Token slots (placeholder prompt tokens) the prefix takes in a paged engine.

        ``varlen``: the packed rows in whole blocks of ``block_size`` (about ``sum(t) / (L*H)``);
        with tensor parallelism every rank packs its own KV heads into the same blocks, so the
        rank with the most rows sets it; ``padded``: the longest head.
        """
        if layout == "padded":
            return self.max_head_length
        if layout != "varlen":
            raise ValueError(f"unknown prefix layout {layout!r} (use varlen or padded)")
        if not block_size:
            raise ValueError("the varlen layout needs the engine's block size")
        heads = self.model.num_kv_heads
        return max(
            self.paged_packing(
                block_size, tensor_parallel_heads(heads, tp_size, rank)
            ).num_tokens
            for rank in range(max(tp_size, 1))
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the packed keys, values and beta."""
        return sum(l.keys.nbytes + l.values.nbytes + l.beta.nbytes for l in self.layers)

    @property
    def padded_nbytes(self) -> int:
        """Bytes of keys, values and beta if every head were padded to its layer's max."""
        per_slot = 2 * self.model.head_dim * self.dtype.itemsize + 4
        return sum(
            int(lengths.max()) * lengths.numel() * per_slot
            for lengths in self.head_lengths
        )

    @property
    def original_nbytes(self) -> int:
        """Bytes of the uncompacted keys and values: ``L * H * T * 2 * d * itemsize``."""
        m = self.model
        return (
            m.num_layers
            * m.num_kv_heads
            * self.logical_length
            * 2
            * m.head_dim
            * self.dtype.itemsize
        )

    @property
    def compaction_ratio(self) -> float:
        """Physical slots / original slots over the compacted layers (1.0 if none)."""
        kept = [l.total_slots for l, c in zip(self.layers, self.layer_compacted) if c]
        original = len(kept) * self.model.num_kv_heads * self.logical_length
        return sum(kept) / original if original else 1.0

    # ------------------------------------------------------------------ identity
    @property
    def prefix_hash(self) -> str:
        """Hex sha256 of ``token_ids`` (see :func:`prefix_hash`)."""
        return prefix_hash(self.token_ids)

    @property
    def config_hash(self) -> str:
        return config_hash(
            self.method, self.ratio, self.options, self.query_source, self.budgets
        )

    def fingerprint_key(self) -> str:
        """Hex digest of (model, prefix, config, format version): the store key's digest."""
        return json_digest(
            [FORMAT_VERSION, self.model.digest(), self.prefix_hash, self.config_hash]
        )

    # ------------------------------------------------------------------ conversions
    def to(
        self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> CompactedCache:
        """A copy with keys/values cast to ``dtype`` and moved to ``device``; beta stays fp32."""
        return dataclasses.replace(
            self, layers=[l.to(dtype=dtype, device=device) for l in self.layers]
        )

    def summary(self) -> dict[str, Any]:
        """JSON-friendly description: shape, sizes, ratio, method and timings."""
        return {
            "model": self.model.name or self.model.architecture,
            "num_layers": self.num_layers,
            "num_kv_heads": self.model.num_kv_heads,
            "head_dim": self.model.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "logical_length": self.logical_length,
            "compacted_span": list(self.compacted_span),
            "layers_compacted": sum(self.layer_compacted),
            "physical_slots": self.physical_slots,
            "max_head_length": self.max_head_length,
            "nbytes": self.nbytes,
            "padded_nbytes": self.padded_nbytes,
            "original_nbytes": self.original_nbytes,
            "compaction_ratio": self.compaction_ratio,
            "method": self.method,
            "ratio": self.ratio,
            "options": self.options,
            "query_source": self.query_source,
            "budgets": self.budgets,
            "timings": dict(self.timings),
            "created": self.created,
            "prefix_hash": self.prefix_hash,
        }

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        """Write a checksummed safetensors file atomically; see :mod:`.serialize`."""
        from vllm_compaction.cache.serialize import save_cache

        return save_cache(self, path)

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        expect_model: ModelFingerprint | None = None,
        device: torch.device | str = "cpu",
    ) -> CompactedCache:
        """Read and verify a file written by :meth:`save`.

        Raises:
            CacheCorruptError: damaged, truncated or foreign file.
            CacheMismatchError: newer format version, or built for a model incompatible with
                ``expect_model``.
        """
        from vllm_compaction.cache.serialize import load_cache

        return load_cache(path, expect_model=expect_model, device=device)
