"""The paged bias-attention Triton kernel against its torch reference and against SDPA.

On CPU the kernel runs through the Triton interpreter (``TRITON_INTERPRET=1``, set by this
folder's conftest), so shapes stay tiny. Caches are filled with NaN before the real slots are
written: a kernel that reads a slot past ``seq_len`` (the tail of a last page) or an unused
block-table entry turns the output NaN instead of passing by luck.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from vllm_compaction.vllm.bias import MASKED_BETA, augment_kv, encode_beta
from vllm_compaction_kernels.paged_bias_attention import (
    paged_bias_attention,
    paged_bias_attention_reference,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"

HEAD_DIM = 16
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}

# decode, full prefill longer than one query tile, chunked prefill on top of a context,
# an idle request (q_len 0), decode of a 1-token sequence
Q_LENS = [1, 40, 7, 0, 1]
SEQ_LENS = [37, 40, 50, 5, 1]


@dataclass
class Batch:
    """A varlen batch in paged form plus the dense per-request tensors it was built from."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]  # per request [S, Hkv, d], rounded to the cache dtype
    values: list[torch.Tensor]
    betas: list[torch.Tensor]  # per request [S, Hkv] fp32 (as encoded)
    scale: float

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens,
                self.query_start_loc)


def make_batch(
    *,
    dtype: torch.dtype,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    d_aug: int = HEAD_DIM + 2,
    vllm_layout: bool = False,
    beta: str = "random",
    q_lens: list[int] = Q_LENS,
    seq_lens: list[int] = SEQ_LENS,
    extra_tokens: int = 0,
    seed: int = 0,
) -> Batch:
    """Scatter random per-request K/V (+beta) into shuffled pages of a NaN-filled cache.

    ``vllm_layout`` builds the caches the way vLLM 0.32's TRITON_ATTN does: one logical
    ``[B, Hkv, N, 2 * D_aug]`` tensor, ``transpose(1, 2).split(D_aug, -1)``, i.e. strided views.
    ``beta``: ``"zero"`` (plain attention), ``"random"`` (N(0, 1.5^2) with ~25% MASKED_BETA
    slots, never slot 0 so every query keeps a real key).
    """
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(pages_per_req) + 3  # spare pages stay NaN and unreferenced
    max_blocks = max(pages_per_req) + 1  # unused table entries point at a NaN page
    if vllm_layout:
        raw = torch.full((num_blocks, num_kv_heads, block_size, 2 * d_aug), float("nan"),
                         dtype=dtype)
        key_cache, value_cache = raw.transpose(1, 2).split(d_aug, dim=-1)
    else:
        key_cache = torch.full((num_blocks, block_size, num_kv_heads, d_aug), float("nan"),
                               dtype=dtype)
        value_cache = torch.full_like(key_cache, float("nan"))

    perm = torch.randperm(num_blocks, generator=gen)
    nan_page = int(perm[-1])
    block_table = torch.full((len(seq_lens), max_blocks), nan_page, dtype=torch.int32)
    used = 0
    keys, values, betas = [], [], []
    for r, (seq_len, n_pages) in enumerate(zip(seq_lens, pages_per_req)):
        block_table[r, :n_pages] = perm[used : used + n_pages].to(torch.int32)
        used += n_pages
        k = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        if beta == "zero":
            b = torch.zeros(seq_len, num_kv_heads)
        else:
            b = 1.5 * torch.randn(seq_len, num_kv_heads, generator=gen)
            masked = torch.rand(seq_len, num_kv_heads, generator=gen) < 0.25
            masked[0] = False
            b[masked] = MASKED_BETA
        k_aug, v_aug = augment_kv(k, v, d_aug, b)
        pos = torch.arange(seq_len)
        pages = block_table[r, pos // block_size].long()
        key_cache[pages, pos % block_size] = k_aug
        value_cache[pages, pos % block_size] = v_aug
        keys.append(k)
        values.append(v)
        betas.append(k_aug[..., HEAD_DIM:HEAD_DIM + 2].float().sum(-1))

    num_tokens = sum(q_lens) + extra_tokens
    query = torch.randn(num_tokens, num_q_heads, HEAD_DIM, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                   dtype=torch.int32)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return Batch(
        query=to(query), key_cache=to(key_cache), value_cache=to(value_cache),
        block_table=to(block_table), seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)),
        query_start_loc=to(query_start_loc), keys=keys, values=values, betas=betas,
        scale=HEAD_DIM ** -0.5,
    )


