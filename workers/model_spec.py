"""What a served model is, without its weights: architecture, numerics, names and generation defaults.

:class:`ModelSpec` is everything the forward pass needs to know to build
the network (one decoder architecture, :mod:`kvstore.workers.model`, covers
Llama, Qwen2 and Mistral through these fields). :class:`ServedModel` adds
what the rest of the system needs: the name clients use, the name that
identifies the weights (the tiers' cache identity), the dtype the worker
computes in, the context limit and the generation defaults.

Both are cheap to build (a few small JSON files, no weights), so the
launcher can compute a worker's cache identity before any worker runs.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvstore.kv_layout import KVDtype, KVLayout

RopeType = Literal["default", "linear", "llama3"]


class RopeSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Rotary position embeddings: the base ``theta`` and an optional frequency scaling.

    ``linear`` divides every frequency by ``factor``; ``llama3`` divides the
    low frequencies by ``factor``, keeps the high ones and interpolates in
    between (``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings`` place the band edges).
    """

    theta: float
    type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The decoder's shape and numerics. Immutable; ValueError when the shape cannot be built.

    Per layer: ``x += o_proj(attention(rope(q), rope(k), v))`` over
    ``rmsnorm(x)``, then ``x += down(silu(gate(h)) * up(h))`` with
    ``h = rmsnorm(x)``; a final RMSNorm and the LM head (the embedding
    matrix when ``tie_word_embeddings``). ``sliding_windows[i]`` is layer
    ``i``'s attention window (a query sees the ``window`` latest positions,
    itself included) or None for full causal attention.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    """One entry per layer; empty means full attention everywhere."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{self.architecture}: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers")
        if any(w is not None and w < 1 for w in self.sliding_windows):
            raise ValueError(f"sliding windows must be >= 1 token, got {self.sliding_windows}")

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window, None for full causal attention."""
        return self.sliding_windows[layer] if self.sliding_windows else None


class GenerationDefaults(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A checkpoint's ``generation_config.json``: the ids that end a sequence and its default sampling.

    None means the checkpoint says nothing (the API's own default applies).
    """

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None  # caps a request's max_tokens, as vLLM applies it


class ServedModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One worker's model as the system sees it: what to build, what to call it, how to run it.

    ``name`` is the name clients list (``/v1/models``) and send; ``weights_id``
    names the weights themselves (equal ids, equal KV for equal tokens) and
    goes into the tiers' cache identity. Exactly one of ``checkpoint`` (a
    Hugging Face model directory) and ``seed`` (seeded random weights) is set.
    """

    name: str
    weights_id: str
    spec: ModelSpec
    dtype: KVDtype
    """Weights, activations and KV."""
    max_context: int
    """Longest prompt + output a request may have."""
    generation: GenerationDefaults = GenerationDefaults()
    checkpoint: str | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if (self.checkpoint is None) == (self.seed is None):
            raise ValueError("a served model has either a checkpoint directory or a weight seed, not both or neither")
        if not 1 <= self.max_context <= self.spec.max_position_embeddings:
            raise ValueError(f"max_context {self.max_context} is outside [1, {self.spec.max_position_embeddings}]")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.generation.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def kv_layout(self, block_size: int) -> KVLayout:
        """The KV block this model writes at ``block_size`` tokens per block."""
        return KVLayout(
            num_layers=self.spec.num_layers,
            num_kv_heads=self.spec.num_kv_heads,
            head_dim=self.spec.head_dim,
            block_size=block_size,
            dtype=self.dtype,
        )
