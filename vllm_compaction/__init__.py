"""vllm-compaction: Attention Matching compacted prefixes, computed offline and served by vLLM.

``import vllm_compaction`` is cheap: the public names load their modules on first use, so the
torch-only core (``vllm_compaction.am``, ``vllm_compaction.cache``) imports without
transformers or vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "compact": "vllm_compaction.pipeline",
    "compact_prefix": "vllm_compaction.pipeline",
    "RECIPES": "vllm_compaction.pipeline",
    "CompactedCache": "vllm_compaction.cache",
    "ModelFingerprint": "vllm_compaction.cache",
    "CompactedHeads": "vllm_compaction.am",
    "compact_heads": "vllm_compaction.am",
    "ReferenceDecoder": "vllm_compaction.reference",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'vllm_compaction' has no attribute {name!r}")
