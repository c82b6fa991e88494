"""The index rebuilt from recorded event streams equals the producers' real caches."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest
from router_helpers import BLOCK_SIZE, WorkloadProducer, held

from kvstore.config import CacheConfig
from kvstore.events import EventBatch, EventDecoder, EventEncoder
from kvstore.hashing import BlockHasher, to_external
from kvstore.router.index import PrefixIndex
from kvstore.router.index_lookup import MediumCounts

CACHE = CacheConfig(block_size=BLOCK_SIZE)


def new_index() -> PrefixIndex:
    index = PrefixIndex(CACHE)
    for r in range(3):
        index.add_producer(f"w{r}", "gpu", [f"r{r}"], "node-a")
    index.add_producer("tier-a", "tier", node="node-a")
    return index


@pytest.mark.parametrize("wire", [False, True], ids=["decoded", "encoded"])
def test_index_equals_pools_after_random_workloads(wire: bool) -> None:
    producers = {f"w{r}": WorkloadProducer(seed=r) for r in range(3)}
    producers["tier-a"] = WorkloadProducer(seed=7, medium="CPU", num_blocks=96)
    index = new_index()
    encoder, decoder = EventEncoder(), EventDecoder()
    seqs = dict.fromkeys(producers, 0)
    duplicates_seen = False
    for step in range(600):
        for name, producer in producers.items():
            batch = EventBatch(float(step), producer.step())
            if wire:
                decoded = decoder.decode(encoder.encode(batch))
                assert decoded.skipped == 0
                batch = decoded.batch
            index.apply_batch(name, seqs[name], batch)
            seqs[name] += 1
        if step % 50 == 0:
            index.check_invariants()
            duplicates_seen |= any(n > 1 for p in producers.values() for n in p.cached().values())
    index.check_invariants()
    for name, producer in producers.items():
        medium = "CPU" if name == "tier-a" else "GPU"
        assert held(index, name, medium) == producer.cached(), name
    assert duplicates_seen, "the workload should exercise duplicate stores"
    # Lookups agree with the pools: every replica's prefix, block by block from its best medium.
    tier = producers["tier-a"].cached()
    for request in producers["w0"].all_requests[-20:]:
        query = [to_external(h) for h in request.block_hashes]
        got = index.lookup(query)
        for r in range(3):
            mine = producers[f"w{r}"].cached()
            gpu = cpu = 0
            for h in query:
                if h in mine:
                    gpu += 1
                elif h in tier:
                    cpu += 1
                else:
                    break
            assert got.get(f"r{r}", MediumCounts(0, 0, 0)) == MediumCounts(gpu, cpu, 0)


def test_foreign_producer_is_rekeyed_from_token_ids() -> None:
    """A producer hashing with another seed (a vLLM fleet): its blocks are found under OUR hashes."""
    ours = BlockHasher.from_config(CACHE)
    foreign = WorkloadProducer(seed=3, hash_seed="vllm-none-hash", lora_names=(None, "adapter-a"))
    index = PrefixIndex(CACHE)
    index.add_producer("vllm-0", "gpu", ["v0"], rekey=True)
    encoder, decoder = EventEncoder(), EventDecoder()
    for step in range(800):
        batch = decoder.decode(encoder.encode(EventBatch(float(step), foreign.step()))).batch
        index.apply_batch("vllm-0", step, batch)
    index.check_invariants()
    expected = foreign.cached_rekeyed(ours)
    assert expected and held(index, "vllm-0") == expected
    assert not set(expected) & set(foreign.cached()), "the seeds should give different hashes"
    stats = index.stats().per_producer["vllm-0"]
    assert stats.rejected_events == 0 and stats.parked_blocks == 0
    # Lookups with our own hashes of a prompt find the foreign replica's blocks.
    request = next(r for r in reversed(foreign.all_requests) if r.lora_name is None and len(r.block_hashes) >= 2)
    foreign_cached = foreign.cached()
    prefix = 0
    for h in request.block_hashes:
        if to_external(h) not in foreign_cached:
            break
        prefix += 1
    query = [to_external(h) for h in ours.hash_blocks(request.token_ids)]
    assert index.lookup(query).get("v0", MediumCounts(0, 0, 0)) == MediumCounts(prefix, 0, 0)


def test_foreign_snapshot_child_before_parent_is_parked_then_resolved() -> None:
    theirs = BlockHasher("sha256_cbor", "vllm-none-hash", BLOCK_SIZE)
    ours = BlockHasher.from_config(CACHE)
    tokens = list(range(3 * BLOCK_SIZE))
    f = [to_external(h) for h in theirs.hash_blocks(tokens)]
    o = [to_external(h) for h in ours.hash_blocks(tokens)]
    index = PrefixIndex(CACHE)
    index.add_producer("vllm-0", "gpu", ["v0"], rekey=True)

    def one(i: int) -> dict[str, object]:
        return {
            "type": "BlockStored",
            "block_hashes": [f[i]],
            "parent_block_hash": f[i - 1] if i else None,
            "token_ids": tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE],
            "block_size": BLOCK_SIZE,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }

    decoder = EventDecoder()
    # Block 2 arrives first, then is removed while parked, then stored again; its parents follow.
    batch = [one(2), {"type": "BlockRemoved", "block_hashes": [f[2]], "medium": "GPU"}, one(2), one(1)]
    index.apply_batch("vllm-0", 0, decoder.decode(msgspec.msgpack.encode([0.0, batch, None])).batch)
    assert index.stats().per_producer["vllm-0"].parked_blocks == 3 and len(index) == 0
    index.apply_batch("vllm-0", 1, decoder.decode(msgspec.msgpack.encode([0.0, [one(0)], None])).batch)
    index.check_invariants()
    assert held(index, "vllm-0") == Counter({o[0]: 1, o[1]: 1, o[2]: 1})
    assert index.stats().per_producer["vllm-0"].parked_blocks == 0
    assert index.lookup(o) == {"v0": MediumCounts(3, 0, 0)}


@pytest.mark.parametrize("form", ["map", "array"])
def test_hand_built_vllm_streams_in_map_and_legacy_array_forms(form: str) -> None:
    """vLLM's wire format as vLLM writes it: events as tagged maps, or the older positional arrays."""
    hasher = BlockHasher.from_config(CACHE)
    tokens = list(range(100, 100 + 4 * BLOCK_SIZE))
    h = [to_external(d) for d in hasher.hash_blocks(tokens)]
    big = (1 << 64) - 5  # hashes are unsigned 64-bit and may exceed 2**63
    if form == "map":
        events: list[object] = [
            {
                "type": "BlockStored",
                "block_hashes": h[:3],
                "parent_block_hash": None,
                "token_ids": tokens[: 3 * BLOCK_SIZE],
                "block_size": BLOCK_SIZE,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
                "an_unknown_field": True,
            },
            {"type": "BlockStored", "block_hashes": [h[3]], "parent_block_hash": h[2],
             "token_ids": tokens[3 * BLOCK_SIZE :], "block_size": BLOCK_SIZE},
            {"type": "BlockStored", "block_hashes": [big], "parent_block_hash": None,
             "token_ids": [0] * BLOCK_SIZE, "block_size": BLOCK_SIZE, "medium": "CPU"},
            {"type": "BlockRemoved", "block_hashes": [h[3]], "medium": "GPU"},
            {"type": "SomethingNew", "x": 1},
        ]  # fmt: skip
    else:
        events = [
            ["BlockStored", h[:3], None, tokens[: 3 * BLOCK_SIZE], BLOCK_SIZE, None, "GPU"],
            ["BlockStored", [h[3]], h[2], tokens[3 * BLOCK_SIZE :], BLOCK_SIZE],
            ["BlockStored", [big], None, [0] * BLOCK_SIZE, BLOCK_SIZE, None, "CPU"],
            ["BlockRemoved", [h[3]], "GPU"],
            ["SomethingNew", 1],
        ]
    payload = msgspec.msgpack.encode([1.5, events, None])
    decoded = EventDecoder().decode(payload)
    assert decoded.skipped == 1
    index = PrefixIndex(CACHE)
    index.add_producer("vllm-0", "gpu", ["v0"])
    index.apply_batch("vllm-0", 0, decoded.batch)
    index.check_invariants()
    assert index.dump() == {"vllm-0": {"GPU": Counter(h[:3]), "CPU": Counter({big: 1})}}
    assert index.lookup(h) == {"v0": MediumCounts(3, 0, 0)}
    assert index.lookup([big]) == {"v0": MediumCounts(0, 1, 0)}
    assert len(index) == 4  # h[3] is gone: its removal left no trace


