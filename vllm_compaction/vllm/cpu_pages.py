"""Reading token rows back from the CPU backend's KV pages.

vLLM's CPU attention keeps a layer's cache as ``[num_blocks, H, 2 * block_size, D]``: per block
and KV head, a key area then a value area of ``block_size * D`` elements each. The C++ write op
(``cpu_attn_reshape_and_cache``) stores them in an order of its own that depends on the ISA (the
key area is transposed for the vector kernels, and AMX tiles bf16 pairs). Requests on packed
prefixes attend their other tokens in torch when the pages have the model's own head size
(:mod:`.cpu_backend`), so they need those rows back.

Rather than re-implement each ISA's packing, :func:`probe_page_order` asks the op itself: it
writes tokens whose elements encode ``(slot, coordinate)`` into a scratch cache and reads where
each one landed. The result, a permutation per area, is checked to be one (every element exactly
once, the same in every block and head) and turns a read into a single gather.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm_compaction.vllm import compat

__all__ = ["PageOrder", "probe_page_order"]


@dataclass(frozen=True)
class PageOrder:
    """Where element ``(slot, j)`` of a block's key/value area sits: flat offsets
    ``key_offsets[slot, j]`` and ``value_offsets[slot, j]`` into the area's ``block_size * D``."""

    block_size: int
    head_size: int
    key_offsets: torch.Tensor  # [block_size, D] int64
    value_offsets: torch.Tensor

    def read(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[N, H, D]`` of the tokens at ``(blocks[i], slots[i])`` of one layer's
        ``kv_cache [num_blocks, H, block_size, 2 * D]`` (one gather each, batched over heads)."""
        num_blocks, heads = kv_cache.shape[:2]
        areas = kv_cache.view(num_blocks, heads, 2, self.block_size * self.head_size)
        block_index = blocks.long()[:, None, None]
        head_index = torch.arange(heads, device=kv_cache.device)[None, :, None]
        keys = areas[:, :, 0][
            block_index, head_index, self.key_offsets[slots.long()][:, None, :]
        ]
        values = areas[:, :, 1][
            block_index, head_index, self.value_offsets[slots.long()][:, None, :]
        ]
        return keys, values


@functools.lru_cache(maxsize=8)
def probe_page_order(
    dtype: torch.dtype, block_size: int, head_size: int, isa: str
) -> PageOrder:
    """The element order of ``cpu_attn_reshape_and_cache`` for pages of this dtype, geometry and ISA.

    Raises:
        RuntimeError: the op does not store each element exactly once, or not the same way in
            every block and head (an ISA this module does not understand).
    """
    blocks, heads = 2, 2
    tokens = blocks * block_size
    slots = torch.arange(tokens)
    in_block = slots % block_size
    # small integers are exact in every float dtype: slot in two base-64 digits, then coordinate
    codes = {
        "slot_low": (in_block % 64).float()[:, None].expand(tokens, head_size),
        "slot_high": (in_block // 64).float()[:, None].expand(tokens, head_size),
        "coordinate": torch.arange(head_size)
        .float()[None, :]
        .expand(tokens, head_size),
    }
    found: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, code in codes.items():
        cache = torch.full(
            (blocks, heads, 2 * block_size, head_size), -1.0, dtype=dtype
        )
        key_cache, value_cache = cache.chunk(2, dim=2)
        rows = code[:, None, :].expand(tokens, heads, head_size).to(dtype).contiguous()
        compat.cpu_attn_reshape_and_cache(
            rows,
            rows.clone(),
            key_cache,
            value_cache,
            slots,
            isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        areas = cache.view(blocks, heads, 2, -1).float()
        if not all(
            torch.equal(areas[b, h], areas[0, 0])
            for b in range(blocks)
            for h in range(heads)
        ):
            raise RuntimeError(
                f"the CPU KV write op ({isa}, {dtype}) lays out blocks or heads differently"
            )
        found[name] = (areas[0, 0, 0], areas[0, 0, 1])
    offsets = []
    for part in (0, 1):  # keys, values
        slot = found["slot_low"][part] + 64 * found["slot_high"][part]
        code = (slot * head_size + found["coordinate"][part]).long()
        if not torch.equal(code.sort().values, torch.arange(block_size * head_size)):
            raise RuntimeError(
                f"the CPU KV write op ({isa}, {dtype}) does not store each element of a "
                f"block exactly once; its pages cannot be read back"
            )
        where = torch.empty_like(code)
        where[code] = torch.arange(code.numel())
        offsets.append(where.view(block_size, head_size))
    return PageOrder(block_size, head_size, offsets[0], offsets[1])
