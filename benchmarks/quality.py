"""Quality vs compaction ratio through the reference decoder: tasks x methods x ratios.

    python -m benchmarks.quality --tasks niah,variable-tracking --methods am-highest-attn-fast,kvzip \
        --ratios 0.1,0.05,0.02 --instances 12 --tokens 2000 --out benchmarks/results/quality.json

Tasks are seeded (``vllm_compaction.eval.tasks``); every method sees the identical instance,
prompt and continuation tokens (asserted through a hash of the prompt). Each instance is also
answered with the full context and with no context. Every compacted run records its answer,
score (fraction of expected answers named), compaction time, slot counts, and the
reconstruction metrics (log-perplexity of the full context's answer under both caches, KL).
Writes JSON and PNG plots (accuracy vs ratio per task; accuracy vs compaction time at the
ratio closest to 10%). ``--quick`` is the CI-sized run. ``--resume`` continues a sweep that
stopped (the JSON at ``--out``, saved after every instance): instances it completed are kept,
after checking that the same settings produced them and that their prompts hash the same.
``--combine A.json B.json --out C.json`` merges runs of other methods over the same instances
into one result and plot.

``--vllm`` answers every prompt a second time through a vLLM engine with the plugin (the
full context as plain tokens, each compacted prefix loaded from a store), as the product
serves it: each row and baseline gains ``vllm_answer`` and ``vllm_score`` beside the reference
decoder's, and the summary scores and plots vLLM's answers. The summary's ``retention`` is the
share of the instances the full context answers right that the compacted prefix still does;
tasks scored exactly (identifiers) count answers ``cut_short``, a prefix of the expected value.

Where the full context answers right, its baseline records its ``margin`` on that answer (the
smallest, over the tokens that give the answer, of the chosen token's logit minus the best
other: how nearly it answered otherwise) and each row the compacted prefix's margin on the
same tokens (negative: it would answer otherwise). The summary splits ``retention`` into the
full context's confident answers and its near-ties (``retention_by_margin``, at
``CONFIDENT_MARGIN`` nats). ``--add-margins`` records the full context's margins in a result
saved before they were (the reference decoder re-answers each right instance, checked against
the saved answer) and summarizes it again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import tempfile
import textwrap
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.output import command_line, log_scale, pyplot, save_result

logger = logging.getLogger("benchmarks.quality")

RESULTS = Path(__file__).resolve().parent / "results"


class SweepError(ValueError):
    """Settings or earlier results this sweep cannot use: an unknown method, a result to resume
    or combine that was made with other settings or instances, a JSON that is not a result."""


class EngineAnswers:
    """Greedy answers from an in-process vLLM engine with the compaction plugin: plain token
    prompts for the full context, compacted prefixes through a store in a temporary folder."""

    def __init__(self, model: str, max_model_len: int = 4096) -> None:
        from vllm import LLM

        from vllm_compaction.models import resolve
        from vllm_compaction.vllm import engine_kwargs

        self._folder = tempfile.TemporaryDirectory(prefix="quality-store-")
        self.llm = LLM(
            str(resolve(model)),
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=2 << 30,
            seed=0,
            **engine_kwargs(store=self._folder.name),
        )

    def answer(self, prefixes: list, continuation: list[int], tokens: int) -> list[str]:
        """One answer per prefix: token ids (answered as they are) or a CompactedCache."""
        from vllm import SamplingParams

        from vllm_compaction.vllm import compacted_prompt

        prompts = [
            {"prompt_token_ids": list(p) + continuation}
            if isinstance(p, list)
            else compacted_prompt(
                p, continuation, llm=self.llm, store=self._folder.name
            )
            for p in prefixes
        ]
        params = SamplingParams(max_tokens=tokens, temperature=0.0)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [out.outputs[0].text for out in outputs]

    def close(self) -> None:
        from vllm_compaction.vllm.engine import shutdown_engine

        shutdown_engine(self.llm)
        self._folder.cleanup()


def instance_prompt(adapter, task: str, tokens: int, seed: int):
    """A seeded instance of ``task``, its prompt and the prompt's hash (which ties results of
    different runs, and of other runners, to the same tokens)."""
    from vllm_compaction.eval.tasks import make_task, task_prompt

    inst = make_task(task, adapter.tokenizer, tokens, seed=seed)
    prompt = task_prompt(adapter, inst)
    digest = hashlib.sha256(
        json.dumps([prompt.prefix_ids, prompt.continuation_ids]).encode()
    ).hexdigest()[:16]
    return inst, prompt, digest


def full_context_answer(decoder, inst, prompt, answer_tokens: int):
    """The full context's KV, its greedy answer, how many of the answer's tokens give the
    expected value (None where the answer is wrong: no margin is read) and the full context's
    logits along the answer."""
    from vllm_compaction.eval.reconstruction import answer_logits

    full_kv = decoder.adapter.prefill(prompt.prefix_ids, capture_queries=False)
    full = decoder.generate(
        full_kv, prompt.continuation_ids, max_new_tokens=answer_tokens
    )
    logits = answer_logits(decoder, full_kv, prompt.continuation_ids, full.token_ids)
    return full_kv, full, inst.answer_span(decoder.text, full.token_ids), logits


def completed_instances(
    previous: dict, args: argparse.Namespace
) -> dict[tuple[str, int], dict]:
    """The instances of an earlier (possibly partial) result that this run may keep, keyed by
    (task, seed): their baselines, rows and prompt hash. Raises SweepError when the result was
    made with another model, length, method list or ratio list, whose rows would not compare."""
    from vllm_compaction.eval.variants import parse_variants

    methods = [v.label for v in parse_variants(args.methods)]
    ratios = [float(r) for r in args.ratios.split(",")]
    summarize = getattr(args, "summarize", False)
    wanted = dict(
        model=args.model,
        tokens=args.tokens,
        methods=methods,
        ratios=ratios,
        answered_by=_answered_by(args),
        summarize=summarize,
    )
    per_method = len(methods) * len(ratios)
    rows = per_method * (2 if summarize else 1) + bool(summarize)
    seeds = range(args.seed, args.seed + args.instances)
    return kept_instances(previous, wanted, args.tasks.split(","), seeds, rows)


def kept_instances(
    previous: dict,
    wanted: dict,
    tasks: list[str],
    seeds: range,
    rows_per_instance: int,
) -> dict[tuple[str, int], dict]:
    """``--resume`` for any runner of these instances: the (task, seed) of ``tasks`` x ``seeds``
    that ``previous`` holds whole (two baselines and ``rows_per_instance`` rows), with their
    baselines, rows and prompt hash. Raises SweepError unless ``previous`` has every setting of
    ``wanted`` (results from before ``--vllm`` and ``--summarize`` count as the reference decoder
    without summaries)."""
    done: dict[tuple[str, int], dict] = {}
    try:
        for key, value in wanted.items():
            if (
                previous.get(
                    key, {"answered_by": "reference", "summarize": False}.get(key)
                )
                != value
            ):
                raise SweepError(
                    f"cannot resume: the earlier result has {key}={previous.get(key)!r}, "
                    f"this run {value!r}"
                )
        for task in tasks:
            for seed in seeds:
                base = [
                    b
                    for b in previous.get("baselines", [])
                    if b["task"] == task and b["seed"] == seed
                ]
                rows = [
                    r
                    for r in previous.get("rows", [])
                    if r["task"] == task and r["seed"] == seed
                ]
                if len(base) == 2 and len(rows) == rows_per_instance:
                    done[(task, seed)] = dict(
                        baselines=base, rows=rows, prompt=base[0]["prompt"]
                    )
    except (AttributeError, KeyError, TypeError) as exc:
        raise SweepError(
            f"cannot resume: not a result of this benchmark ({exc!r})"
        ) from None
    return done


def run(
    args: argparse.Namespace,
    on_instance: Callable[[dict], None] | None = None,
    previous: dict | None = None,
) -> dict:
    """Every task x instance x method x ratio; ``on_instance`` gets the result so far (marked
    ``"partial": true``) after each instance, so a long sweep that stops keeps what it measured.
    Given ``previous`` (such a result), its completed instances are kept, not recomputed. The
    methods and ``previous`` are checked (SweepError) before the model is loaded."""
    import torch

    from vllm_compaction.eval.conversations import cut_short
    from vllm_compaction.eval.reconstruction import (
        answer_logits,
        answer_margin,
        reconstruction_from_logits,
    )
    from vllm_compaction.eval.variants import parse_variants
    from vllm_compaction.models import PrefixKV, load_adapter
    from vllm_compaction.pipeline import RECIPES, compact_prepared
    from vllm_compaction.reference import ReferenceDecoder

    try:
        variants = parse_variants(args.methods, known=RECIPES)
    except ValueError as exc:
        raise SweepError(str(exc)) from None
    summarizing = getattr(args, "summarize", False)
    if summarizing and getattr(args, "vllm", False):
        raise SweepError(
            "--summarize answers through the reference decoder only: drop --vllm"
        )
    if summarizing and args.summary_tokens < 1:
        raise SweepError(f"--summary-tokens must be >= 1, got {args.summary_tokens}")
    done = completed_instances(previous, args) if previous is not None else {}
    if previous is not None:
        logger.warning("resuming: %d instance(s) already complete", len(done))
    adapter = load_adapter(args.model)
    decoder = ReferenceDecoder(adapter)
    engine = EngineAnswers(args.model) if getattr(args, "vllm", False) else None
    tasks = args.tasks.split(",")
    ratios = [float(r) for r in args.ratios.split(",")]
    seeds = range(args.seed, args.seed + args.instances)
    rows, baselines = [], []
    prompt_hash: dict[tuple[str, int], str] = {}
    remaining = len(tasks) * len(seeds) - len(done)
    per_instance = 2 + len(variants) * len(ratios)
    if summarizing:
        per_instance += 1 + len(variants) * len(ratios)
    bar = tqdm(total=remaining * per_instance, desc="quality", unit="run")
    # the kept instances go into every save, the partial ones too: a sweep stopped again
    # loses none of them, even those its task order has not reached yet
    for kept in done.values():
        baselines += kept["baselines"]
        rows += kept["rows"]
    for task in tasks:
        for seed in seeds:
            inst, prompt, digest = instance_prompt(adapter, task, args.tokens, seed)
            # identical for every method
            assert prompt_hash.setdefault((task, seed), digest) == digest
            if (task, seed) in done:
                kept = done[(task, seed)]
                if kept["prompt"] != digest:
                    raise SweepError(
                        f"cannot resume: {task} seed {seed} has another prompt now "
                        f"({digest}) than in the earlier result ({kept['prompt']})"
                    )
                continue
            # free-form tasks answer at length
            answer_tokens = inst.answer_tokens or args.max_new_tokens
            full_kv, full, span, logits = full_context_answer(
                decoder, inst, prompt, answer_tokens
            )
            # the full context's logits along its answer, once per question wording
            full_logits: dict[tuple[int, ...], torch.Tensor] = {
                tuple(prompt.continuation_ids): logits
            }
            template_only = [
                t
                for t, m in zip(prompt.prefix_ids, prompt.compact_mask.tolist())
                if not m
            ]
            none = decoder.generate(
                adapter.prefill(template_only, capture_queries=False),
                prompt.continuation_ids,
                max_new_tokens=answer_tokens,
            )
            for name, gen in (("full-context", full), ("no-context", none)):
                baselines.append(
                    dict(
                        task=task,
                        seed=seed,
                        method=name,
                        answer=gen.text,
                        score=inst.score(gen.text),
                        prompt=digest,
                        prefix_tokens=len(prompt.prefix_ids),
                        **_about(inst, gen.text),
                    )
                )
                bar.update(1)
            if span is not None:
                baselines[-2]["margin"] = answer_margin(logits, full.token_ids, span)
            instance_baselines, instance_rows = baselines[-2:], []
            prefixes: list = [prompt.prefix_ids, template_only]

            def measure(
                prepared_prefix,
                ratio,
                kwargs,
                continuation_ids,
                task=task,
                seed=seed,
                digest=digest,
                inst=inst,
                full_kv=full_kv,
                full=full,
                span=span,
                full_logits=full_logits,
                answer_tokens=answer_tokens,
            ):
                """Compact a prepared prefix (or take a ``PrefixKV`` as it is), answer after
                it, score the answer and the reconstruction of the full context's answer."""
                start = time.perf_counter()
                exact = isinstance(prepared_prefix, PrefixKV)
                cache = (
                    prepared_prefix
                    if exact
                    else compact_prepared(prepared_prefix, ratio=ratio, **kwargs)
                )
                seconds = time.perf_counter() - start
                gen = decoder.generate(
                    cache, continuation_ids, max_new_tokens=answer_tokens
                )
                key = tuple(continuation_ids)
                if key not in full_logits:
                    full_logits[key] = answer_logits(
                        decoder, full_kv, continuation_ids, full.token_ids
                    )
                recon = reconstruction_from_logits(
                    full_logits[key],
                    answer_logits(decoder, cache, continuation_ids, full.token_ids),
                    full.token_ids,
                    span,
                )
                row = dict(
                    task=task,
                    seed=seed,
                    ratio=ratio,
                    prompt=digest,
                    answer=gen.text,
                    score=inst.score(gen.text),
                    compaction_s=seconds,
                    log_ppl_full=recon.log_ppl_full,
                    log_ppl_compacted=recon.log_ppl_compacted,
                    kl=recon.kl,
                    **_about(inst, gen.text),
                )
                if span is not None:
                    # how firmly this prefix gives the full context's answer (< 0: it does not)
                    row["margin"] = recon.margin_compacted
                if not exact:
                    lengths = cache.head_lengths[cache.layer_compacted]
                    row.update(
                        timings=cache.timings,
                        physical_slots=cache.physical_slots,
                        max_head=int(lengths.max()),
                        min_head=int(lengths.min()),
                    )
                return cache, row

            for variant, ratio, kwargs, prepared in method_runs(
                adapter, prompt, variants, ratios, seed
            ):
                cache, row = measure(prepared, ratio, kwargs, prompt.continuation_ids)
                rows.append(dict(row, method=variant.label))
                instance_rows.append(rows[-1])
                prefixes.append(cache)
                bar.update(1)
            if summarizing:
                rows += summarized_rows(
                    adapter, decoder, inst, prompt, variants, ratios, args, measure
                )
                bar.update(1 + len(variants) * len(ratios))
            if engine is not None:
                # the same prompts served by vLLM: full context, no context, every cache
                answers = engine.answer(
                    prefixes, prompt.continuation_ids, answer_tokens
                )
                for record, text in zip(instance_baselines + instance_rows, answers):
                    record["vllm_answer"] = text
                    record["vllm_score"] = inst.score(text)
                    if inst.exact:
                        record["vllm_cut_short"] = cut_short(text, inst.answers)
            if on_instance is not None:
                on_instance(
                    {
                        **_result(
                            args, tasks, ratios, variants, list(rows), list(baselines)
                        ),
                        "partial": True,
                    }
                )
    bar.close()
    if engine is not None:
        engine.close()
    return _result(args, tasks, ratios, variants, rows, baselines)


