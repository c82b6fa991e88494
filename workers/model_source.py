"""Which model a worker serves, and building it: a checkpoint directory, a built-in shape, or the toy.

:func:`describe_model` turns the ``worker`` config section into a
:class:`~kvstore.workers.model_spec.ServedModel` without touching the
weights (config files and a fingerprint only), so cache identities and
limits are known before a worker starts. :func:`load_model` then builds the
one decoder (:mod:`kvstore.workers.model`) with the checkpoint's weights
or seeded ones.

Names: the served name is ``worker.served_model_name``, else the checkpoint
directory's name, the shape's name, or ``kvstore-toy``. The weights' id
(the tiers' cache identity) is the architecture and checkpoint fingerprint,
or the shape/toy and its seed: the served name never enters it, so two
deployments of the same weights under different names share cached KV.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvstore.errors import ConfigError
from kvstore.kv_layout import KVDtype
from kvstore.workers import checkpoint
from kvstore.workers.device import resolve_model_dtype, torch_dtype
from kvstore.workers.hf_config import declared_dtype, generation_from_hf, spec_from_hf_config
from kvstore.workers.model import DecoderModel, build_model
from kvstore.workers.model_spec import GenerationDefaults, ModelSpec, RopeSpec, ServedModel
from kvstore.workers.seeded import seeded_weights
from kvstore.workers.shapes import shape_config

if TYPE_CHECKING:
    from kvstore.workers.config import WorkerConfig

TOY_NAME = "kvstore-toy"
_TOY_ROPE_THETA = 10_000.0
_TOY_NORM_EPS = 1e-6
_TOY_MLP_RATIO = 4


def served_name(worker: WorkerConfig) -> str:
    """The name clients use: ``served_model_name``, else the directory's or shape's name, else the toy's."""
    if worker.served_model_name:
        return worker.served_model_name
    if worker.model:
        return Path(worker.model).resolve().name
    return worker.shape or TOY_NAME


def describe_model(worker: WorkerConfig, device: torch.device) -> ServedModel:
    """The model ``worker`` names, as it would run on ``device``. ConfigError for an unusable model."""
    if worker.model:
        return _describe_checkpoint(Path(worker.model), worker, device)
    if worker.shape:
        config = shape_config(worker.shape)
        spec, generation = spec_from_hf_config(config), generation_from_hf(config, None)
        weights_id = f"shape:{worker.shape}(seed={worker.seed})"
        return _served(worker, device, spec, declared_dtype(config) or "float32", weights_id, generation)
    shape = f"hidden={worker.hidden_size},heads={worker.num_heads},vocab={worker.vocab_size}"
    toy_id = f"kvstore-tiny(seed={worker.seed},{shape})"  # the layout (in the identity too) has the rest
    return _served(worker, device, toy_spec(worker), "float32", toy_id, GenerationDefaults())


def toy_spec(worker: WorkerConfig) -> ModelSpec:
    """The toy: a Llama-shaped decoder with the config's shape, untied head, MLP width 4 x hidden."""
    return ModelSpec(
        architecture=TOY_NAME,
        vocab_size=worker.vocab_size,
        hidden_size=worker.hidden_size,
        intermediate_size=_TOY_MLP_RATIO * worker.hidden_size,
        num_layers=worker.num_layers,
        num_heads=worker.num_heads,
        num_kv_heads=worker.num_kv_heads,
        head_dim=worker.head_dim,
        rms_norm_eps=_TOY_NORM_EPS,
        rope=RopeSpec(theta=_TOY_ROPE_THETA),
        max_position_embeddings=worker.max_context,
    )


def load_model(served: ServedModel, device: torch.device) -> DecoderModel:
    """The model ``served`` describes, with its weights, on ``device`` in ``served.dtype``."""
    dtype = torch_dtype(served.dtype)
    if served.checkpoint is not None:
        weights = checkpoint.load_weights(Path(served.checkpoint), served.spec, device=device, dtype=dtype)
    else:
        assert served.seed is not None
        weights = seeded_weights(served.spec, served.seed)
    return build_model(served.spec, weights, max_positions=served.max_context, device=device, dtype=dtype)


def _describe_checkpoint(directory: Path, worker: WorkerConfig, device: torch.device) -> ServedModel:
    if not directory.is_dir():
        raise ConfigError(f"worker.model {str(directory)!r} is not a directory")
    config = checkpoint.read_json(directory, "config.json")
    assert config is not None
    spec = spec_from_hf_config(config)
    native = declared_dtype(config) or checkpoint.stored_dtype(directory)
    generation = generation_from_hf(config, checkpoint.read_json(directory, "generation_config.json", required=False))
    bad_eos = [t for t in generation.eos_token_ids if not 0 <= t < spec.vocab_size]
    if bad_eos:
        raise ConfigError(f"{directory}: eos token ids {bad_eos} are outside the vocabulary [0, {spec.vocab_size})")
    weights_id = f"{spec.architecture}@{checkpoint.fingerprint(directory, spec)}"
    return _served(worker, device, spec, native, weights_id, generation, checkpoint=str(directory.resolve()))


def _served(
    worker: WorkerConfig,
    device: torch.device,
    spec: ModelSpec,
    native: KVDtype,
    weights_id: str,
    generation: GenerationDefaults,
    *,
    checkpoint: str | None = None,
) -> ServedModel:
    """What every source shares: the served name, the dtype rule, the context cap; seeded unless ``checkpoint``."""
    return ServedModel(
        name=served_name(worker),
        weights_id=weights_id,
        spec=spec,
        dtype=resolve_model_dtype(worker.dtype, native, device),
        max_context=min(worker.max_context, spec.max_position_embeddings),
        generation=generation,
        checkpoint=checkpoint,
        seed=None if checkpoint is not None else worker.seed,
    )