def sdpa_per_request(batch: Batch, *, float_mask: bool) -> torch.Tensor:
    """Dense fp32 attention per request with torch SDPA (GQA via ``enable_gqa``).

    ``float_mask`` adds beta through SDPA's additive mask (with -inf above the causal diagonal);
    otherwise a boolean causal mask is used and beta is ignored (the beta = 0 case).
    """
    num_q_heads = batch.query.shape[1]
    out = torch.zeros(batch.query.shape[0], num_q_heads, HEAD_DIM)
    starts = batch.query_start_loc.tolist()
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        q_start, q_end = starts[r], starts[r + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        q = batch.query[q_start:q_end].float().cpu().transpose(0, 1)[None]  # [1, Hq, T, d]
        k = batch.keys[r].float().transpose(0, 1)[None]  # [1, Hkv, S, d]
        v = batch.values[r].float().transpose(0, 1)[None]
        visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
        if float_mask:
            group = num_q_heads // k.shape[1]
            beta = batch.betas[r].T.repeat_interleave(group, 0)  # [Hq, S]
            mask = beta[:, None, :].masked_fill(~visible, float("-inf"))[None]
        elif q_len == seq_len:
            mask = None  # plain prefill: SDPA's own top-left causal mask is the right one
        else:
            mask = visible
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=batch.scale, enable_gqa=True)
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


def run_kernel(batch: Batch, **kw) -> torch.Tensor:
    return paged_bias_attention(*batch.args(), scale=batch.scale, head_dim=HEAD_DIM, **kw)


def run_reference(batch: Batch, **kw) -> torch.Tensor:
    return paged_bias_attention_reference(*batch.args(), scale=batch.scale, head_dim=HEAD_DIM,
                                          **kw)


