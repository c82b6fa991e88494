"""KV cache events in vLLM's wire format (v0.33), and their codec.

Wire form (msgpack, encoded by msgspec):

- a batch is an array ``[ts, events, data_parallel_rank]``;
- an event is a map tagged ``"type": "<ClassName>"``; optional fields (those
  declared with a default) are omitted while they hold their default;
- hashes are unsigned 64-bit ints and can exceed 2**63.

The decoder is strict where it must be and lenient where vLLM has been:

- it also accepts the older positional form of an event (an array starting
  with its type name, trailing defaults trimmed), a batch written as a map,
  and block hashes sent as raw digests (reduced to their low 64 bits);
- it ignores unknown fields;
- an event of unknown type is skipped and counted (``DecodedBatch.skipped``);
- anything that is not a batch raises :class:`EventDecodeError` -- never
  another exception -- so a subscriber can count and drop garbage.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any, NamedTuple

import msgspec

from kvstore.errors import EventDecodeError
from kvstore.hashing import to_external


class Medium(StrEnum):
    """Where a block lives: the ``medium`` field of vLLM's events. Its values are the wire strings."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


MEDIA: tuple[Medium, ...] = tuple(Medium)
"""Every medium, fastest first."""

WireHash = Annotated[int, msgspec.Meta(ge=0)]
"""A block hash on the wire: an unsigned 64-bit int. msgpack cannot carry more than 2**64 - 1,
so rejecting negatives is all the decoder must add (msgspec cannot bound ints past int64)."""


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of every KV cache event: a msgpack map tagged by its class name."""


class BlockStored(_Event):
    """A run of consecutive full blocks became cached.

    ``token_ids`` holds every token of the listed blocks in order, so a
    consumer with another hash function can re-key them (empty when the
    producer publishes hashes only: ``events.include_token_ids``);
    ``parent_block_hash`` is the hash of the block before the first listed
    one (None at the root). ``extra_keys``, as vLLM publishes it: one entry
    per block, None for a block hashed without extra keys, else the values
    its hash folded in, untagged -- the LoRA name (every block of a LoRA
    request), then the cache salt (the first block of a sequence only); None
    when no block has any. :func:`kvstore.hashing.tagged_extra_keys` turns an
    entry back into the keys the hash was computed with.
    """

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    """These blocks are no longer cached on ``medium``."""

    block_hashes: list[WireHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    """The producer dropped its whole cache (on ``medium``'s owner)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """What one publish sends: the events of one scheduler step, in order."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class DecodedBatch(NamedTuple):
    batch: EventBatch
    skipped: int  # events of an unknown type or malformed shape, dropped


_EVENT_TYPES: dict[str, type[_Event]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
# Positional (legacy) field order, oldest fields first; trailing ones may be trimmed.
_POSITIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    name: tuple(f for f in cls.__struct_fields__) for name, cls in _EVENT_TYPES.items()
}
_REQUIRED_POSITIONAL = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
# Required fields that older producers may omit: None when absent.
_NULLABLE_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("lora_id", "medium", "lora_name"),
    "BlockRemoved": ("medium",),
    "AllBlocksCleared": (),
}


_SCRATCH_BYTES = 1 << 20  # a batch of thousands of blocks; beyond, the encoder's buffer is dropped after use


class EventEncoder:
    """Encodes batches to payload bytes. Not thread-safe; one per thread."""

    __slots__ = ("_buffer", "_encoder")

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer = bytearray()

    def encode(self, batch: EventBatch) -> bytes:
        """The payload, in an allocation of exactly its size.

        msgspec's own ``encode`` leaves up to half again the payload's size
        allocated behind large outputs, which a replay buffer bounded in
        bytes would hold without counting; encoding into a reused buffer
        and copying out costs no more. The buffer is not kept after an
        unusually large batch, which it would otherwise pin for good.
        """
        self._encoder.encode_into(batch, self._buffer)
        payload = bytes(self._buffer)
        if len(payload) > _SCRATCH_BYTES:
            self._buffer = bytearray()
        return payload


