"""Pieces shared by the CPU and the CUDA (Triton) compaction attention backends.

:class:`CompactionImplMixin` is what the two impls have in common: building a layer (does the
engine run compaction, which page width, widened head sizes recorded for the spec hook), the
K/V write of the forward pass, the connector's :meth:`~CompactionImplMixin.write_slots`; each
backend adds only what depends on its pages and kernels. What the layers of one forward step
share (the batch split by packed prefixes) is one :class:`StepState`, made by the first layer
that asks (:func:`step_state`).

Both backends widen the KV pages of decoder attention layers from the model head size ``d`` to
an augmented size that has room for the bias coordinates (see :mod:`.bias`), and only when the
compaction connector is configured. The widening has to reach vLLM's KV cache *spec* (which
sizes and shapes the pages), but ``AttentionBackend.customize_spec`` is a classmethod that gets
no config of its own. So each layer records ``d -> augmented`` when it is built and the spec
hook, called later in the same process, looks it up: :class:`AugmentedHeadSizes`.

Each backend keeps its own registry (its impl's ``head_sizes``) because the augmented sizes
differ (the CPU kernels accept a fixed list of head sizes, the Triton kernel any multiple of 16),
and a registry filled by one backend in a test process must not widen the other backend's specs.

No vLLM import at module level, so importing this module stays cheap and side-effect free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from vllm_compaction.cache import CacheError
from vllm_compaction.vllm.plugin import CONNECTOR_NAME

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import AttentionSpec

    from vllm_compaction.vllm.connector import CompactionConnector
    from vllm_compaction.vllm.paged_prefix import BatchSplit, PagedPrefixPages

__all__ = [
    "PAGE_WIDTHS",
    "AugmentedHeadSizes",
    "CompactionImplMixin",
    "StepState",
    "check_page_width",
    "compaction_enabled",
    "kv_snapshots_enabled",
    "packed_batch",
    "page_width",
    "record_kv_write",
    "step_state",
]

PAGE_WIDTHS = ("stock", "widened")
"""KV page widths with compaction on: ``stock`` keeps the model's head size (plain requests run
vLLM's kernel untouched; prefixes must be varlen), ``widened`` adds the bias coordinates (padded
prefixes too, at +25% KV bytes per token for d = 64)."""

logger = logging.getLogger(__name__)


def compaction_enabled(vllm_config: Any) -> bool:
    """Whether this engine was configured with the compaction connector.

    The backends are registered in every vLLM process that has this package installed, so they
    must behave exactly like the stock backend unless compaction was asked for.
    """
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None:
        return False
    path = kv.kv_connector_module_path or ""
    return kv.kv_connector == CONNECTOR_NAME or path.startswith("vllm_compaction")


def kv_snapshots_enabled(vllm_config: Any) -> bool:
    """Whether this engine opted in to KV snapshots (:mod:`.snapshot`); when not, the backends
    do not even look for them on a K/V write."""
    if not compaction_enabled(vllm_config):
        return False
    return bool(
        (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get(
            "kv_snapshots"
        )
    )


def page_width(vllm_config: Any) -> str:
    """``"stock"`` or ``"widened"``: the ``pages`` entry of the connector's extra config.

    Default ``stock`` on every platform: plain requests keep vLLM's own kernels on pages of the
    model's head size, and varlen prefixes carry their betas in rows of their own. ``widened``
    is needed for padded prefixes only. Without the connector: ``stock`` (the backends are vLLM's own).
    """
    if not compaction_enabled(vllm_config):
        return "stock"
    width = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get(
        "pages"
    )
    return check_page_width("stock" if width is None else width)


def check_page_width(width: str) -> str:
    """``width`` if it is one of :data:`PAGE_WIDTHS`, else ``ValueError`` (one sentence)."""
    if width not in PAGE_WIDTHS:
        raise ValueError(
            f"the 'pages' KV connector option must be one of {', '.join(PAGE_WIDTHS)}, not {width!r}"
        )
    return width


@dataclass
class StepState:
    """What every compaction layer of one forward step shares, worked out once by the first.

    ``packed``: the step's requests on packed (varlen) prefixes split off the batch, with the
    pages to read their prefixes from (None when there are none). ``backend``: whatever else a
    backend derives from the step once (the CPU backend's sub-batch kernel metadata).
    """

    packed: tuple[BatchSplit, PagedPrefixPages] | None
    backend: Any = None


STEP_STATE_ATTR = "_vllm_compaction_step"
"""The one attribute this package sets on vLLM's attention metadata: the step's :class:`StepState`.
The metadata object is built per step and shared by the layers of a KV cache group, so the state
lives and dies with the step it describes."""


def step_state(metadata: Any) -> StepState:
    """The :class:`StepState` of the step ``metadata`` (vLLM's attention metadata) describes."""
    state = getattr(metadata, STEP_STATE_ATTR, None)
    if state is None:
        state = StepState(packed=_find_packed(metadata))
        setattr(metadata, STEP_STATE_ATTR, state)
    return state


def packed_batch(metadata: Any) -> tuple[BatchSplit, PagedPrefixPages] | None:
    """This step's requests on packed (varlen) prefixes, split off the batch, with the pages to
    read them from; None when there are none (:attr:`StepState.packed`)."""
    return step_state(metadata).packed


def _find_packed(metadata: Any) -> tuple[BatchSplit, PagedPrefixPages] | None:
    from vllm_compaction.vllm.paged_prefix import split_batch

    connector = _compaction_connector()
    prefixes = connector.packed_prefixes() if connector is not None else {}
    if connector is None or not prefixes:
        return None
    pages = connector.prefix_pages()
    split = split_batch(
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_table,
        prefixes,
        pages,
    )
    return (split, pages) if split is not None else None


def _compaction_connector() -> CompactionConnector | None:
    """This process's KV connector if it is the compaction one (None without a connector)."""
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    from vllm_compaction.vllm.connector import CompactionConnector

    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    return connector if isinstance(connector, CompactionConnector) else None


def record_kv_write(layer: Any, key: Any, value: Any, slot_mapping: Any) -> None:
    """Show a layer's K/V write (``[N, H, d]`` at ``slot_mapping``) to the connector, which keeps
    the rows of requests being snapshotted (:mod:`.snapshot`)."""
    connector = _compaction_connector()
    if connector is not None:
        connector.record_kv(layer.layer_name, key, value, slot_mapping)


class AugmentedHeadSizes:
    """Model head size -> augmented head size, recorded by layers, read by ``customize_spec``.

    Keyed by head size rather than by layer because the spec hook only sees the spec; layers of
    one head size always get the same augmented size, which :meth:`record` enforces.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._sizes: dict[int, int] = {}

    def record(self, head_size: int, augmented: int) -> None:
        """Remember that layers of ``head_size`` use pages of ``augmented`` coordinates."""
        known = self._sizes.get(head_size)
        if known is not None and known != augmented:
            # two sizes for one key would make the spec disagree with some layer's kernel
            raise RuntimeError(
                f"{self.backend}: head size {head_size} was augmented to {known} and now to "
                f"{augmented}; all layers of one head size must share one page layout"
            )
        if known is None:
            logger.debug(
                "%s: head size %d -> %d (bias-carrying KV pages)",
                self.backend,
                head_size,
                augmented,
            )
        self._sizes[head_size] = augmented

    def forget(self, head_size: int) -> None:
        """Layers of ``head_size`` use stock-width pages. The record is process-wide and the spec
        hook reads it when an engine allocates its pages, so every decoder layer states its page
        width when it is built: an engine built after one with widened pages, in the same
        process (benchmarks, tests, in-process engines), must not be given widened pages too."""
        self._sizes.pop(head_size, None)

    def get(self, head_size: int) -> int | None:
        """The augmented size recorded for ``head_size``, or ``None``."""
        return self._sizes.get(head_size)

    def widen_spec(self, spec: AttentionSpec) -> AttentionSpec:
        """``spec`` with ``head_size`` and ``head_size_v`` widened, if its head size is recorded.

        Values are widened too: both the CPU and the Triton pages hold K and V of one head size
        side by side (logical ``[B, H, N, 2 * hs]``), and the kernels split the content in half.
        """
        augmented = self._sizes.get(spec.head_size)
        return (
            replace(spec, head_size=augmented, head_size_v=augmented)
            if augmented
            else spec
        )


class CompactionImplMixin:
    """What the CPU and the CUDA compaction impls share; put it before vLLM's impl class in the
    bases (``super()`` here is the stock impl). Implements
    :class:`.backend_api.CompactionAttentionImpl` together with the backend's ``prefix_page_views``.

    A backend sets :attr:`head_sizes` and :attr:`augmented_size`, calls
    :meth:`_set_up_compaction` from its ``__init__`` and implements :meth:`_check_supported`
    and :meth:`_write_widened`.
    """

    head_sizes: ClassVar[AugmentedHeadSizes]
    """The backend's head-size record, read by its ``customize_spec``."""

    augmented_size: ClassVar[staticmethod[[int], int]]
    """Model head size -> widened page size on this backend (a staticmethod)."""

    compaction: bool = (
        False  # a KV-holding layer of an engine with the compaction connector
    )
    augmented: int | None = None  # the widened page size, None for stock-width pages
    records_kv: bool = False  # K/V writes shown to a KV snapshot (.snapshot)

    def _set_up_compaction(self, config: Any, *, holds_kv: bool) -> None:
        """Decide this layer's part from the engine's config. Every KV-holding layer states its
        page width in :attr:`head_sizes`: the record is process-wide and read when an engine
        allocates its pages, so an engine built after one with widened pages, in the same
        process (benchmarks, tests, in-process engines), must not be given widened pages too."""
        head_size: int = self.head_size  # type: ignore[attr-defined]
        if not holds_kv:
            return  # no KV cache, nothing for a compacted prefix to live in
        if compaction_enabled(config):
            width = page_width(config)
            self._check_supported(width)
            self.compaction = True
            self.records_kv = kv_snapshots_enabled(config)
            if width == "widened":
                self.augmented = type(self).augmented_size(head_size)
                self.head_sizes.record(head_size, self.augmented)
                return
        self.head_sizes.forget(head_size)

    def _check_supported(self, width: str) -> None:
        """Raise (one sentence) if this layer has an option the backend cannot serve compacted
        prefixes with on pages of ``width``."""
        raise NotImplementedError

    def _widened_size(self) -> int:
        """:attr:`augmented`, on a layer whose pages are widened (the only ones written so)."""
        if self.augmented is None:
            raise RuntimeError("this layer's pages are stock width: nothing is widened")
        return self.augmented

    def _write_widened(
        self,
        layer: Any,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        beta: torch.Tensor | None,
    ) -> None:
        """Write ``key/value [N, Hkv, d]`` widened to :attr:`augmented` with ``beta [N, Hkv]``
        (None: 0) through the backend's own KV write op."""
        raise NotImplementedError

    def _stock_kv_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """vLLM's own K/V write of the impl this mixin sits on."""
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)  # type: ignore[misc]

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.records_kv:
            record_kv_write(layer, key, value, slot_mapping)
        if self.augmented is None:
            self._stock_kv_update(layer, key, value, kv_cache, slot_mapping)
        else:  # ordinary tokens: beta 0, i.e. exactly the scores of the stock backend
            self._write_widened(layer, kv_cache, slot_mapping, key, value, None)

    @property
    def holds_bias(self) -> bool:
        """Whether the pages carry per-slot bias (widened); stock-width pages hold beta = 0 only."""
        return self.augmented is not None

    def write_slots(
        self,
        layer: Any,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        beta: torch.Tensor,
    ) -> None:
        """Write ``keys/values [N, Hkv, d]`` with per-slot ``beta [N, Hkv]`` at ``slot_mapping [N]``.

        Called by the compaction connector for the slots of a padded compacted prefix; goes
        through the same op as the forward pass, so both agree on the page layout. Stock-width
        pages take bias-free slots only (``beta`` all 0), written as ordinary tokens.
        """
        if not self.compaction:
            raise RuntimeError(
                "this attention layer was built without the compaction connector"
            )
        keys, values = keys.to(kv_cache.dtype), values.to(kv_cache.dtype)
        if self.augmented is None:
            if beta.any():
                raise CacheError(
                    "per-slot biases need the bias coordinates of widened KV pages; build the prompt "
                    "with layout='varlen', or start the engine with pages='widened'"
                )
            self._stock_kv_update(layer, keys, values, kv_cache, slot_mapping)
        else:
            self._write_widened(layer, kv_cache, slot_mapping, keys, values, beta)
