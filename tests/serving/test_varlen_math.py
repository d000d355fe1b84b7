"""Varlen-packed prefixes without an engine: the block geometry, writing and reading pages, the
per-head prefix attention and its exact merge with the tokens after the prefix, either from the
stock CPU kernel run with a sink (widened pages) or read back from stock-width pages and attended
in torch. Every attention is checked against the project's float reference
(:func:`vllm_compaction.am.attention.attention_output_and_mass`, through :mod:`serving.reference_ops`)."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.am.heads import CompactedHeads
from vllm_compaction.cache import CacheError, PagedPacking
from vllm_compaction.vllm import compat
from vllm_compaction.vllm.bias import augment_kv, augment_query
from vllm_compaction.vllm.layout import PackedPrefix, pack_layers
from vllm_compaction.vllm.paged_prefix import (
    BATCHED_PREFIX_QUERY_ROWS,
    BatchSplit,
    PackedRequest,
    PagedPrefixPages,
    attend_prefixes,
)
from vllm_compaction.vllm.varlen_attention import (
    masked_attention,
    merge_by_lse,
    merge_two_calls,
    merge_with_prefix,
    prefixes_attention,
    sink_for,
)

from serving.reference_ops import full_reference, masked_reference, prefix_reference

# includes empty and long heads
LENGTHS = torch.tensor([[0, 5, 300], [129, 1, 0], [40, 40, 40]])


def cpu_pages(pages: list[torch.Tensor], head_size: int) -> PagedPrefixPages:
    from vllm_compaction.vllm.cpu_backend import CompactionCPUAttentionImpl

    views = [CompactionCPUAttentionImpl.prefix_page_views(page) for page in pages]
    return PagedPrefixPages([k for k, _ in views], [v for _, v in views], head_size)


def test_geometry_counts_only_real_slots():
    packing = PagedPacking(LENGTHS, head_dim=64, block_size=32)
    assert packing.rows_per_block == 3 * 3 * 32
    assert packing.header_rows == -(-4 * (5 + 9) // 128)
    # fp32 betas in rows of 2 * 64 bytes
    assert packing.beta_rows == -(-int(LENGTHS.sum()) // 32)
    assert packing.num_rows == packing.header_rows + packing.beta_rows + int(
        LENGTHS.sum()
    )
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
            covered += list(
                range(
                    region * packing.region_rows + s.start,
                    region * packing.region_rows + s.stop,
                )
            )
    assert covered == list(range(packing.data_start, packing.num_rows))
    assert packing.cu_seqlens(0).tolist() == [0, 0, 5, 305]
    # each layer's betas: the beta rows from its first to its last, skipping the betas before it
    for layer in range(3):
        spans, skip = packing.beta_spans(layer)
        first = int(packing.layer_offsets[layer]) - packing.data_start
        assert skip == first % 32
        assert spans[0].start == packing.header_rows + first // 32
        assert sum(s.stop - s.start for s in spans) * 32 >= skip + int(
            LENGTHS[layer].sum()
        )


def test_header_round_trip_and_refusals():
    packing = PagedPacking(LENGTHS, head_dim=64, block_size=32)
    words = packing.header()
    again = PagedPacking.from_header(
        words, num_layers=3, num_kv_heads=3, head_dim=64, block_size=32
    )
    assert (
        torch.equal(again.head_lengths, LENGTHS)
        and again.num_blocks == packing.num_blocks
    )
    with pytest.raises(ValueError, match="no packed-prefix header"):
        PagedPacking.from_header(
            torch.zeros(20, dtype=torch.int32),
            num_layers=3,
            num_kv_heads=3,
            head_dim=64,
            block_size=32,
        )
    with pytest.raises(ValueError, match="3 layers x 3 heads, the engine 4 x 3"):
        PagedPacking.from_header(
            torch.cat([words, words]),
            num_layers=4,
            num_kv_heads=3,
            head_dim=64,
            block_size=32,
        )
    with pytest.raises(ValueError, match="must be >= 0"):
        PagedPacking(-LENGTHS, head_dim=64, block_size=32)


def _packed(
    lengths: torch.Tensor, d: int, block_size: int, dtype=torch.float32
) -> tuple[PackedPrefix, list]:
    """A random packed prefix and its per-layer (keys, beta, values)."""
    packing = PagedPacking(lengths, head_dim=d, block_size=block_size)
    layers = [
        (
            torch.randn(int(n), d).to(dtype),
            torch.rand(int(n)) * 6 - 3,
            torch.randn(int(n), d).to(dtype),
        )
        for n in lengths.sum(1)
    ]
    prefix = pack_layers(
        packing,
        [k for k, _, _ in layers],
        [v for _, _, v in layers],
        [b for _, b, _ in layers],
        dtype=dtype,
        logical_length=1000,
    )
    return prefix, layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_round_trip_through_scattered_blocks(dtype):
    torch.manual_seed(0)
    d, width, block_size = 64, 80, 32
    prefix, layers = _packed(LENGTHS, d, block_size, dtype)
    packing = prefix.packing
    pages = [
        torch.full((12, 3, block_size, 2 * width), 7.0, dtype=dtype) for _ in range(3)
    ]
    view = cpu_pages(pages, d)
    blocks = [9, 2, 5, 11][: packing.num_blocks]
    view.write(prefix, blocks)
    found = view.packing_at(blocks[0])
    assert torch.equal(found.head_lengths, LENGTHS)
    for layer in range(3):
        keys, beta, values = view.layer_rows(found, layer, torch.tensor(blocks))
        want_keys, want_beta, want_values = layers[layer]
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
        assert torch.equal(beta, want_beta)  # fp32 bytes: exact in every page dtype
    untouched = [b for b in range(12) if b not in blocks]
    assert all(bool((page[untouched] == 7.0).all()) for page in pages)
    # a partial write (leading blocks already cached) leaves those blocks alone
    pages[0][blocks[0]].fill_(3.0)
    view.write(prefix, blocks, first_block=1)
    assert bool((pages[0][blocks[0]] == 3.0).all())


def test_pages_refuse_another_geometry():
    pages = [torch.zeros(4, 2, 32, 160) for _ in range(3)]
    view = cpu_pages(pages, 64)
    with pytest.raises(
        CacheError, match=r"\(3, 3, 64, 32\), the engine \(3, 2, 64, 32\)"
    ):
        view.write(_packed(LENGTHS, 64, 32)[0], [0, 1, 2, 3])
    with pytest.raises(CacheError, match="no packed-prefix header"):
        view.packing_at(0)


def prefix_attention(query, keys, beta, values, cu_seqlens, scale):
    """:func:`prefixes_attention` for one request (a batch of one), as the production path calls it."""
    out, lse = prefixes_attention(
        query[None], keys[None], beta[None], values[None], cu_seqlens[None], scale
    )
    return out[0], lse[0]


def assert_close_to_reference(out, lse, want_out, want_lse):
    assert torch.allclose(out, want_out, atol=1e-5, rtol=1e-5)
    # -inf exactly where a head is empty
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.allclose(
        lse[torch.isfinite(lse)], want_lse[torch.isfinite(want_lse)], atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_attention_equals_a_per_head_softmax(dtype):
    """One prefix with an empty head, a one-row head and a long one; a prefill chunk of queries."""
    torch.manual_seed(2)
    d, num_q, scale = 64, 9, 64**-0.5
    lengths = torch.tensor([0, 1, 300])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    keys, values = torch.randn(301, d).to(dtype), torch.randn(301, d).to(dtype)
    beta = torch.rand(301) * 6 - 3
    query = (torch.randn(20, num_q, d) * 2).to(dtype)
    out, lse = prefix_attention(query, keys, beta, values, cu, scale)
    assert out.dtype == lse.dtype == torch.float32
    assert_close_to_reference(
        out, lse, *prefix_reference(query, keys, beta, values, cu, scale)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefixes_attention_equals_one_prefix_at_a_time(dtype):
    """Several requests' prefixes of different lengths (empty heads, one request with no rows at
    all), padded together, give each request its own prefix's attention."""
    torch.manual_seed(3)
    d, num_q, scale = 64, 9, 64**-0.5
    lengths = [
        torch.tensor(x) for x in ([0, 37, 300], [5, 0, 1], [0, 0, 0], [120, 64, 2])
    ]
    prefixes = [
        (
            torch.randn(int(n.sum()), d).to(dtype),
            torch.rand(int(n.sum())) * 6 - 3,
            torch.randn(int(n.sum()), d).to(dtype),
        )
        for n in lengths
    ]
    cu = torch.stack(
        [torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)]) for n in lengths]
    )
    width = max(int(n.sum()) for n in lengths)

    def padded(i):
        return torch.stack(
            [
                torch.nn.functional.pad(p[i], (0, 0, 0, width - p[i].shape[0]))
                if p[i].dim() == 2
                else torch.nn.functional.pad(p[i], (0, width - p[i].shape[0]))
                for p in prefixes
            ]
        )

    query = (torch.randn(len(lengths), 3, num_q, d) * 2).to(dtype)
    out, lse = prefixes_attention(query, padded(0), padded(1), padded(2), cu, scale)
    for r, (keys, beta, values) in enumerate(prefixes):
        assert_close_to_reference(
            out[r],
            lse[r],
            *prefix_reference(query[r], keys, beta, values, cu[r], scale),
        )
    # no rows: no mass
    assert bool((out[2] == 0).all()) and bool(torch.isinf(lse[2]).all())
    # every prefix empty in a layer
    empty = torch.zeros(2, 0, d)
    out, lse = prefixes_attention(
        query[:2],
        empty,
        torch.zeros(2, 0),
        empty,
        torch.zeros(2, 4, dtype=torch.long),
        scale,
    )
    assert bool((out == 0).all()) and bool(torch.isinf(lse).all())


