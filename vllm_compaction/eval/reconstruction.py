"""The paper's reconstruction metrics: how well a compacted cache reproduces the full cache.

The answer the full cache generates greedily is scored under both caches: its mean negative
log-likelihood (log-perplexity) under each, and the mean KL divergence KL(full || compacted) of
the next-token distributions along it.

Beside them, how firmly each cache chooses that answer: the *margin* at a token is the logit
of the full cache's token minus the best other logit (a log-probability difference, in nats),
and an answer's margin is the smallest over the tokens that give the answer. The full cache's
margin tells a near-tie (an answer the full context itself almost gave otherwise) from a
confident one; the compacted cache's margin is positive exactly where greedy decoding from it
gives the full cache's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Reconstruction",
    "answer_logits",
    "answer_margin",
    "reconstruction",
    "reconstruction_from_logits",
]


@dataclass(frozen=True)
class Reconstruction:
    log_ppl_full: float
    log_ppl_compacted: float
    kl: float
    answer_tokens: int
    #: each cache's margin on the full cache's answer over its first ``margin_tokens`` tokens
    #: (None where no span was given)
    margin_full: float | None = None
    margin_compacted: float | None = None

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


def answer_logits(
    decoder, source, continuation_ids: list[int], answer_ids: list[int]
) -> torch.Tensor:
    """``[len(answer_ids), V]``: the logits that predict each answer token after
    ``continuation_ids`` from ``source``, teacher-forced (``decoder.logits``)."""
    if not answer_ids:
        raise ValueError("the answer is empty: nothing to score")
    if not continuation_ids:
        # the answer's first token would have no position to be predicted from
        raise ValueError("the continuation is empty: nothing predicts the answer")
    ids = list(continuation_ids) + list(answer_ids)
    # logits at position i predict token i + 1: the answer is predicted from len(cont) - 1 on
    return decoder.logits(source, ids)[len(continuation_ids) - 1 : len(ids) - 1]


def answer_margin(logits: torch.Tensor, answer_ids: list[int], tokens: int) -> float:
    """The smallest, over the first ``tokens`` answer tokens, of the token's logit minus the
    best other logit (``logits`` as from ``answer_logits``)."""
    if not 1 <= tokens <= len(answer_ids):
        raise ValueError(
            f"the margin's span must be 1..{len(answer_ids)} tokens, got {tokens}"
        )
    span = logits[:tokens].double()
    targets = torch.tensor(answer_ids[:tokens])[:, None]
    chosen = span.gather(1, targets).squeeze(1)
    others = span.scatter(1, targets, float("-inf")).amax(1)
    return float((chosen - others).min())


def reconstruction(
    decoder,
    full_source,
    compacted_source,
    continuation_ids: list[int],
    answer_ids: list[int],
    margin_tokens: int | None = None,
) -> Reconstruction:
    """Score ``answer_ids`` (generated from ``full_source`` after ``continuation_ids``) under both
    sources with the reference decoder (``decoder.logits``); given ``margin_tokens``, both
    margins over that many answer tokens."""
    return reconstruction_from_logits(
        answer_logits(decoder, full_source, continuation_ids, answer_ids),
        answer_logits(decoder, compacted_source, continuation_ids, answer_ids),
        answer_ids,
        margin_tokens,
    )


def reconstruction_from_logits(
    full_logits: torch.Tensor,
    compacted_logits: torch.Tensor,
    answer_ids: list[int],
    margin_tokens: int | None = None,
) -> Reconstruction:
    """The metrics from the logits that predict each answer token (``[len(answer_ids), V]``)
    under each source, for a runner with a decoder of its own."""
    targets = torch.tensor(answer_ids)
    logp_full, nll_full = _scores(full_logits, targets)
    logp_comp, nll_comp = _scores(compacted_logits, targets)
    kl = (logp_full.exp() * (logp_full - logp_comp)).sum(-1)
    margins = (
        (
            answer_margin(full_logits, answer_ids, margin_tokens),
            answer_margin(compacted_logits, answer_ids, margin_tokens),
        )
        if margin_tokens is not None
        else (None, None)
    )
    return Reconstruction(
        float(nll_full.mean()),
        float(nll_comp.mean()),
        float(kl.mean()),
        len(answer_ids),
        *margins,
    )
