"""How a per-slot logit bias ``beta`` travels through a paged KV cache.

Stock attention kernels compute ``scale * <q, k>`` and have no per-key bias. We widen the head
dimension from ``d`` to the next size the kernels support (``augmented_head_size``) and use two
of the spare coordinates of every key as a bias carrier:

* keys: ``k[d] = hi(beta)``, ``k[d + 1] = beta - hi(beta)`` where ``hi`` rounds to the cache dtype,
  so bf16 caches keep ~16 bits of beta instead of 8 (fp32 caches get ``lo == 0``);
* queries: ``q[d] = q[d + 1] = 1 / scale``, so ``scale * <q, k>`` gains exactly ``+ beta``;
* values carry a 1 in coordinate ``d`` (``VALUE_ONES_COORD``): the output there is the softmax
  mass of the keys a kernel call saw, which the varlen prefix merge needs
  (:mod:`.varlen_attention`); every other spare coordinate is zero, and outputs sliced back to
  ``d`` are unchanged.

Ordinary tokens are written with ``beta = 0`` and attend exactly as without the plugin. Padding
slots of heads shorter than the physical prefix (nonuniform budgets) get ``MASKED_BETA``: finite,
so online-softmax kernels never see ``-inf - -inf``, yet ``exp`` of it underflows to exactly 0.

This module is pure torch and shared by the CPU backend, the KV loader and the Triton kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "BIAS_COORDS",
    "MASKED_BETA",
    "VALUE_ONES_COORD",
    "augmented_head_size",
    "encode_beta",
    "decode_beta",
    "augment_query",
    "augment_kv",
]

BIAS_COORDS = 2
"""Spare head-dim coordinates used to carry beta (hi and lo part)."""

MASKED_BETA = -1.0e4
"""Bias of a padding slot: exp(MASKED_BETA + any real logit) is 0.0 in fp32 and bf16."""


VALUE_ONES_COORD = 0
"""Offset past ``d`` of the value coordinate that holds 1 for every token."""


def augmented_head_size(head_size: int, supported: Sequence[int]) -> int:
    """Smallest supported kernel head size with room for ``BIAS_COORDS`` extra coordinates."""
    need = head_size + BIAS_COORDS
    fits = sorted(s for s in supported if s >= need)
    if not fits:
        raise ValueError(
            f"No supported attention head size can hold head_size={head_size} plus "
            f"{BIAS_COORDS} bias coordinates (supported: {sorted(supported)})."
        )
    return fits[0]


def encode_beta(beta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``beta [...]`` (fp32) -> ``[..., BIAS_COORDS]`` in ``dtype`` whose fp32 sum is beta."""
    beta = beta.float()
    hi = beta.to(dtype)
    lo = (beta - hi.float()).to(dtype)
    return torch.stack([hi, lo], dim=-1)


def decode_beta(coords: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_beta`: ``[..., BIAS_COORDS]`` -> fp32 beta ``[...]``."""
    return coords.float().sum(dim=-1)


def augment_query(query: torch.Tensor, augmented: int, scale: float) -> torch.Tensor:
    """``[N, H, d]`` -> ``[N, H, augmented]`` with ``1/scale`` in the bias coordinates."""
    n, h, d = query.shape
    out = query.new_zeros((n, h, augmented))
    out[..., :d] = query
    out[..., d : d + BIAS_COORDS] = 1.0 / scale
    return out


def augment_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    augmented: int,
    beta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values ``[N, H, d]`` -> ``[N, H, augmented]``; ``beta [N, H]`` (default 0) encoded."""
    n, h, d = key.shape
    key_aug = key.new_zeros((n, h, augmented))
    key_aug[..., :d] = key
    if beta is not None:
        key_aug[..., d : d + BIAS_COORDS] = encode_beta(beta, key.dtype)
    value_aug = value.new_zeros((n, h, augmented))
    value_aug[..., :d] = value
    value_aug[..., d + VALUE_ONES_COORD] = 1
    return key_aug, value_aug
