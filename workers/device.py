"""Which torch device and dtype a worker uses, from its configuration."""

from __future__ import annotations

from typing import Literal

import torch

from kvstore.errors import ConfigError
from kvstore.kv_layout import DTYPE_BYTES

DeviceChoice = Literal["auto", "cpu", "cuda"]


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
    """The torch dtype of a :data:`~kvstore.kv_layout.KVDtype` name; ConfigError for any other name."""
    if name not in DTYPE_BYTES:
        raise ConfigError(f"worker.dtype {name!r} is not one of {sorted(DTYPE_BYTES)}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype
