"""The routing view of a body: the typed fast path for token-id prompts reads every body as the general path does."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.openai.errors import ApiError
from kvstore.openai.routing import RoutingView, _read_any, read_for_routing
from kvstore.openai.tokenizer import ByteTokenizer

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text())
_prompts = st.one_of(
    st.lists(st.integers(-5, 2**66), max_size=40),
    st.lists(st.one_of(st.integers(0, 100), st.booleans(), st.floats(allow_nan=False)), max_size=5),
    st.lists(st.lists(st.integers(0, 100), max_size=5), max_size=3),
    st.text(max_size=10),
    _scalars,
)
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "prompt": _prompts,
        "model": st.one_of(st.text(max_size=5), _scalars),
        "cache_salt": st.one_of(st.text(max_size=5), _scalars),
        "stream": _scalars,
        "max_tokens": _scalars,
    },
)


def outcome(read: Any, body: bytes) -> RoutingView | str:
    try:
        return read(body, "completion", ByteTokenizer())  # type: ignore[no-any-return]
    except ApiError as exc:
        return exc.message


@settings(max_examples=400, deadline=None)
@given(_bodies)
def test_the_fast_path_reads_every_completion_as_the_general_path(data: dict[str, Any]) -> None:
    body = json.dumps(data).encode()
    assert outcome(read_for_routing, body) == outcome(_read_any, body)


@pytest.mark.parametrize(
    "body",
    [b'{"prompt": [1, 2], "prompt": [3]}', b'{"prompt": [1, 2], "model": "m", "cache_salt": "", "stream": true}',
     b'{"prompt": [1.0]}', b'{"prompt": [true]}', b"[1, 2]", b"{not json", b'{"prompt": [1], "model": 5}',
     b'{"prompt": [1], "cache_salt": "%s"}' % (b"s" * 1024), b'{"prompt": [1], "cache_salt": "%s"}' % (b"s" * 1025)],
)  # fmt: skip
def test_edge_bodies_read_the_same_both_ways(body: bytes) -> None:
    assert outcome(read_for_routing, body) == outcome(_read_any, body)


def test_token_ids_are_read_as_sent() -> None:
    view = read_for_routing(b'{"prompt": [5, 0, 7], "cache_salt": "t", "stream": true, "x": {}}', "completion", None)
    assert view == RoutingView([5, 0, 7], None, "t", True)