def without_token_ids(events: Sequence[KVEvent]) -> list[KVEvent]:
    """``events`` with every BlockStored's ``token_ids`` emptied (copies; the originals are not changed)."""
    return [msgspec.structs.replace(e, token_ids=[]) if isinstance(e, BlockStored) else e for e in events]


class EventDecoder:
    """Decodes payload bytes to batches. Not thread-safe; one per thread."""

    __slots__ = ("_fast", "_generic")

    def __init__(self) -> None:
        self._fast = msgspec.msgpack.Decoder(EventBatch)
        self._generic = msgspec.msgpack.Decoder()

    def decode(self, payload: bytes) -> DecodedBatch:
        """Decode one payload; raises EventDecodeError for anything not a batch."""
        try:
            return DecodedBatch(self._fast.decode(payload), 0)
        except (msgspec.DecodeError, ValueError, RecursionError):
            # ValueError: invalid UTF-8 in a string; RecursionError: deep nesting (e.g. in
            # extra_keys). The generic pass below decides whether the payload is a batch.
            pass
        try:
            raw = self._generic.decode(payload)
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:
            raise EventDecodeError(f"payload is not msgpack: {exc}") from None
        return _decode_lenient(raw)


def _decode_lenient(raw: Any) -> DecodedBatch:
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2:
        raise EventDecodeError("a batch must be an array [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) >= 3 else None  # trailing fields beyond it are ignored, as the fast path does
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise EventDecodeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise EventDecodeError(f"batch events must be an array, got {type(events).__name__}")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)):
        raise EventDecodeError(f"data_parallel_rank must be an int or nil, got {type(dp_rank).__name__}")
    decoded: list[KVEvent] = []
    skipped = 0
    for item in events:
        event = _decode_event(item)
        if event is None:
            skipped += 1
        else:
            decoded.append(event)
    return DecodedBatch(EventBatch(float(ts), decoded, dp_rank), skipped)


def _decode_event(item: Any) -> KVEvent | None:
    """One event in map or positional form, or None when it cannot be used."""
    if isinstance(item, list):
        if not item or not isinstance(item[0], str) or item[0] not in _EVENT_TYPES:
            return None
        name, values = item[0], item[1:]
        if len(values) < _REQUIRED_POSITIONAL[name]:
            return None
        fields = dict(zip(_POSITIONAL_FIELDS[name], values, strict=False))
    elif isinstance(item, dict):
        tag = item.get("type")
        if not isinstance(tag, str) or tag not in _EVENT_TYPES:
            return None
        name = tag
        fields = {k: v for k, v in item.items() if k != "type"}
    else:
        return None
    # Older producers (map form, or positional with trailing defaults trimmed) may
    # lack the later-added nullable fields.
    for key in _NULLABLE_FIELDS[name]:
        fields.setdefault(key, None)
    if "block_hashes" in fields:
        fields["block_hashes"] = _normalise_hashes(fields["block_hashes"])
    if "parent_block_hash" in fields and fields["parent_block_hash"] is not None:
        fields["parent_block_hash"] = _normalise_hash(fields["parent_block_hash"])
    try:
        event: KVEvent = msgspec.convert(fields, _EVENT_TYPES[name], str_keys=True)  # type: ignore[assignment]
    except (msgspec.ValidationError, TypeError, ValueError, RecursionError):
        return None
    return event


def _normalise_hash(value: Any) -> Any:
    # Some vLLM versions published the raw digest; the wire key is its low 64 bits. vLLM 0.9 with its default
    # ``builtin`` hash published Python's signed hash(): the same 64 bits, read as unsigned.
    if isinstance(value, bytes):
        return to_external(value)
    if type(value) is int and -(1 << 63) <= value < 0:
        return value & 0xFFFF_FFFF_FFFF_FFFF
    return value


def _normalise_hashes(values: Any) -> Any:
    if isinstance(values, list):
        return [_normalise_hash(v) for v in values]
    return values
