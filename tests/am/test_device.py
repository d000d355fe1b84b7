"""Device-correctness of the offline path, checked on a CPU.

Every tensor the offline path creates must be made on the device of its inputs (or, for host
bookkeeping, explicitly on the CPU). With ``torch.set_default_device("meta")`` a tensor created
without a device lands on "meta" and the first op that mixes it with the real CPU inputs fails,
so these runs find each spot that would break on a GPU, without one.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from vllm_compaction.am import compact_heads
from vllm_compaction.am.device import (
    CPU_CHUNK_RANGE,
    CPU_MEMORY_RANGE,
    CPU_RUNTIME_ROWS,
    device_limits,
    runtime_rows,
)
from vllm_compaction.recipes import RECIPES


@contextlib.contextmanager
def meta_default_device():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device("cpu")


@pytest.mark.parametrize("method", sorted(RECIPES))
def test_compact_heads_creates_nothing_off_the_input_device(method):
    gen = torch.Generator().manual_seed(0)
    keys, values = (
        torch.randn(3, 60, 16, generator=gen),
        torch.randn(3, 60, 16, generator=gen),
    )
    queries = torch.randn(3, 90, 16, generator=gen)
    weights = torch.rand(90, generator=gen) + 0.1
    with meta_default_device():
        heads = compact_heads(
            keys,
            values,
            queries,
            [6, 0, 60],
            method=RECIPES[method].math,
            query_weights=weights,
        )
    assert heads.keys.device.type == "cpu" and heads.cu_seqlens.device.type == "cpu"
    assert heads.head_budgets.tolist() == [6, 0, 60]


@pytest.fixture(scope="module")
def synthetic():
    from benchmarks.synthetic_model import TINY, synthetic_llama, synthetic_messages

    return synthetic_llama(TINY, layers=2, seed=0), synthetic_messages(240, seed=0)


@pytest.mark.parametrize(
    "method,options",
    [
        (
            "am-highest-attn-fast",
            dict(queries="repeat-prefill+surprise-quote/auto*4", min_layer_share=0.3),
        ),
        ("am-omp-fast", dict(queries="self-study+repeat-prefill")),
        (
            "am-highest-attn",
            dict(
                queries="context-prefill+random-vectors",
                chunk_tokens=100,
                keep_last_tokens=20,
            ),
        ),
        ("kvzip", {}),
        ("snapkv", {}),
        ("pyramidkv", {}),
        ("h2o+", dict(budgets="uniform")),
    ],
)
def test_compact_creates_nothing_off_the_model_device(
    synthetic, method, options, tmp_path
):
    adapter, messages = synthetic
    with meta_default_device():
        cache = compact(adapter, messages, ratio=0.2, method=method, **options)
        assert cache.paged_packing(16).num_blocks > 0
        cache.save(tmp_path / "cache.safetensors")
    assert all(layer.keys.device.type == "cpu" for layer in cache.layers)


def compact(*args, **kwargs):
    from vllm_compaction.pipeline import compact as run

    return run(*args, **kwargs)


def test_cpu_limits_come_from_the_cpu():
    limits = device_limits("cpu")
    assert CPU_CHUNK_RANGE[0] <= limits.chunk_bytes <= CPU_CHUNK_RANGE[1]
    assert CPU_MEMORY_RANGE[0] <= limits.memory_limit <= CPU_MEMORY_RANGE[1]
    assert limits.chunk_bytes_per_head(8) == limits.chunk_bytes  # per head on a CPU
    assert runtime_rows("cpu", 1 << 20) == CPU_RUNTIME_ROWS


def test_devices_are_checked_with_a_sentence(synthetic):
    from vllm_compaction.models import resolve_device

    assert resolve_device("auto").type == (
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    assert resolve_device(None) == resolve_device("auto")
    for bad, match in (
        ("tpu", "unknown device|not supported"),
        ("meta", "not supported"),
        ("cuda:99", "visible"),
    ):
        with pytest.raises(ValueError, match=match):
            resolve_device(bad)
    adapter, messages = synthetic
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            compact(adapter, messages, ratio=0.2, device="cuda")
    with pytest.raises(ValueError, match="weights are on cpu"):
        compact(
            adapter,
            messages,
            ratio=0.2,
            device="cuda:99" if torch.cuda.is_available() else "cpu:1",
        )


def test_cli_refuses_a_missing_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from vllm_compaction.cli import main

    text = tmp_path / "in.txt"
    text.write_text("some words to compact")
    code = main(
        [
            "compact",
            "--input",
            str(text),
            "--ratio",
            "0.5",
            "--device",
            "cuda",
            "--out",
            str(tmp_path / "out.safetensors"),
            "--quiet",
        ]
    )
    assert code == 2
    assert "no CUDA GPU" in capsys.readouterr().err
