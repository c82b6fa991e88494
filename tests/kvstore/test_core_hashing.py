"""Block hashing: byte-for-byte vLLM sha256_cbor, xxh3_128, wire form, tagged extra keys and their untagged
event form, incremental hashing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import cbor2
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.config import CacheConfig
from kvstore.hashing import (
    LORA_PATH,
    BlockHasher,
    HashMemo,
    published_extra_keys,
    tagged_extra_keys,
    to_external,
)


def sha256_cbor(value: object) -> bytes:
    """vLLM's sha256_cbor, written out here independently of kvstore."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def xxh3_cbor(value: object) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(value, canonical=True))


def by_hand(
    fn, seed: str, tokens: list[int], size: int, lora: str | None = None, salt: str | None = None
) -> list[bytes]:
    """vLLM's chained hashing: H((parent or NONE_HASH, tuple(tokens), extra_keys)), full blocks only, with
    extra keys tagged by their source: ("lora", name, path) on every block, ("cache_salt", salt) on block 0."""
    parent = fn(seed)  # NONE_HASH
    out = []
    for i in range(len(tokens) // size):
        lora_key = None if lora is None else ("lora", lora, "")
        salt_key = ("cache_salt", salt) if salt and i == 0 else None
        keys = [k for k in (lora_key, salt_key) if k is not None]
        parent = fn((parent, tuple(tokens[i * size : (i + 1) * size]), tuple(keys) if keys else None))
        out.append(parent)
    return out


def test_cbor_encoding_of_a_block_is_what_vllm_hashes() -> None:
    # Pin the canonical CBOR bytes by hand: array(3) [bytes(32) parent, array(2) [1, 2], null].
    parent = bytes(range(32))
    encoded = bytes([0x83, 0x58, 0x20]) + parent + bytes([0x82, 0x01, 0x02, 0xF6])
    assert cbor2.dumps((parent, (1, 2), None), canonical=True) == encoded
    hasher = BlockHasher("sha256_cbor", "seed", 2)
    assert hasher.hash_block(parent, [1, 2]) == hashlib.sha256(encoded).digest()
    assert BlockHasher("xxh3_128", "seed", 2).hash_block(parent, [1, 2]) == xxhash.xxh3_128_digest(encoded)
    # NONE_HASH = H(seed): CBOR text string of length 14 (0x6e) for vLLM's default seed.
    assert BlockHasher("sha256_cbor", "vllm-none-hash", 2).none_hash == (
        hashlib.sha256(b"\x6e" + b"vllm-none-hash").digest()
    )


@pytest.mark.parametrize(("algo", "fn"), [("sha256_cbor", sha256_cbor), ("xxh3_128", xxh3_cbor)])
@pytest.mark.parametrize("seed", ["kvstore", "vllm-none-hash", "0"])
def test_chained_hashes_match_hand_computation(algo, fn, seed: str) -> None:
    tokens = [7, 300, 2**31 - 1, 0, 5, 5, 9, 12, 100_000, 3]
    hasher = BlockHasher(algo, seed, 4)
    assert hasher.none_hash == fn(seed)
    assert hasher.hash_blocks(tokens) == by_hand(fn, seed, tokens, 4)
    assert len(hasher.hash_blocks(tokens)[0]) == (32 if algo == "sha256_cbor" else 16)
    assert hasher.hash_blocks(tokens, lora_name="adapter", cache_salt="tenant") == by_hand(
        fn, seed, tokens, 4, lora="adapter", salt="tenant"
    )


def test_extra_keys_are_tagged_lora_then_salt_on_block_zero_only() -> None:
    lora = ("lora", "L", LORA_PATH)
    assert LORA_PATH == ""  # a vLLM LoRARequest made without a path
    assert BlockHasher.extra_keys(0, None, None) is None
    assert BlockHasher.extra_keys(0, "L", None) == (lora,)
    assert BlockHasher.extra_keys(0, None, "S") == (("cache_salt", "S"),)
    assert BlockHasher.extra_keys(0, "L", "S") == (lora, ("cache_salt", "S"))
    assert BlockHasher.extra_keys(1, "L", "S") == (lora,)
    assert BlockHasher.extra_keys(3, None, "S") is None
    assert BlockHasher.extra_keys(0, None, "") is None  # an empty salt is no salt
    # A LoRA and a salt spelled alike no longer give the same keys.
    assert BlockHasher.extra_keys(0, "X", None) != BlockHasher.extra_keys(0, None, "X")

    hasher = BlockHasher("sha256_cbor", "kvstore", 2)
    h = hasher.hash_blocks([1, 2, 3, 4], lora_name="L", cache_salt="S")
    none = sha256_cbor("kvstore")
    assert h[0] == sha256_cbor((none, (1, 2), (("lora", "L", ""), ("cache_salt", "S"))))
    assert h[1] == sha256_cbor((h[0], (3, 4), (("lora", "L", ""),)))
    assert hasher.hash_blocks([1, 2, 3, 4], cache_salt="") == hasher.hash_blocks([1, 2, 3, 4])
    # Salted chains differ from block 0 on; the salt itself only enters block 0.
    salted = hasher.hash_blocks([1, 2, 3, 4], cache_salt="S")
    assert salted[1] == sha256_cbor((salted[0], (3, 4), None))
    assert salted[0] != hasher.hash_blocks([1, 2, 3, 4])[0]


def test_published_extra_keys_are_untagged_and_tag_back_to_what_was_hashed() -> None:
    assert published_extra_keys(0, None, None) is None
    assert published_extra_keys(0, "L", "S") == ("L", "S")
    assert published_extra_keys(1, "L", "S") == ("L",)
    assert published_extra_keys(0, None, "S") == ("S",)
    assert published_extra_keys(2, None, "S") is None
    assert published_extra_keys(0, None, "") is None
    for lora in (None, "L", "S"):
        for salt in (None, "", "S", "L"):
            for index in range(3):
                entry = published_extra_keys(index, lora, salt)
                for wire in (entry, None if entry is None else list(entry)):  # msgpack gives lists back
                    tagged = tagged_extra_keys(wire, lora_name=lora, first_block=index == 0)
                    assert tagged == BlockHasher.extra_keys(index, lora, salt), (lora, salt, index, wire)


def test_tagged_extra_keys_of_foreign_entries() -> None:
    # A producer that published no extra_keys: the event's LoRA name still tags every block; a salt is unknowable.
    assert tagged_extra_keys(None, lora_name="L", first_block=True) == (("lora", "L", ""),)
    assert tagged_extra_keys(None, lora_name=None, first_block=True) is None
    # vLLM's order: LoRA name, multimodal identifiers, salt; what our requests never carry is kept as it came.
    mm = ["img-uuid", 3]
    assert tagged_extra_keys(["L", mm, "S"], lora_name="L", first_block=True) == (
        ("lora", "L", ""), ("img-uuid", 3), ("cache_salt", "S"),
    )  # fmt: skip
    assert tagged_extra_keys(["L", mm], lora_name="L", first_block=False) == (("lora", "L", ""), ("img-uuid", 3))
    assert tagged_extra_keys("S", lora_name=None, first_block=True) == (("cache_salt", "S"),)  # a bare value
    assert tagged_extra_keys([b"\x01"], lora_name=None, first_block=False) == (b"\x01",)


def test_external_hash_is_low_64_bits_big_endian() -> None:
    digest = bytes(range(1, 33))
    assert to_external(digest) == int.from_bytes(digest[-8:], "big") == 0x191A1B1C1D1E1F20
    assert to_external(b"\xff" * 32) == 2**64 - 1
    assert to_external(b"\x00" * 31 + b"\x05") == 5
    for algo in ("sha256_cbor", "xxh3_128"):
        for h in BlockHasher(algo, "kvstore", 2).hash_blocks(list(range(20))):  # type: ignore[arg-type]
            assert to_external(h) == (int.from_bytes(h, "big") & (2**64 - 1))
            assert 0 <= to_external(h) < 2**64


def test_only_full_blocks_are_hashed() -> None:
    hasher = BlockHasher("sha256_cbor", "kvstore", 4)
    assert hasher.hash_blocks([]) == []
    assert hasher.hash_blocks([1, 2, 3]) == []
    assert len(hasher.hash_blocks(list(range(11)))) == 2
    assert hasher.hash_blocks(list(range(11))) == hasher.hash_blocks(list(range(8)))


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=50_000), max_size=40),
    split=st.integers(min_value=0, max_value=12),
    size=st.integers(min_value=1, max_value=5),
    lora=st.sampled_from([None, "L"]),
    salt=st.sampled_from([None, "S"]),
    algo=st.sampled_from(["sha256_cbor", "xxh3_128"]),
)
def test_incremental_hashing_equals_full_hashing(tokens, split, size, lora, salt, algo) -> None:
    hasher = BlockHasher(algo, "kvstore", size)
    full = hasher.hash_blocks(tokens, lora_name=lora, cache_salt=salt)
    k = min(split, len(full))
    head = hasher.hash_blocks(tokens[: k * size], lora_name=lora, cache_salt=salt)
    tail = hasher.hash_blocks(tokens, lora_name=lora, cache_salt=salt, parent=head[-1] if head else None, start_block=k)
    assert head + tail == full
    assert full == by_hand(sha256_cbor if algo == "sha256_cbor" else xxh3_cbor, "kvstore", tokens, size, lora, salt)


