"""What must hold on a CUDA GPU (``pytest -m cuda``; skipped with a reason elsewhere).

The offline path runs every stage on the device and agrees with the CPU; the Triton kernels'
cases pass compiled. Nothing here needs vLLM or model weights (the GPU machines have neither):
models are random-weight Llamas built on the device (``benchmarks.synthetic_model``).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kernels.test_kernel_cases import CASES, case_ids, run_cases

pytestmark = pytest.mark.cuda


def test_kernel_cases_compiled():
    """Every kernel's cases, compiled, in shards side by side: each compile is CPU-bound, and
    one file's cases in one process took most of the GPU check's two minutes of tests."""
    workers = max(len(CASES), os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        ids = dict(zip(CASES, pool.map(case_ids, CASES)))
        total = sum(map(len, ids.values()))
        shards = []
        for path, node_ids in ids.items():
            # each file gets shards in proportion to its cases
            size = math.ceil(
                len(node_ids) / max(1, round(workers * len(node_ids) / total))
            )
            shards += [
                (path, node_ids[i : i + size]) for i in range(0, len(node_ids), size)
            ]
        procs = list(
            pool.map(
                lambda shard: run_cases(shard[0], interpret=False, node_ids=shard[1]),
                shards,
            )
        )
    failed = {
        f"{path.stem}[{chunk[0].split('::')[-1]}...]": proc.stdout[-3000:]
        + proc.stderr[-1000:]
        for (path, chunk), proc in zip(shards, procs)
        if proc.returncode
    }
    assert not failed, failed


@pytest.mark.parametrize(
    "method", ["am-highest-attn", "am-omp-fast", "kvzip", "snapkv", "kvmerger"]
)
def test_compact_heads_on_cuda_agrees_with_the_cpu(method, monkeypatch):
    """The same caches as the CPU's, judged by held-out error. OMP ranks with fp16 features
    on the CPU and fp8 ones on CUDA: with fp16 on both it must agree; with CUDA's fp8 it may
    pick other keys, and must fit as well (within 5%)."""
    import vllm_compaction.am.attention as attention
    from vllm_compaction.am import attention_output_error, compact_heads
    from vllm_compaction.recipes import RECIPES

    math = RECIPES[method].math
    gen = torch.Generator().manual_seed(0)
    keys, values = (
        torch.randn(3, 300, 64, generator=gen),
        torch.randn(3, 300, 64, generator=gen),
    )
    queries = 2.0 * torch.randn(3, 500, 64, generator=gen)
    budgets = [30, 0, 300]  # a compacted, an empty and an exact head
    cpu = compact_heads(keys, values, queries[:, :400], budgets, method=math)
    err_cpu = attention_output_error(cpu, keys, values, queries[:, 400:]).output_rel
    fp8 = attention.feature_storage(torch.device("cuda"))[0] != torch.float16
    for storage in ("fp16", "auto") if fp8 and math.selector == "omp" else ("auto",):
        monkeypatch.setattr(attention, "FEATURE_STORAGE", storage)
        gpu = compact_heads(
            keys.cuda(), values.cuda(), queries[:, :400].cuda(), budgets, method=math
        )
        assert gpu.keys.is_cuda and gpu.cu_seqlens.is_cuda
        assert torch.equal(gpu.cu_seqlens.cpu(), cpu.cu_seqlens)
        err_gpu = attention_output_error(
            gpu.to(device="cpu"), keys, values, queries[:, 400:]
        ).output_rel
        if storage == "fp16" or not fp8:
            torch.testing.assert_close(err_gpu, err_cpu, atol=2e-3, rtol=2e-2)
        else:
            assert (err_gpu <= err_cpu * 1.05 + 2e-3).all(), (err_gpu, err_cpu)


def test_compact_runs_every_stage_on_the_device():
    """``compact()`` on the GPU gives a cache on the GPU as good as the CPU's. The budgets and
    the kept keys are not compared one for one: sampled queries and near-tied scores of a
    random-weight model may fall the other way under the GPU's rounding, so what must agree is
    the cache's quality, scored on the CPU against the full prefix (KL along a continuation)."""
    from benchmarks.synthetic_model import TINY, synthetic_llama, synthetic_messages
    from vllm_compaction.eval.reconstruction import reconstruction
    from vllm_compaction.pipeline import compact
    from vllm_compaction.reference import ReferenceDecoder

    messages = synthetic_messages(400, seed=0)
    results = {}
    for device in ("cpu", "cuda"):
        adapter = synthetic_llama(TINY, layers=2, device=device, seed=0)
        results[device] = compact(
            adapter,
            messages,
            ratio=0.2,
            method="am-highest-attn-fast",
            queries="repeat-prefill+surprise-quote/auto*4",
            min_layer_share=0.3,
        )
    cpu, gpu = results["cpu"], results["cuda"]
    assert all(layer.keys.is_cuda and layer.beta.is_cuda for layer in gpu.layers)
    assert (
        gpu.physical_slots == cpu.physical_slots
        and gpu.logical_length == cpu.logical_length
    )
    decoder = ReferenceDecoder(adapter := synthetic_llama(TINY, layers=2, seed=0))
    ids, _ = adapter.chat_content(messages)
    full = adapter.prefill(ids, capture_queries=False)
    continuation = adapter.tokenizer.encode(" ".join(f"w{i}" for i in range(7, 40)))
    answer = (
        ReferenceDecoder(adapter)
        .generate(full, continuation, max_new_tokens=16)
        .token_ids
    )
    kl = {
        name: reconstruction(
            decoder, full, cache.to(device="cpu"), continuation, answer
        ).kl
        for name, cache in results.items()
    }
    # on the CPU this cache scores KL 8e-7; keeping the first 20% of the tokens scores 5e-4
    assert kl["cuda"] <= 3 * kl["cpu"] + 1e-5, kl


def test_device_limits_follow_free_memory():
    from vllm_compaction.am.device import device_limits

    limits = device_limits("cuda")
    free, _ = torch.cuda.mem_get_info()
    assert 0 < limits.memory_limit <= free
    assert limits.chunk_bytes_per_head(8) >= 1 << 20


def test_random_keys_draw_on_the_device():
    from vllm_compaction.am import compact_heads
    from vllm_compaction.recipes import RECIPES

    keys = torch.randn(2, 100, 16, device="cuda")
    heads = compact_heads(
        keys, keys, keys[:, :10], [10, 20], method=RECIPES["random"].math
    )
    assert heads.indices.is_cuda and heads.head_budgets.tolist() == [10, 20]
    for h in range(2):  # distinct, sorted positions within a head
        idx = heads.head(h)[3]
        assert torch.equal(idx, idx.unique())
