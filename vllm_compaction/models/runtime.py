"""Attention runtime for stock HF models: prefix slots with per-slot bias, capture, on-policy hooks.

We register one attention function with transformers' ``AttentionInterface``. While an
``AttentionRun`` is active (a context variable), every attention layer of the model:

1. optionally hands its post-RoPE queries (pooled per KV head) to ``on_queries``, which may
   return a new prefix for that layer (this is how on-policy compaction happens inside a single
   forward pass: layer l is compacted with queries produced by layers < l already compacted);
2. attends over ``[prefix slots of this layer (with bias beta, -inf on padding)] +
   [tokens of this run (causal within their segment)]``;
3. optionally records this run's post-RoPE keys/values (prefill) and queries;
4. optionally scores the prefix slots by the largest attention weight that marked rows of the
   run give them, under the softmax of the real pass (prefix slots *and* the run's own visible
   tokens): KVzip's importance score.

Positions are explicit: prefix slots carry their original positions, run tokens the positions
passed to the model, so sliding windows are exact and logical lengths need no special case.
Without an active run the function falls back to SDPA, so the model behaves as stock.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_compaction.am.device import runtime_rows

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PrefixLayer",
    "AttentionRun",
    "active_run",
    "install",
]

ATTN_IMPLEMENTATION = "vllm_compaction"

_current: contextvars.ContextVar[AttentionRun | None] = contextvars.ContextVar(
    "vllm_compaction_attention_run", default=None
)


@dataclass
class PrefixLayer:
    """One layer's prefix slots, padded per KV head.

    Attributes:
        keys: ``[H, P, d]`` post-RoPE keys.
        values: ``[H, P, d]``.
        bias: ``[H, P]`` float32 logit bias (beta on compacted slots, 0 on exact ones, ``-inf``
            on padding).
        positions: ``[H, P]`` int64 original positions (for sliding windows; -1 on padding).
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def exact(
        cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> PrefixLayer:
        """Every token kept, no bias: keys/values ``[H, T, d]``, positions ``[T]``."""
        h, t, _ = keys.shape
        return cls(
            keys,
            values,
            torch.zeros(h, t, dtype=torch.float32, device=keys.device),
            positions.to(torch.int64).expand(h, t),
        )


@dataclass
class AttentionRun:
    """State of one forward pass (or one decode step) through the runtime.

    Attributes:
        positions: ``[L]`` int64 positions of this pass's tokens.
        segments: ``[L]`` int64 segment ids; a token attends only to earlier tokens of its own
            segment (packed independent continuations share one pass).
        prefix: per layer ``PrefixLayer`` or ``None`` (no prefix).
        past: per layer ``(keys [H, S, d], values, positions [S], segments [S])`` of earlier
            steps of this generation (decode cache), filled when ``keep_kv`` is set.
        on_queries: ``f(layer, queries [H_kv, G*L, d], query_mask [L]) -> PrefixLayer | None``.
        capture_kv / capture_queries: record this pass's keys/values / pooled queries.
        score_rows: ``[L]`` bool rows whose attention scores the prefix slots (``prefix_scores``:
            per layer ``[H_kv, P]``, the max over those rows and the GQA group of the weight a
            slot gets in the full softmax); ``None`` scores nothing.
    """

    positions: torch.Tensor
    segments: torch.Tensor
    prefix: list[PrefixLayer | None]
    keep_kv: bool = False
    capture_kv: bool = False
    capture_queries: bool = False
    on_queries: Callable[[int, torch.Tensor], PrefixLayer | None] | None = None
    score_rows: torch.Tensor | None = None
    past: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = (
        field(default_factory=dict)
    )
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    prefix_scores: dict[int, torch.Tensor] = field(default_factory=dict)

    def advance(
        self, positions: torch.Tensor, segments: torch.Tensor | None = None
    ) -> None:
        """Prepare the next decode step: new token positions (the cache keeps growing)."""
        self.positions = positions
        self.segments = torch.zeros_like(positions) if segments is None else segments


def active_run() -> AttentionRun | None:
    return _current.get()


@contextlib.contextmanager
def activate(run: AttentionRun) -> Iterator[AttentionRun]:
    token = _current.set(run)
    try:
        yield run
    finally:
        _current.reset(token)


def _pool_queries(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[Hq, L, d]`` -> ``[H_kv, G*L, d]``: the query heads of each GQA group, pooled."""
    hq, length, d = query.shape
    return query.reshape(num_kv_heads, (hq // num_kv_heads) * length, d)


def _attend(
    q: torch.Tensor,
    prefix: PrefixLayer | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    key_seg: torch.Tensor,
    run: AttentionRun,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Biased attention of ``q [H_kv, G, L, d]`` over prefix slots + run keys ``[H_kv, S, d]``.

    SDPA with an additive float mask per query block: the prefix part of the mask is the
    per-slot bias, the run part encodes causality/segments/sliding window. KV heads play the
    batch dimension and the G query heads of a group share them (``enable_gqa``).
    Returns ``[H_kv, G, L, d]``.
    """
    if prefix is not None:
        keys = torch.cat([prefix.keys.to(keys.dtype), keys], dim=1)
        values = torch.cat([prefix.values.to(values.dtype), values], dim=1)
    out = torch.empty_like(q)
    for rows in _query_blocks(
        q.shape[2], q.shape[0] * q.shape[1] * keys.shape[1] * 4, q.device
    ):
        mask = _additive_mask(
            q.shape[0], rows, prefix, key_pos, key_seg, run, sliding_window, q.dtype
        )
        # keys after the last one any row of the block may see (causality) are left out: with
        # 512-row blocks a causal run of 2,000 tokens attends 63% of the key columns it did;
        # the softmax over the rest is unchanged
        visible = torch.isfinite(mask).flatten(0, 1).any(0).nonzero()
        width = int(visible[-1]) + 1 if visible.numel() else mask.shape[-1]
        out[:, :, rows] = F.scaled_dot_product_attention(
            q[:, :, rows],
            keys[:, None, :width],
            values[:, None, :width],
            attn_mask=mask[:, None, :, :width],
            scale=scaling,
            enable_gqa=True,
        )
    return out


def _query_blocks(length: int, bytes_per_row: int, device: torch.device) -> list[slice]:
    """Blocks of query rows whose ``[H, G, rows, keys]`` logits (``bytes_per_row`` a row) fit the
    device: 512 rows on a CPU, more on CUDA (``am.device.runtime_rows``)."""
    rows = runtime_rows(device, bytes_per_row)
    return [slice(a, min(a + rows, length)) for a in range(0, length, rows)]


def _additive_mask(
    h_kv: int,
    rows: slice,
    prefix: PrefixLayer | None,
    key_pos: torch.Tensor,
    key_seg: torch.Tensor,
    run: AttentionRun,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[H_kv, rows, P + S]`` float mask: prefix bias (``-inf`` on padding or out of the window),
    then 0 / ``-inf`` for the run keys by segment, causality and sliding window."""
    q_pos, q_seg = run.positions[rows], run.segments[rows]
    allowed = (key_seg[None, :] == q_seg[:, None]) & (
        key_pos[None, :] <= q_pos[:, None]
    )
    if sliding_window:
        allowed &= (q_pos[:, None] - key_pos[None, :]) < sliding_window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )
    mask = mask.expand(h_kv, -1, -1)
    if prefix is not None:
        bias = prefix.bias.to(dtype)[:, None, :].expand(-1, q_pos.numel(), -1)
        if sliding_window:
            far = (
                q_pos[None, :, None] - prefix.positions[:, None, :]
            ) >= sliding_window
            bias = bias.masked_fill(far, float("-inf"))
        mask = torch.cat([bias, mask], dim=-1)
    return mask


def _score_prefix(
    q: torch.Tensor,
    prefix: PrefixLayer,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    key_seg: torch.Tensor,
    run: AttentionRun,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """``[H_kv, P]``: max over the ``run.score_rows`` rows of ``q [H_kv, G, L, d]`` (and the
    group) of each prefix slot's weight in the softmax over prefix slots + visible run keys.

    Unlike renormalising over the prefix alone, a head that mostly attends to the run's own
    recent tokens gives the prefix small weights here, so ranking across heads favours the heads
    that actually read the prefix (KVzip scores the same way)."""
    h_kv, p = q.shape[0], prefix.keys.shape[1]
    all_keys = torch.cat([prefix.keys.to(keys.dtype), keys], dim=1).float()
    scores = torch.zeros(h_kv, p, dtype=torch.float32, device=q.device)
    assert run.score_rows is not None  # only a run with score_rows scores its prefix
    marked = run.score_rows.to(device=q.device, dtype=torch.bool)
    for rows in _query_blocks(
        q.shape[2], q.shape[0] * q.shape[1] * all_keys.shape[1] * 4, q.device
    ):
        pick = marked[rows]
        if not bool(pick.any()):
            continue
        mask = _additive_mask(
            h_kv, rows, prefix, key_pos, key_seg, run, sliding_window, torch.float32
        )
        logits = (
            torch.einsum("hgld,hsd->hgls", q[:, :, rows][:, :, pick].float(), all_keys)
            * scaling
        )
        weights = torch.softmax(logits + mask[:, None, pick], dim=-1)[..., :p]
        scores = torch.maximum(scores, weights.amax(dim=(1, 2)))
    return scores


def _runtime_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    run = _current.get()
    if run is None:  # not ours: behave like the stock model
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            **kwargs,
        )
    if query.shape[0] != 1:
        raise ValueError(
            "the compaction attention runtime runs one sequence at a time (batch 1)"
        )
    layer = module.layer_idx
    h_kv = key.shape[1]
    q, k, v = query[0], key[0], value[0]  # [Hq, L, d], [H_kv, L, d]
    if run.capture_kv:
        run.kv[layer] = (k.detach(), v.detach())
    pooled = _pool_queries(q, h_kv) if (run.capture_queries or run.on_queries) else None
    if run.capture_queries:
        run.queries[layer] = pooled.detach()
    if run.on_queries is not None:
        new_prefix = run.on_queries(layer, pooled)
        if new_prefix is not None:
            run.prefix[layer] = new_prefix
    keys, values, key_pos, key_seg = k, v, run.positions, run.segments
    if layer in run.past:
        pk, pv, ppos, pseg = run.past[layer]
        keys, values = torch.cat([pk, k], 1), torch.cat([pv, v], 1)
        key_pos, key_seg = torch.cat([ppos, key_pos]), torch.cat([pseg, key_seg])
    if run.keep_kv:
        run.past[layer] = (keys, values, key_pos, key_seg)
    sliding = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if kwargs.get("softcap") or getattr(module, "attn_logit_softcapping", None):
        raise ValueError(
            "attention logit soft-capping is not supported by the compaction runtime"
        )
    hq, length, d = q.shape
    grouped = q.reshape(h_kv, hq // h_kv, length, d)
    prefix = run.prefix[layer] if layer < len(run.prefix) else None
    if run.score_rows is not None and prefix is not None:
        run.prefix_scores[layer] = _score_prefix(
            grouped, prefix, keys, key_pos, key_seg, run, scaling, sliding
        )
    out = _attend(
        grouped, prefix, keys, values, key_pos, key_seg, run, scaling, sliding
    )
    # [H_kv, G, L, d] -> [1, L, Hq, d] as transformers expects
    return out.reshape(hq, length, d).transpose(0, 1)[None], None


_installed = False


def install() -> None:
    """Register the runtime attention function with transformers (idempotent)."""
    global _installed
    if _installed:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _runtime_attention)
    # Stock masks keep the SDPA fallback exact (causal, sliding windows); an active run ignores
    # them and builds its own from positions and segments.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _installed = True
