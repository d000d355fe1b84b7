"""vLLM's CPU attention backend with a per-slot logit bias (see :mod:`.bias`).

Two page widths (:func:`.backend_common.page_width`), chosen when the engine starts:

* ``stock`` (the CPU default): pages keep the model's head size, and a step with no request on a
  packed prefix runs vLLM's own forward untouched, so plain traffic pays nothing. Requests whose
  prefix is packed varlen (:mod:`.paged_prefix`) are split off the batch: the prefix is attended
  per head with its betas in torch, the tokens after it by the stock kernel run twice (without
  and with a sink), and the parts merge exactly (:mod:`.varlen_attention`); the rare tokens whose
  merge is ill-conditioned are attended from the pages read back (:mod:`.cpu_pages`) in torch.
  Padded prefixes need the bias coordinates and are refused.
* ``widened``: every decoder attention layer widens its KV pages from ``d`` to
  ``augmented_head_size(d)`` coordinates; queries get ``1/scale`` in the bias coordinates and the
  stock C++ kernels (``cpu_attn_reshape_and_cache``, ``cpu_attention_with_kv_cache``) do the rest,
  ISA packing included, so padded prefixes run in the stock kernel. Requests on packed prefixes
  attend the tokens after the prefix in the stock kernel with an attention sink, merged exactly
  with the prefix (:func:`.varlen_attention.merge_with_prefix`).

Without the connector the class behaves exactly like ``CPUAttentionBackend``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from vllm_compaction.models.rope import layer_windows
from vllm_compaction.vllm import compat
from vllm_compaction.vllm.backend_common import (
    AugmentedHeadSizes,
    CompactionImplMixin,
    step_state,
)
from vllm_compaction.vllm.bias import augment_kv, augment_query, augmented_head_size
from vllm_compaction.vllm.cpu_pages import probe_page_order
from vllm_compaction.vllm.paged_prefix import (
    BatchSplit,
    PagedPrefixPages,
    attend_prefixes,
)
from vllm_compaction.vllm.varlen_attention import (
    masked_attention,
    merge_by_lse,
    merge_two_calls,
    merge_with_prefix,
    sink_for,
)

__all__ = [
    "CompactionCPUAttentionBackend",
    "CompactionCPUAttentionImpl",
    "cpu_augmented_head_size",
    "SUFFIX_FROM_PAGES_ENV",
]

#: Set to "1" in the engine's environment to attend *every* token after a packed prefix on
#: stock-width pages from the pages read back in torch, the fallback otherwise taken only by the
#: rare tokens whose two-call merge is ill-conditioned: for tests and diagnostics of that path.
SUFFIX_FROM_PAGES_ENV = "VLLM_COMPACTION_SUFFIX_FROM_PAGES"

logger = logging.getLogger(__name__)


def cpu_augmented_head_size(head_size: int) -> int:
    """The widened page size of a head: the next size the CPU kernels support (64 -> 80)."""
    return augmented_head_size(
        head_size, CPUAttentionBackend.get_supported_head_sizes()
    )


class CompactionCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CompactionCPUAttentionImpl]:
        return CompactionCPUAttentionImpl

    @classmethod
    def customize_spec(cls, spec):
        return CompactionCPUAttentionImpl.head_sizes.widen_spec(
            super().customize_spec(spec)
        )


class CompactionCPUAttentionImpl(CompactionImplMixin, CPUAttentionBackendImpl):
    """Splits steps with requests on packed prefixes; with widened pages, pads q/k/v into the
    augmented head size around the stock kernels."""

    head_sizes = AugmentedHeadSizes("CPU_ATTN")
    augmented_size = staticmethod(cpu_augmented_head_size)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.suffix_from_pages = os.environ.get(SUFFIX_FROM_PAGES_ENV) == "1"
        config = get_current_vllm_config()
        self._set_up_compaction(
            config, holds_kv=self.attn_type == AttentionType.DECODER
        )
        window = self.sliding_window
        self.window: int | None = None if window in (None, -1) else int(window)
        # the stock builder's scheduler metadata assumes a window only if every layer has it
        hf_config = getattr(config.model_config, "hf_config", None)
        windows = set(layer_windows(hf_config)) if hf_config else {self.window}
        shared = windows.pop() if len(windows) == 1 else None
        self.group_window = -1 if shared is None else shared

    def _check_supported(self, width: str) -> None:
        if width == "stock" and (
            self.alibi_slopes is not None
            or self.logits_soft_cap
            or self.sinks is not None
        ):
            raise ValueError(
                "compacted prefixes on stock-width pages do not support ALiBi, attention "
                "softcapping or sinks yet; start the engine with pages='widened'"
            )

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ) -> torch.Tensor:
        split = (
            _split_for(attn_metadata, self, layer, query.dtype)
            if self.compaction and attn_metadata is not None
            else None
        )
        # no compaction, warm-up, or a plain step
        if self.augmented is None and split is None:
            return super().forward(
                layer,
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                output,
                output_scale,
                output_block_scale,
            )
        n = attn_metadata.num_actual_tokens
        plain_query = query[:n].view(n, self.num_heads, self.head_size)
        result = output[:n].view(n, self.num_heads, self.head_size)
        # stock width: the parts are written into the output directly
        if self.augmented is None:
            q, out = plain_query, result
        else:
            q = augment_query(plain_query, self.augmented, self.scale)
            out = torch.empty_like(q)
        if split is None:
            super().forward(
                layer,
                q,
                key,
                value,
                kv_cache,
                attn_metadata,
                out,
                output_scale,
                output_block_scale,
            )
        else:
            if split.plain is not None:
                tokens = split.split.plain_tokens
                plain_q = q[tokens]
                part = torch.empty_like(plain_q)
                super().forward(layer, plain_q, key, value, kv_cache, split.plain, part)
                out[tokens] = part
            if self.augmented is None:
                self._forward_packed_stock(layer, plain_query, kv_cache, split, out)
            else:
                self._forward_packed_widened(
                    layer, q, plain_query, kv_cache, split, out
                )
        if out is not result:
            result.copy_(out[..., : self.head_size])
        return output

    def _forward_packed_stock(self, layer, query, kv_cache, split: _Split, out) -> None:
        """Requests on packed prefixes, stock-width pages: prefix in torch; the tokens after it in
        the stock kernel twice, without and with a sink, merged exactly
        (:func:`.varlen_attention.merge_two_calls`). Tokens whose share is undetermined there are
        attended from the pages read back in torch instead."""
        tokens = split.split.packed_tokens
        packed_q = query[tokens]
        prefix_out, prefix_lse = attend_prefixes(
            packed_q,
            split.split,
            split.pages,
            extract_layer_index(layer.layer_name),
            self.scale,
            self.window,
        )
        sink = sink_for(prefix_lse)
        plain = self._suffix_kernel(layer, packed_q, kv_cache, split.packed, None)
        sunk = self._suffix_kernel(layer, packed_q, kv_cache, split.packed, sink)
        merged, trusted = merge_two_calls(plain, sunk, sink, prefix_out, prefix_lse)
        if self.suffix_from_pages:
            trusted = torch.zeros_like(trusted)
        if not bool(trusted.all()):
            logger.debug(
                "%d of %d tokens after a packed prefix attended in torch (vanishing suffix output)",
                int((~trusted).sum()),
                trusted.numel(),
            )
            suffix_out, suffix_lse = self._suffix_from_pages(
                layer, packed_q, kv_cache, split
            )
            exact = merge_by_lse(prefix_out, prefix_lse, suffix_out, suffix_lse)
            merged = torch.where(trusted[:, None, None], merged, exact)
        out[tokens] = merged.to(out.dtype)

    def _suffix_from_pages(
        self, layer, packed_q, kv_cache, split: _Split
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over the tokens after the prefix, read back from stock-width pages, in torch:
        fp32 ``out [n, Hq, d]`` and ``lse [n, Hq]``."""
        suffix = split.suffix_plan(kv_cache.shape[2])
        order = probe_page_order(
            kv_cache.dtype, suffix.block_size, self.head_size, layer.isa
        )
        suffix_out = packed_q.new_empty(packed_q.shape, dtype=torch.float32)
        suffix_lse = packed_q.new_empty(packed_q.shape[:2], dtype=torch.float32)
        if suffix.decode_tokens.numel():  # one query row each: all in one batched call
            keys, values = order.read(
                kv_cache, suffix.decode_blocks, suffix.decode_slots
            )
            part, lse = masked_attention(
                packed_q[suffix.decode_tokens][:, None],
                keys[suffix.decode_rows],
                values[suffix.decode_rows],
                suffix.decode_lengths[:, None] - 1,
                self.scale,
                self.window,
            )
            suffix_out[suffix.decode_tokens], suffix_lse[suffix.decode_tokens] = (
                part[:, 0],
                lse[:, 0],
            )
        for (
            request_tokens,
            blocks,
            slots,
        ) in suffix.chunks:  # prefill chunks: one call per request
            keys, values = order.read(kv_cache, blocks, slots)
            seq_len, count = slots.numel(), request_tokens.numel()
            part, lse = masked_attention(
                packed_q[request_tokens][None],
                keys[None],
                values[None],
                torch.arange(seq_len - count, seq_len)[None],
                self.scale,
                self.window,
            )
            suffix_out[request_tokens], suffix_lse[request_tokens] = part[0], lse[0]
        return suffix_out, suffix_lse

    def _forward_packed_widened(
        self, layer, q, plain_query, kv_cache, split: _Split, out
    ) -> None:
        """Requests on packed prefixes, widened pages: prefix in torch, the rest in the stock kernel
        with a sink, merged exactly (:mod:`.varlen_attention`)."""
        tokens = split.split.packed_tokens
        prefix_out, prefix_lse = attend_prefixes(
            plain_query[tokens],
            split.split,
            split.pages,
            extract_layer_index(layer.layer_name),
            self.scale,
            self.window,
        )
        sink = sink_for(prefix_lse)
        suffix = self._suffix_kernel(layer, q[tokens], kv_cache, split.packed, sink)
        merged = merge_with_prefix(suffix, self.head_size, sink, prefix_out, prefix_lse)
        out[tokens, :, : self.head_size] = merged.to(out.dtype)

    def _suffix_kernel(
        self,
        layer,
        query,
        kv_cache,
        metadata: CPUAttentionMetadata,
        sink: torch.Tensor | None,
    ) -> torch.Tensor:
        """The stock kernel over the packed requests' tokens after the prefix (their block tables
        start after it), with an optional per-query-head sink logit."""
        suffix = torch.empty_like(query)
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(
            num_blocks, num_kv_heads, 2 * block_size, -1
        ).chunk(2, dim=2)
        k_scale, v_scale = compat.kv_scale_floats(layer)
        compat.cpu_attention_with_kv_cache(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=suffix,
            query_start_loc=metadata.query_start_loc,
            seq_lens=metadata.seq_lens,
            scale=self.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=self.sliding_window,
            block_table=metadata.block_table,
            softcap=self.logits_soft_cap,
            scheduler_metadata=metadata.scheduler_metadata,
            s_aux=sink,
            dynamic_causal=None,
            k_scale=k_scale,
            v_scale=v_scale,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return suffix

    @staticmethod
    def prefix_page_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value views ``[blocks, H, block_size, D]`` of this layer's pages, for
        :class:`.paged_prefix.PagedPrefixPages` (per block and head: key rows, then value rows)."""
        num_blocks, heads, block_size, width = kv_cache.shape
        view = kv_cache.view(num_blocks, heads, 2, block_size, width // 2)
        return view[:, :, 0], view[:, :, 1]

    def _write_widened(
        self,
        layer: Any,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        beta: torch.Tensor | None,
    ) -> None:
        key_aug, value_aug = augment_kv(key, value, self._widened_size(), beta)
        self._stock_kv_update(layer, key_aug, value_aug, kv_cache, slot_mapping)


# ---------------------------------------------------------------------- packed prefixes in a batch
@dataclass
class _Split:
    """A step's batch split (:func:`.paged_prefix.split_batch`) with the CPU kernel's metadata."""

    split: BatchSplit
    plain: CPUAttentionMetadata | None
    packed: CPUAttentionMetadata  # the suffix kernel's
    pages: PagedPrefixPages
    _suffix: _SuffixPlan | None = None

    def suffix_plan(self, block_size: int) -> _SuffixPlan:
        """Where the packed requests' tokens after the prefix sit (stock-width pages); built by the
        first layer of the step, shared by the others."""
        if self._suffix is None:
            self._suffix = _SuffixPlan.build(self.split, block_size)
        return self._suffix


@dataclass
class _SuffixPlan:
    """The tokens after the prefix of each packed request, as (block, slot) pairs to read.

    Requests with one query row (decode steps) are read in one gather and attended in one batched
    call: ``decode_rows [R, S_max]`` index the gathered rows per request (padding repeats row 0
    and is masked by ``decode_lengths``). Requests with more rows (prefill chunks) are ``chunks``.
    """

    block_size: int
    decode_tokens: torch.Tensor
    decode_blocks: torch.Tensor
    decode_slots: torch.Tensor
    decode_rows: torch.Tensor
    decode_lengths: torch.Tensor
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    @classmethod
    def build(cls, split: BatchSplit, block_size: int) -> _SuffixPlan:
        table, seq_lens = split.block_table, split.seq_lens.tolist()
        device = table.device
        decode_tokens, decode_blocks, decode_slots, lengths, chunks = [], [], [], [], []
        for row, request in enumerate(split.requests):
            positions = torch.arange(seq_lens[row], device=device)
            blocks, slots = table[row, positions // block_size], positions % block_size
            if request.tokens.numel() == 1:
                decode_tokens.append(request.tokens)
                decode_blocks.append(blocks)
                decode_slots.append(slots)
                lengths.append(seq_lens[row])
            else:
                chunks.append((request.tokens, blocks, slots))
        longest = max(lengths, default=0)
        starts = torch.tensor([0] + lengths, device=device).cumsum(0)[:-1]
        rows = (
            starts[:, None] + torch.arange(longest, device=device)[None, :]
        ).clamp_max(max(sum(lengths) - 1, 0))
        empty = torch.zeros(0, dtype=torch.long, device=device)
        cat = lambda parts: torch.cat(parts) if parts else empty  # noqa: E731
        return cls(
            block_size,
            cat(decode_tokens),
            cat(decode_blocks),
            cat(decode_slots),
            rows,
            torch.tensor(lengths, device=device),
            chunks,
        )


def _split_for(
    metadata: CPUAttentionMetadata,
    impl: CompactionCPUAttentionImpl,
    layer,
    dtype: torch.dtype,
) -> _Split | None:
    """The step's batch split into plain requests and requests on packed prefixes (None: all
    plain), with the kernel metadata of both parts: built by the first layer, kept in the
    step's :class:`.backend_common.StepState` for the others."""
    if metadata.causal is not True or metadata.encoder_cache is not None:
        return None
    state = step_state(metadata)
    if state.packed is not None and state.backend is None:
        split, pages = state.packed
        plain = None
        if split.plain_rows:
            rows = split.plain_rows
            plain = _sub_metadata(
                metadata,
                impl,
                layer,
                dtype,
                split.plain_query_start_loc(metadata.query_start_loc),
                metadata.seq_lens[rows],
                metadata.block_table[rows],
            )
        packed = _sub_metadata(
            metadata,
            impl,
            layer,
            dtype,
            split.query_start_loc,
            split.seq_lens,
            split.block_table,
        )
        state.backend = _Split(split, plain, packed, pages)
    return state.backend


def _sub_metadata(
    metadata: CPUAttentionMetadata,
    impl,
    layer,
    dtype: torch.dtype,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> CPUAttentionMetadata:
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    scheduler = compat.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(),
        num_heads=impl.num_heads,
        num_kv_heads=impl.num_kv_heads,
        head_dim=impl.augmented or impl.head_size,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=impl.group_window,
        isa=layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
    return replace(
        metadata,
        num_actual_tokens=int(query_start_loc[-1]),
        max_query_len=int(query_lens.max()),
        query_start_loc=query_start_loc,
        max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens,
        block_table=block_table,
        scheduler_metadata=scheduler,
    )