def add_margins(
    result: dict,
    max_new_tokens: int,
    on_instance: Callable[[dict], None] | None = None,
) -> dict:
    """``result`` with the full context's margin on each right answer that has none (a result
    saved before margins were recorded), summarized again. Each such instance is answered again
    by the reference decoder; SweepError where its prompt or its answer is not the saved one
    (``max_new_tokens``: the run's, where the result does not record it). The compacted
    prefixes' own margins would need every prefix compacted again: only a new run records
    them. ``on_instance`` gets the result so far after each instance."""
    from vllm_compaction.eval.reconstruction import answer_margin
    from vllm_compaction.models import load_adapter
    from vllm_compaction.reference import ReferenceDecoder

    try:
        model, tokens = result["model"], result["tokens"]
        baselines = [dict(b) for b in result["baselines"]]
        rows = result["rows"]
        todo = [
            b
            for b in baselines
            if b["method"] == "full-context" and b["score"] == 1 and "margin" not in b
        ]
    except (KeyError, TypeError) as exc:
        raise SweepError(f"not a result of this benchmark ({exc!r})") from None
    max_new_tokens = result.get("max_new_tokens", max_new_tokens)
    command = command_line()
    about = {"margins_added_by": command} if command is not None else {}

    def current() -> dict:
        return {
            **result,
            **about,
            "summary": summarize(rows, baselines),
            "baselines": baselines,
        }

    if not todo:
        return current()
    adapter = load_adapter(model)
    decoder = ReferenceDecoder(adapter)
    for b in tqdm(todo, desc="margins", unit="instance"):
        task, seed = b["task"], b["seed"]
        inst, prompt, digest = instance_prompt(adapter, task, tokens, seed)
        if digest != b["prompt"]:
            raise SweepError(
                f"{task} seed {seed} has another prompt now ({digest}) than in the result "
                f"({b['prompt']}): its margin would be another answer's"
            )
        _, gen, span, logits = full_context_answer(
            decoder, inst, prompt, inst.answer_tokens or max_new_tokens
        )
        if gen.text != b["answer"] or span is None:
            raise SweepError(
                f"the reference decoder answers {task} seed {seed} with {gen.text!r} now, not "
                f"the saved {b['answer']!r} (was the run's --max-new-tokens "
                f"{max_new_tokens}?)"
            )
        b["margin"] = answer_margin(logits, gen.token_ids, span)
        if on_instance is not None:
            on_instance(current())
    return current()