def test_hasher_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="xxh3_128"):
        BlockHasher("md5", "kvstore", 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher("sha256_cbor", "kvstore", 0)
    assert BlockHasher.from_config(CacheConfig(block_size=8, hash_algo="xxh3_128")).block_size == 8


_CHILD = textwrap.dedent(
    """
    import json
    from kvstore.hashing import LORA_PATH, BlockHasher, published_extra_keys, tagged_extra_keys, to_external
    out = {}
    for algo in ("sha256_cbor", "xxh3_128"):
        hasher = BlockHasher(algo, "kvstore", 4)
        hashes = hasher.hash_blocks(list(range(37)), lora_name="L", cache_salt="S")
        out[algo] = {"none": hasher.none_hash.hex(), "blocks": [h.hex() for h in hashes],
                     "external": [to_external(h) for h in hashes]}
    print(json.dumps(out))
    """
)


def test_two_processes_compute_identical_hashes() -> None:
    results = []
    for hash_seed in ("1", "random"):  # different PYTHONHASHSEEDs: our seed never depends on it
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60, check=True
        )
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1]
    for algo, fn in (("sha256_cbor", sha256_cbor), ("xxh3_128", xxh3_cbor)):
        assert results[0][algo]["none"] == fn("kvstore").hex()
        expected = by_hand(fn, "kvstore", list(range(37)), 4, lora="L", salt="S")
        assert results[0][algo]["blocks"] == [h.hex() for h in expected]
        assert len(expected) == 9


_BOUNDARIES = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
_TOKEN_IDS = st.one_of(
    st.sampled_from(_BOUNDARIES),
    st.integers(min_value=0, max_value=200_000),
    st.integers(min_value=-(2**70), max_value=2**70),  # negatives and bignums take cbor2's path
)
_EXTRA_KEYS = st.one_of(
    st.none(),
    st.just((("lora", "adapter", LORA_PATH),)),
    st.tuples(st.tuples(st.just("cache_salt"), st.text(max_size=40))),
    st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=3).map(lambda keys: (keys,)),  # unhashable
)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(_TOKEN_IDS, max_size=300),
    extra=_EXTRA_KEYS,
    parent=st.one_of(st.none(), st.binary(min_size=16, max_size=16), st.binary(min_size=0, max_size=40)),
    algo=st.sampled_from(["sha256_cbor", "xxh3_128"]),
)
def test_a_blocks_bytes_are_cbor2s_canonical_encoding(
    tokens: list[int], extra: tuple[object, ...] | None, parent: bytes | None, algo: str
) -> None:
    # hash_block writes a block's CBOR itself (a table of token encodings): it must be cbor2's to the byte,
    # for every token id (the table's boundaries, and ids it does not cover), parent length and extra keys.
    hasher = BlockHasher(algo, "seed", max(1, len(tokens)))  # type: ignore[arg-type]
    fn = sha256_cbor if algo == "sha256_cbor" else xxh3_cbor
    expected = fn((hasher.none_hash if parent is None else parent, tuple(tokens), extra))
    assert hasher.hash_block(parent, tokens, extra) == expected  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(_TOKEN_IDS, max_size=40),
    size=st.integers(min_value=1, max_value=6),
    lora=st.one_of(st.none(), st.just("adapter")),
    salt=st.one_of(st.none(), st.just("tenant")),
)
def test_a_chain_with_any_token_ids_is_vllms(tokens: list[int], size: int, lora: str | None, salt: str | None) -> None:
    # The chain's own fast path (blocks after the first) must agree with the by-hand chain, uncovered ids too.
    hasher = BlockHasher("sha256_cbor", "seed", size)
    assert hasher.hash_blocks(tokens, lora_name=lora, cache_salt=salt) == by_hand(
        sha256_cbor, "seed", tokens, size, lora=lora, salt=salt
    )


# ----------------------------------------------------------------- the router's memo

