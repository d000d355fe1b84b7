"""Pieces shared by the CPU and the CUDA (Triton) compaction attention backends.

Both backends widen the KV pages of decoder attention layers from the model head size ``d`` to
an augmented size that has room for the bias coordinates (see :mod:`.bias`), and only when the
compaction connector is configured. The widening has to reach vLLM's KV cache *spec* (which
sizes and shapes the pages), but ``AttentionBackend.customize_spec`` is a classmethod that gets
no config of its own. So each layer records ``d -> augmented`` when it is built and the spec
hook, called later in the same process, looks it up: :class:`AugmentedHeadSizes`.

Each backend keeps its own registry because the augmented sizes differ (the CPU kernels accept
a fixed list of head sizes, the Triton kernel any multiple of 16), and a registry filled by one
backend in a test process must not widen the other backend's specs.

No vLLM import at module level, so importing this module stays cheap and side-effect free.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm_compaction.vllm.plugin import CONNECTOR_NAME

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import AttentionSpec

    from vllm_compaction.vllm.paged_prefix import BatchSplit, PagedPrefixPages

__all__ = ["PAGE_WIDTHS", "AugmentedHeadSizes", "check_page_width", "compaction_enabled", "kv_snapshots_enabled",
           "packed_batch", "page_width", "record_kv_write"]

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
    return bool((vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("kv_snapshots"))


def page_width(vllm_config: Any) -> str:
    """``"stock"`` or ``"widened"``: the ``pages`` entry of the connector's extra config.

    Default ``stock`` on every platform: plain requests keep vLLM's own kernels on pages of the
    model's head size, and varlen prefixes carry their betas in rows of their own. ``widened``
    is needed for padded prefixes only. Without the connector: ``stock`` (the backends are vLLM's own).
    """
    if not compaction_enabled(vllm_config):
        return "stock"
    width = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("pages")
    return check_page_width("stock" if width is None else width)


def check_page_width(width: str) -> str:
    """``width`` if it is one of :data:`PAGE_WIDTHS`, else ``ValueError`` (one sentence)."""
    if width not in PAGE_WIDTHS:
        raise ValueError(f"the 'pages' KV connector option must be one of {', '.join(PAGE_WIDTHS)}, not {width!r}")
    return width


def packed_batch(metadata: Any) -> "tuple[BatchSplit, PagedPrefixPages] | None":
    """This step's requests on packed (varlen) prefixes, split off the batch, with the pages to
    read them from; None when there are none. Asked by every layer of both backends, computed by
    the first and kept on the attention metadata object the layers of a step share."""
    cached = getattr(metadata, "_vllm_compaction_packed", False)
    if cached is not False:
        return cached
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from vllm_compaction.vllm.paged_prefix import split_batch

    result = None
    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    prefixes = connector.packed_prefixes() if hasattr(connector, "packed_prefixes") else {}
    if prefixes:
        pages = connector.prefix_pages()
        split = split_batch(metadata.query_start_loc, metadata.seq_lens, metadata.block_table, prefixes, pages)
        result = (split, pages) if split is not None else None
    metadata._vllm_compaction_packed = result
    return result


def record_kv_write(layer: Any, key: Any, value: Any, slot_mapping: Any) -> None:
    """Show a layer's K/V write (``[N, H, d]`` at ``slot_mapping``) to the connector, which keeps
    the rows of requests being snapshotted (:mod:`.snapshot`)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        record = getattr(get_kv_transfer_group(), "record_kv", None)
        if record is not None:
            record(layer.layer_name, key, value, slot_mapping)


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
            logger.debug("%s: head size %d -> %d (bias-carrying KV pages)",
                         self.backend, head_size, augmented)
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

    def clear(self) -> None:
        """Forget every recorded size (tests; a process builds its layers once)."""
        self._sizes.clear()

    def widen_spec(self, spec: "AttentionSpec") -> "AttentionSpec":
        """``spec`` with ``head_size`` and ``head_size_v`` widened, if its head size is recorded.

        Values are widened too: both the CPU and the Triton pages hold K and V of one head size
        side by side (logical ``[B, H, N, 2 * hs]``), and the kernels split the content in half.
        """
        augmented = self._sizes.get(spec.head_size)
        return replace(spec, head_size=augmented, head_size_v=augmented) if augmented else spec
