"""A ``CompactedCache`` as the rows a paged KV cache holds: one physical prefix per request.

Two layouts, named in the request's salt (:class:`.prompt.CompactedRef`):

* ``varlen`` (:func:`packed_prefix`): every head stores only its own slots, packed back to back
  across heads and layers into whole blocks (:class:`~vllm_compaction.cache.PagedPacking`); the
  prefix takes about ``sum(t) / (L * H)`` token slots. Only the compaction attention reads
  these blocks (:mod:`.paged_prefix`, :mod:`.varlen_attention`).
* ``padded`` (:func:`physical_prefix`): the stock kernels read the prefix like any other tokens.
  With per-slot biases or masked padding it needs the bias coordinates of widened pages; a
  *bias-free* cache (:func:`bias_free`: every head the same length, beta = 0, as for an identity
  cache or truncation) is read as it is from stock-width pages too, by the stock kernels alone.

Padded layout: every layer and head of the prefix gets the same number of physical slots ``P``
(the longest head of the cache): head ``h`` of layer ``l`` fills its first ``t_{l,h}`` slots and the rest are masked
padding (``MASKED_BETA``, zero keys and values). Keys are re-based by ``-(T - P)`` positions so
continuation tokens at physical positions ``P, P+1, ...`` see them as at ``T, T+1, ...``.

Hybrid models (Gemma-3): a sliding-window layer is never compacted; its heads hold the prefix's
last keys, exact and in order (:func:`check_sliding_layers`), and each layer is re-based with its
own RoPE (Gemma-3 has a local and a global base). In the padded layout they are right-aligned,
so they sit at the physical positions the stock kernel's window counts back from ``P``; in the
varlen layout the compaction attention hides the rows a query's window has passed.

The padding costs ``P * L * H - sum(t)`` slots per cache, which the varlen layout removes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_compaction.cache import PREFIX_LAYOUTS as LAYOUTS  # noqa: N811
from vllm_compaction.cache import CompactedCache, PagedPacking
from vllm_compaction.models.rope import layer_windows, rotate_keys
from vllm_compaction.vllm.bias import MASKED_BETA

__all__ = [
    "DEFAULT_LAYOUT",
    "LAYOUTS",
    "PackedPrefix",
    "PhysicalPrefix",
    "bias_free",
    "check_sliding_layers",
    "pack_layers",
    "packed_prefix",
    "physical_prefix",
]

DEFAULT_LAYOUT = "varlen"
"""Both compaction backends read packed prefixes; ``padded`` stays available per prompt."""


def bias_free(cache: CompactedCache) -> bool:
    """Whether the padded layout of ``cache`` needs no bias at all: every head of every layer has
    the same number of slots (no masked padding) and every beta is 0."""
    lengths = cache.head_lengths
    return bool((lengths == lengths.max()).all()) and all(
        not layer.beta.any() for layer in cache.layers
    )


def _layer_types(rope_config, num_layers: int) -> list[str | None]:
    config = getattr(rope_config, "text_config", None) or rope_config
    types = getattr(config, "layer_types", None)
    return list(types) if types else [None] * num_layers


def check_sliding_layers(cache: CompactedCache, rope_config) -> list[int | None]:
    """The sliding window of each layer (None: global), after checking that every head of a
    sliding layer holds the prefix's last keys in order (positions ``T - t_h .. T - 1``) and at
    least the ``W - 1`` a continuation sees: the serving paths place and mask them by that order.
    Raises ValueError (one sentence) for a cache that does not."""
    windows = layer_windows(rope_config)
    if len(windows) != len(cache.layers):
        raise ValueError(
            f"the model has {len(windows)} layers, the cache {len(cache.layers)}"
        )
    total = cache.logical_length
    for index, (layer, window) in enumerate(zip(cache.layers, windows)):
        if window is None:
            continue
        lengths = layer.cu_seqlens.diff().to(torch.int64).cpu()
        starts = layer.cu_seqlens[:-1].to(torch.int64).cpu()
        heads = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        rows = torch.arange(int(lengths.sum()))
        expected = total - lengths[heads] + (rows - starts[heads])
        if (lengths < min(total, window - 1)).any() or not torch.equal(
            layer.indices.cpu().to(torch.int64), expected
        ):
            raise ValueError(
                f"layer {index} slides over {window} tokens, but the cache's rows there are not "
                f"the prefix's last {min(total, window - 1)} tokens in order (a sliding layer must "
                "not be compacted)"
            )
    return windows


@dataclass(frozen=True)
class PhysicalPrefix:
    """Per layer ``keys [P, H, d]``, ``values [P, H, d]`` and ``beta [P, H]`` (fp32)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    beta: list[torch.Tensor]
    logical_length: int

    @property
    def num_slots(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    @property
    def bias_free(self) -> bool:
        """Every slot has beta = 0 (no bias, no masked padding): stock kernels read it as it is."""
        return all(not b.any() for b in self.beta)

    @property
    def padding_fraction(self) -> float:
        """Share of the physical slots that are masked padding."""
        total = sum(b.numel() for b in self.beta)
        masked = sum(int((b <= MASKED_BETA).sum()) for b in self.beta)
        return masked / total if total else 0.0


def physical_prefix(
    cache: CompactedCache,
    rope_config,
    *,
    dtype: torch.dtype | None = None,
    heads: Sequence[int] | None = None,
) -> PhysicalPrefix:
    """Lay ``cache`` out as ``P = cache.max_head_length`` physical slots per head.

    ``rope_config`` is the model's HF config (for the RoPE frequencies); ``dtype`` casts keys and
    values (beta stays fp32); ``heads``: only these KV heads (a tensor-parallel rank's).
    """
    slots = cache.max_head_length
    shift = slots - cache.logical_length  # <= 0: keys move back by T - P positions
    windows = check_sliding_layers(cache, rope_config)
    types = _layer_types(rope_config, len(cache.layers))
    keys_out, values_out, beta_out = [], [], []
    for layer, window, layer_type in zip(cache.layers, windows, types):
        if heads is not None:
            layer = layer.select(heads)
        # [H, t_l, d], [H, t_l] with -inf padding
        keys, beta, values, _ = layer.padded()
        pad = slots - keys.shape[1]
        keys = torch.nn.functional.pad(keys, (0, 0, 0, pad))
        values = torch.nn.functional.pad(values, (0, 0, 0, pad))
        beta = torch.nn.functional.pad(beta, (0, pad), value=float("-inf"))
        if window is not None:
            # a sliding layer's rows end at P - 1, where the stock kernel's window counts back from
            keys, values, beta = _right_align(keys, values, beta)
        beta = torch.where(
            torch.isfinite(beta), beta, torch.full_like(beta, MASKED_BETA)
        )
        if shift:
            keys = rotate_keys(keys, shift, rope_config, layer_type)
        cast = dtype or keys.dtype
        keys_out.append(keys.transpose(0, 1).to(cast).contiguous())
        values_out.append(values.transpose(0, 1).to(cast).contiguous())
        beta_out.append(beta.transpose(0, 1).contiguous())
    return PhysicalPrefix(keys_out, values_out, beta_out, cache.logical_length)


def _right_align(
    keys: torch.Tensor, values: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per head, move its real slots to the end of the slot axis: :meth:`padded` puts them first,
    in order, so each head turns by its count (slot ``s`` takes slot ``(s + count) % P``)."""
    count = torch.isfinite(beta).sum(dim=1, keepdim=True)  # [H, 1]
    slots = beta.shape[1]
    order = (torch.arange(slots, device=beta.device)[None, :] + count) % slots
    return (
        keys.gather(1, order[..., None].expand_as(keys)),
        values.gather(1, order[..., None].expand_as(values)),
        beta.gather(1, order),
    )


@dataclass(frozen=True)
class PackedPrefix:
    """A cache's rows in packed order (:class:`PagedPacking`): ``keys``/``values [rows, d]`` with
    ``rows = blocks * L * H * block_size``. The beta rows of ``keys`` hold the fp32 betas as bytes
    (:func:`pack_layers`); header, value rows beside them and tail rows are zero."""

    packing: PagedPacking
    keys: torch.Tensor
    values: torch.Tensor
    logical_length: int


def pack_layers(
    packing: PagedPacking,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    beta: list[torch.Tensor],
    *,
    dtype: torch.dtype,
    logical_length: int,
) -> PackedPrefix:
    """Per layer ``keys``/``values [sum_h t_{l,h}, d]`` and ``beta [sum_h t_{l,h}]`` (head after
    head) -> the packed rows, with the betas written as fp32 bytes into the beta rows."""
    rows, d = packing.num_blocks * packing.rows_per_block, packing.head_dim
    key_rows = torch.zeros(rows, d, dtype=dtype)
    value_rows = torch.zeros(rows, d, dtype=dtype)
    for index, (layer_keys, layer_values) in enumerate(zip(keys, values)):
        start, stop = (
            int(packing.layer_offsets[index]),
            int(packing.layer_offsets[index + 1]),
        )
        key_rows[start:stop] = layer_keys.to(dtype)
        value_rows[start:stop] = layer_values.to(dtype)
    betas = torch.zeros(packing.beta_rows * packing.betas_per_row, dtype=torch.float32)
    flat = torch.cat([b.reshape(-1).float() for b in beta]) if beta else betas[:0]
    betas[: flat.numel()] = flat
    # the first 2 * d bytes of each beta row: as many as a row has in the narrowest dtype
    row_bytes = key_rows.view(torch.uint8).view(rows, -1)
    beta_rows = slice(packing.header_rows, packing.data_start)
    row_bytes[beta_rows, : 2 * d] = betas.view(torch.uint8).view(
        packing.beta_rows, 2 * d
    )
    return PackedPrefix(packing, key_rows, value_rows, logical_length)


def packed_prefix(
    cache: CompactedCache,
    rope_config,
    *,
    block_size: int,
    dtype: torch.dtype | None = None,
    heads: Sequence[int] | None = None,
    num_slots: int | None = None,
) -> PackedPrefix:
    """Lay ``cache`` out varlen in blocks of ``block_size`` token slots.

    Keys are re-based by ``-(T - P)`` with ``P = num_slots`` (default ``packing.num_tokens``),
    as in the padded layout: the continuation starts at physical position ``P``. ``heads``: only
    these KV heads (a tensor-parallel rank's), packed into the first of the prompt's ``P`` slots,
    which the rank with the most rows fills.
    """
    packing = cache.paged_packing(block_size, heads)
    slots = packing.num_tokens if num_slots is None else num_slots
    if slots < packing.num_tokens:
        raise ValueError(
            f"the packed prefix needs {packing.num_tokens} slots, the prompt has {slots}"
        )
    shift = slots - cache.logical_length
    check_sliding_layers(cache, rope_config)
    types = _layer_types(rope_config, len(cache.layers))
    layers = [layer if heads is None else layer.select(heads) for layer in cache.layers]
    keys = [
        rotate_keys(layer.keys, shift, rope_config, layer_type) if shift else layer.keys
        for layer, layer_type in zip(layers, types)
    ]
    return pack_layers(
        packing,
        keys,
        [layer.values for layer in layers],
        [layer.beta for layer in layers],
        dtype=dtype or cache.dtype,
        logical_length=cache.logical_length,
    )
