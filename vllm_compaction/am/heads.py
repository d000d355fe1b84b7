"""Varlen-packed compacted KV heads: the value every AM method returns.

Each of ``H`` KV heads keeps its own number of slots ``t_h``. The slots of all heads are
packed head after head (no padding), and ``cu_seqlens`` holds the int32 cumulative offsets
(``cu_seqlens[h]:cu_seqlens[h+1]`` are head ``h``'s slots), in the shape flash-attn's
``flash_attn_varlen_func`` uses for sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CompactedHeads", "cu_seqlens_from_lengths"]


def cu_seqlens_from_lengths(
    lengths: Sequence[int] | torch.Tensor, device: torch.device | str | None = None
) -> torch.Tensor:
    """Int32 cumulative offsets ``[H+1]`` (starting at 0) from per-head lengths ``[H]``, on
    ``device`` (default: the lengths' own device, the CPU for a sequence)."""
    if device is None:
        device = lengths.device if isinstance(lengths, torch.Tensor) else "cpu"
    lengths = torch.as_tensor(lengths, dtype=torch.int64, device=device).reshape(-1)
    if (lengths < 0).any():
        raise ValueError(f"per-head lengths must be >= 0, got {lengths.tolist()}")
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu.to(torch.int32)


@dataclass
class CompactedHeads:
    """Compacted keys, biases and values of ``H`` KV heads, varlen-packed.

    Attributes:
        keys: ``[N, d]`` compacted keys C_k (post-RoPE, at their original positions),
            ``N = sum_h t_h``.
        beta: ``[N]`` float32 per-slot logit bias; 0 for exact (uncompacted) slots,
            ``-inf`` never appears in a packed value.
        values: ``[N, d]`` compacted values C_v.
        indices: ``[N]`` int64 original token position of each slot (for a merged slot, the
            position of its anchor token); sorted ascending within a head.
        cu_seqlens: ``[H+1]`` int32 offsets of each head's slots.
    """

    keys: torch.Tensor
    beta: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    cu_seqlens: torch.Tensor

    def __post_init__(self) -> None:
        n = self.keys.shape[0]
        if self.keys.dim() != 2 or self.values.dim() != 2:
            raise ValueError("keys and values must be packed [N, d] tensors")
        if (
            self.values.shape[0] != n
            or self.beta.shape != (n,)
            or self.indices.shape != (n,)
        ):
            raise ValueError(
                f"packed lengths disagree: keys {tuple(self.keys.shape)}, values "
                f"{tuple(self.values.shape)}, beta {tuple(self.beta.shape)}, "
                f"indices {tuple(self.indices.shape)}"
            )
        if self.cu_seqlens.dim() != 1 or self.cu_seqlens.numel() < 1:
            raise ValueError("cu_seqlens must be a 1-D [H+1] tensor")
        if int(self.cu_seqlens[0]) != 0 or int(self.cu_seqlens[-1]) != n:
            raise ValueError(
                f"cu_seqlens must run from 0 to N={n}, got {self.cu_seqlens.tolist()}"
            )
        if (self.cu_seqlens[1:] < self.cu_seqlens[:-1]).any():
            raise ValueError("cu_seqlens must be non-decreasing")

    # ------------------------------------------------------------------ shape facts
    @property
    def num_heads(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def head_dim(self) -> int:
        return self.keys.shape[1]

    @property
    def head_budgets(self) -> torch.Tensor:
        """``[H]`` int64 number of slots t_h of each head."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int64)

    @property
    def total_slots(self) -> int:
        return self.keys.shape[0]

    def head(
        self, h: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys [t_h, d], beta [t_h], values [t_h, d], indices [t_h])`` of head ``h``."""
        if not 0 <= h < self.num_heads:
            raise IndexError(f"head {h} out of range for {self.num_heads} heads")
        a, b = int(self.cu_seqlens[h]), int(self.cu_seqlens[h + 1])
        return self.keys[a:b], self.beta[a:b], self.values[a:b], self.indices[a:b]

    def select(self, heads: Sequence[int]) -> CompactedHeads:
        """The slots of ``heads`` only, in that order (one tensor-parallel rank's KV heads)."""
        lengths = self.head_budgets
        rows = [
            torch.arange(
                int(self.cu_seqlens[h]),
                int(self.cu_seqlens[h + 1]),
                device=self.keys.device,
            )
            for h in heads
        ]
        index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        return CompactedHeads(
            keys=self.keys[index],
            beta=self.beta[index],
            values=self.values[index],
            indices=self.indices[index],
            cu_seqlens=cu_seqlens_from_lengths(
                [int(lengths[h]) for h in heads], device=self.cu_seqlens.device
            ),
        )

    # ------------------------------------------------------------------ conversions
    def to(
        self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> CompactedHeads:
        """Keys/values cast to ``dtype`` (storage dtype); beta stays float32."""
        return CompactedHeads(
            keys=self.keys.to(device=device, dtype=dtype or self.keys.dtype),
            beta=self.beta.to(device=device, dtype=torch.float32),
            values=self.values.to(device=device, dtype=dtype or self.values.dtype),
            indices=self.indices.to(device=device),
            cu_seqlens=self.cu_seqlens.to(device=device),
        )

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pad to ``[H, t_max, ...]``: keys, beta (``-inf`` on padding), values, indices (-1).

        Padding with ``beta = -inf`` gives exactly the varlen attention result; it is meant
        for reference code and small caches, not for serving.
        """
        lengths = self.head_budgets
        h, t_max, d = (
            self.num_heads,
            int(lengths.max()) if self.num_heads else 0,
            self.head_dim,
        )
        slot = torch.arange(t_max, device=lengths.device).expand(h, t_max)
        valid = slot < lengths[:, None]  # [H, t_max]
        keys = self.keys.new_zeros(h, t_max, d)
        values = self.values.new_zeros(h, t_max, d)
        beta = torch.full(
            (h, t_max), float("-inf"), dtype=torch.float32, device=self.beta.device
        )
        indices = torch.full(
            (h, t_max), -1, dtype=torch.int64, device=self.indices.device
        )
        keys[valid], values[valid] = self.keys, self.values
        beta[valid], indices[valid] = self.beta.float(), self.indices
        return keys, beta, values, indices

    @classmethod
    def from_padded(
        cls,
        keys: torch.Tensor,
        beta: torch.Tensor,
        values: torch.Tensor,
        indices: torch.Tensor,
        lengths: Sequence[int] | torch.Tensor,
    ) -> CompactedHeads:
        """Pack ``[H, t_max, ...]`` tensors whose first ``lengths[h]`` slots are valid."""
        lengths = torch.as_tensor(lengths, dtype=torch.int64, device=keys.device)
        t_max = keys.shape[1]
        valid = torch.arange(t_max, device=keys.device)[None, :] < lengths[:, None]
        return cls(
            keys=keys[valid],
            beta=beta[valid].float(),
            values=values[valid],
            indices=indices[valid].to(torch.int64),
            cu_seqlens=cu_seqlens_from_lengths(lengths),
        )

    @classmethod
    def concat_slots(cls, parts: Sequence[CompactedHeads]) -> CompactedHeads:
        """Join several packings of the same ``H`` heads: head h gets the slots of head h of
        every part, ordered by original position (used to put exact template slots around
        compacted ones)."""
        if not parts:
            raise ValueError("concat_slots needs at least one part")
        num_heads = parts[0].num_heads
        if any(p.num_heads != num_heads for p in parts):
            raise ValueError("all parts must have the same number of heads")
        device = parts[0].keys.device
        head_ids = torch.cat(
            [
                torch.repeat_interleave(
                    torch.arange(num_heads, device=device), p.head_budgets.to(device)
                )
                for p in parts
            ]
        )
        indices = torch.cat([p.indices for p in parts])
        # sort key (head, position): positions are < 2**40, so one int64 key orders both
        order = torch.argsort(head_ids * (1 << 40) + indices, stable=True)
        lengths = sum((p.head_budgets for p in parts[1:]), parts[0].head_budgets)
        return cls(
            keys=torch.cat([p.keys for p in parts])[order],
            beta=torch.cat([p.beta.float() for p in parts])[order],
            values=torch.cat([p.values for p in parts])[order],
            indices=indices[order],
            cu_seqlens=cu_seqlens_from_lengths(lengths),
        )

    @classmethod
    def exact(
        cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> CompactedHeads:
        """Every key kept with ``beta = 0``: keys/values ``[H, T, d]``, positions ``[T]``."""
        h, t, d = keys.shape
        return cls(
            keys=keys.reshape(h * t, d),
            beta=torch.zeros(h * t, dtype=torch.float32, device=keys.device),
            values=values.reshape(h * t, values.shape[-1]),
            indices=positions.to(torch.int64).expand(h, t).reshape(-1).clone(),
            cu_seqlens=cu_seqlens_from_lengths([t] * h, device=keys.device),
        )
