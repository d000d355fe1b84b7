"""How to carry a per-slot bias on vLLM's CPU attention: the measurement behind the design.

Run ``python -m benchmarks.bias_attention [--seq-len 2000] [--batch 16]``. Times one decode step
of attention (one query token per request, SmolLM2 shapes: 9 query heads, 3 KV heads, d = 64)
three ways, side by side:

* ``stock``: vLLM's C++ kernel on ordinary d = 64 pages (no bias possible);
* ``widened``: the same kernel on pages widened to 80 with beta in two extra key coordinates,
  including the per-call query padding and output slicing of our backend (what we ship);
* ``side-table``: beta in a side tensor, attention by our own torch path (gather the request's
  pages, SDPA with a float bias), the alternative that needs no wider pages.

Writes ``benchmarks/results/bias_attention.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path

import torch

from benchmarks.output import save_result

logger = logging.getLogger("benchmarks.bias_attention")
RESULTS = Path(__file__).resolve().parent / "results"


def _time(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=str(RESULTS / "bias_attention.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from vllm_compaction.vllm import compat
    from vllm_compaction.vllm.bias import augment_kv, augment_query

    torch.manual_seed(0)
    hq, hkv, d, bs, dtype = 9, 3, 64, 128, torch.float32
    scale = 1 / math.sqrt(d)
    blocks_per_req = math.ceil(args.seq_len / bs)
    num_blocks = blocks_per_req * args.batch
    block_table = torch.randperm(num_blocks, dtype=torch.int32).view(
        args.batch, blocks_per_req
    )
    seq_lens = torch.full((args.batch,), args.seq_len, dtype=torch.int32)
    qsl = torch.arange(args.batch + 1, dtype=torch.int32)
    keys = torch.randn(args.batch, args.seq_len, hkv, d)
    values = torch.randn(args.batch, args.seq_len, hkv, d)
    beta = torch.randn(args.batch, args.seq_len, hkv)
    query = torch.randn(args.batch, hq, d)
    positions = torch.arange(args.seq_len)
    slots = torch.cat(
        [
            block_table[r, positions // bs].long() * bs + positions % bs
            for r in range(args.batch)
        ]
    )

    def paged(width: int, with_bias: bool):
        isa = compat.cpu_attn_isa(dtype, bs, width)
        cache = torch.zeros(num_blocks, hkv, bs, 2 * width, dtype=dtype)
        key_cache, value_cache = cache.view(num_blocks, hkv, 2 * bs, width).chunk(
            2, dim=2
        )
        k, v = keys.reshape(-1, hkv, d), values.reshape(-1, hkv, d)
        if width != d:
            k, v = augment_kv(k, v, width, beta.reshape(-1, hkv) if with_bias else None)
        compat.cpu_attn_reshape_and_cache(
            k.contiguous(), v.contiguous(), key_cache, value_cache, slots, isa
        )
        meta = compat.cpu_attn_get_scheduler_metadata(
            num_reqs=args.batch,
            num_heads=hq,
            num_kv_heads=hkv,
            head_dim=width,
            seq_lens=seq_lens,
            dtype=dtype,
            query_start_loc=qsl,
            causal=True,
            sliding_window_size=-1,
            isa=isa,
            enable_kv_split=False,
        )

        def step() -> torch.Tensor:
            q = augment_query(query, width, scale) if width != d else query
            out = torch.empty(args.batch, hq, width, dtype=dtype)
            compat.cpu_attention_with_kv_cache(
                query=q,
                key_cache=key_cache,
                value_cache=value_cache,
                output=out,
                query_start_loc=qsl,
                seq_lens=seq_lens,
                scale=scale,
                causal=True,
                alibi_slopes=None,
                sliding_window=-1,
                block_table=block_table,
                softcap=0.0,
                scheduler_metadata=meta,
                s_aux=None,
            )
            return out[..., :d].contiguous()

        return step

    # side table: pages in plain torch layout [blocks, bs, H, d] + beta [blocks, bs, H]
    flat_k = torch.zeros(num_blocks * bs, hkv, d)
    flat_v = torch.zeros(num_blocks * bs, hkv, d)
    flat_b = torch.zeros(num_blocks * bs, hkv)
    flat_k[slots], flat_v[slots], flat_b[slots] = (
        keys.reshape(-1, hkv, d),
        values.reshape(-1, hkv, d),
        beta.reshape(-1, hkv),
    )

    def side_table() -> torch.Tensor:
        outs = []
        for r in range(args.batch):
            rows = block_table[r].long()[:, None] * bs + torch.arange(bs)
            rows = rows.flatten()[: args.seq_len]
            # [H, T, d]
            k, v, b = (
                flat_k[rows].transpose(0, 1),
                flat_v[rows].transpose(0, 1),
                flat_b[rows].T,
            )
            mask = b.repeat_interleave(hq // hkv, 0)[:, None, :]
            q = query[r][:, None, :]
            outs.append(
                torch.nn.functional.scaled_dot_product_attention(
                    q,
                    k.repeat_interleave(hq // hkv, 0),
                    v.repeat_interleave(hq // hkv, 0),
                    attn_mask=mask,
                )[:, 0]
            )
        return torch.stack(outs)

    stock, widened = paged(d, False), paged(80, True)
    # the three agree (stock without bias against the side table with beta = 0 is not checked;
    # widened with bias against side table with the same bias is)
    assert torch.allclose(widened(), side_table(), atol=1e-4)
    times = {
        name: _time(fn, args.repeats)
        for name, fn in (
            ("stock", stock),
            ("widened", widened),
            ("side-table", side_table),
        )
    }
    result = dict(
        seq_len=args.seq_len,
        batch=args.batch,
        dtype=str(dtype),
        heads=[hq, hkv, d],
        seconds_per_step=times,
        widened_vs_stock=times["widened"] / times["stock"],
        side_table_vs_stock=times["side-table"] / times["stock"],
        kv_bytes_per_token={"stock": 2 * d * 4, "widened": 2 * 80 * 4},
        created=time.time(),
    )
    save_result(result, args.out)
    logger.warning("%s", json.dumps(result))


if __name__ == "__main__":
    main()
