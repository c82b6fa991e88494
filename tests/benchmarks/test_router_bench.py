"""``kvstore bench router`` at toy sizes writes its JSON, scale section included (no timing is asserted)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from kvstore.benchmarks import router_bench
from kvstore.benchmarks.mooncake import DEFAULT_TRACE
from kvstore.errors import ConfigError
from tests.benchmarks.bench_cli import bench_parser

# 200 requests: enough for a few conversations to have a second turn (those the spread puts on several replicas).
TINY = ["--limit", "200", "--lookup-limit", "200", "--blocks", "100000", "--queries", "30", "--repeat", "1"]
TINY += ["--no-dynamo"]


def build_parser() -> argparse.ArgumentParser:
    return bench_parser(router_bench)


def run_bench(argv: list[str]) -> int:
    args = build_parser().parse_args(["bench", "router", *argv])
    return int(args.func(args))


def test_router_bench_reports_scale_memory_and_lookups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "router.json"
    assert run_bench([*TINY, "--replicas", "2,4", "--no-e2e", "--scale-replicas", "32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    # The existing keys are still there.
    assert set(report["per_replicas"]) == {"2", "4"}
    assert {"ingest_blocks_per_s", "lookup_p50_us", "lookup_p99_us", "e2e_blocks_per_s", "dynamo"} <= set(report)
    assert report["e2e_blocks_per_s"] is None and report["e2e_skipped"] is None  # --no-e2e
    for run in report["per_replicas"].values():
        assert {"index_nodes", "index_entries", "lookup_p99_us", "lookup_worst_case_p99_us"} <= set(run)
    scale = report["scale"]
    assert scale["replicas"] == 32 and scale["spread"] == 4 and scale["memory_method"] == "tracemalloc"
    per_entry, per_block = scale["index_bytes_per_entry"], scale["index_bytes_per_block"]
    assert isinstance(per_entry, float) and math.isfinite(per_entry) and per_entry > 0
    assert isinstance(per_block, float) and math.isfinite(per_block) and per_block >= per_entry
    assert per_block == pytest.approx(scale["index_bytes"] / scale["blocks"])
    assert per_entry == pytest.approx(scale["index_bytes"] / scale["entries"])
    assert 40 < per_block < 5000  # a node costs a dict slot, a tuple and a hash int: tens to hundreds of bytes
    assert scale["entries"] > scale["blocks"] > 0
    assert scale["blocks_held_by_several"] > 32  # more than the shared system prompt: the spread worked
    assert 0 < scale["lookup_p50_us"] <= scale["lookup_p99_us"]
    assert scale["lookup_worst_case_p99_us"] > 0 and scale["dynamo"] is None
    text = capsys.readouterr().out
    assert "scale, 32 replicas" in text and "B per entry" in text and "lookup p50 / p99" in text


def test_router_bench_scale_can_be_skipped_and_e2e_is_skipped_past_the_socket_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(router_bench, "E2E_MAX_REPLICAS", 1)
    out = tmp_path / "router.json"
    assert run_bench([*TINY, "--replicas", "2", "--scale-replicas", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["scale"] is None
    assert report["e2e_blocks_per_s"] is None and "ZeroMQ" in report["e2e_skipped"]
    assert "end to end: not measured" in capsys.readouterr().out


def test_spread_rotates_a_conversations_turns_over_its_group() -> None:
    pinned = router_bench.record(str(DEFAULT_TRACE), 200, 64, 64 * 200, 64)
    spread = router_bench.record(str(DEFAULT_TRACE), 200, 64, 64 * 200, 64, spread=4)
    pinned_holders = router_bench.holders_per_block(pinned)
    spread_holders = router_bench.holders_per_block(spread)
    system_prompt = 512 // 64  # trace block 0, in every prompt: the only blocks a pinned conversation shares
    assert sum(n for held, n in pinned_holders.items() if held > 1) == system_prompt
    assert sum(n for held, n in spread_holders.items() if held > 1) > system_prompt
    counts = sorted(spread_holders)  # the system prompt is on every replica that served; the rest on <= 4
    assert counts[-1] > 4 and all(held <= 4 for held in counts[:-1])


def test_scale_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="scale"):
        run_bench([*TINY, "--replicas", "2", "--scale-spread", "0"])
    with pytest.raises(ConfigError, match="scale"):
        run_bench([*TINY, "--replicas", "2", "--scale-replicas", "-1"])


def test_router_bench_refuses_traces_and_flags_it_cannot_measure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty trace, one whose prompts are all shorter than a lookup, a bad --replicas: one line, exit 2."""
    short = tmp_path / "short.jsonl"
    short.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 700, "output_length": 1, "hash_ids": [0, i + 1]}) + "\n"
            for i in range(5)
        )
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = [
        (["--trace", str(short)], f"no prompt of the 5 requests of {short} fills 32 blocks"),
        (["--trace", str(empty)], f"trace {empty} holds no requests"),
        (["--replicas", "abc"], "--replicas must list positive counts, e.g. 8,64; got 'abc'"),
    ]
    for argv, message in cases:
        with pytest.raises(ConfigError) as info:
            run_bench([*TINY, "--no-e2e", "--scale-replicas", "0", *argv])
        assert message in str(info.value)
    # a smaller lookup block size makes the same short prompts long enough
    assert (
        run_bench([*TINY, "--no-e2e", "--scale-replicas", "0", "--trace", str(short), "--lookup-block-size", "16"]) == 0
    )
    assert "lookup" in capsys.readouterr().out
