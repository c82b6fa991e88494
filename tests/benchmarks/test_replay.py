"""``kvstore replay``: workload expansion and report math on small inputs (exact numbers), real replays
against two Ray workers behind a real router, ``--compare`` end to end, and the errors a user can make.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from kvstore.benchmarks.mooncake import DEFAULT_TRACE, MooncakeRequest
from kvstore.benchmarks.replay.client import Outcome, RunResult, check_url, make_schedule
from kvstore.benchmarks.replay.report import format_table, max_over_mean, percentile, summarize
from kvstore.benchmarks.replay.workload import (
    ModelShape,
    expand_mooncake,
    hash_id_tokens,
    mooncake_workload,
    scaled_length,
    synthetic_workload,
)
from kvstore.cli import main
from kvstore.deploy.config import config_from_dict
from kvstore.deploy.launcher import build_service, place_workers
from kvstore.errors import ConfigError
from kvstore.router.app import create_app
from tests.http_servers import ServerThread

SHAPE = ModelShape(vocab_size=512, max_context=2048)


def write_trace(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ------------------------------------------------------------------ workloads


def test_hash_id_tokens_are_deterministic_in_vocab_and_distinct_per_id() -> None:
    assert hash_id_tokens(0, 16, 512) == [102, 152, 170, 282, 328, 251, 237, 141, 242, 314, 291, 28, 13, 294, 111, 489]
    assert hash_id_tokens(1, 4, 512) == [415, 299, 492, 159]
    blocks = {tuple(hash_id_tokens(k, 16, 512)) for k in range(5000)}
    assert len(blocks) == 5000  # no two ids share a block: no false prefix hits
    assert all(0 <= t < 100 for t in hash_id_tokens(77, 64, 100))


def test_expand_mooncake_scales_each_hash_id_and_keeps_shared_prefixes() -> None:
    a = MooncakeRequest(0.0, input_length=1100, output_length=100, hash_ids=(5, 6, 7))
    b = MooncakeRequest(0.0, input_length=1536, output_length=100, hash_ids=(5, 6, 9))
    tokens_a = expand_mooncake(a, 16, 512)
    tokens_b = expand_mooncake(b, 16, 512)
    # 1100 trace tokens -> ceil(1100 * 16 / 512) = 35: two whole ids and 3 tokens of the third.
    assert tokens_a == hash_id_tokens(5, 16, 512) + hash_id_tokens(6, 16, 512) + hash_id_tokens(7, 16, 512)[:3]
    assert len(tokens_b) == 48
    assert tokens_a[:32] == tokens_b[:32] and tokens_a[32:35] != tokens_b[32:35]
    assert scaled_length(512, 16) == 16 and scaled_length(1, 16) == 1 and scaled_length(0, 16) == 0
    # A prompt covers at most its hash ids' 512-token blocks, and has at least one token.
    assert len(expand_mooncake(MooncakeRequest(0.0, 5000, 1, (3,)), 8, 512)) == 8
    assert len(expand_mooncake(MooncakeRequest(0.0, 1, 1, (3,)), 8, 512)) == 1


def test_mooncake_workload_timestamps_outputs_and_clipping(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 1000, "input_length": 512, "output_length": 100, "hash_ids": [0]},
            {"timestamp": 1500, "input_length": 1024, "output_length": 0, "hash_ids": [0, 1]},
            {"timestamp": 3000, "input_length": 2048, "output_length": 5000, "hash_ids": [0, 1, 2, 3]},
        ],
    )
    workload = mooncake_workload(trace, limit=None, block_tokens=16, max_tokens=8, shape=ModelShape(512, 40))
    assert [r.arrival_s for r in workload.requests] == [0.0, 0.5, 2.0]
    # Outputs: ceil(100 * 16 / 512) = 4; 0 -> at least 1; ceil(5000 * 16 / 512) = 157 -> capped at 8.
    assert [r.max_tokens for r in workload.requests] == [4, 1, 8]
    # Prompts of 16, 32 and 64 tokens; the last is cut to 40 - 8 = 32, keeping its leading tokens.
    assert [len(r.token_ids) for r in workload.requests] == [16, 32, 32]
    assert workload.requests[2].token_ids == workload.requests[1].token_ids
    assert (workload.clipped, workload.longest_prompt) == (1, 32)
    assert len(mooncake_workload(trace, limit=2, block_tokens=16, max_tokens=8, shape=SHAPE).requests) == 2


def test_synthetic_workload_groups_share_prefixes() -> None:
    kwargs: dict[str, Any] = {"requests": 30, "groups": 3, "prefix_tokens": 32, "suffix_tokens": 8}
    workload = synthetic_workload(**kwargs, max_tokens=4, shape=SHAPE, seed=1)
    assert workload == synthetic_workload(**kwargs, max_tokens=4, shape=SHAPE, seed=1)
    assert all(len(r.token_ids) == 40 and r.max_tokens == 4 and r.arrival_s is None for r in workload.requests)
    assert len({tuple(r.token_ids[:32]) for r in workload.requests}) == 3
    assert len({tuple(r.token_ids[32:]) for r in workload.requests}) == 30
    assert (workload.clipped, workload.longest_prompt) == (0, 40)


# ----------------------------------------------------------------- report math


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert max_over_mean([3, 1]) == 1.5 and max_over_mean([2, 2]) == 1.0
    assert max_over_mean([0, 0]) is None and max_over_mean([]) is None


def test_summarize_counts_cache_by_medium_load_per_replica_and_errors() -> None:
    none = {"GPU": 0, "CPU": 0, "STORAGE": 0}
    outcomes = [
        Outcome("200", 100, 10, {"GPU": 64, "CPU": 16, "STORAGE": 0}, "a", 0.010, 0.100, 0.0),
        Outcome("200", 50, 5, none, "a", 0.020, 0.200, 0.1),
        Outcome("200", 50, 5, {**none, "GPU": 32}, "b", 0.030, 0.300, 0.2),
        Outcome("503", 40, 0, {}, None, None, 0.050, 0.3),
        Outcome("ConnectError", 40, 0, {}, None, None, 0.010, 0.4),
    ]
    report = summarize(RunResult(outcomes, 2.0, ["a", "b", "c"]), "x")
    assert (report.requests, report.succeeded) == (5, 3)
    assert report.errors == {"503": 1, "ConnectError": 1}
    assert (report.prompt_tokens, report.output_tokens) == (200, 20)
    assert (report.requests_per_s, report.tokens_per_s) == (1.5, 110.0)
    assert report.cached_tokens == {"GPU": 96, "CPU": 16, "STORAGE": 0}
    assert (report.prefill_tokens_saved, report.prefill_tokens_computed) == (112, 88)
    assert report.cached_fraction == 0.56
    assert report.cached_fraction_by_medium() == {"GPU": 0.48, "CPU": 0.08, "STORAGE": 0.0}
    assert report.ttft_s.p50 == pytest.approx(0.020)
    assert report.ttft_s.p90 == pytest.approx(0.028)
    assert report.ttft_s.p99 == pytest.approx(0.0298)
    assert report.latency_s.p50 == pytest.approx(0.200)
    assert report.replica_requests == {"a": 2, "b": 1, "c": 0}  # the idle replica counts in the mean
    assert report.max_mean_requests == 2.0
    # Work = prefill computed + output: a = (100 - 80 + 10) + (50 + 5) = 85, b = 50 - 32 + 5 = 23, c = 0.
    assert report.replica_work == {"a": 85, "b": 23, "c": 0}
    assert report.max_mean_work == pytest.approx(85 / 36)
    table = format_table({"x": report, "y": report})
    assert "cached fraction" in table and "0.560" in table and "503:1 ConnectError:1" in table
    assert table.splitlines()[0].split() == ["x", "y"]
    data = report.as_json()
    assert data["ttft_ms_sorted"] == [10.0, 20.0, 30.0] and data["max_mean_requests"] == 2.0


# --------------------------------------------------------------------- errors


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["replay", "--no-progress", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "pass --url URL of a running router, or --compare"),
        (["--url", "http://127.0.0.1:1", "--compare"], "pass --url URL of a running router, or --compare"),
        (["--url", "ftp://127.0.0.1:1"], "--url must be http://HOST:PORT"),
        (["--url", "http://127.0.0.1:1", "--format", "csv"], "--format must be one of mooncake, synthetic"),
        (["--url", "http://127.0.0.1:1", "--trace", "/nonexistent.jsonl"], "trace /nonexistent.jsonl: No such"),
        (["--url", "http://127.0.0.1:1", "--limit", "0"], "--limit must be >= 1"),
        (["--url", "http://127.0.0.1:1", "--block-tokens", "0", "--limit", "1"], "--block-tokens must be in 1..512"),
        (["--url", "http://127.0.0.1:1", "--limit", "1", "--max-tokens", "2048"], "leaves no room for a prompt"),
        (["--url", "http://127.0.0.1:1", "--limit", "1", "--rate", "1", "--concurrency", "2"], "are exclusive"),
        (["--url", "http://127.0.0.1:1", "--limit", "1", "--rate", "1", "--speedup", "2"], "--speedup compresses"),
        (["--url", "http://127.0.0.1:1", "--limit", "1", "--rate", "0"], "--rate must be > 0"),
        (["--url", "http://127.0.0.1:1", "--limit", "1", "--speedup", "-1"], "--speedup must be > 0"),
        (["--url", "http://127.0.0.1:1", "--format", "synthetic"], "has no timestamps: pass --rate R or --concurrency"),
        (["--url", "http://127.0.0.1:1", "--format", "synthetic", "--trace", "x"], "drop --trace"),
        (["--url", "http://127.0.0.1:1", "--workers", "2"], "configure --compare's in-process service"),
        (["--compare", "--limit", "1", "--workers", "0"], "--workers must be >= 1"),
        (["--compare"], "pass --limit N"),
        (["--compare", "--set", "pool.num_blocks=-1", "--limit", "1"], "pool.num_blocks"),
        (["--url", "http://127.0.0.1:1", "--limit", "1", "--json", "/nonexistent/dir/r.json"], "cannot write --json"),
    ],
)
def test_bad_flags_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(argv, capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore: error: ") and message in lines[0], err


def test_unreachable_router_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = run_cli(["--url", url, "--limit", "1"], capsys)
    assert code == 2
    assert err.strip() == err.strip().splitlines()[0]
    assert f"cannot reach the router at {url}" in err


def test_malformed_trace_line_names_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = {"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]}
    trace = tmp_path / "bad.jsonl"
    trace.write_text(json.dumps(good) + "\n\n" + '{"timestamp": 5, "input_length": 3}\n')
    code, _, err = run_cli(["--url", "http://127.0.0.1:1", "--trace", str(trace)], capsys)
    assert code == 2
    assert f"{trace}:3: not a Mooncake trace line" in err and len(err.strip().splitlines()) == 1
    trace.write_text(json.dumps(good) + "\n" + json.dumps({**good, "hash_ids": []}) + "\n")
    code, _, err = run_cli(["--url", "http://127.0.0.1:1", "--trace", str(trace)], capsys)
    assert code == 2 and f"{trace}:2: hash_ids is empty" in err
    for path in (tmp_path, tmp_path / "missing.jsonl"):
        code, _, err = run_cli(["--url", "http://127.0.0.1:1", "--trace", str(path)], capsys)
        assert code == 2 and ("is a directory" if path == tmp_path else "No such file") in err


def test_the_url_is_checked_before_the_trace_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text("not json\n")
    code, _, err = run_cli(["--url", "ftp://127.0.0.1:1", "--trace", str(trace)], capsys)
    assert code == 2 and "--url must be http://HOST:PORT" in err


def test_schedule_and_url_checks() -> None:
    assert make_schedule(rate=None, concurrency=None, speedup=None, has_timestamps=True) == ("trace", 1.0)
    assert make_schedule(rate=2.5, concurrency=None, speedup=None, has_timestamps=False) == ("rate", 2.5)
    assert make_schedule(rate=None, concurrency=3, speedup=None, has_timestamps=True) == ("concurrency", 3.0)
    assert check_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    with pytest.raises(ConfigError, match="must be http://HOST:PORT"):
        check_url("http://")
    with pytest.raises(ConfigError, match="is not a URL"):
        check_url("http://[::")


# --------------------------------------------------- real replays through a router


@pytest.fixture(scope="module")
def router_url(ray_session: Any) -> Iterator[str]:
    """Two KV workers on the session's Ray, placed as ``kvstore serve`` places them, behind the real router."""
    config = config_from_dict(
        {
            "cache": {"block_size": 16},
            "pool": {"num_blocks": 512},
            "worker": {"device": "cpu", "max_context": 1024},
            "router": {"health_interval_s": 0.2},
        }
    )
    workers = place_workers(config, 2, start_index=200)
    server = ServerThread(create_app(build_service(config, workers))).start()
    try:
        yield server.url
    finally:
        server.stop()
        for worker in workers:
            ray.kill(worker.handle, no_restart=True)


