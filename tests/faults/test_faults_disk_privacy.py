"""The disk tier's files are its user's alone: KV can be read back into prompts.

Slab files are created 0600 and the tier's directory 0700, whatever the
process's umask; a directory an older version left open (0755) is
tightened when the tier starts on it, and the older format's shard folders
are removed. Slots are reused in place, so no file changes hands.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import stat
from pathlib import Path

from kvstore.hashing import BlockHasher
from kvstore.kv_layout import KVLayout
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.identity import CacheIdentity

IDENTITY = CacheIdentity(
    model="privacy-test",
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=4),
    hash_algo="sha256_cbor",
    hash_seed="kvstore",
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_slab_files_are_0600_and_directories_0700_even_under_a_permissive_umask(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    (root / IDENTITY.digest() / "00").mkdir(parents=True, mode=0o755)  # as an older version left it
    os.chmod(root / IDENTITY.digest(), 0o755)
    hasher = BlockHasher(IDENTITY.hash_algo, IDENTITY.hash_seed, IDENTITY.block_size)
    tokens = list(range(3 * IDENTITY.block_size))
    metas = BlockMeta.chain(hasher.hash_blocks(tokens), tokens, IDENTITY.block_size)
    payload = memoryview(mmap.mmap(-1, IDENTITY.block_bytes))

    async def scenario() -> DiskTier:
        tier = DiskTier(
            root,
            IDENTITY,
            capacity_bytes=2 * (IDENTITY.block_bytes + 4096),  # the third write evicts and reuses a slot
            deadline_s=5.0,
            max_concurrent_io=2,
        )
        for meta in metas:
            assert await tier.write(meta, payload)
        return tier

    old = os.umask(0)  # the most permissive: nothing masked off what the tier asks for
    try:
        tier = asyncio.run(scenario())
    finally:
        os.umask(old)
    try:
        directories = [tier.directory, *(p for p in tier.directory.iterdir() if p.is_dir())]
        assert len(directories) == 1  # the tier's (the old version's shard folder, empty, is gone)
        assert {str(p): _mode(p) for p in directories if _mode(p) != 0o700} == {}
        files = [p for p in tier.directory.rglob("*") if p.is_file()]
        assert [p.name for p in files] == ["000000.kvslab"]  # one slab of two slots: the third write reused one
        assert {str(p): oct(_mode(p)) for p in files if _mode(p) != 0o600} == {}
    finally:
        tier.close()
