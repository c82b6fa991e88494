"""KV events: vLLM wire format (golden bytes), legacy and lenient forms, and a decoder that never crashes."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from kvstore.errors import EventDecodeError
from kvstore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    EventBatch,
    EventDecoder,
    EventEncoder,
)

BIG = 0xFEDCBA9876543210  # > 2**63: must travel as an unsigned 64-bit int


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: Any) -> BlockStored:
    fields: dict[str, Any] = {"lora_id": None, "medium": "GPU", "lora_name": None, **kw}
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=2, **fields)


def decode(payload: bytes) -> DecodedBatch:
    return EventDecoder().decode(payload)


def pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


# --------------------------------------------------------------------------- the canonical form


def test_round_trip() -> None:
    batch = EventBatch(
        123.25,
        [
            stored([BIG, 1], None, [1, 2, 3, 4], lora_name="L", extra_keys=[["L"], None], group_idx=3),
            stored([2**64 - 1], BIG, [5, 6], medium="CPU"),
            BlockRemoved(block_hashes=[BIG], medium="STORAGE", group_idx=1),
            AllBlocksCleared(),
        ],
        7,
    )
    decoded = decode(EventEncoder().encode(batch))
    assert decoded == DecodedBatch(batch, 0)


GOLDEN = bytes.fromhex(
    "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cffedcba98765432"
    "1007b1706172656e745f626c6f636b5f68617368cf8000000000000001a9746f6b656e5f69647394010203cd012caa626c6f63"
    "6b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52"
    "656d6f766564ac626c6f636b5f68617368657391cfffffffffffffffffa66d656469756da347505581a474797065b0416c6c42"
    "6c6f636b73436c656172656400"
)


def golden_batch() -> EventBatch:
    return EventBatch(
        1.5,
        [
            stored([BIG, 7], 2**63 + 1, [1, 2, 3, 300]),
            BlockRemoved(block_hashes=[2**64 - 1], medium="GPU"),
            AllBlocksCleared(),
        ],
        0,
    )


def test_golden_wire_bytes() -> None:
    assert EventEncoder().encode(golden_batch()) == GOLDEN
    assert decode(GOLDEN) == DecodedBatch(golden_batch(), 0)

    # Decoded with no schema at all: [ts, [event maps tagged "type"], dp_rank], vLLM's wire form.
    raw = msgspec.msgpack.decode(GOLDEN)
    assert isinstance(raw, list) and len(raw) == 3
    ts, events, dp_rank = raw
    assert ts == 1.5 and dp_rank == 0
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": [BIG, 7],
            "parent_block_hash": 2**63 + 1,
            "token_ids": [1, 2, 3, 300],
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        },  # optional fields holding None (extra_keys, group_idx, ...) are omitted
        {"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]
    assert next(iter(events[0])) == "type"
    # The hashes above 2**63 are msgpack uint64 (0xcf), not negative int64 (0xd3).
    assert bytes.fromhex("cffedcba9876543210") in GOLDEN and b"\xd3" not in GOLDEN


# --------------------------------------------------------------------------- lenient decoding


def test_legacy_positional_events_with_trailing_defaults_trimmed() -> None:
    payload = pack(
        [
            2.0,
            [
                ["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None],  # no medium, lora_name
                ["BlockStored", [3], 2, [5, 6], 2],  # not even lora_id
                ["BlockRemoved", [1, 2]],  # no medium
                ["BlockRemoved", [3], "CPU"],
                ["AllBlocksCleared"],
            ],
            None,
        ]
    )
    decoded = decode(payload)
    assert decoded.skipped == 0
    assert decoded.batch == EventBatch(
        2.0,
        [
            stored([1, 2], None, [1, 2, 3, 4], medium=None),
            stored([3], 2, [5, 6], medium=None),
            BlockRemoved(block_hashes=[1, 2], medium=None),
            BlockRemoved(block_hashes=[3], medium="CPU"),
            AllBlocksCleared(),
        ],
        None,
    )


def test_legacy_positional_events_with_extra_trailing_fields() -> None:
    nones = [None] * 7  # extra_keys .. session_id
    payload = pack(
        [
            2.0,
            [
                ["BlockStored", [1], None, [1, 2], 2, 5, "GPU", "L", *nones, "from-the-future", 42],
                ["BlockRemoved", [9], "CPU", 0, None, None, {"new": True}],
                ["AllBlocksCleared", "extra"],
            ],
        ]
    )
    decoded = decode(payload)
    assert decoded.skipped == 0
    assert decoded.batch.events == [
        stored([1], None, [1, 2], lora_id=5, lora_name="L"),
        BlockRemoved(block_hashes=[9], medium="CPU", group_idx=0),
        AllBlocksCleared(),
    ]
    assert decoded.batch.data_parallel_rank is None


def test_positional_event_missing_required_fields_is_skipped() -> None:
    decoded = decode(pack([1.0, [["BlockStored", [1], None, [1, 2]], ["BlockRemoved"]], 0]))
    assert decoded == DecodedBatch(EventBatch(1.0, [], 0), 2)


def test_map_form_with_unknown_fields_and_missing_nullable_fields() -> None:
    payload = pack(
        [
            1.0,
            [
                {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "brand_new": [1, {"x": 2}]},
                {
                    "type": "BlockStored",
                    "block_hashes": [6],
                    "parent_block_hash": None,
                    "token_ids": [1, 2],
                    "block_size": 2,
                    "future": "ignored",
                },
            ],
            3,
        ]
    )
    decoded = decode(payload)
    assert decoded == DecodedBatch(
        EventBatch(1.0, [BlockRemoved(block_hashes=[5], medium="GPU"), stored([6], None, [1, 2], medium=None)], 3), 0
    )


def test_batch_written_as_a_map() -> None:
    payload = pack({"ts": 4.5, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1, "unknown": "x"})
    assert decode(payload) == DecodedBatch(EventBatch(4.5, [AllBlocksCleared()], 1), 0)
    assert decode(pack({"ts": 4, "events": []})) == DecodedBatch(EventBatch(4.0, [], None), 0)


def test_trailing_batch_fields_are_ignored_whatever_the_event_form() -> None:
    assert decode(pack([1.0, [], None, "new"])) == DecodedBatch(EventBatch(1.0, [], None), 0)
    legacy = pack([1.0, [["AllBlocksCleared"]], 2, "new"])  # not decodable by the strict fast path
    assert decode(legacy) == DecodedBatch(EventBatch(1.0, [AllBlocksCleared()], 2), 0)


def test_raw_digest_hashes_are_reduced_to_low_64_bits() -> None:
    digest = bytes(range(32))
    parent = b"\xff" * 16
    payload = pack(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [digest, 3],
                    "parent_block_hash": parent,
                    "token_ids": [1, 2, 3, 4],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                },
                {"type": "BlockRemoved", "block_hashes": [digest], "medium": "GPU"},
                ["BlockRemoved", [parent], "GPU"],
            ],
            None,
        ]
    )
    low = int.from_bytes(digest[-8:], "big")
    decoded = decode(payload)
    assert decoded.skipped == 0
    assert decoded.batch.events == [
        stored([low, 3], 2**64 - 1, [1, 2, 3, 4]),
        BlockRemoved(block_hashes=[low], medium="GPU"),
        BlockRemoved(block_hashes=[2**64 - 1], medium="GPU"),
    ]


def test_unknown_event_types_are_skipped_and_counted() -> None:
    payload = pack(
        [
            1.0,
            [
                {"type": "BlockMoved", "block_hashes": [1]},
                {"type": "AllBlocksCleared"},
                ["SomethingElse", 1, 2],
                {"no_type": 1},
                42,
                {"type": "BlockRemoved", "block_hashes": "not-a-list", "medium": None},
                {"type": "BlockRemoved", "block_hashes": [1], "medium": None},
            ],
            None,
        ]
    )
    assert decode(payload) == DecodedBatch(
        EventBatch(1.0, [AllBlocksCleared(), BlockRemoved(block_hashes=[1], medium=None)], None), 5
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        pack("hello"),
        pack([1.0]),
        pack(["ts", []]),
        pack([True, []]),
        pack([1.0, "events"]),
        pack([1.0, [], "rank"]),
        pack([1.0, [], False]),
        pack({"events": []}),
        pack(None),
        b"\x93\xcb\x3f",  # truncated
    ],
)
def test_non_batches_raise_event_decode_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode(payload)


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x01"  # [[[...[1]...]]]


@pytest.mark.parametrize("depth", [10, 900, 1_500, 5_000, 100_000])
def test_deeply_nested_payloads_never_escape_as_recursion_error(depth: int) -> None:
    event = pack(
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": 2,
            "lora_id": None,
            "medium": None,
            "lora_name": None,
        }
    )
    assert event[0] == 0x88
    with_extra = b"\x89" + event[1:] + pack("extra_keys") + b"\x91" + _nested(depth)
    positional = b"\x99" + pack("BlockStored") + pack([1]) + b"\xc0" + pack([]) + pack(2) + b"\xc0" * 3 + _nested(depth)
    for ev in (with_extra, positional):
        payload = b"\x93" + pack(1.0) + b"\x91" + ev + b"\xc0"
        try:
            decoded = decode(payload)
        except EventDecodeError:
            continue
        assert isinstance(decoded.batch, EventBatch)
    with pytest.raises(EventDecodeError):
        decode(_nested(depth))


def test_invalid_utf8_in_a_string_is_a_decode_error() -> None:
    payload = bytearray(pack([1.0, [{"type": "BlockStoreX", "block_hashes": [1], "medium": None}], None]))
    at = payload.index(b"BlockStoreX")
    payload[at + 3] = 0x85  # "Blo\x85kStoreX": not UTF-8
    with pytest.raises(EventDecodeError):
        decode(bytes(payload))


# --------------------------------------------------------------------------- fuzz


def _random_object(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "u64", "neg", "float", "str", "bytes", "none", "bool", "list", "map", "event", "positional"]
    kind = rng.choice(kinds if depth < 4 else kinds[:8])
    if kind == "int":
        return rng.randint(0, 300)
    if kind == "u64":
        return rng.randint(2**63, 2**64 - 1)
    if kind == "neg":
        return rng.randint(-(2**63), -1)
    if kind == "float":
        return rng.choice([0.5, -1.0, float("nan"), float("inf"), 1e300])
    if kind == "str":
        return rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU", "", "ts", "events"])
    if kind == "bytes":
        return rng.randbytes(rng.choice([0, 1, 8, 16, 32, 33]))
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [_random_object(rng, depth + 1) for _ in range(rng.randrange(5))]
    fields = [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "ts",
        "events",
        "data_parallel_rank",
        "unknown",
    ]
    if kind == "map":
        out: dict[Any, Any] = {}
        for _ in range(rng.randrange(5)):
            key = rng.choice([*fields, 7, b"k", "type"])
            out[key] = _random_object(rng, depth + 1)
        return out
    if kind == "event":
        out = {"type": rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Nope"])}
        for key in rng.sample(fields, rng.randrange(9)):
            out[key] = _random_object(rng, depth + 1)
        return out
    return [rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared"])] + [
        _random_object(rng, depth + 1) for _ in range(rng.randrange(9))
    ]


def _check_decode(decoder: EventDecoder, payload: bytes) -> str:
    try:
        decoded = decoder.decode(payload)
    except EventDecodeError:
        return "error"
    assert isinstance(decoded, DecodedBatch) and isinstance(decoded.batch, EventBatch)
    assert isinstance(decoded.batch.ts, float)
    # Every event sent is either decoded or counted as skipped, never silently lost.
    raw = msgspec.msgpack.decode(payload)
    sent = raw["events"] if isinstance(raw, dict) else raw[1]
    assert len(decoded.batch.events) + decoded.skipped == len(sent)
    for event in decoded.batch.events:
        assert isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared)
        if not isinstance(event, AllBlocksCleared):
            assert all(isinstance(h, int) for h in event.block_hashes)
    return "ok"


def test_fuzz_decoder_never_raises_anything_but_event_decode_error() -> None:
    rng = random.Random(20241122)
    decoder = EventDecoder()
    valid = EventEncoder().encode(golden_batch())
    outcomes = {"ok": 0, "error": 0}
    for i in range(10_000):
        mode = i % 4
        if mode == 0:  # random bytes
            payload = rng.randbytes(rng.randrange(64))
        elif mode == 1:  # a valid payload with a few bytes flipped, cut or extended
            buf = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            payload = bytes(buf[: rng.randrange(len(buf) + 1)] if rng.random() < 0.3 else buf)
        else:  # valid msgpack, batch-like but of the wrong shape in random places
            events = [_random_object(rng, 1) for _ in range(rng.randrange(4))]
            obj = [_random_object(rng, 2), events, _random_object(rng, 3)][: rng.choice([1, 2, 3, 3, 4])]
            if mode == 3 and rng.random() < 0.5:
                obj = {"ts": rng.choice([1.0, 2, "x"]), "events": events}
            payload = msgspec.msgpack.encode(obj if rng.random() < 0.9 else _random_object(rng))
        outcomes[_check_decode(decoder, payload)] += 1
    # Both outcomes occur: the fuzz reaches past the framing into event decoding.
    assert outcomes["ok"] > 500 and outcomes["error"] > 500


def test_signed_hashes_of_old_vllm_are_read_as_their_unsigned_64_bits() -> None:
    """vLLM 0.9's default ``builtin`` hash published Python's signed hash(): half of all blocks had a negative
    hash. Read as the same 64 bits unsigned, a BlockStored keeps all its blocks and its BlockRemoved matches."""
    payload = pack(
        [
            1.0,
            [
                ["BlockStored", [5, -3], -(2**63), [1, 2, 3, 4], 2, None],
                ["BlockRemoved", [-3]],
            ],
        ]
    )
    decoded = decode(payload)
    assert decoded.skipped == 0
    stored, removed = decoded.batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [5, 2**64 - 3] and stored.parent_block_hash == 2**63
    assert removed.block_hashes == [2**64 - 3]
    assert decode(pack([1.0, [["BlockRemoved", [True]]]])).skipped == 1  # not an int: still refused
