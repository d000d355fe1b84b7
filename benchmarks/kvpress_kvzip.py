"""kvpress's own KVzip on the conversation families, beside ours: a reference point for our port.

    make kvpress-venv
    .venv-kvpress/bin/python -m benchmarks.kvpress_kvzip --tasks chat-facts,chat-multikey,exact-copy,agent-trace \
        --instances 12 --ratios 0.1,0.05,0.02 --out benchmarks/results/conversations_kvpress_kvzip_12.json

kvpress (NVIDIA's library of KV-cache presses for transformers) pins ``transformers<5.3`` while
vLLM 0.32 needs 5.16 or later, so it runs from a venv of its own (``make kvpress-venv``) that
layers kvpress and its transformers over the project venv's torch. The instances, prompts
(hashed as ``benchmarks.quality`` hashes them) and scoring are the project's; the model is run
by transformers with kvpress's ``KVzipPress`` as kvpress's pipeline runs it: the whole prefix
is prefilled under the press (its context reconstruction scores every KV pair, its eviction
masks the lowest-scored ones across all layers and heads), then the question and answer
prefix are decoded greedily at the positions after the full prefix.

Budget: our methods keep ``ratio`` of the content tokens per KV head and every chat-template
token exact; kvpress's ``compression_ratio`` removes a fraction of the whole prefix. It is set
so that the same number of KV pairs is kept in all: ``1 - (ratio * content + template) / T``.

Each row carries the answer, its score, the compaction time and the reconstruction metrics of
``vllm_compaction.eval.reconstruction`` (the full context's greedy answer scored under both
caches), so ``python -m benchmarks.quality --combine`` merges it with a run of ours over the same
instances (the full-context answers must agree, which checks that both run the same model).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.output import save_result

logger = logging.getLogger("benchmarks.kvpress_kvzip")

METHOD = "kvpress-kvzip"


class SetupError(RuntimeError):
    """kvpress or a transformers it supports is missing: a sentence that says how to get them."""


def _kvpress():
    try:
        import kvpress
        import transformers
    except ImportError as exc:
        raise SetupError(
            f"kvpress is not importable ({exc}); run `make kvpress-venv` and use "
            ".venv-kvpress/bin/python"
        ) from None
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) >= (5, 3):
        raise SetupError(
            f"kvpress needs transformers<5.3, this interpreter has {transformers.__version__}: "
            "use .venv-kvpress/bin/python (`make kvpress-venv`)"
        )
    return kvpress


class KvpressModel:
    """SmolLM2 in transformers, greedy decoding after a (pressed) prefill, as kvpress's pipeline
    decodes: question tokens at the positions after the whole prefix."""

    def __init__(self, path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        # kvpress's attention patch masks evicted keys inside the sdpa attention function
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        eos = self.model.generation_config.eos_token_id
        self.stop = set(eos if isinstance(eos, list) else [eos])

    def prefill(self, prefix_ids: list[int], press=None):
        from transformers import DynamicCache

        cache = DynamicCache()
        ids = self.torch.tensor([prefix_ids])
        with press(self.model) if press is not None else contextlib.nullcontext():
            self.model.model(input_ids=ids, past_key_values=cache)
        return cache

    def _logits(self, cache, ids: list[int], start: int):
        position = self.torch.arange(start, start + len(ids))[None]
        out = self.model(
            input_ids=self.torch.tensor([ids]),
            past_key_values=cache,
            position_ids=position,
        )
        return out.logits[0]

    def generate(
        self, cache, context_length: int, continuation: list[int], tokens: int
    ) -> list[int]:
        """Greedy answer ids; the cache is cut back to the prefix afterwards."""
        kept = cache.get_seq_length()
        logits = self._logits(cache, continuation, context_length)
        answer = [int(logits[-1].argmax())]
        position = context_length + len(continuation)
        while len(answer) < tokens and answer[-1] not in self.stop:
            logits = self._logits(cache, answer[-1:], position)
            position += 1
            answer.append(int(logits[-1].argmax()))
        cache.crop(kept)
        return answer

    def answer_logits(
        self, cache, context_length: int, continuation: list[int], answer: list[int]
    ):
        """Logits predicting each answer token after the continuation (teacher-forced)."""
        kept = cache.get_seq_length()
        ids = list(continuation) + list(answer)
        logits = self._logits(cache, ids, context_length)
        cache.crop(kept)
        return logits[len(continuation) - 1 : len(ids) - 1]


def _metrics(full_logits, comp_logits, answer: list[int]) -> dict[str, float]:
    from vllm_compaction.eval.reconstruction import reconstruction_from_logits

    recon = reconstruction_from_logits(full_logits, comp_logits, answer)
    return dict(
        log_ppl_full=recon.log_ppl_full,
        log_ppl_compacted=recon.log_ppl_compacted,
        kl=recon.kl,
    )


def removed_fraction(prefix_tokens: int, content_tokens: int, ratio: float) -> float:
    """kvpress's ``compression_ratio`` that keeps as many KV pairs as our methods at ``ratio``."""
    if not 0 < ratio <= 1:
        raise ValueError(f"ratios must be in (0, 1], got {ratio}")
    kept = round(ratio * content_tokens) + (prefix_tokens - content_tokens)
    return max(0.0, 1.0 - kept / prefix_tokens)


