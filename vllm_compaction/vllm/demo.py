"""``make demo``: compact a needle-in-a-haystack context, then answer from the compacted cache
through a vLLM engine with the plugin (and, for comparison, from the full prompt and the
reference decoder)."""

from __future__ import annotations

import logging
import os
import sys
import time

from vllm_compaction.eval import make_needle, needle_prompt, score_answer
from vllm_compaction.models import load_adapter, resolve
from vllm_compaction.pipeline import compact_prefix
from vllm_compaction.reference import ReferenceDecoder

__all__ = ["run_demo"]

logger = logging.getLogger(__name__)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def run_demo(
    *,
    model: str = "smollm2-135m",
    ratio: float = 0.1,
    method: str = "am",
    tokens: int = 2000,
    seed: int = 0,
) -> int:
    out = sys.stdout.write
    adapter = load_adapter(model)
    decoder = ReferenceDecoder(adapter)
    instance = make_needle(adapter.tokenizer, tokens, seed=seed)
    prompt = needle_prompt(adapter, instance)
    out(
        f"context: {len(prompt.prefix_ids)} prefix tokens ({int(prompt.compact_mask.sum())} compacted), "
        f"needle {instance.value!r} for {instance.key!r} at depth {instance.depth:.2f}\n"
    )

    start = time.perf_counter()
    full = decoder.generate(
        adapter.prefill(prompt.prefix_ids, capture_queries=False),
        prompt.continuation_ids,
        max_new_tokens=16,
    )
    full_s = time.perf_counter() - start

    cache = compact_prefix(
        adapter,
        prompt.prefix_ids,
        prompt.compact_mask,
        ratio=ratio,
        method=method,
        progress=True,
    )
    reference = decoder.generate(cache, prompt.continuation_ids, max_new_tokens=16)

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams

    from vllm_compaction.vllm import compacted_prompt, default_store_dir, engine_kwargs

    out("starting vLLM with the compaction plugin ...\n")
    llm = LLM(
        str(resolve(model)),
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
        **engine_kwargs(store=default_store_dir()),
    )
    params = SamplingParams(max_tokens=16, temperature=0.0)
    served_prompt = compacted_prompt(cache, prompt.continuation_ids, llm=llm)
    start = time.perf_counter()
    answer = llm.generate([served_prompt], params, use_tqdm=False)[0].outputs[0]
    answer_s = time.perf_counter() - start
    start = time.perf_counter()
    plain = llm.generate(
        [{"prompt_token_ids": prompt.prefix_ids + prompt.continuation_ids}],
        params,
        use_tqdm=False,
    )[0].outputs[0]
    plain_s = time.perf_counter() - start

    s = cache.summary()
    lengths = cache.head_lengths[cache.layer_compacted]
    out(
        f"method {method} at ratio {ratio}: {s['physical_slots']} slots kept of "
        f"{cache.logical_length * cache.num_layers * adapter.num_kv_heads} "
        f"(per-head t_h from {int(lengths.min())} to {int(lengths.max())})\n"
    )
    out(
        f"KV bytes: original {_mib(cache.original_nbytes)}, compacted packed {_mib(cache.nbytes)}, "
        f"padded per layer {_mib(cache.padded_nbytes)}\n"
    )
    out(
        "timings: "
        + ", ".join(f"{k} {v:.2f}s" for k, v in cache.timings.items())
        + "\n"
    )

    def verdict(text: str) -> str:
        return "correct" if score_answer(instance, text) else "wrong"

    out(
        f"vLLM, compacted prefix ({len(served_prompt['prompt_token_ids'])} physical prompt tokens, "
        f"{answer_s:.2f}s): {answer.text.strip()!r} [{verdict(answer.text)}]\n"
    )
    out(
        f"vLLM, full prompt ({len(prompt.prefix_ids) + len(prompt.continuation_ids)} prompt tokens, "
        f"{plain_s:.2f}s): {plain.text.strip()!r} [{verdict(plain.text)}]\n"
    )
    out(
        f"reference decoder, compacted: {reference.text.strip()!r} [{verdict(reference.text)}]; "
        f"full context ({full_s:.1f}s): {full.text.strip()!r} [{verdict(full.text)}]\n"
    )
    # the demo tells the truth: a wrong compacted answer fails it, even where every path agrees
    correct = score_answer(instance, answer.text)
    if not correct:
        out("the compacted prefix did not answer correctly: demo FAILED\n")
    elif not score_answer(instance, reference.text):
        out(
            "the reference decoder disagrees with vLLM on the compacted prefix: demo FAILED\n"
        )
    return 0 if correct and score_answer(instance, reference.text) else 1
