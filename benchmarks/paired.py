"""A method against a saved quality run, on the instances that decide its retention.

    python -m benchmarks.paired --against benchmarks/results/conversations_names_10pct_48.json \
        --method 'am:protect=identifiers-names,priority_exact_depth=0.56-0.84' --ratio 0.1 \
        --max-new-tokens 32 --resume --out benchmarks/results/paired_band_10pct.json

Retention (the share of the full context's right answers a compacted prefix keeps) moves only
on the instances the full context answers right. This runs a new method on exactly those
instances of a saved ``benchmarks.quality`` run, through the same code (``quality.run``, one
instance at a time): the saved method's losses first, then its wins in a seeded shuffle. So a
run cut short (``--limit``, or stopped and ``--resume``d) has measured every loss and an
unbiased sample of the wins. Each instance's prompt hash and full-context score must match the
saved ones, else the runs do not compare (the instance is refused, with a sentence). With
``--saved-ratio`` the pairs are the saved run's instances at that ratio and the method runs at
``--ratio``: the saved method itself at twice the budget says which of its losses are the
budget's.

Per task the result gives the losses given back, the sampled wins lost, and the new method's
retention: exact once every win ran, else its bounds (every unsampled win lost / kept) and the
estimate from the sample. Once every instance ran, each task and the totals carry the exact
p-value of McNemar's test on the answers given back and lost (``sign_test_p``): on these
instances a change of a few answers either way is what noise gives, and the p-value says how
far a difference is from that. Writes JSON and a PNG (retention per task, saved vs new).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.output import pyplot, save_figure, save_result
from benchmarks.quality import RESULTS, SweepError, load_result
from benchmarks.quality import parser as quality_parser
from benchmarks.quality import run as quality_run

logger = logging.getLogger("benchmarks.paired")


def _saved_instances(
    saved: dict, method: str | None, ratio: float
) -> tuple[str, dict[tuple[str, int], dict]]:
    """The saved method (the only one at ``ratio`` unless named) and, per ``(task, seed)`` the
    full context answers right, its prompt hash and the method's row."""
    rows = [r for r in saved["rows"] if abs(r["ratio"] - ratio) < 1e-9]
    methods = sorted({r["method"] for r in rows})
    if method is None:
        if len(methods) != 1:
            raise SweepError(
                f"the saved run has {len(methods)} methods at {ratio:g} ({methods}): "
                "name one with --saved-method"
            )
        method = methods[0]
    elif method not in methods:
        raise SweepError(
            f"the saved run has no {method!r} at {ratio:g}; it has {methods}"
        )
    full = {
        (b["task"], b["seed"]): b
        for b in saved["baselines"]
        if b["method"] == "full-context"
    }
    picked = {}
    for row in rows:
        key = (row["task"], row["seed"])
        if row["method"] == method and full[key]["score"] == 1:
            picked[key] = {"prompt": row["prompt"], "saved": row}
    return method, picked


def instance_order(
    picked: dict[tuple[str, int], dict], tasks: list[str], order_seed: int
) -> list[tuple[str, int]]:
    """The saved method's losses (in the saved run's task order, then by seed), then its wins
    shuffled by ``order_seed``: a prefix of this list is every loss and a uniform sample of
    the wins."""
    keys = sorted(picked, key=lambda k: (tasks.index(k[0]), k[1]))
    losses = [k for k in keys if picked[k]["saved"]["score"] < 1]
    wins = [k for k in keys if picked[k]["saved"]["score"] >= 1]
    random.Random(order_seed).shuffle(wins)
    return losses + wins


