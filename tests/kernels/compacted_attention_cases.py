"""Cases of the split-KV compacted-prefix kernel (``kernels/compacted_attention.py``) against its
float64 twin, run by ``test_kernel_cases.py`` in a fresh interpreter (``TRITON_INTERPRET=1`` on
a CPU, compiled on a GPU).

Each batch is built the way the engine holds it: one page tensor per layer (separate
allocations, so rows read from another layer's pages test the offsets), NaN-filled, a packed
prefix written by the real writer (``PagedPrefixPages.write``) into shuffled blocks, the suffix
tokens into further blocks. A read of any slot that was never written turns the output NaN.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from benchmarks.source_tree import alias_kernels

alias_kernels()

from vllm_compaction.cache import PagedPacking  # noqa: E402
from vllm_compaction.vllm.bias import MASKED_BETA, encode_beta  # noqa: E402
from vllm_compaction.vllm.layout import pack_layers  # noqa: E402
from vllm_compaction.vllm.paged_prefix import PagedPrefixPages  # noqa: E402
from vllm_compaction_kernels.compacted_attention import (  # noqa: E402
    compacted_attention,
    compacted_attention_reference,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
LAYERS, BLOCK = 3, 16
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def build(
    *,
    dtype,
    num_kv_heads,
    group,
    head_dim,
    head_lengths,
    suffix_lens,
    q_lens,
    width=None,
    layer=1,
    suffix_bias=False,
    masked=False,
    physical="HND",
    seed=0,
):
    """A batch: request r has a packed prefix with ``head_lengths[r]`` ([L, H] rows, or None
    for a plain request) and ``suffix_lens[r]`` suffix tokens, the last ``q_lens[r]`` of them
    this step's queries."""
    gen = torch.Generator().manual_seed(seed)
    width = width or head_dim
    packings = [
        None if hl is None else PagedPacking(torch.as_tensor(hl), head_dim, BLOCK)
        for hl in head_lengths
    ]
    prefix_blocks = [0 if p is None else p.num_blocks for p in packings]
    suffix_blocks = [-(-s // BLOCK) for s in suffix_lens]
    num_blocks = sum(prefix_blocks) + sum(suffix_blocks) + 4
    # one tensor per layer holding its keys and values side by side, as vLLM's CUDA pages do:
    # logical [B, H, N, 2 * width], physically in that order (HND) or [B, N, H, 2 * width] (NHD)
    shape = (
        (num_blocks, num_kv_heads, BLOCK, 2 * width)
        if physical == "HND"
        else (num_blocks, BLOCK, num_kv_heads, 2 * width)
    )
    raw = [
        torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        for _ in range(LAYERS)
    ]
    logical = raw if physical == "HND" else [t.transpose(1, 2) for t in raw]
    keys, values = [t[..., :width] for t in logical], [t[..., width:] for t in logical]
    pages = PagedPrefixPages(keys, values, head_dim)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    nan_block = perm.pop()
    block_ids, suffix_table = (
        [],
        torch.full((len(q_lens), max(suffix_blocks) + 1), nan_block, dtype=torch.int32),
    )
    for r, packing in enumerate(packings):
        ids = None
        if packing is not None:
            ids = torch.tensor([perm.pop() for _ in range(packing.num_blocks)])
            rows = [packing.head_lengths[l].sum() for l in range(LAYERS)]
            k = [torch.randn(int(n), head_dim, generator=gen) for n in rows]
            v = [torch.randn(int(n), head_dim, generator=gen) for n in rows]
            b = [2.0 * torch.randn(int(n), generator=gen) for n in rows]
            pages.write(
                pack_layers(packing, k, v, b, dtype=dtype, logical_length=1000),
                ids.tolist(),
            )
        block_ids.append(ids)
        for j in range(suffix_blocks[r]):
            suffix_table[r, j] = perm.pop()
        for pos in range(suffix_lens[r]):
            blk, slot = int(suffix_table[r, pos // BLOCK]), pos % BLOCK
            row = torch.zeros(num_kv_heads, width)
            row[:, :head_dim] = torch.randn(num_kv_heads, head_dim, generator=gen)
            vrow = torch.zeros(num_kv_heads, width)
            vrow[:, :head_dim] = torch.randn(num_kv_heads, head_dim, generator=gen)
            if suffix_bias:
                beta = 2.0 * torch.randn(num_kv_heads, generator=gen)
                # padding slots of a head shorter than the padded prefix
                if masked and pos % 3 == 1:
                    beta[0], vrow[0, :head_dim] = MASKED_BETA, 1e4
                row[:, head_dim : head_dim + 2] = encode_beta(beta, dtype).float()
            keys[layer][blk, :, slot] = row.to(device=DEVICE, dtype=dtype)
            values[layer][blk, :, slot] = vrow.to(device=DEVICE, dtype=dtype)
    num_q = num_kv_heads * group
    query = torch.randn(sum(q_lens), num_q, head_dim, generator=gen).to(dtype)
    starts = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32
    )
    to = lambda t: t.to(DEVICE)  # noqa: E731
    dev_pages = pages
    tables = (
        dev_pages.kernel_tables(packings, block_ids)
        if any(p is not None for p in packings)
        else None
    )
    rows = [
        None if p is None else [t.cpu() for t in pages.layer_rows(p, layer, ids)]
        for p, ids in zip(packings, block_ids)
    ]
    prefix_rows = [
        None if p is None else (*rows[r], p.cu_seqlens(layer))
        for r, p in enumerate(packings)
    ]
    max_keys = max(
        s + (0 if p is None else int(p.head_lengths[layer].max()))
        for s, p in zip(suffix_lens, packings)
    )
    # the kernel reads other layers' pages through offsets: every layer's pages must stay alive
    keep_alive = (raw, dev_pages)
    return dict(
        query=to(query),
        key_pages=dev_pages._keys[layer],
        value_pages=dev_pages._values[layer],
        keep_alive=keep_alive,
        block_table=to(suffix_table),
        seq_lens=to(torch.tensor(suffix_lens, dtype=torch.int32)),
        query_start_loc=to(starts),
        scale=1 / math.sqrt(head_dim),
        head_dim=head_dim,
        max_query_len=max(q_lens),
        max_keys=max_keys,
        prefix=tables,
        layer=layer,
        suffix_bias=suffix_bias,
    ), dict(
        query=query,
        key_pages=keys[layer].cpu(),
        value_pages=values[layer].cpu(),
        block_table=suffix_table,
        seq_lens=torch.tensor(suffix_lens),
        query_start_loc=starts,
        scale=1 / math.sqrt(head_dim),
        head_dim=head_dim,
        prefix_rows=prefix_rows,
        suffix_bias=suffix_bias,
    )


def check(kernel_args, ref_args, dtype, splits=None):
    """The kernel against the float64 twin; with splits, the merge both as its own launch and
    fused into the last split, the fused one called twice into NaN-filled outputs (its counters
    must be back at zero for the second call to write anything)."""
    args = {k: v for k, v in kernel_args.items() if k != "keep_alive"}
    ref, ref_lse = compacted_attention_reference(**ref_args)
    query = kernel_args["query"]
    calls = [False] if not splits or splits == 1 else [False, True, True]
    for fused_merge in calls:
        out = torch.full(
            (*query.shape[:2], args["head_dim"]),
            math.nan,
            dtype=query.dtype,
            device=DEVICE,
        )
        lse = torch.full(query.shape[:2], math.nan, dtype=torch.float32, device=DEVICE)
        compacted_attention(
            **args, num_splits=splits, fused_merge=fused_merge, out=out, lse=lse
        )
        assert torch.isfinite(out.float()).all(), (
            "NaN: a slot that was never written was read, or an output never written"
        )
        torch.testing.assert_close(
            out.float().cpu(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype]
        )
        torch.testing.assert_close(
            lse.cpu(), ref_lse.float(), atol=TOL[dtype], rtol=TOL[dtype]
        )


def lengths(num_kv_heads, *, seed, empty=True, full=None):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 70, (LAYERS, num_kv_heads), generator=gen)
    if empty:
        table[1, 0] = 0  # an empty head in the layer under test
    if full is not None:
        table[1, -1] = full
    return table


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str
)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_over_prefix_and_suffix(dtype, group):
    kv, ref = build(
        dtype=dtype,
        num_kv_heads=2,
        group=group,
        head_dim=64,
        head_lengths=[lengths(2, seed=1), lengths(2, seed=2, full=300), None],
        suffix_lens=[5, 40, 33],
        q_lens=[1, 1, 1],
        seed=group,
    )
    check(kv, ref, dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims_with_splits(head_dim):
    kv, ref = build(
        dtype=torch.float32,
        num_kv_heads=2,
        group=2,
        head_dim=head_dim,
        head_lengths=[lengths(2, seed=3, full=400), lengths(2, seed=4)],
        suffix_lens=[20, 1],
        q_lens=[1, 1],
        seed=head_dim,
    )
    for splits in (1, 4):
        check(kv, ref, torch.float32, splits)


def test_chunked_prefill_on_a_compacted_prefix():
    kv, ref = build(
        dtype=torch.float32,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        head_lengths=[lengths(2, seed=5), None],
        suffix_lens=[70, 40],
        q_lens=[37, 9],
        seed=5,
    )
    for splits in (1, 2):
        check(kv, ref, torch.float32, splits)


@pytest.mark.parametrize("window", [1, 30, 90])
def test_sliding_window_over_prefix_and_suffix(window):
    """A sliding layer (hybrid models): each packed head's rows are the prefix's last keys, the
    window runs back from every query over the suffix into them; decode and a prefill chunk,
    with and without splits."""
    kv, ref = build(
        dtype=torch.float32,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        head_lengths=[lengths(2, seed=8, full=120), None, lengths(2, seed=9)],
        suffix_lens=[20, 50, 60],
        q_lens=[1, 1, 25],
        seed=window,
    )
    kv["window"] = ref["window"] = window
    for splits in (1, 4):
        check(kv, ref, torch.float32, splits)


def test_every_head_empty_but_the_suffix():
    zero = torch.zeros(LAYERS, 2, dtype=torch.long)
    zero[0, 0] = 3  # other layers keep rows, this one none
    kv, ref = build(
        dtype=torch.float32,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        head_lengths=[zero],
        suffix_lens=[3],
        q_lens=[1],
        seed=6,
    )
    check(kv, ref, torch.float32, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_widened_pages_add_the_suffix_bias(dtype):
    """Widened pages: every suffix key adds its beta (hi + lo coordinates); masked slots
    (``MASKED_BETA``, the padding of padded prefixes) get exactly no weight."""
    kv, ref = build(
        dtype=dtype,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        width=80,
        head_lengths=[None, lengths(2, seed=7), None],
        suffix_lens=[50, 17, 33],
        q_lens=[2, 1, 1],
        suffix_bias=True,
        masked=True,
        seed=7,
    )
    out = torch.empty(kv["query"].shape, dtype=dtype, device=DEVICE)
    check(kv, ref, dtype, 2)
    args = {k: v for k, v in kv.items() if k != "keep_alive"}
    compacted_attention(**args, out=out)
    assert out.float().abs().max() < 100  # a masked slot's value (1e4) never leaks in


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_vllm_page_layouts_and_strided_outputs(physical):
    """vLLM's logical ``[B, H, N, 2A]`` pages over either physical order; an output that is a
    strided slice of a wider buffer; padding rows past the last request untouched."""
    kv, ref = build(
        dtype=torch.float32,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        physical=physical,
        head_lengths=[lengths(2, seed=8), None],
        suffix_lens=[9, 30],
        q_lens=[3, 1],
        seed=8,
    )
    wide = torch.full((kv["query"].shape[0] + 2, 6, 80), 7.0, device=DEVICE)
    args = {k: v for k, v in kv.items() if k != "keep_alive"}
    query = torch.cat([args.pop("query"), torch.zeros(2, 6, 64, device=DEVICE)])
    out = compacted_attention(query, **args, out=wide[:, :, :64])
    assert out.data_ptr() == wide.data_ptr()
    n = kv["query"].shape[0]
    assert (wide[n:] == 7.0).all() and (wide[..., 64:] == 7.0).all()
    expected, _ = compacted_attention_reference(**ref)
    torch.testing.assert_close(
        wide[:n, :, :64].cpu(),
        expected.float(),
        atol=TOL[torch.float32],
        rtol=TOL[torch.float32],
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(query=lambda q: q.to(torch.float16)), "share one float dtype"),
        (dict(query=lambda q: q[:, :5]), "multiple"),
        (
            dict(
                out=lambda q: torch.empty(q.shape[0], q.shape[1], 32, device=q.device)
            ),
            "out must be",
        ),
    ],
)
def test_bad_inputs_are_refused(change, match):
    kv, _ = build(
        dtype=torch.float32,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        head_lengths=[None],
        suffix_lens=[4],
        q_lens=[1],
        seed=9,
    )
    args = {k: v for k, v in kv.items() if k != "keep_alive"}
    if "out" in change:
        args["out"] = change["out"](args["query"])
    else:
        args["query"] = change["query"](args["query"])
    with pytest.raises(ValueError, match=match):
        compacted_attention(**args)


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("only meaningful where the cases run on CPU tensors")
    import triton

    kv, _ = build(
        dtype=torch.float32,
        num_kv_heads=1,
        group=1,
        head_dim=64,
        head_lengths=[None],
        suffix_lens=[2],
        q_lens=[1],
        seed=10,
    )
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        compacted_attention(**{k: v for k, v in kv.items() if k != "keep_alive"})


_COMPILE = """
from vllm_compaction_kernels.compacted_attention import _build
attend, merge = _build()
pointers = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", lse_ptr="*fp32", part_ptr="*fp32",
                stat_ptr="*fp32", count_ptr="*i32", block_table_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32",
                region_base_ptr="*i64", head_rows_ptr="*i32", beta_rows_ptr="*i32", beta_ptr="*fp32",
                scale_log2="fp32", prefix_shift="i64")
for head_dim, group, splits, prefix, bias, fused in [(128, 4, 8, True, False, False), (128, 4, 8, True, False, True),
                                                     (256, 8, 1, True, False, False), (64, 1, 2, False, True, False)]:
    group_pad = 1 << (group - 1).bit_length()
    compiled = compile_sm90(attend, pointers, dict(BLOCK_SIZE=16, REGION_ROWS=16 * 8, HEAD_DIM=head_dim, HEAD_PAD=head_dim, GROUP=group, GROUP_PAD=group_pad,
                                                   BLOCK_Q=max(1, 16 // group_pad), BLOCK_N=64, SPLITS=splits, HAS_PREFIX=prefix,
                                                   SUFFIX_BIAS=bias, WINDOWED=False, ELEM_SIZE=2, ROW_MULTIPLE=16, DOT_PRECISION="tf32",
                                                   UPCAST_DOT=False, STORE_LSE=True, FUSED_MERGE=fused))
    ptx = compiled.asm["ptx"]
    if fused:
        # the split's stores, a barrier, one thread's release-acquire count at GPU scope, and the
        # last split's reads of the partials from L2
        count = ptx.index("atom.global.gpu.acq_rel.add")
        assert "bar.sync" in ptx[:count] and "ld.global.cg" in ptx[count:], "fused merge's ordering"
    else:
        assert "atom." not in ptx
    if splits > 1 and not fused:
        compile_sm90(merge, dict(out_ptr="*bf16", lse_ptr="*fp32", part_ptr="*fp32", stat_ptr="*fp32"),
                     dict(HEAD_DIM=head_dim, HEAD_PAD=head_dim, SPLITS=splits, STORE_LSE=True))
"""


def test_kernels_compile_for_sm90(tmp_path):
    from kernels.sm90 import compile_for_sm90

    if DEVICE == "cuda":
        pytest.skip("compiled for this GPU by every other case here")

    compile_for_sm90(_COMPILE, tmp_path)
