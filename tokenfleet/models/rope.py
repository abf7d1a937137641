"""Rotary position embeddings and their context-extension variants (linear, llama3, yarn).

cos/sin are computed once for every position up to the context length and indexed by
position at run time, so a token's rotation never depends on what it is batched with.
"""

from __future__ import annotations

import math

import torch

from tokenfleet.models.config import ModelConfig


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated, short ones kept, the band between smoothed.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    base: float, dim: int, scaling: dict[str, float], max_positions: int
) -> tuple[torch.Tensor, float]:
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = (
        correction_dim(scaling.get("beta_fast") or 32),
        correction_dim(scaling.get("beta_slow") or 1),
    )
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_share = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_share) + (
        1.0 / pos_freqs
    ) * extrapolation_share
    return inv_freq, float(attention_factor)


def rope_cos_sin(
    config: ModelConfig, num_positions: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [num_positions, head_dim], in the model's dtype."""
    dim, base = config.head_dim, config.rope_theta
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    inv_freq = _default_inv_freq(base, dim)
    attention_factor = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(
            base, dim, scaling, config.max_position_embeddings
        )
    positions = torch.arange(num_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention_factor).to(device=device, dtype=dtype)
    sin = (emb.sin() * attention_factor).to(device=device, dtype=dtype)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by the per-token cos/sin [tokens, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