def method_runs(adapter, prompt, variants, ratios, seed):
    """Each (variant, ratio) to measure on ``prompt``, with the variant's compaction options and
    the prepared prefix to compact: one prefill and query plan per query source, shared by the
    methods and ratios that use it ('/auto' spacings plan per ratio)."""
    from vllm_compaction.pipeline import RECIPES, prepare_prefix
    from vllm_compaction.queries import resolve_spacing

    prepared: dict = {}
    for variant in variants:
        kwargs = variant.kwargs()
        requested = kwargs.pop("queries", None) or RECIPES[variant.method].queries
        for ratio in ratios:
            queries = resolve_spacing(requested, ratio)
            if queries not in prepared:
                prepared[queries] = prepare_prefix(
                    adapter,
                    prompt.prefix_ids,
                    prompt.compact_mask,
                    queries=queries,
                    seed=seed,
                )
            yield variant, ratio, kwargs, prepared[queries]


def summarized_rows(
    adapter, decoder, inst, prompt, variants, ratios, args, measure
) -> list[dict]:
    """``--summarize``: the model's summary of the instance's context stands in for it
    (``vllm_compaction.summarize``, the paper's summarize + AM). A ``summarize`` row answers
    from the summary's exact KV, a ``summarize+<method>`` row from the summary compacted at each
    ratio. ``content_fraction`` is the share of the original content tokens the answer was
    served from (the paper's "cache size"); compaction time includes the summary's."""
    from dataclasses import replace

    from vllm_compaction.eval.tasks import task_prompt
    from vllm_compaction.summarize import SUMMARY_HEADER, summarize

    start = time.perf_counter()
    source = list(inst.messages) or [{"role": "user", "content": inst.context}]
    summary = summarize(adapter, source, max_new_tokens=args.summary_tokens)
    summary_s = time.perf_counter() - start
    if inst.messages:
        message = {"role": "user", "content": SUMMARY_HEADER + summary}
        short = replace(inst, context=summary, messages=(message,))
    else:
        short = replace(inst, context=summary)
    s_prompt = task_prompt(adapter, short)
    original = int(prompt.compact_mask.sum())
    summary_tokens = int(s_prompt.compact_mask.sum())
    # the exact summary, measured like a compacted prefix
    exact = adapter.prefill(s_prompt.prefix_ids, capture_queries=False)
    _, row = measure(exact, 1.0, {}, s_prompt.continuation_ids)
    about = dict(summary=summary, summary_tokens=summary_tokens)
    rows = [
        dict(
            row,
            **about,
            method="summarize",
            compaction_s=summary_s,
            content_fraction=summary_tokens / original,
        )
    ]
    for variant, ratio, kwargs, prepared in method_runs(
        adapter, s_prompt, variants, ratios, inst.seed
    ):
        _, row = measure(prepared, ratio, kwargs, s_prompt.continuation_ids)
        rows.append(
            dict(
                row,
                **about,
                method=f"summarize+{variant.label}",
                compaction_s=row["compaction_s"] + summary_s,
                content_fraction=ratio * summary_tokens / original,
            )
        )
    return rows


