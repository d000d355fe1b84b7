"""Per-head sensitivity curves and a model's head-budget schedule (paper: "Nonuniform
Compaction", appendix "Head Budgets").

Per context, one compaction pass at the base ratio (on-policy when the method is) also compacts
every compactable layer, with the same queries, at every ratio of a grid. The loss is the mean
NLL of a reconstruction target (the first context tokens after the turn "Repeat the previous
context.") under a compacted prefix; curve point ``((l, h), r)`` = loss with head h of layer l
from the ratio-r compaction and all other heads at base, minus the all-base loss. Layers below l
see exactly the baseline run: their recorded outputs are replayed by stubs swapped in for the
stock decoder layers, so only layers >= l are computed.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from vllm_compaction.am import CompactedHeads, compact_heads, cu_seqlens_from_lengths
from vllm_compaction.budgets.allocate import uniform_budgets
from vllm_compaction.budgets.schedule import Schedule
from vllm_compaction.budgets.solver import greedy_swap_shares
from vllm_compaction.models import ModelAdapter, PrefixLayer, load_adapter

if TYPE_CHECKING:
    from vllm_compaction.pipeline import PreparedPrefix

__all__ = [
    "LossContext",
    "SensitivityCurves",
    "TargetLoss",
    "compute_schedule",
    "default_ratios",
    "head_sensitivity_curves",
    "mixed_layer",
    "repeat_context",
]

logger = logging.getLogger(__name__)

# x base ratio, clipped to [0, 1]: 0, .05, .1, .25, 1 at .05
_GRID_FACTORS = (
    0.0,
    1.0,
    2.0,
    5.0,
    20.0,
)
DEFAULT_TARGET_TOKENS = 64
CONTEXT_SEED_OFFSET = (
    10_000  # haystack seeds stay clear of the small seeds of NIAH instances
)


@dataclass
class LossContext:
    """A prefix to compact and the target whose NLL measures the damage.

    Attributes:
        prefix_ids: ``[T]`` prefix tokens; compact_mask: ``[T]`` bool, the tokens to compact.
        target_ids: ``[M]`` tokens run after the prefix (positions T..T+M-1).
        score_from: NLL is the mean over ``target_ids[score_from:]`` (>= 1).
    """

    prefix_ids: list[int]
    compact_mask: torch.Tensor
    target_ids: list[int]
    score_from: int

    def __post_init__(self) -> None:
        self.compact_mask = torch.as_tensor(self.compact_mask, dtype=torch.bool)
        if (
            self.compact_mask.numel() != len(self.prefix_ids)
            or not self.compact_mask.any()
        ):
            raise ValueError(
                "compact_mask needs one entry per prefix token and at least one True"
            )
        if not 1 <= self.score_from < len(self.target_ids):
            raise ValueError(
                f"score_from must be in [1, {len(self.target_ids)}), got {self.score_from}"
            )


def _has_chat_template(adapter: ModelAdapter) -> bool:
    return bool(getattr(adapter.tokenizer, "chat_template", None))


def repeat_context(
    adapter: ModelAdapter, text: str, *, target_tokens: int = DEFAULT_TARGET_TOKENS
) -> LossContext:
    """``text`` as one user message; target: the turn "Repeat the previous context." and the
    first ``target_tokens`` content tokens (scored). A base model without a chat template gets
    the plain text (special tokens exact) and the instruction between blank lines."""
    from vllm_compaction.queries.repeat_prefill import REPEAT_INSTRUCTION

    if target_tokens < 1:
        raise ValueError(f"target_tokens must be positive, got {target_tokens}")
    if _has_chat_template(adapter):
        ids, mask = adapter.chat_content([{"role": "user", "content": text}])
        turn = adapter.turn_ids([{"role": "user", "content": REPEAT_INSTRUCTION}])
    else:
        ids = [int(i) for i in adapter.tokenizer(text)["input_ids"]]
        special = set(adapter.tokenizer.all_special_ids)
        mask = torch.tensor([i not in special for i in ids])
        turn = adapter.encode(f"\n\n{REPEAT_INSTRUCTION}\n\n")
    content = torch.as_tensor(ids)[mask].tolist()[:target_tokens]
    return LossContext(ids, mask, turn + content, len(turn))


@dataclass
class SensitivityCurves:
    """Per-head curves, heads flattened layer-major (``l * H + h``).

    Attributes:
        curves: ``[L*H, R]`` mean over contexts of loss(head at ``ratios[r]``, others at base)
            minus loss(all at base); 0 for heads of layers that are not compacted.
        std: ``[L*H, R]`` standard deviation of that change across contexts (0 for one context).
        ratios: ``[R]`` increasing ratios (the base ratio among them).
        compactable: ``[L*H]`` bool, heads that get curves.
        baseline: ``[C]`` all-base loss of each context.
    """

    curves: torch.Tensor
    std: torch.Tensor
    ratios: torch.Tensor
    base_ratio: float
    compactable: torch.Tensor
    baseline: torch.Tensor
    num_layers: int
    num_kv_heads: int


def _decoder_layers(adapter: ModelAdapter) -> torch.nn.ModuleList:
    decoder = (
        adapter.model.get_decoder()
        if hasattr(adapter.model, "get_decoder")
        else adapter.model.model
    )
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != adapter.num_layers:
        raise ValueError(
            "cannot find the model's decoder layers to replay (expected decoder.layers)"
        )
    return layers


class _Replay(torch.nn.Module):
    """Stands in for a decoder layer: returns its recorded output, computes nothing."""

    def __init__(self, output: Any):
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ARG002 - the layer's call signature
        return self.output


@contextlib.contextmanager
def _replaying(
    layers: torch.nn.ModuleList, outputs: list[Any], upto: int
) -> Iterator[None]:
    saved = [layers[i] for i in range(upto)]
    try:
        for i in range(upto):
            layers[i] = _Replay(outputs[i])
        yield
    finally:
        for i, module in enumerate(saved):
            layers[i] = module


class TargetLoss:
    """Mean NLL of a context's target after per-layer prefixes that differ from ``base`` in one
    layer. ``baseline()`` runs the all-base prefix and records every decoder layer's output;
    ``loss(l, layer_prefix)`` then runs only layers >= l (``replay=False``: the full model)."""

    def __init__(
        self, adapter: ModelAdapter, ctx: LossContext, base: list[PrefixLayer | None]
    ):
        self.adapter, self.base = adapter, base
        length, m = len(ctx.prefix_ids), len(ctx.target_ids)
        self.ids = torch.tensor(ctx.target_ids, dtype=torch.long)
        self.positions = torch.arange(length, length + m)
        # logits row i predicts token i + 1
        self.rows = torch.arange(ctx.score_from - 1, m - 1)
        self.labels = self.ids[ctx.score_from :]
        self._layers = _decoder_layers(adapter)
        self._outputs: list[Any] | None = None
        self.baseline_loss = float("nan")

    def _nll(self, prefix: list[PrefixLayer | None]) -> float:
        logits = self.adapter.forward(
            self.ids, self.positions, prefix=prefix, logits_to_keep=self.rows
        ).logits
        assert logits is not None  # logits_to_keep keeps the scored rows
        return float(F.cross_entropy(logits, self.labels))

    def baseline(self) -> float:
        """All-base loss; records each decoder layer's output for replay."""
        outputs: list[Any] = [None] * len(self._layers)
        hooks = [
            layer.register_forward_hook(
                lambda _m, _a, out, i=i: outputs.__setitem__(i, out)
            )
            for i, layer in enumerate(self._layers)
        ]
        try:
            self.baseline_loss = self._nll(self.base)
        finally:
            for handle in hooks:
                handle.remove()
        self._outputs = outputs
        return self.baseline_loss

    def loss(
        self, layer: int, layer_prefix: PrefixLayer, *, replay: bool = True
    ) -> float:
        """Loss with ``layer``'s prefix replaced by ``layer_prefix``."""
        prefix = list(self.base)
        prefix[layer] = layer_prefix
        if not replay or layer == 0:
            return self._nll(prefix)
        if self._outputs is None:
            raise ValueError("call baseline() before loss(..., replay=True)")
        with _replaying(self._layers, self._outputs, layer):
            return self._nll(prefix)


