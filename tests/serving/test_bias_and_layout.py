"""The bias carrier, RoPE re-basing and the physical layout, against plain torch (no engine)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_compaction.am.heads import CompactedHeads
from vllm_compaction.models.rope import rope_inv_freq, rotate_keys
from vllm_compaction.vllm.bias import (
    MASKED_BETA,
    augment_kv,
    augment_query,
    augmented_head_size,
    decode_beta,
    encode_beta,
)

SUPPORTED = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]


def test_augmented_head_size_leaves_room_for_two_coordinates():
    assert augmented_head_size(64, SUPPORTED) == 80
    assert augmented_head_size(128, SUPPORTED) == 160
    assert augmented_head_size(78, SUPPORTED) == 80
    with pytest.raises(ValueError, match="head_size=512"):
        augmented_head_size(512, SUPPORTED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_beta_survives_the_cache_dtype(dtype):
    beta = torch.linspace(-7, 7, 1001)
    decoded = decode_beta(encode_beta(beta, dtype))
    one_coordinate = beta.to(dtype).float()
    assert (decoded - beta).abs().max() <= (
        one_coordinate - beta
    ).abs().max() / 64 + 1e-7


def _reference(q, k, v, beta, scale):
    """Causal attention of the last q rows with an additive per-key bias (float mask)."""
    n, t = q.shape[0], k.shape[0]
    mask = torch.full((n, t), float("-inf"))
    for i in range(n):
        mask[i, : t - n + i + 1] = 0
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    bias = beta.repeat_interleave(group, 1).T[:, None, :]  # [H, 1, t]
    scores = torch.einsum("nhd,thd->hnt", q.double(), kk.double()) * scale + mask + bias
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, -1), vv.double())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_cpu_kernel_adds_beta_and_masks_padding(dtype, tol):
    """Widened q/k/v through vLLM's own CPU ops give biased attention; masked slots weigh 0."""
    pytest.importorskip("vllm")
    from vllm_compaction.vllm import compat

    torch.manual_seed(0)
    t, n, hq, hkv, d, bs = 150, 5, 9, 3, 64, 128
    aug = augmented_head_size(d, SUPPORTED)
    scale = 1 / math.sqrt(d)
    q = torch.randn(n, hq, d)
    k, v = torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    beta = torch.zeros(t, hkv)
    beta[: t - n] = torch.randn(t - n, hkv) * 2
    beta[10:30, 1] = MASKED_BETA
    v[10:30, 1] = 1e4  # would dominate the output if a masked slot leaked
    isa = compat.cpu_attn_isa(dtype, bs, aug)
    cache = torch.zeros(3, hkv, bs, 2 * aug, dtype=dtype)
    key_cache, value_cache = cache.view(3, hkv, 2 * bs, aug).chunk(2, dim=2)
    key_aug, value_aug = augment_kv(k.to(dtype), v.to(dtype), aug, beta)
    # blocks 2 then 0
    slots = torch.cat([torch.arange(128) + 2 * bs, torch.arange(t - 128)])
    compat.cpu_attn_reshape_and_cache(
        key_aug, value_aug, key_cache, value_cache, slots, isa
    )
    qsl, seq = (
        torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([t], dtype=torch.int32),
    )
    meta = compat.cpu_attn_get_scheduler_metadata(
        num_reqs=1,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=aug,
        seq_lens=seq,
        dtype=dtype,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    out = torch.empty(n, hq, aug, dtype=dtype)
    compat.cpu_attention_with_kv_cache(
        query=augment_query(q.to(dtype), aug, scale),
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=qsl,
        seq_lens=seq,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=torch.tensor([[2, 0]], dtype=torch.int32),
        softcap=0.0,
        scheduler_metadata=meta,
        s_aux=None,
    )
    expected = _reference(q, k.to(dtype).float(), v.to(dtype).float(), beta, scale)
    assert torch.allclose(out[..., :d].double(), expected, atol=tol, rtol=tol)
    assert out[..., :d].abs().max() < 100  # nothing of the 1e4 values


def _hf_rope(x, positions, config):
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cos, sin = LlamaRotaryEmbedding(config)(x, positions[None])
    return apply_rotary_pos_emb(x[None], x[None], cos, sin)[0][0]


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    ],
)
def test_rotate_keys_matches_transformers_and_composes(rope):
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        rope_theta=10000.0,
        rope_scaling=rope,
    )
    torch.manual_seed(0)
    raw = torch.randn(1, 40, 64)  # [H, T, d]
    positions = torch.arange(1000, 1040)
    rotated = _hf_rope(raw, positions, config)
    assert torch.allclose(rotate_keys(raw, positions, config), rotated, atol=2e-4)
    # re-basing by -(T - P) equals computing the keys at the shifted positions
    assert torch.allclose(
        rotate_keys(rotated, -700, config),
        _hf_rope(raw, positions - 700, config),
        atol=2e-4,
    )


