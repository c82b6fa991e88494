"""Hugging Face ``config.json`` and ``generation_config.json`` to a :class:`~kvstore.workers.model_spec.ModelSpec`.

Supported architectures are the Llama family that one decoder covers:
``LlamaForCausalLM`` (optional attention/MLP bias, ``llama3`` and
``linear`` RoPE scaling), ``Qwen2ForCausalLM`` (q/k/v bias, tied
embeddings, per-layer sliding windows) and ``MistralForCausalLM``
(sliding-window attention). Anything else -- another architecture, an
activation other than SiLU, a RoPE scaling we do not implement, partial
rotary -- is an :class:`UnsupportedModelError` that says what is
supported, never a silently different model.

Two spellings of RoPE are accepted because both exist: checkpoints in the
wild carry ``rope_theta`` and ``rope_scaling`` at the top level, while
transformers 5 writes one ``rope_parameters`` mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from kvstore.errors import ConfigError
from kvstore.kv_layout import DTYPE_BYTES, KVDtype
from kvstore.workers.model_spec import GenerationDefaults, ModelSpec, RopeSpec, RopeType

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_ROPE_TYPES: tuple[RopeType, ...] = ("default", "linear", "llama3")
_DTYPE_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "fp32": "float32",
                "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}  # fmt: skip


class UnsupportedModelError(ConfigError):
    """The checkpoint is valid but not something this worker can run exactly."""


def architecture_of(config: Mapping[str, Any]) -> str:
    """The one architecture ``config`` names; UnsupportedModelError for none, several or an unknown one."""
    names = config.get("architectures") or []
    if len(names) != 1:
        raise UnsupportedModelError(
            f"config.json names architectures {names!r}; expected exactly one of {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    name = str(names[0])
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {name} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return name


def spec_from_hf_config(config: Mapping[str, Any]) -> ModelSpec:
    """The decoder ``config`` (a parsed ``config.json``) describes. Raises UnsupportedModelError or ConfigError."""
    arch = architecture_of(config)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{arch} with hidden_act {act!r}: only 'silu' (SwiGLU) is supported")
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    layers = _int(config, "num_hidden_layers")
    head_dim = config.get("head_dim") or hidden // heads
    llama_bias = bool(config.get("attention_bias", False))
    rope = rope_from_hf_config(config)
    windows = _sliding_windows(arch, config, layers)
    try:
        return ModelSpec(
            architecture=arch,
            vocab_size=_int(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(config, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=_int(config, "max_position_embeddings"),
            qkv_bias=arch == "Qwen2ForCausalLM" or (arch == "LlamaForCausalLM" and llama_bias),
            o_bias=arch == "LlamaForCausalLM" and llama_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(config.get("mlp_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_windows=windows,
        )
    except ValueError as exc:
        raise ConfigError(f"config.json describes an impossible {arch}: {exc}") from None


def rope_from_hf_config(config: Mapping[str, Any]) -> RopeSpec:
    """RoPE from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (older checkpoints)."""
    params: dict[str, Any] = dict(config.get("rope_parameters") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError(f"per-layer-type RoPE parameters are not supported: {sorted(params)}")
    params.update({k: v for k, v in (config.get("rope_scaling") or {}).items() if k not in params})
    theta = params.get("rope_theta", config.get("rope_theta", 10_000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise UnsupportedModelError(f"RoPE type {kind!r} is not supported; supported: {', '.join(_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModelError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    fields: dict[str, Any] = {"theta": float(theta), "type": cast(RopeType, kind)}
    if kind != "default":
        fields["factor"] = float(params["factor"])
    if kind == "llama3":
        fields["low_freq_factor"] = float(params["low_freq_factor"])
        fields["high_freq_factor"] = float(params["high_freq_factor"])
        original = params.get("original_max_position_embeddings") or config["max_position_embeddings"]
        fields["original_max_position_embeddings"] = int(original)
    return RopeSpec(**fields)


def generation_from_hf(config: Mapping[str, Any], generation: Mapping[str, Any] | None) -> GenerationDefaults:
    """``generation_config.json`` (when present) over ``config.json``'s bos/eos ids."""
    merged = {**config, **(generation or {})}
    eos = merged.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(t) for t in (eos if isinstance(eos, list) else [eos]))
    gen = generation or {}
    return GenerationDefaults(
        eos_token_ids=eos_ids,
        bos_token_id=None if merged.get("bos_token_id") is None else int(merged["bos_token_id"]),
        do_sample=None if gen.get("do_sample") is None else bool(gen["do_sample"]),
        temperature=None if gen.get("temperature") is None else float(gen["temperature"]),
        top_p=None if gen.get("top_p") is None else float(gen["top_p"]),
        top_k=None if gen.get("top_k") is None else int(gen["top_k"]),
        min_p=None if gen.get("min_p") is None else float(gen["min_p"]),
        repetition_penalty=None if gen.get("repetition_penalty") is None else float(gen["repetition_penalty"]),
        max_new_tokens=None if gen.get("max_new_tokens") is None else max(1, int(gen["max_new_tokens"])),
    )


def declared_dtype(config: Mapping[str, Any]) -> KVDtype | None:
    """The dtype ``config.json`` declares (``dtype`` in transformers 5, ``torch_dtype`` before), if one we run."""
    raw = config.get("dtype") or config.get("torch_dtype")
    if raw is None:
        return None
    name = _DTYPE_NAMES.get(str(raw).removeprefix("torch."))
    if name is None or name not in DTYPE_BYTES:
        raise UnsupportedModelError(f"checkpoint dtype {raw!r} is not supported; supported: {sorted(DTYPE_BYTES)}")
    return cast(KVDtype, name)


# MistralConfig's sliding_window, and Qwen2Config's with use_sliding_window, when config.json leaves it out.
_DEFAULT_WINDOW = 4096


def _sliding_windows(arch: str, config: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """Per-layer windows: Mistral's applies to every layer; Qwen2's only when enabled, from ``max_window_layers``."""
    if arch == "LlamaForCausalLM":
        return ()
    # An absent key is transformers' default for the class (Mistral's and Qwen2's: 4096); only an explicit
    # null means no window (Mistral v0.2 on).
    window = config.get("sliding_window", _DEFAULT_WINDOW)
    if arch == "Qwen2ForCausalLM" and not config.get("use_sliding_window", False):
        window = None
    if window is None:
        return ()
    types = config.get("layer_types")
    if types is None:
        first_windowed = int(config.get("max_window_layers", 28)) if arch == "Qwen2ForCausalLM" else 0
        types = ["sliding_attention" if i >= first_windowed else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {types!r} are not {layers} of sliding_attention/full_attention")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _int(config: Mapping[str, Any], key: str) -> int:
    if key not in config:
        raise ConfigError(f"config.json has no {key!r}")
    return int(config[key])
