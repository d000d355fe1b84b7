"""CompactedCache / ModelFingerprint: validation, sizes, identity, casting."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_compaction.am.heads import CompactedHeads, cu_seqlens_from_lengths
from vllm_compaction.cache import (
    CacheKey,
    CacheMismatchError,
    CompactedCache,
    ModelFingerprint,
    prefix_hash,
)

T, H, D = 50, 3, 16
# Per-layer per-head slot counts, including empty and full heads.
LENGTHS = [[0, 50, 7], [50, 50, 50], [12, 1, 33], [50, 0, 0]]


def make_fingerprint(num_layers: int = 4, **overrides) -> ModelFingerprint:
    fields = dict(
        architecture="LlamaForCausalLM",
        num_layers=num_layers,
        num_kv_heads=H,
        num_q_heads=2 * H,
        head_dim=D,
        config_digest="c" * 64,
        weights_digest="w" * 64,
        dtype="float32",
        name="tiny-llama",
    )
    fields.update(overrides)
    return ModelFingerprint(**fields)


def make_heads(
    lengths: list[int], dtype: torch.dtype = torch.float32, seed: int = 0, t: int = T
) -> CompactedHeads:
    """Random packed heads: head h keeps ``lengths[h]`` sorted distinct positions of ``[0, t)``."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    indices = torch.cat(
        [torch.randperm(t, generator=g)[:l].sort().values for l in lengths]
    )
    return CompactedHeads(
        keys=torch.randn(n, D, generator=g).to(dtype),
        beta=torch.randn(n, generator=g),
        values=torch.randn(n, D, generator=g).to(dtype),
        indices=indices,
        cu_seqlens=cu_seqlens_from_lengths(lengths),
    )


def make_cache(
    dtype: torch.dtype = torch.float32, lengths=LENGTHS, seed: int = 0, **overrides
) -> CompactedCache:
    fields = dict(
        layers=[make_heads(l, dtype, seed + i) for i, l in enumerate(lengths)],
        logical_length=T,
        token_ids=list(range(1000 + seed, 1000 + seed + T)),
        compacted_span=(5, 45),
        layer_compacted=[True, False, True, True][: len(lengths)],
        model=make_fingerprint(len(lengths)),
        method="am-highest-attn",
        ratio=0.25,
        options={"scale": 0.125, "keep_sink": True, "tags": ["a", "b"]},
        query_source="context_prefill",
        budgets="uniform",
        timings={"queries": 0.5, "compact": 1.25},
        created=1_700_000_000.123456,
    )
    fields.update(overrides)
    return CompactedCache(**fields)


# ---------------------------------------------------------------------- fingerprint
def test_fingerprint_dict_round_trip_and_digest() -> None:
    fp = make_fingerprint()
    assert ModelFingerprint.from_dict(json.loads(json.dumps(fp.to_dict()))) == fp
    assert (
        fp.digest() == dataclasses.replace(fp, name="other", dtype="bfloat16").digest()
    )
    bf16 = dataclasses.replace(fp, dtype="bfloat16")
    assert fp.digest(include_dtype=True) != bf16.digest(include_dtype=True)
    assert fp.digest() != dataclasses.replace(fp, weights_digest="x").digest()


@pytest.mark.parametrize(
    "field,value",
    [
        ("architecture", "Gemma3ForCausalLM"),
        ("num_layers", 5),
        ("num_kv_heads", 1),
        ("num_q_heads", 9),
        ("head_dim", 32),
        ("config_digest", "d"),
        ("weights_digest", "v"),
    ],
)
def test_check_compatible_names_first_differing_field(field: str, value) -> None:
    fp = make_fingerprint()
    other = dataclasses.replace(fp, **{field: value})
    with pytest.raises(CacheMismatchError, match=field):
        fp.check_compatible(other)


def test_check_compatible_dtype_and_name() -> None:
    fp = make_fingerprint()
    fp.check_compatible(dataclasses.replace(fp, name="renamed", dtype="bfloat16"))
    with pytest.raises(CacheMismatchError, match="dtype"):
        fp.check_compatible(
            dataclasses.replace(fp, dtype="bfloat16"), allow_dtype_cast=False
        )


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_layers=0),
        dict(head_dim=-1),
        dict(num_kv_heads=True),
        dict(num_q_heads=4),
        dict(architecture=3),
    ],
)
def test_fingerprint_validation(bad) -> None:
    with pytest.raises(ValueError):
        make_fingerprint(**bad)


def test_fingerprint_from_dict_rejects_missing_and_unknown() -> None:
    data = make_fingerprint().to_dict()
    with pytest.raises(ValueError, match="lacks"):
        ModelFingerprint.from_dict({k: v for k, v in data.items() if k != "head_dim"})
    with pytest.raises(ValueError, match="unknown"):
        ModelFingerprint.from_dict({**data, "extra": 1})


# ---------------------------------------------------------------------- validation
def test_validation_layer_count() -> None:
    with pytest.raises(ValueError, match="layers"):
        make_cache(model=make_fingerprint(num_layers=3))


