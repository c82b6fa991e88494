"""Disk tier faults under a real worker: corrupt, torn and wiped slots; a disk that fills up.

Each test runs KV workers (the real model and paged pool) whose evicted
blocks go through a real tier store (:class:`LocalTierClient`: the shared
arena in /dev/shm, block files on the real disk under ``tmp_path``), and
whose admissions promote from it -- the same TierOffload/TierLink path as a
Ray worker, in one process so that 1,000+ blocks take seconds.

The slab files are then damaged behind the tier's back, and the prompts
whose prefixes live in the damaged slots are served again. Every output must equal
the output of a run with no cache at all, and every fault must show up in
the tier's metrics, exactly where the count is deterministic.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from faults_helpers import tokens
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import kvstore.tiers.disk_files as disk_files
from kvstore.deploy.config import Config, config_from_dict
from kvstore.hashing import BlockHasher, to_external
from kvstore.metrics import render
from kvstore.tiers.client import LocalTierClient
from kvstore.tiers.disk_format import header_len
from kvstore.tiers.link import TierLink
from kvstore.tiers.metrics import TierCollector
from kvstore.worker_api import GenerateRequest, GenerateResult
from kvstore.workers.config import cache_identity
from kvstore.workers.tier_offload import TierOffload
from kvstore.workers.worker import KVWorker
from tests.ground_truth import reference_outputs

BLOCK = 4  # small blocks: 8 KiB of KV for the toy model, so a block file is 12 KiB
DOC_BLOCKS = 24
MAX_TOKENS = 3
CPU_SLOTS = 32


def disk_config(tmp_path: Path, *, disk_files: int | None = None) -> Config:
    """The toy model on the CPU, a 64-block pool, a 32-slot arena and a disk tier under ``tmp_path``."""
    tiers: dict[str, Any] = {"cpu_capacity_bytes": CPU_SLOTS * block_bytes(), "disk_dir": str(tmp_path / "disk"),
                             "io_deadline_s": 10.0}  # fmt: skip
    if disk_files is not None:
        tiers["disk_capacity_bytes"] = disk_files * (header_len(BLOCK) + block_bytes())
    return config_from_dict(
        {
            "cache": {"block_size": BLOCK},
            "pool": {"num_blocks": 64},
            "events": {"enabled": False},
            "worker": {"device": "cpu"},
            "tiers": tiers,
        }
    )


def block_bytes() -> int:
    return cache_identity(config_from_dict({"cache": {"block_size": BLOCK}})).block_bytes


@contextmanager
def tiered_workers(config: Config, names: list[str]) -> Iterator[tuple[LocalTierClient, list[KVWorker]]]:
    """A tier store and workers linked to it (each maps the arena), all shut down afterwards."""
    identity = cache_identity(config)
    client = LocalTierClient(config.tiers, identity, arena_name=f"kvstore-test-{uuid.uuid4().hex[:12]}")
    workers: list[KVWorker] = []
    try:
        for name in names:
            workers.append(KVWorker(name, config, offload=TierOffload(TierLink(client, identity))))
        yield client, workers
    finally:
        for worker in workers:
            worker.shutdown()
        client.close()


def wrong_tokens(got: list[int], want: list[int]) -> int:
    return sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))


def tier_metrics(client: LocalTierClient) -> dict[str, float]:
    """The tier's Prometheus page as {``name{label=value,...}``: value} (its one node's label left out)."""
    registry = CollectorRegistry()
    registry.register(TierCollector(client.stats, "n0"))
    page = {}
    for family in text_string_to_metric_families(render(registry).decode()):
        for sample in family.samples:
            assert sample.labels["node"] == "n0", sample
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "node")
            page[f"{sample.name}{{{labels}}}"] = sample.value
    return page


def corrupt_bytes(path: Path, offset: int, rng: random.Random) -> str:
    """XOR 1-8 bytes at a random place of the slot at ``offset`` with random non-zero values; the region hit."""
    size = slot_bytes()
    at = rng.randrange(size)
    length = min(rng.randint(1, 8), size - at)
    with path.open("r+b") as fh:
        fh.seek(offset + at)
        raw = bytearray(fh.read(length))
        for k in range(length):
            raw[k] ^= rng.randrange(1, 256)
        fh.seek(offset + at)
        fh.write(raw)
    fields = 64 + 8 * BLOCK + 8  # fixed fields, tokens, checksum
    return "header fields" if at < fields else "header padding" if at < header_len(BLOCK) else "payload"


def slot_bytes() -> int:
    return header_len(BLOCK) + block_bytes()


def write_at(path: Path, offset: int, raw: bytes) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        fh.write(raw)


def read_at(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as fh:
        fh.seek(offset)
        return fh.read(length)


def test_corrupt_torn_and_wiped_slots_never_serve_a_wrong_token(tmp_path: Path) -> None:
    corrupt_n, torn_n, wiped_n = 1000, 100, 100
    config = disk_config(tmp_path)
    hasher = BlockHasher.from_config(config.cache)
    rng = random.Random(2024)
    docs = [tokens(rng, DOC_BLOCKS * BLOCK) for _ in range(130)]
    prompts = [doc + tokens(rng, 2) for doc in docs]  # every block of the doc can be a hit
    expected = reference_outputs(prompts, MAX_TOKENS)
    doc_hashes = [[to_external(h) for h in hasher.hash_blocks(doc)] for doc in docs]

    with tiered_workers(config, ["fill", "serve"]) as (client, (fill, serve)):
        # 1. Fill: one worker computes every prompt; its evictions go through the 32-slot arena to disk.
        for prompt, want in zip(prompts, expected, strict=True):
            assert fill.generate(GenerateRequest(prompt, MAX_TOKENS)).output_token_ids == want
        assert fill.drain_offload()  # stores run off the step loop: every block is written before the damage
        disk = client.store.disk
        assert disk is not None
        whole = [d for d, h in enumerate(doc_hashes) if client.lookup(h).media == ("STORAGE",) * DOC_BLOCKS]
        files = [(d, i) for d in whole for i in range(DOC_BLOCKS)]
        assert len(files) >= corrupt_n + torn_n + wiped_n + 100, (len(files), disk.num_blocks)
        stored_before = disk.num_blocks

        # 2. Damage (only blocks no other tier holds): corrupt bytes in 1,000 slots; tear 100 (another block's
        #    header over the old payload: a write cut short after its header); wipe 100 headers (zeros).
        chosen = rng.sample(files, corrupt_n + torn_n + wiped_n)
        fault: dict[tuple[int, int], str] = {}
        regions: Counter[str] = Counter()
        hlen = header_len(BLOCK)
        spared = next(f for f in files if f not in set(chosen))
        donor = disk.location_of(doc_hashes[spared[0]][spared[1]])  # an undamaged block: its header tears others
        donor_header = read_at(donor[0], donor[1], hlen)
        for n, (d, i) in enumerate(chosen):
            path, offset = disk.location_of(doc_hashes[d][i])
            if n < corrupt_n:
                region = corrupt_bytes(path, offset, rng)
                regions[region] += 1
                fault[d, i] = f"corrupt {region}"
            elif n < corrupt_n + torn_n:
                write_at(path, offset, donor_header)
                fault[d, i] = "torn"
            else:
                write_at(path, offset, bytes(hlen))
                fault[d, i] = "wiped"

        # 3. Serve every damaged prompt on a worker that never computed it: its prefix comes from disk
        #    up to the first damaged block, the rest is recomputed.
        wrong: dict[int, int] = {}
        hits: list[tuple[int, dict[str, int], int]] = []
        results: list[GenerateResult] = []
        for d in whole:
            result = serve.generate(GenerateRequest(prompts[d], MAX_TOKENS))
            results.append(result)
            if result.output_token_ids != expected[d]:
                wrong[d] = wrong_tokens(result.output_token_ids, expected[d])
            first_bad = min((i for (dd, i) in fault if dd == d), default=DOC_BLOCKS)
            if result.cached_tokens_by_medium != {"GPU": 0, "CPU": 0, "STORAGE": first_bad * BLOCK}:
                served_bad = result.cached_tokens_by_medium["STORAGE"] // BLOCK
                hits.append((d, first_bad, [fault.get((d, i), "intact") for i in range(first_bad, served_bad + 1)]))
        assert not wrong, f"{sum(wrong.values())} wrong tokens served, in {len(wrong)} of {len(whole)} prompts"
        assert not hits, f"hits other than the intact prefixes: {hits[:5]}"
        fill.check_invariants()
        serve.check_invariants()
        client.check_invariants()

        # 4. Every fault is counted, once, by reason.
        stats = client.stats()
        integrity = dict(stats.integrity_failures)
        kinds = Counter(kind.split()[0] for kind in fault.values())
        assert kinds == {"corrupt": corrupt_n, "torn": torn_n, "wiped": wiped_n}
        assert sum(integrity.values()) == corrupt_n + torn_n + wiped_n, (integrity, regions)  # every one is caught
        assert integrity["wrong_hash"] >= torn_n and integrity["bad_magic"] >= wiped_n, integrity
        assert set(integrity) <= {"bad_checksum", "bad_magic", "bad_version", "bad_length", "wrong_identity",
                                  "wrong_hash", "wrong_tokens", "bad_padding"}, integrity  # fmt: skip
        assert stats.disk_errors == {} and stats.collisions["STORAGE"] == 0
        page = tier_metrics(client)
        total = sum(v for k, v in page.items() if k.startswith("kvstore_tier_integrity_failures_total"))
        assert total == corrupt_n + torn_n + wiped_n
        assert page["kvstore_tier_integrity_failures_total{reason=bad_magic}"] == integrity["bad_magic"]
        damaged = {doc_hashes[d][i] for d, i in fault}
        for key in [k for k in disk.lru_hashes() if k in damaged]:
            # A damaged block back on disk was written again (spilled by the serving worker): a valid slot.
            path, offset = disk.location_of(key)
            assert read_at(path, offset, 8) == b"KVSTBLK\0"
        served = sum(r.cached_tokens_by_medium["STORAGE"] for r in results) // BLOCK
        print(
            f"\ndisk faults ({disk.io_mode}): {stored_before} blocks in slots, {len(files)} of them for {len(whole)} "
            f"prompts; damaged {corrupt_n} (byte runs in {dict(regions)}), torn {torn_n}, wiped {wiped_n}; "
            f"{len(whole)} prompts served, 0 wrong tokens, {served} blocks promoted from disk; integrity failures "
            f"{dict(stats.integrity_failures)}"
        )


class FailingWrites:
    """Replaces the disk tier's vectored write loop: every run fails, ENOSPC except every ``eio_every``-th
    (EIO); ``blocks`` counts the blocks of the failed runs by errno."""

    def __init__(self, eio_every: int) -> None:
        self.eio_every = eio_every
        self.calls: Counter[str] = Counter()
        self.blocks: Counter[str] = Counter()
        self._lock = threading.Lock()  # called on the tier's I/O threads

    def __call__(self, fd: int, views: list[memoryview], offset: int = 0) -> None:
        with self._lock:
            n = sum(self.calls.values()) + 1
            name = "EIO" if n % self.eio_every == 0 else "ENOSPC"
            self.calls[name] += 1
            self.blocks[name] += len(views) // 2  # a header and a payload per block
        raise OSError(getattr(errno, name), os.strerror(getattr(errno, name)))


def no_room(*args: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_stops_storing_and_is_counted_while_every_output_stays_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = disk_config(tmp_path, disk_files=150)  # fewer slots than the first prompts need: LRU at capacity
    rng = random.Random(99)
    prompts = [tokens(rng, DOC_BLOCKS * BLOCK) + tokens(rng, 2) for _ in range(24)]
    expected = reference_outputs(prompts, MAX_TOKENS)
    early, late = prompts[:10], prompts[10:]

    with tiered_workers(config, ["w0"]) as (client, (worker,)):
        for i, prompt in enumerate(early):
            assert worker.generate(GenerateRequest(prompt, MAX_TOKENS)).output_token_ids == expected[i]
        assert worker.drain_offload()  # stores run off the step loop: let the last ones land
        before = client.stats()
        assert before.blocks["STORAGE"] == 150 and before.evictions["STORAGE"] > 0  # capacity reached: LRU evicts

        # The file system fills up: every write into a slot fails (ENOSPC, and EIO now and then), and no slab
        # can grow.
        failing = FailingWrites(eio_every=5)
        monkeypatch.setattr(disk_files, "write_all", failing)
        monkeypatch.setattr(os, "posix_fallocate", no_room)
        for i, prompt in enumerate(late, start=len(early)):
            assert worker.generate(GenerateRequest(prompt, MAX_TOKENS)).output_token_ids == expected[i]
        assert worker.drain_offload()
        full = client.stats()
        blocks = dict(failing.blocks)
        assert blocks["ENOSPC"] > 0 and blocks["EIO"] > 0, blocks
        assert full.not_stored["STORAGE"]["disk_full"] == blocks["ENOSPC"]
        assert full.not_stored["STORAGE"]["io_error"] == blocks["EIO"] == full.disk_errors["EIO"]
        # A failed write may have touched its slot, so the block evicted for it is gone, and its slot is free
        # for the next write: only the writes that found no free slot evicted (at most one arena's worth in
        # flight), the rest reused the slots freed by earlier failures.
        lost = before.blocks["STORAGE"] - full.blocks["STORAGE"]
        assert lost == full.evictions["STORAGE"] - before.evictions["STORAGE"] <= CPU_SLOTS, lost
        assert full.capacity_bytes["STORAGE"] <= before.capacity_bytes["STORAGE"]
        page = tier_metrics(client)
        assert page["kvstore_tier_not_stored_total{medium=STORAGE,reason=disk_full}"] == blocks["ENOSPC"]
        assert page["kvstore_tier_disk_errors_total{reason=EIO}"] == blocks["EIO"]
        assert [p.name for p in (tmp_path / "disk").rglob("*") if p.is_file()] == ["000000.kvslab"]  # one slab

        # The disk has room again: every prompt, early and late, is still served exactly.
        monkeypatch.undo()
        results = [worker.generate(GenerateRequest(p, MAX_TOKENS)) for p in prompts]
        assert [r.output_token_ids for r in results] == expected
        assert worker.drain_offload()
        after = client.stats()
        assert after.capacity_bytes["STORAGE"] == before.capacity_bytes["STORAGE"]  # the configured capacity is back
        assert after.blocks["STORAGE"] == 150  # full again, of new blocks
        assert after.not_stored["STORAGE"] == full.not_stored["STORAGE"]  # nothing failed once there was room
        worker.check_invariants()
        client.check_invariants()
        print(
            f"\nfull disk: capacity 150 slots reached ({before.evictions['STORAGE']} LRU evictions), then "
            f"{sum(blocks.values())} block writes failed ({blocks}), each counted; {lost} stored blocks evicted for "
            f"writes that then failed; "
            f"{len(late)} prompts served while full and {len(prompts)} after, "
            f"0 wrong tokens; hits after: {sum(r.cached_tokens for r in results) // BLOCK} blocks"
        )
