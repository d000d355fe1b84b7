"""``compact()``: chat messages -> ``CompactedCache``. The only per-layer loop of the project.

tokens -> prefill (keys/values/queries) -> query plan -> budgets -> per-layer ``compact_heads``
(on-policy: inside one packed forward pass) -> exact template slots + compacted slots.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from vllm_compaction.am import CompactedHeads, compact_heads, score_keys
from vllm_compaction.budgets import (
    check_score_aggregation,
    check_score_softmax,
    protected_tokens,
    ranked_template,
    resolve_budgets,
    singular_tokens,
    span_ids,
)
from vllm_compaction.cache import CompactedCache
from vllm_compaction.models import (
    ModelAdapter,
    PrefixLayer,
    load_adapter,
    resolve_device,
)
from vllm_compaction.queries import (
    PrefixSpec,
    QueryCollector,
    parse_sources,
    resolve_spacing,
)
from vllm_compaction.recipes import DEFAULT_METHOD, RECIPES, ResolvedRecipe, resolve
from vllm_compaction.summarize import DEFAULT_SUMMARY_TOKENS, summary_messages

__all__ = [
    "DEFAULT_METHOD",
    "PreparedPrefix",
    "RECIPES",
    "compact",
    "compact_prefix",
    "compact_prepared",
    "prepare_prefix",
]

logger = logging.getLogger(__name__)


def compact(
    model: str | Path | ModelAdapter,
    messages: Sequence[dict] | str,
    *,
    ratio: float | None = None,
    target_tokens: int | None = None,
    method: str = DEFAULT_METHOD,
    queries: str | None = None,
    budgets: str | None = None,
    on_policy: bool | None = None,
    keep_last_tokens: int = 0,
    query_cap: int = 50_000,
    seed: int = 0,
    progress: bool = False,
    on_progress: Callable[[float], None] | None = None,
    chunk_tokens: int | None = None,
    device: str | torch.device | None = None,
    summarize: bool = False,
    summary_tokens: int = DEFAULT_SUMMARY_TOKENS,
    **options: Any,
) -> CompactedCache:
    """Compact the content of chat ``messages`` (template tokens stay exact, unless
    ``template="ranked"``).

    Args:
        model: a known name (``"smollm2-135m"``), a checkpoint folder, or a loaded adapter.
        messages: OpenAI-style ``[{"role", "content"}]``; a string is one user message.
        ratio: slots kept per head on average, as a fraction of the content tokens; or
        target_tokens: the same as an absolute number of slots per head.
        method: a method spec (``vllm_compaction.recipes``): a name of ``RECIPES`` (math +
            queries, budgets, on-policy and default options), optionally with overrides,
            ``"name:key=value,..."``. The default, ``"am"``, is the recommended configuration.
        queries: override the query source (``"repeat-prefill"``, ``"a+b"`` mixtures, ...).
        budgets: ``"uniform" | "global" | "pyramid" | <schedule file>``.
        keep_last_tokens: the last content tokens stay exact (the recent turn).
        progress: show a progress bar over layers.
        chunk_tokens: compact contiguous chunks of about this many content tokens separately, each
            at ``ratio`` with its own budgets (default: one chunk).
        on_progress: called with the fraction of layers done (0 after the prefill, then after
            each layer); the compaction worker reports it and may raise from it to cancel.
        device: where to load a named model and run every stage (``"cpu"``, ``"cuda"``,
            ``"cuda:1"``, ``"auto"``); default the CPU. A loaded adapter runs where its weights
            are, and a different ``device`` is refused.
        summarize: first let the model summarize ``messages`` (at most ``summary_tokens``
            tokens) and compact the summary instead, as one user message
            (``vllm_compaction.summarize``); ``ratio`` then applies to the summary.
        options: math options for ``compact_heads`` (e.g. ``values="direct"``), budget
            options (``max_head_ratio``, ``min_head_slots``, ``min_layer_share``) and how
            ``global`` budgets rank keys (``score_softmax``, ``score_aggregation``,
            ``score_weight_power``), and which tokens stay exact (``protect``, ``protect_by``,
            ``template``: see ``budgets.protect``).
    """
    if isinstance(model, ModelAdapter):
        adapter = model
        if device is not None and resolve_device(device) != adapter.device:
            raise ValueError(
                f"the adapter's weights are on {adapter.device}, not on {device}: load it there "
                f"(load_adapter(..., device={str(device)!r})) or leave device out"
            )
    else:
        adapter = load_adapter(model, device="cpu" if device is None else device)
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not messages:
        raise ValueError("nothing to compact: messages is empty")
    if keep_last_tokens < 0:
        raise ValueError(f"keep_last_tokens must be >= 0, got {keep_last_tokens}")
    summary_s = None
    if summarize:
        if keep_last_tokens:
            raise ValueError(
                "keep_last_tokens cannot be combined with summarize: the summary replaces "
                "every message"
            )
        start = time.perf_counter()
        messages = summary_messages(adapter, messages, max_new_tokens=summary_tokens)
        summary_s = time.perf_counter() - start
    ids, mask = adapter.chat_content(messages)
    if keep_last_tokens:
        content_pos = torch.nonzero(mask).flatten()
        mask[content_pos[max(0, len(content_pos) - keep_last_tokens) :]] = False
    cache = compact_prefix(
        adapter,
        ids,
        mask,
        ratio=ratio,
        target_tokens=target_tokens,
        method=method,
        queries=queries,
        budgets=budgets,
        on_policy=on_policy,
        query_cap=query_cap,
        seed=seed,
        progress=progress,
        on_progress=on_progress,
        chunk_tokens=chunk_tokens,
        **options,
    )
    if summary_s is not None:
        cache.timings["summarize_s"] = summary_s
        cache.timings["total_s"] = cache.timings.get("total_s", 0.0) + summary_s
    return cache


def content_chunks(mask: torch.Tensor, chunk_tokens: int | None) -> list[torch.Tensor]:
    """Split the ``True`` positions of ``mask [T]`` into contiguous chunks of ``chunk_tokens``
    (a last chunk under half that joins the one before); one chunk when ``chunk_tokens`` is None."""
    if chunk_tokens is None:
        return [mask]
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    content = torch.nonzero(mask).flatten()
    starts = list(range(0, len(content), chunk_tokens))
    if len(starts) > 1 and len(content) - starts[-1] < chunk_tokens / 2:
        starts.pop()
    chunks = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(content)
        chunk = torch.zeros_like(mask)
        chunk[content[start:end]] = True
        chunks.append(chunk)
    return chunks


def _resolve_ratio(ratio: float | None, target_tokens: int | None, n: int) -> float:
    if (ratio is None) == (target_tokens is None):
        raise ValueError("give exactly one of ratio or target_tokens")
    if target_tokens is not None:
        if target_tokens <= 0:
            raise ValueError(f"target_tokens must be positive, got {target_tokens}")
        return min(1.0, target_tokens / n)
    assert ratio is not None  # exactly one of the two was given
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return float(ratio)


@dataclass
class PreparedPrefix:
    """A prefix after its prefill and query planning, reusable across ratios and methods.

    Off-policy queries are computed on first use and kept (they do not depend on the ratio).
    """

    adapter: ModelAdapter
    spec: PrefixSpec
    queries: str
    collector: QueryCollector
    timings: dict[str, float]
    _off_policy: list[torch.Tensor] | None = None
    _probe_scores: list[torch.Tensor | None] | None = None

    @property
    def num_content(self) -> int:
        return int(self.spec.compact_mask.sum())

    def off_policy_queries(self) -> list[torch.Tensor]:
        if self._off_policy is None:
            start = time.perf_counter()
            self._off_policy = self.collector.run(self.spec.kv.exact_prefix())
            self.timings["queries_s"] = time.perf_counter() - start
        return self._off_policy

    def probe_scores(self) -> list[torch.Tensor | None]:
        """Per layer ``[H, T]`` key scores of the probes under the full softmax of their pass
        (``QueryCollector.run_scored``); the off-policy queries come from the same pass."""
        if self._probe_scores is None:
            start = time.perf_counter()
            self._off_policy, self._probe_scores = self.collector.run_scored(
                self.spec.kv.exact_prefix()
            )
            self.timings["queries_s"] = time.perf_counter() - start
        return self._probe_scores

    def key_scores(
        self,
        layer: int,
        scale: float,
        softmax: str,
        aggregation: str,
        weight_power: float | None,
    ) -> torch.Tensor:
        """``[H, T]`` KVzip importance of every prefix key of ``layer``: its largest attention
        weight under the reference queries. ``softmax="prefix"`` renormalises each query over
        the prefix keys; ``"probe"`` takes the weight of the probe's real pass, whose softmax also
        covers the probe's own tokens (KVzip's score); queries without a probe (prefix queries,
        random vectors) are scored over the prefix either way. ``aggregation="weighted-max"``
        scales each query's weights by its source's weight (``QueryCollector.weights``) raised
        to ``weight_power``, over the largest one, before the max (``"prefix"`` only; ``None``
        under ``max``)."""
        check_score_aggregation(aggregation, softmax)
        keys = self.spec.kv.keys[layer]
        if softmax == "prefix":
            weights = (
                self.collector.weights(layer) if aggregation == "weighted-max" else None
            )
            if weights is not None:
                if weight_power is None:
                    raise ValueError(
                        "score_aggregation='weighted-max' needs a score weight power"
                    )
                weights = weights**weight_power
            return score_keys(
                keys,
                self.off_policy_queries()[layer],
                scale=scale,
                aggregation=aggregation,
                query_weights=weights,
            )
        check_score_softmax(softmax)
        probe, static = self.probe_scores()[layer], self.collector.static_queries(layer)
        if static is not None:
            prefix_only = score_keys(keys, static, scale=scale, aggregation="max")
            return prefix_only if probe is None else torch.maximum(probe, prefix_only)
        if probe is None:
            raise ValueError(
                f"layer {layer} has no reference queries to score its keys with"
            )
        return probe


def prepare_prefix(
    adapter: ModelAdapter,
    token_ids: Sequence[int],
    compact_mask: torch.Tensor,
    *,
    queries: str,
    query_cap: int = 50_000,
    seed: int = 0,
) -> PreparedPrefix:
    """Prefill ``token_ids [T]`` and plan the reference queries for the ``compact_mask`` tokens."""
    mask = torch.as_tensor(compact_mask, dtype=torch.bool, device="cpu")
    if mask.numel() != len(token_ids):
        raise ValueError(
            f"compact_mask has {mask.numel()} entries for {len(token_ids)} tokens"
        )
    if not mask.any():
        raise ValueError("the prefix has no content tokens to compact")
    start = time.perf_counter()
    kv = adapter.prefill(token_ids)
    spec = PrefixSpec(
        torch.as_tensor(token_ids, dtype=torch.long, device="cpu"), mask, kv
    )
    sources = parse_sources(queries)
    plan = sources[0].plan(adapter, spec)
    for source in sources[1:]:
        plan = plan.merge(source.plan(adapter, spec))
    collector = QueryCollector(adapter, spec, plan, cap=query_cap, seed=seed)
    return PreparedPrefix(
        adapter,
        spec,
        queries,
        collector,
        {"prefill_and_plan_s": time.perf_counter() - start},
    )


def compact_prefix(
    adapter: ModelAdapter,
    token_ids: Sequence[int],
    compact_mask: torch.Tensor,
    *,
    method: str = DEFAULT_METHOD,
    queries: str | None = None,
    query_cap: int = 50_000,
    seed: int = 0,
    **kwargs: Any,
) -> CompactedCache:
    """Compact the tokens of ``token_ids [T]`` selected by ``compact_mask [T]`` (see ``compact``)."""
    options = {k: v for k, v in kwargs.items() if k not in _RUN_ARGUMENTS}
    # every check of the method before the prefill
    recipe = resolve(
        method,
        queries=queries,
        budgets=kwargs.get("budgets"),
        on_policy=kwargs.get("on_policy"),
        options=options,
    ).recipe
    content = int(torch.as_tensor(compact_mask, dtype=torch.bool, device="cpu").sum())
    queries = recipe.queries
    if content:  # else prepare_prefix says there is nothing to compact
        # a '/auto' probe spacing follows the ratio: plan the probes for this one
        queries = resolve_spacing(
            queries,
            _resolve_ratio(kwargs.get("ratio"), kwargs.get("target_tokens"), content),
        )
    prepared = prepare_prefix(
        adapter,
        token_ids,
        compact_mask,
        queries=queries,
        query_cap=query_cap,
        seed=seed,
    )
    # the prepared plan fixes the queries
    return compact_prepared(prepared, method=method, **kwargs)


#: The arguments of ``compact_prepared`` that are not options of the method.
_RUN_ARGUMENTS = (
    "ratio",
    "target_tokens",
    "budgets",
    "on_policy",
    "progress",
    "on_progress",
    "chunk_tokens",
)


@dataclass
class _Compaction:
    """The state one ``compact_prepared`` call passes from stage to stage."""

    prepared: PreparedPrefix
    plan: ResolvedRecipe
    method: str
    ratio: float
    chunk_tokens: int | None
    progress: bool
    on_progress: Callable[[float], None] | None
    #: ``[L]`` host bools: which layers are compacted.
    layers: torch.Tensor = field(init=False)
    #: host masks of the content chunks, and their device copies (which index the keys).
    chunks: list[torch.Tensor] = field(init=False)
    chunks_on_device: list[torch.Tensor] = field(init=False)
    #: first and last position of the content and a ranked template (``compacted_span``).
    span: list[int] = field(init=False)
    #: device mask of the template tokens and the protected ones, which stay exact.
    exact_on_device: torch.Tensor = field(init=False)
    #: how many content tokens are protected (``budgets.protect``).
    protected: int = field(init=False)
    #: per chunk, ``[chunk tokens]`` device mask of the protected tokens each head's selection
    #: keeps first (``protect_by="selection"``), or int64 span ids (``"whole"``), or ``None``.
    priorities: list[torch.Tensor | None] = field(init=False)
    #: the ratio the budgets give the fitted content: ``ratio`` less the slots of the tokens
    #: protected exact.
    fit_ratio: float = field(init=False)
    positions: torch.Tensor = field(init=False)
    scales: list[float] = field(init=False)
    windows: list[int | None] = field(init=False)
    #: per layer, whether it is in the ``priority_exact_depth`` band, where the heads run
    #: ``band_method`` and keep first the tokens of ``band_priorities`` (``band_protect``).
    in_band: list[bool] = field(init=False)
    band_priorities: list[torch.Tensor | None] = field(init=False)
    band_protected: int = field(init=False)
    #: per chunk, ``[chunk tokens]`` device mask of the protected tokens the fit's
    #: ``priority_beta_floor`` raises (``floor_on="singular"``), or ``None`` (every one).
    floor_keys: list[torch.Tensor | None] = field(init=False)
    #: per chunk of the content, ``[L, H]`` budgets (the budgets stage).
    budgets: list[torch.Tensor] = field(default_factory=list)
    #: per layer, its slots (the layers stage).
    compacted: list[CompactedHeads | None] = field(default_factory=list)
    #: this call's stages, in seconds; the prepared prefix's are merged in at the end.
    timings: dict[str, float] = field(default_factory=dict)
    fit_s: float = 0.0
    cache: CompactedCache | None = None

    def __post_init__(self) -> None:
        adapter = self.prepared.adapter
        # host bookkeeping, as the masks
        self.layers = torch.tensor(adapter.compactable_layers, device="cpu")
        self.compacted = [None] * adapter.num_layers
        spec = self.prepared.spec
        mask, n = spec.compact_mask, self.prepared.num_content
        # the rule's cap: half the mean head budget, or none where each head's selection caps
        # what it keeps (protect_room="head")
        room = None if self.plan.protect_room == "head" else self.ratio * n
        protected = protected_tokens(
            spec.token_ids, adapter.tokenizer, self.plan.protect, mask, room
        )
        kept = self.protected = int(protected.sum())
        # what the cache's compacted_span covers: the content, and a ranked template's tokens
        self.fit_ratio, content, spanned = self.ratio, mask, mask
        if self.plan.protect_by == "exact" and kept:
            # protected content tokens stay exact, as the template's; their slots come out of
            # the budget, so the rest is fitted at a lower ratio and the prefix keeps its size
            self.fit_ratio = (self.ratio * n - kept) / (n - kept)
            content = mask & ~protected
        if self.plan.template == "ranked":
            # the template's tokens (past the sinks) join the content and its budget, so the
            # prefix keeps as many slots as with them exact (KVzip's budget)
            ranked = ranked_template(mask)
            extra, fitted = int(ranked.sum()), int(content.sum())
            self.fit_ratio = (self.fit_ratio * fitted + extra) / (fitted + extra)
            content, spanned = content | ranked, mask | ranked
        # Chunked compaction (paper, KV-based): every chunk of the content gets its own budgets,
        # so a long tail cannot starve an early span (e.g. facts stated in the first turn).
        self.chunks = content_chunks(content, self.chunk_tokens)
        self.span = torch.nonzero(spanned).flatten()[[0, -1]].tolist()
        self.exact_on_device = (~content).to(adapter.device)
        self.chunks_on_device = [chunk.to(adapter.device) for chunk in self.chunks]
        self.priorities = self._chunk_priorities(protected)
        self.floor_keys = [None] * len(self.chunks)
        if self.plan.floor_on == "singular" and kept:
            # the fit's floor raises only the protected words with no look-alike (budgets.protect)
            singular = singular_tokens(spec.token_ids, adapter.tokenizer, mask)
            self.floor_keys = [
                singular[chunk].to(adapter.device) for chunk in self.chunks
            ]
        self.positions = torch.arange(self.prepared.spec.length, device=adapter.device)
        self.scales = adapter.layer_scales()
        self.windows = adapter.layer_windows
        self.in_band = self.plan.band_layers(adapter.num_layers)
        self.band_priorities, self.band_protected = self.priorities, kept
        if self.plan.band_protect not in (None, self.plan.protect):
            in_band = protected_tokens(
                spec.token_ids,
                adapter.tokenizer,
                self.plan.band_protect,
                mask,
                room,
            )
            self.band_protected = int(in_band.sum())
            self.band_priorities = self._chunk_priorities(in_band)

    def _chunk_priorities(self, protected: torch.Tensor) -> list[torch.Tensor | None]:
        """Per chunk, what each head's selection keeps first of the ``protected`` tokens (by
        selection token by token, ``whole`` by span ids), or ``None`` (none protected, or
        ``protect_by="exact"``, which keeps them outside the fit)."""
        priority, any_protected = None, bool(protected.any())
        if any_protected and self.plan.protect_by == "selection":
            priority = protected
        elif any_protected and self.plan.protect_by == "whole":
            priority = span_ids(protected)
        device = self.prepared.adapter.device
        return [
            None if priority is None else priority[chunk].to(device)
            for chunk in self.chunks
        ]


def _budget_stage(run: _Compaction) -> None:
    """Head budgets of every chunk; ``global`` ones rank the keys by their reference scores,
    computed (with the off-policy queries they need) on first use and shared by the chunks."""
    prepared, adapter, scoring = run.prepared, run.prepared.adapter, run.plan.scoring

    @functools.cache
    def prefix_scores() -> tuple[torch.Tensor | None, ...]:
        return tuple(
            prepared.key_scores(
                i,
                run.scales[i],
                scoring.softmax,
                scoring.aggregation,
                scoring.weight_power,
            )
            if run.layers[i]
            else None
            for i in range(adapter.num_layers)
        )

    def chunk_scores(chunk: torch.Tensor) -> list[torch.Tensor | None]:
        return [None if s is None else s[:, chunk] for s in prefix_scores()]

    run.budgets = [
        resolve_budgets(
            run.plan.recipe.budgets,
            ratio=run.fit_ratio,
            n=int(chunk.sum()),
            layers=run.layers,
            num_heads=adapter.num_kv_heads,
            model_name=adapter.name,
            scores=functools.partial(chunk_scores, chunk),
            **run.plan.budget_options,
        )
        for chunk in run.chunks
    ]


def _fit_layer(
    run: _Compaction, layer: int, layer_queries: torch.Tensor
) -> PrefixLayer | None:
    """Compact one layer with its reference queries: the template slots stay exact, every chunk
    is fitted to its budgets. Returns the compacted layer for the on-policy pass to attend."""
    kv = run.prepared.spec.kv
    keys, values = kv.keys[layer], kv.values[layer]
    if not run.layers[layer]:
        # a sliding layer keeps only what a continuation can still see: its last W - 1 keys
        window = run.windows[layer]
        keep = slice(-(window - 1), None) if window and window > 1 else slice(None)
        run.compacted[layer] = CompactedHeads.exact(
            keys[:, keep], values[:, keep], run.positions[keep]
        )
        return None
    start = time.perf_counter()
    exact, positions = run.exact_on_device, run.positions
    parts = [CompactedHeads.exact(keys[:, exact], values[:, exact], positions[exact])]
    query_weights = run.prepared.collector.weights(layer)
    plan = run.plan
    method, priorities = plan.method, run.priorities
    if run.in_band[layer] and plan.band_method is not None:
        method, priorities = plan.band_method, run.band_priorities
    for chunk, budgets, priority, floor_keys in zip(
        run.chunks_on_device, run.budgets, priorities, run.floor_keys, strict=True
    ):
        parts.append(
            compact_heads(
                keys[:, chunk],
                values[:, chunk],
                layer_queries,
                budgets[layer],
                method=method,
                scale=run.scales[layer],
                positions=positions[chunk],
                query_weights=query_weights,
                priority=priority,
                floor_keys=floor_keys,
            )
        )
    heads = CompactedHeads.concat_slots(parts)
    run.compacted[layer] = heads
    run.fit_s += time.perf_counter() - start
    k, beta, v, idx = heads.padded()
    return PrefixLayer(k, v, beta, idx)


def _layer_stage(run: _Compaction) -> None:
    """Every layer in order: on-policy, inside one packed forward pass whose queries at layer l
    come from the layers below, already compacted (its time less the fits is
    ``on_policy_queries_s``); off-policy, with the prepared prefix's queries."""
    adapter, collector = run.prepared.adapter, run.prepared.collector
    bar = tqdm(
        total=adapter.num_layers,
        desc=f"{run.method} layers",
        unit="layer",
        disable=not run.progress,
    )
    if run.on_progress is not None:
        run.on_progress(0.0)

    def on_layer(layer: int, layer_queries: torch.Tensor) -> PrefixLayer | None:
        bar.update(1)
        if run.on_progress is not None:
            run.on_progress(bar.n / adapter.num_layers)
        return _fit_layer(run, layer, layer_queries)

    start = time.perf_counter()
    if run.plan.recipe.on_policy:
        collector.run(run.prepared.spec.kv.exact_prefix(), on_layer=on_layer)
        run.timings["on_policy_queries_s"] = time.perf_counter() - start - run.fit_s
    else:
        for layer, layer_queries in enumerate(run.prepared.off_policy_queries()):
            on_layer(layer, layer_queries)
    bar.close()


