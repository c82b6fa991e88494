"""How the tiers name blocks, and the small results they hand back.

A tier keys a block by its *external* hash (the 64-bit wire form that KV
events carry) and keeps the block's tokens and parent hash beside it: a
64-bit hash can collide, and a lookup that brings its own tokens is checked
against them before any KV is served (the nano-vllm collision guard).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, repeat
from typing import NamedTuple

import msgspec

from kvstore.block_pool import KVCacheBlock
from kvstore.events import Medium
from kvstore.hashing import BlockHash, ExternalBlockHash, to_external
from kvstore.tiers.errors import InvalidBlockError, TierError

_metas_ok: Callable[[Sequence[BlockMeta], type, int, bool], bool] | None
_use_meta_type: Callable[[type], bool] | None
try:  # the compiled check (tiers/_copyrows.c); without a C compiler the builtin passes below do the same
    from kvstore.tiers._copyrows import metas_ok as _metas_ok
    from kvstore.tiers._copyrows import use_meta_type as _use_meta_type
except ImportError:
    _metas_ok = _use_meta_type = None


class BlockMeta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One full block: its hash, its parent's hash (None for a first block) and its tokens."""

    block_hash: ExternalBlockHash
    parent_hash: ExternalBlockHash | None
    token_ids: tuple[int, ...]

    @classmethod
    def from_pool_block(cls, block: KVCacheBlock) -> BlockMeta:
        """The meta of a cached pool block (e.g. one handed to the pool's eviction hook)."""
        if block.external_hash is None:
            raise ValueError(f"block {block.block_id} is not cached: only cached blocks can be offloaded")
        parent = None if block.parent_hash is None else to_external(block.parent_hash)
        return cls(block.external_hash, parent, block.token_ids)

    @classmethod
    def chain(
        cls, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], block_size: int, *, start: int = 0
    ) -> list[BlockMeta]:
        """Metas of blocks ``start..len(block_hashes)-1`` of a request (hashes are full digests)."""
        metas = []
        for index in range(start, len(block_hashes)):
            parent = to_external(block_hashes[index - 1]) if index > 0 else None
            tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
            metas.append(cls(to_external(block_hashes[index]), parent, tokens))
        return metas


if _use_meta_type is not None:
    _use_meta_type(BlockMeta)  # the compiled loops read its fields from their slots, not by attribute lookup

_MAX_HASH = (1 << 64) - 1
_MAX_TOKEN = (1 << 63) - 1
_LITTLE_ENDIAN = sys.byteorder == "little"


def check_blocks(blocks: Sequence[BlockMeta], block_size: int, *, tokens: bool = True) -> None:
    """Raise InvalidBlockError unless every block is a full BlockMeta with 64-bit hashes and token ids
    in 0..2**63-1 (``tokens=False``: all but the token ids' range, which :func:`check_tokens` checks).

    Runs for every block spilled or promoted, so the common case is checked per batch: by the compiled
    ``metas_ok`` where it is built, else by a few builtin passes over all blocks. A batch that fails is
    checked block by block for the message. The token range is most of the Python check's cost (a pass
    over every token id): a promotion checks it only for the blocks its prefix did not match, since a
    block equal to a stored one was checked when it was stored.
    """
    if not blocks:
        return
    if _metas_ok is not None:
        if _metas_ok(blocks, BlockMeta, block_size, tokens):
            return
    else:
        try:
            token_lists = [meta.token_ids for meta in blocks] if set(map(type, blocks)) == {BlockMeta} else []
            if token_lists and set(map(type, token_lists)) == {tuple} and set(map(len, token_lists)) == {block_size}:
                hashes = [meta.block_hash for meta in blocks]
                hashes += [meta.parent_hash for meta in blocks if meta.parent_hash is not None]
                in_range = set(map(type, hashes)) == {int} and min(hashes) >= 0 and max(hashes) <= _MAX_HASH
                if in_range and (not tokens or _tokens_in_range(blocks)):
                    return
        except TypeError:
            pass  # a field of the wrong type: the loop below names the block
    _check_each(blocks, block_size)


def check_tokens(blocks: Sequence[BlockMeta], block_size: int) -> None:
    """The token-id range part of :func:`check_blocks`, for blocks that passed the rest of it."""
    if not blocks:
        return
    if _metas_ok is not None:
        if _metas_ok(blocks, BlockMeta, block_size, True):
            return
    else:
        try:
            if _tokens_in_range(blocks):
                return
        except TypeError:
            pass
    _check_each(blocks, block_size)


def _tokens_in_range(blocks: Sequence[BlockMeta]) -> bool:
    """Every token id in 0..2**63-1, in one C pass: packing into int64 rejects ids above the range
    (OverflowError), and no packed id has its sign bit set (the top byte of each, little-endian, is
    ASCII) -- half the cost of a min and a max over every id."""
    flat = list(chain.from_iterable(meta.token_ids for meta in blocks))
    if not _LITTLE_ENDIAN:
        return bool(min(flat) >= 0 and max(flat) <= _MAX_TOKEN)
    try:
        packed = array("q", flat)
    except OverflowError:
        return False
    return packed.tobytes()[7::8].isascii()