def kept_instances(
    previous: dict, args: argparse.Namespace, ratios: list[float]
) -> dict[tuple[str, int], dict]:
    """``--resume``: the instances of an earlier (possibly partial) result of this script made
    with the same model, length and ratios (``benchmarks.quality.kept_instances``)."""
    from benchmarks.quality import kept_instances as kept

    wanted = dict(model=args.model, tokens=args.tokens, ratios=ratios, methods=[METHOD])
    seeds = range(args.seed, args.seed + args.instances)
    return kept(previous, wanted, args.tasks.split(","), seeds, len(ratios))


def run(args: argparse.Namespace, previous: dict | None = None) -> dict:
    kvpress = _kvpress()
    from benchmarks.quality import _about, instance_prompt
    from vllm_compaction.models import load_adapter, resolve

    ratios = [float(r) for r in args.ratios.split(",")]
    for ratio in ratios:
        removed_fraction(2, 1, ratio)  # refuses a bad ratio before the model loads
    tasks = args.tasks.split(",")
    adapter = load_adapter(args.model)  # the project's prompts and tokenizer
    model = KvpressModel(resolve(args.model))
    rows: list[dict] = []
    baselines: list[dict] = []
    seeds = range(args.seed, args.seed + args.instances)
    done = kept_instances(previous, args, ratios) if previous is not None else {}
    for kept in done.values():
        baselines += kept["baselines"]
        rows += kept["rows"]
    bar = tqdm(
        total=len(tasks) * len(seeds) - len(done), desc="kvpress-kvzip", unit="instance"
    )
    for task in tasks:
        for seed in seeds:
            inst, prompt, digest = instance_prompt(adapter, task, args.tokens, seed)
            if (task, seed) in done:
                if done[(task, seed)]["prompt"] != digest:
                    raise ValueError(
                        f"cannot resume: {task} seed {seed} has another prompt now "
                        f"({digest}) than in the earlier result"
                    )
                continue
            tokens = inst.answer_tokens or args.max_new_tokens
            prefix, cont = prompt.prefix_ids, prompt.continuation_ids
            content = int(prompt.compact_mask.sum())
            full_cache = model.prefill(prefix)
            full_answer = model.generate(full_cache, len(prefix), cont, tokens)
            full_logits = model.answer_logits(
                full_cache, len(prefix), cont, full_answer
            )
            template_only = [
                t for t, m in zip(prefix, prompt.compact_mask.tolist()) if not m
            ]
            none_answer = model.generate(
                model.prefill(template_only), len(template_only), cont, tokens
            )
            for name, ids, length in (
                ("full-context", full_answer, len(prefix)),
                ("no-context", none_answer, len(template_only)),
            ):
                text = adapter.tokenizer.decode(ids, skip_special_tokens=True)
                baselines.append(
                    dict(
                        task=task, seed=seed, method=name, answer=text,
                        score=inst.score(text), prompt=digest, prefix_tokens=length,
                        **_about(inst, text),
                    )
                )  # fmt: skip
            for ratio in ratios:
                removed = removed_fraction(len(prefix), content, ratio)
                press = kvpress.KVzipPress(compression_ratio=removed)
                start = time.perf_counter()
                cache = model.prefill(prefix, press)
                seconds = time.perf_counter() - start
                ids = model.generate(cache, len(prefix), cont, tokens)
                comp_logits = model.answer_logits(cache, len(prefix), cont, full_answer)
                text = adapter.tokenizer.decode(ids, skip_special_tokens=True)
                rows.append(
                    dict(
                        task=task, seed=seed, ratio=ratio, prompt=digest, method=METHOD,
                        answer=text, score=inst.score(text), compaction_s=seconds,
                        compression_ratio=removed,
                        **_metrics(full_logits, comp_logits, full_answer),
                        **_about(inst, text),
                    )
                )  # fmt: skip
            bar.update(1)
            if args.out:
                save_result(
                    {**_result(args, tasks, ratios, rows, baselines), "partial": True},
                    args.out,
                )
    bar.close()
    return _result(args, tasks, ratios, rows, baselines)


def _result(args, tasks, ratios, rows, baselines) -> dict:
    from importlib.metadata import version

    from benchmarks.quality import summarize

    return dict(
        model=args.model,
        tokens=args.tokens,
        instances=args.instances,
        seed=args.seed,
        tasks=tasks,
        ratios=ratios,
        methods=[METHOD],
        answered_by=f"kvpress {version('kvpress')} (transformers {version('transformers')})",
        summary=summarize(rows, baselines),
        baselines=baselines,
        rows=rows,
        created=time.time(),
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tasks", default="chat-facts,chat-multikey,exact-copy,agent-trace")
    p.add_argument("--instances", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--ratios", default="0.1,0.05,0.02")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the instances already completed in --out (same settings) and run the rest",
    )
    p.add_argument(
        "--out",
        default=str(
            Path(__file__).resolve().parent
            / "results"
            / "conversations_kvpress_kvzip_12.json"
        ),
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.WARNING)
    args = parser().parse_args(argv)
    import torch

    try:
        from benchmarks.quality import load_result

        previous = (
            load_result(args.out) if args.resume and Path(args.out).exists() else None
        )
        with torch.inference_mode():
            result = run(args, previous)
    except (SetupError, ValueError) as exc:
        raise SystemExit(f"kvpress_kvzip: {exc}") from None
    from benchmarks.quality import plot

    save_result(result, args.out, plot)
    return result


if __name__ == "__main__":
    main()
