"""The on-disk format: slab files of fixed-size slots, one block per slot (format version 2).

``<disk_dir>/<identity digest>/<n:06d>.kvslab`` holds slots ``n * S`` to
``(n + 1) * S - 1`` (``S`` = :func:`slots_per_slab`, fixed by the slot size
alone, so a restart with another capacity maps slots to the same places).
Slot ``s`` starts at byte ``(s % S) * slot_bytes`` of its slab, and
``slot_bytes`` = header length + block bytes. Only the last slab may be
shorter than ``S`` slots. A slot is exactly what a block file was in format
version 1, header then payload; the header's reserved field now carries the
low 32 bits of the tier's write sequence, so a restart can order blocks by
when they were written. All integers little-endian. The header is padded to
a multiple of 4096 bytes so the payload starts aligned (O_DIRECT reads it
straight into an arena slot)::

    offset      size  field
    0           8     magic  b"KVSTBLK\\0"
    8           2     format version (1)
    10          2     flags (bit 0: the block has a parent)
    12          4     header length (payload offset; a multiple of 4096)
    16          4     number of tokens (= block size)
    20          4     write sequence (low 32 bits; ordering after a restart)
    24          8     block hash (external, 64-bit)
    32          8     parent hash (0 when there is none)
    40          8     payload length (the cache identity's block bytes)
    48          16    cache identity digest (first 16 bytes)
    64          8*n   token ids (int64)
    64+8n       8     checksum: xxh3_64 of bytes [0, 64+8n) followed by the payload
    ...               zero padding up to the header length (checked on read: damage anywhere is refused)
    header_len  ...   payload: the block's KV, exactly as in the worker's pool row

A slot is served only if every field matches what the reader expects (and
the checksum matches); anything else raises :class:`IntegrityError` with a
short reason, which callers count and treat as a miss. A never-written slot
(zeros from the slab's allocation) and an invalidated one (header zeroed
after a refusal) fail the magic check: free.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from kvstore.hashing import ExternalBlockHash
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.errors import TierError

MAGIC = b"KVSTBLK\0"
FORMAT_VERSION = 2
ALIGN = 4096
SLAB_SUFFIX = ".kvslab"
SLAB_TARGET_BYTES = 64 * 1024 * 1024  # a slab's size when full: few files, each a long contiguous range
TEMP_SUFFIX = ".tmp"
OLD_SUFFIXES = (".kvb", ".kvs", ".tmp")  # format 1's block files, spares and temporaries: removed at start
_FIXED = struct.Struct("<8sHHIIIQQQ16s")
_CHECKSUM = struct.Struct("<Q")
_HAS_PARENT = 1


class IntegrityError(TierError):
    """A block file that must not be served; ``reason`` is a short label for counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class FileHeader(NamedTuple):
    meta: BlockMeta
    sequence: int  # the write sequence's low 32 bits
    header_len: int
    payload_len: int
    checksum: int
    checked_prefix: bytes  # header bytes the checksum covers (fields and tokens)


def header_len(num_tokens: int) -> int:
    """Bytes before the payload for a block of ``num_tokens`` tokens."""
    used = _FIXED.size + 8 * num_tokens + _CHECKSUM.size
    return -(-used // ALIGN) * ALIGN


def slab_name(slab: int) -> str:
    return f"{slab:06d}{SLAB_SUFFIX}"


def slab_number(name: str) -> int | None:
    """The slab number a file name stands for, or None if it is not a slab's name."""
    stem = name[: -len(SLAB_SUFFIX)] if name.endswith(SLAB_SUFFIX) else ""
    return int(stem) if len(stem) == 6 and stem.isdigit() else None


def slots_per_slab(slot_bytes: int) -> int:
    """Slots of a full slab: as many as fit in :data:`SLAB_TARGET_BYTES`, at least one."""
    return max(1, SLAB_TARGET_BYTES // slot_bytes)


def encode_header(meta: BlockMeta, payload: memoryview, identity_digest: bytes, sequence: int = 0) -> bytes:
    """The padded header of ``meta``'s file, checksum over it and ``payload`` included."""
    num_tokens = len(meta.token_ids)
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        _HAS_PARENT if meta.parent_hash is not None else 0,
        header_len(num_tokens),
        num_tokens,
        sequence & 0xFFFFFFFF,
        meta.block_hash,
        meta.parent_hash or 0,
        payload.nbytes,
        identity_digest[:16],
    )
    prefix = fixed + struct.pack(f"<{num_tokens}q", *meta.token_ids)
    checksum = checksum_of(prefix, payload)
    header = prefix + _CHECKSUM.pack(checksum)
    return header + bytes(header_len(num_tokens) - len(header))


def decode_header(raw: bytes | memoryview, *, identity_digest: bytes, block_size: int, block_bytes: int) -> FileHeader:
    """Parse and check a header against the reader's identity; raises IntegrityError."""
    raw = bytes(raw[: header_len(block_size)])
    if len(raw) < _FIXED.size:
        raise IntegrityError("short_read", f"header is {len(raw)} bytes")
    magic, version, flags, hlen, num_tokens, sequence, block_hash, parent, payload_len, digest = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise IntegrityError("bad_magic", f"magic {magic!r}")
    if version != FORMAT_VERSION:
        raise IntegrityError("bad_version", f"format version {version}, expected {FORMAT_VERSION}")
    if digest != identity_digest[:16]:
        raise IntegrityError("wrong_identity", "written by a deployment with another cache identity")
    if num_tokens != block_size or hlen != header_len(block_size) or payload_len != block_bytes:
        raise IntegrityError(
            "bad_length",
            f"{num_tokens} tokens, header {hlen} B, payload {payload_len} B; "
            f"expected {block_size}, {header_len(block_size)}, {block_bytes}",
        )
    end = _FIXED.size + 8 * num_tokens
    if len(raw) < end + _CHECKSUM.size:
        raise IntegrityError("short_read", f"header is {len(raw)} bytes, needs {end + _CHECKSUM.size}")
    tokens = struct.unpack_from(f"<{num_tokens}q", raw, _FIXED.size)
    (checksum,) = _CHECKSUM.unpack_from(raw, end)
    padding = raw[end + _CHECKSUM.size :]  # not under the checksum: writers zero it, so readers check it
    if padding.count(0) != len(padding):
        raise IntegrityError("bad_padding", "non-zero bytes in the header's padding (the file is damaged)")
    meta = BlockMeta(ExternalBlockHash(block_hash), ExternalBlockHash(parent) if flags & _HAS_PARENT else None, tokens)
    return FileHeader(meta, sequence, hlen, payload_len, checksum, raw[:end])


def verify(header: FileHeader, payload: memoryview) -> None:
    """Raise IntegrityError unless ``payload`` is the one the header's checksum covers."""
    if payload.nbytes != header.payload_len:
        raise IntegrityError("short_read", f"payload is {payload.nbytes} bytes, expected {header.payload_len}")
    if checksum_of(header.checked_prefix, payload) != header.checksum:
        raise IntegrityError("bad_checksum", "header and payload do not match their checksum")


def checksum_of(prefix: bytes, payload: memoryview) -> int:
    digest = xxhash.xxh3_64(prefix)
    digest.update(payload)
    return digest.intdigest()