_PROMPT_TOKENS = st.one_of(st.integers(min_value=0, max_value=40), st.sampled_from([2**32 - 1, 2**32, -1, 2**64]))


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(
            st.lists(_PROMPT_TOKENS, max_size=14),
            st.one_of(st.none(), st.just("adapter"), st.just("other")),
            st.one_of(st.none(), st.just("tenant"), st.just("")),
        ),
        max_size=12,
    ),
    shared=st.lists(st.integers(min_value=0, max_value=3), min_size=3, max_size=3),
    capacity=st.integers(min_value=0, max_value=9),
    size=st.integers(min_value=1, max_value=4),
    algo=st.sampled_from(["sha256_cbor", "xxh3_128"]),
)
def test_the_memo_answers_the_hashers_chain_for_any_sequence_of_prompts(
    prompts: list[tuple[list[int], str | None, str | None]], shared: list[int], capacity: int, size: int, algo: str
) -> None:
    # Prompts that share a prefix (the memo's hits), differ in LoRA or salt (keys that must not alias), carry
    # ids the memo's 32-bit words cannot hold (its fallback), under every capacity (its generations turning).
    hasher = BlockHasher(algo, "seed", size)  # type: ignore[arg-type]
    memo = HashMemo(hasher, capacity)
    for tokens, lora, salt in prompts:
        tokens = shared + tokens
        expected = [to_external(h) for h in hasher.hash_blocks(tokens, lora_name=lora, cache_salt=salt)]
        assert list(memo.iter_external(tokens, lora_name=lora, cache_salt=salt)) == expected
        assert len(memo) <= capacity


class _CountingHasher(BlockHasher):
    """Records the token ids of every block it hashes itself."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.hashed: list[tuple[int, ...]] = []

    def hash_block(self, parent, token_ids, extra_keys=None):  # type: ignore[no-untyped-def]
        self.hashed.append(tuple(token_ids))
        return super().hash_block(parent, token_ids, extra_keys)


def test_the_memo_keeps_what_is_used_and_drops_the_oldest_generation() -> None:
    hasher = _CountingHasher("sha256_cbor", "seed", 2)
    memo = HashMemo(hasher, 4)  # two generations of at most two blocks each
    system, a, b, c, d = [1, 2, 3, 4], [9, 9], [8, 8], [7, 7], [6, 6]

    def run(tokens: list[int]) -> list[tuple[int, ...]]:
        hasher.hashed.clear()
        assert list(memo.iter_external(tokens)) == [to_external(h) for h in BlockHasher.hash_blocks(hasher, tokens)]
        return hasher.hashed[: len(hasher.hashed) - len(tokens) // 2]  # what the memo hashed, not the check

    assert run(system) == [(1, 2), (3, 4)]  # young: both blocks
    assert run(a) == [(9, 9)]  # the young generation was full: it became the old one
    assert run(system) == []  # both from the old generation, back into the young one (which turned again)
    assert run(b) == [(8, 8)]
    assert run(c) == [(7, 7)]  # turned: the generation that held (9, 9) and (1, 2) is gone
    assert run(system + d) == [(1, 2), (6, 6)]  # (3, 4) was kept: it had been used since
    assert len(memo) <= 4
    assert run(a) == [(9, 9)]


def test_a_memo_of_no_capacity_hashes_every_prompt_and_a_negative_one_is_refused() -> None:
    hasher = _CountingHasher("sha256_cbor", "seed", 2)
    memo = HashMemo(hasher, 0)
    for _ in range(2):
        assert list(memo.iter_external([1, 2, 3, 4])) == [to_external(h) for h in hasher.hash_blocks([1, 2, 3, 4])]
    assert len(memo) == 0
    assert len(hasher.hashed) == 8  # twice by the memo, twice by the check
    with pytest.raises(ValueError, match="capacity"):
        HashMemo(hasher, -1)


def test_huge_token_ids_hash_as_vllm_hashes_them_and_are_not_kept() -> None:
    """The CBOR of each token id is kept for ids a vocabulary has; a client's arbitrary 64-bit ids (a router
    hashes prompts it has not checked) are encoded each time, or its memory would grow with every request."""
    from kvstore import hashing

    hasher = BlockHasher("sha256_cbor", "seed", 2)
    parent = bytes(32)
    for tokens in ([2**63 + 5, 7], [2**64 - 1, 2**40], [5, 1 << 20]):
        assert hasher.hash_block(parent, tokens) == sha256_cbor((parent, tuple(tokens), None))
    kept = set(hashing._TOKEN_CBOR)
    assert {5, 7} <= kept and not kept & {2**63 + 5, 2**64 - 1, 2**40, 1 << 20}