def _prefix_layer(heads: CompactedHeads) -> PrefixLayer:
    keys, beta, values, indices = heads.padded()
    return PrefixLayer(keys, values, beta, indices)


def mixed_layer(
    per_ratio: Sequence[CompactedHeads], choice: Sequence[int]
) -> PrefixLayer:
    """One layer's prefix with head h taken from ``per_ratio[choice[h]]`` (padded, -inf bias)."""
    parts = [per_ratio[c].head(h) for h, c in enumerate(choice)]
    heads = CompactedHeads(
        keys=torch.cat([p[0] for p in parts]),
        beta=torch.cat([p[1] for p in parts]),
        values=torch.cat([p[2] for p in parts]),
        indices=torch.cat([p[3] for p in parts]),
        cu_seqlens=cu_seqlens_from_lengths([p[0].shape[0] for p in parts]),
    )
    return _prefix_layer(heads)


def _prepare(
    adapter: ModelAdapter, ctx: LossContext, queries: str, seed: int
) -> PreparedPrefix:
    """``prepare_prefix``; for repeat-prefill on a base model (no chat template) the repeat
    prompt is the plain-text instruction turn of the loss target."""
    from vllm_compaction.pipeline import PreparedPrefix, prepare_prefix
    from vllm_compaction.queries import PrefixSpec, QueryCollector, QueryPlan

    if queries != "repeat-prefill" or _has_chat_template(adapter):
        return prepare_prefix(
            adapter, ctx.prefix_ids, ctx.compact_mask, queries=queries, seed=seed
        )
    spec = PrefixSpec(
        torch.tensor(ctx.prefix_ids), ctx.compact_mask, adapter.prefill(ctx.prefix_ids)
    )
    plan = QueryPlan([ctx.target_ids[: ctx.score_from] + spec.content_ids], [0])
    return PreparedPrefix(
        adapter, spec, queries, QueryCollector(adapter, spec, plan, seed=seed), {}
    )