@pytest.mark.ray
def test_replay_synthetic_shared_prefixes_hit_the_cache(
    router_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["--url", router_url, "--format", "synthetic", "--limit", "40", "--groups", "4", "--prefix-tokens", "128",
            "--suffix-tokens", "16", "--max-tokens", "4", "--concurrency", "4", "--json", str(out_json),
            "--plot", str(out_png)]  # fmt: skip
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "40 requests of synthetic:4x128+16; 4 concurrent clients; 2 replicas at" in out
    data = json.loads(out_json.read_text())
    assert set(data) == {"mode", "url", "workers", "workload", "schedule", "model", "config_overrides", "runs"}
    assert data["schedule"] == {"mode": "concurrency", "value": 4.0}
    run = data["runs"]["replay"]
    assert (run["requests"], run["succeeded"], run["errors"]) == (40, 40, {})
    assert run["prompt_tokens"] == 40 * 144 and run["output_tokens"] == 40 * 4
    assert run["cached_fraction"] > 0
    # The router's blocks are 16 tokens and a hit recomputes at least the last token: at most 128 of 144 per request.
    assert run["prefill_tokens_saved"] <= 36 * 128
    assert set(run["cached_fraction_by_medium"]) == {"GPU", "CPU", "STORAGE"}
    assert set(run["ttft_s"]) == {"p50", "p90", "p99"} and run["ttft_s"]["p50"] > 0
    assert sorted(run["replica_requests"]) == ["worker-200", "worker-201"]
    assert sum(run["replica_requests"].values()) == 40 and run["max_mean_requests"] >= 1.0
    assert len(run["ttft_ms_sorted"]) == 40 and run["ttft_ms_sorted"] == sorted(run["ttft_ms_sorted"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.ray
def test_replay_ends_quietly_when_stdout_is_closed(router_url: str) -> None:
    """``kvstore replay ... | head -1``: exit 0, nothing on stderr (it was a BrokenPipeError traceback)."""
    argv = ["--url", router_url, "--format", "synthetic", "--limit", "4", "--max-tokens", "2", "--concurrency", "2",
            "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "replay", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the first line
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (0, "")


@pytest.mark.ray
def test_replay_mooncake_slice_on_trace_timestamps(
    router_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = mooncake_workload(DEFAULT_TRACE, limit=16, block_tokens=16, max_tokens=8, shape=ModelShape(512, 1024))
    assert expected.clipped > 0  # the slice has prompts longer than the 1,024-token context
    out_json = tmp_path / "m.json"
    argv = ["--url", router_url, "--limit", "16", "--max-tokens", "8", "--max-context", "1024", "--speedup", "20",
            "--json", str(out_json)]  # fmt: skip
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert f"{expected.clipped} prompts clipped to fit the 1024-token context" in out
    data = json.loads(out_json.read_text())
    assert data["workload"]["clipped"] == expected.clipped
    assert data["schedule"] == {"mode": "trace", "value": 20.0}
    run = data["runs"]["replay"]
    assert (run["succeeded"], run["errors"]) == (16, {})
    assert run["prompt_tokens"] == sum(len(r.token_ids) for r in expected.requests)
    assert run["output_tokens"] == sum(r.max_tokens for r in expected.requests)
    # Every prompt of the trace starts with hash id 0: later ones can find it cached.
    assert 0 <= run["cached_fraction"] < 1


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_compare_runs_three_deployments_in_process(
    ray_session: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "c.json"
    argv = ["--compare", "--format", "synthetic", "--limit", "24", "--groups", "3", "--prefix-tokens", "96",
            "--suffix-tokens", "16", "--max-tokens", "2", "--concurrency", "3", "--set", "pool.num_blocks=256",
            "--json", str(out_json)]  # fmt: skip
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    header = out.splitlines()[1].split()
    assert header == ["kvstore", "round_robin", "no_cache"]
    data = json.loads(out_json.read_text())
    runs = data["runs"]
    assert list(runs) == ["kvstore", "round_robin", "no_cache"]
    assert all(r["succeeded"] == 24 and r["errors"] == {} for r in runs.values())
    assert data["config_overrides"]["round_robin"][-1] == "router.policy=round_robin"
    assert runs["kvstore"]["cached_fraction"] > 0
    assert runs["no_cache"]["cached_fraction"] == 0 and runs["no_cache"]["prefill_tokens_saved"] == 0
    assert runs["round_robin"]["replica_requests"] == {"worker-0": 12, "worker-1": 12}
    assert ray.is_initialized()  # the session's Ray was reused and left up