def _record_stage(run: _Compaction) -> None:
    """The cache, with the options it was made with and the timings of every stage."""
    prepared, plan = run.prepared, run.plan
    # prepared.timings gains queries_s when the off-policy pass ran during this call
    timings = {**prepared.timings, **run.timings, "fit_s": run.fit_s}
    timings["total_s"] = sum(v for k, v in timings.items() if k != "total_s")
    layers = [heads for heads in run.compacted if heads is not None]
    if len(layers) != len(run.compacted):
        raise RuntimeError("the layers stage left a layer without its slots")
    run.cache = CompactedCache(
        layers=layers,
        logical_length=prepared.spec.length,
        token_ids=prepared.spec.token_ids.tolist(),
        compacted_span=(run.span[0], run.span[1] + 1),
        layer_compacted=run.layers.tolist(),
        model=prepared.adapter.fingerprint(),
        method=run.method,
        ratio=run.ratio,
        options={
            **plan.math_options,
            **plan.budget_options,
            **plan.scoring.as_options(),
            "protect": plan.protect,
            "protect_by": plan.protect_by,
            "protect_room": plan.protect_room,
            "protected_tokens": run.protected,
            "floor_on": plan.floor_on,
            "template": plan.template,
            "priority_exact_depth": None
            if plan.priority_exact_depth is None
            else "-".join(f"{share:g}" for share in plan.priority_exact_depth),
            "band_protect": plan.band_protect,
            "band_protected_tokens": None
            if plan.band_protect is None
            else run.band_protected,
            "chunk_tokens": run.chunk_tokens,
            "query_cap": prepared.collector.cap,
            "seed": prepared.collector.seed,
            "on_policy": plan.recipe.on_policy,
        },
        query_source=plan.recipe.queries,
        budgets=plan.recipe.budgets,
        timings=timings,
    )


