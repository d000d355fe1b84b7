"""Where the rows of a compacted cache go in paged KV blocks when every head keeps only its own
slots (varlen packing, no padding).

A paged engine gives each token slot of a block, for every layer ``l`` and KV head ``h``, room
for one key row and one value row. A packed prefix ignores that pairing: its ``n`` blocks are
``n * L * H * block_size`` row slots, numbered

    g = ((block * L + layer) * H + lane) * block_size + slot,

and the prefix fills them in this order: a header, the betas, then the cache's rows layer after
layer, each layer head after head (its ``cu_seqlens`` order). So a prefix with ``sum(t)`` slots
over all layers and heads takes about ``sum(t) * (1 + 2 / head_dim) / (L * H * block_size)``
blocks, however uneven the per-head lengths are; the padded layout takes ``max(t)`` token slots.

The header (int32: magic, version, L, H, blocks, then ``t[l, h]``) makes the blocks describe
themselves, so whoever reads them needs only the block ids. The betas are fp32, in data-row
order, ``head_dim / 2`` to a row: they travel as bytes in key rows, so they stay exact in any
storage dtype and need no spare coordinate (pages of the model's own head size can hold a packed
prefix). Header and beta rows are counted in rows of ``2 * head_dim`` bytes (the smallest row any
storage dtype gives), so the geometry depends on the cache and the block size alone, never on the
engine's dtype or page width.

Pure integer bookkeeping (no engine, no model): the vLLM loader and attention use it, and so
does the service when it reports how many prompt tokens a compacted prefix takes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "PAGED_MAGIC",
    "PREFIX_LAYOUTS",
    "PagedPacking",
    "RegionSpan",
    "tensor_parallel_heads",
]

PREFIX_LAYOUTS = ("varlen", "padded")
"""How a prefix sits in paged blocks: packed per head (this module) or every head padded to the longest."""


def tensor_parallel_heads(num_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """The KV heads rank ``rank`` of ``tp_size`` holds, as vLLM splits them: consecutive equal
    slices, or, with fewer heads than ranks, each head replicated on ``tp_size / H`` ranks."""
    if tp_size <= 1:
        return list(range(num_kv_heads))
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"{num_kv_heads} KV heads do not split over {tp_size} tensor-parallel ranks"
            )
        per_rank = num_kv_heads // tp_size
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    if tp_size % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} KV heads do not replicate over {tp_size} tensor-parallel ranks"
        )
    return [rank // (tp_size // num_kv_heads)]


PAGED_MAGIC = 0x50434C56  # "VLCP" little-endian
_PAGED_VERSION = 2  # 2: betas in rows of their own (1: in widened key coordinates)
_HEADER_FIELDS = 5  # magic, version, layers, heads, blocks


@dataclass(frozen=True)
class RegionSpan:
    """Rows ``[start, stop)`` of the region (``block`` index in the prefix, ``layer`` page)."""

    block: int
    layer: int
    start: int
    stop: int


@dataclass(frozen=True, eq=False)
class PagedPacking:
    """Geometry of one packed prefix: per-head lengths ``[L, H]``, head size, block size."""

    head_lengths: torch.Tensor  # [L, H] int64
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        lengths = torch.as_tensor(self.head_lengths, dtype=torch.int64, device="cpu")
        if lengths.dim() != 2 or lengths.numel() == 0:
            raise ValueError(
                f"head_lengths must be a non-empty [L, H] table, got shape {tuple(lengths.shape)}"
            )
        if (lengths < 0).any():
            raise ValueError("head lengths must be >= 0")
        if self.head_dim <= 0 or self.head_dim % 2 or self.block_size <= 0:
            raise ValueError(
                f"head_dim must be even and positive and block_size positive "
                f"(got {self.head_dim}, {self.block_size})"
            )
        object.__setattr__(self, "head_lengths", lengths.cpu())

    # ------------------------------------------------------------------ sizes
    @property
    def num_layers(self) -> int:
        return int(self.head_lengths.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.head_lengths.shape[1])

    @property
    def region_rows(self) -> int:
        """Rows of one (block, layer) region: ``H * block_size``."""
        return self.num_kv_heads * self.block_size

    @property
    def rows_per_block(self) -> int:
        return self.num_layers * self.region_rows

    @functools.cached_property
    def header_rows(self) -> int:
        nbytes = 4 * self.header_words(self.num_layers, self.num_kv_heads)
        return -(-nbytes // (2 * self.head_dim))

    @property
    def betas_per_row(self) -> int:
        """fp32 betas in one beta row (``2 * head_dim`` bytes)."""
        return self.head_dim // 2

    @functools.cached_property
    def beta_rows(self) -> int:
        """Rows after the header that hold the betas of every data row, in data-row order."""
        return -(-int(self.head_lengths.sum()) // self.betas_per_row)

    @property
    def data_start(self) -> int:
        """First data row: after the header and the betas."""
        return self.header_rows + self.beta_rows

    @functools.cached_property
    def layer_offsets(self) -> torch.Tensor:
        """``[L+1]`` first row of each layer (after header and betas); the last entry ends the data."""
        offsets = torch.zeros(self.num_layers + 1, dtype=torch.int64, device="cpu")
        offsets[1:] = torch.cumsum(self.head_lengths.sum(1), 0)
        return offsets + self.data_start

    @property
    def num_rows(self) -> int:
        """Header plus data rows."""
        return int(self.layer_offsets[-1])

    @property
    def num_blocks(self) -> int:
        return -(-self.num_rows // self.rows_per_block)

    @property
    def num_tokens(self) -> int:
        """Token slots (placeholder prompt tokens) the prefix occupies in the engine."""
        return self.num_blocks * self.block_size

    def cu_seqlens(self, layer: int) -> torch.Tensor:
        """``[H+1]`` int64 offsets of each head's rows within ``layer``'s rows."""
        cu = torch.zeros(self.num_kv_heads + 1, dtype=torch.int64, device="cpu")
        cu[1:] = torch.cumsum(self.head_lengths[layer], 0)
        return cu

    def layer_spans(self, layer: int) -> list[RegionSpan]:
        """The region pieces holding ``layer``'s rows, in row order."""
        return self.spans(
            int(self.layer_offsets[layer]), int(self.layer_offsets[layer + 1])
        )

    def beta_spans(self, layer: int) -> tuple[list[RegionSpan], int]:
        """The region pieces of the beta rows that hold ``layer``'s betas, and how many betas of
        the first of those rows precede them (the layer's ``sum(t)`` betas follow)."""
        first = int(self.layer_offsets[layer]) - self.data_start
        stop = int(self.layer_offsets[layer + 1]) - self.data_start
        per_row = self.betas_per_row
        start_row, stop_row = first // per_row, -(-stop // per_row)
        spans = self.spans(self.header_rows + start_row, self.header_rows + stop_row)
        return spans, first - start_row * per_row

    def spans(self, start: int, stop: int) -> list[RegionSpan]:
        """The region pieces holding rows ``[start, stop)``, in row order."""
        spans, size = [], self.region_rows
        while start < stop:
            region, offset = divmod(start, size)
            take = min(stop - start, size - offset)
            block, page = divmod(region, self.num_layers)
            spans.append(RegionSpan(block, page, offset, offset + take))
            start += take
        return spans

    # ------------------------------------------------------------------ header
    @staticmethod
    def header_words(num_layers: int, num_kv_heads: int) -> int:
        """int32 words of the header of an ``L x H`` prefix."""
        return _HEADER_FIELDS + num_layers * num_kv_heads

    def header(self) -> torch.Tensor:
        """The int32 header: magic, version, L, H, blocks, then ``t[l, h]`` row-major."""
        fields = torch.tensor(
            [
                PAGED_MAGIC,
                _PAGED_VERSION,
                self.num_layers,
                self.num_kv_heads,
                self.num_blocks,
            ],
            dtype=torch.int64,
            device="cpu",
        )
        return torch.cat([fields, self.head_lengths.reshape(-1)]).to(torch.int32)

    @classmethod
    def from_header(
        cls,
        words: torch.Tensor,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
    ) -> PagedPacking:
        """Parse the header at the start of ``words`` (int32) and check it against the engine.

        Raises:
            ValueError: the words are not a header, or describe another model or block count.
        """
        words = words.reshape(-1).to(torch.int64)
        count = cls.header_words(num_layers, num_kv_heads)
        if (
            words.numel() < count
            or int(words[0]) != PAGED_MAGIC
            or int(words[1]) != _PAGED_VERSION
        ):
            raise ValueError("the prefix blocks hold no packed-prefix header")
        if (int(words[2]), int(words[3])) != (num_layers, num_kv_heads):
            raise ValueError(
                f"the packed prefix has {int(words[2])} layers x {int(words[3])} heads, "
                f"the engine {num_layers} x {num_kv_heads}"
            )
        packing = cls(
            words[_HEADER_FIELDS:count].reshape(num_layers, num_kv_heads),
            head_dim,
            block_size,
        )
        if packing.num_blocks != int(words[4]):
            raise ValueError(
                f"the packed-prefix header says {int(words[4])} blocks, its lengths "
                f"{packing.num_blocks}"
            )
        return packing
