"""Serving compacted prefixes from a stock vLLM engine (its private vLLM surface: :mod:`.compat`).

* :func:`engine_kwargs` / :func:`kv_transfer_config`: turn compaction on in ``vllm.LLM`` or
  ``vllm serve --kv-transfer-config``;
* :func:`compacted_prompt`: a prompt that continues a ``CompactedCache``;
* the ``vllm.general_plugins`` entry point :func:`.plugin.register` wires the attention backend
  with per-slot bias (:mod:`.cpu_backend`) and the ``CompactionConnector`` (:mod:`.connector`).

Importing this package does not import vLLM; the submodules that need it do.
"""

from vllm_compaction.vllm.compat import (
    TESTED_VLLM_VERSIONS,
    UnsupportedVLLMError,
    check_vllm_version,
)
from vllm_compaction.vllm.engine import (
    engine_fingerprint,
    engine_kwargs,
    kv_transfer_config,
)
from vllm_compaction.vllm.prompt import (
    CompactedRef,
    compacted_prompt,
    default_store_dir,
)

__all__ = [
    "TESTED_VLLM_VERSIONS",
    "CompactedRef",
    "UnsupportedVLLMError",
    "check_vllm_version",
    "compacted_prompt",
    "default_store_dir",
    "engine_fingerprint",
    "engine_kwargs",
    "kv_transfer_config",
]
