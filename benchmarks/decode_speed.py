"""One decode step of the compacted-prefix kernel against torch SDPA (flash), on a CUDA GPU.

The ``decode`` section of ``benchmarks.gpu_check``. For each shape (requests x tokens, query/KV
heads, head dim; bf16, block size 16):

* ``sdpa``: SDPA's flash kernel over dense K/V, the bandwidth bar;
* ``paged``: our kernel over the same tokens in shuffled pages, no prefix (a plain request);
* ``prefix_full``: the same rows as a packed compacted prefix (every head ``t_h = T``);
* ``prefix_10pct``: a prefix compacted to 10% with uneven per-head lengths (shares drawn as
  squared uniforms, as global budgets give), compared with SDPA over the whole uncompacted
  prefix, for the library's default launch and for a sweep of tiles, pipeline depths and splits;
  then the same with the merge fused into the last split (``prefix_10pct_fused_*``: one launch
  instead of two), with its largest difference from the separate merge.

Two numbers per call, because vLLM pays both: ``*_ms`` is the GPU's time (CUDA graphs of the
call after an L2 flush, less graphs of the flush alone, so that a 10% prefix smaller than L2 is
not read from it), ``*_host_us`` the host's time to launch one call (eager calls, no sync).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("benchmarks.decode_speed")

#: (requests, tokens, query heads, KV heads, head dim)
DECODE_SHAPES = [
    (64, 4096, 32, 8, 128),
    (16, 16384, 32, 8, 128),
    (1, 32768, 32, 8, 128),
    (64, 4096, 8, 1, 256),
]
SMOKE_SHAPES = [(2, 256, 4, 2, 64), (1, 512, 4, 1, 64)]
#: (block_n, num_warps, num_stages) tried for the plain paged path
PAGED_CONFIGS = [(64, 4, 2), (32, 4, 3), (128, 4, 2)]
#: tiles and pipeline depths tried for the 10% prefix, each at 1/2, 1 and 2 times the default splits
PREFIX_CONFIGS = [(32, 4, 2), (64, 4, 2), (128, 4, 2)]
FLUSH_BYTES = 256 << 20


def gpu_ms(
    fn: Callable[[], Any], device: torch.device, iters: int = 8, reps: int = 15
) -> float:
    """GPU milliseconds per call of ``fn`` with a cold L2 (module doc); on a CPU (``--smoke``),
    the wall time of one eager call."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize(device)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)

    def flushes() -> None:
        for _ in range(iters):
            flush.zero_()

    def flushed_calls() -> None:
        for _ in range(iters):
            flush.zero_()
            fn()

    def replay_ms(body: Callable[[], None]) -> float:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            body()  # allocations settle outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        times = []
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return max(0.0, (replay_ms(flushed_calls) - replay_ms(flushes)) / iters)