def _answered_by(args: argparse.Namespace) -> str:
    return "reference+vllm" if getattr(args, "vllm", False) else "reference"


def _about(inst, text: str) -> dict:
    """What a record of an instance carries besides its score: how the instance was built
    (where its fact sits, the distractors beside its answer) and, for identifiers, whether the
    answer named only a prefix."""
    from vllm_compaction.eval.conversations import cut_short

    details = dict(inst.details)
    if inst.distractors:
        details["distractors"] = list(inst.distractors)
    out: dict = {"details": details} if details else {}
    if inst.exact:
        out["cut_short"] = cut_short(text, inst.answers)
    return out


def _result(
    args, tasks, ratios, variants, rows: list[dict], baselines: list[dict]
) -> dict:
    return dict(
        model=args.model,
        tokens=args.tokens,
        instances=args.instances,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        tasks=tasks,
        ratios=ratios,
        methods=[v.label for v in variants],
        answered_by=_answered_by(args),
        summarize=getattr(args, "summarize", False),
        summary=summarize(rows, baselines),
        baselines=baselines,
        rows=rows,
        created=time.time(),
    )


def _first_instances(result: dict, instances: int) -> dict:
    """``result`` with only its baselines and rows of seeds ``seed .. seed + instances - 1``."""
    seeds = range(result["seed"], result["seed"] + instances)
    return {
        **result,
        "instances": instances,
        "baselines": [b for b in result["baselines"] if b["seed"] in seeds],
        "rows": [r for r in result["rows"] if r["seed"] in seeds],
    }


