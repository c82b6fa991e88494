"""Rotary position embeddings, computed the way transformers computes them.

Exactness against transformers is the point, so the arithmetic follows
it step for step: inverse frequencies in float32, angles as float32
products ``position * inv_freq``, cos/sin in float32, then the rotation
``x * cos + rotate_half(x) * sin`` in the activations' dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kvstore.workers.model_spec import RopeSpec


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """``[head_dim / 2]`` float32 frequencies, scaled as ``rope.type`` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotation(NamedTuple):
    """cos and sin of one step's positions, ``[T, 1, head_dim]`` in the activations' dtype."""

    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding:
    """cos/sin tables for positions ``[0, max_positions)`` on one device."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int, device: torch.device) -> None:
        inv_freq = inverse_frequencies(rope, head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        full = torch.cat((angles, angles), dim=-1)
        self.cos = full.cos().to(device)
        self.sin = full.sin().to(device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation of each position in ``positions`` (``[T]``), once per step for every layer."""
        return Rotation(self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))


def rotate(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """``x`` (``[T, heads, head_dim]``) rotated to its positions: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * rotation.cos + rotated * rotation.sin
