"""KV snapshots: the keys and values a running engine computed for a prompt, as the engine
stores them (its dtype, its RoPE, its rounding).

A cache built from the engine's own K/V is what the engine itself would attend, so serving an
identity cache built from a snapshot reproduces the uncompacted prompt bit for bit in any dtype
(a cache built by the HF model in bf16 rounds differently from vLLM's bf16 prefill).

How a snapshot is taken, without touching the model runner:

* the request carries ``kv_transfer_params={"compaction_snapshot": NAME}`` and a ``cache_salt``
  of its own (so that no prefix-cache hit skips the computation of a token);
* the connector's scheduler side sends the workers, each step, which prompt positions of that
  request are computed and in which slots (:class:`SnapshotPlan`);
* the compaction attention backends hand every K/V write to :class:`SnapshotRecorder`, which
  copies the rows of those slots; after the step that completes the prompt it writes
  ``<snapshot dir>/NAME.safetensors`` (keys and values ``[L, H, T, d]``) atomically.

Snapshots are off unless the engine was started with ``kv_snapshots=True``
(:func:`.engine.engine_kwargs`): they write files, so an API client must not be able to ask for
them on a deployment that did not opt in. :func:`snapshot_kv` is the offline entry point.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "EngineKV",
    "SNAPSHOT_PARAM",
    "SnapshotPlan",
    "SnapshotRecorder",
    "identity_cache",
    "snapshot_kv",
]

logger = logging.getLogger(__name__)

SNAPSHOT_PARAM = "compaction_snapshot"
"""Key of ``kv_transfer_params`` that asks for a snapshot; its value names the file."""

_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def snapshot_name(params: dict[str, Any] | None) -> str | None:
    """The snapshot a request asks for (None: none). Raises ``ValueError`` on a bad name."""
    name = (params or {}).get(SNAPSHOT_PARAM)
    if name is None:
        return None
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"snapshot name {name!r} must be 1-64 letters, digits, '_' or '-'"
        )
    return name


def snapshot_dir(store_root: str | Path) -> Path:
    return Path(store_root) / "snapshots"


@dataclass
class SnapshotPlan:
    """Prompt positions ``[start, end)`` of one snapshot request, computed this step in ``slots``."""

    name: str
    start: int
    end: int
    slots: list[int]
    num_tokens: int  # the prompt length T: the snapshot is complete once end == T

    @property
    def final(self) -> bool:
        return self.end >= self.num_tokens


class SnapshotRecorder:
    """Worker side: copies the K/V rows written for planned slots, writes complete snapshots."""

    def __init__(self, directory: Path, num_layers: int) -> None:
        self.directory = directory
        self.num_layers = num_layers
        self._buffers: dict[
            str, tuple[torch.Tensor, torch.Tensor]
        ] = {}  # name -> keys, values [L,H,T,d]
        self._lookup: tuple[torch.Tensor, torch.Tensor] | None = (
            None  # sorted slots, their positions
        )

    @property
    def pending(self) -> list[str]:
        """Snapshots with rows recorded and no file written yet."""
        return list(self._buffers)

    def drop(self, names: list[str]) -> None:
        """Forget the rows of snapshots whose request ended before its prompt was computed."""
        for name in names:
            self._buffers.pop(name, None)

    def begin_step(self, plans: list[SnapshotPlan]) -> None:
        """Index this step's planned slots (one sorted table for every layer of the step)."""
        self._lookup = None
        if not plans:
            return
        slots, owners = [], []
        for index, plan in enumerate(plans):
            slots.append(torch.as_tensor(plan.slots, dtype=torch.long))
            owners.append(
                torch.stack(
                    [
                        torch.full((plan.end - plan.start,), index, dtype=torch.long),
                        torch.arange(plan.start, plan.end),
                    ],
                    dim=1,
                )
            )
        slots_all, order = torch.cat(slots).sort()
        self._lookup = (slots_all, torch.cat(owners)[order])
        self._plans = plans

    def record(
        self,
        layer_index: int,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Copy the rows of ``key/value [N, H, d]`` whose slot is planned this step."""
        if self._lookup is None:
            return
        sorted_slots, owners = self._lookup
        n = min(key.shape[0], slot_mapping.shape[0])
        written = slot_mapping[:n].to("cpu", torch.long)
        where = torch.searchsorted(sorted_slots, written).clamp_(
            max=sorted_slots.numel() - 1
        )
        hit = sorted_slots[where] == written
        if not bool(hit.any()):
            return
        rows, owner = hit.nonzero().squeeze(1), owners[where[hit]]
        for index, plan in enumerate(self._plans):
            mine = owner[:, 0] == index
            if bool(mine.any()):
                keys, values = self._buffer(plan, key, value)
                positions = owner[mine, 1]
                keys[layer_index, :, positions] = (
                    key[rows[mine]].to("cpu").transpose(0, 1).to(keys.dtype)
                )
                values[layer_index, :, positions] = (
                    value[rows[mine]].to("cpu").transpose(0, 1).to(values.dtype)
                )

    def finish_step(self) -> None:
        """Write the snapshots whose prompt is complete after this step."""
        if self._lookup is None:
            return
        self._lookup = None
        for plan in self._plans:
            if plan.final and plan.name in self._buffers:
                keys, values = self._buffers.pop(plan.name)
                self._write(plan, keys, values)

    def _buffer(self, plan: SnapshotPlan, key: torch.Tensor, value: torch.Tensor):
        if plan.name not in self._buffers:
            heads, dim = key.shape[1], key.shape[2]
            shape = (self.num_layers, heads, plan.num_tokens, dim)
            self._buffers[plan.name] = (
                torch.zeros(shape, dtype=key.dtype),
                torch.zeros((*shape[:3], value.shape[2]), dtype=value.dtype),
            )
        return self._buffers[plan.name]

    def _write(
        self, plan: SnapshotPlan, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"{plan.name}.safetensors"
        partial = final.with_suffix(f".{os.getpid()}.partial")
        save_file(
            {"keys": keys.contiguous(), "values": values.contiguous()},
            str(partial),
            metadata={"num_tokens": str(plan.num_tokens)},
        )
        os.replace(partial, final)  # readers see a whole file or none
        logger.info(
            "KV snapshot %s: %d tokens written to %s", plan.name, plan.num_tokens, final
        )


# ---------------------------------------------------------------------------- offline entry point
@dataclass
class EngineKV:
    """A prompt's K/V as the engine stored them: ``keys``/``values [L, H, T, d]``, post-RoPE."""

    token_ids: list[int]
    keys: torch.Tensor
    values: torch.Tensor


def snapshot_kv(llm: Any, token_ids: list[int], *, keep_file: bool = False) -> EngineKV:
    """Run ``token_ids`` through ``llm`` (a ``vllm.LLM`` started with
    ``engine_kwargs(..., kv_snapshots=True)``) and return the K/V the engine computed."""
    from safetensors.torch import load_file
    from vllm import SamplingParams

    extra = _connector_extra(llm)
    if not extra.get("kv_snapshots"):
        raise ValueError(
            "this engine takes no KV snapshots; start it with engine_kwargs(..., kv_snapshots=True)"
        )
    from vllm_compaction.vllm.prompt import open_store

    name = uuid.uuid4().hex
    path = snapshot_dir(open_store(extra.get("store")).root) / f"{name}.safetensors"
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        extra_args={"kv_transfer_params": {SNAPSHOT_PARAM: name}},
    )
    # a salt of its own: no prefix-cache hit may skip computing (and so recording) a token
    llm.generate(
        [{"prompt_token_ids": list(token_ids), "cache_salt": f"kv-snapshot:{name}"}],
        params,
        use_tqdm=False,
    )
    if not path.is_file():
        raise RuntimeError(
            f"the engine wrote no KV snapshot for the prompt ({path} is missing); its log says why"
        )
    try:
        tensors = load_file(str(path))
    finally:
        if not keep_file:
            path.unlink(missing_ok=True)
    return EngineKV(list(token_ids), tensors["keys"], tensors["values"])


def _connector_extra(llm: Any) -> dict[str, Any]:
    config = llm.llm_engine.vllm_config.kv_transfer_config
    return dict(config.kv_connector_extra_config or {}) if config is not None else {}


def identity_cache(llm: Any, kv: EngineKV):
    """A ``CompactedCache`` that keeps every snapshotted key with beta = 0 (t = T): served by the
    same engine it must reproduce the uncompacted prompt exactly, in the engine's dtype."""
    from vllm_compaction.cache import CompactedCache
    from vllm_compaction.vllm.engine import engine_fingerprint

    return CompactedCache.identity(
        list(kv.keys),  # [L, H, T, d] -> per-layer [H, T, d]
        list(kv.values),
        kv.token_ids,
        engine_fingerprint(llm.llm_engine.vllm_config.model_config),
    )
