"""Request validation, message normalisation, settings and the serve launcher's arguments."""

from __future__ import annotations

import json
import os

import pytest
import torch
from pydantic import ValidationError

from vllm_compaction.queries import QUERY_SOURCES as REGISTRY
from vllm_compaction.service.config import ServiceConfig
from vllm_compaction.service.protocol import (
    QUERY_SOURCES,
    CompactRequest,
    normalize_messages,
)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"model": "m", "ratio": 0.5}, "one of messages, prompt or conversation_id"),
        ({"model": "m", "prompt": "x"}, "exactly one of ratio"),
        (
            {"model": "m", "prompt": "x", "ratio": 0.5, "target_tokens": 4},
            "exactly one of ratio",
        ),
        ({"model": "m", "prompt": "x", "ratio": 0}, "greater than 0"),
        ({"model": "m", "prompt": "x", "ratio": 1.5}, "less than or equal to 1"),
        (
            {"model": "m", "prompt": "x", "ratio": 0.5, "method": "nope"},
            "unknown method",
        ),
        ({"model": "m", "prompt": "x", "ratio": 0.5, "queries": "nope"}, "queries"),
        (
            {
                "model": "m",
                "prompt": "x",
                "ratio": 0.5,
                "queries": "repeat-prefill+nope",
            },
            "joined by '+'",
        ),
        (
            {
                "model": "m",
                "prompt": "x",
                "ratio": 0.5,
                "queries": "repeat-prefill+repeat-prefill",
            },
            "each once",
        ),
        (
            {
                "model": "m",
                "prompt": "x",
                "ratio": 0.5,
                "queries": "repeat-prefill+repeat-prefill*2",
            },
            "each once",
        ),
        (
            {"model": "m", "prompt": "x", "ratio": 0.5, "queries": "surprise-quote*0"},
            "weight is an integer",
        ),
        (
            {"model": "m", "prompt": "x", "ratio": 0.5, "queries": "context-prefill*2"},
            "sources that run probes",
        ),
        (
            {
                "model": "m",
                "prompt": "x",
                "ratio": 0.5,
                "queries": "surprise-quote/0*4",
            },
            "spacing is a whole number",
        ),
        (
            {"model": "m", "prompt": "x", "ratio": 0.5, "queries": "repeat-prefill/80"},
            "sources that probe spans",
        ),
        (
            {
                "model": "m",
                "prompt": "x",
                "ratio": 0.5,
                "queries": "surprise-quote+surprise-quote/80",
            },
            "each once",
        ),
        (
            {"model": "m", "prompt": "x", "ratio": 0.5, "queries": "mix*2"},
            "sources that run probes",
        ),
        (
            {"model": "m", "prompt": "x", "ratio": 0.5, "queries": "mix/80"},
            "not to the alias 'mix'",
        ),
        (
            {
                "model": "m",
                "prompt": "x",
                "ratio": 0.5,
                "queries": "repeat-prefill/auto",
            },
            "sources that probe spans",
        ),
        (
            {
                "model": "m",
                "prompt": "x",
                "ratio": 0.5,
                "queries": "surprise-quote/autox",
            },
            "or 'auto'",
        ),
        ({"model": "m", "prompt": "x", "messages": [], "ratio": 0.5}, "not both"),
        (
            {"model": "m", "prompt": "x", "ratio": 0.5, "keep_last_tokens": -1},
            "greater than or equal to 0",
        ),
        ({"model": "m", "prompt": "x", "ratio": 0.5, "surprise": 1}, "Extra inputs"),
        ({"model": "m", "conversation_id": "a/b", "ratio": 0.5}, "pattern"),
        (
            {"model": "m", "prompt": "x", "ratio": 0.5, "min_layer_share": 1.5},
            "less than or equal to 1",
        ),
        (
            {
                "model": "m",
                "prompt": "x",
                "ratio": 0.5,
                "method": "snapkv",
                "min_layer_share": 0.3,
            },
            "global budgets",
        ),
    ],
)
def test_bad_compact_requests_say_why(body, fragment):
    with pytest.raises(ValidationError) as info:
        CompactRequest.model_validate(body)
    assert fragment in str(info.value)


