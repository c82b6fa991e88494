"""Chained block hashing, byte-compatible with vLLM's ``sha256_cbor``.

    H(x)          = sha256(cbor2.dumps(x, canonical=True)).digest()   (or xxh3_128)
    NONE_HASH     = H(seed)                      -- a string from config, never random
    hash(block_i) = H((parent_hash or NONE_HASH, tuple(token_ids), extra_keys))

``extra_keys`` is ``None`` or a tuple of keys tagged by their source, as vLLM
(0.33) builds them: ``("lora", lora_name, lora_path)`` on every block of a
LoRA request, then ``("cache_salt", salt)`` on block 0 only (so one tenant's
whole chain differs from another's) -- and an empty salt is no salt. The tags
keep a LoRA name and a salt spelled alike from colliding. Our requests name
a LoRA but carry no path: our keys put :data:`LORA_PATH` there.

BlockStored events carry the extra keys *untagged* (vLLM's ``extra_keys``
field: per block, the LoRA name, then the salt on block 0):
:func:`published_extra_keys` writes an entry, :func:`tagged_extra_keys`
turns one back into what the hash folded in -- how a consumer re-keys a
foreign producer's salted or LoRA blocks.

Because each hash folds in its parent, a hit on block N proves blocks 0..N-1
match: prefix lookup is a forward walk that stops at the first miss.

Inside a process a block hash is the full digest (:data:`BlockHash`). On the
wire it is the low 64 bits of the digest as an unsigned int
(:data:`ExternalBlockHash`), exactly as vLLM publishes it.

A block's CBOR is written here rather than by ``cbor2.dumps``: a block is
always the same shape -- array(3) of the parent's bytes, an array of token
ids, the extra keys -- and canonical CBOR of a non-negative int is fixed
bytes, so the encoding is the parent's header, the parent, the array's
header, each token's bytes (from a table shared by the process, filled as
ids are first seen: at most a vocabulary's worth of entries) and the extra
keys' bytes (``cbor2``, cached: a request repeats them on every block). The
bytes are identical to ``cbor2.dumps(..., canonical=True)`` (tested against
it); it halves the cost of hashing a prompt, which is on every routed
request's path. A token id that is not an int in [0, 2**64) takes cbor2's
path.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import NewType, TypedDict, Unpack

import cbor2
import xxhash

from kvstore.config import CacheConfig, HashAlgo

BlockHash = NewType("BlockHash", bytes)
"""Full digest of a block: the in-process key of the prefix cache."""

ExternalBlockHash = NewType("ExternalBlockHash", int)
"""Low 64 bits of a BlockHash, unsigned: what KV events carry."""

LORA_PATH = ""
"""The ``lora_path`` of our LoRA keys. Our requests name a LoRA (a cache namespace: we load no adapter) and
have no path; "" is the path of a vLLM ``LoRARequest`` made without one, so our hashes equal vLLM's for such
adapters. A vLLM fleet that loads adapters from paths hashes them differently: re-keying (which rebuilds
our keys from the event's LoRA name) is what matches its blocks to our requests."""

_LOW_64 = (1 << 64) - 1
_NULL = b"\xf6"  # CBOR null: a block without extra keys
_ID_BYTES = array("I").itemsize  # a token id in the memo's keys (4 bytes on every platform we build for)


def _cbor_head(major: int, length: int) -> bytes:
    """The canonical CBOR head of a ``major`` type item with argument ``length`` (< 2**64)."""
    if length < 24:
        return bytes((major << 5 | length,))
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if length < 1 << (8 * width):
            return bytes((major << 5 | info,)) + length.to_bytes(width, "big")
    raise ValueError(f"{length} does not fit a CBOR head")


class _Unencodable(Exception):
    """A token id the table does not cover: the block is encoded by cbor2 instead."""


_KEPT_TOKENS = 1 << 20  # every vocabulary's ids, with room: a client's ids beyond it are encoded, not kept


class _TokenCbor(dict[int, bytes]):
    """Canonical CBOR of each token id (an unsigned int), computed on first sight and kept when below
    ``_KEPT_TOKENS`` -- ids a client sends unchecked (a router's /route) must not grow it without bound."""

    def __missing__(self, token: int) -> bytes:
        if type(token) is not int or not 0 <= token <= _LOW_64:
            raise _Unencodable(token)
        encoded = _cbor_head(0, token)
        if token < _KEPT_TOKENS:
            self[token] = encoded
        return encoded


_TOKEN_CBOR = _TokenCbor()
_BLOCK_HEAD = b"\x83"  # array(3): parent, tokens, extra keys
_PARENT_HEADS = {n: _BLOCK_HEAD + _cbor_head(2, n) for n in (16, 32)}  # the block's head and the digest's


@functools.lru_cache(maxsize=1024)
def _extra_cbor(extra_keys: tuple[object, ...]) -> bytes:
    return cbor2.dumps(extra_keys, canonical=True)


_HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {
    "sha256_cbor": lambda data: hashlib.sha256(data).digest(),
    "xxh3_128": xxhash.xxh3_128_digest,
}


def to_external(block_hash: bytes) -> ExternalBlockHash:
    """The 64-bit wire form of a digest, as vLLM reduces it (``int.from_bytes(d, "big") & 2**64-1``).

    The one place the reduction is written: the pool keys its events with it and the event decoder
    applies it to producers that send raw digests, so both land on the same key.
    """
    return ExternalBlockHash(int.from_bytes(block_hash, "big") & _LOW_64)


class ChainKeys(TypedDict, total=False):
    """What a request's chain of block hashes depends on besides its tokens.

    ``parent`` must be the hash of block ``start_block - 1`` (None when
    starting at 0); this lets a caller extend a request's hashes as its
    tokens grow without rehashing the prefix.
    """

    lora_name: str | None
    cache_salt: str | None
    parent: BlockHash | None
    start_block: int


class BlockHasher:
    """Computes chained block hashes for one cache identity (algorithm + seed).

    Instances are immutable and cheap; every process built from the same
    CacheConfig computes identical hashes.
    """

    __slots__ = ("_digest", "_seed", "_tokens_head", "algo", "block_size", "none_hash")

    def __init__(self, algo: HashAlgo, seed: str, block_size: int) -> None:
        if algo not in _HASH_FUNCTIONS:
            raise ValueError(f"unknown hash algorithm {algo!r}; use one of {sorted(_HASH_FUNCTIONS)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.algo = algo
        self.block_size = block_size
        self._seed = seed
        self._digest = _HASH_FUNCTIONS[algo]
        self.none_hash = self.hash_value(seed)
        self._tokens_head = _cbor_head(4, block_size)

    @classmethod
    def from_config(cls, cache: CacheConfig) -> BlockHasher:
        return cls(cache.hash_algo, cache.hash_seed, cache.block_size)

    def hash_value(self, value: object) -> BlockHash:
        """H(value): the digest of the canonical CBOR encoding of ``value``."""
        return BlockHash(self._digest(cbor2.dumps(value, canonical=True)))

    def hash_block(
        self,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[object, ...] | None = None,
    ) -> BlockHash:
        """Hash one full block given its parent's hash (None for the first block)."""
        parent_hash = self.none_hash if parent is None else parent
        tokens_head = self._tokens_head if len(token_ids) == self.block_size else _cbor_head(4, len(token_ids))
        try:
            extra = _NULL if extra_keys is None else _extra_cbor(extra_keys)
            parent_head = _PARENT_HEADS.get(len(parent_hash)) or _BLOCK_HEAD + _cbor_head(2, len(parent_hash))
            encoded = b"".join((parent_head, parent_hash, tokens_head, *map(_TOKEN_CBOR.__getitem__, token_ids), extra))
        except (_Unencodable, TypeError):  # an unusual token id, or unhashable extra keys: cbor2 writes it all
            return self.hash_value((parent_hash, tuple(token_ids), extra_keys))
        return BlockHash(self._digest(encoded))

    def hash_blocks(self, token_ids: Sequence[int], **chain: Unpack[ChainKeys]) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids`` from ``start_block`` on (:class:`ChainKeys`).

        A trailing partial block is never hashed.
        """
        return list(self.iter_hashes(token_ids, **chain))

    def iter_hashes(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        parent: BlockHash | None = None,
        start_block: int = 0,
    ) -> Iterator[BlockHash]:
        """:meth:`hash_blocks`, one hash at a time: a walk that stops early hashes no further."""
        size = self.block_size
        first, rest = self.extra_keys(0, lora_name, cache_salt), self.extra_keys(1, lora_name, cache_salt)
        hash_block = self.hash_block
        for index in range(start_block, len(token_ids) // size):
            parent = hash_block(parent, token_ids[index * size : (index + 1) * size], first if index == 0 else rest)
            yield parent

    @staticmethod
    def extra_keys(block_index: int, lora_name: str | None, cache_salt: str | None) -> tuple[object, ...] | None:
        """The tagged keys block ``block_index`` of a request hashes (module docstring): LoRA, then salt."""
        keys: list[object] = []
        if lora_name is not None:
            keys.append(("lora", lora_name, LORA_PATH))
        if cache_salt and block_index == 0:
            keys.append(("cache_salt", cache_salt))
        return tuple(keys) if keys else None

    def __repr__(self) -> str:
        return f"BlockHasher(algo={self.algo!r}, seed={self._seed!r}, block_size={self.block_size})"


def published_extra_keys(block_index: int, lora_name: str | None, cache_salt: str | None) -> tuple[str, ...] | None:
    """Block ``block_index``'s entry in a BlockStored's ``extra_keys``, as vLLM publishes it: untagged."""
    keys: list[str] = []
    if lora_name is not None:
        keys.append(lora_name)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def tagged_extra_keys(entry: object, *, lora_name: str | None, first_block: bool) -> tuple[object, ...] | None:
    """The keys a block's hash folded in, rebuilt from its entry in a BlockStored's untagged ``extra_keys``.

    ``lora_name`` is the event's; ``first_block``: the block starts its
    sequence (no parent), the only one a salt is hashed into. vLLM orders an
    entry LoRA name, multimodal identifiers, salt, prompt-embeds digests: the
    LoRA name (first, when the event names a LoRA) becomes our LoRA key --
    also when the producer published no ``extra_keys`` at all -- the last
    string of a first block becomes the salt key, and anything else (what
    our requests never carry) is kept as it came, msgpack arrays as tuples.
    A salt is unknowable without ``extra_keys``: such a block re-keys as
    unsalted. Raises nothing: entries of unexpected shapes are kept as they are.
    """
    items: list[object]
    if entry is None:
        items = []
    elif isinstance(entry, list | tuple):
        items = [tuple(item) if isinstance(item, list) else item for item in entry]
    else:
        items = [entry]
    keys: list[object] = []
    if lora_name is not None:
        if items and items[0] == lora_name:
            items.pop(0)
        keys.append(("lora", lora_name, LORA_PATH))
    salt_at = None
    if first_block:
        salt_at = next((i for i in range(len(items) - 1, -1, -1) if isinstance(items[i], str)), None)
    for index, item in enumerate(items):
        keys.append(("cache_salt", item) if index == salt_at else item)
    return tuple(keys) if keys else None


class HashMemo:
    """A prompt's chain of external block hashes, remembered block by block for the next prompt that shares it.

    The router hashes every routed prompt as far as some replica holds it,
    and prompts share prefixes -- that is what the cache is for: a system
    prompt, a conversation's earlier turns, a document asked about again. The
    memo turns a block's hash from a CBOR write and a SHA-256 into a dict
    lookup (about a sixth of the time for a 1k-token prompt).

    Key: the parent's digest, the block's token ids as 32-bit words, and --
    only when the block has any -- its extra keys' CBOR. The digest has the
    hasher's fixed length and the ids the block's, so no two keys alias.
    Value: the block's digest (the next block's parent) and its external
    hash. Ids outside [0, 2**32) skip the memo for the whole prompt and are
    hashed by the :class:`BlockHasher` as usual; either way the hashes are
    the hasher's, bit for bit.

    Bounded by two generations of at most ``capacity // 2`` blocks each: a hit
    in the old generation moves to the young one; when the young one is full
    it becomes the old one and the oldest generation is dropped. So a prefix
    in use stays, at most ``capacity`` blocks are held (about 500 bytes each),
    and no access pays for eviction bookkeeping. ``capacity`` 0 remembers
    nothing. Not thread-safe: one thread uses it (the router's event loop).
    """

    __slots__ = ("_half", "_hasher", "_old", "_young")

    def __init__(self, hasher: BlockHasher, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._hasher = hasher
        self._half = capacity // 2
        self._young: dict[bytes, tuple[BlockHash, ExternalBlockHash]] = {}
        self._old: dict[bytes, tuple[BlockHash, ExternalBlockHash]] = {}

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def iter_external(
        self, token_ids: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> Iterator[ExternalBlockHash]:
        """The external hashes of the full blocks of ``token_ids``, one at a time (as ``iter_hashes`` yields)."""
        hasher = self._hasher
        words = _id_words(token_ids) if self._half else None
        if words is None:  # nothing is remembered, or an id no key can hold: the hasher as it is
            for digest in hasher.iter_hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt):
                yield to_external(digest)
            return
        size = hasher.block_size
        width = _ID_BYTES * size
        extras = [hasher.extra_keys(i, lora_name, cache_salt) for i in (0, 1)]
        suffixes = [b"" if keys is None else _extra_cbor(keys) for keys in extras]
        parent = hasher.none_hash
        for index in range(len(token_ids) // size):
            first = index == 0
            key = parent + words[index * width : (index + 1) * width] + suffixes[not first]
            entry = self._young.get(key)
            if entry is None:
                entry = self._old.pop(key, None)
                if entry is None:
                    tokens = token_ids[index * size : (index + 1) * size]
                    digest = hasher.hash_block(None if first else parent, tokens, extras[not first])
                    entry = (digest, to_external(digest))
                self._remember(key, entry)
            parent = entry[0]
            yield entry[1]

    def _remember(self, key: bytes, entry: tuple[BlockHash, ExternalBlockHash]) -> None:
        if len(self._young) >= self._half:
            self._old = self._young
            self._young = {}
        self._young[key] = entry


def _id_words(token_ids: Sequence[int]) -> bytes | None:
    """The ids as the memo's key writes them (C unsigned ints); None when one does not fit [0, 2**32)."""
    try:
        return array("I", token_ids).tobytes()
    except (OverflowError, TypeError):
        return None