def _compact_grid(
    adapter: ModelAdapter,
    ctx: LossContext,
    ratios: list[float],
    base_index: int,
    *,
    method: str,
    queries: str | None,
    seed: int,
    options: dict[str, Any],
) -> tuple[list[PrefixLayer | None], dict[int, list[CompactedHeads]]]:
    """All-base prefix per layer, and per compactable layer its compaction at every ratio
    (template slots exact), all fitted to the queries of the base-ratio pass."""
    from vllm_compaction.queries import resolve_spacing
    from vllm_compaction.recipes import resolve_recipe

    recipe = resolve_recipe(method)[0]
    # one query pass serves every ratio of the grid: '/auto' probes are spaced for the base ratio
    prepared = _prepare(
        adapter,
        ctx,
        resolve_spacing(queries or recipe.queries, ratios[base_index]),
        seed,
    )
    kv, mask, n = prepared.spec.kv, prepared.spec.compact_mask, prepared.num_content
    layers = torch.tensor(adapter.compactable_layers)
    base_budgets = uniform_budgets(ratios[base_index], n, layers, adapter.num_kv_heads)
    scales, positions = adapter.layer_scales(), torch.arange(prepared.spec.length)
    base: list[PrefixLayer | None] = list(kv.exact_prefix())
    grid: dict[int, list[CompactedHeads]] = {}

    def on_layer(layer: int, layer_queries: torch.Tensor) -> PrefixLayer | None:
        if not layers[layer]:
            return None
        keys, values = kv.keys[layer], kv.values[layer]
        exact = CompactedHeads.exact(keys[:, ~mask], values[:, ~mask], positions[~mask])
        grid[layer] = []
        query_weights = prepared.collector.weights(layer)
        for i, ratio in enumerate(ratios):
            budget = (
                base_budgets[layer] if i == base_index else min(n, round(ratio * n))
            )
            heads = compact_heads(
                keys[:, mask],
                values[:, mask],
                layer_queries,
                budget,
                method=recipe.math,
                scale=scales[layer],
                positions=positions[mask],
                query_weights=query_weights,
                **options,
            )
            grid[layer].append(CompactedHeads.concat_slots([exact, heads]))
        base[layer] = _prefix_layer(grid[layer][base_index])
        return base[layer]

    if recipe.on_policy:
        prepared.collector.run(kv.exact_prefix(), on_layer=on_layer)
    else:
        for layer, layer_queries in enumerate(prepared.off_policy_queries()):
            on_layer(layer, layer_queries)
    return base, grid


