"""Exactness and quality properties on the real default model (SmolLM2-135M-Instruct, fp32)."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.am import (
    attention_output_and_mass,
    attention_output_error,
    compact_heads,
)
from vllm_compaction.am.heads import CompactedHeads
from vllm_compaction.cache import CompactedCache
from vllm_compaction.corpus import haystack_text
from vllm_compaction.recipes import RECIPES
from vllm_compaction.reference import ReferenceDecoder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def essay_prefix(smollm2):
    text = haystack_text(500, smollm2.tokenizer, seed=3)
    ids, mask = smollm2.chat_content([{"role": "user", "content": text}])
    return ids, mask, smollm2.prefill(ids)


def test_model_facts(smollm2):
    assert (
        smollm2.num_layers,
        smollm2.num_q_heads,
        smollm2.num_kv_heads,
        smollm2.head_dim,
    ) == (30, 9, 3, 64)
    assert all(smollm2.compactable_layers)


def test_exact_cache_logits_equal_full_forward(smollm2, essay_prefix):
    ids, mask, kv = essay_prefix
    positions = torch.arange(len(ids))
    span = torch.nonzero(mask).flatten()
    cache = CompactedCache(
        layers=[
            CompactedHeads.exact(k, v, positions) for k, v in zip(kv.keys, kv.values)
        ],
        logical_length=len(ids),
        token_ids=list(ids),
        compacted_span=(int(span[0]), int(span[-1]) + 1),
        layer_compacted=[True] * 30,
        model=smollm2.fingerprint(),
        method="identity",
        ratio=1.0,
    )
    cont = smollm2.turn_ids([{"role": "user", "content": "What is this text about?"}])
    got = ReferenceDecoder(smollm2).logits(cache, cont)
    with torch.inference_mode():
        want = (
            smollm2.model(input_ids=torch.tensor([list(ids) + cont]))
            .logits[0, len(ids) :]
            .float()
        )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_full_budget_reproduces_outputs_and_mass(smollm2, essay_prefix):
    ids, mask, kv = essay_prefix
    layer = 12
    keys, values = kv.keys[layer][:, mask], kv.values[layer][:, mask]
    queries = kv.queries[layer]
    scale = smollm2.layer_scales()[layer]
    want = attention_output_and_mass(queries, keys, values, scale=scale)
    for method in ("am-highest-attn", "am-omp-fast"):
        heads = compact_heads(
            keys,
            values,
            queries,
            keys.shape[1],
            method=RECIPES[method].math,
            scale=scale,
        )
        ck, cbeta, cv, _ = heads.padded()
        got = attention_output_and_mass(queries, ck, cv, scale=scale, beta=cbeta)
        torch.testing.assert_close(got.output, want.output, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            got.log_mass.exp(), want.log_mass.exp(), atol=0, rtol=1e-5
        )


def test_am_beats_no_bias_direct_values_on_held_out_queries(smollm2, essay_prefix):
    ids, mask, kv = essay_prefix
    scales = smollm2.layer_scales()
    wins = total = 0
    for layer in (4, 12, 20, 27):
        keys, values = kv.keys[layer][:, mask], kv.values[layer][:, mask]
        queries = kv.queries[layer]
        perm = torch.randperm(
            queries.shape[1], generator=torch.Generator().manual_seed(layer)
        )
        fit, held = (
            queries[:, perm[: len(perm) * 4 // 5]],
            queries[:, perm[len(perm) * 4 // 5 :]],
        )
        t = max(1, round(0.05 * keys.shape[1]))
        am = compact_heads(
            keys,
            values,
            fit,
            t,
            method=RECIPES["am-highest-attn"].math,
            scale=scales[layer],
        )
        plain = compact_heads(
            keys,
            values,
            fit,
            t,
            method=RECIPES["am-highest-attn"].math,
            scale=scales[layer],
            beta="zero",
            values="direct",
        )
        e_am = attention_output_error(
            am, keys, values, held, scale=scales[layer]
        ).output_rel
        e_plain = attention_output_error(
            plain, keys, values, held, scale=scales[layer]
        ).output_rel
        wins += int((e_am < e_plain).sum())
        total += e_am.numel()
    assert wins > total / 2, f"AM won on {wins}/{total} heads"
