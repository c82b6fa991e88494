"""Which torch device and dtype a worker uses, from its configuration and its model.

The dtype rule (``worker.dtype``):

- ``auto``: the checkpoint's own dtype (``config.json``), float32 for the
  seeded models; except that an **fp16 checkpoint on a CPU runs in
  float32**: every fp16 value is exact in float32, and CPUs have no fast
  fp16 matmul (bfloat16 would round the weights).
- an explicit dtype is used as given on a GPU; on a CPU only ``float32``
  and ``bfloat16`` are accepted (fp16 is a ConfigError for the reason above).

The GPU path is only the device itself: the model, the pool and the
checkpoint reader take ``device`` and do the rest the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, cast

from kvstore.errors import ConfigError
from kvstore.kv_layout import DTYPE_BYTES, KVDtype, torch_dtype_of

if TYPE_CHECKING:
    import torch

DeviceChoice = Literal["auto", "cpu", "cuda"]
DtypeChoice = Literal["auto", "float32", "float16", "bfloat16"]


def resolve_device(choice: DeviceChoice) -> torch.device:
    """``auto`` is CUDA when this process sees a GPU, else CPU; ``cuda`` without one is a ConfigError."""
    import torch  # in the functions: the choices above are read by processes without torch (the router)

    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if choice == "cuda":
        raise ConfigError("worker.device is 'cuda' but this process sees no CUDA device; use 'auto' or 'cpu'")
    return torch.device("cpu")


def resolve_model_dtype(choice: DtypeChoice, native: KVDtype, device: torch.device) -> KVDtype:
    """The dtype a model whose weights are ``native`` runs in on ``device`` (see the module docstring)."""
    on_cpu = device.type == "cpu"
    if choice == "auto":
        return "float32" if on_cpu and native == "float16" else native
    if on_cpu and choice == "float16":
        raise ConfigError("worker.dtype 'float16' is not supported on the CPU; use 'float32' or 'bfloat16' (or 'auto')")
    return choice


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a :data:`~kvstore.kv_layout.KVDtype` name; ConfigError for any other name."""
    if name not in DTYPE_BYTES:
        raise ConfigError(f"worker.dtype {name!r} is not one of {sorted(DTYPE_BYTES)}")
    return torch_dtype_of(cast(KVDtype, name))