def sign_test(given_back: int, lost: int) -> float:
    """Exact two-sided p-value of McNemar's test on the discordant pairs: how likely a method
    no better or worse than the saved one gives back and loses answers at least this unevenly
    (each discordant answer a fair coin). 7 back and 4 lost is p = 0.55; 10 and 2, p = 0.04."""
    n, k = given_back + lost, min(given_back, lost)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def totals(summary: dict[str, dict]) -> dict:
    """Over every task: right with the full context, kept by the saved and (once every instance
    ran) by the new method, answers given back and lost, and the sign test's p-value."""
    back = sum(len(e["given_back"]) for e in summary.values())
    lost = sum(len(e["wins_lost"]) for e in summary.values())
    n = sum(e["full_context_right"] for e in summary.values())
    saved = round(
        sum(e["saved_retention"] * e["full_context_right"] for e in summary.values())
    )
    out = {
        "full_context_right": n,
        "saved_kept": saved,
        "given_back": back,
        "wins_lost": lost,
    }
    if all(e["exact"] for e in summary.values()):
        # a sampled run's discordant pairs undercount the wins lost: no p-value from them
        out |= {"new_kept": saved + back - lost, "sign_test_p": sign_test(back, lost)}
    return out


def summarize(
    picked: dict[tuple[str, int], dict], pairs: list[dict]
) -> dict[str, dict]:
    """Per task: the saved retention, what the new method gave back and lost, and its retention
    (``exact`` once every instance ran; else bounds and the sample's estimate)."""
    ran = {(p["task"], p["seed"]): p["new"]["score"] >= 1 for p in pairs}
    summary = {}
    for task in sorted({k[0] for k in picked}):
        keys = [k for k in picked if k[0] == task]
        losses = [k for k in keys if picked[k]["saved"]["score"] < 1]
        wins = [k for k in keys if k not in losses]
        run_losses = [k for k in losses if k in ran]
        run_wins = [k for k in wins if k in ran]
        given_back = sorted(k[1] for k in run_losses if ran[k])
        lost = sorted(k[1] for k in run_wins if not ran[k])
        n = len(keys)
        unrun = len(wins) - len(run_wins) + len(losses) - len(run_losses)
        # integer numerators, so that the estimate with every sampled win kept is the upper
        # bound to the last bit
        kept = len(run_wins) - len(lost) + len(given_back)
        low, high = kept / n, (kept + unrun) / n
        entry = {
            "full_context_right": n,
            "saved_retention": len(wins) / n,
            "losses_run": f"{len(run_losses)}/{len(losses)}",
            "given_back": given_back,
            "wins_run": f"{len(run_wins)}/{len(wins)}",
            "wins_lost": lost,
            "retention_bounds": [low, high],
            "exact": unrun == 0,
        }
        if unrun == 0:
            entry["sign_test_p"] = sign_test(len(given_back), len(lost))
        if run_wins and len(run_losses) == len(losses):
            kept_share = 1 - len(lost) / len(run_wins)
            entry["retention_estimate"] = (len(wins) * kept_share + len(given_back)) / n
        summary[task] = entry
    return summary


#: what the runs ``--combine`` joins must share
SAME_RUN = (
    "against",
    "saved_method",
    "method",
    "ratio",
    "saved_ratio",
    "max_new_tokens",
)


