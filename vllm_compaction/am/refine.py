"""Joint refinement of the compacted slots ``(C_k, beta, C_v)`` by gradient steps on the
Attention Matching objective, after the closed-form fits.

The closed-form path fixes ``C_k`` to a subset of the original keys and fits ``beta`` and
``C_v`` for those keys (paper, "Constructing beta and C_v"); joint optimisation over all three
is the objective the paper decomposes to avoid gradient descent. Starting from the closed-form
solution, a few Adam steps on the same two terms (the outputs' squared error, normalised by the
outputs' mean squared norm, plus the squared error of the log attention mass) let the kept keys
leave the original key set: a slot can then stand for several dropped keys at once, which a
subset cannot. Slots the caller freezes (kept identifiers) keep their key and value as given.

A head that keeps hundreds of slots has as many free vectors as it has distinct queries to fit:
its steps lower the error on the fitted queries while raising it on others (a head keeping 680
of 1,500 keys fell from 0.040 to 0.020 on the fitted queries and rose from 0.037 to 0.144 on
held-out ones). With ``holdout`` a share of the queries is set aside and each head keeps the
iterate (the closed form included) that did best on them.
"""

from __future__ import annotations

import torch

__all__ = ["refine_slots"]

# steps between the held-out checks: each costs one pass over the held-out queries
_CHECK_EVERY = 25

# the held-out queries, their log masses, outputs and weights
_HeldOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


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


def _head_losses(
    queries: torch.Tensor,
    target_log_mass: torch.Tensor,
    target_output: torch.Tensor,
    weights: torch.Tensor,
    output_norm: torch.Tensor,
    keys: torch.Tensor,
    beta: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[H]`` each head's objective: relative output error plus the log mass's error."""
    w = weights / weights.sum(-1, keepdim=True)
    log_mass, output = _objective_terms(queries, keys, beta, values, valid, scale)
    output_error = (w * (output - target_output).pow(2).sum(-1)).sum(-1)
    mass_error = (w * (log_mass - target_log_mass).pow(2)).sum(-1)
    return output_error / output_norm + mass_error


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
    holdout: float = 0.0,
    key_radius: float | None = None,
    freeze_beta: bool = False,
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
    holdout : share of the queries (``0 <= holdout < 0.5``, a seeded draw) kept out of the
        steps; every 25 steps and after the last, each head keeps its iterate if it
        lowers the objective on them, so no head ends worse on them than the closed form.
        0 fits on every query and returns the last iterate.
    freeze_beta : ``True`` keeps the frozen slots' ``beta`` as given too, so a kept
        identifier weighs what the closed form gave it.
    key_radius : how far a key may move, as a share of its own norm: after every step each
        key is pulled back into that ball around where it started. ``None`` lets keys go
        anywhere; ``0`` keeps every key as given (only ``beta`` and the values move), so each
        slot stays the token it was selected as, at its own position.

    Returns
    -------
    The refined ``(keys, beta, values)``, detached, the same shapes.
    """
    if not 0.0 <= holdout < 0.5:
        raise ValueError(f"holdout must be in [0, 0.5), got {holdout!r}")
    if key_radius is not None and not key_radius >= 0:  # also refuses NaN
        raise ValueError(
            f"key_radius must be >= 0 (None: no limit), got {key_radius!r}"
        )
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
        move_keys = key_radius is None or key_radius > 0
        k = keys.clone().requires_grad_(move_keys)
        b, v = (x.clone().requires_grad_(True) for x in (beta, values))
        # each key's reach, [H, t, 1], where a bounded radius lets it move; the start stays in
        # `keys`
        reach = key_radius * keys.norm(dim=-1, keepdim=True) if key_radius else None
        generator = torch.Generator(device=queries.device).manual_seed(seed)
        n = queries.shape[1]
        n_check = int(holdout * n)
        check: _HeldOut | None = None
        if n_check:
            split = torch.randperm(n, generator=generator, device=queries.device)
            held = split[:n_check]
            check = (
                queries[:, held],
                target_log_mass[:, held],
                target_output[:, held],
                weights[:, held],
            )
            queries, target_log_mass, target_output, weights = (
                x[:, split[n_check:]]
                for x in (queries, target_log_mass, target_output, weights)
            )
            n -= n_check
        # the outputs' scale differs by head and layer: each head's error is relative to its own
        output_norm = (weights * target_output.pow(2).sum(-1)).sum(-1) / weights.sum(-1)
        output_norm = output_norm.clamp_min(1e-12)
        # each head's best iterate on the held-out queries
        best: list[torch.Tensor] = []
        if check is not None:
            with torch.no_grad():
                best_loss = _head_losses(
                    *check, output_norm, keys, beta, values, valid, scale
                )
            best = [keys.clone(), beta.clone(), values.clone()]
        optimizer = torch.optim.Adam([k, b, v] if move_keys else [b, v], lr=lr)
        rows: torch.Tensor | slice = slice(None)
        for step in range(steps):
            if batch is not None and batch < n:
                draw = torch.randperm(n, generator=generator, device=queries.device)
                rows = draw[:batch]
            loss = _head_losses(
                queries[:, rows],
                target_log_mass[:, rows],
                target_output[:, rows],
                weights[:, rows],
                output_norm,
                k,
                b,
                v,
                valid,
                scale,
            ).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # padding and frozen slots keep what they were given
            if move_keys:
                k.grad.mul_(movable[..., None])  # type: ignore[union-attr]
            v.grad.mul_(movable[..., None])  # type: ignore[union-attr]
            b.grad.mul_(movable if freeze_beta else valid)  # type: ignore[union-attr]
            optimizer.step()
            with torch.no_grad():
                b.copy_(torch.maximum(torch.minimum(b, upper_t), lower_t))
                if reach is not None:
                    shift = k - keys
                    length = shift.norm(dim=-1, keepdim=True)
                    over = length > reach
                    k.copy_(torch.where(over, keys + shift * (reach / length), k))
                if check is not None and (
                    (step + 1) % _CHECK_EVERY == 0 or step + 1 == steps
                ):
                    held_out = _head_losses(*check, output_norm, k, b, v, valid, scale)
                    better = held_out < best_loss
                    best_loss = torch.where(better, held_out, best_loss)
                    for kept, now in zip(best, (k, b, v)):
                        kept.copy_(
                            torch.where(
                                better.view(-1, *[1] * (now.dim() - 1)), now, kept
                            )
                        )
        if check is not None:
            return best[0], best[1], best[2]
    return k.detach(), b.detach(), v.detach()