def test_rotate_keys_refuses_sequence_dependent_rope():
    from transformers import LlamaConfig

    config = LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic"):
        rope_inv_freq(config)


def test_physical_prefix_pads_heads_and_rebases_keys(tiny_llama):
    from vllm_compaction.cache import CompactedCache
    from vllm_compaction.vllm.layout import physical_prefix

    adapter = tiny_llama
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (30,)).tolist()
    prefix = adapter.prefill(ids, capture_queries=False)
    layers = []
    for l in range(adapter.num_layers):
        keep = [torch.tensor([0, 3, 7]), torch.arange(0, 30, 2)][: adapter.num_kv_heads]
        keep += [torch.arange(5)] * (adapter.num_kv_heads - len(keep))
        keys = torch.cat([prefix.keys[l][h, idx] for h, idx in enumerate(keep)])
        values = torch.cat([prefix.values[l][h, idx] for h, idx in enumerate(keep)])
        lengths = [len(idx) for idx in keep]
        beta = torch.linspace(-1, 1, sum(lengths))
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        layers.append(
            CompactedHeads(
                keys=keys,
                beta=beta,
                values=values,
                indices=torch.cat(keep),
                cu_seqlens=cu,
            )
        )
    cache = CompactedCache(
        layers=layers,
        logical_length=30,
        token_ids=ids,
        compacted_span=(0, 30),
        layer_compacted=[True] * adapter.num_layers,
        model=adapter.fingerprint(),
        method="test",
        ratio=0.5,
    )
    phys = physical_prefix(cache, adapter.model.config)
    assert phys.num_slots == 15 and phys.keys[0].shape == (
        15,
        adapter.num_kv_heads,
        adapter.head_dim,
    )
    beta0 = phys.beta[0]
    assert (beta0[3:, 0] == MASKED_BETA).all() and (beta0[:, 1] > MASKED_BETA).all()
    assert torch.allclose(beta0[:3, 0], layers[0].head(0)[1])
    assert phys.padding_fraction > 0
    # head 0's slots are its kept keys, re-based by -(T - P) = -15 positions
    expect = rotate_keys(prefix.keys[0][0, [0, 3, 7]], -15, adapter.model.config)
    assert torch.allclose(phys.keys[0][:3, 0], expect, atol=1e-5)
    assert (phys.values[0][3:, 0] == 0).all()


def test_hybrid_rope_is_per_layer_type(tiny_gemma3):
    """Gemma-3 rotates sliding layers with a local base and global ones with a global base."""
    config, rotary = tiny_gemma3.model.config, tiny_gemma3.model.model.rotary_emb
    for layer_type in ("sliding_attention", "full_attention"):
        inv_freq, d_rot = rope_inv_freq(config, layer_type)
        assert d_rot == 32
        assert torch.allclose(
            inv_freq.float(), getattr(rotary, f"{layer_type}_inv_freq").float()
        )
    with pytest.raises(ValueError, match="per layer type"):
        rope_inv_freq(config)


