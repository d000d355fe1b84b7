"""``CompactionConnector``: loads compacted prefixes into a request's paged KV blocks.

Scheduler side: a request whose ``cache_salt`` names a compacted prefix (see
:mod:`.prompt`) has its ``P`` placeholder tokens claimed as externally computed, minus what the
prefix cache already holds; the blocks allocated for them are sent to the workers.

Worker side: before the forward pass the cache is read from the store, checked (checksum, model,
slot count), laid out by :func:`.layout.physical_prefix` and written into those blocks through the
attention backend's ``write_slots`` (the engine's own packing op). A cache that cannot be loaded
fails only its request: its blocks are reported as load errors and vLLM's default
``kv_load_failure_policy="fail"`` finishes that request with an error while the others run on.

Packed (``varlen``) prefixes need two more things, because only the compaction attention can read
their blocks: the scheduler tells the workers, every step, which scheduled requests start on one
(their first block id and prefix block count: :attr:`CompactionMetadata.packed`), and the
workers keep the engine's pages as :class:`.paged_prefix.PagedPrefixPages` for the attention to
read the prefix rows from.

KV snapshots (:mod:`.snapshot`), when the engine opted in with ``kv_snapshots``: the scheduler side
plans, per step, which prompt positions of a snapshot request are computed in which slots; the
workers record those rows as the backends write them and save the snapshot after the last one.

Configure with ``--kv-transfer-config '{"kv_connector": "CompactionConnector",
"kv_role": "kv_both", "kv_connector_extra_config": {"store": "/path/to/store"}}'``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm_compaction.cache import CacheError, CompactedCache, read_metadata
from vllm_compaction.cache.paged import tensor_parallel_heads
from vllm_compaction.vllm.backend_api import compaction_impl
from vllm_compaction.vllm.backend_common import page_width
from vllm_compaction.vllm.compat import check_vllm_version
from vllm_compaction.vllm.layout import (
    PackedPrefix,
    PhysicalPrefix,
    packed_prefix,
    physical_prefix,
)
from vllm_compaction.vllm.paged_prefix import PagedPrefixPages
from vllm_compaction.vllm.prompt import PLACEHOLDER_TOKEN_ID, CompactedRef, open_store
from vllm_compaction.vllm.snapshot import (
    SnapshotPlan,
    SnapshotRecorder,
    snapshot_dir,
    snapshot_name,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["CompactionConnector", "CompactionMetadata", "PrefixLoad"]

logger = logging.getLogger(__name__)


@dataclass
class PrefixLoad:
    """Write physical slots ``[start, end)`` of ``ref`` into ``block_ids`` of one request."""

    request_id: str
    ref: CompactedRef
    start: int
    end: int
    block_ids: list[int]
    problem: str | None = (
        None  # set by the scheduler when the request itself is malformed
    )


@dataclass
class CompactionMetadata(KVConnectorMetadata):
    loads: list[PrefixLoad] = field(default_factory=list)
    # first block id -> prefix blocks
    packed: dict[int, int] = field(default_factory=dict)
    snapshots: list[SnapshotPlan] = field(default_factory=list)
    # requests that ended before their prompt did
    abandoned_snapshots: list[str] = field(default_factory=list)


def check_deployment_shape(vllm_config: Any) -> None:
    """Refuse, in one sentence, the engine shapes a compacted prefix cannot be served in (rather
    than serve wrong output): each would need a path of its own."""
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    problems = []
    if parallel.tensor_parallel_size > 1 and (
        (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get(
            "kv_snapshots"
        )
    ):
        problems.append(
            f"KV snapshots under tensor parallelism (tensor_parallel_size="
            f"{parallel.tensor_parallel_size}: each rank would record only its own KV heads)"
        )
    if parallel.pipeline_parallel_size > 1:
        problems.append(
            f"pipeline parallelism (pipeline_parallel_size={parallel.pipeline_parallel_size}: "
            "each stage holds a slice of the layers)"
        )
    if getattr(model, "use_mla", False):
        problems.append(
            "multi-head latent attention (one latent vector per token, no per-head keys to "
            "compact)"
        )
    if getattr(model, "attention_chunk_size", None):
        problems.append(
            "chunked local attention (a key's visibility depends on its chunk, which a "
            "logical length shorter than the physical one would move)"
        )
    if problems:
        raise ValueError(
            "compacted prefixes cannot be served with " + "; ".join(problems)
        )


class CompactionConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        check_vllm_version()
        check_deployment_shape(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        block_size = _block_size(vllm_config, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        snapshots = bool(extra.get("kv_snapshots", False))
        self._scheduler = (
            _SchedulerSide(block_size, snapshots, page_width(vllm_config))
            if role == KVConnectorRole.SCHEDULER
            else None
        )
        self._worker = (
            _WorkerSide(vllm_config, kv_cache_config)
            if role == KVConnectorRole.WORKER
            else None
        )
        self._step: CompactionMetadata | None = (
            None  # this step's metadata (worker side), once bound
        )

    @property
    def _scheduler_side(self) -> _SchedulerSide:
        # vLLM calls each side's methods in its own process only
        if self._scheduler is None:
            raise RuntimeError(
                "a scheduler-side connector method was called on a worker"
            )
        return self._scheduler

    @property
    def _worker_side(self) -> _WorkerSide:
        if self._worker is None:
            raise RuntimeError(
                "a worker-side connector method was called on the scheduler"
            )
        return self._worker

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self._scheduler_side.num_new_matched(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        self._scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        return self._scheduler_side.take_metadata(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler_side.forget(request.request_id)
        return False, None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker_side.register(kv_caches)

    def packed_prefixes(self) -> dict[int, int]:
        """This step's requests on packed prefixes: first block id -> prefix block count.

        A request whose load failed in this step is left out: its blocks hold no prefix, vLLM
        fails it after the step, and until then it attends like a plain request.
        """
        if self._step is None:
            return {}
        failed = self._worker.failed_blocks if self._worker is not None else set()
        return {
            first: count
            for first, count in self._step.packed.items()
            if first not in failed
        }

    def prefix_pages(self) -> PagedPrefixPages:
        """The engine's pages as packed-prefix rows (worker side)."""
        return self._worker_side.pages()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._step = (
            connector_metadata
            if isinstance(connector_metadata, CompactionMetadata)
            else None
        )
        # before the forward pass (loads may start after it, when no request waits on one)
        if self._worker is not None and self._step is not None:
            self._worker.begin_step(
                self._step.snapshots, self._step.abandoned_snapshots
            )

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._step = None

    def record_kv(
        self,
        layer_name: str,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Called by the compaction backends with every K/V write: feeds this step's snapshots."""
        if self._worker is not None and self._worker.recorder is not None:
            from vllm.model_executor.models.utils import extract_layer_index

            self._worker.recorder.record(
                extract_layer_index(layer_name), key, value, slot_mapping
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._step is None:
            raise RuntimeError(
                "start_load_kv before the step's connector metadata was bound"
            )
        for load in self._step.loads:
            self._worker_side.load(load, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any
    ) -> None:
        return  # nothing is saved: caches come from the compaction worker's store

    def wait_for_save(self):
        if self._worker is not None:
            self._worker.finish_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()


def _block_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> int:
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    return (
        groups[0].kv_cache_spec.block_size
        if groups
        else vllm_config.cache_config.block_size
    )


class _SchedulerSide:
    def __init__(
        self, block_size: int, snapshots: bool = False, pages: str = "widened"
    ) -> None:
        self.block_size = block_size
        self.snapshots = snapshots
        self.pages = pages  # page width (backend_common.page_width): stock pages hold varlen prefixes only
        self._snapshot_of: dict[
            str, tuple[str, int]
        ] = {}  # request -> snapshot name, prompt length
        self._snapshot_blocks: dict[
            str, list[int]
        ] = {}  # request -> its block ids so far
        self._abandoned: list[
            str
        ] = []  # snapshots whose request ended first: workers drop their rows
        self._pending: dict[str, tuple[CompactedRef, int, str | None]] = {}
        self._loads: list[PrefixLoad] = []
        self._packed_blocks: dict[
            str, int
        ] = {}  # request -> prefix blocks, for packed prefixes
        self._first_block: dict[
            str, int
        ] = {}  # request -> its first block id, once allocated

    def num_new_matched(self, request: Request, num_computed_tokens: int) -> int:
        self._plan_snapshot(request, num_computed_tokens)
        try:
            ref = CompactedRef.parse(request.cache_salt)
        except ValueError as exc:
            logger.warning(
                "request %s: %s; served as an ordinary prompt", request.request_id, exc
            )
            return 0
        if ref is None:
            return 0
        problem = None
        claim = ref.num_slots
        if ref.layout == "varlen":
            self._packed_blocks[request.request_id] = ref.num_slots // self.block_size
            if ref.num_slots % self.block_size:
                problem = (
                    f"a packed prefix of {ref.num_slots} placeholders does not fill whole blocks of "
                    f"{self.block_size} (the prompt was built for another block size)"
                )
        if request.num_prompt_tokens <= ref.num_slots:
            problem = (
                f"the prompt has {request.num_prompt_tokens} tokens, not the {ref.num_slots} "
                f"placeholders of the compacted prefix plus at least one more"
            )
            claim = request.num_prompt_tokens - 1
        elif any(
            t != PLACEHOLDER_TOKEN_ID for t in request.prompt_token_ids[: ref.num_slots]
        ):
            problem = "its placeholder positions hold other tokens (build prompts with compacted_prompt)"
        remaining = claim - num_computed_tokens
        if remaining <= 0:
            return 0
        self._pending[request.request_id] = (ref, num_computed_tokens, problem)
        return remaining

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pending = self._pending.pop(request.request_id, None)
        if pending is None or num_external_tokens == 0:
            return
        ref, start, problem = pending
        groups = blocks.get_block_ids()
        if len(groups) != 1:
            problem = (
                problem
                or "several KV cache groups (vLLM's hybrid KV cache manager) are not supported: "
                "leave --disable-hybrid-kv-cache-manager to vLLM, which turns it off for this "
                "connector"
            )
        self._loads.append(
            PrefixLoad(
                request.request_id,
                ref,
                start,
                start + num_external_tokens,
                list(groups[0]),
                problem,
            )
        )

    def take_metadata(self, scheduler_output: SchedulerOutput) -> CompactionMetadata:
        if self._packed_blocks:
            for new in scheduler_output.scheduled_new_reqs:
                if (
                    new.req_id in self._packed_blocks
                    and new.block_ids
                    and new.block_ids[0]
                ):
                    self._first_block[new.req_id] = new.block_ids[0][0]
            cached = scheduler_output.scheduled_cached_reqs
            for req_id, blocks in zip(cached.req_ids, cached.new_block_ids):
                if (
                    req_id in cached.resumed_req_ids
                    and req_id in self._packed_blocks
                    and blocks
                    and blocks[0]
                ):
                    # resumed: a new block table
                    self._first_block[req_id] = blocks[0][0]
        packed = {
            self._first_block[r]: self._packed_blocks[r]
            for r in scheduler_output.num_scheduled_tokens
            if r in self._first_block
        }
        snapshots = self._snapshot_plans(scheduler_output) if self._snapshot_of else []
        metadata = CompactionMetadata(self._loads, packed, snapshots, self._abandoned)
        self._loads, self._abandoned = [], []
        return metadata

    def _plan_snapshot(self, request: Request, num_computed_tokens: int) -> None:
        try:
            name = snapshot_name(request.kv_transfer_params)
        except ValueError as exc:
            logger.error(
                "request %s: %s; no KV snapshot taken", request.request_id, exc
            )
            return
        if name is None or request.request_id in self._snapshot_of:
            return  # (a resumed request keeps its plan: the rows recorded before stay valid)
        if not self.snapshots:
            logger.error(
                "request %s asks for a KV snapshot, but this engine was not started with "
                "kv_snapshots enabled; none is taken",
                request.request_id,
            )
        elif num_computed_tokens:
            logger.error(
                "request %s: %d prompt tokens came from the prefix cache, so no KV snapshot can be "
                "taken; give snapshot requests a cache_salt of their own",
                request.request_id,
                num_computed_tokens,
            )
        else:
            self._snapshot_of[request.request_id] = (name, request.num_prompt_tokens)

    def _snapshot_plans(self, scheduler_output: SchedulerOutput) -> list[SnapshotPlan]:
        """The prompt positions of snapshot requests computed this step, and their slots."""
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._snapshot_of:
                self._snapshot_blocks[new.req_id] = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            if req_id in self._snapshot_of:
                blocks = cached.new_block_ids[index]
                known = (
                    []
                    if req_id in cached.resumed_req_ids
                    else self._snapshot_blocks.get(req_id, [])
                )
                self._snapshot_blocks[req_id] = known + (
                    list(blocks[0]) if blocks else []
                )
                computed[req_id] = cached.num_computed_tokens[index]
        plans = []
        for req_id, start in computed.items():
            name, length = self._snapshot_of[req_id]
            end = min(start + scheduler_output.num_scheduled_tokens[req_id], length)
            if start >= length:
                continue
            blocks = self._snapshot_blocks[req_id]
            slots = [
                blocks[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ]
            plans.append(SnapshotPlan(name, start, end, slots, length))
            if end >= length:
                self._forget_snapshot(req_id)
        return plans

    def _forget_snapshot(self, request_id: str) -> None:
        self._snapshot_of.pop(request_id, None)
        self._snapshot_blocks.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        # aborted (or failed) before its prompt was computed
        if request_id in self._snapshot_of:
            self._abandoned.append(self._snapshot_of[request_id][0])
        self._forget_snapshot(request_id)
        self._pending.pop(request_id, None)
        self._packed_blocks.pop(request_id, None)
        self._first_block.pop(request_id, None)


class _WorkerSide:
    _MAX_PREPARED = 8

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.store = open_store(extra.get("store"))
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.hf_config = vllm_config.model_config.hf_config
        self.dtype = vllm_config.model_config.dtype
        self.block_size = _block_size(vllm_config, kv_cache_config)
        # tensor parallelism: this rank holds (and loads) only its slice of the KV heads
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.heads: list[int] | None = None
        if self.tp_size > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            self.heads = tensor_parallel_heads(
                self.model_config.get_total_num_kv_heads(),
                self.tp_size,
                get_tensor_model_parallel_rank(),
            )
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._by_layer: list[tuple[str, torch.Tensor]] = []  # kv_caches in layer order
        self._pages: PagedPrefixPages | None = None
        self._prepared: OrderedDict[str, PhysicalPrefix | PackedPrefix] = OrderedDict()
        self._failed: set[int] = set()
        self.recorder = (
            SnapshotRecorder(
                snapshot_dir(self.store.root),
                self.model_config.get_num_layers(vllm_config.parallel_config),
            )
            if extra.get("kv_snapshots")
            else None
        )

    def begin_step(self, plans: list[SnapshotPlan], abandoned: list[str]) -> None:
        if self.recorder is not None:
            self.recorder.drop(abandoned)
            self.recorder.begin_step(plans)

    def finish_step(self) -> None:
        if self.recorder is not None:
            self.recorder.finish_step()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self.kv_caches = kv_caches
        self._by_layer = sorted(
            kv_caches.items(), key=lambda item: extract_layer_index(item[0])
        )

    def pages(self) -> PagedPrefixPages:
        """The pages as packed-prefix rows, through each attention layer's ``prefix_page_views``."""
        if self._pages is None:
            layers = self.vllm_config.compilation_config.static_forward_context
            keys, values = [], []
            for name, kv_cache in self._by_layer:
                impl = compaction_impl(
                    layers[name].impl,
                    "cannot read packed (varlen) prefixes; build the "
                    "prompt with layout='padded'",
                )
                key_view, value_view = impl.prefix_page_views(kv_cache)
                keys.append(key_view)
                values.append(value_view)
            self._pages = PagedPrefixPages(
                keys, values, self.model_config.get_head_size()
            )
        return self._pages

    @property
    def failed_blocks(self) -> set[int]:
        """Blocks whose load failed in this step (reported to vLLM after the forward pass)."""
        return self._failed

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def load(self, load: PrefixLoad, forward_context: ForwardContext) -> None:
        try:
            if load.problem:
                raise CacheError(load.problem)
            prefix = self._prepare(load.ref)
            self._write(load, prefix, forward_context)
        except Exception as exc:  # any failure fails this request only
            logger.error(
                "Compacted prefix %r for request %s could not be loaded: %s",
                load.ref.entry_id,
                load.request_id,
                exc,
            )
            first, last = (
                load.start // self.block_size,
                (load.end - 1) // self.block_size,
            )
            self._failed.update(load.block_ids[first : last + 1])

    def _prepare(self, ref: CompactedRef) -> PhysicalPrefix | PackedPrefix:
        if ref.salt in self._prepared:
            self._prepared.move_to_end(ref.salt)
            return self._prepared[ref.salt]
        from vllm_compaction.vllm.engine import engine_fingerprint

        path = self.store.path_for(ref.entry_id)
        if not path.is_file():
            raise CacheError(
                f"no compacted cache {ref.entry_id!r} in the store at {self.store.root}"
            )
        expect = engine_fingerprint(self.model_config)
        if (
            read_metadata(path, expect_model=expect)["tensors_sha256"][:32]
            != ref.digest
        ):
            raise CacheError(
                f"the store entry {ref.entry_id!r} changed since the prompt was built"
            )
        cache = CompactedCache.load(path, expect_model=expect)
        slots = cache.physical_tokens(ref.layout, self.block_size, self.tp_size)
        if slots != ref.num_slots:
            raise CacheError(
                f"the cache takes {slots} physical slots in the {ref.layout} layout, "
                f"the prompt has {ref.num_slots} placeholders"
            )
        prefix: PhysicalPrefix | PackedPrefix
        if ref.layout == "varlen":
            prefix = packed_prefix(
                cache,
                self.hf_config,
                block_size=self.block_size,
                dtype=self.dtype,
                heads=self.heads,
                num_slots=slots,
            )
        else:
            prefix = physical_prefix(
                cache, self.hf_config, dtype=self.dtype, heads=self.heads
            )
        self._prepared[ref.salt] = prefix
        while len(self._prepared) > self._MAX_PREPARED:
            self._prepared.popitem(last=False)
        return prefix

    def _write(
        self,
        load: PrefixLoad,
        prefix: PhysicalPrefix | PackedPrefix,
        forward_context: ForwardContext,
    ) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        if isinstance(prefix, PackedPrefix):
            self.pages().write(
                prefix, load.block_ids, first_block=load.start // self.block_size
            )
            return

        impls = [
            compaction_impl(
                forward_context.no_compile_layers[name].impl,
                "cannot hold per-slot bias; on "
                "CUDA start the engine with --attention-backend CUSTOM",
            )
            for name in self.kv_caches
        ]
        # checked before any page is written: a refused request leaves no half-written prefix
        if not prefix.bias_free and not all(impl.holds_bias for impl in impls):
            raise CacheError(
                "this padded prefix has per-slot biases or masked padding, which need the bias "
                "coordinates of widened KV pages, and this engine runs stock-width pages; build "
                "the prompt with layout='varlen' (or start the engine with pages='widened')"
            )
        positions = torch.arange(load.start, load.end)
        blocks = torch.as_tensor(load.block_ids, dtype=torch.long)
        slot_mapping = (
            blocks[positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        rows = slice(load.start, load.end)
        for (name, kv_cache), impl in zip(self.kv_caches.items(), impls):
            layer = forward_context.no_compile_layers[name]
            index = extract_layer_index(name)
            impl.write_slots(
                layer,
                kv_cache,
                slot_mapping.to(kv_cache.device),
                prefix.keys[index][rows],
                prefix.values[index][rows],
                prefix.beta[index][rows],
            )
