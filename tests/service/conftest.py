"""The real SmolLM2 tokenizer and fingerprint, for services built without an engine."""

from __future__ import annotations

import pytest

MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def checkpoint():
    from transformers import AutoTokenizer

    from vllm_compaction.models import resolve
    from vllm_compaction.models.fingerprint import checkpoint_fingerprint

    path = resolve(MODEL)
    return (
        path,
        AutoTokenizer.from_pretrained(path),
        checkpoint_fingerprint(path, dtype="float32"),
    )
