"""The paper's reconstruction metrics: how well a compacted cache reproduces the full cache.

The answer the full cache generates greedily is scored under both caches: its mean negative
log-likelihood (log-perplexity) under each, and the mean KL divergence KL(full || compacted) of
the next-token distributions along it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Reconstruction", "reconstruction", "reconstruction_from_logits"]


@dataclass(frozen=True)
class Reconstruction:
    log_ppl_full: float
    log_ppl_compacted: float
    kl: float
    answer_tokens: int

    @property
    def log_ppl_ratio(self) -> float:
        return (
            self.log_ppl_compacted / self.log_ppl_full
            if self.log_ppl_full > 0
            else float("inf")
        )


def _scores(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.double(), dim=-1)
    return logp, -logp.gather(1, targets[:, None]).squeeze(1)


def reconstruction(
    decoder,
    full_source,
    compacted_source,
    continuation_ids: list[int],
    answer_ids: list[int],
) -> Reconstruction:
    """Score ``answer_ids`` (generated from ``full_source`` after ``continuation_ids``) under both
    sources with the reference decoder (``decoder.logits``)."""
    if not answer_ids:
        raise ValueError("the answer is empty: nothing to score")
    ids = list(continuation_ids) + list(answer_ids)
    # logits at position i predict token i + 1: the answer is predicted from len(cont) - 1 on
    span = slice(len(continuation_ids) - 1, len(ids) - 1)
    return reconstruction_from_logits(
        decoder.logits(full_source, ids)[span],
        decoder.logits(compacted_source, ids)[span],
        answer_ids,
    )


def reconstruction_from_logits(
    full_logits: torch.Tensor, compacted_logits: torch.Tensor, answer_ids: list[int]
) -> Reconstruction:
    """The metrics from the logits that predict each answer token (``[len(answer_ids), V]``)
    under each source, for a runner with a decoder of its own."""
    targets = torch.tensor(answer_ids)
    logp_full, nll_full = _scores(full_logits, targets)
    logp_comp, nll_comp = _scores(compacted_logits, targets)
    kl = (logp_full.exp() * (logp_full - logp_comp)).sum(-1)
    return Reconstruction(
        float(nll_full.mean()),
        float(nll_comp.mean()),
        float(kl.mean()),
        len(answer_ids),
    )
