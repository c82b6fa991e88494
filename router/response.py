"""The OpenAI completion body the router answers with, from a replica's result.

OpenAI's fields (``choices``, ``usage`` with ``prompt_tokens_details.cached_tokens``)
plus a ``kvstore`` object: the replica chosen, whether the request was
retried, the cached tokens it reported by medium against the prefix the
index predicted, and its timings -- what a client needs to see the routing.
"""

from __future__ import annotations

import time
from typing import Any

from kvstore.openai.protocol import ParsedPrompt
from kvstore.openai.tokenizer import Tokenizer
from kvstore.router.backends import ReplicaResult
from kvstore.router.index_lookup import NO_MATCH, MediumCounts
from kvstore.router.routing import RouteResult


def medium_dict(counts: MediumCounts) -> dict[str, int]:
    """Blocks by medium, keyed by the media's wire names."""
    return {"GPU": counts.gpu, "CPU": counts.cpu, "STORAGE": counts.storage}


def completion_body(
    request_id: str,
    prompt: ParsedPrompt,
    replica: str,
    routed: RouteResult,
    result: ReplicaResult,
    *,
    retried: bool,
    tokenizer: Tokenizer,
    default_model: str,
) -> dict[str, Any]:
    """The response to ``prompt``, served by ``replica``; text is detokenised when the replica sent ids only."""
    output_ids = result.output_token_ids or []
    text = result.text if result.text is not None else tokenizer.decode(output_ids)
    completion_tokens = len(output_ids) if result.output_token_ids is not None else None
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": result.finish_reason}
    if result.output_token_ids is not None:
        choice["token_ids"] = output_ids
    usage: dict[str, Any] = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion_tokens if completion_tokens is not None else 0,
        "total_tokens": result.prompt_tokens + (completion_tokens or 0),
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": prompt.model or default_model,
        "choices": [choice],
        "usage": usage,
        "kvstore": {
            "replica": replica,
            "retried": retried,
            "cached_tokens": result.cached_tokens_by_medium,
            "predicted_cached_blocks": medium_dict(routed.matched.get(replica, NO_MATCH)),
            "prompt_blocks": routed.prompt_blocks,
            "queue_s": result.queue_s,
            "ttft_s": result.ttft_s,
            "total_s": result.total_s,
            "route_s": routed.route_s,
        },
    }