def test_validation_heads_and_dim() -> None:
    bad_heads = make_heads([5, 5])  # 2 heads, model has 3
    with pytest.raises(ValueError, match="heads"):
        make_cache(layers=[make_heads(l) for l in LENGTHS[:3]] + [bad_heads])
    wide = CompactedHeads(
        torch.zeros(3, 2 * D),
        torch.zeros(3),
        torch.zeros(3, 2 * D),
        torch.arange(3),
        cu_seqlens_from_lengths([1, 1, 1]),
    )
    with pytest.raises(ValueError, match="dim"):
        make_cache(layers=[make_heads(l) for l in LENGTHS[:3]] + [wide])


def test_validation_token_ids_indices_span_flags() -> None:
    with pytest.raises(ValueError, match="token_ids"):
        make_cache(token_ids=list(range(T - 1)))
    with pytest.raises(ValueError, match="indices"):
        make_cache(layers=[make_heads(l, t=T + 5, seed=3) for l in LENGTHS])
    for span in [(10, 5), (-1, 3), (0, T + 1)]:
        with pytest.raises(ValueError, match="compacted_span"):
            make_cache(compacted_span=span)
    with pytest.raises(ValueError, match="layer_compacted"):
        make_cache(layer_compacted=[True])
    with pytest.raises(ValueError, match="dtype|float32|keys"):
        mixed = [
            make_heads(l, torch.bfloat16 if i else torch.float32)
            for i, l in enumerate(LENGTHS)
        ]
        make_cache(layers=mixed)
    with pytest.raises(ValueError, match="JSON"):
        make_cache(options={"x": object()})
    with pytest.raises(ValueError, match="ratio"):
        make_cache(ratio=float("nan"))


# ---------------------------------------------------------------------- sizes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sizes(dtype: torch.dtype) -> None:
    cache = make_cache(dtype)
    item = dtype.itemsize
    lengths = torch.tensor(LENGTHS)
    assert (
        torch.equal(cache.head_lengths, lengths)
        and cache.head_lengths.dtype == torch.int64
    )
    assert cache.physical_slots == int(lengths.sum())
    assert cache.max_head_length == T
    assert cache.nbytes == int(lengths.sum()) * (2 * D * item + 4)
    padded_slots = sum(max(l) * H for l in LENGTHS)
    assert cache.padded_nbytes == padded_slots * (2 * D * item + 4)
    assert cache.original_nbytes == len(LENGTHS) * H * T * 2 * D * item
    compacted = [sum(l) for l, c in zip(LENGTHS, cache.layer_compacted) if c]
    assert cache.compaction_ratio == pytest.approx(
        sum(compacted) / (len(compacted) * H * T)
    )


def test_compaction_ratio_without_compacted_layers() -> None:
    assert make_cache(layer_compacted=[False] * 4).compaction_ratio == 1.0


# ---------------------------------------------------------------------- identity / conversions
def test_identity_hashes() -> None:
    cache = make_cache()
    assert cache.prefix_hash == prefix_hash(cache.token_ids)
    assert cache.prefix_hash == prefix_hash(torch.tensor(cache.token_ids))
    assert cache.prefix_hash != make_cache(seed=1).prefix_hash
    assert cache.fingerprint_key() == CacheKey.for_cache(cache).digest()
    assert cache.config_hash != make_cache(ratio=0.5).config_hash
    assert cache.config_hash != make_cache(options={"scale": 0.5}).config_hash


def test_to_dtype_keeps_beta_fp32() -> None:
    cache = make_cache()
    half = cache.to(torch.bfloat16)
    assert half.dtype == torch.bfloat16 and cache.dtype == torch.float32
    for a, b in zip(cache.layers, half.layers):
        assert b.values.dtype == torch.bfloat16 and b.beta.dtype == torch.float32
        assert torch.equal(a.beta, b.beta) and torch.equal(a.indices, b.indices)
        assert torch.equal(a.keys.to(torch.bfloat16), b.keys)
    assert half.nbytes < cache.nbytes


def test_summary_is_json() -> None:
    summary = make_cache().summary()
    assert json.loads(json.dumps(summary)) == summary
    assert summary["physical_slots"] == sum(map(sum, LENGTHS))
    assert summary["timings"] == {"queries": 0.5, "compact": 1.25}


def test_options_normalised_through_json() -> None:
    assert make_cache(options={"pair": (1, 2)}).options == {"pair": [1, 2]}


def test_cache_package_imports_only_torch_and_safetensors() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['transformers'] = None; "
        "import vllm_compaction.cache"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)


def test_tensor_parallel_heads_follow_vllms_split():
    """Consecutive equal slices, or each head replicated when there are fewer heads than ranks;
    a split vLLM refuses is refused with a sentence."""
    from vllm_compaction.cache.paged import tensor_parallel_heads

    assert [tensor_parallel_heads(8, 4, r) for r in range(4)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert [tensor_parallel_heads(2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]
    assert tensor_parallel_heads(3, 1, 0) == [0, 1, 2]
    with pytest.raises(ValueError, match="do not split"):
        tensor_parallel_heads(3, 2, 0)
    with pytest.raises(ValueError, match="do not replicate"):
        tensor_parallel_heads(2, 3, 0)
