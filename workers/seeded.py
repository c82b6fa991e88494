"""Seeded random weights: the toy model's, and a real architecture's when no checkpoint is wanted.

The weights are drawn from a ``torch.Generator`` seeded with ``seed``, on
the CPU, parameter by parameter in sorted-name order, so every process
(and every device) with the same spec and seed holds the same model, and
greedy output with any mix of cache hits must equal output with none.
"""

from __future__ import annotations

import math

import torch

from kvstore.workers.model import DecoderModel
from kvstore.workers.model_spec import ModelSpec


def seeded_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """float32 CPU weights: N(0, 1/fan_in) for matrices, N(0, 1) for embeddings, 1 for norms, 0 for biases."""
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in DecoderModel(spec).named_parameters()}
    generator = torch.Generator(device="cpu").manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            weights[name] = torch.zeros(shape)
        else:
            std = 1.0 if name.startswith("embed") else 1.0 / math.sqrt(shape[-1])
            weights[name] = torch.randn(shape, generator=generator, dtype=torch.float32) * std
    return weights
