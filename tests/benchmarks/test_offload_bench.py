"""``kvstore bench offload`` runs end to end at toy sizes and writes its JSON and plot (no timing is asserted)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvstore.benchmarks import offload_bench
from kvstore.errors import ConfigError
from tests.benchmarks.bench_cli import bench_parser
from tests.checkpoints import TinyCheckpoint


def build_parser() -> argparse.ArgumentParser:
    return bench_parser(offload_bench)


def test_offload_bench_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out, plot = tmp_path / "offload.json", tmp_path / "offload.png"
    args = build_parser().parse_args(
        [
            "bench",
            "offload",
            "--shapes",
            "tiny",
            "--disk-shapes",
            "tiny",
            "--total-mib",
            "2",
            "--disk-total-mib",
            "1",
            "--repeat",
            "2",  # both disk orders: ours first, then the baseline first
            "--settle-s",
            "0.1",
            "--disk-dir",
            str(tmp_path / "disk"),
            "--json",
            str(out),
            "--plot",
            str(plot),
            "--ttft-lengths",
            "256",
            "--no-progress",
        ]
    )
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert set(report) >= {"cpu", "disk", "ttft"}
    (row,) = report["ttft"]
    assert row["prompt_tokens"] == 256
    assert all(row[k] > 0 for k in ("recompute_ms", "gpu_hit_ms", "cpu_hit_ms", "disk_hit_ms"))
    assert isinstance(report["cpu"]["spill_ratio"], float) and isinstance(report["cpu"]["promote_ratio"], float)
    assert isinstance(report["disk"]["write_ratio"], float) and isinstance(report["disk"]["read_ratio"], float)
    assert report["cpu"]["rows"][0]["shape"] == "tiny" and report["disk"]["rows"][0]["blocks"] == 64
    disk_row = report["disk"]["rows"][0]
    assert len(disk_row["write_ratio_runs"]) == len(disk_row["read_ratio_runs"]) == 2
    assert plot.stat().st_size > 0
    assert list((tmp_path / "disk").iterdir()) == []  # its files are cleaned up
    text = capsys.readouterr().out
    assert "spill/memcpy" in text and "I/O mode:" in text and "recompute/CPU" in text


def test_breakdown_parts_add_up_within_each_direction(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--breakdown times the tier calls and copies of the measured runs; they happen inside the timed
    spills and promotions, so each direction's parts sum to at most its total (the rest is the link's own
    Python), and without the flag no part is timed."""
    out = tmp_path / "offload.json"
    common = "bench offload --shapes tiny --total-mib 2 --disk-total-mib 0 --repeat 2 --ttft-lengths= --no-progress"
    args = build_parser().parse_args([*common.split(), "--breakdown", "--json", str(out), "--disk-dir", str(tmp_path)])
    assert args.func(args) == 0
    (row,) = json.loads(out.read_text())["cpu"]["rows"]
    parts = row["breakdown_us"]
    assert set(parts) == {
        *("reserve", "spill", "commit_later", "spill_total"),
        *("acquire", "promote", "release_later", "promote_total"),
        "memcpy",
    }
    assert all(parts[name] > 0 for name in parts)
    assert parts["reserve"] + parts["spill"] + parts["commit_later"] <= parts["spill_total"]
    assert parts["acquire"] + parts["promote"] + parts["release_later"] <= parts["promote_total"]
    assert "Where a block's time goes" in capsys.readouterr().out
    plain = build_parser().parse_args([*common.split(), "--json", str(out), "--disk-dir", str(tmp_path)])
    assert plain.func(plain) == 0
    assert json.loads(out.read_text())["cpu"]["rows"][0]["breakdown_us"] == {}


def test_floor_rows_take_the_tiers_books_away_and_still_move_every_byte(tmp_path: Path) -> None:
    """--floor adds a row per CPU shape measured through a stand-in tier that only checks metas and hands out
    slots in order: the same link and copies, so its promotions must bring back the spilled bytes (the bench
    checks them)."""
    out = tmp_path / "offload.json"
    argv = "bench offload --shapes tiny --total-mib 2 --disk-total-mib 0 --repeat 2 --ttft-lengths= --no-progress"
    args = build_parser().parse_args(
        [
            *argv.split(),
            "--batch-blocks",
            "48",
            "--floor",
            "--breakdown",
            "--json",
            str(out),
            "--disk-dir",
            str(tmp_path),
        ]
    )
    assert args.func(args) == 0
    real, floor = json.loads(out.read_text())["cpu"]["rows"]
    assert (real["shape"], floor["shape"]) == ("tiny", "tiny floor") and real["blocks"] == floor["blocks"] == 128
    assert floor["spill_ratio"] > 0 and floor["promote_ratio"] > 0
    assert set(floor["breakdown_us"]) == set(real["breakdown_us"])  # timed the same way (no timing is asserted)