def _relabel(result: dict, labels: dict[str, str]) -> dict:
    """``result`` with its methods renamed by ``labels`` (the others as they are)."""
    return {
        **result,
        "methods": [labels.get(m, m) for m in result["methods"]],
        "rows": [
            {**r, "method": labels.get(r["method"], r["method"])}
            for r in result["rows"]
        ],
    }


def combine(
    results: list[dict],
    instances: int | None = None,
    labels: dict[str, str] | None = None,
) -> dict:
    """One result from several runs, for one table and one plot: runs of different methods over
    the same instances, or of the same sweep split by task across processes, or both. A task in
    two runs must have the same instances in both (prompts and baseline answers, asserted), and
    a method may come from several runs at different ratios (10% in one, 5% and 2% in another),
    never at one ratio on one task twice; the model and the length must agree, else the runs do
    not compare. Given ``instances``, each run's first ``instances`` instances are combined (a
    48-instance run beside 12-instance ones); ``labels`` renames methods first (a method spec
    written out in one run and by its recipe name in another)."""
    if not results:
        raise SweepError("nothing to combine")
    if instances is not None and instances < 1:
        raise SweepError(f"--first must be >= 1, got {instances}")
    try:
        if instances is not None:
            results = [_first_instances(result, instances) for result in results]
        if labels:
            results = [_relabel(result, labels) for result in results]
        first = results[0]
        for other in results[1:]:
            for key in ("model", "tokens"):
                if other[key] != first[key]:
                    raise SweepError(
                        f"cannot combine: {key} {other[key]!r} differs from {first[key]!r}"
                    )
        tasks, baselines = _combined_baselines(results)
        methods: list[str] = []
        seen: set[tuple[str, str, float]] = set()
        for result in results:
            for method in result["methods"]:
                for task in result["tasks"]:
                    for ratio in result["ratios"]:
                        if (task, method, ratio) in seen:
                            raise SweepError(
                                f"cannot combine: {method} at {ratio:g} on {task} is in two "
                                "of the runs"
                            )
                        seen.add((task, method, ratio))
                if method not in methods:
                    methods.append(method)
        rows = [row for result in results for row in result["rows"]]
        ratios = sorted(
            {r for result in results for r in result["ratios"]}, reverse=True
        )
        answered_by = {result.get("answered_by") for result in results}
    except (KeyError, TypeError) as exc:
        raise SweepError(
            f"cannot combine: not a result of this benchmark ({exc!r})"
        ) from None
    merged = dict(
        model=first["model"],
        tokens=first["tokens"],
        instances=first["instances"],
        seed=first["seed"],
        tasks=tasks,
        ratios=ratios,
        methods=methods,
    )
    max_new_tokens = {result.get("max_new_tokens") for result in results}
    if len(max_new_tokens) == 1 and None not in max_new_tokens:
        merged["max_new_tokens"] = max_new_tokens.pop()
    if len(answered_by) == 1 and None not in answered_by:
        # vLLM's answers are scored only where every run has them
        merged["answered_by"] = answered_by.pop()
    if any(result.get("partial") for result in results):
        # a part that stopped early (--resume continues it) leaves the whole partial
        merged["partial"] = True
    return dict(
        **merged,
        summary=summarize(rows, baselines),
        baselines=baselines,
        rows=rows,
        created=time.time(),
    )