def test_a_foreign_store_whose_extra_keys_cannot_be_hashed_is_rejected_not_raised() -> None:
    """msgpack lets an event carry keys no hash can take (an Ext); rekeying it counts it rejected and goes on."""
    theirs = BlockHasher("sha256_cbor", "vllm-none-hash", BLOCK_SIZE)
    ours = BlockHasher.from_config(CACHE)
    tokens = list(range(2 * BLOCK_SIZE))
    f = [to_external(h) for h in theirs.hash_blocks(tokens)]
    index = PrefixIndex(CACHE)
    index.add_producer("vllm-0", "gpu", ["v0"], rekey=True)
    stored = {"type": "BlockStored", "block_hashes": f, "parent_block_hash": None, "token_ids": tokens,
              "block_size": BLOCK_SIZE, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
    poisoned = {**stored, "extra_keys": [[msgspec.msgpack.Ext(5, b"zz")], None]}
    decoder = EventDecoder()
    index.apply_batch("vllm-0", 0, decoder.decode(msgspec.msgpack.encode([0.0, [poisoned], None])).batch)
    assert index.stats().per_producer["vllm-0"].rejected_events == 1 and len(index) == 0
    index.apply_batch("vllm-0", 1, decoder.decode(msgspec.msgpack.encode([0.0, [stored], None])).batch)
    index.check_invariants()
    assert index.lookup([to_external(h) for h in ours.hash_blocks(tokens)]) == {"v0": MediumCounts(2, 0, 0)}