def host_us(fn: Callable[[], Any], device: torch.device, calls: int = 50) -> float:
    """Host microseconds to launch one call (the GPU is not waited for)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed / calls * 1e6


def _flash() -> contextlib.AbstractContextManager:
    """SDPA restricted to its flash kernel, where this torch has the switch."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _pages(
    num_blocks: int,
    heads: int,
    width: int,
    block: int,
    device: torch.device,
    dtype: torch.dtype,
    layers: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer key and value views ``[B, H, block, width]`` of vLLM's Triton layout (logical
    ``[B, H, N, 2 * width]``, physically ``[B, N, H, 2 * width]``), random finite contents."""
    out = []
    for _ in range(layers):
        raw = (
            torch.randn(num_blocks, block, heads, 2 * width, device=device, dtype=dtype)
            * 0.5
        )
        logical = raw.permute(0, 2, 1, 3)
        out.append((logical[..., :width], logical[..., width:]))
    return out


def _uneven_lengths(
    reqs: int, layers: int, num_kv: int, tokens: int, share: float
) -> list:
    """Per request ``[layers, H]`` head lengths summing to ``share`` of the prefix per layer."""
    lengths = []
    for r in range(reqs):
        weights = (
            torch.rand(layers, num_kv, generator=torch.Generator().manual_seed(r)) ** 2
        )
        per = weights / weights.sum(1, keepdim=True) * share * tokens * num_kv
        lengths.append(per.round().long().clamp_min(1))
    return lengths


def _timed(label: str, fn: Callable[[], Any], device: torch.device, row: dict) -> float:
    row[f"{label}_ms"] = ms = gpu_ms(fn, device)
    row[f"{label}_host_us"] = host_us(fn, device)
    return ms


def _fused_merge(
    prefixed: Callable[..., torch.Tensor],
    best: str,
    auto: int,
    sdpa_ms: float,
    smoke: bool,
    device: torch.device,
) -> dict:
    """The 10% prefix with the merge fused into the last split (one launch, not two): its
    largest difference from the separate merge's output (at two splits or more), its time at
    the default launch, and at the best tile of the sweep for 1/2, 1, 2 and 4 times the
    default splits."""
    row: dict[str, Any] = {}
    split = max(2, auto)  # at least two splits, or there is nothing to merge
    separate = prefixed(num_splits=split).float().clone()
    row["prefix_10pct_fused_max_abs_diff"] = float(
        (prefixed(num_splits=split, fused_merge=True).float() - separate).abs().max()
    )
    ms = _timed("prefix_10pct_fused", lambda: prefixed(fused_merge=True), device, row)
    row["prefix_10pct_fused_speedup_vs_sdpa_full"] = sdpa_ms / ms
    bn, warps, stages, _ = (int(x) for x in best.split("/"))
    sweep = {}
    for splits in sorted(
        {max(2, auto // 2), split, min(64, 2 * auto), min(64, 4 * auto)}
    )[: 1 if smoke else None]:
        launch = dict(block_n=bn, num_warps=warps, num_stages=stages, num_splits=splits)
        sweep[f"{bn}/{warps}/{stages}/{splits}"] = gpu_ms(
            lambda launch=launch: prefixed(fused_merge=True, **launch), device
        )
    fastest = min(sweep, key=sweep.get)
    row["prefix_10pct_fused_sweep_ms"], row["prefix_10pct_fused_best"] = sweep, fastest
    row["prefix_10pct_fused_best_speedup_vs_sdpa_full"] = sdpa_ms / sweep[fastest]
    return row


def _shape_row(shape: tuple, smoke: bool, device: torch.device) -> dict:
    import torch.nn.functional as F

    from vllm_compaction.cache import PagedPacking
    from vllm_compaction.vllm.paged_prefix import PagedPrefixPages
    from vllm_compaction_kernels.compacted_attention import (
        choose_splits,
        compacted_attention,
    )

    reqs, tokens, num_q, num_kv, dim = shape
    dtype, block = torch.bfloat16, 16
    gen = torch.Generator(device=device).manual_seed(tokens)
    row: dict[str, Any] = dict(
        zip(("requests", "tokens", "q_heads", "kv_heads", "d"), shape)
    )
    kv_bytes = 2 * reqs * tokens * num_kv * dim * 2
    query = torch.randn(reqs, num_q, dim, device=device, dtype=dtype, generator=gen)
    out = torch.empty_like(query)
    starts = torch.arange(reqs + 1, dtype=torch.int32, device=device)

    # SDPA (flash) on dense K/V: the bandwidth bar
    k = torch.randn(
        reqs, num_kv, tokens, dim, device=device, dtype=dtype, generator=gen
    )
    v = torch.randn_like(k)
    q4 = query[:, :, None, :]

    def sdpa() -> torch.Tensor:
        with _flash():
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    sdpa_ms = _timed("sdpa", sdpa, device, row)
    row["sdpa_GBps"] = kv_bytes / sdpa_ms / 1e6

    # ours over the same tokens in shuffled pages (no prefix)
    blocks_per_req = -(-tokens // block)
    pages = _pages(reqs * blocks_per_req + 1, num_kv, dim, block, device, dtype, 1)[0]
    table = (
        torch.randperm(reqs * blocks_per_req, device=device, generator=gen)
        .view(reqs, -1)
        .to(torch.int32)
    )
    seq_lens = torch.full((reqs,), tokens, dtype=torch.int32, device=device)

    def paged(**launch: Any) -> torch.Tensor:
        return compacted_attention(
            query, pages[0], pages[1], table, seq_lens, starts, scale=dim**-0.5,
            head_dim=dim, max_query_len=1, max_keys=tokens, out=out, **launch,
        )  # fmt: skip

    row["paged_default_ms"] = gpu_ms(paged, device)
    sweep = {}
    for bn, warps, stages in PAGED_CONFIGS[: 1 if smoke else None]:
        launch = dict(block_n=bn, num_warps=warps, num_stages=stages)
        sweep[f"{bn}/{warps}/{stages}"] = gpu_ms(
            lambda launch=launch: paged(**launch), device
        )
    best = min(sweep, key=sweep.get)
    row["paged_sweep_ms"], row["paged_best"] = sweep, best
    row["paged_ms"] = min(row["paged_default_ms"], sweep[best])
    row["paged_host_us"] = host_us(paged, device)
    row["paged_GBps"] = kv_bytes / row["paged_ms"] / 1e6
    row["paged_vs_sdpa"] = sdpa_ms / row["paged_ms"]

    for label, share in (("prefix_full", 1.0), ("prefix_10pct", 0.1)):
        layers = 2
        if share == 1.0:
            lengths = [torch.full((layers, num_kv), tokens, dtype=torch.long)] * reqs
        else:
            lengths = _uneven_lengths(reqs, layers, num_kv, tokens, share)
        packings = [PagedPacking(t, dim, block) for t in lengths]
        total_blocks = sum(p.num_blocks for p in packings)
        layer_pages = _pages(
            total_blocks + 1, num_kv, dim, block, device, dtype, layers
        )
        tables = PagedPrefixPages(
            [k for k, _ in layer_pages], [v for _, v in layer_pages], dim
        )
        ids, first = [], 0
        for p in packings:
            ids.append(torch.arange(first, first + p.num_blocks))
            first += p.num_blocks
        prefix = tables.kernel_tables(packings, ids)
        max_keys = 1 + max(int(p.head_lengths[1].max()) for p in packings)
        suffix_table = torch.full(
            (reqs, 1), total_blocks, dtype=torch.int32, device=device
        )
        one = torch.ones(reqs, dtype=torch.int32, device=device)

        def prefixed(
            lp=layer_pages, st=suffix_table, t=prefix, mk=max_keys, **launch: Any
        ):
            return compacted_attention(
                query, lp[1][0], lp[1][1], st, one, starts, scale=dim**-0.5, head_dim=dim,
                max_query_len=1, max_keys=mk, prefix=t, layer=1, out=out, **launch,
            )  # fmt: skip

        rows_read = sum(int(p.head_lengths[1].sum()) for p in packings) + reqs * num_kv
        ms = _timed(label, prefixed, device, row)
        row[f"{label}_GBps"] = 2 * rows_read * dim * 2 / ms / 1e6
        if share == 1.0:
            bn, warps, stages = (int(x) for x in row["paged_best"].split("/"))
            row["prefix_full_paged_best_ms"] = gpu_ms(
                lambda: prefixed(block_n=bn, num_warps=warps, num_stages=stages), device
            )
            continue
        auto = choose_splits(
            reqs * num_kv, max_keys, prefix.total_rows[1] + reqs * num_kv, device
        )
        row["prefix_10pct_auto_splits"] = auto
        sweep = {}
        for bn, warps, stages in PREFIX_CONFIGS[: 1 if smoke else None]:
            for splits in sorted({max(1, auto // 2), auto, min(64, 2 * auto)}):
                launch = dict(
                    block_n=bn, num_warps=warps, num_stages=stages, num_splits=splits
                )
                try:
                    sweep[f"{bn}/{warps}/{stages}/{splits}"] = gpu_ms(
                        lambda launch=launch: prefixed(**launch), device
                    )
                except Exception as exc:  # noqa: BLE001 - a launch that fails is a result too
                    sweep[f"{bn}/{warps}/{stages}/{splits}"] = f"{exc}"[:200]
        timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
        best = min(timed, key=timed.get)
        row["prefix_10pct_sweep_ms"], row["prefix_10pct_best"] = sweep, best
        row["prefix_10pct_best_ms"] = timed[best]
        row["prefix_10pct_speedup_vs_sdpa_full"] = sdpa_ms / ms
        row["prefix_10pct_best_speedup_vs_sdpa_full"] = sdpa_ms / timed[best]
        row.update(_fused_merge(prefixed, best, auto, sdpa_ms, smoke, device))
        del layer_pages, tables, prefix
    return row


def run_shapes(
    name: str,
    shape_row: Callable[[tuple, bool, torch.device], dict],
    smoke: bool,
    device: torch.device,
    deadline: float | None = None,
    catch: bool = False,
) -> list[dict]:
    """``shape_row`` at every shape (the smoke shapes with ``smoke``), each logged; the GPU is
    flushed of each shape's tensors before the next. With a ``deadline`` (a ``time.time()``),
    shapes after it are skipped; with ``catch``, a shape that fails records its error."""
    rows = []
    for shape in SMOKE_SHAPES if smoke else DECODE_SHAPES:
        if deadline is not None and time.time() > deadline:
            rows.append({"shape": list(shape), "skipped": "past the deadline"})
            continue
        if not catch:
            row = shape_row(shape, smoke, device)
        else:
            try:
                row = shape_row(shape, smoke, device)
            except Exception as exc:  # noqa: BLE001 - a shape that fails is a result too
                logger.exception("%s %s failed", name, shape)
                row = {
                    "shape": list(shape),
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                }
        logger.info(
            "%s %s",
            name,
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
        )
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def decode_section(smoke: bool, device: torch.device) -> dict:
    """Every shape's row (module doc)."""
    return {
        "dtype": "bfloat16",
        "block_size": 16,
        "timing": "GPU ms from CUDA graphs after an L2 flush; host us per eager launch",
        "shapes": run_shapes("decode", _shape_row, smoke, device),
    }
