"""The attention runtime is exact: prefixes, logical positions, segments, sliding windows."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.models.runtime import PrefixLayer


def _stock_logits(adapter, ids):
    """Logits of the unmodified model (SDPA, no runtime)."""
    with torch.inference_mode():
        return adapter.model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3"])
def test_prefix_then_continuation_equals_full_forward(fixture, request):
    adapter = request.getfixturevalue(fixture)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    full = _stock_logits(adapter, ids)
    kv = adapter.prefill(ids[:30])
    cont = adapter.forward(ids[30:], torch.arange(30, 40), prefix=kv.exact_prefix(), logits_to_keep=10)
    torch.testing.assert_close(cont.logits, full[30:], atol=1e-4, rtol=1e-4)


def test_segments_are_independent(tiny_llama):
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    a, b = [5, 6, 7, 8], [9, 10, 11]
    kv = tiny_llama.prefill(ids)
    packed = tiny_llama.forward(a + b, torch.tensor([30, 31, 32, 33, 30, 31, 32]), prefix=kv.exact_prefix(),
                                segments=torch.tensor([0, 0, 0, 0, 1, 1, 1]), logits_to_keep=7).logits
    alone_b = tiny_llama.forward(b, torch.arange(30, 33), prefix=kv.exact_prefix(), logits_to_keep=3).logits
    torch.testing.assert_close(packed[4:], alone_b, atol=1e-5, rtol=1e-5)


def test_minus_inf_padding_and_zero_bias_are_neutral(tiny_llama):
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    kv = tiny_llama.prefill(ids)
    padded = []
    for layer in kv.exact_prefix():
        h, t, d = layer.keys.shape
        pad = lambda x, v: torch.cat([x, torch.full((h, 5, *x.shape[2:]), v, dtype=x.dtype)], 1)
        padded.append(PrefixLayer(pad(layer.keys, 3.0), pad(layer.values, 7.0),
                                  pad(layer.bias, float("-inf")), pad(layer.positions, -1)))
    a = tiny_llama.forward([1, 2], torch.tensor([20, 21]), prefix=kv.exact_prefix(), logits_to_keep=2).logits
    b = tiny_llama.forward([1, 2], torch.tensor([20, 21]), prefix=padded, logits_to_keep=2).logits
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_greedy_generation_matches_stock_model(tiny_llama):
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    kv = tiny_llama.prefill(ids[:5])
    new, _ = tiny_llama.generate(kv.exact_prefix(), 5, ids[5:], max_new_tokens=6, stop_ids=[])
    seq = list(ids)
    for _ in range(6):
        seq.append(int(_stock_logits(tiny_llama, seq)[-1].argmax()))
    assert new == seq[len(ids):]
