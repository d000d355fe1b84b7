"""Speed and held-out quality of ``compact_heads`` against the paper's per-head algorithm.

Run ``python -m benchmarks.compaction_speed [--kv FILE] [--quick]``. Writes
``benchmarks/results/compaction_speed.json`` (and ``.png`` when matplotlib is installed).
``--omp-global`` instead times plain OMP (``am-omp``) with the uneven budgets global
allocation gives (one head keeping most of its keys), its refits extending one Cholesky factor
against factoring anew at every refit (the code before the factor was kept), in one run.

Inputs: ``--kv FILE`` is a ``torch.save``d dict with ``keys``, ``values``, ``queries`` lists (one
``[H, T|n, d]`` tensor per layer) and optionally ``queries_s`` (seconds spent generating the
queries, recorded as the query-generation stage). Without a file, realistic inputs are
synthesised (see ``synthesize_layer``) and the JSON says so.

Baseline: ``baseline_compact`` re-implements the straightforward per-head algorithm of the
paper (a Python loop over heads; ``torch.linalg.lstsq`` for the beta and value fits, re-solved
from scratch at every OMP refit, as Algorithms "OMP Key Selection (Periodic Refit)" and
"NNLS via Projected Gradient Descent" describe). It lives here, never in the package.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import platform
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.output import pyplot, save_result
from vllm_compaction.am import CompactedHeads, attention_output_error, compact_heads
from vllm_compaction.am.selectors import omp as omp_selector
from vllm_compaction.recipes import RECIPES

logger = logging.getLogger("benchmarks.compaction_speed")

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("am-highest-attn", "am-omp-fast")
OMP_FAST = {"am-highest-attn": None, "am-omp-fast": (4, 2)}


# ----------------------------------------------------------------------------- inputs
def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split convention) of ``x [H, L, d]`` at ``positions [L]``."""
    d = x.shape[-1]
    inv_freq = 10000.0 ** (
        -torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d
    )
    ang = positions.float()[:, None] * inv_freq[None, :]  # [L, d/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def synthesize_layer(
    heads: int, length: int, num_queries: int, dim: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Keys/values/queries with the structure real attention has.

    Keys: a shared mean, topic segments (~40 tokens, topics recur, so neighbours and
    same-topic tokens are similar), token noise, three outlier tokens, RoPE at their positions,
    and a sink token 0. Queries (post-RoPE): each aims at one key (half of them recent, half
    anywhere) with a target logit ~ U(0.4, 1.2) x 9 and at the sink with ~ U(0.5, 1.2) x 11
    (per-head sharpness varies), plus noise. On average ~40% of the attention mass lands on the
    sink and the effective support (exp entropy) is ~100-200 keys of 2,000.
    Everything is drawn on the generator's device.
    """
    h, t, n, d = heads, length, num_queries, dim
    dev = gen.device
    randn = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    rand = lambda *s: torch.rand(*s, generator=gen, device=dev)  # noqa: E731
    scale = 1.0 / math.sqrt(d)
    topics = randn(h, 48, d)
    seg = torch.cumsum((rand(t) < 1 / 40).long(), 0) % 48  # [T] topic id
    raw = 0.6 * randn(h, 1, d) + 0.9 * topics[:, seg] + 0.55 * randn(h, t, d)
    raw[:, torch.randint(1, t, (3,), generator=gen, device=dev)] *= 2.0  # outliers
    keys = _rope(raw, torch.arange(t, device=dev))
    sink = randn(h, d)
    keys[:, 0] = (
        sink
        / sink.norm(dim=-1, keepdim=True)
        * keys[:, 1:].norm(dim=-1).mean(-1, keepdim=True)
        * 1.5
    )
    values = topics[:, seg] @ randn(h, d, d) / math.sqrt(d) + 0.3 * randn(h, t, d)
    values[:, 0] *= 0.1  # sinks carry little value
    recent = (t - 1 - (rand(n) ** 3 * t)).long().clamp(0, t - 1)
    anywhere = torch.randint(0, t, (n,), generator=gen, device=dev)
    target = torch.where(rand(n) < 0.5, recent, anywhere)  # [n]
    sharp = 0.8 + 0.4 * rand(h, 1, 1)  # per-head sharpness
    k_t, k_s = keys[:, target], keys[:, :1]  # [H, n, d], [H, 1, d]
    a = (
        sharp
        * 9.0
        * (0.4 + 0.8 * rand(h, n, 1))
        / (k_t.square().sum(-1, keepdim=True) * scale)
    )
    b = (
        sharp
        * 11.0
        * (0.5 + 0.7 * rand(h, n, 1))
        / (k_s.square().sum(-1, keepdim=True) * scale)
    )
    queries = a * k_t + b * k_s + 0.8 * randn(h, n, d)
    return {"keys": keys, "values": values, "queries": queries}


def load_inputs(path: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    """Per-layer lists of keys/values/queries, from ``path`` or synthesised."""
    if path is not None:
        blob = torch.load(path, map_location="cpu")
        layers = [
            {"keys": k, "values": v, "queries": q}
            for k, v, q in zip(blob["keys"], blob["values"], blob["queries"])
        ]
        return {
            "layers": layers[: args.layers],
            "source": str(path),
            "synthetic": False,
            "queries_s": blob.get("queries_s"),
        }
    gen = torch.Generator().manual_seed(args.seed)
    count = args.layers or 2
    layers = [
        synthesize_layer(args.heads, args.length, args.queries, args.dim, gen)
        for _ in range(count)
    ]
    return {
        "layers": layers,
        "source": "synthetic (benchmarks.compaction_speed.synthesize_layer)",
        "synthetic": True,
        "queries_s": None,
    }


# ----------------------------------------------------------------------------- baseline
def _lstsq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.lstsq`` with the QR driver the paper's CUDA runs use (``gels``); the CPU
    default (``gelsy``) truncates singular values below ``eps * max(n, t)`` and fits worse."""
    return torch.linalg.lstsq(
        a, b, driver="gels" if a.device.type == "cpu" else None
    ).solution


