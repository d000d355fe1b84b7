"""Model adapters (post-RoPE q/k/v capture on stock HF models) and packaged checkpoints."""

from vllm_compaction.models.base import (
    ForwardResult,
    ModelAdapter,
    PrefixKV,
    UnsupportedModelError,
)
from vllm_compaction.models.loader import (
    ADAPTERS,
    adapter_class,
    load_adapter,
    resolve_device,
)
from vllm_compaction.models.prepare import ModelPrepareError, home, prepare, resolve
from vllm_compaction.models.registry import DEFAULT_MODEL
from vllm_compaction.models.runtime import AttentionRun, PrefixLayer

__all__ = [
    "ADAPTERS",
    "AttentionRun",
    "DEFAULT_MODEL",
    "ForwardResult",
    "ModelAdapter",
    "ModelPrepareError",
    "PrefixKV",
    "PrefixLayer",
    "UnsupportedModelError",
    "adapter_class",
    "home",
    "load_adapter",
    "prepare",
    "resolve",
    "resolve_device",
]
