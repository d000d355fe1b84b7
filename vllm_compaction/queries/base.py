"""Reference-query sources: what a source contributes, and the protocol it implements.

A source never runs the model itself for recording: it returns a ``QueryPlan`` (token
continuations to run after the prefix, plus flags for the prefix's own queries and random
vectors). ``collect.QueryCollector`` runs every plan of a mixture in one packed forward pass,
which is what lets on-policy compaction happen layer by layer inside that single pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from vllm_compaction.models.base import ModelAdapter, PrefixKV

__all__ = ["PrefixSpec", "QueryPlan", "QuerySource"]


@dataclass
class PrefixSpec:
    """The prefix being compacted.

    Attributes:
        token_ids: ``[T]`` all prefix tokens (template + content).
        compact_mask: ``[T]`` bool, True for the tokens to compact (content C).
        kv: the prefix's keys/values/queries from one prefill.
    """

    token_ids: torch.Tensor
    compact_mask: torch.Tensor
    kv: PrefixKV
    _content_surprisal: torch.Tensor | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    @property
    def content_ids(self) -> list[int]:
        return self.token_ids[self.compact_mask].tolist()

    def content_surprisal(self, adapter: ModelAdapter) -> torch.Tensor:
        """``[C]`` float32 surprisal (nats) of each content token, on the host, from the
        prefill's hidden states when kept. Computed once per prefix: every surprise source of a
        mixture reads it, and the vocabulary projection is most of their planning time."""
        if self._content_surprisal is None:
            hidden = self.kv.last_hidden if self.kv is not None else None
            surprisal = adapter.token_surprisal(self.token_ids, hidden=hidden).cpu()
            self._content_surprisal = surprisal[self.compact_mask]
        return self._content_surprisal


@dataclass
class QueryPlan:
    """Queries a source asks for.

    Attributes:
        continuations: token sequences run after the prefix (positions T, T+1, ...), each
            attending to the prefix and to itself only.
        record_from: per continuation, the offset from which its queries are recorded.
        weights: per continuation, how many times each recorded query counts (default 1):
            a row counted ``w`` times weighs ``w`` in the least-squares fits of beta and values
            (and OMP) and in the rms key scores, exactly as if the continuation had run ``w``
            times. The row is recorded once; ``QueryCollector.weights`` hands the weight to
            ``compact_heads(query_weights=)``.
        prefix_queries: include the prefix's own queries (context-prefill).
        random_vectors: random query vectors per KV head, scaled to the head's query norm.
    """

    continuations: list[list[int]] = field(default_factory=list)
    record_from: list[int] = field(default_factory=list)
    weights: list[int] | None = None
    prefix_queries: bool = False
    random_vectors: int = 0

    def __post_init__(self) -> None:
        if len(self.record_from) != len(self.continuations):
            raise ValueError("record_from needs one offset per continuation")
        if self.weights is None:
            self.weights = [1] * len(self.continuations)
        if len(self.weights) != len(self.continuations) or any(
            isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.weights
        ):
            raise ValueError("weights needs one integer >= 1 per continuation")

    def merge(self, other: QueryPlan) -> QueryPlan:
        # __post_init__ fills both plans' weights
        assert self.weights is not None and other.weights is not None
        return QueryPlan(
            continuations=self.continuations + other.continuations,
            record_from=self.record_from + other.record_from,
            weights=self.weights + other.weights,
            prefix_queries=self.prefix_queries or other.prefix_queries,
            random_vectors=self.random_vectors + other.random_vectors,
        )

    def weighted(self, weight: int) -> QueryPlan:
        """This plan with every continuation's weight multiplied by ``weight``."""
        if self.prefix_queries or self.random_vectors:
            raise ValueError(
                "a weight applies to sources that run continuations, not to "
                "context-prefill or random-vectors"
            )
        assert self.weights is not None  # __post_init__ fills it
        return dataclasses.replace(self, weights=[w * weight for w in self.weights])


class QuerySource(Protocol):
    """One way of sampling reference queries (one file per source)."""

    @property
    def name(self) -> str: ...

    def plan(self, adapter: ModelAdapter, prefix: PrefixSpec) -> QueryPlan: ...
