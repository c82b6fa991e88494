"""What the router adds to an answer: the ``kvstore`` object for our workers, headers for every replica.

For our own workers the router builds the OpenAI body itself
(:mod:`kvstore.openai.responses`) and adds a ``kvstore`` object: the replica
chosen, whether the request was retried, the cached tokens the worker
reported by medium against the prefix the index predicted, and its timings
-- what a client needs to see the routing. In front of a vLLM fleet the body
is the replica's, untouched, so the same facts travel as response headers
(``x-kvstore-replica``, ``x-kvstore-retried``, ``x-kvstore-predicted-cached-blocks``,
``x-kvstore-prompt-blocks``, ``x-kvstore-route-s``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.router.index_lookup import NO_MATCH, MediumCounts
from kvstore.router.routing import RouteResult
from kvstore.worker_api import RequestStats


def medium_dict(counts: MediumCounts) -> dict[str, int]:
    """Blocks by medium, keyed by the media's wire names."""
    return {"GPU": counts.gpu, "CPU": counts.cpu, "STORAGE": counts.storage}


def batch_route(routes: Sequence[RouteResult], served: Sequence[str]) -> tuple[str, RouteResult]:
    """A batch's routing as one request's: the replicas that served (comma-separated, once each, in prompt
    order) and, under that name, each prompt's prediction for the replica that served it, summed, with the
    prompts' blocks and routing times summed. One prompt: its own name and route."""
    name = ",".join(dict.fromkeys(served))
    if len(routes) == 1:
        return name, routes[0]
    predicted = [route.matched.get(replica, NO_MATCH) for route, replica in zip(routes, served, strict=True)]
    summed = MediumCounts(*(sum(column) for column in zip(*predicted, strict=True)))
    return name, routes[0]._replace(
        matched={name: summed},
        prompt_blocks=sum(route.prompt_blocks for route in routes),
        route_s=sum(route.route_s for route in routes),
    )


def kvstore_extras(replica: str, retried: bool, routed: RouteResult, stats: RequestStats) -> dict[str, Any]:
    """The ``kvstore`` object of a body built from our worker's output."""
    return {
        "replica": replica,
        "retried": retried,
        "cached_tokens": stats.cached_tokens_by_medium,
        "predicted_cached_blocks": medium_dict(routed.matched.get(replica, NO_MATCH)),
        "prompt_blocks": routed.prompt_blocks,
        "queue_s": stats.queue_s,
        "ttft_s": stats.ttft_s,
        "total_s": stats.total_s,
        "route_s": routed.route_s,
    }


def routing_headers(replica: str, retried: bool, routed: RouteResult) -> dict[str, str]:
    """Headers naming the replica that served and what the index predicted it held."""
    predicted = routed.matched.get(replica, NO_MATCH)
    return {
        "x-kvstore-replica": replica,
        "x-kvstore-retried": "true" if retried else "false",
        "x-kvstore-predicted-cached-blocks": str(predicted.total),
        "x-kvstore-prompt-blocks": str(routed.prompt_blocks),
        "x-kvstore-route-s": f"{routed.route_s:.6f}",
    }
