"""``make demo``: compact a needle-in-a-haystack context and answer from the compacted cache."""

from __future__ import annotations

import logging
import sys
import time

from vllm_compaction.eval import make_needle, needle_prompt, score_answer
from vllm_compaction.models import load_adapter
from vllm_compaction.pipeline import compact_prefix
from vllm_compaction.reference import ReferenceDecoder

__all__ = ["run_demo"]

logger = logging.getLogger(__name__)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def run_demo(*, model: str = "smollm2-135m", ratio: float = 0.1, method: str = "am-highest-attn-fast",
             tokens: int = 2000, seed: int = 0) -> int:
    out = sys.stdout.write
    adapter = load_adapter(model)
    decoder = ReferenceDecoder(adapter)
    instance = make_needle(adapter.tokenizer, tokens, seed=seed)
    prompt = needle_prompt(adapter, instance)
    out(f"context: {len(prompt.prefix_ids)} prefix tokens ({int(prompt.compact_mask.sum())} compacted), "
        f"needle {instance.value!r} for {instance.key!r} at depth {instance.depth:.2f}\n")

    start = time.perf_counter()
    full = decoder.generate(adapter.prefill(prompt.prefix_ids, capture_queries=False),
                            prompt.continuation_ids, max_new_tokens=16)
    full_s = time.perf_counter() - start

    cache = compact_prefix(adapter, prompt.prefix_ids, prompt.compact_mask, ratio=ratio, method=method,
                           progress=True)
    start = time.perf_counter()
    answer = decoder.generate(cache, prompt.continuation_ids, max_new_tokens=16)
    answer_s = time.perf_counter() - start

    s = cache.summary()
    lengths = cache.head_lengths[cache.layer_compacted]
    out(f"method {method} at ratio {ratio}: {s['physical_slots']} slots kept of "
        f"{cache.logical_length * cache.num_layers * adapter.num_kv_heads} "
        f"(per-head t_h from {int(lengths.min())} to {int(lengths.max())})\n")
    out(f"KV bytes: original {_mib(cache.original_nbytes)}, compacted packed {_mib(cache.nbytes)}, "
        f"padded per layer {_mib(cache.padded_nbytes)}\n")
    out("timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in cache.timings.items()) + "\n")
    out(f"full context answer ({full_s:.1f}s):  {full.text.strip()!r} "
        f"[{'correct' if score_answer(instance, full.text) else 'wrong'}]\n")
    out(f"compacted answer ({answer_s:.1f}s):     {answer.text.strip()!r} "
        f"[{'correct' if score_answer(instance, answer.text) else 'wrong'}]\n")
    return 0
