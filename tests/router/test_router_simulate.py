"""``kvstore simulate`` on a slice of the Mooncake conversation trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import main
from router.mooncake import DEFAULT_TRACE, read_trace
from router.sim_replica import WorkQueue
from router.simulate import POLICIES


def test_simulate_slice_json_shape_and_kvstore_beats_round_robin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    code = main(["simulate", "--limit", "800", "--replicas", "8", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 800 and report["replicas"] == 8 and report["hash_mode"] == "tokens"
    assert set(report["policies"]) == set(POLICIES)
    for name, result in report["policies"].items():
        assert 0.0 <= result["hit_rate"] <= 1.0, name
        assert result["max_mean_load"] >= 1.0, name
        assert len(result["work_per_replica"]) == 8
        assert result["prefill_tokens_saved"] + result["prefill_tokens"] == result["prompt_tokens"]
    policies = report["policies"]
    assert policies["kvstore"]["index_mismatches"] == 0, "the index must predict every replica's real cache"
    assert policies["kvstore"]["hit_rate"] > 1.5 * policies["round_robin"]["hit_rate"]
    assert policies["kvstore"]["hit_rate"] <= policies["global_cache"]["hit_rate"] + 1e-9
    assert policies["kvstore"]["max_mean_load"] <= 1.3
    table = capsys.readouterr().out
    assert "kvstore" in table and "global_cache" in table


def test_simulate_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--block-tokens", "100", "--limit", "5"]) == 2
    assert main(["simulate", "--policies", "kvstore,bogus", "--limit", "5"]) == 2
    assert main(["simulate", "--trace", "/nonexistent.jsonl"]) == 2
    assert "error" in capsys.readouterr().err


def test_trace_reader_and_work_queue() -> None:
    requests = read_trace(DEFAULT_TRACE, 3)
    assert len(requests) == 3 and requests[0].hash_ids[:2] == (0, 1) and requests[0].input_length == 6758
    queue = WorkQueue(rate=100.0)
    assert queue.add(100.0, now=0.0) == 0.0  # busy until t=1
    assert queue.add(50.0, now=0.5) == pytest.approx(0.5)  # waits for the first
    assert queue.outstanding(1.0) == pytest.approx(50.0)
    assert queue.in_flight(1.2) == 1 and queue.in_flight(2.0) == 0
    assert queue.total_work == 150.0