@pytest.mark.ray
def test_ray_rows_go_through_a_tier_actor_and_leave_nothing_behind(ray_session: Any, tmp_path: Path) -> None:
    """--ray measures each CPU shape again through a TierActor (a process of its own, reached by RayTierClient,
    its calls packed): the promotions must bring back the spilled bytes, and the actor is gone afterwards,
    its arena unlinked; the Ray cluster this process was connected to is left running."""
    out = tmp_path / "offload.json"
    argv = "bench offload --shapes tiny --total-mib 2 --disk-total-mib 0 --repeat 2 --ttft-lengths= --no-progress"
    shm_before = set(os.listdir("/dev/shm"))
    args = build_parser().parse_args([*argv.split(), "--ray", "--json", str(out), "--disk-dir", str(tmp_path)])
    assert args.func(args) == 0
    local, through_ray = json.loads(out.read_text())["cpu"]["rows"]
    assert (local["shape"], through_ray["shape"]) == ("tiny", "tiny ray") and through_ray["blocks"] == 128
    assert through_ray["spill_ratio"] > 0 and through_ray["promote_ratio"] > 0
    assert ray_session.is_initialized()  # not this benchmark's to stop
    assert set(os.listdir("/dev/shm")) <= shm_before  # the actor's arena and the scratch buffers are unlinked


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--shapes", "gpt-5", "unknown shape"),
        ("--repeat", "0", "--repeat"),
        ("--total-mib", "-1", "--total-mib"),
        ("--ttft-lengths", "1k", "--ttft-lengths"),
        ("--settle-s", "-1", "--settle-s"),
        ("--copy-threads", "0", "--copy-threads"),
        ("--copy-threads", "66", r"--copy-threads must be <= 65"),
        ("--ttft-lengths", "128", "--ttft-lengths"),
    ],
)
def test_offload_bench_rejects_bad_flags(tmp_path: Path, flag: str, value: str, message: str) -> None:
    args = build_parser().parse_args(["bench", "offload", flag, value, "--disk-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=message):
        args.func(args)


def test_a_model_that_cannot_load_is_refused_before_anything_runs(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    args = build_parser().parse_args(["bench", "offload", "--model", "/nonexistent/model", "--disk-dir", str(disk)])
    with pytest.raises(ConfigError, match=r"worker\.model '/nonexistent/model' is not a directory"):
        args.func(args)
    assert not disk.exists()  # refused before the bench made its disk directory, let alone measured


def test_plot_names_every_series_and_needs_no_ttft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TTFT rows the plot has the two bar panels (it once failed: a log axis with no data); every
    series' legend entry says what was measured and what the baseline is."""
    pytest.importorskip("matplotlib")
    bench = offload_bench
    legends: list[list[str]] = []
    real_save = bench.save_figure

    def keep_legends(fig: Any, path: str | Path, *, dpi: int) -> None:
        legends.extend([text.get_text() for text in axis.get_legend().get_texts()] for axis in fig.axes)
        real_save(fig, path, dpi=dpi)

    monkeypatch.setattr(bench, "save_figure", keep_legends)
    plot = tmp_path / "offload.png"
    flags = "--shapes tiny --disk-shapes tiny --total-mib 1 --disk-total-mib 1 --repeat 1 --settle-s 0 --disk-fresh"
    args = build_parser().parse_args(
        [
            "bench",
            "offload",
            *flags.split(),
            "--no-progress",
            "--disk-dir",
            str(tmp_path),
            "--plot",
            str(plot),
            "--ttft-lengths",
            "",
        ]
    )
    assert args.func(args) == 0 and plot.stat().st_size > 0
    cpu, disk = legends
    assert any(label.startswith("spill: TierLink.spill") for label in cpu)
    assert any(label.startswith("baseline: one memcpy") for label in cpu)
    assert any(label.startswith("write: DiskTier.write_many") for label in disk)
    assert any(label.startswith("baseline: one sequential file") for label in disk)


def test_ttft_by_tier_runs_on_the_model_the_flags_name(
    llama_checkpoint: TinyCheckpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--model PATH`` puts a checkpoint (its own geometry and block bytes) under the TTFT-by-tier rows."""
    out = tmp_path / "offload.json"
    argv = ["bench", "offload", "--total-mib", "0", "--disk-total-mib", "0", "--ttft-lengths", "256",
            "--model", str(llama_checkpoint.path), "--no-progress", "--json", str(out)]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["ttft_model"] == f"worker.model={llama_checkpoint.path}"
    (row,) = report["ttft"]
    assert all(row[k] > 0 for k in ("recompute_ms", "gpu_hit_ms", "cpu_hit_ms", "disk_hit_ms"))
    assert f"TTFT (one worker, worker.model={llama_checkpoint.path}, on the CPU)" in capsys.readouterr().out
