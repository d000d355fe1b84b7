"""Build the compaction service from a running vLLM server's configuration."""

from __future__ import annotations

import logging
import os
from argparse import Namespace
from pathlib import Path

from vllm_compaction.service.config import ServiceConfig
from vllm_compaction.service.service import CompactionService
from vllm_compaction.service.supervisor import Supervisor
from vllm_compaction.vllm.backend_common import compaction_enabled
from vllm_compaction.vllm.engine import engine_fingerprint, kv_bytes_per_token
from vllm_compaction.vllm.layout import DEFAULT_LAYOUT
from vllm_compaction.vllm.plugin import CONNECTOR_NAME

__all__ = ["start_service"]

logger = logging.getLogger(__name__)


async def start_service(vllm_config, args: Namespace) -> CompactionService:
    """The service for this engine, with its local workers started (call on the server's loop).

    ValueError (one sentence) when the engine was not started with the compaction connector.
    """
    # the test the backends use to take the compaction path
    if not compaction_enabled(vllm_config):
        raise ValueError(
            f"the engine runs without the {CONNECTOR_NAME} KV connector: start it with "
            f"`vllm-compaction serve` or pass --kv-transfer-config (see docs/serving.md)"
        )
    from transformers import AutoTokenizer

    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    from vllm_compaction.vllm.prompt import default_store_dir

    engine_store = Path(extra.get("store") or default_store_dir())
    config = ServiceConfig.from_env(store=str(engine_store))
    if config.store is not None and config.store.resolve() != engine_store.resolve():
        raise ValueError(
            f"the service store {config.store} (VLLM_COMPACTION_STORE) is not the store the "
            f"engine's connector reads ({engine_store}); give both the same directory"
        )
    model_config = vllm_config.model_config
    names = model_config.served_model_name
    names = [names] if isinstance(names, str) else list(names or [model_config.model])
    service = CompactionService(
        config,
        model_path=model_config.model,
        served_model_names=names,
        fingerprint=engine_fingerprint(model_config),
        tokenizer=AutoTokenizer.from_pretrained(
            model_config.tokenizer or model_config.model
        ),
        kv_bytes_per_token=kv_bytes_per_token(vllm_config),
        max_model_len=model_config.max_model_len,
        layout=DEFAULT_LAYOUT,
        block_size=vllm_config.cache_config.block_size,
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
    )
    # vLLM checks bearer keys only when it has some (--api-key or VLLM_API_KEY); without them a
    # header is not a credential, and compactions must not be split by it
    service.keyed_owners = bool(
        getattr(args, "api_key", None) or os.environ.get("VLLM_API_KEY")
    )
    host = getattr(args, "host", None)
    host = "127.0.0.1" if host in (None, "", "0.0.0.0", "::") else host
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    service.supervisor = Supervisor(
        service, f"{scheme}://{host}:{args.port}", config.local_workers
    )
    service.supervisor.start()
    logger.info(
        "compaction service: store %s, %d local worker(s), auto-compaction %s",
        service.store.root,
        config.local_workers,
        f"above {config.auto_compact_threshold_tokens} tokens"
        if config.auto_compact_threshold_tokens
        else "off",
    )
    return service
