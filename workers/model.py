"""A small decoder-only transformer with deterministic weights, reading KV from the paged pool.

Llama-shaped: token embedding, then per layer ``x += attn(rmsnorm(x))``,
``x += mlp(rmsnorm(x))`` (SwiGLU, width 4 x hidden), a final RMSNorm and an
untied LM head. Attention uses rotary positions and grouped-query heads,
and reads and writes K/V only through the pool (:mod:`kvstore.workers.attention`).

It exists so that cached, spilled and promoted KV can be proven correct:
the weights are drawn from a ``torch.Generator`` seeded with
``worker.seed``, on the CPU in a fixed order, so every process (and every
device) with the same shape and seed holds the same model, and greedy
output with any mix of cache hits must equal output with none.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvstore.workers.attention import AttentionMetadata, paged_attention
from kvstore.workers.config import WorkerConfig
from kvstore.workers.kv_tensor_pool import KVTensorPool

MLP_RATIO = 4
_ROPE_THETA = 10_000.0
_NORM_EPS = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + _NORM_EPS)
        return (normed * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embeddings, with cos/sin tables for every position below ``max_positions``."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (_ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` is ``[T, heads, head_dim]``; ``positions`` is ``[T]``."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.attn_norm = RMSNorm(config.hidden_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(config.hidden_size)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * MLP_RATIO * config.hidden_size, bias=False)
        self.down_proj = nn.Linear(MLP_RATIO * config.hidden_size, config.hidden_size, bias=False)
        self._split = (q_size, kv_size, kv_size)

    def forward(
        self, x: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(self.attn_norm(x)).split(self._split, dim=-1)
        q = rotary(q.view(tokens, self.num_heads, self.head_dim), meta.positions)
        k = rotary(k.view(tokens, self.num_kv_heads, self.head_dim), meta.positions)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        attended = paged_attention(q, k, v, kv_layer, meta)
        x = x + self.o_proj(attended.reshape(tokens, -1))
        gate, up = self.gate_up_proj(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class DecoderModel(nn.Module):
    """The model. :meth:`forward` computes one step's tokens and returns each slice's next-token logits."""

    def __init__(self, config: WorkerConfig, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_context)
        _init_weights(self, config.seed)
        self.to(device=device, dtype=dtype)
        self.rotary.to(device=device, dtype=torch.float32)
        self.requires_grad_(False)
        self.eval()

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_pool: KVTensorPool) -> torch.Tensor:
        """``token_ids`` is the step's flattened ``[T]`` tokens; returns float32 ``[S, vocab]`` logits."""
        x = self.embed(token_ids)
        for index, layer in enumerate(self.layers):
            x = layer(x, kv_pool.layer(index), meta, self.rotary)
        last = self.norm(x[meta.sample_rows])
        return self.lm_head(last).float()


def _init_weights(model: nn.Module, seed: int) -> None:
    """Seeded, device-independent init: N(0, 1/fan_in) for matrices, N(0, 1) for embeddings, 1 for norms."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = 1.0 if param.dim() == 2 and name.startswith("embed") else 1.0 / math.sqrt(param.shape[-1])
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * std)
