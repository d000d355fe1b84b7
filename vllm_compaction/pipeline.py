"""``compact()``: chat messages -> ``CompactedCache``. The only per-layer loop of the project.

tokens -> prefill (keys/values/queries) -> query plan -> budgets -> per-layer ``compact_heads``
(on-policy: inside one packed forward pass) -> exact template slots + compacted slots.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from vllm_compaction.am import CompactedHeads, compact_heads, score_keys
from vllm_compaction.budgets import resolve_budgets
from vllm_compaction.cache import CompactedCache
from vllm_compaction.models import ModelAdapter, PrefixLayer, load_adapter, resolve_device
from vllm_compaction.queries import PrefixSpec, QueryCollector, parse_sources, resolve_spacing
from vllm_compaction.recipes import BUDGET_OPTIONS, DEFAULT_METHOD, RECIPES, resolve_recipe

__all__ = ["DEFAULT_METHOD", "PreparedPrefix", "RECIPES", "compact", "compact_prefix", "compact_prepared",
           "prepare_prefix"]

logger = logging.getLogger(__name__)


#: How global budgets normalise a probe query's attention when ranking keys (``key_scores``).
SCORE_SOFTMAXES = ("prefix", "probe")
DEFAULT_SCORE_SOFTMAX = "prefix"
#: How global budgets aggregate a key's attention over the reference queries: KVzip's ``max``,
#: or ``weighted-max``, where each query's weight scales its attention (``score_keys``). The
#: default is ``weighted-max`` under the ``prefix`` softmax, which is ``max`` for unweighted
#: queries: a source weighted ``*k`` weighs in the ranking too (measured on 48 needles:
#: 46/44/35 at 10/5/2% with the default power 2, 46/41/37 with power 1, 46/40/32 with ``max``).
SCORE_AGGREGATIONS = ("max", "weighted-max")
#: ``weighted-max`` raises each source's weight to this power in the ranking only (the fits keep
#: the weights as given): 0 is the plain max, 1 the weights as the fits count them, and larger
#: powers let the heaviest source decide the ranking more alone. 2 measured best on 48 needles
#: (docs/experiments/2026-11-25-needle-probes.md: "Sharper weights in the ranking").
DEFAULT_SCORE_WEIGHT_POWER = 2.0


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
    **options: Any,
) -> CompactedCache:
    """Compact the content of chat ``messages`` (template tokens stay exact).

    Args:
        model: a known name (``"smollm2-135m"``), a checkpoint folder, or a loaded adapter.
        messages: OpenAI-style ``[{"role", "content"}]``; a string is one user message.
        ratio: slots kept per head on average, as a fraction of the content tokens; or
        target_tokens: the same as an absolute number of slots per head.
        method: a method spec (``vllm_compaction.recipes``): a name of ``RECIPES`` (math preset +
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
        options: math options for ``compact_heads`` (e.g. ``values="direct"``), budget
            options (``max_head_ratio``, ``min_head_slots``, ``min_layer_share``) and how
            ``global`` budgets rank keys (``score_softmax``, ``score_aggregation``,
            ``score_weight_power``).
    """
    if isinstance(model, ModelAdapter):
        adapter = model
        if device is not None and resolve_device(device) != adapter.device:
            raise ValueError(f"the adapter's weights are on {adapter.device}, not on {device}: load it there "
                             f"(load_adapter(..., device={str(device)!r})) or leave device out")
    else:
        adapter = load_adapter(model, device="cpu" if device is None else device)
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not messages:
        raise ValueError("nothing to compact: messages is empty")
    ids, mask = adapter.chat_content(messages)
    if keep_last_tokens < 0:
        raise ValueError(f"keep_last_tokens must be >= 0, got {keep_last_tokens}")
    if keep_last_tokens:
        content_pos = torch.nonzero(mask).flatten()
        mask[content_pos[max(0, len(content_pos) - keep_last_tokens):]] = False
    return compact_prefix(adapter, ids, mask, ratio=ratio, target_tokens=target_tokens, method=method,
                          queries=queries, budgets=budgets, on_policy=on_policy, query_cap=query_cap,
                          seed=seed, progress=progress, on_progress=on_progress,
                          chunk_tokens=chunk_tokens, **options)


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
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return float(ratio)


def _check_score_softmax(softmax: str) -> None:
    if softmax not in SCORE_SOFTMAXES:
        raise ValueError(f"score_softmax must be one of {', '.join(SCORE_SOFTMAXES)}, got {softmax!r}")


def _check_score_aggregation(aggregation: str, softmax: str) -> None:
    if aggregation not in SCORE_AGGREGATIONS:
        raise ValueError(
            f"score_aggregation must be one of {', '.join(SCORE_AGGREGATIONS)}, got {aggregation!r}"
        )
    if aggregation == "weighted-max" and softmax != "prefix":
        # the probe pass's own scores are a max taken inside the model run, before any weight
        raise ValueError("score_aggregation='weighted-max' needs score_softmax='prefix'")


def _check_score_weight_power(power: float | None, aggregation: str) -> float | None:
    """The resolved power of the ranking weights: ``DEFAULT_SCORE_WEIGHT_POWER`` when ``None``
    under ``weighted-max``; ``None`` under ``max``, which has no weight to raise."""
    if power is None:
        return DEFAULT_SCORE_WEIGHT_POWER if aggregation == "weighted-max" else None
    if aggregation != "weighted-max":
        # the plain max uses no weight, so a power would be silently ignored
        raise ValueError(f"score_weight_power needs score_aggregation='weighted-max', got {aggregation!r}")
    if isinstance(power, bool) or not isinstance(power, (int, float)) or not math.isfinite(power) or power < 0:
        raise ValueError(f"score_weight_power must be a finite number >= 0, got {power!r}")
    return float(power)


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
            self._off_policy, self._probe_scores = self.collector.run_scored(self.spec.kv.exact_prefix())
            self.timings["queries_s"] = time.perf_counter() - start
        return self._probe_scores

    def key_scores(self, layer: int, scale: float, softmax: str, aggregation: str,
                   weight_power: float | None) -> torch.Tensor:
        """``[H, T]`` KVzip importance of every prefix key of ``layer``: its largest attention
        weight under the reference queries. ``softmax="prefix"`` renormalises each query over
        the prefix keys; ``"probe"`` takes the weight of the probe's real pass, whose softmax also
        covers the probe's own tokens (KVzip's score); queries without a probe (prefix queries,
        random vectors) are scored over the prefix either way. ``aggregation="weighted-max"``
        scales each query's weights by its source's weight (``QueryCollector.weights``) raised
        to ``weight_power``, over the largest one, before the max (``"prefix"`` only; ``None``
        under ``max``)."""
        _check_score_aggregation(aggregation, softmax)
        keys = self.spec.kv.keys[layer]
        if softmax == "prefix":
            weights = self.collector.weights(layer) if aggregation == "weighted-max" else None
            if weights is not None:
                weights = weights ** weight_power
            return score_keys(keys, self.off_policy_queries()[layer], scale=scale, aggregation=aggregation,
                              query_weights=weights)
        _check_score_softmax(softmax)
        probe, static = self.probe_scores()[layer], self.collector.static_queries(layer)
        if static is not None:
            prefix_only = score_keys(keys, static, scale=scale, aggregation="max")
            return prefix_only if probe is None else torch.maximum(probe, prefix_only)
        return probe


def prepare_prefix(adapter: ModelAdapter, token_ids: Sequence[int], compact_mask: torch.Tensor, *,
                   queries: str, query_cap: int = 50_000, seed: int = 0) -> PreparedPrefix:
    """Prefill ``token_ids [T]`` and plan the reference queries for the ``compact_mask`` tokens."""
    mask = torch.as_tensor(compact_mask, dtype=torch.bool, device="cpu")
    if mask.numel() != len(token_ids):
        raise ValueError(f"compact_mask has {mask.numel()} entries for {len(token_ids)} tokens")
    if not mask.any():
        raise ValueError("the prefix has no content tokens to compact")
    start = time.perf_counter()
    kv = adapter.prefill(token_ids)
    spec = PrefixSpec(torch.as_tensor(token_ids, dtype=torch.long, device="cpu"), mask, kv)
    sources = parse_sources(queries)
    plan = sources[0].plan(adapter, spec)
    for source in sources[1:]:
        plan = plan.merge(source.plan(adapter, spec))
    collector = QueryCollector(adapter, spec, plan, cap=query_cap, seed=seed)
    return PreparedPrefix(adapter, spec, queries, collector, {"prefill_and_plan_s": time.perf_counter() - start})


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
    recipe, _ = resolve_recipe(method, queries=queries)
    content = int(torch.as_tensor(compact_mask, dtype=torch.bool, device="cpu").sum())
    if content:  # else prepare_prefix says there is nothing to compact
        # a '/auto' probe spacing follows the ratio: plan the probes for this one
        ratio = _resolve_ratio(kwargs.get("ratio"), kwargs.get("target_tokens"), content)
        recipe = replace(recipe, queries=resolve_spacing(recipe.queries, ratio))
    prepared = prepare_prefix(adapter, token_ids, compact_mask, queries=recipe.queries,
                              query_cap=query_cap, seed=seed)
    return compact_prepared(prepared, method=method, **kwargs)  # the prepared plan fixes the queries


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
    adapter, kv, mask = prepared.adapter, prepared.spec.kv, prepared.spec.compact_mask
    recipe, options = resolve_recipe(method, queries=prepared.queries, budgets=budgets, on_policy=on_policy,
                                     options=options)
    budget_options = {k: options.pop(k) for k in BUDGET_OPTIONS if k in options}
    score_softmax = options.pop("score_softmax", DEFAULT_SCORE_SOFTMAX)
    score_aggregation = options.pop("score_aggregation", None)
    if score_aggregation is None:  # an explicit value, even an empty one, is checked below
        score_aggregation = "weighted-max" if score_softmax == "prefix" else "max"
    _check_score_softmax(score_softmax)
    _check_score_aggregation(score_aggregation, score_softmax)
    score_weight_power = _check_score_weight_power(options.pop("score_weight_power", None), score_aggregation)
    n = prepared.num_content
    ratio = _resolve_ratio(ratio, target_tokens, n)
    timings: dict[str, float] = {}  # this call's stages; the prepared prefix's are merged at the end
    layers = torch.tensor(adapter.compactable_layers, device="cpu")  # host bookkeeping, as the masks
    scales = adapter.layer_scales()
    device = adapter.device
    positions = torch.arange(prepared.spec.length, device=device)

    @functools.cache
    def prefix_scores() -> tuple[torch.Tensor | None, ...]:
        return tuple(prepared.key_scores(i, scales[i], score_softmax, score_aggregation, score_weight_power)
                     if layers[i] else None
                     for i in range(adapter.num_layers))

    # Chunked compaction (paper, KV-based): every chunk of the content gets its own budgets, so
    # a long tail cannot starve an early span (e.g. facts stated in the first turn).
    chunks = content_chunks(mask, chunk_tokens)  # host masks; their device copies index the keys
    exact_on_device, chunks_on_device = (~mask).to(device), [chunk.to(device) for chunk in chunks]
    chunk_budgets = [
        resolve_budgets(recipe.budgets, ratio=ratio, n=int(chunk.sum()), layers=layers,
                        num_heads=adapter.num_kv_heads, model_name=adapter.name,
                        scores=lambda chunk=chunk: [None if s is None else s[:, chunk] for s in prefix_scores()],
                        **budget_options)
        for chunk in chunks
    ]
    compacted: list[CompactedHeads] = [None] * adapter.num_layers  # type: ignore[list-item]
    fit_time = [0.0]
    bar = tqdm(total=adapter.num_layers, desc=f"{method} layers", unit="layer", disable=not progress)
    if on_progress is not None:
        on_progress(0.0)

    def compact_layer(layer: int, layer_queries: torch.Tensor) -> PrefixLayer | None:
        keys, values = kv.keys[layer], kv.values[layer]
        bar.update(1)
        if on_progress is not None:
            on_progress(bar.n / adapter.num_layers)
        if not layers[layer]:
            compacted[layer] = CompactedHeads.exact(keys, values, positions)
            return None
        start = time.perf_counter()
        parts = [CompactedHeads.exact(keys[:, exact_on_device], values[:, exact_on_device],
                                      positions[exact_on_device])]
        query_weights = prepared.collector.weights(layer)
        for chunk, budgets_of_chunk in zip(chunks_on_device, chunk_budgets):
            parts.append(compact_heads(keys[:, chunk], values[:, chunk], layer_queries, budgets_of_chunk[layer],
                                       method=recipe.math, scale=scales[layer], positions=positions[chunk],
                                       query_weights=query_weights, **options))
        compacted[layer] = CompactedHeads.concat_slots(parts)
        fit_time[0] += time.perf_counter() - start
        k, beta, v, idx = compacted[layer].padded()
        return PrefixLayer(k, v, beta, idx)

    start = time.perf_counter()
    if recipe.on_policy:
        prepared.collector.run(kv.exact_prefix(), on_layer=compact_layer)
        timings["on_policy_queries_s"] = time.perf_counter() - start - fit_time[0]
    else:
        off_policy = prepared.off_policy_queries()
        for layer in range(adapter.num_layers):
            compact_layer(layer, off_policy[layer])
    bar.close()
    # prepared.timings gains queries_s when the off-policy pass ran during this call
    timings = {**prepared.timings, **timings, "fit_s": fit_time[0]}
    timings["total_s"] = sum(v for k, v in timings.items() if k != "total_s")
    span = torch.nonzero(mask).flatten()
    cache = CompactedCache(
        layers=compacted,
        logical_length=prepared.spec.length,
        token_ids=prepared.spec.token_ids.tolist(),
        compacted_span=(int(span[0]), int(span[-1]) + 1),
        layer_compacted=layers.tolist(),
        model=adapter.fingerprint(),
        method=method,
        ratio=ratio,
        options={**options, **budget_options, "score_softmax": score_softmax,
                 "score_aggregation": score_aggregation,
                 "score_weight_power": score_weight_power,
                 "chunk_tokens": chunk_tokens, "query_cap": prepared.collector.cap,
                 "seed": prepared.collector.seed, "on_policy": recipe.on_policy},
        query_source=recipe.queries,
        budgets=recipe.budgets,
        timings=timings,
    )
    logger.info("compacted %d content tokens at %.3f with %s: %d -> %d slots in %.1fs", n, ratio,
                method, prepared.spec.length * int(layers.sum()) * adapter.num_kv_heads,
                cache.physical_slots, timings["total_s"])
    return cache