def _baseline_nnls(
    m: torch.Tensor, y: torch.Tensor, lower: float, upper: float, iters: int
) -> torch.Tensor:
    """Paper Algorithm "NNLS via Projected Gradient Descent" for one head."""
    w = _lstsq(m, y[:, None])[:, 0].clamp(lower, upper)
    if iters:
        v = torch.ones(m.shape[1], device=m.device)
        for _ in range(8):
            v = m.T @ (m @ v)
            v = v / v.norm()
        lip = (m @ v).norm() ** 2
        for _ in range(iters):
            w = (w - (m.T @ (m @ w - y)) / lip).clamp(lower, upper)
    return w


def _baseline_omp(
    phi: torch.Tensor, mass: torch.Tensor, t: int, k: int, tau: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paper Algorithm "OMP Key Selection (Periodic Refit)" for one head, lstsq at every refit,
    with the beta >= -7 drop rule and the e^7 cap."""
    lo, hi = math.exp(-7.0), math.exp(7.0)
    chosen: list[int] = []
    excluded = torch.zeros(phi.shape[1], dtype=torch.bool, device=phi.device)
    resid, w, step = mass.clone(), torch.empty(0, device=phi.device), 0
    while True:
        step += 1
        corr = (phi.T @ resid).masked_fill(excluded, float("-inf"))
        new = torch.topk(corr, min(k, t - len(chosen))).indices
        chosen += new.tolist()
        excluded[new] = True
        if step % tau and len(chosen) < t:
            continue
        w = _lstsq(phi[:, chosen], mass[:, None])[:, 0]
        keep = w >= lo
        if not keep.all():
            chosen = [j for j, ok in zip(chosen, keep.tolist()) if ok]
            w = _lstsq(phi[:, chosen], mass[:, None])[:, 0]
        w = w.clamp(lo, hi)
        resid = mass - phi[:, chosen] @ w
        if len(chosen) == t and keep.all():
            return torch.tensor(chosen, device=phi.device), w


def _now(device: torch.device) -> float:
    """Wall clock after the device's queued work is done (stage times on a GPU are otherwise
    only launch times)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def baseline_compact(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    t: int,
    method: str,
    clock: dict[str, float],
) -> CompactedHeads:
    """The per-head reference pipeline (Python loop over heads), timed by stage into ``clock``."""
    out_k, out_b, out_v, out_i = [], [], [], []
    scale = 1.0 / math.sqrt(keys.shape[-1])
    for h in range(keys.shape[0]):
        start = _now(keys.device)
        logits = scale * queries[h] @ keys[h].T  # [n, T]
        phi = torch.exp(logits - logits.amax(-1, keepdim=True))
        mass = phi.sum(-1)
        attn = phi / mass[:, None]
        target = attn @ values[h]
        clock["reference_s"] += (mark := _now(keys.device)) - start
        if method == "am-omp-fast":
            idx, w = _baseline_omp(phi, mass, t, *OMP_FAST[method])
            clock["select_s"] += (start := _now(keys.device)) - mark
        else:
            idx = torch.topk(attn.square().mean(0).sqrt(), t).indices
            clock["select_s"] += (start := _now(keys.device)) - mark
            w = _baseline_nnls(phi[:, idx], mass, math.exp(-3), math.exp(3), 2)
        beta = w.log()
        clock["beta_s"] += (mark := _now(keys.device)) - start
        x = torch.softmax(logits[:, idx] + beta, dim=-1)
        cv = _lstsq(x, target)
        clock["values_s"] += _now(keys.device) - mark
        order = idx.argsort()
        (
            out_k.append(keys[h, idx[order]]),
            out_b.append(beta[order]),
            out_v.append(cv[order]),
            out_i.append(idx[order]),
        )
    lengths = [t] * keys.shape[0]
    return CompactedHeads.from_padded(
        torch.stack(out_k),
        torch.stack(out_b),
        torch.stack(out_v),
        torch.stack(out_i),
        lengths,
    )


