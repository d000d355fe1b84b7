"""Attention Matching (AM) KV compaction math, batched over KV heads; imports only torch.

``compact_heads`` turns ``[H, T, d]`` keys/values plus ``[H, n, d]`` reference queries into
varlen-packed ``CompactedHeads`` with per-head budgets, running the math a ``MethodSpec``
declares (a selector of ``SELECTORS`` with its options, and ``FitOptions``); the named methods
(AM and baselines) are ``vllm_compaction.recipes.RECIPES``, a layer above. The fit/attention
helpers are exported for budget solvers and evaluation.
"""

from vllm_compaction.am.attention import (
    AttentionResult,
    OutputError,
    attention_output_and_mass,
    attention_output_error,
    score_keys,
)
from vllm_compaction.am.compact import compact_heads
from vllm_compaction.am.fit import lstsq_values, nnls_pgd
from vllm_compaction.am.heads import CompactedHeads, cu_seqlens_from_lengths
from vllm_compaction.am.presets import (
    AM_HIGHEST_ATTENTION,
    FitOptions,
    MethodSpec,
    ResolvedMethod,
    resolve_method,
)
from vllm_compaction.am.selectors import SELECTORS, Selector

__all__ = [
    "AM_HIGHEST_ATTENTION",
    "SELECTORS",
    "AttentionResult",
    "CompactedHeads",
    "FitOptions",
    "MethodSpec",
    "OutputError",
    "ResolvedMethod",
    "Selector",
    "attention_output_and_mass",
    "attention_output_error",
    "compact_heads",
    "cu_seqlens_from_lengths",
    "lstsq_values",
    "nnls_pgd",
    "resolve_method",
    "score_keys",
]
