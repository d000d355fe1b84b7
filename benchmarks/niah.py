"""Needle-in-a-haystack through the reference decoder: methods x ratios on seeded instances.

    python -m benchmarks.niah --methods am-highest-attn-fast,kvzip --ratios 0.1,0.05,0.02 \
        --instances 12 --out benchmarks/results/niah.json

Every method sees identical instances (same seeds, prompts and continuation tokens). Writes
every instance's answer, score, compaction time and slot counts, a summary table, and a plot.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from tqdm.auto import tqdm

from vllm_compaction.eval import make_needle, needle_prompt, score_answer
from vllm_compaction.eval.variants import parse_variant
from vllm_compaction.models import load_adapter
from vllm_compaction.pipeline import RECIPES, compact_prepared, prepare_prefix
from vllm_compaction.reference import ReferenceDecoder

from benchmarks.output import pyplot, save_result

logger = logging.getLogger("benchmarks.niah")


def run(args: argparse.Namespace) -> dict:
    adapter = load_adapter(args.model)
    decoder = ReferenceDecoder(adapter)
    variants = [parse_variant(s) for s in args.methods.split(";" if ";" in args.methods else ",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    rows, full_rows = [], []
    seeds = range(args.seed, args.seed + args.instances)
    bar = tqdm(total=len(seeds) * (1 + len(variants) * len(ratios)), desc="niah", unit="run")
    for seed in seeds:
        inst = make_needle(adapter.tokenizer, args.tokens, seed=seed)
        prompt = needle_prompt(adapter, inst)
        full = decoder.generate(adapter.prefill(prompt.prefix_ids, capture_queries=False),
                                prompt.continuation_ids, max_new_tokens=args.max_new_tokens)
        full_rows.append(dict(seed=seed, value=inst.value, answer=full.text, correct=score_answer(inst, full.text),
                              prefix_tokens=len(prompt.prefix_ids)))
        bar.update(1)
        prepared = {}  # one prefill + query plan per query source, shared by methods and ratios
        for variant in variants:
            kwargs = variant.kwargs()
            queries = kwargs.pop("queries", None) or RECIPES[variant.method].queries
            if queries not in prepared:
                prepared[queries] = prepare_prefix(adapter, prompt.prefix_ids, prompt.compact_mask,
                                                   queries=queries, seed=seed)
            for ratio in ratios:
                start = time.perf_counter()
                cache = compact_prepared(prepared[queries], ratio=ratio, **kwargs)
                seconds = time.perf_counter() - start
                gen = decoder.generate(cache, prompt.continuation_ids, max_new_tokens=args.max_new_tokens)
                lengths = cache.head_lengths[cache.layer_compacted]
                rows.append(dict(method=variant.label, ratio=ratio, seed=seed, value=inst.value,
                                 answer=gen.text, correct=score_answer(inst, gen.text),
                                 compaction_s=seconds, timings=cache.timings,
                                 physical_slots=cache.physical_slots, max_head=int(lengths.max()),
                                 min_head=int(lengths.min())))
                bar.update(1)
    bar.close()
    summary = {"full-context": f"{sum(r['correct'] for r in full_rows)}/{len(full_rows)}"}
    for variant in variants:
        summary[variant.label] = {
            str(r): f"{sum(x['correct'] for x in rows if x['method'] == variant.label and x['ratio'] == r)}"
                    f"/{len(seeds)}" for r in ratios}
    return dict(model=args.model, tokens=args.tokens, instances=args.instances, seed=args.seed,
                ratios=ratios, methods=[v.label for v in variants], summary=summary,
                full_context=full_rows, rows=rows, created=time.time())


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    n = result["instances"]
    for method, per_ratio in result["summary"].items():
        if isinstance(per_ratio, dict):
            xs = sorted(float(r) for r in per_ratio)
            ax.plot(xs, [int(per_ratio[str(x)].split("/")[0]) / n for x in xs], marker="o", label=method)
    full = int(result["summary"]["full-context"].split("/")[0]) / n
    ax.axhline(full, color="k", linestyle="--", label="full context")
    ax.set_xscale("log")
    ax.set_xlabel("compaction ratio (slots / context tokens)")
    ax.set_ylabel(f"NIAH accuracy ({n} instances)")
    ax.set_title(f"{result['model']}, {result['tokens']}-token haystacks")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="am-highest-attn-fast,kvzip,am-highest-attn-fast:budgets=uniform")
    parser.add_argument("--ratios", default="0.1,0.05,0.02")
    parser.add_argument("--instances", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results/niah.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = run(args)
    out = save_result(result, args.out, plot)
    logger.warning("summary: %s", json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