# ----------------------------------------------------------------------------- measurement
STAGE_KEYS = ("reference_s", "select_s", "beta_s", "values_s")


def _split(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * n)
    return perm[:cut], perm[cut:]


def _warm_up(layer: dict[str, torch.Tensor], method: str, baseline: bool) -> None:
    """One small untimed run of each implementation (thread pools, allocator, kernels)."""
    k, v, q = (layer[name][:, :256].float() for name in ("keys", "values", "queries"))
    compact_heads(k, v, q, 16, method=RECIPES[method].math)
    if baseline:
        baseline_compact(k, v, q, 16, method, dict.fromkeys(STAGE_KEYS, 0.0))


def measure(
    layers: list[dict[str, torch.Tensor]],
    ratio: float,
    method: str,
    baseline: bool,
    repeats: int,
    seed: int,
) -> dict[str, Any]:
    """Per-KV-head seconds (best of ``repeats``) and held-out errors of ours and the baseline."""
    runs: dict[str, dict[str, Any]] = {}
    _warm_up(layers[0], method, baseline)
    for who in ("ours", "baseline") if baseline else ("ours",):
        clock = dict.fromkeys(STAGE_KEYS, 0.0)
        errs_out, errs_mass, heads_total = [], [], 0
        for li, layer in enumerate(layers):
            k, v, q = (
                layer["keys"].float(),
                layer["values"].float(),
                layer["queries"].float(),
            )
            fit_idx, eval_idx = _split(q.shape[1], seed + li)
            t = max(1, round(ratio * k.shape[1]))
            best: dict[str, float] | None = None
            for _ in range(repeats):
                stages = dict.fromkeys(STAGE_KEYS, 0.0)
                if who == "ours":
                    heads = compact_heads(
                        k,
                        v,
                        q[:, fit_idx],
                        t,
                        method=RECIPES[method].math,
                        timings=stages,
                    )
                else:
                    heads = baseline_compact(k, v, q[:, fit_idx], t, method, stages)
                if best is None or sum(stages[s] for s in STAGE_KEYS) < sum(
                    best[s] for s in STAGE_KEYS
                ):
                    best = stages
            for s in STAGE_KEYS:
                clock[s] += best[s]
            err = attention_output_error(heads, k, v, q[:, eval_idx])
            errs_out += err.output_rel.tolist()
            errs_mass += err.mass_rel.tolist()
            heads_total += k.shape[0]
        total = sum(clock.values())
        runs[who] = {
            "per_head_s": total / heads_total,
            "stages_per_head_s": {s: clock[s] / heads_total for s in STAGE_KEYS},
            "key_selection_per_head_s": (clock["reference_s"] + clock["select_s"])
            / heads_total,
            "heldout_output_rel": sum(errs_out) / len(errs_out),
            "heldout_mass_rel": sum(errs_mass) / len(errs_mass),
            "heldout_output_rel_per_head": errs_out,
        }
        logger.info(
            "%s %s ratio=%.3f: %.4f s/head, held-out output err %.4f",
            method,
            who,
            ratio,
            runs[who]["per_head_s"],
            runs[who]["heldout_output_rel"],
        )
    if baseline:
        runs["speedup"] = runs["baseline"]["per_head_s"] / runs["ours"]["per_head_s"]
    return runs