def _combined_baselines(results: list[dict]) -> tuple[list[str], list[dict]]:
    """The tasks of ``results`` in the order they first appear, and each task's baselines from
    the first run that has it; SweepError where a later run has the task with other instances
    (missing ones, another prompt or another baseline answer)."""
    tasks: list[str] = []
    baselines: list[dict] = []
    known: dict[str, dict] = {}
    for result in results:
        mine: dict[str, dict] = {task: {} for task in result["tasks"]}
        for b in result["baselines"]:
            mine[b["task"]][(b["seed"], b["method"])] = (b["prompt"], b["score"])
        for task, answers in mine.items():
            if task not in known:
                known[task] = answers
                tasks.append(task)
                baselines += [b for b in result["baselines"] if b["task"] == task]
            elif answers != known[task]:
                theirs = known[task]
                differ = sorted(
                    {k[0] for k in set(answers) ^ set(theirs)}
                    | {
                        k[0]
                        for k in set(answers) & set(theirs)
                        if answers[k] != theirs[k]
                    }
                )
                raise SweepError(
                    f"cannot combine: the runs differ on {task} instances {differ[:5]} "
                    "(missing, or another prompt or baseline answer)"
                )
    return tasks, baselines


def _total(scores: list[float | None]) -> str | None:
    """ "hits/n", or None for a task that scores nothing (free-form answers)."""
    if any(score is None for score in scores):
        return None
    return f"{sum(scores):g}/{len(scores)}"


#: a full-context answer chosen by less than this (nats, at its closest token) is a near-tie:
#: about a quarter of the default model's right answers on the conversation families, and the
#: ones every change of the method moves both ways
CONFIDENT_MARGIN = 0.5


def full_context_margins(
    baselines: list[dict], right_by: str | None = None
) -> dict[tuple[str, int], float | None]:
    """(task, seed) -> the full context's margin on its answer (None where it was not recorded:
    a wrong answer, or a result saved before margins); with ``right_by`` (a score key, "score"
    or "vllm_score"), only the instances the full context answers right by that score."""
    return {
        (b["task"], b["seed"]): b.get("margin")
        for b in baselines
        if b["method"] == "full-context" and (right_by is None or b.get(right_by) == 1)
    }


def _margin_split(kept: list[dict], margins: dict, task: str, engine: str) -> dict:
    """Retention ("hits/n") among the full context's confident answers and its near-ties;
    instances whose full-context margin is unknown (saved before margins) count in neither."""
    split: dict[str, list[bool]] = defaultdict(list)
    for r in kept:
        margin = margins.get((task, r["seed"]))
        if margin is not None:
            confident = margin >= CONFIDENT_MARGIN
            split[f"margin{'>=' if confident else '<'}{CONFIDENT_MARGIN:g}"].append(
                r[engine] == 1
            )
    return {k: f"{sum(v)}/{len(v)}" for k, v in sorted(split.items())}