def test_attend_prefixes_batches_decode_rows_over_different_prefixes():
    """A step with decode rows on three different prefixes, two sessions on one of them and a
    long prefill chunk on a fourth: the batched call and the chunk's own call give each token
    exactly what attending its prefix alone gives."""
    torch.manual_seed(4)
    d, block_size, num_q, scale = 64, 32, 9, 64**-0.5
    pages = [torch.zeros(24, 3, block_size, 2 * d) for _ in range(3)]
    view = cpu_pages(pages, d)
    geometries = [
        LENGTHS,
        LENGTHS.flip(0),
        torch.tensor([[3, 0, 9], [1, 1, 1], [0, 0, 0]]),
        LENGTHS // 2,
    ]
    # query rows per request, per prefix
    requests_rows = [
        [1],
        [1],
        [1, 1],
        [BATCHED_PREFIX_QUERY_ROWS + 4],
    ]
    requests, offset, next_block = [], 0, 0
    for lengths, counts in zip(geometries, requests_rows):
        prefix, _ = _packed(lengths, d, block_size)
        blocks = torch.arange(next_block, next_block + prefix.packing.num_blocks)
        next_block += prefix.packing.num_blocks
        view.write(prefix, blocks.tolist())
        for count in counts:
            requests.append(
                PackedRequest(
                    torch.arange(offset, offset + count),
                    blocks,
                    view.packing_at(int(blocks[0])),
                )
            )
            offset += count
    split = BatchSplit(
        plain_rows=[],
        plain_tokens=torch.zeros(0, dtype=torch.long),
        packed_rows=list(range(len(requests))),
        packed_tokens=torch.arange(offset),
        block_table=torch.zeros(0),
        seq_lens=torch.zeros(0),
        query_start_loc=torch.zeros(0),
        requests=requests,
    )
    assert sorted(tokens.numel() for tokens, _ in split.prefix_groups()) == [
        1,
        1,
        2,
        BATCHED_PREFIX_QUERY_ROWS + 4,
    ]
    query = torch.randn(offset, num_q, d) * 2
    for layer in range(3):
        out, lse = attend_prefixes(query, split, view, layer, scale)
        for request in requests:
            keys, beta, values = view.layer_rows(request.packing, layer, request.blocks)
            assert_close_to_reference(
                out[request.tokens],
                lse[request.tokens],
                *prefix_reference(
                    query[request.tokens],
                    keys,
                    beta,
                    values,
                    request.packing.cu_seqlens(layer),
                    scale,
                ),
            )


