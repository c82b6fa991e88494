"""Keeps a deployment at its size: a dead worker is replaced, and the router follows it.

Two ways a worker dies, two repairs:

- its process dies (a crash, the OOM killer, ``ray.kill`` with restarts):
  Ray restarts the actor with the same arguments (``max_restarts=-1``, see
  :func:`~kvstore.deploy.launcher.start_worker`). The restarted worker has an
  empty pool and publishes on new ports, so the router must forget the old
  stream's blocks and subscribe to the new one: the supervisor sees the new
  endpoints and registers the worker again (``add_replica`` replaces it).
- it dies for good (killed without restarts, its node lost): Ray says
  ``ActorDiedError``. The supervisor starts a new worker under the same name
  on a live node -- the one holding the fewest workers -- and registers it.
- its process lives on but its step loop died (a fault outside the model
  step): ``health()`` says it is not alive, and its ``load()`` fails so the
  router's health poll keeps it out of routing. The supervisor kills the
  process for Ray to restart, and follows the restart as above.

A worker that does not answer in time (starting, restarting, busy) is left
alone until the next check. This is the model of
:mod:`kvstore.router.tier_watch`, which follows restarted tier actors.

Not thread-safe: runs on the router's asyncio loop (``create_app(tasks=...)``);
placing a worker blocks, so it runs in a thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import ray
import ray.exceptions

from kvstore.deploy.launcher import (
    Deployment,
    PlacedTier,
    PlacedWorker,
    alive_nodes,
    placed_worker,
    replica_spec,
    start_worker,
    worker_nodes,
)

logger = logging.getLogger(__name__)

_CALL_S = 5.0  # one probe of a worker
_PLACE_S = 120.0  # a new worker loading its model


class WorkerSupervisor:
    """Checks every worker of ``deployment`` once per :meth:`check`; :meth:`run` checks forever."""

    def __init__(self, deployment: Deployment, *, tiers: dict[str, PlacedTier] | None = None) -> None:
        """``tiers``: the placed tiers by node, for re-placed workers (default: the deployment's)."""
        self._deployment = deployment
        self._tiers = tiers if tiers is not None else {t.node: t for t in deployment.tiers}
        self.restarts_followed = 0
        self.replaced = 0
        self.engines_restarted = 0  # workers whose process answered with its step loop dead: killed for Ray to restart

    async def run(self, interval_s: float | None = None) -> None:
        """Check every ``interval_s`` (default ``router.health_interval_s``) until cancelled."""
        interval = interval_s or self._deployment.config.router.health_interval_s
        while True:
            try:
                await self.check()
            except Exception:
                logger.exception("worker supervision failed; retrying")
            await asyncio.sleep(interval)

    async def check(self) -> None:
        """Probe every worker at once; follow the restarted ones, re-place the dead ones (one at a time)."""
        workers = list(self._deployment.workers)
        probes = await asyncio.gather(*(self._probe(w) for w in workers), return_exceptions=True)
        for worker, probe in zip(workers, probes, strict=True):
            if isinstance(probe, ray.exceptions.ActorDiedError):
                logger.warning("worker %s died for good (%s); placing a new one", worker.name, _first_line(probe))
                await self._replace(worker)
            elif isinstance(probe, tuple) and probe != (worker.endpoint, worker.replay_endpoint):
                logger.warning("worker %s was restarted by Ray; the router follows it to %s", worker.name, probe[0])
                self._register(worker._replace(endpoint=probe[0], replay_endpoint=probe[1]))
                self.restarts_followed += 1
            # else: the same worker, or one not answering yet (restarting, starting, busy): next check

    async def _probe(self, worker: PlacedWorker) -> tuple[str, str]:
        health = await asyncio.wait_for(worker.handle.health.remote(), _CALL_S)
        if not health["alive"]:  # the process answers but its step loop died: have Ray restart it, then follow
            logger.warning("worker %s stopped serving (%s); restarting its process", worker.name, health["last_error"])
            ray.kill(worker.handle, no_restart=False)
            self.engines_restarted += 1
            return worker.endpoint, worker.replay_endpoint  # the restarted process is followed at a later check
        endpoints = await asyncio.wait_for(worker.handle.event_endpoints.remote(), _CALL_S)
        return endpoints.endpoint, endpoints.replay_endpoint

    async def _replace(self, dead: PlacedWorker) -> None:
        config = self._deployment.config
        node = self._least_loaded_node(dead)
        handle = start_worker(config, dead.name, node, self._tiers)
        try:
            placed = await asyncio.to_thread(placed_worker, dead.name, handle, _PLACE_S)
        except BaseException:  # failed, or the deployment is stopping: no half-placed worker is left behind
            ray.kill(handle, no_restart=True)  # a failure is retried at the next check, with the name free
            raise
        self._register(placed)
        self.replaced += 1

    def _least_loaded_node(self, dead: PlacedWorker) -> str:
        nodes = worker_nodes(self._deployment.config) or alive_nodes(gpu_first=False)
        load = Counter(w.node for w in self._deployment.workers if w.name != dead.name)
        return min(nodes, key=lambda node: (load[node], nodes.index(node)))

    def _register(self, worker: PlacedWorker) -> None:
        deployment = self._deployment
        deployment.workers = [worker if w.name == worker.name else w for w in deployment.workers]
        deployment.service.add_replica(replica_spec(worker, deployment.config))


def _first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