def summarize(rows: list[dict], baselines: list[dict]) -> dict:
    """Per task: baselines' and each method x ratio's total score ("hits/n"; None where the task
    scores nothing), mean compaction time, log-perplexity ratio (compacted / full) and KL.

    Where vLLM answered too (``--vllm``), each cell adds ``vllm_score``; ``retention`` (the
    share of the instances the full context answers right that the method keeps, vLLM's
    answers where present), split by the full context's margin where it was recorded
    (``retention_by_margin``; ``margin_median``: the median of the prefix's own margins on
    those answers), and, per value of each instance detail (the fact's turn and position,
    ...), the hits among those instances (``by``); exact tasks count ``cut_short``."""
    out: dict = defaultdict(dict)
    engine = "vllm_score" if rows and all("vllm_score" in r for r in rows) else "score"
    full_right: dict[tuple[str, int], bool] = {}
    margins = full_context_margins(baselines)
    for b in baselines:
        out[b["task"]].setdefault(b["method"], []).append(b["score"])
        if engine == "vllm_score":
            out[b["task"]].setdefault(f"vllm:{b['method']}", []).append(
                b.get("vllm_score")
            )
        if b["method"] == "full-context" and b.get(engine) is not None:
            full_right[(b["task"], b["seed"])] = b[engine] == 1
    for methods in out.values():
        for name in list(methods):
            methods[name] = _total(methods[name])
    groups: dict = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["method"], r["ratio"])].append(r)
    for (task, method, ratio), group in groups.items():
        cell = {
            "score": _total([r["score"] for r in group]),
            "compaction_s": statistics.mean(r["compaction_s"] for r in group),
            "log_ppl_ratio": statistics.mean(r["log_ppl_compacted"] for r in group)
            / max(1e-9, statistics.mean(r["log_ppl_full"] for r in group)),
            "kl": statistics.mean(r["kl"] for r in group),
        }
        if engine == "vllm_score":
            cell["vllm_score"] = _total([r["vllm_score"] for r in group])
        kept = [r for r in group if full_right.get((task, r["seed"]))]
        if kept:
            cell["retention"] = sum(r[engine] == 1 for r in kept) / len(kept)
            split = _margin_split(kept, margins, task, engine)
            if split:
                cell["retention_by_margin"] = split
            own = [r["margin"] for r in kept if r.get("margin") is not None]
            if own:
                cell["margin_median"] = statistics.median(own)
        if any("cut_short" in r for r in group):
            cell["cut_short"] = sum(
                bool(r.get("vllm_cut_short", r.get("cut_short"))) for r in group
            )
        by: dict[str, list] = defaultdict(list)
        for r in group:
            for key, value in r.get("details", {}).items():
                if isinstance(value, (str, int)):
                    by[f"{key}={value}"].append(r[engine])
        if by:
            cell["by"] = {k: _total(v) for k, v in sorted(by.items())}
        out[task].setdefault(method, {})[str(ratio)] = cell
    return dict(out)


