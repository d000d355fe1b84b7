"""The attention runtime is exact: prefixes, logical positions, segments, sliding windows; its
attention and prefix scores equal the float reference ``attention_output_and_mass``."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.am import attention_output_and_mass
from vllm_compaction.models.runtime import (
    AttentionRun,
    PrefixLayer,
    _attend,
    _score_prefix,
)


def _stock_logits(adapter, ids):
    """Logits of the unmodified model (SDPA, no runtime)."""
    with torch.inference_mode():
        return adapter.model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3"])
def test_prefix_then_continuation_equals_full_forward(fixture, request):
    adapter = request.getfixturevalue(fixture)
    ids = torch.randint(
        0, 128, (40,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    full = _stock_logits(adapter, ids)
    kv = adapter.prefill(ids[:30])
    cont = adapter.forward(
        ids[30:], torch.arange(30, 40), prefix=kv.exact_prefix(), logits_to_keep=10
    )
    torch.testing.assert_close(cont.logits, full[30:], atol=1e-4, rtol=1e-4)


def test_segments_are_independent(tiny_llama):
    ids = torch.randint(
        0, 128, (30,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    a, b = [5, 6, 7, 8], [9, 10, 11]
    kv = tiny_llama.prefill(ids)
    packed = tiny_llama.forward(
        a + b,
        torch.tensor([30, 31, 32, 33, 30, 31, 32]),
        prefix=kv.exact_prefix(),
        segments=torch.tensor([0, 0, 0, 0, 1, 1, 1]),
        logits_to_keep=7,
    ).logits
    alone_b = tiny_llama.forward(
        b, torch.arange(30, 33), prefix=kv.exact_prefix(), logits_to_keep=3
    ).logits
    torch.testing.assert_close(packed[4:], alone_b, atol=1e-5, rtol=1e-5)


def test_minus_inf_padding_and_zero_bias_are_neutral(tiny_llama):
    ids = torch.randint(
        0, 128, (20,), generator=torch.Generator().manual_seed(3)
    ).tolist()
    kv = tiny_llama.prefill(ids)
    padded = []
    for layer in kv.exact_prefix():
        h, t, d = layer.keys.shape
        pad = lambda x, v: torch.cat(
            [x, torch.full((h, 5, *x.shape[2:]), v, dtype=x.dtype)], 1
        )
        padded.append(
            PrefixLayer(
                pad(layer.keys, 3.0),
                pad(layer.values, 7.0),
                pad(layer.bias, float("-inf")),
                pad(layer.positions, -1),
            )
        )
    a = tiny_llama.forward(
        [1, 2], torch.tensor([20, 21]), prefix=kv.exact_prefix(), logits_to_keep=2
    ).logits
    b = tiny_llama.forward(
        [1, 2], torch.tensor([20, 21]), prefix=padded, logits_to_keep=2
    ).logits
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_greedy_generation_matches_stock_model(tiny_llama):
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    kv = tiny_llama.prefill(ids[:5])
    new, _ = tiny_llama.generate(
        kv.exact_prefix(), 5, ids[5:], max_new_tokens=6, stop_ids=[]
    )
    seq = list(ids)
    for _ in range(6):
        seq.append(int(_stock_logits(tiny_llama, seq)[-1].argmax()))
    assert new == seq[len(ids) :]


def _random_run(
    seed: int, *, length: int = 7, kv_heads: int = 2, group: int = 3, dim: int = 8
):
    """Queries ``[H, G, L, d]`` and keys/values of a run at positions 20..20+L-1 after a compacted
    prefix of uneven heads (lengths 5 and 2 of 5 slots, ``-inf`` padding) with random betas."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    bias = 2.0 * rand(kv_heads, 5)
    bias[1, 2:] = float("-inf")
    positions = torch.tensor([[0, 3, 9, 14, 19], [2, 17, -1, -1, -1]])
    prefix = PrefixLayer(
        rand(kv_heads, 5, dim), rand(kv_heads, 5, dim), bias, positions
    )
    run = AttentionRun(
        positions=torch.arange(20, 20 + length),
        segments=torch.zeros(length, dtype=torch.int64),
        prefix=[prefix],
    )
    return (
        rand(kv_heads, group, length, dim),
        rand(kv_heads, length, dim),
        rand(kv_heads, length, dim),
        prefix,
        run,
    )


def _reference_rows(q, keys, values, prefix, run, scale, window):
    """Per run token: ``attention_output_and_mass`` (float64) over the prefix slots in its window
    and the run keys up to itself; returns outputs ``[H, G, L, d]``, log mass ``[H, G, L]`` and
    the prefix slots' biased logits ``[H, G, L, P]``."""
    h, g, length, d = q.shape
    out = torch.zeros(h, g, length, d, dtype=torch.float64)
    log_mass = torch.zeros(h, g, length, dtype=torch.float64)
    prefix_logits = torch.zeros(h, g, length, prefix.keys.shape[1], dtype=torch.float64)
    for i in range(length):
        pos = int(run.positions[i])
        bias = prefix.bias.double()
        if window:
            bias = bias.masked_fill(pos - prefix.positions >= window, float("-inf"))
        own = torch.zeros(h, i + 1, dtype=torch.float64)
        if window:
            own = own.masked_fill(
                pos - run.positions[: i + 1] >= window, float("-inf")
            ).expand(h, -1)
        ref = attention_output_and_mass(
            q[:, :, i],
            torch.cat([prefix.keys, keys[:, : i + 1]], 1),
            torch.cat([prefix.values, values[:, : i + 1]], 1),
            scale=scale,
            beta=torch.cat([bias, own], 1),
            dtype=torch.float64,
        )
        out[:, :, i], log_mass[:, :, i] = ref.output, ref.log_mass
        prefix_logits[:, :, i] = (
            scale * q[:, :, i].double() @ prefix.keys.double().transpose(1, 2)
            + bias[:, None]
        )
    return out, log_mass, prefix_logits


@pytest.mark.parametrize("window", [None, 6])
def test_runtime_attention_and_prefix_scores_equal_the_float_reference(window):
    """The reference decoder's attention (SDPA over an additive mask) and KVzip's prefix scores
    against ``attention_output_and_mass``: compacted prefix with betas and uneven heads, GQA,
    causal run tokens, sliding windows over both."""
    q, keys, values, prefix, run = _random_run(0)
    scale = 0.4
    out, log_mass, prefix_logits = _reference_rows(
        q, keys, values, prefix, run, scale, window
    )
    got = _attend(
        q, prefix, keys, values, run.positions, run.segments, run, scale, window
    )
    torch.testing.assert_close(got.double(), out, rtol=1e-5, atol=1e-5)
    run.score_rows = torch.tensor([False, True, True, False, False, True, True])
    scores = _score_prefix(
        q, prefix, keys, run.positions, run.segments, run, scale, window
    )
    # [H, G, marked, P]
    weights = torch.exp(prefix_logits - log_mass[..., None])[:, :, run.score_rows]
    torch.testing.assert_close(
        scores.double(), weights.amax(dim=(1, 2)), rtol=1e-5, atol=1e-6
    )
