"""Reconstruction metrics: exact identities on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.eval.reconstruction import reconstruction
from vllm_compaction.pipeline import compact_prefix
from vllm_compaction.reference import ReferenceDecoder

IDS = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(1)).tolist()
MASK = torch.zeros(60, dtype=torch.bool)
MASK[5:55] = True


def test_full_budget_reconstructs_exactly_and_a_small_one_does_not(tiny_llama):
    decoder = ReferenceDecoder(tiny_llama)
    full = tiny_llama.prefill(IDS, capture_queries=False)
    cont, answer = [3, 4, 5], [9, 10, 11, 12]
    same = reconstruction(decoder, full, full, cont, answer)
    assert (
        same.kl == pytest.approx(0.0, abs=1e-9)
        and same.log_ppl_full == same.log_ppl_compacted > 0
    )
    exact = compact_prefix(
        tiny_llama,
        IDS,
        MASK,
        ratio=1.0,
        method="am-highest-attn",
        queries="context-prefill",
        budgets="uniform",
        on_policy=False,
    )
    assert reconstruction(decoder, full, exact, cont, answer).kl < 1e-5
    small = compact_prefix(
        tiny_llama, IDS, MASK, ratio=0.1, method="truncate", queries="context-prefill"
    )
    lossy = reconstruction(decoder, full, small, cont, answer)
    assert lossy.kl > 1e-4 and lossy.answer_tokens == 4
    with pytest.raises(ValueError, match="empty"):
        reconstruction(decoder, full, full, cont, [])
