"""Re-basing post-RoPE keys to other positions, from the HF config alone (no weights).

RoPE rotates each pair of key coordinates by ``position * inv_freq``; rotations compose, so a
key stored at position ``p`` is turned into the same key at ``p + delta`` by one more rotation of
``delta * inv_freq``. The serving path uses this to place a compacted prefix of logical length
``T`` in ``P < T`` physical slots: keys rotated by ``-(T - P)`` make a query at physical position
``P + i`` score them exactly as a query at logical position ``T + i``.
"""

from __future__ import annotations

import torch

__all__ = [
    "REBASABLE_ROPE_TYPES",
    "layer_windows",
    "rope_inv_freq",
    "rotate_keys",
]

REBASABLE_ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE variants whose frequencies do not depend on the sequence length or a scaling factor."""


def _text_config(config):
    return getattr(config, "text_config", None) or config


def layer_windows(config) -> list[int | None]:
    """Per decoder layer, its sliding window (keys a query sees, itself included) or None for a
    global layer: hybrid models (Gemma-2/3, Cohere-2, ...) name each layer's type in
    ``layer_types``; a model with a ``sliding_window`` and no types slides in every layer."""
    config = _text_config(config)
    count = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return [None] * count
    if not types:
        return [int(window)] * count
    return [int(window) if t == "sliding_attention" else None for t in types]


def _rope_parameters(config, layer_type: str | None) -> dict:
    rope = (
        getattr(config, "rope_parameters", None)
        or getattr(config, "rope_scaling", None)
        or {}
    )
    if not isinstance(rope, dict):
        rope = {}
    if any(isinstance(v, dict) for v in rope.values()):
        # per layer type (Gemma-3: a local base for sliding layers, a global one for the rest)
        if layer_type not in rope:
            raise ValueError(
                f"this model has RoPE parameters per layer type ({sorted(rope)}); name the "
                f"layer's type (got {layer_type!r})"
            )
        rope = dict(rope[layer_type])
    else:
        rope = dict(rope)
        local_theta = getattr(config, "rope_local_base_freq", None)
        if layer_type == "sliding_attention" and local_theta:
            rope["rope_theta"] = local_theta  # older Gemma-3 configs
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def rope_inv_freq(config, layer_type: str | None = None) -> tuple[torch.Tensor, int]:
    """``(inv_freq [d_rot / 2] float64, d_rot)`` of a model's rotary embedding; ``layer_type``
    (``"full_attention"`` / ``"sliding_attention"``) picks the parameters of hybrid models.

    Raises ValueError for RoPE variants a constant rotation cannot re-base (dynamic NTK, YaRN
    with attention scaling, long-rope, M-RoPE).
    """
    config = _text_config(config)
    rope = _rope_parameters(config, layer_type)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in REBASABLE_ROPE_TYPES:
        raise ValueError(
            f"RoPE type {kind!r} cannot be re-based by a constant rotation; "
            f"supported: {list(REBASABLE_ROPE_TYPES)}"
        )
    head_dim = int(
        getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads
    )
    d_rot = int(head_dim * float(getattr(config, "partial_rotary_factor", 1.0)))
    exponent = torch.arange(0, d_rot, 2, dtype=torch.float64) / d_rot
    inv_freq = 1.0 / (float(rope["rope_theta"]) ** exponent)
    if kind == "linear":
        inv_freq = inv_freq / float(rope["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, rope)
    return inv_freq, d_rot


def _llama3_frequencies(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama-3's wavelength-dependent frequency scaling (a fixed function of the config)."""
    factor, low, high = (
        float(rope["factor"]),
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
    )
    original = float(rope["original_max_position_embeddings"])
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def rotate_keys(
    keys: torch.Tensor,
    delta: int | torch.Tensor,
    config,
    layer_type: str | None = None,
) -> torch.Tensor:
    """Post-RoPE ``keys [..., d]`` moved by ``delta`` positions (neox/rotate-half layout), with
    the RoPE of ``layer_type`` on hybrid models.

    ``delta`` is an int or a tensor broadcastable to ``keys.shape[:-1]``. Angles are computed in
    float64 so large shifts add no error beyond the storage dtype's rounding.
    """
    inv_freq, d_rot = rope_inv_freq(config, layer_type)
    delta = torch.as_tensor(delta, dtype=torch.float64)
    angle = delta[..., None] * inv_freq  # [..., d_rot / 2]
    cos, sin = torch.cos(angle), torch.sin(angle)
    x = keys[..., :d_rot].double()
    half = d_rot // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    out = keys.clone()
    out[..., :d_rot] = rotated.to(keys.dtype)
    return out