def test_hybrid_cache_keeps_the_window_and_lays_it_out_where_the_window_reads(
    tiny_gemma3,
):
    """A sliding layer (window 8) keeps the prefix's last 7 keys, exact and in order: the
    reference decoder still equals the model; the padded layout right-aligns them at P - 1,
    re-based with the local RoPE; a cache whose sliding rows are not the last keys is refused."""
    import dataclasses

    from vllm_compaction.pipeline import compact_prefix
    from vllm_compaction.reference import ReferenceDecoder
    from vllm_compaction.vllm.layout import check_sliding_layers, physical_prefix

    adapter = tiny_gemma3
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (30,)).tolist()
    mask = torch.ones(30, dtype=torch.bool)
    full = compact_prefix(
        adapter,
        ids,
        mask,
        ratio=1.0,
        method="truncate",
        queries="context-prefill",
        budgets="uniform",
    )
    assert full.head_lengths[:, 0].tolist() == [7, 7, 30, 7]
    assert full.layers[0].indices.tolist() == list(range(23, 30))
    cont = [5, 9, 17, 3, 44, 2, 8, 8, 1, 60, 61]  # longer than the window
    with torch.inference_mode():
        want = adapter.model(input_ids=torch.tensor([ids + cont])).logits[0, 30:]
    got = ReferenceDecoder(adapter).logits(full, cont)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-4)

    cache = compact_prefix(
        adapter,
        ids,
        mask,
        ratio=0.2,
        method="am-highest-attn",
        queries="context-prefill",
        budgets="uniform",
        on_policy=False,
    )
    assert cache.head_lengths[:, 0].tolist() == [7, 7, 6, 7]
    config = adapter.model.config
    assert check_sliding_layers(cache, config) == [8, 8, None, 8]
    phys = physical_prefix(cache, config)
    assert phys.num_slots == 7
    prefill = adapter.prefill(ids, capture_queries=False)
    expect = rotate_keys(prefill.keys[0][0, 23:30], -23, config, "sliding_attention")
    assert torch.allclose(phys.keys[0][:, 0], expect, atol=1e-5)
    assert bool((phys.beta[0] == 0).all())
    # the global layer's 6 slots come first, then one masked slot
    assert (phys.beta[2][6:, 0] == MASKED_BETA).all() and (
        phys.beta[2][:6, 0] > MASKED_BETA
    ).all()

    # a longer global layer: the sliding layers' 7 rows end at P - 1, masked slots before them
    wide = compact_prefix(
        adapter,
        ids,
        mask,
        ratio=0.5,
        method="am-highest-attn",
        queries="context-prefill",
        budgets="uniform",
        on_policy=False,
    )
    padded = physical_prefix(wide, config)
    slots = padded.num_slots
    assert slots == 15
    assert (padded.beta[0][: slots - 7, 0] == MASKED_BETA).all()
    assert (padded.beta[0][slots - 7 :, 0] == 0).all()
    expect = rotate_keys(
        prefill.keys[0][0, 23:30], slots - 30, config, "sliding_attention"
    )
    assert torch.allclose(padded.keys[0][slots - 7 :, 0], expect, atol=1e-5)

    # a sliding layer that lost a key is refused with a sentence
    heads = cache.layers[1]
    shorter = dataclasses.replace(
        heads,
        keys=heads.keys[1:],
        values=heads.values[1:],
        beta=heads.beta[1:],
        indices=heads.indices[1:],
        cu_seqlens=torch.tensor([0, 6], dtype=torch.int32),
    )
    broken = dataclasses.replace(
        cache, layers=[cache.layers[0], shorter, *cache.layers[2:]]
    )
    with pytest.raises(ValueError, match="layer 1 slides over 8 tokens"):
        physical_prefix(broken, config)
