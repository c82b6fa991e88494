"""KV workers: the paged KV tensor pool, the model runner, the request loop and the Ray actor.

Modules, one concern each:

- ``api`` -- the request/result types other parts depend on;
- ``kv_tensor_pool`` -- block-major KV memory and whole-block copies;
- ``attention`` / ``model`` / ``model_runner`` -- paged attention, the one
  decoder (Llama, Qwen2, Mistral, the toy), and one step's tensors in and
  greedy tokens out;
- ``model_spec`` / ``model_source`` -- what a served model is, and building it
  from a checkpoint (``hf_config``, ``checkpoint``), a built-in shape
  (``shapes``) or seeded weights (``seeded``); ``rope`` -- rotary tables;
- ``scheduler`` -- continuous batching, admission, preemption by recompute;
- ``validation`` -- request checks before queuing;
- ``offload`` -- the seam where a lower tier spills and promotes blocks
  (``offload_backend``: the tier contract; ``offload_jobs``: the offload
  thread; ``offload_loads`` / ``offload_stores``: the two paths;
  ``offload_slot``: the tier a worker has attached);
- ``worker`` -- :class:`KVWorker`, the thread-safe replica and its step loop
  (``request_table``: its requests in flight; ``worker_telemetry``: its step
  log and metrics registry);
- ``actor`` -- the thin Ray wrapper (imports Ray; not imported here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from kvstore.publisher import EventEndpoints
    from kvstore.worker_api import GenerateRequest, GenerateResult, ModelInfo, WorkerLoad, WorkerShutdownError
    from kvstore.workers.kv_tensor_pool import KVTensorPool
    from kvstore.workers.offload import Offloader
    from kvstore.workers.offload_backend import NoOffload, OffloadBackend, Promotion
    from kvstore.workers.worker import KVWorker

# The names below load on first use (PEP 562): a process that needs only ``workers.config`` -- the
# router reading its config file -- does not import the model runner and torch to get it.
_EXPORTS = {
    "EventEndpoints": "kvstore.publisher",
    "GenerateRequest": "kvstore.worker_api",
    "GenerateResult": "kvstore.worker_api",
    "KVTensorPool": "kvstore.workers.kv_tensor_pool",
    "KVWorker": "kvstore.workers.worker",
    "ModelInfo": "kvstore.worker_api",
    "NoOffload": "kvstore.workers.offload_backend",
    "OffloadBackend": "kvstore.workers.offload_backend",
    "Offloader": "kvstore.workers.offload",
    "Promotion": "kvstore.workers.offload_backend",
    "WorkerLoad": "kvstore.worker_api",
    "WorkerShutdownError": "kvstore.worker_api",
}

__all__ = [  # (each loaded by __getattr__ below)
    "EventEndpoints",
    "GenerateRequest",
    "GenerateResult",
    "KVTensorPool",
    "KVWorker",
    "ModelInfo",
    "NoOffload",
    "OffloadBackend",
    "Offloader",
    "Promotion",
    "WorkerLoad",
    "WorkerShutdownError",
]


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