def _check_each(blocks: Sequence[BlockMeta], block_size: int) -> None:
    """Block by block, raising InvalidBlockError for the first fault: the authority the batch checks defer to."""
    for meta in blocks:
        if not isinstance(meta, BlockMeta):
            raise InvalidBlockError(f"expected BlockMeta, got {type(meta).__name__}")
        block_hash, parent, tokens = meta.block_hash, meta.parent_hash, meta.token_ids
        if not _is_u64(block_hash) or not (parent is None or _is_u64(parent)):
            raise InvalidBlockError(f"block hashes are unsigned 64-bit ints, got {block_hash!r} / {parent!r}")
        if not isinstance(tokens, tuple) or len(tokens) != block_size:
            count = len(tokens) if isinstance(tokens, tuple) else type(tokens).__name__
            raise InvalidBlockError(f"block {block_hash:#x} has {count} tokens, not a tuple of {block_size}")
        if not all(isinstance(token, int) and 0 <= token <= _MAX_TOKEN for token in tokens):
            raise InvalidBlockError(f"block {block_hash:#x} has a token id outside 0..2**63-1")


def _is_u64(value: object) -> bool:
    return isinstance(value, int) and 0 <= value <= _MAX_HASH


class TierHit(NamedTuple):
    """What :meth:`TierStore.lookup` found."""

    num_blocks: int  # consecutive blocks found, counting from the lookup's ``start``
    media: tuple[Medium, ...]  # the medium holding each of them: CPU or STORAGE


class SlotGrant(NamedTuple):
    """A lease on one arena slot, in a form that crosses process boundaries.

    Hand ``lease_id`` back exactly once: to ``commit`` (a write grant) or
    ``release`` (a read grant, or to abandon a write). Until then the slot is
    neither evicted nor reused, so its bytes are safe to copy.
    """

    lease_id: int
    slot: int  # row of the arena tensor
    block_hash: ExternalBlockHash
    medium: Medium  # where the block was found: CPU, or STORAGE (promoted into the slot); CPU for writes


def make_grants(
    lease_ids: Iterable[int], slots: Iterable[int], hashes: Iterable[int], medium: Medium
) -> list[SlotGrant]:
    """SlotGrants from parallel sequences, all of one ``medium``, each built in C (``tuple.__new__`` over a
    zip): ``SlotGrant(...)`` and ``SlotGrant._make`` are Python calls, a tenth of a 16 KiB block's copy each."""
    return list(map(tuple.__new__, repeat(SlotGrant), zip(lease_ids, slots, hashes, repeat(medium))))


# ---------------------------------------------------------------------------------------------- wire form
#
# What a worker sends its node's tier actor and gets back, packed: a reserve or an acquire names up to
# about a thousand blocks, and Ray's own serialization of a list of BlockMeta objects cost about 4 us a
# block each way (measured: 1,024 metas to an actor and a count back took 5.5 ms, against a 1.2 ms round
# trip), and of SlotGrants about 2 us -- more than a 192 KiB block's copy at 1,024 a call. One msgpack
# buffer per call costs about 0.35 us a block to pack and unpack (metas) and 0.1 us (grants).

_WIRE = msgspec.msgpack.Encoder()
_METAS = msgspec.msgpack.Decoder(list[BlockMeta])
_GRANTS = msgspec.msgpack.Decoder(list[SlotGrant | None])


def encode_metas(blocks: Sequence[BlockMeta]) -> bytes:
    """``blocks`` as one msgpack buffer (:func:`decode_metas` reads it); raises InvalidBlockError for a
    block that is not a BlockMeta (the buffer would not say so)."""
    if blocks and set(map(type, blocks)) != {BlockMeta}:
        bad = next(block for block in blocks if type(block) is not BlockMeta)
        raise InvalidBlockError(f"expected BlockMeta, got {type(bad).__name__}")
    try:
        return _WIRE.encode(list(blocks))
    except (TypeError, OverflowError) as exc:  # a field msgpack cannot carry (a hash past 64 bits, say)
        raise InvalidBlockError(f"block metas cannot be packed: {exc}") from None


def decode_metas(data: bytes) -> list[BlockMeta]:
    """The metas :func:`encode_metas` packed; raises InvalidBlockError for anything else. Field types are
    checked here; ranges and lengths by :func:`check_blocks`, as for metas that arrive unpacked."""
    if not isinstance(data, bytes):
        raise InvalidBlockError(f"packed block metas must be bytes, got {type(data).__name__}")
    try:
        return _METAS.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise InvalidBlockError(f"packed block metas are malformed: {exc}") from None


def encode_grants(grants: Sequence[SlotGrant | None]) -> bytes:
    """A reserve's or acquire's answer as one msgpack buffer (:func:`decode_grants` reads it)."""
    return _WIRE.encode(list(grants))


def decode_grants(data: bytes) -> list[SlotGrant | None]:
    """The grants :func:`encode_grants` packed; raises TierError if the buffer is anything else (the tier's
    answer is damaged: no slot in it can be trusted)."""
    try:
        return _GRANTS.decode(data)
    except (msgspec.DecodeError, TypeError) as exc:
        raise TierError(f"the tier's packed grants are malformed: {exc}") from None
