"""Varlen-packed prefixes without an engine: the block geometry, writing and reading pages, the
per-head prefix attention and its exact merge with the stock CPU kernel run with a sink."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.am.heads import CompactedHeads
from vllm_compaction.cache import CacheError, PagedPacking
from vllm_compaction.vllm.bias import augment_kv, augment_query
from vllm_compaction.vllm.layout import PackedPrefix
from vllm_compaction.vllm.paged_prefix import PagedPrefixPages
from vllm_compaction.vllm.varlen_attention import merge_with_prefix, prefix_attention, sink_for

LENGTHS = torch.tensor([[0, 5, 300], [129, 1, 0], [40, 40, 40]])  # includes empty and long heads


def cpu_pages(pages: list[torch.Tensor], head_size: int) -> PagedPrefixPages:
    from vllm_compaction.vllm.cpu_backend import CompactionCPUAttentionImpl

    views = [CompactionCPUAttentionImpl.prefix_page_views(page) for page in pages]
    return PagedPrefixPages([k for k, _ in views], [v for _, v in views], head_size)


def test_geometry_counts_only_real_slots():
    packing = PagedPacking(LENGTHS, head_dim=64, block_size=32)
    assert packing.rows_per_block == 3 * 3 * 32
    assert packing.header_rows == -(-4 * (5 + 9) // 128)
    assert packing.num_rows == packing.header_rows + int(LENGTHS.sum())
    assert packing.num_blocks == -(-packing.num_rows // packing.rows_per_block)
    assert packing.num_tokens == packing.num_blocks * 32
    # every layer's rows are covered once, in order, by its spans
    covered = []
    for layer in range(3):
        spans = packing.layer_spans(layer)
        rows = sum(s.stop - s.start for s in spans)
        assert rows == int(LENGTHS[layer].sum())
        for s in spans:
            region = s.block * 3 + s.layer
            covered += list(range(region * packing.region_rows + s.start, region * packing.region_rows + s.stop))
    assert covered == list(range(packing.header_rows, packing.num_rows))
    assert packing.cu_seqlens(0).tolist() == [0, 0, 5, 305]


def test_header_round_trip_and_refusals():
    packing = PagedPacking(LENGTHS, head_dim=64, block_size=32)
    words = packing.header()
    again = PagedPacking.from_header(words, num_layers=3, num_kv_heads=3, head_dim=64, block_size=32)
    assert torch.equal(again.head_lengths, LENGTHS) and again.num_blocks == packing.num_blocks
    with pytest.raises(ValueError, match="no packed-prefix header"):
        PagedPacking.from_header(torch.zeros(20, dtype=torch.int32), num_layers=3, num_kv_heads=3,
                                 head_dim=64, block_size=32)
    with pytest.raises(ValueError, match="3 layers x 3 heads, the engine 4 x 3"):
        PagedPacking.from_header(torch.cat([words, words]), num_layers=4, num_kv_heads=3, head_dim=64,
                                 block_size=32)
    with pytest.raises(ValueError, match="must be >= 0"):
        PagedPacking(-LENGTHS, head_dim=64, block_size=32)


def _packed(lengths: torch.Tensor, d: int, block_size: int, dtype=torch.float32) -> PackedPrefix:
    packing = PagedPacking(lengths, head_dim=d, block_size=block_size)
    rows = packing.num_blocks * packing.rows_per_block
    keys, values = torch.zeros(rows, d, dtype=dtype), torch.zeros(rows, d, dtype=dtype)
    beta = torch.zeros(rows)
    data = slice(packing.header_rows, packing.num_rows)
    keys[data] = torch.randn(packing.num_rows - packing.header_rows, d).to(dtype)
    values[data] = torch.randn(packing.num_rows - packing.header_rows, d).to(dtype)
    beta[data] = torch.rand(packing.num_rows - packing.header_rows) * 6 - 3
    return PackedPrefix(packing, keys, values, beta, logical_length=1000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_round_trip_through_scattered_blocks(dtype):
    torch.manual_seed(0)
    d, width, block_size = 64, 80, 32
    prefix = _packed(LENGTHS, d, block_size, dtype)
    packing = prefix.packing
    pages = [torch.full((12, 3, block_size, 2 * width), 7.0, dtype=dtype) for _ in range(3)]
    view = cpu_pages(pages, d)
    blocks = [9, 2, 5, 11][: packing.num_blocks]
    view.write(prefix, blocks)
    found = view.packing_at(blocks[0])
    assert torch.equal(found.head_lengths, LENGTHS)
    for layer in range(3):
        keys, beta, values = view.layer_rows(found, layer, torch.tensor(blocks))
        start, stop = int(packing.layer_offsets[layer]), int(packing.layer_offsets[layer + 1])
        assert torch.equal(keys, prefix.keys[start:stop]) and torch.equal(values, prefix.values[start:stop])
        tolerance = 0 if dtype == torch.float32 else 1e-4  # beta keeps ~16 bits in bf16 (hi + lo)
        assert (beta - prefix.beta[start:stop]).abs().max() <= tolerance
    untouched = [b for b in range(12) if b not in blocks]
    assert all(bool((page[untouched] == 7.0).all()) for page in pages)
    # a partial write (leading blocks already cached) leaves those blocks alone
    pages[0][blocks[0]].fill_(3.0)
    view.write(prefix, blocks, first_block=1)
    assert bool((pages[0][blocks[0]] == 3.0).all())


def test_pages_refuse_another_geometry():
    pages = [torch.zeros(4, 2, 32, 160) for _ in range(3)]
    view = cpu_pages(pages, 64)
    with pytest.raises(CacheError, match=r"\(3, 3, 64, 32\), the engine \(3, 2, 64, 32\)"):
        view.write(_packed(LENGTHS, 64, 32), [0, 1, 2, 3])
    with pytest.raises(CacheError, match="no packed-prefix header"):
        view.packing_at(0)


def packed_from_heads(heads: CompactedHeads, block_size: int) -> PackedPrefix:
    """A one-layer packed prefix holding ``heads``."""
    packing = PagedPacking(heads.head_budgets[None], heads.head_dim, block_size)
    rows = packing.num_blocks * packing.rows_per_block
    keys, values = heads.keys.new_zeros(rows, heads.head_dim), heads.values.new_zeros(rows, heads.head_dim)
    beta = torch.zeros(rows)
    data = slice(packing.header_rows, packing.num_rows)
    keys[data], values[data], beta[data] = heads.keys, heads.values, heads.beta
    return PackedPrefix(packing, keys, values, beta, logical_length=1000)


def full_reference(query, heads: CompactedHeads, suffix_k, suffix_v, scale):
    """Attention of one query row per token over (padded prefix heads + causal suffix), float64."""
    keys, beta, values, _ = heads.padded()  # [H, t, d]
    n, num_q, d = query.shape
    group = num_q // heads.num_heads
    out = torch.empty(n, num_q, d, dtype=torch.float64)
    for j in range(num_q):
        h = j // group
        for i in range(n):
            k = torch.cat([keys[h].double(), suffix_k[: suffix_k.shape[0] - n + i + 1, h].double()])
            v = torch.cat([values[h].double(), suffix_v[: suffix_v.shape[0] - n + i + 1, h].double()])
            b = torch.cat([beta[h].double(), torch.zeros(suffix_k.shape[0] - n + i + 1, dtype=torch.float64)])
            p = torch.softmax(query[i, j].double() @ k.T * scale + b, dim=0)
            out[i, j] = p @ v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_plus_sink_kernel_equals_full_attention(dtype):
    """The exact merge of :mod:`varlen_attention` with vLLM's own CPU kernel (sink + ones coordinate)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.manual_seed(1)
    num_kv, group, d, width, block_size = 3, 3, 64, 80, 32
    lengths = torch.tensor([0, 37, 300])
    heads = CompactedHeads.from_padded(torch.randn(3, 300, d) * 2, torch.rand(3, 300) * 6 - 3,
                                       torch.randn(3, 300, d), torch.arange(300).expand(3, 300), lengths)
    heads.keys[:5] *= 0  # some flat scores too
    suffix_len, n = 70, 4  # four query tokens at the end of a 70-token suffix (a prefill chunk)
    suffix_k, suffix_v = torch.randn(suffix_len, num_kv, d), torch.randn(suffix_len, num_kv, d)
    query = torch.randn(n, num_kv * group, d) * 2
    scale = d ** -0.5

    isa = _get_attn_isa(dtype, block_size, width)
    cache = torch.zeros(4, num_kv, block_size, 2 * width, dtype=dtype)
    key_cache, value_cache = cache.view(4, num_kv, 2 * block_size, width).chunk(2, dim=2)
    block_table = torch.tensor([[3, 1, 0, 2]], dtype=torch.int32)
    positions = torch.arange(suffix_len)
    slots = block_table[0, positions // block_size].long() * block_size + positions % block_size
    k_aug, v_aug = augment_kv(suffix_k.to(dtype), suffix_v.to(dtype), width)
    ops.cpu_attn_reshape_and_cache(k_aug, v_aug, key_cache, value_cache, slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    prefix_out, prefix_lse = prefix_attention(query.to(dtype), heads.keys, heads.beta, heads.values,
                                              heads.cu_seqlens, scale)
    sink = sink_for(prefix_lse)
    seq_lens = torch.tensor([suffix_len], dtype=torch.int32)
    query_start = torch.tensor([0, n], dtype=torch.int32)
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=num_kv * group, num_kv_heads=num_kv, head_dim=width, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto")
    out = torch.empty(n, num_kv * group, width, dtype=dtype)
    ops.cpu_attention_with_kv_cache(
        query=augment_query(query.to(dtype), width, scale), key_cache=key_cache, value_cache=value_cache,
        output=out, query_start_loc=query_start, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=block_table, softcap=0.0, scheduler_metadata=schedule, s_aux=sink,
        dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    merged = merge_with_prefix(out, d, sink, prefix_out, prefix_lse)

    reference = full_reference(query.to(dtype).float(), heads, suffix_k.to(dtype).float(),
                                suffix_v.to(dtype).float(), scale)
    error = (merged.double() - reference).abs().max().item()
    assert error < (1e-5 if dtype == torch.float32 else 2e-2), error
    assert torch.isinf(prefix_lse[:, :group]).all()  # the empty head
