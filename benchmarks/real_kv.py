"""Dump real SmolLM2 keys/values/reference queries of an essay context for compaction_speed.

    python -m benchmarks.real_kv --tokens 2000 --layers 6,12,18,24 --out benchmarks/results/real_kv.pt
    python -m benchmarks.compaction_speed --kv benchmarks/results/real_kv.pt

Queries are repeat-prefill plus context-prefill (about 12k per KV head for 2,000 tokens); the
time spent generating them is stored as ``queries_s`` (per KV head of the dumped layers).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from vllm_compaction.corpus import haystack_text
from vllm_compaction.models import load_adapter
from vllm_compaction.pipeline import prepare_prefix

logger = logging.getLogger("benchmarks.real_kv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--layers", default="6,12,18,24")
    parser.add_argument("--queries", default="repeat-prefill+context-prefill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/real_kv.pt")
    )
    args = parser.parse_args()
    if "*" in args.queries:  # the speed benchmark fits the saved rows as they are
        parser.error(
            "--queries: the saved queries carry no weights; drop the '*k' of a source"
        )
    logging.basicConfig(level=logging.INFO)
    adapter = load_adapter(args.model)
    text = haystack_text(args.tokens, adapter.tokenizer, seed=args.seed)
    ids, mask = adapter.chat_content([{"role": "user", "content": text}])
    start = time.perf_counter()
    prepared = prepare_prefix(adapter, ids, mask, queries=args.queries, seed=args.seed)
    queries = prepared.off_policy_queries()
    seconds = time.perf_counter() - start
    layers = [int(x) for x in args.layers.split(",")]
    kv = prepared.spec.kv
    blob = {
        "keys": [kv.keys[i][:, mask].contiguous() for i in layers],
        "values": [kv.values[i][:, mask].contiguous() for i in layers],
        "queries": [queries[i].contiguous() for i in layers],
        "queries_s": seconds / (adapter.num_layers * adapter.num_kv_heads),
        "meta": {
            "model": args.model,
            "tokens": int(mask.sum()),
            "layers": layers,
            "queries": args.queries,
            "scales": [adapter.layer_scales()[i] for i in layers],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(blob, args.out)
    logger.info(
        "wrote %s: T=%d, n=%d per KV head, queries %.1fs in all",
        args.out,
        int(mask.sum()),
        blob["queries"][0].shape[1],
        seconds,
    )


if __name__ == "__main__":
    main()