def default_ratios(base_ratio: float) -> list[float]:
    """The default grid: 0, 1, 2, 5 and 20 times the base ratio, clipped to [0, 1], and 1."""
    return sorted({min(1.0, round(f * base_ratio, 6)) for f in _GRID_FACTORS} | {1.0})


def _ratio_grid(
    ratios: Sequence[float] | None, base_ratio: float
) -> tuple[list[float], int]:
    if not 0.0 < base_ratio <= 1.0:
        raise ValueError(f"base_ratio must be in (0, 1], got {base_ratio}")
    ratios = default_ratios(base_ratio) if ratios is None else ratios
    if any(not 0.0 <= r <= 1.0 for r in ratios):
        raise ValueError(
            f"every ratio of the grid must lie in [0, 1], got {list(ratios)}"
        )
    grid = sorted(set(float(r) for r in ratios) | {float(base_ratio)})
    return grid, grid.index(float(base_ratio))


def _context_deltas(
    runner: TargetLoss,
    per_layer: dict[int, list[CompactedHeads]],
    base_index: int,
    num_heads: int,
    out: torch.Tensor,
    bar: tqdm,
) -> None:
    """Fill ``out [L*H, R]`` with one context's loss changes (the base column stays 0)."""
    baseline = runner.baseline()
    for layer, per_ratio in per_layer.items():
        for h in range(num_heads):
            for r in range(len(per_ratio)):
                if r != base_index:
                    choice = [base_index] * num_heads
                    choice[h] = r
                    out[layer * num_heads + h, r] = (
                        runner.loss(layer, mixed_layer(per_ratio, choice)) - baseline
                    )
            bar.update(1)


def head_sensitivity_curves(
    adapter: ModelAdapter,
    contexts: Sequence[LossContext],
    *,
    ratios: Sequence[float] | None = None,
    base_ratio: float = 0.05,
    method: str = "am-highest-attn-fast",
    queries: str | None = None,
    seed: int = 0,
    progress: bool = True,
    **options: Any,
) -> SensitivityCurves:
    """Sensitivity curves of every compactable KV head (see the module doc).

    ``ratios`` (default ``default_ratios(base_ratio)``) get ``base_ratio`` added; ``queries``
    overrides the method's query source; ``options`` go to ``compact_heads``. Cost per context:
    one prefill and one query pass, then ``heads * (R - 1)`` target passes from the varied layer up.
    """
    from vllm_compaction.recipes import parse_method

    parse_method(method)  # ValueError with a sentence for an unknown method
    if not contexts:
        raise ValueError("head sensitivity needs at least one context")
    grid, base_index = _ratio_grid(ratios, base_ratio)
    num_layers, num_heads = adapter.num_layers, adapter.num_kv_heads
    compactable = torch.tensor(adapter.compactable_layers).repeat_interleave(num_heads)
    deltas = torch.zeros(
        len(contexts), num_layers * num_heads, len(grid), dtype=torch.float64
    )
    baseline = torch.zeros(len(contexts), dtype=torch.float64)
    bar = tqdm(
        total=len(contexts) * int(compactable.sum()),
        desc="head sensitivity",
        unit="head",
        disable=not progress,
    )
    for c, ctx in enumerate(contexts):
        base, per_layer = _compact_grid(
            adapter,
            ctx,
            grid,
            base_index,
            method=method,
            queries=queries,
            seed=seed,
            options=options,
        )
        runner = TargetLoss(adapter, ctx, base)
        _context_deltas(runner, per_layer, base_index, num_heads, deltas[c], bar)
        baseline[c] = runner.baseline_loss
        logger.info(
            "context %d/%d: all-base loss %.4f",
            c + 1,
            len(contexts),
            float(baseline[c]),
        )
    bar.close()
    std = deltas.std(0) if len(contexts) > 1 else torch.zeros_like(deltas[0])
    return SensitivityCurves(
        deltas.mean(0),
        std,
        torch.tensor(grid, dtype=torch.float64),
        float(base_ratio),
        compactable,
        baseline,
        num_layers,
        num_heads,
    )


