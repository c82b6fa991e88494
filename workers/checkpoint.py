"""A Hugging Face model directory: its JSON files, its safetensors weights, and a fingerprint of them.

A directory holds ``config.json``, optionally ``generation_config.json``,
and the weights as ``model.safetensors`` or as shards listed by
``model.safetensors.index.json``. (Tokenizer files are read by the serving
front, not here.) Nothing is downloaded: a missing file is a ConfigError
that names the directory.

Weights are read with ``safetensors.safe_open``: the file is memory-mapped
and each tensor is materialised straight on the target device (on a GPU,
without a host copy of the whole model), converted to the serving dtype,
and renamed to :mod:`kvstore.workers.model`'s parameters, the q/k/v and
gate/up matrices concatenated.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import safe_open

from kvstore.errors import ConfigError
from kvstore.kv_layout import KVDtype
from kvstore.openai.tokenizer import read_json_object
from kvstore.workers.hf_config import UnsupportedModelError
from kvstore.workers.model_spec import ModelSpec

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_SAFETENSORS_DTYPES: dict[str, KVDtype] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Tensors some checkpoints carry that the model recomputes (RoPE frequencies).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# The fingerprint reads up to three windows of this size from each tensor.
_SAMPLE_BYTES = 4096


def read_json(directory: Path, name: str, *, required: bool = True) -> dict[str, Any] | None:
    """``directory/name`` parsed; None when absent and not ``required``; ConfigError when unreadable."""
    path = directory / name
    if not path.is_file():
        if required:
            raise ConfigError(f"{directory} is not a Hugging Face model directory: it has no {name}")
        return None
    return read_json_object(path)


def weight_files(directory: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint and the file holding it. ConfigError when there are no weights."""
    index = read_json(directory, _INDEX, required=False)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{directory / _INDEX} has no weight_map")
        files = {name: directory / str(file) for name, file in weight_map.items()}
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise ConfigError(f"{directory / _INDEX} lists shards that are missing: {absent}")
        return files
    single = directory / _SINGLE
    if not single.is_file():
        raise ConfigError(f"{directory} has no {_SINGLE} nor {_INDEX} (only safetensors weights are read)")
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def stored_dtype(directory: Path) -> KVDtype:
    """The dtype of the checkpoint's largest tensor (the weights' dtype when config.json declares none)."""
    files = weight_files(directory)
    header = _header(files[next(iter(files))])[0]
    tensors = [meta for name, meta in header.items() if name != "__metadata__"]
    largest = max(tensors, key=lambda meta: meta["data_offsets"][1] - meta["data_offsets"][0])
    if largest["dtype"] not in _SAFETENSORS_DTYPES:
        raise UnsupportedModelError(f"{directory} stores {largest['dtype']} weights; supported: F32, F16, BF16")
    return _SAFETENSORS_DTYPES[largest["dtype"]]


def fingerprint(directory: Path, spec: ModelSpec) -> str:
    """32 hex chars naming the weights: the spec, and every tensor's name, dtype, shape and sampled bytes.

    Each tensor contributes its head, middle and tail (4 KiB each; a small
    tensor -- a norm, a bias -- all of it), so the cost is a few MiB however
    large the model, and cheap at startup. Equal weights always give equal
    fingerprints; checkpoints that differ in any small tensor, or anywhere
    near the ends of a large one (a fine-tune changes every tensor), differ.
    """
    digest = hashlib.sha256(b"kvstore-weights-v1\0" + msgspec.json.encode(spec))
    for shard in sorted(set(weight_files(directory).values())):
        header, start = _header(shard)
        with shard.open("rb") as fh:
            for name in sorted(n for n in header if n != "__metadata__"):
                meta = header[name]
                begin, end = meta["data_offsets"]
                digest.update(json.dumps([name, meta["dtype"], meta["shape"]]).encode())
                for offset, length in _samples(begin, end):
                    fh.seek(start + offset)
                    digest.update(fh.read(length))
    return digest.hexdigest()[:32]


def _samples(begin: int, end: int) -> list[tuple[int, int]]:
    """The byte ranges of a tensor at ``[begin, end)`` that the fingerprint reads."""
    if end - begin <= 3 * _SAMPLE_BYTES:
        return [(begin, end - begin)]
    middle = (begin + end - _SAMPLE_BYTES) // 2
    return [(begin, _SAMPLE_BYTES), (middle, _SAMPLE_BYTES), (end - _SAMPLE_BYTES, _SAMPLE_BYTES)]


def load_weights(
    directory: Path, spec: ModelSpec, *, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors on ``device`` in ``dtype``, under :class:`DecoderModel`'s parameter names.

    Raises ConfigError when a tensor the model needs is missing, or the
    checkpoint holds tensors the model would ignore (a different model).
    """
    files = weight_files(directory)
    plan = _plan(spec)
    wanted = {source for sources in plan.values() for source in sources}
    missing = sorted(wanted - set(files))
    if missing:
        raise ConfigError(f"{directory} lacks tensors {spec.architecture} needs: {missing[:8]}")
    extra = sorted(n for n in set(files) - wanted if not n.endswith(_IGNORED_SUFFIXES) and not _tied_head(spec, n))
    if extra:
        raise UnsupportedModelError(f"{directory} has tensors a {spec.architecture} does not use: {extra[:8]}")
    with contextlib.ExitStack() as stack:
        handles = {
            path: stack.enter_context(safe_open(str(path), framework="pt", device=str(device)))
            for path in sorted({files[n] for n in wanted})
        }

        def read(name: str) -> torch.Tensor:
            tensor: torch.Tensor = handles[files[name]].get_tensor(name)
            return tensor.to(dtype=dtype)

        return {
            ours: read(parts[0]) if len(parts) == 1 else torch.cat([read(p) for p in parts])
            for ours, parts in plan.items()
        }


def _plan(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    """Each model parameter and the checkpoint tensors it is made of (concatenated along dim 0)."""
    plan: dict[str, tuple[str, ...]] = {
        "embed.weight": ("model.embed_tokens.weight",),
        "norm.weight": ("model.norm.weight",),
    }
    if not spec.tie_word_embeddings:
        plan["lm_head.weight"] = ("lm_head.weight",)
    for i in range(spec.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        plan[f"{ours}.attn_norm.weight"] = (f"{hf}.input_layernorm.weight",)
        plan[f"{ours}.mlp_norm.weight"] = (f"{hf}.post_attention_layernorm.weight",)
        linears = {
            "qkv_proj": ([f"{hf}.self_attn.{p}_proj" for p in "qkv"], spec.qkv_bias),
            "o_proj": ([f"{hf}.self_attn.o_proj"], spec.o_bias),
            "gate_up_proj": ([f"{hf}.mlp.gate_proj", f"{hf}.mlp.up_proj"], spec.mlp_bias),
            "down_proj": ([f"{hf}.mlp.down_proj"], spec.mlp_bias),
        }
        for name, (sources, bias) in linears.items():
            for kind in ("weight", "bias") if bias else ("weight",):
                plan[f"{ours}.{name}.{kind}"] = tuple(f"{source}.{kind}" for source in sources)
    return plan


def _tied_head(spec: ModelSpec, name: str) -> bool:
    """A tied model's checkpoint may still store the head (a copy of the embedding); it is not read."""
    return spec.tie_word_embeddings and name == "lm_head.weight"


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the offset where its tensor data starts."""
    with path.open("rb") as fh:
        length = int.from_bytes(fh.read(8), "little")
        header: dict[str, Any] = json.loads(fh.read(length))
    return header, 8 + length
