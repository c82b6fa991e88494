"""Block hash extra keys as vLLM 0.33 builds them: tagged by source, so that a salt and a LoRA never collide.

vLLM hashes ``(parent or NONE_HASH, tuple(block_tokens), extra_keys)`` with
``sha256_cbor`` (``sha256(cbor2.dumps(x, canonical=True))``), where, in
``generate_block_hash_extra_keys``, ``extra_keys`` is None or the tuple of

- ``("lora", lora_name, lora_path)`` on every block of a LoRA request, then
- ``("cache_salt", salt)`` on the first block only (``start_token_idx == 0``),
  and only for a non-empty salt: an empty salt is no salt.

``fixtures/vllm_block_hashes.json`` was recorded from that construction --
:func:`vllm_block_hashes` below, a transcription of the documented rules
that imports nothing of kvstore; vLLM itself cannot be installed here. It
holds 30 salted sequences (every third also names a LoRA), 6 LoRA-only ones,
an empty salt, and a LoRA named like a salt next to that salt. Our requests
load no adapter and carry no ``lora_path``: our hashes put ``""`` there
(vLLM's ``LoRARequest`` default), so every LoRA case is recorded with it.

Untagged keys (the bare strings kvstore used to hash) also let a base-model
request with ``cache_salt = "X"`` hit the blocks a LoRA named ``"X"``
computed: the last test serves both from a real worker.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import cbor2
from faults_helpers import BLOCK, fault_config, tokens

from kvstore.hashing import BlockHasher
from kvstore.worker_api import GenerateRequest
from kvstore.workers.worker import KVWorker

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_block_hashes.json"


def sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def vllm_block_hashes(case: dict[str, Any]) -> list[str]:
    """The full-block hashes of one case, built as vLLM builds them (see the module docstring)."""
    size, toks = case["block_size"], case["tokens"]
    parent = None
    out = []
    for start in range(0, len(toks) - size + 1, size):
        keys: list[tuple[str, ...]] = []
        if case["lora_name"] is not None:
            keys.append(("lora", case["lora_name"], case["lora_path"]))
        if start == 0 and case["cache_salt"]:
            keys.append(("cache_salt", case["cache_salt"]))
        parent = sha256_cbor((parent or sha256_cbor(case["seed"]), tuple(toks[start : start + size]),
                              tuple(keys) if keys else None))  # fmt: skip
        out.append(parent.hex())
    return out


def cases() -> list[dict[str, Any]]:
    loaded: list[dict[str, Any]] = json.loads(FIXTURE.read_text())["cases"]
    return loaded


def ours(case: dict[str, Any]) -> list[str]:
    hasher = BlockHasher("sha256_cbor", case["seed"], case["block_size"])
    hashes = hasher.hash_blocks(case["tokens"], lora_name=case["lora_name"], cache_salt=case["cache_salt"])
    return [h.hex() for h in hashes]


def test_the_fixture_is_vllms_construction() -> None:
    for case in cases():
        assert vllm_block_hashes(case) == case["block_hashes"]


def test_salted_and_lora_sequences_hash_as_vllm_hashes_them() -> None:
    salted = [c for c in cases() if c["cache_salt"]]
    lora_only = [c for c in cases() if c["lora_name"] is not None and not c["cache_salt"]]
    plain = [c for c in cases() if c["lora_name"] is None and not c["cache_salt"]]
    assert len(salted) == 31 and len(lora_only) == 7 and len(plain) == 2  # 30 + the salt named like a LoRA
    matches = {name: sum(ours(c) == c["block_hashes"] for c in group)
               for name, group in (("salted", salted), ("LoRA", lora_only), ("plain", plain))}  # fmt: skip
    print(f"\nhashes equal to vLLM's: {matches['salted']} of {len(salted)} salted sequences, "
          f"{matches['LoRA']} of {len(lora_only)} LoRA-only, {matches['plain']} of {len(plain)} unsalted")  # fmt: skip
    assert matches == {"salted": len(salted), "LoRA": len(lora_only), "plain": len(plain)}
    # An empty salt is no salt; a LoRA and a salt spelled alike hash apart.
    empty = next(c for c in plain if c["cache_salt"] == "")
    assert ours(empty) == ours({**empty, "cache_salt": None})
    lora_x, salt_x = cases()[-2:]
    assert lora_x["lora_name"] == salt_x["cache_salt"] and lora_x["tokens"] == salt_x["tokens"]
    assert not set(ours(lora_x)) & set(ours(salt_x))


def test_a_lora_and_a_salt_spelled_alike_never_share_kv() -> None:
    worker = KVWorker("w", fault_config())
    try:
        prompt = tokens(random.Random(73), 4 * BLOCK + 1)
        adapter = worker.generate(GenerateRequest(prompt, 2, lora_name="tenant-x"))
        assert adapter.cached_tokens == 0
        # A base-model request whose salt equals the adapter's name: it must not be served the adapter's KV.
        salted = worker.generate(GenerateRequest(prompt, 2, cache_salt="tenant-x"))
        again = worker.generate(GenerateRequest(prompt, 2, cache_salt="tenant-x"))
        print(f"\nLoRA 'tenant-x', then salt 'tenant-x' on the same prompt: {salted.cached_tokens} tokens served "
              f"from the LoRA's blocks")  # fmt: skip
        assert salted.cached_tokens == 0
        assert again.cached_tokens == 4 * BLOCK  # the salted chain caches on its own
    finally:
        worker.shutdown()
