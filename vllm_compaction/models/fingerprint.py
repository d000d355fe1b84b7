"""``ModelFingerprint`` of a checkpoint folder, from its files (no model loaded).

The offline pipeline (HF transformers) and the serving engine (vLLM) load the same checkpoint
into different module layouts, so identity is taken from what both read: ``config.json`` and the
weight files. Weight digests come from the prepared-model manifest when it lists them, otherwise
the ``*.safetensors`` files are hashed once per (path, size, mtime).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from vllm_compaction.cache.format import ModelFingerprint, json_digest

__all__ = ["checkpoint_fingerprint"]

# config keys that differ between tools reading the same checkpoint, not between models
_VOLATILE_CONFIG_KEYS = (
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_name_or_path",
)
_MANIFEST_NAME = "vllm_compaction_model.json"


@functools.lru_cache(maxsize=16)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _weights_digest(folder: Path) -> str:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights.")
    listed: dict = {}
    manifest = folder / _MANIFEST_NAME
    if manifest.is_file():
        listed = json.loads(manifest.read_text()).get("files") or {}
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        entry = listed.get(path.name) or {}
        sha = entry.get("sha256") if entry.get("size") == stat.st_size else None
        digest.update(
            f"{path.name}:{sha or _file_sha256(str(path), stat.st_size, stat.st_mtime_ns)};".encode()
        )
    return digest.hexdigest()


def checkpoint_fingerprint(
    folder: str | Path, *, dtype: str = "float32", name: str = ""
) -> ModelFingerprint:
    """The fingerprint of the HF checkpoint in ``folder`` (``config.json`` + weights)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    num_q = int(text["num_attention_heads"])
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return ModelFingerprint(
        architecture=(config.get("architectures") or ["?"])[0],
        num_layers=int(text["num_hidden_layers"]),
        num_kv_heads=int(text.get("num_key_value_heads") or num_q),
        num_q_heads=num_q,
        head_dim=int(text.get("head_dim") or text["hidden_size"] // num_q),
        config_digest=json_digest(stable),
        weights_digest=_weights_digest(folder),
        dtype=dtype,
        name=name or folder.name,
    )