def _fraction(score: str) -> float:
    hits, n = score.split("/")
    return float(hits) / float(n)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    tasks = result["tasks"]
    # the legend goes under the plots (with many methods it would hide the curves): one column
    # per task's width, and the figure grows by its height
    legend_cols = max(1, len(tasks))
    # a method string with options is longer than a column: break it after its commas
    labels = {
        m: "\n".join(textwrap.wrap(m.replace(",", ", "), 60)) for m in result["methods"]
    }
    lines = sum(label.count("\n") + 1 for label in labels.values())
    legend_rows = -(-(lines + 2) // legend_cols)
    legend_h = 0.14 * legend_rows + 0.15
    fig, axes = plt.subplots(
        2, len(tasks), figsize=(5 * len(tasks), 7.5 + legend_h), squeeze=False
    )
    near_10 = min(result["ratios"], key=lambda r: abs(r - 0.1))
    # the default cycle repeats after 10 colours: a combined table has more methods than that
    palette = (
        plt.cm.tab10.colors if len(result["methods"]) <= 10 else plt.cm.tab20.colors
    )
    palette = [palette[i % len(palette)] for i in range(len(result["methods"]))]
    for col, task in enumerate(tasks):
        summary = result["summary"][task]
        top, bottom = axes[0][col], axes[1][col]
        # a task that scores nothing (free-form answers) is drawn by its reconstruction instead
        scored = summary["full-context"] is not None
        ylabel = "score" if scored else "log-ppl ratio (compacted / full)"

        def value(cell: dict) -> float:
            if not scored:
                return cell["log_ppl_ratio"]
            return _fraction(cell.get("vllm_score") or cell["score"])

        for method, color in zip(result["methods"], palette):
            per_ratio = summary.get(method)
            if per_ratio is None:  # joined runs: a method measured on some tasks only
                continue
            xs = sorted(float(r) for r in per_ratio)
            top.plot(
                xs,
                [value(per_ratio[str(x)]) for x in xs],
                marker="o",
                color=color,
                label=labels[method],
            )
            if str(near_10) in per_ratio:
                at = per_ratio[str(near_10)]
                bottom.scatter(
                    [at["compaction_s"]], [value(at)], color=color, label=labels[method]
                )
        references = (
            (("full-context", "--"), ("no-context", ":"))
            if scored
            else (("full-context", "--"),)
        )
        for name, style in references:
            # the full cache's own ratio is 1
            served = summary.get(f"vllm:{name}") or summary[name]
            level = _fraction(served) if scored else 1.0
            top.axhline(level, color="k", linestyle=style, label=name)
            bottom.axhline(level, color="k", linestyle=style)
        log_scale(top)
        top.set_xlabel("compaction ratio (slots / context tokens)")
        top.set_ylabel(ylabel)
        # the instances this task has: a stopped run or part has fewer than it planned
        instances = sum(
            b["task"] == task and b["method"] == "full-context"
            for b in result["baselines"]
        )
        top.set_title(f"{task} ({instances} x {result['tokens']} tokens)")
        log_scale(bottom)
        bottom.set_xlabel(f"compaction time at ratio {near_10} (s)")
        bottom.set_ylabel(ylabel)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=legend_cols, fontsize=7)
    fig.suptitle(result["model"])
    fig.tight_layout(rect=(0, legend_h / (7.5 + legend_h), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser(**defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="niah")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--methods",
        default="am-highest-attn-fast,kvzip,am-highest-attn-fast:budgets=uniform",
    )
    p.add_argument("--ratios", default="0.1,0.05,0.02")
    p.add_argument("--instances", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=12,
        help="answer length of the scored tasks (essay-questions answers at length: 96)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI size: 2 instances of 600 tokens, ratio 0.2",
    )
    p.add_argument(
        "--vllm",
        action="store_true",
        help="answer every prompt through a vLLM engine with the plugin too (scored and plotted)",
    )
    p.add_argument(
        "--summarize",
        action="store_true",
        help="also answer from the model's summary of each context, exact and compacted by "
        "each method at each ratio (rows summarize, summarize+<method>; reference decoder)",
    )
    p.add_argument("--summary-tokens", type=int, default=256)
    p.add_argument("--out", default=str(RESULTS / "quality.json"))
    p.add_argument(
        "--combine",
        nargs="+",
        metavar="RESULT.json",
        help="run nothing: merge these results (other methods or ratios on the same instances, "
        "or other tasks: a sweep split by task) into "
        "--out and plot",
    )
    p.add_argument(
        "--first",
        type=int,
        metavar="N",
        help="with --combine: merge each result's first N instances only",
    )
    p.add_argument(
        "--label",
        action="append",
        metavar="METHOD=NAME",
        help="with --combine: call METHOD NAME in the merged result (repeatable)",
    )
    p.add_argument(
        "--add-margins",
        action="store_true",
        help="run no method: record the full context's margin on each right answer of the "
        "result at --out that has none (a result from before margins), and summarize it again",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the instances already completed in --out (same settings) and run the rest",
    )
    p.set_defaults(**defaults)
    return p


def parse_label(text: str) -> tuple[str, str]:
    """``"METHOD=NAME"`` -> ``(METHOD, NAME)``, split at the last ``=`` (a method spec has its
    own); SweepError for anything else."""
    method, eq, name = text.rpartition("=")
    if not eq or not method.strip() or not name.strip():
        raise SweepError(f"--label takes METHOD=NAME, got {text!r}")
    return method.strip(), name.strip()


def load_result(path: str | Path) -> dict:
    """A saved result, or SweepError with a sentence when it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SweepError(f"cannot read {path}: {exc}") from None


def main(argv: list[str] | None = None, **defaults) -> dict:
    args = parser(**defaults).parse_args(argv)
    if args.quick:
        args.instances, args.tokens, args.ratios = 2, 600, "0.2"
    logging.basicConfig(level=logging.WARNING)
    try:
        if (args.first is not None or args.label) and not args.combine:
            raise SweepError(
                "--first and --label go with --combine (they pick the instances to merge "
                "and name the methods merged)"
            )
        if args.add_margins and (args.combine or args.resume):
            raise SweepError(
                "--add-margins works on the result at --out alone: drop --combine and --resume"
            )
        if args.add_margins:
            if not Path(args.out).exists():
                raise SweepError(f"--add-margins: there is no result at {args.out}")
            result = add_margins(
                load_result(args.out),
                args.max_new_tokens,
                on_instance=lambda partial: save_result(partial, args.out),
            )
        elif args.combine:
            labels = dict(parse_label(text) for text in args.label or ())
            result = combine(
                [load_result(f) for f in args.combine],
                instances=args.first,
                labels=labels,
            )
        else:
            previous = (
                load_result(args.out)
                if args.resume and Path(args.out).exists()
                else None
            )
            result = run(
                args,
                on_instance=lambda partial: save_result(partial, args.out),
                previous=previous,
            )
    except SweepError as exc:
        raise SystemExit(f"benchmarks.quality: {exc}") from None
    out = save_result(result, args.out, plot)
    logger.warning("wrote %s: %s", out, json.dumps(result["summary"], indent=1))
    return result


if __name__ == "__main__":
    main()