def packed_from_heads(heads: CompactedHeads, block_size: int) -> PackedPrefix:
    """A one-layer packed prefix holding ``heads``."""
    packing = PagedPacking(heads.head_budgets[None], heads.head_dim, block_size)
    return pack_layers(
        packing,
        [heads.keys],
        [heads.values],
        [heads.beta],
        dtype=heads.keys.dtype,
        logical_length=1000,
    )


def uneven_heads(d: int) -> CompactedHeads:
    """Three random compacted heads of lengths 0, 37 and 300 (an empty head and a long one)."""
    return CompactedHeads.from_padded(
        torch.randn(3, 300, d) * 2,
        torch.rand(3, 300) * 6 - 3,
        torch.randn(3, 300, d),
        torch.arange(300).expand(3, 300),
        torch.tensor([0, 37, 300]),
    )


def stock_kernel(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    query_start,
    scale,
    isa,
    num_kv,
    sink,
):
    """vLLM's CPU paged attention (causal) over ``block_table``, with an optional sink."""
    schedule = compat.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(),
        num_heads=query.shape[1],
        num_kv_heads=num_kv,
        head_dim=query.shape[2],
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=query_start,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
        dynamic_causal=None,
        kv_cache_dtype="auto",
    )
    out = torch.empty_like(query)
    compat.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=query_start,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=block_table,
        softcap=0.0,
        scheduler_metadata=schedule,
        s_aux=sink,
        dynamic_causal=None,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_plus_sink_kernel_equals_full_attention(dtype):
    """The exact merge of :mod:`varlen_attention` with vLLM's own CPU kernel (sink + ones coordinate)."""
    torch.manual_seed(1)
    num_kv, group, d, width, block_size = 3, 3, 64, 80, 32
    heads = uneven_heads(d)
    heads.keys[:5] *= 0  # some flat scores too
    # four query tokens at the end of a 70-token suffix (a prefill chunk)
    suffix_len, n = (
        70,
        4,
    )
    suffix_k, suffix_v = (
        torch.randn(suffix_len, num_kv, d),
        torch.randn(suffix_len, num_kv, d),
    )
    query = torch.randn(n, num_kv * group, d) * 2
    scale = d**-0.5

    isa = compat.cpu_attn_isa(dtype, block_size, width)
    cache = torch.zeros(4, num_kv, block_size, 2 * width, dtype=dtype)
    key_cache, value_cache = cache.view(4, num_kv, 2 * block_size, width).chunk(
        2, dim=2
    )
    block_table = torch.tensor([[3, 1, 0, 2]], dtype=torch.int32)
    positions = torch.arange(suffix_len)
    slots = (
        block_table[0, positions // block_size].long() * block_size
        + positions % block_size
    )
    k_aug, v_aug = augment_kv(suffix_k.to(dtype), suffix_v.to(dtype), width)
    compat.cpu_attn_reshape_and_cache(
        k_aug,
        v_aug,
        key_cache,
        value_cache,
        slots,
        isa,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )

    prefix_out, prefix_lse = prefix_attention(
        query.to(dtype), heads.keys, heads.beta, heads.values, heads.cu_seqlens, scale
    )
    sink = sink_for(prefix_lse)
    seq_lens = torch.tensor([suffix_len], dtype=torch.int32)
    query_start = torch.tensor([0, n], dtype=torch.int32)
    out = stock_kernel(
        augment_query(query.to(dtype), width, scale),
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start,
        scale,
        isa,
        num_kv,
        sink,
    )
    merged = merge_with_prefix(out, d, sink, prefix_out, prefix_lse)

    reference = full_reference(
        query.to(dtype).float(),
        heads,
        suffix_k.to(dtype).float(),
        suffix_v.to(dtype).float(),
        scale,
    )
    error = (merged.double() - reference).abs().max().item()
    assert error < (1e-5 if dtype == torch.float32 else 2e-2), error
    assert torch.isinf(prefix_lse[:, :group]).all()  # the empty head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_size", [(128, 64), (32, 80)])
def test_page_order_reads_back_what_the_write_op_stored(dtype, block_size, head_size):
    """The probed element order turns the ISA-packed pages back into the rows that were written."""
    from vllm_compaction.vllm.cpu_pages import probe_page_order

    torch.manual_seed(2)
    isa = compat.cpu_attn_isa(dtype, block_size, head_size)
    order = probe_page_order(dtype, block_size, head_size, isa)
    heads, blocks = 3, 5
    cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, head_size).chunk(
        2, dim=2
    )
    slots = torch.randperm(blocks * block_size)[:100]
    keys, values = (
        torch.randn(100, heads, head_size).to(dtype),
        torch.randn(100, heads, head_size).to(dtype),
    )
    compat.cpu_attn_reshape_and_cache(
        keys,
        values,
        key_cache,
        value_cache,
        slots,
        isa,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )
    read_keys, read_values = order.read(cache, slots // block_size, slots % block_size)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)


def test_causal_attention_matches_the_reference():
    torch.manual_seed(4)
    query, keys, values = (
        torch.randn(5, 6, 16),
        torch.randn(9, 2, 16),
        torch.randn(9, 2, 16),
    )
    last_key = torch.tensor([4, 5, 6, 7, 8])
    out, lse = masked_attention(
        query[None], keys[None], values[None], last_key[None], 0.25
    )
    assert_close_to_reference(
        out[0], lse[0], *masked_reference(query, keys, values, last_key, 0.25)
    )


def test_batched_decode_attention_equals_one_call_per_request():
    """Decode steps of several requests over padded suffixes: the padding changes nothing."""
    torch.manual_seed(5)
    lengths = [7, 1, 12]
    query = torch.randn(3, 6, 16)
    keys, values = torch.randn(3, 12, 2, 16), torch.randn(3, 12, 2, 16)
    out, lse = masked_attention(
        query[:, None], keys, values, torch.tensor(lengths)[:, None] - 1, 0.25
    )
    for r, length in enumerate(lengths):
        want_out, want_lse = masked_reference(
            query[r, None], keys[r], values[r], torch.tensor([length - 1]), 0.25
        )
        assert_close_to_reference(out[r], lse[r], want_out, want_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_plus_suffix_read_from_stock_pages_equals_full_attention(dtype):
    """Stock-width pages: the tokens after the prefix are read back through the probed order and
    attended in torch, then merged with the prefix by log-sum-exp."""
    from vllm_compaction.vllm.cpu_pages import probe_page_order

    torch.manual_seed(3)
    num_kv, group, d, block_size = 3, 3, 64, 32
    heads = uneven_heads(d)
    suffix_len, n = 70, 4
    suffix_k, suffix_v = (
        torch.randn(suffix_len, num_kv, d).to(dtype),
        torch.randn(suffix_len, num_kv, d).to(dtype),
    )
    query = (torch.randn(n, num_kv * group, d) * 2).to(dtype)
    scale = d**-0.5
    isa = compat.cpu_attn_isa(dtype, block_size, d)
    cache = torch.zeros(4, num_kv, block_size, 2 * d, dtype=dtype)
    key_cache, value_cache = cache.view(4, num_kv, 2 * block_size, d).chunk(2, dim=2)
    table = torch.tensor([3, 1, 0, 2])
    positions = torch.arange(suffix_len)
    slots = table[positions // block_size] * block_size + positions % block_size
    compat.cpu_attn_reshape_and_cache(
        suffix_k,
        suffix_v,
        key_cache,
        value_cache,
        slots,
        isa,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )

    keys, values = probe_page_order(dtype, block_size, d, isa).read(
        cache, table[positions // block_size], positions % block_size
    )
    suffix_out, suffix_lse = masked_attention(
        query[None],
        keys[None],
        values[None],
        torch.arange(suffix_len - n, suffix_len)[None],
        scale,
    )
    suffix_out, suffix_lse = suffix_out[0], suffix_lse[0]
    prefix_out, prefix_lse = prefix_attention(
        query, heads.keys, heads.beta, heads.values, heads.cu_seqlens, scale
    )
    merged = merge_by_lse(prefix_out, prefix_lse, suffix_out, suffix_lse)
    reference = full_reference(
        query.float(), heads, suffix_k.float(), suffix_v.float(), scale
    )
    assert (
        merged.double() - reference
    ).abs().max().item() < 1e-5  # fp32 math on the stored rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_plus_two_stock_width_kernel_calls_equal_full_attention(dtype):
    """Stock-width pages: the kernel without and with a sink over two requests' suffixes (a
    prefill chunk and a decode step) gives the share of the suffix, hence the exact merge."""
    torch.manual_seed(6)
    num_kv, group, d, block_size = 3, 3, 64, 32
    heads = uneven_heads(d)
    scale = d**-0.5
    isa = compat.cpu_attn_isa(dtype, block_size, d)
    cache = torch.zeros(6, num_kv, block_size, 2 * d, dtype=dtype)
    key_cache, value_cache = cache.view(6, num_kv, 2 * block_size, d).chunk(2, dim=2)
    tables = torch.tensor([[3, 1, 0], [5, 4, 2]], dtype=torch.int32)
    requests = [(70, 4), (41, 1)]  # (suffix length, query tokens at its end)
    suffixes, queries = [], []
    for row, (suffix_len, n) in enumerate(requests):
        k, v = (
            torch.randn(suffix_len, num_kv, d).to(dtype),
            torch.randn(suffix_len, num_kv, d).to(dtype),
        )
        positions = torch.arange(suffix_len)
        slots = (
            tables[row, positions // block_size].long() * block_size
            + positions % block_size
        )
        compat.cpu_attn_reshape_and_cache(
            k,
            v,
            key_cache,
            value_cache,
            slots,
            isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        suffixes.append((k, v))
        queries.append((torch.randn(n, num_kv * group, d) * 2).to(dtype))
    query = torch.cat(queries)
    seq_lens = torch.tensor([length for length, _ in requests], dtype=torch.int32)
    query_start = torch.tensor([0, 4, 5], dtype=torch.int32)

    prefix_out, prefix_lse = prefix_attention(
        query, heads.keys, heads.beta, heads.values, heads.cu_seqlens, scale
    )
    sink = sink_for(prefix_lse)
    call = (key_cache, value_cache, tables, seq_lens, query_start, scale, isa, num_kv)
    merged, trusted = merge_two_calls(
        stock_kernel(query, *call, None),
        stock_kernel(query, *call, sink),
        sink,
        prefix_out,
        prefix_lse,
    )
    assert trusted.all()
    reference = torch.cat(
        [
            full_reference(q.float(), heads, k.float(), v.float(), scale)
            for q, (k, v) in zip(queries, suffixes)
        ]
    )
    error = (merged.double() - reference).abs().max().item()
    assert error < (1e-5 if dtype == torch.float32 else 2e-2), error


def test_two_call_merge_flags_a_vanishing_suffix_output():
    """Where the sink-free suffix output vanishes the share is undetermined: the token is flagged
    (and attended from the pages instead), unless its prefix head is empty (no share needed)."""
    torch.manual_seed(7)
    n, num_q, d = 3, 6, 16
    plain = torch.randn(n, num_q, d)
    plain[1, 4] = 0.0  # token 1, head 4: the values after the prefix cancel out
    plain[2, 0] = 1e-6
    sunk = plain * 0.5
    prefix_out, prefix_lse = torch.randn(n, num_q, d), torch.randn(n, num_q)
    prefix_lse[2, 0] = float("-inf")  # empty prefix head: token 2 stays trusted
    prefix_out[2, 0] = 0.0
    merged, trusted = merge_two_calls(
        plain, sunk, sink_for(prefix_lse), prefix_out, prefix_lse
    )
    assert trusted.tolist() == [True, False, True]
    assert torch.isfinite(merged[trusted]).all()
    # no prefix: the suffix's own output
    assert torch.allclose(merged[2, 0], plain[2, 0])


def _windowed_reference(query, keys, beta, values, cu_seqlens, scale, window, offsets):
    """float64, one query row and head at a time: row ``j`` of head ``h`` (of ``t_h``) is visible
    to the query ``offsets[i]`` tokens after the prefix while ``t_h + offsets[i] - j < window``."""
    n, num_q, d = query.shape
    num_kv = cu_seqlens.numel() - 1
    group = num_q // num_kv
    out = torch.zeros(n, num_q, d, dtype=torch.float64)
    lse = torch.full((n, num_q), float("-inf"), dtype=torch.float64)
    for i in range(n):
        for j in range(num_q):
            start, stop = int(cu_seqlens[j // group]), int(cu_seqlens[j // group + 1])
            rows = [
                r
                for r in range(start, stop)
                if (stop - start) + int(offsets[i]) - (r - start) < window
            ]
            if not rows:
                continue
            logits = (
                keys[rows].double() @ query[i, j].double() * scale + beta[rows].double()
            )
            lse[i, j] = torch.logsumexp(logits, 0)
            out[i, j] = torch.softmax(logits, 0) @ values[rows].double()
    return out, lse


def test_a_sliding_window_hides_the_prefix_rows_a_query_has_passed():
    """Sliding-window layers (Gemma-3): each head's rows are the prefix's last keys; the query
    ``i`` tokens after the prefix sees row ``j`` of ``t_h`` while ``t_h + i - j < W``. Batched over
    requests of different lengths, empty heads and queries past the whole window."""
    torch.manual_seed(9)
    d, num_q, scale, window = 32, 4, 32**-0.5, 64
    lengths = [torch.tensor([0, 1, 63, 300]), torch.tensor([40, 70, 2, 0])]
    offsets = torch.tensor([[0, 1, 30, 63, 200], [0, 5, 10, 39, 69]])
    width = max(int(n.sum()) for n in lengths)
    parts = [
        (
            torch.randn(int(n.sum()), d),
            torch.rand(int(n.sum())) * 4 - 2,
            torch.randn(int(n.sum()), d),
        )
        for n in lengths
    ]
    cu = torch.stack(
        [torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)]) for n in lengths]
    )
    pad = lambda x: torch.nn.functional.pad(  # noqa: E731
        x, (0, 0, 0, width - x.shape[0]) if x.dim() == 2 else (0, width - x.shape[0])
    )
    keys, beta, values = (torch.stack([pad(p[k]) for p in parts]) for k in range(3))
    query = torch.randn(2, offsets.shape[1], num_q, d) * 2
    out, lse = prefixes_attention(
        query, keys, beta, values, cu, scale, window=window, query_offsets=offsets
    )
    for r, (k, b, v) in enumerate(parts):
        want_out, want_lse = _windowed_reference(
            query[r], k, b, v, cu[r], scale, window, offsets[r]
        )
        assert_close_to_reference(out[r], lse[r], want_out.float(), want_lse.float())
    # past the window nothing of the prefix is left: no mass
    assert bool(torch.isinf(lse[0, 4]).all()) and bool((out[0, 4] == 0).all())
    with pytest.raises(ValueError, match="offsets"):
        prefixes_attention(query, keys, beta, values, cu, scale, window=window)


def test_query_offsets_count_tokens_after_the_prefix():
    """A decode row 9 tokens after its prefix and a 3-token chunk that starts right after its own."""
    split = BatchSplit(
        plain_rows=[],
        plain_tokens=torch.zeros(0, dtype=torch.long),
        packed_rows=[0, 1],
        packed_tokens=torch.arange(4),
        block_table=torch.zeros(0),
        seq_lens=torch.tensor([10, 3], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
        requests=[],
    )
    assert split.query_offsets.tolist() == [9, 0, 1, 2]


def test_masked_attention_with_a_window_sees_only_the_last_keys():
    torch.manual_seed(10)
    d, num_q, scale, window = 16, 4, 0.25, 5
    keys, values = torch.randn(1, 12, 2, d), torch.randn(1, 12, 2, d)
    query = torch.randn(1, 3, num_q, d)
    last = torch.tensor([[2, 7, 11]])
    out, lse = masked_attention(query, keys, values, last, scale, window)
    for i, stop in enumerate(last[0].tolist()):
        start = max(0, stop - window + 1)
        want_out, want_lse = masked_reference(
            query[0, i : i + 1],
            keys[0, start : stop + 1],
            values[0, start : stop + 1],
            torch.tensor([stop - start]),
            scale,
        )
        assert torch.allclose(out[0, i], want_out[0], atol=1e-5)
        assert torch.allclose(lse[0, i], want_lse[0], atol=1e-5)
