"""Compaction time of several methods on the same prepared instances, side by side in one process.

    python -m benchmarks.method_time --methods "am;am:refine_steps=50,refine_batch=1024" \
        --tasks chat-facts --seeds 1 --ratio 0.1 --out benchmarks/results/method_time.json

Each instance is prefilled once per method (the query sources may differ) and only the
compaction is timed (``compact_prepared``: query collection on-policy, budgets, fits), method
after method, so the ratios between methods are measured under the same load. Methods are
separated by ``;`` where one holds commas (``--methods "am;am:refine_steps=50,refine_batch=1024"``).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from tqdm import tqdm

from benchmarks.output import save_result
from vllm_compaction.eval.tasks import TASKS, make_task, task_prompt
from vllm_compaction.models import load_adapter
from vllm_compaction.pipeline import compact_prepared, prepare_prefix
from vllm_compaction.queries import resolve_spacing
from vllm_compaction.recipes import resolve

logger = logging.getLogger("benchmarks.method_time")


def time_methods(
    methods: list[str],
    tasks: list[str],
    seeds: list[int],
    ratio: float,
    model: str,
    tokens: int = 2000,
) -> dict:
    """Per method, its compaction seconds on every (task, seed) and their median, and the median
    of its per-instance ratio to the first method's."""
    adapter = load_adapter(model)
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    # each method's query sources, the '/auto' spacings resolved for this ratio
    queries = {m: resolve_spacing(resolve(m).recipe.queries, ratio) for m in methods}
    instances = [(task, seed) for task in tasks for seed in seeds]
    for task, seed in tqdm(instances, desc="instances", unit="instance"):
        instance = make_task(task, adapter.tokenizer, tokens, seed=seed)
        prompt = task_prompt(adapter, instance)
        for method in methods:
            prepared = prepare_prefix(
                adapter, prompt.prefix_ids, prompt.compact_mask, queries=queries[method]
            )
            start = time.perf_counter()
            compact_prepared(prepared, ratio=ratio, method=method)
            seconds[method].append(time.perf_counter() - start)
    first = seconds[methods[0]]
    return {
        "model": model,
        "ratio": ratio,
        "tokens": tokens,
        "instances": [{"task": t, "seed": s} for t, s in instances],
        "methods": {
            m: {
                "seconds": s,
                "median_s": statistics.median(s),
                "ratio_to_first_median": statistics.median(
                    x / y for x, y in zip(s, first, strict=True)
                ),
            }
            for m, s in seconds.items()
        },
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", required=True, help="';'- or ','-separated")
    parser.add_argument("--tasks", default="chat-facts")
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument(
        "--tokens", type=int, default=2000, help="each instance's length"
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", default="benchmarks/results/method_time.json")
    args = parser.parse_args(argv)
    separator = ";" if ";" in args.methods else ","
    methods = [m.strip() for m in args.methods.split(separator) if m.strip()]
    if not methods:
        parser.error("--methods names no method")
    if args.tokens <= 0:
        parser.error(f"--tokens must be a positive length, got {args.tokens}")
    tasks = args.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(
            f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}"
        )
    try:
        for method in methods:
            resolve(method)
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError as error:
        parser.error(str(error))
    result = time_methods(methods, tasks, seeds, args.ratio, args.model, args.tokens)
    save_result(result, args.out)
    for method, row in result["methods"].items():
        logger.warning(
            "%s: median %.1f s (x%.2f the first)",
            method,
            row["median_s"],
            row["ratio_to_first_median"],
        )
    return result


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    main()