#: What ``compact_prepared`` does, in order: budgets (which may run the reference queries),
#: the layers (on-policy queries and the fits), the cache.
_STAGES: tuple[Callable[[_Compaction], None], ...] = (
    _budget_stage,
    _layer_stage,
    _record_stage,
)


def compact_prepared(
    prepared: PreparedPrefix,
    *,
    ratio: float | None = None,
    target_tokens: int | None = None,
    method: str = DEFAULT_METHOD,
    budgets: str | None = None,
    on_policy: bool | None = None,
    progress: bool = False,
    on_progress: Callable[[float], None] | None = None,
    chunk_tokens: int | None = None,
    **options: Any,
) -> CompactedCache:
    """Compact a prepared prefix at one ratio with one method (``on_progress``, ``chunk_tokens``:
    see ``compact``)."""
    plan = resolve(
        method,
        queries=prepared.queries,
        budgets=budgets,
        on_policy=on_policy,
        options=options,
    )
    n = prepared.num_content
    run = _Compaction(
        prepared,
        plan,
        method,
        _resolve_ratio(ratio, target_tokens, n),
        chunk_tokens,
        progress,
        on_progress,
    )
    for stage in _STAGES:
        stage(run)
    cache = run.cache
    assert cache is not None  # the record stage sets it
    logger.info(
        "compacted %d content tokens at %.3f with %s: %d -> %d slots in %.1fs",
        n,
        run.ratio,
        method,
        prepared.spec.length * int(run.layers.sum()) * prepared.adapter.num_kv_heads,
        cache.physical_slots,
        cache.timings["total_s"],
    )
    return cache
