"""The ``vllm.general_plugins`` entry point: registers the compaction attention backend and the
``CompactionConnector`` in every vLLM process.

Which backend carries the per-slot bias depends on the platform:

* CPU: ``CPU_ATTN`` is overridden by :class:`.cpu_backend.CompactionCPUAttentionBackend` (the CPU
  platform ignores ``--attention-backend`` and always picks ``CPU_ATTN``), nothing to select;
* CUDA: ``AttentionBackendEnum.CUSTOM`` is registered as
  :class:`.cuda_backend.CompactionTritonBackend`; select it with ``--attention-backend CUSTOM``
  (``vllm serve ... --attention-backend CUSTOM --kv-transfer-config ...``, or
  ``attention_backend="CUSTOM"`` in ``vllm.LLM``). The default CUDA backends (FlashAttention,
  FlashInfer, stock Triton) are left alone, so they never see widened pages.

Registration is idempotent and never raises (a general plugin that raised would stop every vLLM
deployment that merely has this package installed). The attention override is inert unless the
compaction connector is configured; an untested vLLM version is refused where it matters, when
the connector is constructed (:func:`.compat.check_vllm_version`).
"""

from __future__ import annotations

import logging

from vllm_compaction.vllm import compat
from vllm_compaction.vllm.compat import (
    TESTED_VLLM_VERSIONS,
    UnsupportedVLLMError,
    check_vllm_version,
)

__all__ = [
    "TESTED_VLLM_VERSIONS",
    "CONNECTOR_NAME",
    "register",
    "check_vllm_version",
    "UnsupportedVLLMError",
]

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "CompactionConnector"
_registered = False


def register() -> None:
    """Register the backend override and the connector (safe to call any number of times)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        compat.check_vllm_version()
    except UnsupportedVLLMError as exc:
        logger.warning("%s The compaction plugin stays disabled.", exc)
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    if not compat.connector_registered(CONNECTOR_NAME):
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "vllm_compaction.vllm.connector", "CompactionConnector"
        )
    if current_platform.is_cpu():
        # the CPU platform ignores --attention-backend and always picks CPU_ATTN
        register_backend(
            AttentionBackendEnum.CPU_ATTN,
            "vllm_compaction.vllm.cpu_backend.CompactionCPUAttentionBackend",
        )
    elif current_platform.is_cuda():
        # a class path, not the class: importing the backend here would pull in Triton kernels in
        # every process; users opt in with --attention-backend CUSTOM
        register_backend(
            AttentionBackendEnum.CUSTOM,
            "vllm_compaction.vllm.cuda_backend.CompactionTritonBackend",
        )
    logger.debug("vllm-compaction plugin registered")
