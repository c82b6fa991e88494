"""What a lower tier must be to plug into a worker: the :class:`OffloadBackend` contract, and the answer it feeds.

A lower tier (CPU arena, disk) is an :class:`OffloadBackend`: three
*blocking* calls -- ``lookup`` (how many of these blocks do you hold, from
the first), ``store`` (copy these pool rows out) and ``load`` (copy the
blocks you hold into these pool rows). The worker makes them only on its
offload thread (:mod:`kvstore.workers.offload_jobs`), one at a time, never
on its step loop; only ``connected`` is read on the step loop.

Failure modes, and whose they are
    - An outage (the tier is down, slow to answer, went away) is the
      backend's to absorb: it answers 0 / nothing and reports
      ``connected`` False. The worker then recomputes instead of loading,
      and drops instead of storing.
    - Anything a backend *raises* is a fault, not an outage: it is logged
      in full and the job treated as having done nothing (no block filled,
      none stored).
    - ``load`` fills a *prefix* of the rows it was given and says which
      (the media of those filled); the rest stay unfilled and are freed, so
      a partial load is never read as KV.

Optional: ``idle()``. A backend whose calls return before the tier has
answered them (:class:`~kvstore.workers.tier_offload.TierOffload` on an
ordered tier: a store ends with its copy, its commit's answer still on the
way) may define it. The offload thread calls it whenever its queue runs
dry, and counts it as part of the job just run. It waits for those answers,
so that an idle offloader, and a drained worker, means every store is in
the tier for every other caller too. It must absorb its own errors, as the
other calls absorb outages.

:class:`NoOffload` is the null backend (no tier: nothing is stored or
loaded, and the worker runs no offload thread). :class:`LinkedOffload`
marks a backend whose tier link has counters the worker exports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from kvstore.events import Medium
from kvstore.kv_cache_manager import PrefixHit
from kvstore.tiers.blocks import BlockMeta
from kvstore.workers.metrics import TierLinkCounters


class Promotion(NamedTuple):
    hit: PrefixHit  # the GPU hit extended by the loaded blocks (all now cached in the pool)
    promoted_tokens: Mapping[Medium, int]  # tokens loaded, by source medium (CPU, STORAGE)


class OffloadBackend(Protocol):
    """A lower tier's blocking calls; the worker makes them only on its offload thread, one at a time.

    ``kv`` is the worker's whole KV tensor (block rows first). Outages are
    the backend's to absorb (answer 0 / nothing, and report ``connected``
    False); anything it raises is logged as a fault and the job treated as
    having done nothing.
    """

    @property
    def connected(self) -> bool:
        """Whether the tier is reachable now; read on the step loop, so it must be cheap."""
        ...

    def lookup(self, blocks: Sequence[BlockMeta]) -> int:
        """How many of ``blocks``, counting from the first, the tier holds."""
        ...

    def store(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> int:
        """Copy pool rows ``block_ids`` out as ``blocks``; returns how many the tier newly stored."""
        ...

    def load(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> tuple[Medium, ...]:
        """Fill pool rows ``block_ids`` with the longest prefix of ``blocks`` held; the media of those filled."""
        ...


@runtime_checkable
class LinkedOffload(Protocol):
    """A backend linked to a tier that can go away: the worker exports its link's metrics."""

    counters: TierLinkCounters

    @property
    def connected(self) -> bool: ...


class NoOffload:
    """No lower tier: evicted KV is dropped, nothing is loaded (the worker runs no offload thread)."""

    connected = False

    def lookup(self, blocks: Sequence[BlockMeta]) -> int:
        return 0

    def store(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> int:
        return 0

    def load(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> tuple[Medium, ...]:
        return ()
