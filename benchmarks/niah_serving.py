"""Needle-in-a-haystack answered through vLLM vs through the reference decoder, same caches.

Run ``python -m benchmarks.niah_serving [--instances 12] [--ratio 0.1]``. For each seeded
2,000-token essay instance the prefix is compacted once (am-highest-attn-fast, default global
budgets) and the question after it is answered greedily twice: by the reference decoder (plain
torch) and by a vLLM engine with the compaction plugin. Caches are kept in ``--store`` and reused
by later runs. Writes ``benchmarks/results/niah_serving.json``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.output import save_result

logger = logging.getLogger("benchmarks.niah_serving")

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=12)
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--method", default="am-highest-attn-fast")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--store", default="/tmp/vllm-compaction-niah-store")
    parser.add_argument("--out", default=str(RESULTS / "niah_serving.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from vllm import LLM, SamplingParams

    from vllm_compaction.cache import LocalDiskStore
    from vllm_compaction.eval import make_needle, needle_prompt, score_answer
    from vllm_compaction.models import load_adapter, resolve
    from vllm_compaction.pipeline import compact_prepared, prepare_prefix
    from vllm_compaction.reference import ReferenceDecoder
    from vllm_compaction.vllm import compacted_prompt, engine_kwargs

    adapter = load_adapter("smollm2-135m")
    decoder = ReferenceDecoder(adapter)
    store = LocalDiskStore(args.store)
    rows, prompts = [], []
    for seed in tqdm(range(args.instances), desc="compact + reference"):
        inst = make_needle(adapter.tokenizer, args.tokens, seed=seed)
        prompt = needle_prompt(adapter, inst)
        entry = f"niah-{args.method}-{args.ratio}-{args.tokens}-{seed}".replace(
            ".", "_"
        )
        cache = store.get_id(entry)
        seconds = None
        if cache is None or cache.model != adapter.fingerprint():
            start = time.perf_counter()
            prepared = prepare_prefix(
                adapter,
                prompt.prefix_ids,
                prompt.compact_mask,
                queries="repeat-prefill",
            )
            cache = compact_prepared(prepared, ratio=args.ratio, method=args.method)
            seconds = time.perf_counter() - start
            store.put_id(entry, cache)
        reference = decoder.generate(
            cache, prompt.continuation_ids, max_new_tokens=args.max_new_tokens
        )
        rows.append(
            dict(
                seed=seed,
                value=inst.value,
                entry=entry,
                compaction_s=seconds,
                physical_slots=cache.max_head_length,
                reference_answer=reference.text,
                reference_correct=score_answer(inst, reference.text),
            )
        )
        prompts.append((inst, entry, prompt.continuation_ids))

    llm = LLM(
        str(resolve("smollm2-135m")),
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        kv_cache_memory_bytes=2 << 30,
        seed=0,
        **engine_kwargs(store=args.store),
    )
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0)
    batch = [
        compacted_prompt(entry, ids, llm=llm, store=store) for _, entry, ids in prompts
    ]
    outputs = llm.generate(batch, params)
    for row, (inst, _, _), out in zip(rows, prompts, outputs):
        row["vllm_answer"] = out.outputs[0].text
        row["vllm_correct"] = score_answer(inst, out.outputs[0].text)
        row["same_answer"] = row["vllm_answer"] == row["reference_answer"]
    result = dict(
        model="smollm2-135m",
        method=args.method,
        ratio=args.ratio,
        tokens=args.tokens,
        instances=args.instances,
        vllm_correct=sum(r["vllm_correct"] for r in rows),
        reference_correct=sum(r["reference_correct"] for r in rows),
        identical_answers=sum(r["same_answer"] for r in rows),
        rows=rows,
        created=time.time(),
    )
    save_result(result, args.out)
    logger.warning(
        "vLLM %d/%d, reference %d/%d, identical answers %d/%d",
        result["vllm_correct"],
        args.instances,
        result["reference_correct"],
        args.instances,
        result["identical_answers"],
        args.instances,
    )


if __name__ == "__main__":
    main()