def test_compact_request_defaults_and_query_names():
    req = CompactRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "target_tokens": 64,
            "queries": "mix",
        }
    )
    assert req.method == "am" and req.query_source() == "self-study+repeat-prefill"
    assert req.max_head_ratio is None and req.keep_last_tokens == 0
    mixed = req.model_copy(update={"queries": "repeat-prefill+surprise-quote"})
    assert mixed.query_source() == "repeat-prefill+surprise-quote"
    assert (
        req.model_copy(update={"queries": "mix+repeat-prefill"}).query_source()
        == "self-study+repeat-prefill"
    )
    # the pipeline parses a weight and a spacing, compact() resolves '/auto' by the ratio, and
    # the probes for the numbers the spans miss take both
    for queries in (
        "repeat-prefill+surprise-quote*4",
        "repeat-prefill+surprise-quote/80*4",
        "repeat-prefill+surprise-quote/auto*4",
        "repeat-prefill+surprise-number-quote/auto*4",
        "repeat-prefill+surprise-number-quote/auto*4+surprise-name-quote/auto",
    ):
        request = {"model": "m", "prompt": "x", "ratio": 0.05, "queries": queries}
        assert CompactRequest.model_validate(request).query_source() == queries


def test_normalize_messages():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert normalize_messages([{"role": "user", "content": parts, "name": "x"}]) == [
        {"role": "user", "content": "ab"}
    ]
    for bad, fragment in [
        ([], "non-empty"),
        ("hi", "non-empty"),
        ([{"content": "x"}], "messages[0]"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text"),
        ([{"role": "wizard", "content": "x"}], "messages[0]"),
    ]:
        with pytest.raises(
            ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")
        ):
            normalize_messages(bad)


def test_config_from_env_names_the_bad_variable():
    cfg = ServiceConfig.from_env(
        {
            "VLLM_COMPACTION_LOCAL_WORKERS": "2",
            "VLLM_COMPACTION_AUTO_COMPACT_THRESHOLD_TOKENS": "1000",
        },
        store="/s",
    )
    assert (
        cfg.local_workers == 2
        and cfg.auto_compact_threshold_tokens == 1000
        and str(cfg.store) == "/s"
    )
    with pytest.raises(
        ValueError, match="VLLM_COMPACTION_AUTO_COMPACT_RATIO .*--auto-compact-ratio"
    ):
        ServiceConfig.from_env({"VLLM_COMPACTION_AUTO_COMPACT_RATIO": "2"})
    with pytest.raises(ValueError, match="WORKER_TOKEN"):
        ServiceConfig.from_env({"VLLM_COMPACTION_WORKER_TOKEN": "short"})
    # automatic compactions are checked at start-up, not when the first one fails
    with pytest.raises(
        ValueError, match="--auto-compact-method.*unknown method 'nope'"
    ):
        ServiceConfig.from_env({"VLLM_COMPACTION_AUTO_COMPACT_METHOD": "nope"})
    with pytest.raises(ValueError, match="--auto-compact-queries.*joined by '\\+'"):
        ServiceConfig.from_env(
            {"VLLM_COMPACTION_AUTO_COMPACT_QUERIES": "repeat-prefill+nope"}
        )
    mixed = ServiceConfig.from_env(
        {"VLLM_COMPACTION_AUTO_COMPACT_QUERIES": "repeat-prefill+surprise-quote"}
    )
    assert mixed.auto_compact_queries == "repeat-prefill+surprise-quote"
    floor = ServiceConfig.from_env(
        {"VLLM_COMPACTION_AUTO_COMPACT_MIN_LAYER_SHARE": "0.3"}
    )
    assert floor.auto_compact_min_layer_share == 0.3
    with pytest.raises(
        ValueError,
        match="--auto-compact-min-layer-share.*global budgets only.*method 'h2o\\+'",
    ):
        ServiceConfig.from_env(
            {
                "VLLM_COMPACTION_AUTO_COMPACT_MIN_LAYER_SHARE": "0.3",
                "VLLM_COMPACTION_AUTO_COMPACT_METHOD": "h2o+",
            }
        )
    with pytest.raises(
        ValueError, match="--auto-compact-min-layer-share.*less than or equal to 1"
    ):
        ServiceConfig.from_env({"VLLM_COMPACTION_AUTO_COMPACT_MIN_LAYER_SHARE": "2"})


def test_serve_arguments(tmp_path):
    from vllm_compaction.models import resolve
    from vllm_compaction.vllm.serve import vllm_serve_argv

    env = {"VLLM_PLUGINS": "other"}
    args = vllm_serve_argv(
        [
            "smollm2-135m",
            "--port",
            "9",
            "--compaction-store",
            str(tmp_path),
            "--auto-compact-threshold-tokens",
            "800",
            "--dtype",
            "float32",
        ],
        env,
    )
    assert args[0] == str(resolve("smollm2-135m"))
    assert args[args.index("--served-model-name") + 1] == "smollm2-135m"
    assert "--enable-prefix-caching" in args and args[args.index("--port") + 1] == "9"
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "CompactionConnector"
    assert transfer["kv_connector_extra_config"]["store"] == str(tmp_path)
    assert env["VLLM_PLUGINS"] == "other,vllm_compaction,vllm_compaction_api"
    # the connector needs no extra core
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    # idle connections outlive a proxy's idle timeout and a busy loop; a user's value stays
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) >= 60
    mine = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "7"}
    vllm_serve_argv(["smollm2-135m"], mine)
    assert mine["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "7"
    assert env["VLLM_COMPACTION_AUTO_COMPACT_THRESHOLD_TOKENS"] == "800"
    assert not any(
        a.startswith("--compaction") or a.startswith("--auto-compact") for a in args
    )
    with pytest.raises(ValueError, match="model first"):
        vllm_serve_argv(["--port", "9"], {})
    with pytest.raises(ValueError, match="--auto-compact-ratio"):
        vllm_serve_argv(["smollm2-135m", "--auto-compact-ratio", "0"], {})
    for flags in (["-pp", "2"], ["--pipeline-parallel-size=4"]):
        with pytest.raises(ValueError, match="pipeline_parallel_size=[24] yet"):
            vllm_serve_argv(["smollm2-135m", *flags], {})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # one rank: vLLM binds it
    env = {}
    assert "-tp" in vllm_serve_argv(["smollm2-135m", "-tp", "2"], env)
    if torch.cuda.is_available():
        return  # GPU ranks bind no cores
    # two CPU ranks on one NUMA node: each gets half of the cores (vLLM would refuse them)
    ranks = [
        set(map(int, r.split(","))) for r in env["VLLM_CPU_OMP_THREADS_BIND"].split("|")
    ]
    cores = sorted(os.sched_getaffinity(0))
    assert len(ranks) == 2 and set().union(*ranks) <= set(cores)
    assert len(cores) < 2 or not ranks[0] & ranks[1]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # the user's own binding stays
    vllm_serve_argv(["smollm2-135m", "--tensor-parallel-size=2"], env)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_serve_cli_bad_flag_is_a_sentence(capsys):
    from vllm_compaction.cli import main

    assert main(["serve", "smollm2-135m", "--compaction-workers", "-1"]) == 2
    assert "--compaction-workers" in capsys.readouterr().err


def test_worker_cli_errors_are_sentences(capsys, monkeypatch):
    from vllm_compaction.cli import main

    monkeypatch.delenv("VLLM_COMPACTION_WORKER_TOKEN", raising=False)
    assert main(["worker", "--server", "http://127.0.0.1:1"]) == 2
    assert "no worker token" in capsys.readouterr().err
    assert (
        main(
            [
                "worker",
                "--server",
                "http://127.0.0.1:1",
                "--token",
                "t" * 20,
                "--connect-timeout",
                "1",
            ]
        )
        == 2
    )
    assert "no compaction server at http://127.0.0.1:1" in capsys.readouterr().err


def test_the_api_accepts_every_registered_source_but_the_library_only_ones():
    """The service checks source names without importing the query package: its list must name
    every registered source and nothing else but its aliases. Two sources are not offered through
    the API: ``mock-question`` (set by the SnapKV and PyramidKV recipes themselves) and
    ``random-vectors``."""
    library_only = {"random-vectors", "mock-question"}
    assert set(QUERY_SOURCES) - {"mix"} == set(REGISTRY) - library_only