def _rounded(t: torch.Tensor) -> list[Any] | float:
    return [_rounded(x) for x in t] if t.dim() else round(float(t), 5)


def compute_schedule(
    model: str | Path | ModelAdapter,
    *,
    contexts: int = 3,
    context_tokens: int = 1000,
    base_ratio: float = 0.05,
    seed: int = 0,
    ratios: Sequence[float] | None = None,
    target_tokens: int = DEFAULT_TARGET_TOKENS,
    method: str = "am-highest-attn-fast",
    step_fraction: float = 0.05,
    progress: bool = True,
) -> Schedule:
    """A model's head-budget schedule: curves on ``contexts`` essay haystacks of about
    ``context_tokens`` tokens, then greedy swaps in steps of ``step_fraction`` of a uniform
    share. Heads of layers that are not compacted get share 0; ``meta`` records the run."""
    if contexts < 1 or context_tokens < 2:
        raise ValueError(
            f"need contexts >= 1 and context_tokens >= 2, got {contexts} and {context_tokens}"
        )
    if not 0.0 < step_fraction <= 1.0:
        raise ValueError(f"step_fraction must be in (0, 1], got {step_fraction}")
    from vllm_compaction.corpus import haystack_text

    start = time.perf_counter()
    adapter = model if isinstance(model, ModelAdapter) else load_adapter(model)
    seeds = [CONTEXT_SEED_OFFSET + 1000 * seed + i for i in range(contexts)]
    items = [
        repeat_context(
            adapter,
            haystack_text(context_tokens, adapter.tokenizer, seed=s),
            target_tokens=target_tokens,
        )
        for s in seeds
    ]
    curves = head_sensitivity_curves(
        adapter,
        items,
        ratios=ratios,
        base_ratio=base_ratio,
        method=method,
        seed=seed,
        progress=progress,
    )
    mask = curves.compactable
    step = step_fraction / int(mask.sum())
    shares = torch.zeros(mask.numel(), dtype=torch.float64)
    shares[mask] = greedy_swap_shares(
        curves.curves[mask], curves.ratios, base_ratio, step
    )
    meta = dict(
        procedure="per-head sensitivity curves (one head varied, others at the base ratio) + greedy swaps",
        loss=f"mean NLL of the first {target_tokens} context tokens after 'Repeat the previous context.'",
        method=method,
        contexts=contexts,
        context_tokens=context_tokens,
        haystack_seeds=seeds,
        prefix_tokens=[len(c.prefix_ids) for c in items],
        target_tokens=target_tokens,
        base_ratio=base_ratio,
        ratios=curves.ratios.tolist(),
        step=step,
        seed=seed,
        seconds=round(time.perf_counter() - start, 1),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        baseline_loss=_rounded(curves.baseline),
        curves=_rounded(curves.curves),
        curves_std=_rounded(curves.std),
    )
    logger.info(
        "head-budget schedule of %s computed in %.0fs", adapter.name, meta["seconds"]
    )
    return Schedule(
        model=adapter.name or str(model),
        num_layers=curves.num_layers,
        num_kv_heads=curves.num_kv_heads,
        shares=shares.view(curves.num_layers, curves.num_kv_heads).tolist(),
        meta=meta,
    )
