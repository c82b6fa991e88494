"""How big and how complex a request body may be, checked on its raw bytes before anything decodes it.

Decoding a JSON body costs memory in proportion to the values it holds, not
to its bytes: 4 MiB of ``[{},{},...]`` decodes into 1.4 million dicts, about
96 MiB, and a decoder cannot be told to stop early. So a body is scanned
first, at the cost of a few passes of C code over its bytes: its strings are
blanked out (a string's content is never structure), then its brackets and
commas are counted, and the nesting depth is walked over the brackets alone,
which the container bound has already capped. A body over any bound is
refused before a single value is built.

The counts are upper bounds for any body that is valid JSON and exact for
most: ``values`` counts the commas plus the containers, which is at least the
number of array items and object members. A body that is not valid JSON may
be refused for its counts instead of its syntax; either way it is a 400.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from kvstore.openai.errors import ApiError

# A JSON string: a quote, then runs of ordinary characters and escapes, then a quote (unrolled, so the C engine
# never backtracks). In valid JSON a quote outside a string always opens one, so the scan finds them all.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class BodyBounds(NamedTuple):
    """What one request body may hold; see the module docstring for what is counted."""

    max_bytes: int
    max_values: int = 262_144
    max_containers: int = 10_000
    max_depth: int = 64


class BodyShape(NamedTuple):
    values: int  # array items + object members, at least (commas + containers)
    containers: int  # arrays + objects
    depth: int | None  # None: not walked, the containers were already over their bound


def body_shape(body: bytes, max_containers: int) -> BodyShape:
    """Count ``body``'s values and containers; walk its depth only when it holds at most ``max_containers``."""
    blank = _STRING.sub(b'""', body)
    containers = blank.count(b"[") + blank.count(b"{")
    values = blank.count(b",") + containers
    if containers > max_containers:
        return BodyShape(values, containers, None)
    brackets = blank.translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for byte in brackets:  # at most 2 * max_containers closers matter; an excess of them is refused below
        depth += 1 if byte in b"[{" else -1
        deepest = max(deepest, depth)
        if depth < 0:
            break  # more closers than openers: not JSON; the decoder names the error
    return BodyShape(values, containers, deepest)


def check_body(body: bytes, bounds: BodyBounds) -> None:
    """Raise ApiError (413 for bytes, 400 for structure) when ``body`` exceeds ``bounds``; decode nothing."""
    if len(body) > bounds.max_bytes:
        raise ApiError(413, f"request body larger than {bounds.max_bytes} bytes")
    shape = body_shape(body, bounds.max_containers)
    if shape.containers > bounds.max_containers:
        raise ApiError(
            400, f"request body holds {shape.containers} arrays and objects; this server reads at most "
            f"{bounds.max_containers}"
        )  # fmt: skip
    if shape.values > bounds.max_values:
        raise ApiError(
            400, f"request body holds about {shape.values} values; this server reads at most {bounds.max_values}"
        )
    if shape.depth is not None and shape.depth > bounds.max_depth:
        raise ApiError(
            400, f"request body nests {shape.depth} levels deep; this server reads at most {bounds.max_depth}"
        )
