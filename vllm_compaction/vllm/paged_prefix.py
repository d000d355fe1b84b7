"""Varlen-packed prefixes in the engine's KV pages: writing them, reading one layer back, and
splitting a step's batch into plain requests and requests on packed prefixes.

Each backend shows its pages as key and value views of logical shape
``[num_blocks, H, block_size, D]`` (``D`` the page width, ``d`` or widened; any strides): the CPU backend
from its ``[num_blocks, H, block_size, 2 * D]`` pages (per block and head, key rows then value
rows), the CUDA one from its ``[B, H, N, 2 * D]`` pages (key and value side by side). The stock
kernels may keep rows in their own packing (the CPU key rows are ISA-packed), but the blocks of
a packed prefix are read only through this module, so their rows are stored plainly: region
``(block j, layer page l)`` of the prefix is the rows ``[H * block_size, D]`` of page ``l``'s
block ``j``, filled in the order :class:`~vllm_compaction.cache.PagedPacking` defines. The betas
are fp32 bytes in key rows of their own (:func:`.layout.pack_layers`), so they are exact in any
dtype and the pages need no spare coordinate: stock-width pages (``D = d``) hold packed prefixes
as well as widened ones. The header goes, as bytes, into the first key rows of block 0.

Pure torch (no vLLM import): both backends use it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vllm_compaction.cache import CacheError, PagedPacking
from vllm_compaction.vllm.layout import PackedPrefix
from vllm_compaction.vllm.varlen_attention import prefixes_attention
from vllm_compaction_kernels.compacted_attention import PrefixTables

__all__ = [
    "BatchSplit",
    "KernelInputs",
    "PackedRequest",
    "PagedPrefixPages",
    "attend_prefixes",
    "split_batch",
]


class PagedPrefixPages:
    """The engine's KV pages, one key and one value view ``[num_blocks, H, block_size, D]`` per
    attention layer (in layer order), seen as the rows of packed prefixes."""

    def __init__(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        head_size: int,
    ) -> None:
        if not keys or len(keys) != len(values):
            raise ValueError(
                "packed prefixes need one key and one value view per layer"
            )
        shape = tuple(keys[0].shape)
        if len(shape) != 4 or any(tuple(t.shape) != shape for t in (*keys, *values)):
            raise ValueError(
                "packed prefixes need every layer's pages in one [blocks, H, block_size, D] shape"
            )
        _, self.num_kv_heads, self.block_size, self.width = shape
        self.head_size = head_size
        if self.width < head_size:
            raise ValueError(
                f"pages of head size {self.width} cannot hold rows of {head_size}"
            )
        # views: writes land in the engine's pages
        self._keys, self._values = (
            list(keys),
            list(values),
        )

    @property
    def num_layers(self) -> int:
        return len(self._keys)

    def check(self, packing: PagedPacking) -> None:
        """Refuse a prefix whose geometry is not this engine's (one sentence saying why)."""
        engine = (self.num_layers, self.num_kv_heads, self.head_size, self.block_size)
        prefix = (
            packing.num_layers,
            packing.num_kv_heads,
            packing.head_dim,
            packing.block_size,
        )
        if engine != prefix:
            raise CacheError(
                f"the packed prefix has layers x KV heads x head size x block size "
                f"{prefix}, the engine {engine}"
            )

    # ------------------------------------------------------------------ write
    def write(
        self, prefix: PackedPrefix, block_ids: Sequence[int], first_block: int = 0
    ) -> None:
        """Write blocks ``first_block..`` of ``prefix`` into the engine blocks ``block_ids[...]``.

        ``block_ids`` are the request's prefix blocks (all of them); blocks before
        ``first_block`` already hold their content (prefix-cache hits).
        """
        packing = prefix.packing
        self.check(packing)
        if len(block_ids) < packing.num_blocks:
            raise CacheError(
                f"the packed prefix needs {packing.num_blocks} blocks, the request has "
                f"{len(block_ids)}"
            )
        if first_block >= packing.num_blocks:
            return
        dtype, d = self._keys[0].dtype, self.head_size
        if prefix.keys.dtype != dtype:
            raise CacheError(
                f"the packed prefix was laid out in {prefix.keys.dtype}, the engine's pages are {dtype}"
            )
        # stage only the blocks to write, in page width (spare coordinates, if any, stay zero)
        shape = (
            packing.num_blocks - first_block,
            packing.num_layers,
            self.num_kv_heads,
            self.block_size,
        )
        rows = slice(
            first_block * packing.rows_per_block,
            packing.num_blocks * packing.rows_per_block,
        )
        keys = torch.zeros(*shape, self.width, dtype=dtype)
        values = torch.zeros(*shape, self.width, dtype=dtype)
        keys[..., :d] = prefix.keys[rows].view(*shape, d)
        values[..., :d] = prefix.values[rows].view(*shape, d)
        blocks = torch.as_tensor(
            list(block_ids[first_block : packing.num_blocks]), dtype=torch.long
        )
        blocks = blocks.to(self._keys[0].device)
        for layer in range(self.num_layers):
            self._keys[layer][blocks] = keys[:, layer].to(self._keys[layer].device)
            self._values[layer][blocks] = values[:, layer].to(
                self._values[layer].device
            )
        if first_block == 0:
            header = packing.header().view(torch.uint8)
            header_rows = self._header_rows(int(block_ids[0]), header.numel())
            staged = torch.zeros(header_rows.shape, dtype=dtype)
            staged.view(-1).view(torch.uint8)[: header.numel()] = header
            header_rows.copy_(staged)

    def _header_rows(self, first_block: int, nbytes: int) -> torch.Tensor:
        """The first key rows of lane 0 of ``first_block``: enough of them for ``nbytes``."""
        row_bytes = self.width * self._keys[0].element_size()
        return self._keys[0][first_block, 0, : -(-nbytes // row_bytes)]

    # ------------------------------------------------------------------ read
    def packing_at(self, first_block: int) -> PagedPacking:
        """The geometry recorded in the header of the prefix that starts at ``first_block``."""
        words = PagedPacking.header_words(self.num_layers, self.num_kv_heads)
        rows = self._header_rows(first_block, 4 * words).cpu().contiguous()
        raw = rows.view(-1).view(torch.uint8)[: 4 * words].clone().view(torch.int32)
        try:
            return PagedPacking.from_header(
                raw,
                num_layers=self.num_layers,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size,
                block_size=self.block_size,
            )
        except ValueError as exc:
            raise CacheError(f"block {first_block}: {exc}") from None

    def layer_rows(
        self,
        packing: PagedPacking,
        layer: int,
        block_ids: torch.Tensor,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s rows of the prefix in ``block_ids``: keys ``[N, d]``, beta ``[N]``
        (fp32), values ``[N, d]``, head after head (``packing.cu_seqlens(layer)``). ``out``: key
        and value buffers ``[N, D]`` (contiguous rows) to copy the rows into instead of new ones."""
        d = self.head_size
        count = int(packing.layer_offsets[layer + 1] - packing.layer_offsets[layer])
        if not count:
            empty = self._keys[0].new_zeros(0, d)
            return empty, empty.new_zeros(0, dtype=torch.float32), empty
        spans = packing.layer_spans(layer)
        keys = self._gather(
            self._keys, spans, block_ids, None if out is None else out[0]
        )
        values = self._gather(
            self._values, spans, block_ids, None if out is None else out[1]
        )
        beta_spans, skip = packing.beta_spans(layer)
        beta_rows = self._gather(self._keys, beta_spans, block_ids)[:, :d].contiguous()
        betas = (
            beta_rows.view(torch.uint8)
            .view(beta_rows.shape[0], -1)[:, : 2 * d]
            .contiguous()
            .view(torch.float32)
        )
        return keys[:, :d], betas.reshape(-1)[skip : skip + count], values[:, :d]

    def kernel_tables(
        self,
        packings: Sequence[PagedPacking | None],
        block_ids: Sequence[torch.Tensor | Sequence[int] | None],
    ) -> PrefixTables:
        """Where the prefix rows of every layer lie for a batch of requests (``None``: a request
        without a prefix), as the compacted-attention kernel reads them in place. Host arithmetic
        on the packings, copied to the device once per step; every layer's call reuses it."""
        keys, values = self._keys, self._values
        size, device = keys[0].element_size(), keys[0].device
        key_offsets = [(k.data_ptr() - keys[0].data_ptr()) // size for k in keys]
        deltas = {v.data_ptr() - k.data_ptr() for k, v in zip(keys, values)}
        if (
            len(deltas) != 1
            or deltas.pop() != values[0].data_ptr() - keys[0].data_ptr()
        ):
            raise CacheError(
                "the compacted-prefix kernel needs every layer's values at one offset from its keys"
            )
        num_layers, num_heads = self.num_layers, self.num_kv_heads
        regions = max(
            [num_layers * len(b) for b in block_ids if b is not None], default=1
        )
        bases = torch.zeros(len(packings), regions, dtype=torch.int64, device="cpu")
        head_rows = torch.zeros(
            num_layers, len(packings), num_heads, 2, dtype=torch.int32, device="cpu"
        )
        beta_rows = torch.zeros(len(packings), 2, dtype=torch.int32, device="cpu")
        offsets = torch.tensor(key_offsets, dtype=torch.int64, device="cpu")
        total_rows, max_rows = [0] * num_layers, [0] * num_layers
        for r, (packing, ids) in enumerate(zip(packings, block_ids)):
            if packing is None or ids is None:
                continue
            ids = torch.as_tensor(ids, dtype=torch.int64, device="cpu")[
                : packing.num_blocks
            ]
            index = torch.arange(packing.num_blocks * num_layers, device="cpu")
            bases[r, : index.numel()] = (
                ids[index // num_layers] * keys[0].stride(0)
                + offsets[index % num_layers]
            )
            starts = (
                packing.layer_offsets[:-1, None]
                + torch.cumsum(packing.head_lengths, 1)
                - packing.head_lengths
            )
            head_rows[:, r, :, 0] = starts.to(torch.int32)
            head_rows[:, r, :, 1] = packing.head_lengths.to(torch.int32)
            beta_rows[r, 0], beta_rows[r, 1] = packing.header_rows, packing.data_start
            total_rows = [
                t + int(n)
                for t, n in zip(total_rows, packing.head_lengths.sum(1).tolist())
            ]
            max_rows = [
                max(m, int(n))
                for m, n in zip(max_rows, packing.head_lengths.amax(1).tolist())
            ]
        shifts = [-o for o in key_offsets]
        multiple = 16
        while multiple > 1 and any(
            o % multiple for o in [*key_offsets, keys[0].stride(0)]
        ):
            multiple //= 2
        return PrefixTables(
            region_bases=bases.to(device),
            head_rows=head_rows.to(device),
            beta_rows=beta_rows.to(device),
            beta_words=_fp32_alias(keys[0]),
            layer_shifts=shifts,
            total_rows=total_rows,
            max_rows=max_rows,
            prefixed=sum(
                p is not None and b is not None for p, b in zip(packings, block_ids)
            ),
            offset_multiple=multiple,
        )

    def layers_rows(
        self,
        packings: Sequence[PagedPacking],
        layer: int,
        block_ids: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s rows of several prefixes, each padded to the longest: keys and values
        ``[R, N, d]`` (zero padding), beta ``[R, N]`` (fp32) and ``cu_seqlens [R, H + 1]``, the
        rows of prefix ``r``'s head ``h`` being ``cu_seqlens[r, h]:cu_seqlens[r, h + 1]``."""
        cu_seqlens = torch.stack([packing.cu_seqlens(layer) for packing in packings])
        counts = cu_seqlens[:, -1].tolist()
        rows = max(counts)
        keys = self._keys[0].new_empty(len(packings), rows, self.width)
        values = self._values[0].new_empty(len(packings), rows, self.width)
        beta = torch.zeros(len(packings), rows, dtype=torch.float32, device=keys.device)
        for r, (packing, blocks, count) in enumerate(zip(packings, block_ids, counts)):
            keys[r, count:] = 0  # padding: finite, and masked out by the caller
            values[r, count:] = 0
            if count:
                _, beta[r, :count], _ = self.layer_rows(
                    packing, layer, blocks, out=(keys[r, :count], values[r, :count])
                )
        return (
            keys[..., : self.head_size],
            beta,
            values[..., : self.head_size],
            cu_seqlens.to(keys.device),
        )

    def _gather(
        self,
        pages: list[torch.Tensor],
        spans,
        block_ids: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The rows of ``spans`` (a region's rows run lane after lane) into ``out`` or a new
        ``[rows, D]`` tensor, copied once from the pages: whole lanes at once, partial lanes at
        the ends."""
        size = self.block_size
        if out is None:
            out = pages[0].new_empty(
                sum(span.stop - span.start for span in spans), self.width
            )
        row = 0
        for span in spans:
            block = pages[span.layer][int(block_ids[span.block])]  # [H, block_size, D]
            start = span.start
            while start < span.stop:
                lane, slot = divmod(start, size)
                whole = (span.stop - start) // size if slot == 0 else 0
                if whole:
                    take = whole * size
                    out[row : row + take].view(whole, size, -1).copy_(
                        block[lane : lane + whole]
                    )
                else:
                    take = min(size - slot, span.stop - start)
                    out[row : row + take].copy_(block[lane, slot : slot + take])
                row, start = row + take, start + take
        return out


def _fp32_alias(pages: torch.Tensor) -> torch.Tensor:
    """A flat fp32 tensor over the memory of ``pages`` from its first element on (the beta rows
    hold fp32 bytes whatever the page dtype)."""
    storage = pages.untyped_storage()
    offset = pages.data_ptr() - storage.data_ptr()
    if offset % 4:
        raise CacheError("the KV pages are not 4-byte aligned")
    return torch.empty(0, dtype=torch.float32, device=pages.device).set_(
        storage, offset // 4, ((storage.nbytes() - offset) // 4,), (1,)
    )


# ---------------------------------------------------------------------- a step's batch
@dataclass
class PackedRequest:
    """One request on a packed prefix: its query rows within the packed sub-batch, its prefix
    blocks and their geometry."""

    tokens: torch.Tensor
    blocks: torch.Tensor
    packing: PagedPacking


@dataclass
class KernelInputs:
    """A step's batch for :func:`vllm_compaction_kernels.compacted_attention.compacted_attention`:
    ``block_table [R, B]`` and ``seq_lens [R]`` after each request's prefix, the prefix tables,
    and ``max_keys``, a host bound on the keys any request attends (prefix rows + suffix)."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    tables: PrefixTables
    max_keys: int


@dataclass
class BatchSplit:
    """A batch's requests split into plain ones and ones on packed prefixes.

    ``*_rows`` index requests of the batch, ``*_tokens`` its query rows. For the packed requests
    ``block_table`` and ``seq_lens`` have the prefix cut off (what the stock kernel attends),
    ``query_start_loc`` is relative to ``packed_tokens``.
    """

    plain_rows: list[int]
    plain_tokens: torch.Tensor
    packed_rows: list[int]
    packed_tokens: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    requests: list[PackedRequest]
    _groups: list[tuple[torch.Tensor, PackedRequest]] | None = field(
        default=None, repr=False
    )
    _kernel: KernelInputs | None = field(default=None, repr=False)

    def kernel_inputs(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        pages: PagedPrefixPages,
    ) -> KernelInputs:
        """The whole batch as the compacted-attention kernel takes it (built by a step's first
        layer, reused by the others): every request's block table and length after its prefix
        (unchanged for plain requests) and where the prefix rows lie."""
        if self._kernel is None:
            num_reqs = seq_lens.shape[0]
            rows = torch.tensor(
                self.packed_rows, dtype=torch.long, device=block_table.device
            )
            table, lengths = block_table[:num_reqs].clone(), seq_lens.clone()
            table[rows], lengths[rows] = self.block_table, self.seq_lens
            packings: list[PagedPacking | None] = [None] * num_reqs
            blocks: list[torch.Tensor | None] = [None] * num_reqs
            for row, request in zip(self.packed_rows, self.requests):
                packings[row], blocks[row] = request.packing, request.blocks.cpu()
            longest_head = max(int(r.packing.head_lengths.max()) for r in self.requests)
            self._kernel = KernelInputs(
                table,
                lengths,
                pages.kernel_tables(packings, blocks),
                max_keys=longest_head + max_seq_len,
            )
        return self._kernel

    @functools.cached_property
    def query_offsets(self) -> torch.Tensor:
        """Per packed query row, how many tokens after its prefix it stands (``[m]`` int64):
        the logical distance a sliding window counts from the prefix's last keys."""
        counts = self.query_start_loc.diff().to(torch.int64)
        request = torch.repeat_interleave(
            torch.arange(counts.numel(), device=counts.device), counts
        )
        within = (
            torch.arange(int(counts.sum()), device=counts.device)
            - self.query_start_loc[:-1].to(torch.int64)[request]
        )
        first = (
            self.seq_lens.to(torch.int64) - counts
        )  # suffix tokens before this step's
        return first[request] + within

    def plain_query_start_loc(self, query_start_loc: torch.Tensor) -> torch.Tensor:
        return _sub_starts(query_start_loc, self.plain_rows)

    def prefix_groups(self) -> list[tuple[torch.Tensor, PackedRequest]]:
        """The packed requests grouped by their prefix blocks: the query rows of each group and
        one request standing for it (all of a group read the same rows)."""
        if self._groups is None:
            groups: dict[tuple[int, ...], list[PackedRequest]] = {}
            for request in self.requests:
                groups.setdefault(tuple(request.blocks.tolist()), []).append(request)
            self._groups = [
                (torch.cat([r.tokens for r in members]), members[0])
                for members in groups.values()
            ]
        return self._groups


def _sub_starts(query_start_loc: torch.Tensor, rows: list[int]) -> torch.Tensor:
    lengths = (query_start_loc[1:] - query_start_loc[:-1])[rows]
    starts = torch.zeros(
        len(rows) + 1, dtype=query_start_loc.dtype, device=query_start_loc.device
    )
    starts[1:] = torch.cumsum(lengths, 0)
    return starts


def _tokens(starts: list[int], rows: list[int], device) -> torch.Tensor:
    parts = [torch.arange(starts[r], starts[r + 1], device=device) for r in rows]
    return (
        torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)
    )


def split_batch(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    prefixes: dict[int, int],
    pages: PagedPrefixPages,
) -> BatchSplit | None:
    """Split a batch by the first block of each request (``prefixes``: first block id -> prefix
    blocks, from the connector). None when no request starts on a packed prefix."""
    num_reqs = query_start_loc.numel() - 1
    first_blocks = block_table[:num_reqs, 0].tolist()
    packed_rows = [r for r, block in enumerate(first_blocks) if block in prefixes]
    if not packed_rows:
        return None
    packed = set(packed_rows)
    plain_rows = [r for r in range(num_reqs) if r not in packed]
    starts, device = query_start_loc.tolist(), block_table.device
    cut = torch.tensor([prefixes[first_blocks[r]] for r in packed_rows], device=device)
    width = block_table.shape[1]
    shifted = (torch.arange(width, device=device)[None, :] + cut[:, None]).clamp_max(
        width - 1
    )
    rows = torch.tensor(packed_rows, device=device)
    requests, offset = [], 0
    for row, blocks in zip(packed_rows, cut.tolist()):
        count = starts[row + 1] - starts[row]
        prefix_blocks = block_table[row, :blocks].clone()
        requests.append(
            PackedRequest(
                torch.arange(offset, offset + count, device=device),
                prefix_blocks,
                pages.packing_at(int(prefix_blocks[0])),
            )
        )
        offset += count
    return BatchSplit(
        plain_rows=plain_rows,
        plain_tokens=_tokens(starts, plain_rows, device),
        packed_rows=packed_rows,
        packed_tokens=_tokens(starts, packed_rows, device),
        block_table=torch.gather(block_table[rows], 1, shifted.to(torch.long)),
        seq_lens=seq_lens[rows] - (cut * pages.block_size).to(seq_lens.dtype),
        query_start_loc=_sub_starts(query_start_loc, packed_rows),
        requests=requests,
    )


#: Prefix groups with at most this many query rows (decode steps, short chunks) are attended in
#: one call over all their prefixes (:func:`.varlen_attention.prefixes_attention`); longer
#: prefill chunks get a call of their own, where padding the queries to a common length would cost.
BATCHED_PREFIX_QUERY_ROWS = 16


def attend_prefixes(
    query: torch.Tensor,
    split: BatchSplit,
    pages: PagedPrefixPages,
    layer: int,
    scale: float,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the packed requests' queries ``[m, Hq, d]`` (``split.packed_tokens`` order)
    over their prefixes in ``layer``: fp32 ``out [m, Hq, d]`` and ``lse [m, Hq]``; a sliding
    ``window`` hides the rows each query's window has passed.

    Requests on the same prefix blocks (sessions on one cached prefix) are one group: the layer's
    rows are read once and their queries share the GEMMs. Groups with few query rows (decode
    steps of sessions on different prefixes) are attended together in one batched call.
    """
    m, num_q_heads, d = query.shape
    out = torch.empty(m, num_q_heads, d, dtype=torch.float32, device=query.device)
    lse = torch.empty(m, num_q_heads, dtype=torch.float32, device=query.device)
    offsets = split.query_offsets if window is not None else None
    groups = split.prefix_groups()
    small = [g for g in groups if g[0].numel() <= BATCHED_PREFIX_QUERY_ROWS]
    alone = (
        groups
        if len(small) < 2
        else [g for g in groups if g[0].numel() > BATCHED_PREFIX_QUERY_ROWS]
    )
    for tokens, request in alone:
        keys, beta, values = pages.layer_rows(request.packing, layer, request.blocks)
        cu_seqlens = request.packing.cu_seqlens(layer).to(keys.device)
        part_out, part_lse = prefixes_attention(
            query[tokens][None],
            keys[None],
            beta[None],
            values[None],
            cu_seqlens[None],
            scale,
            window=window,
            query_offsets=None if offsets is None else offsets[tokens][None],
        )
        out[tokens], lse[tokens] = part_out[0], part_lse[0]
    if len(small) >= 2:
        _attend_together(query, small, pages, layer, scale, out, lse, window, offsets)
    return out, lse


def _attend_together(
    query: torch.Tensor,
    groups: list[tuple[torch.Tensor, PackedRequest]],
    pages: PagedPrefixPages,
    layer: int,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: int | None,
    offsets: torch.Tensor | None,
) -> None:
    """One :func:`prefixes_attention` call for ``groups``: their rows padded to the longest prefix,
    their query rows to the largest group (padding query rows repeat a real one and are dropped)."""
    keys, beta, values, cu_seqlens = pages.layers_rows(
        [request.packing for _, request in groups],
        layer,
        [request.blocks for _, request in groups],
    )
    width = max(tokens.numel() for tokens, _ in groups)
    index = torch.stack(
        [
            torch.cat([tokens, tokens[-1:].expand(width - tokens.numel())])
            for tokens, _ in groups
        ]
    )
    real = torch.stack(
        [
            torch.arange(width, device=index.device) < tokens.numel()
            for tokens, _ in groups
        ]
    )
    part_out, part_lse = prefixes_attention(
        query[index],
        keys,
        beta,
        values,
        cu_seqlens,
        scale,
        window=window,
        query_offsets=None if offsets is None else offsets[index],
    )
    out[index[real]], lse[index[real]] = part_out[real], part_lse[real]
