"""Real architectures without their weights: the ``config.json`` of a few published models.

``worker.shape = "qwen2.5-0.5b"`` serves that architecture with seeded
random weights (:mod:`kvstore.workers.seeded`), so TTFT and KV traffic can
be measured on a real model's shape with nothing downloaded. The configs
are the published ``config.json`` fields that change the computation; the
outputs are of course meaningless.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import ConfigError

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-0.5B: q/k/v bias, tied embeddings; KV block of 16 tokens = 192 KiB in bf16.
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 24,
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    },
    # meta-llama/Llama-3.2-1B: llama3 RoPE scaling, tied embeddings.
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}, "tie_word_embeddings": True,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
    # meta-llama/Llama-3.1-8B: KV block of 16 tokens = 2 MiB in bf16.
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
    # mistralai/Mistral-7B-v0.1: 4096-token sliding window.
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 32768, "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "sliding_window": 4096,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
}  # fmt: skip


def shape_config(name: str) -> dict[str, Any]:
    """The ``config.json`` of built-in shape ``name``; ConfigError listing the shapes for an unknown one."""
    if name not in SHAPES:
        raise ConfigError(f"worker.shape {name!r} is not a built-in shape; choose one of {', '.join(SHAPES)}")
    return dict(SHAPES[name])
