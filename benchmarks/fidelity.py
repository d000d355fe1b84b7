"""Methods compared answer by answer: how faithfully and how firmly their prefixes give the
full context's right answers.

    python -m benchmarks.fidelity benchmarks/results/conversations_margins_6.json \
        --reference am@0.1 --out benchmarks/results/fidelity_margins_6.json
    python -m benchmarks.fidelity benchmarks/results/paired_default_20pct_combined.json \
        --out benchmarks/results/fidelity_paired_10pct.json

A greedy hit moves only where a prefix's answer crosses the edge it sits on, so two methods
compared by hits differ on a handful of answers, which noise moves both ways (``benchmarks.paired``
gives their McNemar p-value). Every compacted row of ``benchmarks.quality`` also records two
continuous measures on the full context's answer: its KL (the full context's next-token
distribution against the prefix's over the answer's tokens, teacher-forced), and, in runs made
since margins were recorded, its margin (at each token up to the answer's value, the full
context's token's logit minus the best other's, the smallest of these; positive exactly where
the prefix gives those tokens).

This pairs each method with a reference on every answer the full context gives right and
reports, per task, over all, and over the full context's confident answers and its near-ties
(``quality.CONFIDENT_MARGIN``): the answers kept, given back and lost (McNemar's p-value); on
how many answers the method's KL is lower and higher (exact sign test), the median factor, and
how well each one's KL tells the answers it loses from those it keeps; and the same for the
margins where both record them. The inputs are either ``benchmarks.quality`` results (joined by
``quality.combine``: same model, length, prompts and baseline answers, else refused), each
other method x ratio paired with ``--reference``, or ``benchmarks.paired`` results, each
against the saved run it was paired with (parts of one run joined). Writes JSON and a PNG (each
answer's KL and margin against the reference's).
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.output import pyplot, save_figure, save_result
from benchmarks.paired import sign_test
from benchmarks.quality import (
    CONFIDENT_MARGIN,
    RESULTS,
    SweepError,
    combine,
    full_context_margins,
    load_result,
    parse_label,
)

logger = logging.getLogger("benchmarks.fidelity")
ROOT = Path(__file__).resolve().parent.parent

#: the groups of pairs each comparison reports beside its tasks
CONFIDENT, NEAR_TIES = f"margin>={CONFIDENT_MARGIN:g}", f"margin<{CONFIDENT_MARGIN:g}"


@dataclass(frozen=True)
class Pair:
    """One answer the full context gives right, as the reference and the compared method's
    prefixes give it: each one's score, KL and margin on the full context's answer (None where
    not recorded)."""

    task: str
    seed: int
    full_margin: float | None
    reference_score: float
    reference_kl: float
    reference_margin: float | None
    score: float
    kl: float
    margin: float | None


def parse_reference(text: str) -> tuple[str, float | None]:
    """``"METHOD@RATIO"`` -> ``(METHOD, RATIO)`` (split at the last ``@``), ``"METHOD"`` ->
    ``(METHOD, None)``; SweepError for an empty method or a ratio outside (0, 1]."""
    method, at, ratio = text.rpartition("@")
    if not at:
        method, value = ratio, None
    else:
        try:
            value = float(ratio)
        except ValueError:
            value = -1.0
        if not 0 < value <= 1:
            method = ""
    if not method.strip():
        raise SweepError(
            "--reference takes METHOD (paired at each ratio) or METHOD@RATIO with a ratio "
            f"in (0, 1] (am@0.1), got {text!r}"
        )
    return method.strip(), value


def pairs_by_method(
    result: dict, reference: tuple[str, float | None]
) -> dict[str, list[Pair]]:
    """Per other method x ratio of ``result`` (``"method@ratio"``), its pairs with the reference
    (the reference method at that ratio where none is given) on the instances the full context
    answers right. SweepError where the reference has no rows, or nothing pairs with it."""
    engine = "vllm_score" if all("vllm_score" in r for r in result["rows"]) else "score"
    full = full_context_margins(result["baselines"], right_by=engine)
    cells: dict[tuple[str, float], dict[tuple[str, int], dict]] = defaultdict(dict)
    for row in result["rows"]:
        cells[(row["method"], row["ratio"])][(row["task"], row["seed"])] = row
    method, ratio = reference
    references = {
        r: v
        for (m, r), v in cells.items()
        if m == method and (ratio is None or abs(r - ratio) < 1e-9)
    }
    have = ", ".join(f"{m}@{r:g}" for m, r in cells)
    if not references:
        at = "" if ratio is None else f"@{ratio:g}"
        raise SweepError(f"the results have no {method}{at}; they have {have}")
    # the reference's own cells pair with nothing; the others with it at their ratio, or with
    # the one cell named
    own = {(method, r) for r in references}
    out: dict[str, list[Pair]] = {}
    for (m, r), rows in cells.items():
        if (m, r) in own:
            continue
        ref = references.get(r) if ratio is None else next(iter(references.values()))
        if ref is None:
            logger.warning("%s@%g: the reference has no rows at %g", m, r, r)
            continue
        pairs = [
            Pair(
                task=task,
                seed=seed,
                full_margin=full[(task, seed)],
                reference_score=ref[(task, seed)][engine],
                reference_kl=ref[(task, seed)]["kl"],
                reference_margin=ref[(task, seed)].get("margin"),
                score=row[engine],
                kl=row["kl"],
                margin=row.get("margin"),
            )
            for (task, seed), row in sorted(rows.items())
            if (task, seed) in full and (task, seed) in ref
        ]
        if not pairs:
            raise SweepError(
                f"{m}@{r:g} and the reference share no instance the full context answers right"
            )
        out[f"{m}@{r:g}"] = pairs
    if not out:
        raise SweepError(
            f"nothing to compare with the reference: the results hold {have}"
        )
    return out


def above(high: list[float], low: list[float]) -> float | None:
    """How often a value of ``high`` is above one of ``low`` (ties count half; the area under
    the ROC curve), or None where either is empty."""
    if not high or not low:
        return None
    wins = sum((h > lo) + 0.5 * (h == lo) for h in high for lo in low)
    return wins / (len(high) * len(low))


def compare(pairs: list[Pair]) -> dict:
    """The answers, the KL and the margins of ``pairs``: kept by each, given back and lost
    (McNemar's p-value); each one's median KL on the full context's answer and on how many pairs
    the compared method's is lower and higher (exact sign test's p-value), the median of its
    KL over the reference's, and for each how often an answer it loses has a higher KL than one
    it keeps; and over the pairs with margins, each one's median margin, the median and mean
    difference (compared minus reference), and on how many pairs it is higher and lower (sign
    test)."""
    back = sum(p.score == 1 and p.reference_score < 1 for p in pairs)
    lost = sum(p.score < 1 and p.reference_score == 1 for p in pairs)
    kl_lower = sum(p.kl < p.reference_kl for p in pairs)
    kl_higher = sum(p.kl > p.reference_kl for p in pairs)
    ratios = [p.kl / p.reference_kl for p in pairs if p.reference_kl > 0]
    out = dict(
        answers=len(pairs),
        reference_kept=sum(p.reference_score == 1 for p in pairs),
        kept=sum(p.score == 1 for p in pairs),
        given_back=back,
        lost=lost,
        answers_p=sign_test(back, lost),
        reference_kl_median=statistics.median(p.reference_kl for p in pairs),
        kl_median=statistics.median(p.kl for p in pairs),
        # the typical factor on one answer (0.5: half the reference's KL); a reference KL of
        # exactly 0 (the prefix is the full context) has no factor
        kl_ratio_median=statistics.median(ratios) if ratios else None,
        kl_lower=kl_lower,
        kl_higher=kl_higher,
        kl_p=sign_test(kl_lower, kl_higher),
        # does a prefix's KL tell which answers it loses? 0.5: not at all, 1: always
        lost_kl_above_kept=above(
            [p.kl for p in pairs if p.score < 1], [p.kl for p in pairs if p.score == 1]
        ),
        reference_lost_kl_above_kept=above(
            [p.reference_kl for p in pairs if p.reference_score < 1],
            [p.reference_kl for p in pairs if p.reference_score == 1],
        ),
    )
    both = [
        (p.reference_margin, p.margin)
        for p in pairs
        if p.reference_margin is not None and p.margin is not None
    ]
    if both:
        differences = [mine - theirs for theirs, mine in both]
        higher = sum(d > 0 for d in differences)
        lower = sum(d < 0 for d in differences)
        out |= dict(
            margins=len(both),
            reference_margin_median=statistics.median(theirs for theirs, _ in both),
            margin_median=statistics.median(mine for _, mine in both),
            margin_difference_median=statistics.median(differences),
            margin_difference_mean=statistics.mean(differences),
            margin_higher=higher,
            margin_lower=lower,
            margin_p=sign_test(higher, lower),
        )
    return out


def comparison(pairs: list[Pair]) -> dict:
    """``compare`` over all pairs, over the full context's confident answers and its near-ties
    (where its margins were recorded), and per task."""
    groups = {
        "all": pairs,
        CONFIDENT: [
            p
            for p in pairs
            if p.full_margin is not None and p.full_margin >= CONFIDENT_MARGIN
        ],
        NEAR_TIES: [
            p
            for p in pairs
            if p.full_margin is not None and p.full_margin < CONFIDENT_MARGIN
        ],
    }
    tasks: dict[str, list[Pair]] = defaultdict(list)
    for p in pairs:
        tasks[p.task].append(p)
    return {
        **{name: compare(group) for name, group in groups.items() if group},
        "by_task": {task: compare(group) for task, group in tasks.items()},
    }


def _scatter(ax, pairs: list[dict], key: str, colours: dict[str, str]) -> None:
    """Each pair's ``key`` under the compared method against the reference's, coloured by task:
    filled where the full context answers confidently, hollow where it is a near-tie, a cross
    where its margin was not recorded."""

    def kind(p: dict) -> str:
        if p["full_margin"] is None:
            return "unknown"
        return "confident" if p["full_margin"] >= CONFIDENT_MARGIN else "near-tie"

    for task, colour in colours.items():
        for style in ("confident", "near-tie", "unknown"):
            mine = [
                p
                for p in pairs
                if p["task"] == task
                and p[key] is not None
                and p[f"reference_{key}"] is not None
                and kind(p) == style
            ]
            if not mine:
                continue
            ax.scatter(
                [p[f"reference_{key}"] for p in mine],
                [p[key] for p in mine],
                s=14,
                marker="x" if style == "unknown" else "o",
                c="none" if style == "near-tie" else colour,
                edgecolors=None if style == "unknown" else colour,
                label=None if style == "near-tie" else task,
            )
    values = [
        v
        for p in pairs
        if p[key] is not None and p[f"reference_{key}"] is not None
        for v in (p[key], p[f"reference_{key}"])
    ]
    if values:
        ax.plot(
            [min(values), max(values)], [min(values), max(values)], color="grey", lw=0.8
        )


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(result["comparisons"])
    # a second row of margins where any comparison has them
    rows = 1 + any("margins" in c["all"] for c in result["comparisons"].values())
    fig, axes = plt.subplots(
        rows,
        len(names),
        figsize=(0.5 + 3.4 * len(names), 0.6 + 3.2 * rows),
        squeeze=False,
    )
    tasks = sorted({p["task"] for ps in result["pairs"].values() for p in ps})
    colours = {t: f"C{i}" for i, t in enumerate(tasks)}
    for column, name in enumerate(names):
        stats = result["comparisons"][name]["all"]
        kl_ax = axes[0][column]
        _scatter(kl_ax, result["pairs"][name], "kl", colours)
        kl_ax.set_xscale("log")
        kl_ax.set_yscale("log")
        kl_ax.set_title(
            f"{name[:40]}\nKL lower on {stats['kl_lower']}, higher on "
            f"{stats['kl_higher']} (p={stats['kl_p']:.2g})",
            fontsize=8,
        )
        reference = result["comparisons"][name]["reference"][:30]
        kl_ax.set_xlabel(f"KL, {reference}", fontsize=8)
        kl_ax.set_ylabel("KL", fontsize=8)
        if rows == 1:
            continue
        margin_ax = axes[1][column]
        if "margins" not in stats:
            margin_ax.set_axis_off()
            continue
        _scatter(margin_ax, result["pairs"][name], "margin", colours)
        margin_ax.axhline(0, color="grey", lw=0.5, ls=":")
        margin_ax.axvline(0, color="grey", lw=0.5, ls=":")
        margin_ax.set_title(
            f"margin higher on {stats['margin_higher']}, lower on "
            f"{stats['margin_lower']} (p={stats['margin_p']:.2g})",
            fontsize=8,
        )
        margin_ax.set_xlabel(f"margin (nats), {reference}", fontsize=8)
        margin_ax.set_ylabel("margin (nats)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    axes[0][0].legend(unique.values(), unique.keys(), fontsize=6, loc="upper left")
    fig.suptitle(
        "on the full context's right answers: each prefix's KL on it and margin\n"
        "(filled: answered by half a nat or more; hollow: near-ties; x: margin not recorded)",
        fontsize=9,
    )
    save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "results",
        nargs="+",
        help="benchmarks.quality results to join, or benchmarks.paired results (each "
        "against its saved run; parts of one run joined)",
    )
    p.add_argument(
        "--reference",
        help="quality results: METHOD: every other method is paired with it at the same "
        "ratio; METHOD@RATIO: every other method x ratio is paired with that one",
    )
    p.add_argument(
        "--first",
        type=int,
        metavar="N",
        help="join each result's first N instances only (a longer run beside shorter ones)",
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="METHOD=NAME",
        help="call METHOD NAME before joining (repeatable)",
    )
    p.add_argument("--out", default=str(RESULTS / "fidelity.json"))
    return p


def _saved_run(against: str, cache: dict[str, dict]) -> dict:
    """The saved run a paired result was made against, read once (its path as recorded, from
    here or from the repository's root)."""
    if against not in cache:
        path = Path(against)
        if not path.exists() and (ROOT / path).exists():
            path = ROOT / path
        cache[against] = load_result(path)
    return cache[against]


def pairs_from_paired(paired: dict, saved: dict) -> list[Pair]:
    """A ``benchmarks.paired`` result's pairs: each new row beside the saved method's row on
    the same instance (reference decoder's scores in both). SweepError where the saved run
    lacks one."""
    ratio = paired.get("saved_ratio", paired["ratio"])
    rows = {
        (r["task"], r["seed"]): r
        for r in saved["rows"]
        if r["method"] == paired["saved_method"] and abs(r["ratio"] - ratio) < 1e-9
    }
    margins = full_context_margins(saved["baselines"])
    out = []
    for pair in paired["pairs"]:
        key = (pair["task"], pair["seed"])
        # runs paired before margins were recorded carry none; the saved run may
        full_margin = pair.get("full_margin")
        ref, new = rows.get(key), pair["new"]
        if ref is None or ref["prompt"] != pair["prompt"]:
            raise SweepError(
                f"{paired['against']} has no {paired['saved_method']}@{ratio:g} row for "
                f"{key[0]} seed {key[1]} with prompt {pair['prompt']}: not the run it was "
                "paired against"
            )
        out.append(
            Pair(
                task=key[0],
                seed=key[1],
                full_margin=margins.get(key) if full_margin is None else full_margin,
                reference_score=ref["score"],
                reference_kl=ref["kl"],
                reference_margin=ref.get("margin"),
                score=new["score"],
                kl=new["kl"],
                margin=new.get("margin"),
            )
        )
    return out


def paired_comparisons(
    results: list[dict],
) -> tuple[dict[str, list[Pair]], dict[str, str]]:
    """Per method of the paired ``results`` (parts of one run joined, each instance once), its
    pairs and what it was paired against."""
    cache: dict[str, dict] = {}
    pairs: dict[str, dict[tuple[str, int], Pair]] = defaultdict(dict)
    references: dict[str, str] = {}
    for result in results:
        saved_ratio = result.get("saved_ratio", result["ratio"])
        reference = f"{result['saved_method']}@{saved_ratio:g} in {result['against']}"
        name = f"{result['method']}@{result['ratio']:g}"
        if references.setdefault(name, reference) != reference:
            name = f"{name} against {Path(result['against']).stem}@{saved_ratio:g}"
            references[name] = reference
        for pair in pairs_from_paired(result, _saved_run(result["against"], cache)):
            pairs[name].setdefault((pair.task, pair.seed), pair)
    return {name: list(ps.values()) for name, ps in pairs.items()}, references


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        results = [load_result(path) for path in args.results]
        kinds = {"pairs" in r and "against" in r for r in results}
        if kinds == {True}:
            if args.reference or args.first or args.label:
                raise SweepError(
                    "paired results carry their own reference: drop --reference, --first "
                    "and --label"
                )
            pairs, references = paired_comparisons(results)
            about = dict(model=results[0]["model"], tokens=results[0]["tokens"])
        elif kinds == {False}:
            if args.reference is None:
                raise SweepError(
                    "give --reference METHOD or METHOD@RATIO to pair quality results with"
                )
            reference = parse_reference(args.reference)
            labels = dict(parse_label(text) for text in args.label)
            joined = combine(results, args.first, labels)
            pairs = pairs_by_method(joined, reference)
            references = dict.fromkeys(pairs, args.reference)
            about = dict(model=joined["model"], tokens=joined["tokens"])
        else:
            raise SweepError(
                "give either benchmarks.quality results or benchmarks.paired results, not both"
            )
    except (KeyError, TypeError) as exc:
        raise SystemExit(
            f"error: not a result of benchmarks.quality or benchmarks.paired ({exc!r})"
        ) from None
    except SweepError as exc:
        raise SystemExit(f"error: {exc}") from None
    result = dict(
        results=[str(path) for path in args.results],
        **about,
        confident_margin=CONFIDENT_MARGIN,
        comparisons={
            name: {"reference": references[name], **comparison(ps)}
            for name, ps in pairs.items()
        },
        pairs={name: [asdict(p) for p in ps] for name, ps in pairs.items()},
    )
    for name, c in result["comparisons"].items():
        logger.warning(
            "%s against %s: %d answers, kept %d (reference %d), KL lower on %d, higher on "
            "%d (p=%.3g)%s",
            name, c["reference"], c["all"]["answers"], c["all"]["kept"],
            c["all"]["reference_kept"], c["all"]["kl_lower"], c["all"]["kl_higher"],
            c["all"]["kl_p"],
            "" if "margins" not in c["all"] else
            f"; margin higher on {c['all']['margin_higher']}, lower on "
            f"{c['all']['margin_lower']} (p={c['all']['margin_p']:.3g})",
        )  # fmt: skip
    save_result(result, args.out, plot)
    return result


if __name__ == "__main__":
    main()
