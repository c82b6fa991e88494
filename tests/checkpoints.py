"""Tiny random Hugging Face checkpoints, written by transformers itself, for tests in every folder.

Registered as a pytest plugin by tests/conftest.py, so every test can ask
for a fixture by name; each is written once per session under
``tmp_path_factory``:

====================  =================================================================
``llama_checkpoint``  LlamaForCausalLM, GQA (4 heads / 2 KV heads), rope_theta 500000,
                      Llama-3-style tokenizer (BOS added), chat template in
                      tokenizer_config.json, two eos ids in generation_config.json
``llama3_checkpoint`` the same with llama3 RoPE scaling, its config.json rewritten in the
                      older ``rope_theta`` + ``rope_scaling`` spelling of real checkpoints
``qwen2_checkpoint``  Qwen2ForCausalLM: q/k/v bias, tied embeddings, weights sharded
                      (model.safetensors.index.json), ChatML template in chat_template.jinja
``mistral_checkpoint`` MistralForCausalLM with an 8-token sliding window
====================  =================================================================

Weights are drawn large enough (N(0, 1/fan_in), biases and norms perturbed)
that greedy decoding has clear margins: tests compare argmaxes token for
token. :func:`reference_model` loads one back with transformers as the oracle.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 320  # the model's; the tokenizer uses the first TOKENIZER_VOCAB ids
TOKENIZER_VOCAB = 300
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip

LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LLAMA_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CORPUS = [
    "The KV cache makes the second request faster than the first one.",
    "A paged pool holds blocks of keys and values for every layer of the model.",
    "Prefix caching lets requests that share a system prompt skip its prefill.",
    "Blocks evicted from the GPU are spilled to the CPU arena and then to disk.",
    "The router sends each request to the replica that holds most of its prefix.",
    "Hello, world! How are you today? I am fine, thank you very much.",
]


class TinyCheckpoint(NamedTuple):
    """A checkpoint directory and what a test needs to know about it."""

    path: Path
    architecture: str
    bos_token_id: int | None  # what the tokenizer's post-processor prepends (None: nothing)
    eos_token_ids: tuple[int, ...]  # generation_config.json's


def train_tokenizer(specials: tuple[str, ...], *, bos: str | None) -> Tokenizer:
    """A byte-level BPE over a small corpus; with ``bos``, a post-processor that prepends it (as Llama's does)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if bos is not None:
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    assert tokenizer.get_vocab_size() <= VOCAB
    return tokenizer


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with clear greedy margins: N(0, 1/fan_in) matrices, perturbed norms and biases.

    Embeddings are small (N(0, 0.01)) so that a tied head does not just echo the input token.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise * (0.1 if "embed" in name else 1.0 / math.sqrt(param.shape[-1])))


def write_checkpoint(
    directory: Path,
    model_class: str,
    config: dict[str, Any],
    *,
    seed: int,
    chatml: bool = False,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
) -> TinyCheckpoint:
    """Save a random ``model_class`` (a transformers class name) of ``config`` with a tokenizer and templates."""
    import transformers

    specials = CHATML_SPECIALS if chatml else LLAMA_SPECIALS
    bos = None if chatml else specials[0]
    tokenizer = train_tokenizer(specials, bos=bos)
    ids = {token: tokenizer.token_to_id(token) for token in specials}
    eos = (ids["<|endoftext|>"], ids["<|im_end|>"]) if chatml else (ids["<|end_of_text|>"], ids["<|eot_id|>"])
    hf_config = getattr(transformers, model_class.replace("ForCausalLM", "Config"))(
        **TINY, **config, bos_token_id=None if bos is None else ids[bos], eos_token_id=eos[0]
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(hf_config)
    randomize(model, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=hf_config.bos_token_id, eos_token_id=list(eos), do_sample=True, temperature=0.6, top_p=0.9
    )
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": TINY["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "bos_token": bos,
        "eos_token": specials[2] if chatml else specials[4],
        "pad_token": specials[0] if chatml else None,
    }
    if chatml:
        (directory / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    else:
        tokenizer_config["chat_template"] = LLAMA_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return TinyCheckpoint(directory, model_class, None if bos is None else ids[bos], eos)


def reference_model(checkpoint: TinyCheckpoint, dtype: torch.dtype = torch.float32) -> Any:
    """The checkpoint loaded back by transformers (eager CPU, no grad): the oracle for logits and greedy output."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint.path, dtype=dtype)
    return model.eval().requires_grad_(False)


def _old_rope_spelling(path: Path) -> None:
    """Rewrite ``rope_parameters`` (transformers 5) as ``rope_theta`` + ``rope_scaling``, as real Llama 3.1 ships."""
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    path = tmp_path_factory.mktemp("tiny-llama")
    return write_checkpoint(path, "LlamaForCausalLM", {"rope_theta": 500000.0}, seed=1)


@pytest.fixture(scope="session")
def llama3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    path = tmp_path_factory.mktemp("tiny-llama3")
    # original_max_position_embeddings 64 puts this head's frequencies in all three llama3 bands.
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    checkpoint = write_checkpoint(path, "LlamaForCausalLM", {"rope_theta": 500000.0, "rope_scaling": scaling}, seed=2)
    _old_rope_spelling(path)
    return checkpoint


@pytest.fixture(scope="session")
def qwen2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    config = {"tie_word_embeddings": True, "rope_theta": 1000000.0}
    return write_checkpoint(path, "Qwen2ForCausalLM", config, seed=3, chatml=True, max_shard_size="100KB")


@pytest.fixture(scope="session")
def mistral_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    path = tmp_path_factory.mktemp("tiny-mistral")
    return write_checkpoint(path, "MistralForCausalLM", {"sliding_window": 8}, seed=4)
