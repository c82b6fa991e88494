"""Which torch device and dtype a worker uses, from its configuration."""

from __future__ import annotations

from typing import Literal

import torch

from kvstore.errors import ConfigError

DeviceChoice = Literal["auto", "cpu", "cuda"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(choice: DeviceChoice) -> torch.device:
    """``auto`` is CUDA when this process sees a GPU, else CPU; ``cuda`` without one is a ConfigError."""
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if choice == "cuda":
        raise ConfigError("worker.device is 'cuda' but this process sees no CUDA device; use 'auto' or 'cpu'")
    return torch.device("cpu")


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"worker.dtype {name!r} is not one of {sorted(_DTYPES)}") from None
