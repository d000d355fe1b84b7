"""Service settings: ``vllm-compaction serve --compaction-*`` flags, or ``VLLM_COMPACTION_*``
environment variables in a plain ``vllm serve`` deployment (the flags set the variables)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator

from vllm_compaction.service.protocol import MethodName, QuerySources, check_layer_share

__all__ = ["ServiceConfig", "ENV_PREFIX", "FLAGS"]

ENV_PREFIX = "VLLM_COMPACTION_"

# field -> (flag, help); each flag sets VLLM_COMPACTION_<FIELD>
FLAGS: dict[str, tuple[str, str]] = {
    "store": (
        "--compaction-store",
        "directory of compacted caches and jobs (shared with workers)",
    ),
    "store_max_bytes": (
        "--compaction-store-max-bytes",
        "evict least recently used caches when everything under the "
        "store exceeds this size (default: its size at start-up plus half the free disk, at most 64 GiB)",
    ),
    "fresh_hold_s": (
        "--compaction-fresh-hold-s",
        "a new cache is kept from eviction this long or until its first use",
    ),
    "serving_hold_s": (
        "--compaction-serving-hold-s",
        "a cache a request is served from is kept from eviction this long (the "
        "engine reads it when the request is scheduled)",
    ),
    "local_workers": (
        "--compaction-workers",
        "compaction worker processes the server starts (0: only remote)",
    ),
    "worker_token": (
        "--compaction-worker-token",
        "secret remote workers present (default: random, "
        "written to <store>/worker-token)",
    ),
    "worker_lease_s": (
        "--compaction-worker-lease-s",
        "a running job fails when its worker is silent this long",
    ),
    "job_timeout_s": (
        "--compaction-job-timeout-s",
        "a compaction still running after this long fails (its "
        "worker stops the computation)",
    ),
    "max_attempts": (
        "--compaction-max-attempts",
        "runs of a job whose worker died before it fails",
    ),
    "max_queued_jobs": (
        "--compaction-max-queued",
        "compactions queued at once; more are answered 429 with Retry-After",
    ),
    "max_queued_per_key": (
        "--compaction-max-queued-per-key",
        "compactions one API key may have queued; more are answered 429 with Retry-After",
    ),
    "device": (
        "--compaction-device",
        "where local workers run compactions: cpu (default: the GPU's memory stays "
        "vLLM's), cuda, cuda:N or auto (leave room with --gpu-memory-utilization)",
    ),
    "auto_compact_threshold_tokens": (
        "--auto-compact-threshold-tokens",
        "compact a conversation once its prompt exceeds this many tokens",
    ),
    "auto_compact_ratio": ("--auto-compact-ratio", "ratio of automatic compactions"),
    "auto_compact_target_tokens": (
        "--auto-compact-target-tokens",
        "content slots per head that automatic compactions keep, instead of a "
        "ratio: compact to fit (a conversation no longer than this is left alone)",
    ),
    "auto_compact_keep_last_tokens": (
        "--auto-compact-keep-last-tokens",
        "content tokens at the end that automatic compactions keep exact",
    ),
    "auto_compact_method": ("--auto-compact-method", "method of automatic compactions"),
    "auto_compact_queries": (
        "--auto-compact-queries",
        "query source of automatic compactions",
    ),
    "auto_compact_min_layer_share": (
        "--auto-compact-min-layer-share",
        "share of an equal split every layer keeps first in automatic "
        "compactions (global-budget methods; 0.3 measured best for needles)",
    ),
}


class ServiceConfig(BaseModel):
    store: Path | None = None
    store_max_bytes: int | None = Field(None, ge=0)
    fresh_hold_s: float = Field(600.0, ge=0)
    serving_hold_s: float = Field(120.0, ge=0)
    local_workers: int = Field(1, ge=0, le=64)
    worker_token: str | None = Field(None, min_length=16)
    worker_lease_s: float = Field(20.0, gt=0)
    job_timeout_s: float = Field(3600.0, gt=0)
    max_attempts: int = Field(3, ge=1, le=20)
    retry_backoff_s: float = Field(5.0, ge=0)
    max_queued_jobs: int = Field(256, ge=1)
    max_queued_per_key: int = Field(32, ge=1)
    device: str = "cpu"
    heartbeat_s: float = Field(1.0, gt=0)
    auto_compact_threshold_tokens: int | None = Field(None, gt=0)
    auto_compact_ratio: float = Field(0.2, gt=0, le=1)
    auto_compact_target_tokens: int | None = Field(None, gt=0)
    auto_compact_keep_last_tokens: int = Field(0, ge=0)
    # checked at start-up, not when the first automatic compaction fails
    auto_compact_method: MethodName = "am"
    auto_compact_queries: QuerySources | None = None
    auto_compact_min_layer_share: float | None = Field(None, ge=0, le=1)

    @field_validator("device")
    @classmethod
    def _device_exists(cls, device: str) -> str:
        from vllm_compaction.models.loader import resolve_device

        # ValueError with a sentence for a device not here
        return str(resolve_device(device))

    @field_validator("auto_compact_min_layer_share")
    @classmethod
    def _layer_share_needs_global_budgets(
        cls, share: float | None, info: ValidationInfo
    ) -> float | None:
        # else the method itself failed, and says so
        if "auto_compact_method" in info.data:
            check_layer_share(info.data["auto_compact_method"], share)
        return share

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **defaults: Any
    ) -> ServiceConfig:
        """Settings from ``VLLM_COMPACTION_<FIELD>`` variables over ``defaults``.

        ValueError with one sentence naming the variable for a value that does not parse.
        """
        env: Mapping[str, str] = os.environ if environ is None else environ
        values = dict(defaults)
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw not in (None, ""):
                values[name] = raw
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = str(first["loc"][0]) if first.get("loc") else "?"
            raise ValueError(
                f"{ENV_PREFIX}{field.upper()} (or {FLAGS.get(field, ('--?',))[0]}): "
                f"{first['msg']}"
            ) from None
