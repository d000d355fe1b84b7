"""Serving compacted prefixes through vLLM vs full prefixes, measured side by side in one run.

Run ``python -m benchmarks.serving [--prefix-tokens 4000] [--sessions 16] [--quick]``. Writes
``benchmarks/results/serving.json`` and ``serving.png``:

1. time to first token of a follow-up question on a ``--prefix-tokens`` essay prefix, served from
   am-highest-attn-fast caches at 10% (global budgets, uncapped and with ``--max-head-ratios``
   caps: the padded layout costs the longest head) (first request: load from the store; second:
   prefix-cache hit) vs the full prefix re-prefilled (a fresh ``cache_salt`` defeats prefix caching);
2. ``--sessions`` concurrent sessions decoding ``--decode-tokens`` tokens each: decode tokens/s
   and KV blocks per session, compacted (each session its own store entry, so nothing is shared)
   vs full;
3. maximum concurrent sessions at a fixed KV memory (``--capacity-kv-mib``): ``--capacity-sessions``
   sessions on distinct ``--prefix-tokens`` prefixes submitted at once (4 more than fit), uncompacted vs compacted
   at ``--ratio`` in the padded layout (every head at the longest) vs the varlen layout (each head
   only its own slots), per head cap; the peak of running requests and KV blocks in use is read
   from the scheduler (an in-process engine), then decode tokens/s with that many sessions
   (``--only-capacity`` runs just this, into ``serving_capacity.json`` and ``.png``);
4. decode tokens/s on ordinary uncompacted traffic with the plugin on (compaction connector
   configured), with stock-width pages (the CPU default) and with widened pages, vs off (stock
   engine): one engine at a time, alternating the three over the trials (``--only-overhead`` runs
   just this, into ``plugin_overhead.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.output import pyplot, save_result

logger = logging.getLogger("benchmarks.serving")

RESULTS = Path(__file__).resolve().parent / "results"
QUESTION = [{"role": "user", "content": "Summarize the essay above in one sentence."}]


def _engine(
    dtype: str,
    store: Path | None,
    max_len: int,
    kv_bytes: int,
    max_num_seqs: int = 32,
    pages: str | None = None,
):
    """A plugin engine on ``store`` (``pages``: the KV page width, default the platform's), or a
    stock engine when ``store`` is None."""
    from vllm import LLM

    from vllm_compaction.models import resolve
    from vllm_compaction.vllm import engine_kwargs

    extra = (
        engine_kwargs(store=store, pages=pages)
        if store is not None
        else {"enable_prefix_caching": True}
    )
    return LLM(
        str(resolve("smollm2-135m")),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=max_len,
        kv_cache_memory_bytes=kv_bytes,
        max_num_seqs=max_num_seqs,
        seed=0,
        **extra,
    )


def _params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _timed(llm, prompts: list, max_tokens: int) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, _params(max_tokens), use_tqdm=False)
    return time.perf_counter() - start, outputs


def _kv_bytes_per_token(llm) -> int:
    from vllm_compaction.vllm.engine import kv_bytes_per_token

    return kv_bytes_per_token(llm.llm_engine.vllm_config)


def _workload(args):
    """The adapter, the essay prefix and question ids, and the store (shared by every phase)."""
    from vllm_compaction.cache import LocalDiskStore
    from vllm_compaction.corpus import haystack_text
    from vllm_compaction.models import load_adapter

    adapter = load_adapter("smollm2-135m")
    messages = [
        {
            "role": "user",
            "content": "Read this essay.\n\n"
            + haystack_text(args.prefix_tokens, adapter.tokenizer, seed=args.seed),
        }
    ]
    return (
        adapter,
        messages,
        adapter.chat_ids(messages),
        adapter.turn_ids(QUESTION),
        LocalDiskStore(Path(args.store)),
    )


def _caches(args, adapter, messages, prefix_ids, store) -> tuple[dict, dict]:
    """One am-highest-attn-fast cache per head cap (kept in the store between runs) and their facts."""
    from vllm_compaction.pipeline import compact

    caches, variants = {}, {}
    for cap in args.max_head_ratios:
        logger.warning(
            "compacting a %d-token prefix at %.0f%% (am-highest-attn-fast, max_head_ratio=%s)",
            len(prefix_ids),
            100 * args.ratio,
            cap,
        )
        # kept in the store under a stable id, so a re-run measures without compacting again
        kept = f"bench-{len(prefix_ids)}-{args.seed}-{args.ratio}-{cap}".replace(
            ".", "_"
        )
        start = time.perf_counter()
        cache = store.get_id(kept)
        if cache is None or cache.model != adapter.fingerprint():
            cache = compact(
                adapter,
                messages,
                ratio=args.ratio,
                method="am-highest-attn-fast",
                max_head_ratio=cap,
            )
            store.put_id(kept, cache)
        caches[cap] = cache
        variants[str(cap)] = dict(
            max_head_ratio=cap,
            compaction_s=cache.timings.get("total_s", time.perf_counter() - start),
            physical_slots=cache.max_head_length,
            kept_slots=cache.physical_slots,
            padding_fraction=1
            - cache.physical_slots
            / (cache.max_head_length * cache.num_layers * cache.model.num_kv_heads),
        )
    return caches, variants


def measure(args) -> dict[str, Any]:
    from vllm_compaction.vllm import compacted_prompt
    from vllm_compaction.vllm.engine import shutdown_engine

    adapter, messages, prefix_ids, question_ids, store = _workload(args)
    block = 128
    max_len = len(prefix_ids) + len(question_ids) + args.decode_tokens + 64
    result: dict[str, Any] = dict(
        model="smollm2-135m",
        dtype=args.dtype,
        prefix_tokens=len(prefix_ids),
        ratio=args.ratio,
        sessions=args.sessions,
        decode_tokens=args.decode_tokens,
        trials=args.trials,
        variants={},
        created=time.time(),
    )
    caches, result["variants"] = _caches(args, adapter, messages, prefix_ids, store)

    llm = _engine(args.dtype, Path(args.store), max_len, args.kv_gib << 30)
    try:
        bytes_per_token = _kv_bytes_per_token(llm)
        result["kv_bytes_per_token_plugin_on"] = bytes_per_token
        full_ttft: list[float] = []
        full_sessions: dict[str, Any] | None = None
        for cap, cache in caches.items():
            variant = result["variants"][str(cap)]
            # 1. time to first token (full re-prefill measured once per trial, side by side)
            ttft: dict[str, list[float]] = {"compacted_cold": [], "compacted_warm": []}
            for trial in range(args.trials):
                entry = f"ttft-{trial}-{int(time.time() * 1000)}"
                store.put_id(entry, cache)
                cold = compacted_prompt(entry, question_ids, llm=llm, store=store)
                ttft["compacted_cold"].append(_timed(llm, [cold], 1)[0])
                ttft["compacted_warm"].append(_timed(llm, [cold], 1)[0])
                full = {
                    "prompt_token_ids": prefix_ids + question_ids,
                    "cache_salt": f"full-{entry}",
                }
                full_ttft.append(_timed(llm, [full], 1)[0])
                store.delete_id(entry)
            variant["ttft_s"] = {k: statistics.median(v) for k, v in ttft.items()}
            variant["ttft_s_all"] = ttft
            # 2. concurrent sessions
            kinds = ("compacted", "full") if full_sessions is None else ("compacted",)
            sessions: dict[str, Any] = {}
            for kind in kinds:
                prompts = []
                for i in range(args.sessions):
                    if kind == "compacted":
                        store.put_id(f"session-{i}", cache)
                        prompts.append(
                            compacted_prompt(
                                f"session-{i}", question_ids, llm=llm, store=store
                            )
                        )
                    else:
                        prompts.append(
                            {
                                "prompt_token_ids": prefix_ids + question_ids,
                                "cache_salt": f"session-full-{i}-{time.time()}",
                            }
                        )
                prompt_tokens = len(prompts[0]["prompt_token_ids"])
                prefill_s, _ = _timed(llm, prompts, 1)
                # the same prompts again hit the prefix cache, so this run is (almost) all decode
                total_s, outputs = _timed(llm, prompts, args.decode_tokens)
                generated = sum(len(o.outputs[0].token_ids) for o in outputs)
                blocks = math.ceil((prompt_tokens + args.decode_tokens) / block)
                sessions[kind] = dict(
                    prompt_tokens=prompt_tokens,
                    prefill_s=prefill_s,
                    decode_run_s=total_s,
                    decode_tokens_per_s=generated / total_s,
                    kv_blocks_per_session=blocks,
                    kv_bytes_per_session=blocks * block * bytes_per_token,
                )
                for i in range(args.sessions):
                    store.delete_id(f"session-{i}")
            if full_sessions is None:
                full_sessions = sessions.pop("full")
            variant["sessions"] = sessions["compacted"]
            variant["decode_speedup"] = (
                sessions["compacted"]["decode_tokens_per_s"]
                / full_sessions["decode_tokens_per_s"]
            )
            variant["kv_block_ratio"] = (
                sessions["compacted"]["kv_blocks_per_session"]
                / full_sessions["kv_blocks_per_session"]
            )
            logger.warning(
                "variant %s: %s",
                cap,
                json.dumps({k: v for k, v in variant.items() if k != "ttft_s_all"}),
            )
        result["full"] = dict(
            ttft_s=statistics.median(full_ttft),
            ttft_s_all=full_ttft,
            sessions=full_sessions,
        )
        for variant in result["variants"].values():
            variant["ttft_speedup_cold"] = (
                result["full"]["ttft_s"] / variant["ttft_s"]["compacted_cold"]
            )
            variant["ttft_speedup_warm"] = (
                result["full"]["ttft_s"] / variant["ttft_s"]["compacted_warm"]
            )
        checkpoint = Path(args.out or RESULTS / "serving.json")
        checkpoint.write_text(json.dumps(result, indent=1))  # before phase 3
    finally:
        shutdown_engine(llm)
    result["capacity"] = measure_capacity(args, prefix_ids, question_ids, store, caches)
    result.update(measure_overhead(args, adapter))
    return result


def _drain(engine, prompts: list, params, tag: str) -> dict[str, Any]:
    """Submit ``prompts`` at once and step the in-process engine to the end, watching its scheduler."""
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    for i, prompt in enumerate(prompts):
        engine.llm_engine.add_request(f"{tag}-{i}", prompt, params)
    peak_running = peak_blocks = generated = 0
    failed = 0
    start = time.perf_counter()
    while engine.llm_engine.has_unfinished_requests():
        for output in engine.llm_engine.step():
            if output.finished:
                generated += len(output.outputs[0].token_ids)
                failed += output.outputs[0].finish_reason not in ("stop", "length")
        running = len(scheduler.running)
        if running >= peak_running:
            peak_running = running
            peak_blocks = max(
                peak_blocks, pool.num_gpu_blocks - pool.get_num_free_blocks()
            )
    return dict(
        seconds=time.perf_counter() - start,
        generated=generated,
        failed=failed,
        peak_running=peak_running,
        blocks_in_use_at_peak=peak_blocks,
        total_blocks=pool.num_gpu_blocks,
    )


def measure_capacity(
    args, prefix_ids: list[int], question_ids: list[int], store, caches: dict
) -> dict[str, Any]:
    """3. sessions at a fixed KV memory: uncompacted vs padded vs varlen, one engine, side by side."""
    from vllm import SamplingParams

    from vllm_compaction.vllm import compacted_prompt
    from vllm_compaction.vllm.engine import shutdown_engine

    # in-process engine core, so the benchmark can read the scheduler's running queue and block pool
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    max_len = len(prefix_ids) + len(question_ids) + args.decode_tokens + 64
    # widened pages: the padded layout needs them, and one engine serves every kind side by side
    engine = _engine(
        args.dtype,
        Path(args.store),
        max_len,
        args.capacity_kv_mib << 20,
        max_num_seqs=args.capacity_sessions,
        pages="widened",
    )
    block_size = engine.llm_engine.vllm_config.cache_config.block_size
    result: dict[str, Any] = dict(
        kv_mib=args.capacity_kv_mib,
        sessions_submitted=args.capacity_sessions,
        decode_tokens=args.decode_tokens,
        block_size=block_size,
        kinds={},
    )
    try:
        kinds: list[tuple[str, Any, str | None]] = [("uncompacted", None, None)]
        for cap, cache in caches.items():
            kinds += [
                (f"padded cap {cap}", cache, "padded"),
                (f"varlen cap {cap}", cache, "varlen"),
            ]
        run = int(time.time())
        pool = engine.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        for name, cache, layout in kinds:
            tokens = (
                len(prefix_ids)
                if cache is None
                else cache.physical_tokens(layout, block_size)
            )
            blocks = math.ceil(
                (tokens + len(question_ids) + args.decode_tokens) / block_size
            )
            # a few more sessions than the free blocks can hold (the null block is not usable)
            count = min(args.capacity_sessions, (pool.num_gpu_blocks - 1) // blocks + 4)
            prompts = []
            for i in range(count):
                if cache is None:
                    prompts.append(
                        {
                            "prompt_token_ids": prefix_ids + question_ids,
                            "cache_salt": f"cap-{run}-{i}",
                        }
                    )
                else:  # each session its own store entry: distinct prefixes, nothing shared
                    entry = f"cap-{run}-{i}"
                    store.put_id(entry, cache)
                    prompts.append(
                        compacted_prompt(
                            entry, question_ids, llm=engine, store=store, layout=layout
                        )
                    )
            prompt_tokens = len(prompts[0]["prompt_token_ids"])
            logger.warning(
                "capacity: %s, %d prompt tokens per session", name, prompt_tokens
            )
            params = SamplingParams(
                max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True
            )
            everyone = _drain(engine, prompts, params, f"{name}-all")
            # decode rate with as many sessions as fit: prefill once, then time a run on the cached prefixes
            fit = prompts[: max(1, everyone["peak_running"])]
            _drain(
                engine,
                fit,
                SamplingParams(max_tokens=1, temperature=0.0),
                f"{name}-warm",
            )
            decode = _drain(engine, fit, params, f"{name}-decode")
            entry = dict(
                prompt_tokens=prompt_tokens,
                layout=layout or "uncompacted",
                sessions_submitted=count,
                blocks_per_session=blocks,
                max_concurrent_sessions=everyone["peak_running"],
                run_all=everyone,
                decode_sessions=len(fit),
                decode_tokens_per_s=decode["generated"] / decode["seconds"],
                decode_run=decode,
            )
            if cache is not None:
                layers, heads = cache.num_layers, cache.model.num_kv_heads
                entry.update(
                    prefix_tokens_exact=cache.physical_slots / (layers * heads),
                    prefix_tokens=tokens,
                    kept_slots=cache.physical_slots,
                )
                for i in range(count):
                    store.delete_id(f"cap-{run}-{i}")
            result["kinds"][name] = entry
            logger.warning(
                "capacity: %s: %s",
                name,
                json.dumps(
                    {
                        k: v
                        for k, v in entry.items()
                        if not k.endswith("run") and k != "run_all"
                    }
                ),
            )
    finally:
        shutdown_engine(engine)
    base = result["kinds"]["uncompacted"]
    for entry in result["kinds"].values():
        entry["sessions_vs_uncompacted"] = (
            entry["max_concurrent_sessions"] / base["max_concurrent_sessions"]
        )
        entry["decode_vs_uncompacted"] = (
            entry["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        )
    return result


def plot_capacity(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    capacity = result.get("capacity", result)
    names = list(capacity["kinds"])
    kinds = list(capacity["kinds"].values())
    colors = [
        "grey"
        if k["layout"] == "uncompacted"
        else "C1"
        if k["layout"] == "padded"
        else "C0"
        for k in kinds
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(names, [k["max_concurrent_sessions"] for k in kinds], color=colors)
    axes[0].set_title(f"concurrent sessions in {capacity['kv_mib']} MiB of KV")
    axes[1].bar(names, [k["blocks_per_session"] for k in kinds], color=colors)
    axes[1].set_title(f"KV blocks ({capacity['block_size']} tokens) per session")
    axes[2].bar(names, [k["decode_tokens_per_s"] for k in kinds], color=colors)
    axes[2].set_title("decode tok/s at that many sessions")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


OVERHEAD_ENGINES = ("stock", "widened", "off")
"""Plugin on with stock-width pages (the CPU default), plugin on with widened pages, plugin off."""


def measure_overhead(args, adapter) -> dict[str, Any]:
    """4. plugin on (stock-width and widened pages) vs off (a stock engine) on plain prompts, and
    the two plugin engines on compacted (varlen) sessions: one engine at a time (an idle engine
    beside a busy one takes CPU from it), alternating the three over ``--trials`` rounds."""
    from vllm_compaction.cache import LocalDiskStore
    from vllm_compaction.corpus import haystack_text
    from vllm_compaction.pipeline import compact
    from vllm_compaction.vllm import compacted_prompt
    from vllm_compaction.vllm.engine import shutdown_engine

    plain = [
        {
            "prompt_token_ids": adapter.chat_ids(
                [
                    {
                        "role": "user",
                        "content": haystack_text(
                            args.plain_tokens, adapter.tokenizer, seed=100 + i
                        ),
                    }
                ],
                add_generation_prompt=True,
            )
        }
        for i in range(args.sessions)
    ]
    # compacted sessions: one essay of the same length at --ratio, each session its own question
    # (the prefix blocks are shared through the prefix cache; every session attends them anyway)
    messages = [
        {
            "role": "user",
            "content": "Read this essay.\n\n"
            + haystack_text(args.plain_tokens, adapter.tokenizer, seed=100),
        }
    ]
    store = LocalDiskStore(Path(args.store))
    cache = compact(adapter, messages, ratio=args.ratio, method="am-highest-attn-fast")
    questions = [
        [
            {
                "role": "user",
                "content": f"Question {i + 1}: what is the essay above about?",
            }
        ]
        for i in range(args.sessions)
    ]
    small_len = args.plain_tokens + args.decode_tokens + 128
    # vLLM's CPU executor reserves one core more whenever a KV connector is configured (meant for
    # NIXL transfers): on a 2-core box the plugin engine would then compute on both cores and the
    # stock one on one. The same reservation for both makes the comparison about the plugin.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    result: dict[str, Any] = {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"],
        "compacted_prefix": {
            "logical_tokens": cache.logical_length,
            "ratio": args.ratio,
            "kept_slots": cache.physical_slots,
        },
    }
    rates: dict[str, list[float]] = {name: [] for name in OVERHEAD_ENGINES}
    compacted_rates: dict[str, list[float]] = {
        name: [] for name in OVERHEAD_ENGINES if name != "off"
    }
    for _ in range(args.trials):
        for name in OVERHEAD_ENGINES:
            engine = _engine(
                args.dtype,
                None if name == "off" else store.root,
                small_len,
                int(args.overhead_kv_gib * (1 << 30)),
                pages=None if name == "off" else name,
            )
            try:
                result[f"kv_bytes_per_token_{name}"] = _kv_bytes_per_token(engine)
                _timed(engine, plain, 1)  # prefill (then cached)
                _timed(engine, plain, 8)  # warm the decode path
                seconds, outputs = _timed(engine, plain, args.decode_tokens)
                rates[name].append(
                    sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
                )
                if name != "off":
                    compacted = [
                        compacted_prompt(cache, q, llm=engine, store=store)
                        for q in questions
                    ]
                    _timed(engine, compacted, 1)  # load and prefill
                    seconds, outputs = _timed(engine, compacted, args.decode_tokens)
                    compacted_rates[name].append(
                        sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
                    )
            finally:
                shutdown_engine(engine)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    result["plain_decode_tokens_per_s"] = medians
    result["plain_decode_tokens_per_s_all"] = rates
    result["plugin_decode_overhead"] = {
        name: 1 - medians[name] / medians["off"] for name in ("stock", "widened")
    }
    # per round: each round's engines ran back to back, so their ratio is less exposed to drift
    result["plugin_decode_overhead_per_round"] = {
        name: [1 - on / off for on, off in zip(rates[name], rates["off"])]
        for name in ("stock", "widened")
    }
    result["compacted_decode_tokens_per_s"] = {
        k: statistics.median(v) for k, v in compacted_rates.items()
    }
    result["compacted_decode_tokens_per_s_all"] = compacted_rates
    logger.warning(
        "plugin overhead on plain decode: %s (%s); compacted sessions: %s",
        result["plugin_decode_overhead"],
        rates,
        compacted_rates,
    )
    return result


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    names = ["full"] + [f"AM cap {k}" for k in result["variants"]]
    variants = list(result["variants"].values())
    full = result["full"]
    colors = ["grey"] + [f"C{i}" for i in range(len(variants))]
    axes[0].bar(
        names,
        [full["ttft_s"]] + [v["ttft_s"]["compacted_cold"] for v in variants],
        color=colors,
    )
    axes[0].set_ylabel("seconds")
    axes[0].set_title(f"TTFT, {result['prefix_tokens']}-token prefix (cold load)")
    axes[1].bar(
        names,
        [full["sessions"]["decode_tokens_per_s"]]
        + [v["sessions"]["decode_tokens_per_s"] for v in variants],
        color=colors,
    )
    axes[1].set_title(f"decode tok/s, {result['sessions']} sessions")
    axes[2].bar(
        names,
        [full["sessions"]["kv_blocks_per_session"]]
        + [v["sessions"]["kv_blocks_per_session"] for v in variants],
        color=colors,
    )
    axes[2].set_title("KV blocks (128 tokens) per session")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(
        f"SmolLM2-135M on vLLM CPU ({result['dtype']}), am-highest-attn-fast at {result['ratio']:.0%}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, default=4000)
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument(
        "--max-head-ratios",
        default="1.0,0.25",
        help="comma-separated per-head caps on the global budgets (1.0 = uncapped)",
    )
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--plain-tokens", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-gib", type=int, default=6)
    parser.add_argument(
        "--overhead-kv-gib",
        type=float,
        default=1.5,
        help="KV memory of each of the two engines of the plugin on/off comparison",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store", default="/tmp/vllm-compaction-bench-store")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, to check the script runs"
    )
    parser.add_argument(
        "--capacity-kv-mib",
        type=int,
        default=1024,
        help="KV memory of the sessions-at-fixed-memory phase",
    )
    parser.add_argument(
        "--capacity-sessions",
        type=int,
        default=64,
        help="most sessions submitted at once in that phase (each kind gets 4 more than "
        "its blocks per session say fit, up to this)",
    )
    parser.add_argument(
        "--only-capacity",
        action="store_true",
        help="measure only sessions at a fixed KV memory (writes serving_capacity.json)",
    )
    parser.add_argument(
        "--only-overhead",
        action="store_true",
        help="measure only the plugin on/off decode overhead (writes plugin_overhead.json)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="result file (default: serving.json, plugin_overhead.json or serving_capacity.json "
        "under benchmarks/results/, by mode)",
    )
    args = parser.parse_args()
    if args.quick:
        (
            args.prefix_tokens,
            args.sessions,
            args.decode_tokens,
            args.trials,
            args.plain_tokens,
        ) = 600, 2, 8, 1, 200
        args.kv_gib, args.overhead_kv_gib = 1, 0.5
        args.capacity_kv_mib, args.capacity_sessions = 160, 12
    args.max_head_ratios = [float(x) for x in args.max_head_ratios.split(",")]
    logging.basicConfig(level=logging.WARNING)
    if args.only_overhead:
        from vllm_compaction.models import load_adapter

        result = {
            "model": "smollm2-135m",
            "dtype": args.dtype,
            "sessions": args.sessions,
            "plain_tokens": args.plain_tokens,
            "decode_tokens": args.decode_tokens,
            "trials": args.trials,
            "created": time.time(),
            **measure_overhead(args, load_adapter("smollm2-135m")),
        }
        out = save_result(result, Path(args.out or RESULTS / "plugin_overhead.json"))
        logger.warning("wrote %s", out)
        return
    if args.only_capacity:
        adapter, messages, prefix_ids, question_ids, store = _workload(args)
        caches, variants = _caches(args, adapter, messages, prefix_ids, store)
        result = {
            "model": "smollm2-135m",
            "dtype": args.dtype,
            "prefix_tokens": len(prefix_ids),
            "ratio": args.ratio,
            "variants": variants,
            "created": time.time(),
            **measure_capacity(args, prefix_ids, question_ids, store, caches),
        }
        out = save_result(
            result, Path(args.out or RESULTS / "serving_capacity.json"), plot_capacity
        )
        logger.warning("wrote %s", out)
        return
    result = measure(args)
    out = save_result(result, Path(args.out or RESULTS / "serving.json"), plot)
    logger.warning("wrote %s", out)


if __name__ == "__main__":
    main()
