"""Run a query plan: one packed forward pass over every continuation, per-KV-head caps.

Continuations are packed into one sequence with segment ids (each attends to the prefix and
to itself), so the pass visits layers in order exactly once. ``on_layer`` receives layer l's
final reference queries before layer l attends; if it returns a new prefix for the layer, the
rest of the pass runs on it: that is on-policy compaction without re-running the prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from vllm_compaction.models.runtime import PrefixLayer
from vllm_compaction.queries.base import PrefixSpec, QueryPlan

__all__ = ["QueryCollector", "DEFAULT_QUERY_CAP"]

logger = logging.getLogger(__name__)

DEFAULT_QUERY_CAP = 50_000

OnLayer = Callable[[int, torch.Tensor], PrefixLayer | None]


class QueryCollector:
    """Builds each layer's reference queries ``[H_kv, n, d]`` (float32) from a plan."""

    def __init__(
        self,
        adapter,
        prefix: PrefixSpec,
        plan: QueryPlan,
        *,
        cap: int = DEFAULT_QUERY_CAP,
        seed: int = 0,
    ):
        if cap <= 0:
            raise ValueError(f"the per-head query cap must be positive, got {cap}")
        self.adapter, self.prefix, self.plan, self.cap, self.seed = (
            adapter,
            prefix,
            plan,
            cap,
            seed,
        )
        assert plan.weights is not None  # QueryPlan.__post_init__ fills it
        ids: list[int] = []
        positions: list[int] = []
        segments: list[int] = []
        token_weights: list[int] = []
        for seg, (cont, start, weight) in enumerate(
            zip(plan.continuations, plan.record_from, plan.weights)
        ):
            ids += cont
            positions += range(prefix.length, prefix.length + len(cont))
            segments += [seg] * len(cont)
            token_weights += [weight if i >= start else 0 for i in range(len(cont))]
        self.device = device = adapter.device
        self.ids = torch.tensor(ids, dtype=torch.long, device=device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)
        self.segments = torch.tensor(segments, dtype=torch.long, device=device)
        # how many times each continuation token's queries count in the fits (0: not recorded);
        # a weight is carried to the fits (``weights``), not a second run: its queries would be
        # identical
        self.token_weights = torch.tensor(
            token_weights, dtype=torch.long, device=device
        )
        self.record = self.token_weights > 0

    @property
    def num_continuation_tokens(self) -> int:
        return int(self.ids.numel())

    def static_queries(self, layer: int) -> torch.Tensor | None:
        """``[H_kv, m, d]`` the plan's queries that need no run (prefix queries, random vectors),
        uncapped, or ``None``."""
        parts = self._static(layer)
        return torch.cat(parts, dim=1) if parts else None

    def _static(self, layer: int) -> list[torch.Tensor]:
        parts = []
        prefix_q = (
            self.prefix.kv.queries[layer]
            if self.prefix.kv.queries is not None
            else None
        )
        if self.plan.prefix_queries:
            if prefix_q is None:
                raise ValueError("context-prefill needs the prefix's queries")
            parts.append(prefix_q.float())
        if self.plan.random_vectors:
            if prefix_q is None:
                raise ValueError(
                    "random-vectors needs the prefix's queries to scale by their norm"
                )
            norm = prefix_q.float().norm(dim=-1).mean(dim=-1)  # [H]
            gen = torch.Generator(device=self.device).manual_seed(
                self.seed * 1000 + layer
            )
            h, d = prefix_q.shape[0], prefix_q.shape[-1]
            vec = torch.randn(
                h, self.plan.random_vectors, d, generator=gen, device=self.device
            )
            parts.append(vec / vec.norm(dim=-1, keepdim=True) * norm[:, None, None])
        return parts

    def _recorded(self, pooled: torch.Tensor) -> torch.Tensor:
        """``[H, G*L, d]`` pooled run queries -> ``[H, G*m, d]`` recorded rows (GQA group
        outer, token inner)."""
        h, gl, d = pooled.shape
        length = self.record.numel()
        return (
            pooled.reshape(h, gl // length, length, d)[:, :, self.record]
            .reshape(h, -1, d)
            .float()
        )

    def _capped(self, layer: int, rows: int) -> torch.Tensor | None:
        """Sorted indices of the ``cap`` rows a layer keeps out of ``rows`` (uniform, seeded by
        the layer), or ``None`` when all fit."""
        if rows <= self.cap:
            return None
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1000 + layer)
        return (
            torch.randperm(rows, generator=gen, device=self.device)[: self.cap]
            .sort()
            .values
        )

    def combine(self, layer: int, pooled: torch.Tensor | None) -> torch.Tensor:
        parts = self._static(layer) + (
            [self._recorded(pooled)] if pooled is not None else []
        )
        if not parts:
            raise ValueError("the query plan produced no reference queries")
        queries = torch.cat(parts, dim=1)
        keep = self._capped(layer, queries.shape[1])
        return queries if keep is None else queries[:, keep]

    def weights(self, layer: int) -> torch.Tensor | None:
        """``[n]`` float32 weight of each of ``layer``'s reference queries (``combine``'s rows):
        how many times the fits count it, the weight of its source. ``None`` when every row
        counts once."""
        if not (self.token_weights > 1).any():
            return None
        static = self.plan.random_vectors or 0
        if self.plan.prefix_queries:
            if self.prefix.kv.queries is None:
                raise ValueError("context-prefill needs the prefix's queries")
            static += self.prefix.kv.queries[layer].shape[1]
        group = self.adapter.num_q_heads // self.adapter.num_kv_heads
        # the rows' order in _recorded
        recorded = self.token_weights[self.record].repeat(group)
        rows = torch.cat(
            [torch.ones(static, dtype=torch.long, device=self.device), recorded]
        ).float()
        keep = self._capped(layer, rows.numel())
        return rows if keep is None else rows[keep]

    def run(
        self, prefix: Sequence[PrefixLayer | None], on_layer: OnLayer | None = None
    ) -> list[torch.Tensor]:
        """Each layer's reference queries; ``on_layer`` may swap in that layer's compacted prefix."""
        return self._run(prefix, on_layer, score_prefix=False)[0]

    def run_scored(
        self, prefix: Sequence[PrefixLayer | None]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """``run`` plus, per layer, ``[H_kv, P]`` prefix-slot scores from the recorded
        continuation rows: each slot's largest weight in the softmax of the real pass, whose
        denominator includes the continuation's own tokens (``None`` without continuations or
        for layers without a prefix). The static queries (prefix, random vectors) are not in it."""
        return self._run(prefix, None, score_prefix=True)

    def _run(
        self,
        prefix: Sequence[PrefixLayer | None],
        on_layer: OnLayer | None,
        *,
        score_prefix: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        layers = range(self.adapter.num_layers)
        out: dict[int, torch.Tensor] = {}
        if self.num_continuation_tokens == 0:
            for layer in layers:
                out[layer] = self.combine(layer, None)
                if on_layer is not None:
                    on_layer(layer, out[layer])
            return [out[i] for i in layers], [None for _ in layers]

        def on_queries(layer: int, pooled: torch.Tensor) -> PrefixLayer | None:
            out[layer] = self.combine(layer, pooled)
            return on_layer(layer, out[layer]) if on_layer is not None else None

        res = self.adapter.forward(
            self.ids,
            self.positions,
            prefix=prefix,
            segments=self.segments,
            on_queries=on_queries,
            score_rows=self.record if score_prefix else None,
        )
        return [out[i] for i in layers], [res.run.prefix_scores.get(i) for i in layers]
