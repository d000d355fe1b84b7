"""Joint refinement of the compacted slots ``(C_k, beta, C_v)`` by gradient steps on the
Attention Matching objective, after the closed-form fits.

The closed-form path fixes ``C_k`` to a subset of the original keys and fits ``beta`` and
``C_v`` for those keys (paper, "Constructing beta and C_v"); joint optimisation over all three
is the objective the paper decomposes to avoid gradient descent. Starting from the closed-form
solution, a few Adam steps on the same two terms (the outputs' squared error, normalised by the
outputs' mean squared norm, plus the squared error of the log attention mass) let the kept keys
leave the original key set: a slot can then stand for several dropped keys at once, which a
subset cannot. Slots the caller freezes (kept identifiers) keep their key and value as given.
"""

from __future__ import annotations

import torch

__all__ = ["refine_slots"]


def _objective_terms(
    queries: torch.Tensor,
    keys: torch.Tensor,
    beta: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_mass [H, n], output [H, n, d])`` of the compacted slots under ``queries``."""
    logits = scale * queries @ keys.transpose(-1, -2) + beta[:, None, :]
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.logsumexp(logits, -1), torch.softmax(logits, -1) @ values


def refine_slots(
    queries: torch.Tensor,
    target_log_mass: torch.Tensor,
    target_output: torch.Tensor,
    keys: torch.Tensor,
    beta: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    *,
    scale: float,
    steps: int,
    lr: float,
    lower: torch.Tensor | float,
    upper: torch.Tensor | float,
    query_weights: torch.Tensor | None = None,
    frozen: torch.Tensor | None = None,
    batch: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``steps`` Adam steps on ``(keys, beta, values)`` of ``H`` heads, from the given ones.

    Parameters
    ----------
    queries : ``[H, n, d]`` fp32 reference queries.
    target_log_mass, target_output : ``[H, n]`` and ``[H, n, d]`` the original attention's log
        mass and output for those queries.
    keys, beta, values : ``[H, t, d]``, ``[H, t]``, ``[H, t, d]`` fp32 slots to start from.
    valid : ``[H, t]`` bool real slots (padding stays as given).
    lower, upper : bounds on ``beta`` (a number or ``[H, t]``), kept after every step.
    query_weights : ``[H, n]`` positive weights of the queries in both terms, or ``None``.
    frozen : ``[H, t]`` bool slots whose key and value stay as given (their ``beta`` moves
        inside its bounds), or ``None``.
    batch : queries per step, drawn afresh each step (seeded by ``seed``), or ``None`` for
        all ``n``: a step costs ``batch * t * d`` per head, and heads that keep a thousand
        slots under ten thousand queries make 50 full steps cost 3.6 times the rest of the
        default's compaction, a draw of 1,024 a fifth of it (benchmarks/README.md).

    Returns
    -------
    The refined ``(keys, beta, values)``, detached, the same shapes.
    """
    if steps <= 0 or not valid.any():
        return keys, beta, values
    # compaction runs under inference mode, whose tensors autograd cannot save: the steps run
    # outside it, on copies
    with torch.inference_mode(False), torch.enable_grad():
        queries, target_log_mass, target_output, valid = (
            x.clone() for x in (queries, target_log_mass, target_output, valid)
        )
        lower_t, upper_t = (
            torch.as_tensor(x, dtype=beta.dtype, device=beta.device).clone()
            for x in (lower, upper)
        )
        weights = (
            torch.ones_like(target_log_mass)
            if query_weights is None
            else query_weights.clone()
        )
        movable = valid if frozen is None else valid & ~frozen.clone()
        k, b, v = (x.clone().requires_grad_(True) for x in (keys, beta, values))
        n = queries.shape[1]
        # the outputs' scale differs by head and layer: each head's error is relative to its own
        output_norm = (weights * target_output.pow(2).sum(-1)).sum(-1) / weights.sum(-1)
        output_norm = output_norm.clamp_min(1e-12)
        optimizer = torch.optim.Adam([k, b, v], lr=lr)
        generator = torch.Generator(device=queries.device).manual_seed(seed)
        rows: torch.Tensor | slice = slice(None)
        for _ in range(steps):
            if batch is not None and batch < n:
                draw = torch.randperm(n, generator=generator, device=queries.device)
                rows = draw[:batch]
            w = weights[:, rows]
            w = w / w.sum(-1, keepdim=True)
            log_mass, output = _objective_terms(queries[:, rows], k, b, v, valid, scale)
            residual = (output - target_output[:, rows]).pow(2).sum(-1)
            output_error = (w * residual).sum(-1)
            mass_error = (w * (log_mass - target_log_mass[:, rows]).pow(2)).sum(-1)
            loss = (output_error / output_norm + mass_error).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # padding and frozen slots keep what they were given
            k.grad.mul_(movable[..., None])  # type: ignore[union-attr]
            v.grad.mul_(movable[..., None])  # type: ignore[union-attr]
            b.grad.mul_(valid)  # type: ignore[union-attr]
            optimizer.step()
            with torch.no_grad():
                b.copy_(torch.maximum(torch.minimum(b, upper_t), lower_t))
    return k.detach(), b.detach(), v.detach()