def combine(paths: list[str]) -> dict:
    """The union of paired results of one method against one saved run (split by ``--tasks``
    or ``--seeds`` to run in parallel, or resumed in parts): one summary, with the totals and
    their sign test once every instance ran. An instance in two runs must have the same answer
    in both (the runs are deterministic); runs that do not compare are refused."""
    runs = [load_result(path) for path in paths]
    for path, run in zip(paths, runs, strict=True):
        if (
            not isinstance(run, dict)
            or not {"against", "method", "pairs"} <= run.keys()
        ):
            raise SweepError(f"{path} is not a benchmarks.paired result")
    first = runs[0]
    for path, run in zip(paths[1:], runs[1:], strict=True):
        differ = [k for k in SAME_RUN if run.get(k) != first.get(k)]
        if differ:
            raise SweepError(
                f"{path} does not combine with {paths[0]}: their {', '.join(differ)} differ"
            )
    saved = load_result(first["against"])
    saved_ratio = first.get("saved_ratio", first["ratio"])
    _, picked = _saved_instances(saved, first["saved_method"], saved_ratio)
    # a run made before --tasks existed paired every task
    tasks = [
        t
        for t in saved["tasks"]
        if any(t in run.get("tasks", saved["tasks"]) for run in runs)
    ]
    picked = {k: v for k, v in picked.items() if k[0] in tasks}
    pairs: dict[tuple[str, int], dict] = {}
    for path, run in zip(paths, runs, strict=True):
        for pair in run["pairs"]:
            key = (pair["task"], pair["seed"])
            if key in pairs and pairs[key]["new"]["answer"] != pair["new"]["answer"]:
                raise SweepError(
                    f"{pair['task']} seed {pair['seed']} ran twice with different answers "
                    f"(one of them in {path}): the runs do not compare"
                )
            pairs.setdefault(key, pair)
    summary = summarize(picked, list(pairs.values()))
    return {
        **{k: first.get(k) for k in SAME_RUN},
        "saved_ratio": saved_ratio,
        "combined": list(paths),
        "tasks": tasks,
        "tokens": first["tokens"],
        "model": first["model"],
        "summary": summary,
        "totals": totals(summary),
        "pairs": list(pairs.values()),
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    tasks = list(result["summary"])
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(tasks), 3.6))
    xs = range(len(tasks))
    saved = [result["summary"][t]["saved_retention"] for t in tasks]
    low = [result["summary"][t]["retention_bounds"][0] for t in tasks]
    high = [result["summary"][t]["retention_bounds"][1] for t in tasks]
    middle = [
        result["summary"][t].get("retention_estimate", (lo + hi) / 2)
        for t, lo, hi in zip(tasks, low, high, strict=True)
    ]
    ax.bar(
        [x - 0.2 for x in xs], saved, 0.4, label="saved: " + result["saved_method"][:40]
    )
    ax.bar(
        [x + 0.2 for x in xs],
        middle,
        0.4,
        yerr=[
            [m - lo for m, lo in zip(middle, low, strict=True)],
            [hi - m for m, hi in zip(middle, high, strict=True)],
        ],
        capsize=3,
        label="new: " + result["method"][:40],
    )
    ax.set_xticks(list(xs), tasks)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("share of the full context's right answers kept")
    saved_ratio = result.get("saved_ratio", result["ratio"])
    at = f"{result['ratio']:g}" + (
        "" if saved_ratio == result["ratio"] else f" (saved at {saved_ratio:g})"
    )
    ax.set_title(f"paired, at {at} (bars: bounds where wins were sampled)")
    ax.legend(fontsize=7, loc="lower left")
    save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", help="a saved benchmarks.quality result")
    p.add_argument("--saved-method", help="the saved method, if it holds several")
    p.add_argument("--method", help="the method to run (any method string)")
    p.add_argument("--ratio", type=float)
    p.add_argument(
        "--saved-ratio",
        type=float,
        help="the saved run's ratio to pair with (--ratio unless given): the same method at "
        "another ratio shows how retention moves with the budget",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--order-seed", type=int, default=0, help="the shuffle of the wins")
    p.add_argument("--limit", type=int, help="run at most this many instances in all")
    p.add_argument(
        "--tasks",
        help="comma-separated tasks of the saved run to pair (all unless given): where a "
        "method differs from the saved one only on some tasks, the others answer the same",
    )
    p.add_argument(
        "--seeds",
        help="comma-separated seeds to pair (all unless given), as --tasks: the instances a "
        "change can reach",
    )
    p.add_argument(
        "--resume", action="store_true", help="keep the pairs already in --out"
    )
    p.add_argument(
        "--combine",
        nargs="+",
        metavar="RESULT",
        help="instead of running: join paired results of one method against one saved run "
        "(parts run by --tasks, --seeds or --limit) into one summary at --out",
    )
    p.add_argument("--out", default=str(RESULTS / "paired.json"))
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        if args.combine:
            joined = combine(args.combine)
            save_result(joined, args.out, plot)
            return joined
        if args.against is None or args.method is None or args.ratio is None:
            raise SweepError(
                "give --against, --method and --ratio (or --combine RESULT ...)"
            )
        saved = load_result(args.against)
        saved_ratio = args.ratio if args.saved_ratio is None else args.saved_ratio
        saved_method, picked = _saved_instances(saved, args.saved_method, saved_ratio)
        tasks = saved["tasks"] if args.tasks is None else args.tasks.split(",")
        unknown = sorted(set(tasks) - set(saved["tasks"]))
        if unknown:
            raise SweepError(
                f"the saved run has no task {', '.join(unknown)}; it has "
                f"{', '.join(saved['tasks'])}"
            )
        seeds = None
        if args.seeds is not None:
            try:
                seeds = sorted({int(s) for s in args.seeds.split(",")})
            except ValueError:
                raise SweepError(
                    f"--seeds takes comma-separated integers, got {args.seeds!r}"
                ) from None
        picked = {
            k: v
            for k, v in picked.items()
            if k[0] in tasks and (seeds is None or k[1] in seeds)
        }
        if args.limit is not None and args.limit < 1:
            raise SweepError(f"--limit must be >= 1, got {args.limit}")
        pairs: list[dict] = []
        if args.resume and Path(args.out).exists():
            earlier = load_result(args.out)
            same = (
                earlier.get("against"),
                earlier.get("method"),
                earlier.get("ratio"),
                earlier.get("saved_ratio", earlier.get("ratio")),
                earlier.get("tasks", saved["tasks"]),
                earlier.get("seeds"),
            )
            wanted = (
                str(args.against),
                args.method,
                args.ratio,
                saved_ratio,
                tasks,
                seeds,
            )
            if same != wanted:
                raise SweepError(
                    f"cannot resume {args.out}: it was made against {same[0]} at "
                    f"{same[3]} with {same[1]!r} at {same[2]} on {', '.join(same[4])}"
                    + ("" if same[5] is None else f", seeds {same[5]}")
                )
            pairs = earlier["pairs"]
        done = {(p["task"], p["seed"]) for p in pairs}
        todo = [
            k
            for k in instance_order(picked, saved["tasks"], args.order_seed)
            if k not in done
        ]
        if args.limit is not None:
            todo = todo[: max(0, args.limit - len(done))]

        def result() -> dict:
            summary = summarize(picked, pairs)
            return dict(
                against=str(args.against),
                saved_method=saved_method,
                method=args.method,
                ratio=args.ratio,
                saved_ratio=saved_ratio,
                tasks=tasks,
                seeds=seeds,
                tokens=saved["tokens"],
                model=saved["model"],
                max_new_tokens=args.max_new_tokens,
                order_seed=args.order_seed,
                summary=summary,
                totals=totals(summary),
                pairs=pairs,
            )

        for task, seed in tqdm(todo, desc="paired", unit="instance"):
            one = quality_parser().parse_args(
                [
                    "--tasks", task, "--seed", str(seed), "--instances", "1",
                    "--tokens", str(saved["tokens"]), "--model", saved["model"],
                    "--ratios", str(args.ratio), "--methods", args.method,
                    "--max-new-tokens", str(args.max_new_tokens),
                ]
            )  # fmt: skip
            measured = quality_run(one)
            row = measured["rows"][0]
            full = next(
                b for b in measured["baselines"] if b["method"] == "full-context"
            )
            expected = picked[(task, seed)]
            if row["prompt"] != expected["prompt"] or full["score"] != 1:
                raise SweepError(
                    f"{task} seed {seed} does not compare with the saved run: prompt "
                    f"{row['prompt']} (saved {expected['prompt']}), full-context score "
                    f"{full['score']} (saved 1)"
                )
            pairs.append(
                dict(
                    task=task,
                    seed=seed,
                    prompt=row["prompt"],
                    full_answer=full["answer"],
                    # how firmly the full context gives it (the new row's own margin beside)
                    full_margin=full.get("margin"),
                    saved={k: expected["saved"][k] for k in ("answer", "score")},
                    new=row,
                )
            )
            logger.warning(
                "%s %d: saved %g, new %g %r",
                task, seed, expected["saved"]["score"], row["score"], row["answer"][:60],
            )  # fmt: skip
            save_result(result(), args.out, plot)
    except SweepError as exc:
        raise SystemExit(f"error: {exc}") from None
    final = result()
    save_result(final, args.out, plot)
    return final


if __name__ == "__main__":
    main()
