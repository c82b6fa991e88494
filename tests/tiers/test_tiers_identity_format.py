"""CacheIdentity (digest, sizes), the slot and slab format (encode, decode, each refusal), TierConfig validation."""

from __future__ import annotations

import hashlib
import struct

import msgspec
import pytest
import torch
from tiers_helpers import IDENTITY, make_blocks

from kvstore.deploy.config import load_config
from kvstore.errors import ConfigError
from kvstore.kv_layout import KVLayout
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.disk_format import (
    FORMAT_VERSION,
    IntegrityError,
    decode_header,
    encode_header,
    header_len,
    slab_name,
    slab_number,
    slots_per_slab,
    verify,
)
from kvstore.tiers.identity import CacheIdentity
from kvstore.workers.config import cache_identity

DIGEST = bytes.fromhex(IDENTITY.digest())


def test_digest_is_stable_and_covers_every_field() -> None:
    # Pinned: a change here orphans every deployment's disk cache, so it must be deliberate.
    canonical = (
        '["kvstore-cache-identity-v1",{"block_size":4,"dtype":"float16","hash_algo":"sha256_cbor",'
        '"hash_seed":"kvstore","head_dim":64,"model":"test-model","num_kv_heads":2,"num_layers":2}]'
    )
    assert (
        IDENTITY.digest() == hashlib.sha256(canonical.encode()).hexdigest()[:32] == "fdf596e4c73a685468525006e003fbde"
    )
    changed = {"model": "other", "hash_algo": "xxh3_128", "hash_seed": "vllm"}
    layout_changed = {"num_layers": 3, "num_kv_heads": 4, "head_dim": 32, "dtype": "bfloat16", "block_size": 8}
    digests = {msgspec.structs.replace(IDENTITY, **{k: v}).digest() for k, v in changed.items()}
    digests |= {
        msgspec.structs.replace(IDENTITY, layout=msgspec.structs.replace(IDENTITY.layout, **{k: v})).digest()
        for k, v in layout_changed.items()
    }
    assert len(digests) == len(changed) + len(layout_changed) and IDENTITY.digest() not in digests


def test_block_bytes_and_shape() -> None:
    llama = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")
    assert llama.bytes_per_block == 2 * 1024 * 1024  # a Llama-3-8B block at block size 16 in fp16
    assert IDENTITY.layout.block_shape == (2, 2, 4, 2, 64) and IDENTITY.block_bytes == 4096


def test_identity_from_config_and_validation() -> None:
    config = load_config(overrides=["cache.block_size=8", "worker.seed=3"])
    identity = cache_identity(config)
    assert identity.block_size == 8 and identity.hash_algo == config.cache.hash_algo
    assert "seed=3" in identity.model
    assert cache_identity(config, model="llama").model == "llama"
    with pytest.raises(ValueError, match="num_layers"):
        msgspec.structs.replace(IDENTITY.layout, num_layers=0)
    with pytest.raises(ValueError, match="block_size"):
        CacheIdentity.from_layout(IDENTITY.layout, config.cache, model="m")  # layout 4, cache 8
    with pytest.raises(ValueError, match="model"):
        msgspec.structs.replace(IDENTITY, model="")


def test_header_round_trip() -> None:
    metas, data = make_blocks(2)
    payload = memoryview(data[1].view(-1).view(torch.uint8).numpy())
    raw = encode_header(metas[1], payload, DIGEST)
    assert len(raw) == header_len(IDENTITY.block_size) == 4096
    header = decode_header(raw, identity_digest=DIGEST, block_size=4, block_bytes=4096)
    assert header.meta == metas[1] and header.payload_len == 4096 and header.header_len == 4096
    verify(header, payload)
    first = decode_header(
        encode_header(metas[0], payload, DIGEST), identity_digest=DIGEST, block_size=4, block_bytes=4096
    )
    assert first.meta.parent_hash is None  # the root block has no parent (not parent 0)


def test_slab_names_and_sizes() -> None:
    assert slab_name(3) == "000003.kvslab" and slab_number("000003.kvslab") == 3
    assert slab_number("notes.txt") is None and slab_number("3.kvslab") is None
    assert slots_per_slab(2 * 1024 * 1024 + 4096) == 31  # a Llama-3-8B block and its header: 62 MiB slabs
    assert slots_per_slab(200 * 1024) == 327 and slots_per_slab(1 << 30) == 1


def _header() -> tuple[bytearray, memoryview, BlockMeta]:
    metas, data = make_blocks(1)
    payload = memoryview(bytearray(data.view(-1).view(torch.uint8).numpy().tobytes()))
    return bytearray(encode_header(metas[0], payload, DIGEST)), payload, metas[0]


@pytest.mark.parametrize(
    ("offset", "value", "reason"),
    [
        (0, b"XXXXXXXX", "bad_magic"),
        (8, struct.pack("<H", FORMAT_VERSION + 1), "bad_version"),
        (16, struct.pack("<I", 5), "bad_length"),
        (40, struct.pack("<Q", 4095), "bad_length"),
        (48, b"\x00" * 16, "wrong_identity"),
        (4095, b"\x01", "bad_padding"),
    ],
)
def test_header_refusals(offset: int, value: bytes, reason: str) -> None:
    raw, _, _ = _header()
    raw[offset : offset + len(value)] = value
    with pytest.raises(IntegrityError) as info:
        decode_header(raw, identity_digest=DIGEST, block_size=4, block_bytes=4096)
    assert info.value.reason == reason


def test_checksum_catches_a_flipped_bit_in_tokens_or_payload() -> None:
    raw, payload, _ = _header()
    raw[64] ^= 1  # first token
    header = decode_header(raw, identity_digest=DIGEST, block_size=4, block_bytes=4096)
    with pytest.raises(IntegrityError) as info:
        verify(header, payload)
    assert info.value.reason == "bad_checksum"
    raw, payload, _ = _header()
    header = decode_header(raw, identity_digest=DIGEST, block_size=4, block_bytes=4096)
    flipped = bytearray(payload)
    flipped[1000] ^= 0x80
    with pytest.raises(IntegrityError, match="bad_checksum"):
        verify(header, memoryview(flipped))
    with pytest.raises(IntegrityError, match="short_read"):
        verify(header, payload[:100])
    with pytest.raises(IntegrityError, match="short_read"):
        decode_header(raw[:40], identity_digest=DIGEST, block_size=4, block_bytes=4096)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("tiers.io_deadline_s=0", "tiers.io_deadline_s"),
        ("tiers.cpu_capacity_bytes=0", "tiers.cpu_capacity_bytes"),
        ("tiers.max_concurrent_io=0", "tiers.max_concurrent_io"),
        ("tiers.admit_after_spills=0", "tiers.admit_after_spills"),
        ("tiers.disk_capacity_bytes=-1", "tiers.disk_capacity_bytes"),
        ("tiers.write_through=maybe", "tiers.write_through"),
        ("tiers.disk_dri=/tmp", "tiers"),
    ],
)
def test_tier_config_is_validated_on_load(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=[override])


def test_tier_config_defaults_and_overrides() -> None:
    tiers = load_config(overrides=["tiers.disk_dir=/var/cache/kv", "tiers.write_through=true"]).tiers
    assert tiers.disk_dir == "/var/cache/kv" and tiers.write_through
    assert load_config().tiers.disk_dir is None and load_config().tiers.admit_after_spills == 1
