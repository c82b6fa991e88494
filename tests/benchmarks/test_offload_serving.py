"""``kvstore bench offload-serving`` runs end to end at toy sizes and writes its JSON (no timing is asserted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvstore.benchmarks import offload_serving
from kvstore.errors import ConfigError
from tests.benchmarks.bench_cli import bench_parser


def build_parser() -> argparse.ArgumentParser:
    return bench_parser(offload_serving)


def test_offload_serving_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "serving.json"
    argv = ["bench", "offload-serving", "--model", "bench", "--batch", "2", "--steps", "3", "--repeats", "2",
            "--doc-blocks", "2", "--json", str(out)]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert [p["mode"] for p in result["phases"]] == ["quiet", "traffic", "traffic", "quiet"]  # the order alternates
    assert all(p["decode_steps"] >= 3 for p in result["phases"])
    traffic = [p for p in result["phases"] if p["mode"] == "traffic"]
    assert sum(p["loaded_blocks"] for p in traffic) > 0 and sum(p["stored_blocks"] for p in traffic) > 0
    assert result["step_time_ratio"] > 0 and 0 <= result["blocked_share"] < 1
    assert "ratio" in capsys.readouterr().out


def test_offload_serving_refuses_a_zero_batch() -> None:
    args = build_parser().parse_args(["bench", "offload-serving", "--batch", "0"])
    with pytest.raises(ConfigError, match="--batch, --steps, --repeats and --doc-blocks must be >= 1"):
        args.func(args)
