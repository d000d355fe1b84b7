"""Reference decoder: plain torch generation from a compacted cache (the exactness oracle)."""

from vllm_compaction.reference.decoder import (
    Continuation,
    Generation,
    ReferenceDecoder,
    prefix_layers,
)

__all__ = ["Continuation", "Generation", "ReferenceDecoder", "prefix_layers"]
