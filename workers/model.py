"""The decoder: one implementation of the Llama architecture family, reading KV from the paged pool.

Per layer ``x += attn(rmsnorm(x))``, ``x += mlp(rmsnorm(x))`` (SwiGLU), a
final RMSNorm and the LM head; rotary positions, grouped-query heads, and
optional q/k/v, output and MLP biases, tied embeddings and sliding windows
(:class:`~kvstore.workers.model_spec.ModelSpec`). That covers Hugging Face's
Llama, Qwen2 and Mistral checkpoints and the built-in toy model alike; the
weights come from :mod:`kvstore.workers.weights`. Attention reads and writes
K/V only through the pool (:mod:`kvstore.workers.attention`).

The q/k/v projections are one fused matrix (``qkv_proj``) and gate/up are
another (``gate_up_proj``): one matmul instead of three (two) per layer;
:mod:`kvstore.workers.checkpoint` concatenates the checkpoint's matrices.

The arithmetic follows transformers' (RMSNorm in float32, the weight
applied in the activations' dtype; :mod:`kvstore.workers.rope`) so that an
fp32 checkpoint's logits match its reference implementation to 1e-4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstore.workers.attention import AttentionMetadata, paged_attention, with_window
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.model_spec import ModelSpec
from kvstore.workers.rope import RotaryEmbedding, Rotation, rotate


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        self.attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.qkv_proj = nn.Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        self.mlp_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self._split = (q_size, kv_size, kv_size)

    def forward(
        self, x: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, rotation: Rotation
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(self.attn_norm(x)).split(self._split, dim=-1)
        q = rotate(q.reshape(tokens, self.num_heads, self.head_dim), rotation)
        k = rotate(k.reshape(tokens, self.num_kv_heads, self.head_dim), rotation)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        attended = paged_attention(q, k, v, kv_layer, meta)
        x = x + self.o_proj(attended.reshape(tokens, -1))
        gate, up = self.gate_up_proj(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class DecoderModel(nn.Module):
    """The model. :meth:`forward` computes one step's tokens and returns each slice's next-token logits.

    Built on the ``meta`` device (no memory) by :func:`build_model`, then
    given its weights; never trained (no gradients, eval mode).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_pool: KVTensorPool) -> torch.Tensor:
        """``token_ids`` is the step's flattened ``[T]`` tokens; returns float32 ``[S, vocab]`` logits."""
        return self.logits(self.hidden(token_ids, meta, kv_pool)[meta.sample_rows])

    def hidden(self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_pool: KVTensorPool) -> torch.Tensor:
        """The last layer's ``[T, hidden]`` output for every row of the step (storing the step's KV)."""
        assert self.rotary is not None, "the model has no weights yet (see build_model)"
        windows = {w: with_window(meta, w) for w in set(self.spec.sliding_windows) if w is not None}
        x = self.embed(token_ids)
        rotation = self.rotary.at(meta.positions, x.dtype)
        for index, layer in enumerate(self.layers):
            window = self.spec.window(index)
            x = layer(x, kv_pool.layer(index), meta if window is None else windows[window], rotation)
        return x

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Float32 ``[R, vocab]`` next-token logits of ``rows`` of :meth:`hidden`'s output."""
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(rows), head).float()


def build_model(
    spec: ModelSpec,
    weights: dict[str, torch.Tensor],
    *,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
) -> DecoderModel:
    """A ready model: ``weights`` (this module's parameter names, any device) become its parameters.

    Tensors already on ``device`` in ``dtype`` are used as they are (no
    copy). Raises ValueError naming missing, unexpected or misshapen weights.
    """
    with torch.device("meta"):
        model = DecoderModel(spec)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = sorted(n for n in set(expected) & set(weights) if tuple(weights[n].shape) != expected[n])
    if missing or unexpected or wrong:
        shapes = [f"{n} {tuple(weights[n].shape)} != {expected[n]}" for n in wrong]
        raise ValueError(f"weights do not fit {spec.architecture}: missing {missing}, unexpected {unexpected}, "
                         f"misshapen {shapes}")  # fmt: skip
    state = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
    model.load_state_dict(state, assign=True, strict=True)
    model.rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_positions, device)
    model.requires_grad_(False)
    return model.eval()