@requires_triton
@pytest.mark.parametrize(
    "dtype,block_size,heads,d_aug,vllm_layout",
    [
        (torch.float32, 16, (4, 2), HEAD_DIM + 2, False),
        (torch.float32, 32, (6, 2), 32, True),  # group 3: padded GQA rows
        (torch.float32, 16, (2, 2), 32, True),  # MHA
        (torch.float16, 32, (4, 1), HEAD_DIM + 2, True),
        (torch.bfloat16, 16, (4, 2), 32, True),
        (torch.bfloat16, 32, (6, 2), HEAD_DIM + 2, False),
    ],
    ids=["fp32-bs16-gqa2", "fp32-bs32-gqa3-vllm", "fp32-bs16-mha-vllm", "fp16-bs32-mqa-vllm",
         "bf16-bs16-gqa2-vllm", "bf16-bs32-gqa3"],
)
def test_kernel_matches_reference(dtype, block_size, heads, d_aug, vllm_layout):
    batch = make_batch(dtype=dtype, block_size=block_size, num_q_heads=heads[0],
                       num_kv_heads=heads[1], d_aug=d_aug, vllm_layout=vllm_layout)
    out = run_kernel(batch, max_query_len=max(Q_LENS))
    ref = run_reference(batch)
    assert out.dtype == dtype and out.shape == (sum(Q_LENS), heads[0], HEAD_DIM)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **TOL[dtype])


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_sum_exp_output(dtype):
    """The optional lse rows: the kernel's equal the reference's, and merging two halves of a
    sequence by their lse gives the attention over the whole (what packed prefixes rely on)."""
    batch = make_batch(dtype=dtype, block_size=16, num_q_heads=4, num_kv_heads=2, vllm_layout=True)
    tokens = sum(Q_LENS)
    lse_kernel = torch.empty(tokens, 4, dtype=torch.float32, device=DEVICE)
    lse_reference = torch.empty(tokens, 4, dtype=torch.float32, device=DEVICE)
    run_kernel(batch, max_query_len=max(Q_LENS), lse=lse_kernel)
    run_reference(batch, lse=lse_reference)
    torch.testing.assert_close(lse_kernel.cpu(), lse_reference.cpu(), atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="lse must be float32"):
        run_reference(batch, lse=lse_reference[:, :2])


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_beta_is_plain_causal_attention(dtype):
    """With beta = 0 everywhere the kernel is ordinary causal attention (SDPA, boolean mask)."""
    batch = make_batch(dtype=dtype, block_size=16, num_q_heads=4, num_kv_heads=2, beta="zero",
                       vllm_layout=True)
    out = run_kernel(batch)
    expected = sdpa_per_request(batch, float_mask=False)
    torch.testing.assert_close(out.float().cpu(), expected, **TOL[dtype])


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_slots_get_exactly_zero_weight(dtype):
    """Values are 0 except at MASKED_BETA slots, where they are ~1e38: any nonzero weight there
    (even the smallest subnormal) would make the output nonzero, so it must be exactly 0."""
    batch = make_batch(dtype=dtype, block_size=16, num_q_heads=4, num_kv_heads=2)
    huge = torch.tensor(1e38, dtype=dtype)
    num_masked = 0
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        pages = batch.block_table[r, pos // 16].long().cpu()
        masked = (batch.betas[r] <= MASKED_BETA / 2).to(dtype)  # [S, Hkv]
        num_masked += int(masked.sum())
        vals = (masked * huge)[..., None].expand(-1, -1, HEAD_DIM)
        batch.value_cache[pages.to(DEVICE), (pos % 16).to(DEVICE), :, :HEAD_DIM] = vals.to(DEVICE)
    assert num_masked > 10
    out = run_kernel(batch)
    ref = run_reference(batch)
    assert torch.count_nonzero(out) == 0
    assert torch.count_nonzero(ref) == 0
    # sanity: the same slots with beta = 0 do carry weight
    batch.key_cache[..., HEAD_DIM:HEAD_DIM + 2] = 0
    assert torch.count_nonzero(run_reference(batch)) > 0


@requires_triton
def test_bf16_beta_keeps_its_lo_part():
    """Two slots whose betas differ only below bf16 resolution (64.0 vs 64.2: both round to
    64.0): with q = 0 the logits are the betas, so only the lo coordinate separates them."""
    betas = torch.tensor([64.0, 64.2])
    key_cache = torch.zeros(1, 16, 1, HEAD_DIM + 2, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    key_cache[0, :2, 0, HEAD_DIM:] = encode_beta(betas, torch.bfloat16)
    assert key_cache[0, 1, 0, HEAD_DIM] == 64.0 and key_cache[0, 1, 0, HEAD_DIM + 1] != 0
    value_cache[0, 0, 0, :HEAD_DIM] = -1.0
    value_cache[0, 1, 0, :HEAD_DIM] = 1.0
    args = [torch.zeros(1, 1, HEAD_DIM, dtype=torch.bfloat16), key_cache, value_cache,
            torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32)]
    args = [a.to(DEVICE) for a in args]
    out = paged_bias_attention(*args, scale=HEAD_DIM ** -0.5, head_dim=HEAD_DIM)
    expected = math.tanh(0.1)  # softmax([64, 64.2]) . [-1, 1]
    torch.testing.assert_close(out.float().cpu(), torch.full((1, 1, HEAD_DIM), expected),
                               atol=3e-3, rtol=0)


@requires_triton
def test_out_buffer_and_padding_tokens():
    """``out`` may be a strided slice of a wider buffer; padding tokens past
    ``query_start_loc[-1]`` (CUDA-graph padding) are not written."""
    batch = make_batch(dtype=torch.float32, block_size=16, num_q_heads=4, num_kv_heads=2,
                       extra_tokens=3)
    wide = torch.full((batch.query.shape[0], 4, HEAD_DIM + 8), 7.0, device=DEVICE)
    out = run_kernel(batch, out=wide[..., :HEAD_DIM])
    assert out.data_ptr() == wide.data_ptr()
    n = sum(Q_LENS)
    assert (wide[n:] == 7.0).all() and (wide[..., HEAD_DIM:] == 7.0).all()
    ref = run_reference(batch)
    torch.testing.assert_close(wide[:n, :, :HEAD_DIM].cpu(), ref[:n].cpu(), **TOL[torch.float32])


@requires_triton
def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("only meaningful where the tests run on CPU tensors")
    batch = make_batch(dtype=torch.float32, block_size=16, num_q_heads=2, num_kv_heads=2,
                       q_lens=[1], seq_lens=[3])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        run_kernel(batch)


_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_compaction_kernels.paged_bias_attention import _build_kernel

kernel = _build_kernel()
for dtype, group, head_dim in [("bf16", 3, 80), ("fp32", 1, 16)]:
    signature = {
        name: ("*" + dtype if name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr") else "*i32")
        if name.endswith("_ptr")
        else "fp32" if name == "scale" else "constexpr" if name.isupper() else "i32"
        for name in kernel.arg_names
    }
    group_pad = 1 << (group - 1).bit_length()
    constexprs = dict(HEAD_DIM=head_dim, HEAD_PAD=1 << (head_dim - 1).bit_length(), GROUP=group,
                      GROUP_PAD=group_pad, BLOCK_Q=max(1, 16 // group_pad), BLOCK_N=32,
                      DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST_DOT=False)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm, (dtype, sorted(compiled.asm))
"""


@requires_triton
def test_kernel_compiles_for_sm90(tmp_path):
    """The interpreter skips Triton's type checks and lowering; compiling to a cubin for sm_90
    (no GPU needed: ptxas ships with Triton) catches kernels that would only fail on a GPU.

    Runs in a subprocess: once Triton is imported with TRITON_INTERPRET=1 its own library
    functions are interpreter objects, and compiling in the same process fails."""
    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_kernel_without_triton_raises_clearly(monkeypatch):
    batch = make_batch(dtype=torch.float32, block_size=16, num_q_heads=2, num_kv_heads=2,
                       q_lens=[1], seq_lens=[3])
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    with pytest.raises(RuntimeError, match="needs Triton"):
        run_kernel(batch)
    run_reference(batch)  # the torch twin needs no Triton


@pytest.mark.parametrize("block_size,heads", [(16, (4, 2)), (32, (3, 1))])
def test_reference_matches_sdpa_with_float_mask(block_size, heads):
    """The reference's beta handling equals SDPA with beta (and -inf causal) as a float mask."""
    batch = make_batch(dtype=torch.float32, block_size=block_size, num_q_heads=heads[0],
                       num_kv_heads=heads[1], vllm_layout=True)
    ref = run_reference(batch)
    expected = sdpa_per_request(batch, float_mask=True)
    torch.testing.assert_close(ref.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_reference_zero_beta_matches_causal_sdpa():
    batch = make_batch(dtype=torch.float32, block_size=16, num_q_heads=4, num_kv_heads=2,
                       beta="zero")
    torch.testing.assert_close(run_reference(batch).cpu(),
                               sdpa_per_request(batch, float_mask=False), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(d_aug=HEAD_DIM + 1), "bias coordinates"),
        (dict(num_q_heads=3, num_kv_heads=2), "multiple"),
    ],
)
def test_bad_inputs_are_rejected(change, match):
    kw = dict(dtype=torch.float32, block_size=16, num_q_heads=4, num_kv_heads=2,
              q_lens=[1], seq_lens=[3])
    if change.get("d_aug") == HEAD_DIM + 1:
        # augment_kv cannot write 2 bias coords into HEAD_DIM + 1; build a valid batch and slice
        batch = make_batch(**kw)
        batch.key_cache = batch.key_cache[..., : HEAD_DIM + 1]
    else:
        batch = make_batch(**{**kw, **change})
    with pytest.raises(ValueError, match=match):
        run_reference(batch)


def test_mismatched_dtypes_are_rejected():
    batch = make_batch(dtype=torch.float32, block_size=16, num_q_heads=2, num_kv_heads=2,
                       q_lens=[1], seq_lens=[3])
    batch.query = batch.query.to(torch.bfloat16)
    with pytest.raises(ValueError, match="share one dtype"):
        run_reference(batch)