def scaling(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Ours (and the baseline where affordable) versus T at ratio 0.1 and versus the ratio."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    out: dict[str, list[dict[str, Any]]] = {"T": [], "ratio": []}
    points = [("T", t, 0.1) for t in args.scale_lengths] + [
        ("ratio", args.length, r) for r in args.scale_ratios
    ]
    for axis, length, ratio in points:
        layer = synthesize_layer(
            args.heads, length, int(args.queries * length / args.length), args.dim, gen
        )
        for method in METHODS:
            with_base = args.scale_baseline and (
                method != "am-omp-fast" or ratio * length <= args.omp_baseline_max_t
            )
            row = measure([layer], ratio, method, with_base, 1, args.seed)
            out[axis].append({"T": length, "ratio": ratio, "method": method, **row})
    return out


#: Shares of T kept by the three heads of one layer in ``--omp-global``: global budgets at 10%
#: give the retrieval layers of SmolLM2 1,000-1,900 of their 3 x 1,500 keys, one head most.
OMP_GLOBAL_SHARES = (0.7, 0.2, 0.05)


def omp_global(layers: list[dict[str, torch.Tensor]], repeats: int) -> dict[str, Any]:
    """Plain OMP at ``OMP_GLOBAL_SHARES`` of T per head: seconds with the kept factor and with
    a fresh factorisation at every refit (its extension refused), and how far the two agree."""
    layer = layers[0]
    k, v, q = (layer[name].float() for name in ("keys", "values", "queries"))
    budgets = [max(1, round(share * k.shape[1])) for share in OMP_GLOBAL_SHARES]
    _warm_up(layer, "am-omp", False)
    runs: dict[str, Any] = {}
    kept: dict[str, CompactedHeads] = {}
    for who in ("kept_factor", "refactor_each_refit"):
        # refused extensions: every refit factors the whole system anew, as before
        refactor = mock.patch.object(
            omp_selector._GreedyMassFit, "_extend_factor", lambda self, used: False
        )
        with refactor if who == "refactor_each_refit" else contextlib.nullcontext():
            best = math.inf
            for _ in range(repeats):
                stages = dict.fromkeys(STAGE_KEYS, 0.0)
                kept[who] = compact_heads(
                    k, v, q, budgets, method=RECIPES["am-omp"].math, timings=stages
                )
                best = min(best, sum(stages[s] for s in STAGE_KEYS))
        runs[who] = {"s": best}
        logger.info("am-omp budgets %s, %s: %.2f s", budgets, who, best)
    a, b = kept["kept_factor"], kept["refactor_each_refit"]
    return {
        "T": k.shape[1],
        "n_per_head": q.shape[1],
        "budgets": budgets,
        **runs,
        "speedup": runs["refactor_each_refit"]["s"] / runs["kept_factor"]["s"],
        "same_keys": bool(torch.equal(a.indices, b.indices)),
        "beta_max_abs_diff": float((a.beta - b.beta).abs().max()),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """Per-head time versus T and versus ratio (log scale), ours against the baseline."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, axis in zip(axes, ("T", "ratio")):
        for method in METHODS:
            rows = [r for r in result["scaling"][axis] if r["method"] == method]
            for who, style in (("ours", "-o"), ("baseline", "--x")):
                pts = [(r[axis], r[who]["per_head_s"]) for r in rows if who in r]
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{method} ({who})")
        ax.set_xlabel(
            "T (ratio 0.1)" if axis == "T" else f"ratio t/T (T={result['inputs']['T']})"
        )
        ax.set_ylabel("seconds per KV head")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"compact_heads vs per-head baseline (torch threads={result['machine']['threads']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--kv",
        type=Path,
        default=None,
        help="torch.save'd dict of per-layer keys/values/queries",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small shapes, one layer, few scaling points",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers to use (default: all of --kv, 2 synthesised)",
    )
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--length", type=int, default=2000, help="T of synthesised inputs")
    p.add_argument(
        "--queries",
        type=int,
        default=12500,
        help="n per KV head (80%% fit, 20%% held out)",
    )
    p.add_argument("--dim", type=int, default=64)
    p.add_argument(
        "--ratio", type=float, default=0.1, help="t / T of the main comparison"
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="best-of repeats per measurement"
    )
    p.add_argument(
        "--queries-s",
        type=float,
        default=None,
        help="seconds spent generating the queries",
    )
    p.add_argument("--no-scaling", dest="scaling", action="store_false")
    p.add_argument(
        "--omp-global",
        action="store_true",
        help="time plain OMP at uneven (global) budgets, kept factor vs refactoring",
    )
    p.add_argument("--no-scale-baseline", dest="scale_baseline", action="store_false")
    p.add_argument(
        "--omp-baseline-max-t",
        type=int,
        default=200,
        help="skip slower OMP baselines in scaling",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result JSON (default: results/compaction_speed.json, or "
        "results/omp_global_budgets.json with --omp-global)",
    )
    args = p.parse_args(argv)
    if args.out is None:
        name = "omp_global_budgets.json" if args.omp_global else "compaction_speed.json"
        args.out = RESULTS / name
    args.scale_lengths, args.scale_ratios = (
        (500, 1000, 2000, 4000),
        (0.02, 0.05, 0.1, 0.2),
    )
    if args.quick:
        args.layers, args.length, args.queries = 1, 1000, 5000
        args.scale_lengths, args.scale_ratios = (250, 500, 1000), (0.05, 0.2)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    inputs = load_inputs(args.kv, args)
    layers = inputs.pop("layers")
    h, t_len, d = layers[0]["keys"].shape
    queries_s = (
        args.queries_s if args.queries_s is not None else inputs.pop("queries_s")
    )
    inputs.pop("queries_s", None)
    machine = {"threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
               "torch": torch.__version__, "load_avg": os.getloadavg()}  # fmt: skip
    if args.omp_global:
        row = {"inputs": inputs, "machine": machine, "omp_global": omp_global(layers, args.repeats)}  # fmt: skip
        save_result(row, args.out)
        logger.info("wrote %s: %s", args.out, row["omp_global"])
        return row
    result: dict[str, Any] = {
        "inputs": {**inputs, "layers": len(layers), "H": h, "T": t_len, "d": d,
                   "n_per_head": layers[0]["queries"].shape[1], "fit_fraction": 0.8, "ratio": args.ratio},
        "machine": machine,
        # query-generation stage: filled when the caller passes it (--queries-s or the --kv file)
        "queries_s": queries_s,
        "main": {m: measure(layers, args.ratio, m, True, args.repeats, args.seed) for m in METHODS},
    }  # fmt: skip
    if args.scaling:
        result["scaling"] = scaling(args)
    save_result(result, args.out, plot if args.scaling else None)
    lines = [
        f"{'method':<18}{'impl':<10}{'s/head':>9}{'select':>9}{'beta':>9}{'values':>9}{'out err':>9}{'mass err':>9}"
    ]
    for m, runs in result["main"].items():
        for who in ("ours", "baseline"):
            r = runs[who]
            st = r["stages_per_head_s"]
            lines.append(
                f"{m:<18}{who:<10}{r['per_head_s']:>9.4f}{r['key_selection_per_head_s']:>9.4f}{st['beta_s']:>9.4f}"
                f"{st['values_s']:>9.4f}{r['heldout_output_rel']:>9.4f}{r['heldout_mass_rel']:>9.4f}"
            )
        lines.append(f"{m:<18}{'speedup':<10}{runs['speedup']:>8.1f}x")
    print("\n".join(lines))  # noqa: T201 - the final summary table
    logger.info("wrote %s", args.out)
    return result


if __name__ == "__main__":
    main()
