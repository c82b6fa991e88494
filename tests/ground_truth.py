"""The ground truth of cached runs, shared by tests in several folders (imported as ``tests.ground_truth``)."""

from __future__ import annotations

from kvstore.deploy.config import config_from_dict
from kvstore.worker_api import GenerateRequest
from kvstore.workers.worker import KVWorker


def reference_outputs(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of the default model on the CPU with the prefix cache off.

    Paging does not change the arithmetic, so these are what any cached or
    tiered run of the same prompts must return, whatever its block size.
    """
    plain = config_from_dict({"cache": {"block_size": 16, "enable_prefix_caching": False},
                              "pool": {"num_blocks": 64}, "worker": {"device": "cpu"},
                              "events": {"enabled": False}})  # fmt: skip
    worker = KVWorker("reference", plain)
    try:
        return [worker.generate(GenerateRequest(p, max_tokens)).output_token_ids for p in prompts]
    finally:
        worker.shutdown()
