"""The Mooncake trace reader: every field typed and in range, bounded reading, one clear error per bad line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvstore.benchmarks.mooncake import DEFAULT_TRACE, MAX_LINE_BYTES, read_trace
from kvstore.benchmarks.pool_bench import record_trace
from kvstore.cli import main
from kvstore.errors import ConfigError

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}
FAST = ["--prefill-tps", "20000", "--decode-tps", "1000", "--policies", "kvstore"]


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hash_ids": [0, 7.2]}, "hash_ids[1] must be an integer in 0..2**63-1, got 7.2"),
        ({"hash_ids": [0, "1"]}, "hash_ids[1] must be an integer"),
        ({"hash_ids": [0, True]}, "hash_ids[1] must be an integer"),
        ({"hash_ids": [0, -1]}, "got -1"),
        ({"hash_ids": [0, 2**63]}, f"got {2**63}"),
        ({"hash_ids": [0, 2**64]}, f"got {2**64}"),
        ({"hash_ids": "78"}, "hash_ids must be a list of integers, got '78'"),
        ({"hash_ids": {"7": 1, "8": 2}}, "hash_ids must be a list"),
        ({"hash_ids": []}, "hash_ids is empty"),
        ({"input_length": "600"}, "input_length must be an integer >= 1, got '600'"),
        ({"input_length": 600.5}, "input_length must be an integer"),
        ({"input_length": True}, "input_length must be an integer"),
        ({"input_length": 0}, "input_length must be an integer >= 1, got 0"),
        ({"input_length": 1e999}, "input_length must be an integer >= 1, got inf"),
        ({"input_length": 10**12}, "input_length 1000000000000 does not match its 2 hash_ids"),
        ({"input_length": 512}, "its 2 hash_ids of 512 tokens (it must be in 513..1024)"),
        ({"output_length": -1}, "output_length must be an integer >= 0, got -1"),
        ({"output_length": 1.5}, "output_length must be an integer"),
        ({"timestamp": "0"}, "timestamp must be a finite number of milliseconds, got '0'"),
        ({"timestamp": False}, "timestamp must be a finite number"),
        ({"timestamp": float("nan")}, "timestamp must be a finite number of milliseconds, got nan"),
        ({"timestamp": float("inf")}, "got inf"),
        ({"timestamp": 10**400}, "timestamp must be a finite number of milliseconds, got 1000000000"),
        ({"input_length": 10**400}, "input_length 1000000000000000000000000000000000000... does not match"),
    ],
)
def test_bad_field_names_file_line_and_field(tmp_path: Path, fields: dict[str, object], message: str) -> None:
    trace = write_lines(tmp_path / "t.jsonl", json.dumps(GOOD), json.dumps({**GOOD, **fields}))
    with pytest.raises(ConfigError) as info:
        read_trace(trace)
    assert str(info.value).startswith(f"{trace}:2: ") and message in str(info.value)


def test_valid_lines_keep_their_values(tmp_path: Path) -> None:
    trace = write_lines(
        tmp_path / "t.jsonl",
        json.dumps({**GOOD, "timestamp": 1.5, "input_length": 513, "output_length": 0}),
        "",
        json.dumps({**GOOD, "timestamp": 1.5, "input_length": 1024, "hash_ids": [0, 2**63 - 1]}),
    )
    first, second = read_trace(trace)
    assert first == (1.5, 513, 0, (0, 1)) and second == (1.5, 1024, 1, (0, 2**63 - 1))


def test_structural_faults_are_one_error(tmp_path: Path) -> None:
    cases = {
        "[1, 2]": "not a Mooncake trace line (a JSON object)",
        '{"timestamp": 0}': "no 'input_length'",
        "[" * 100_000 + "]" * 100_000: "nested too deeply",
        '{"timestamp": 0, "input_length": 1' + "0" * 5000 + "}": "not a Mooncake trace line",
        "{oops": "invalid JSON",
    }
    for line, message in cases.items():
        trace = write_lines(tmp_path / "t.jsonl", json.dumps(GOOD), line)
        with pytest.raises(ConfigError, match=r"t\.jsonl:2: ") as info:
            read_trace(trace)
        assert message in str(info.value)


def test_binary_and_endless_lines_are_refused(tmp_path: Path) -> None:
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\x00garbage\n")
    with pytest.raises(ConfigError, match=r"b\.jsonl:2: not UTF-8 text"):
        read_trace(binary)
    long = tmp_path / "long.jsonl"
    long.write_bytes(json.dumps(GOOD).encode() + b"\n" + b" " * (MAX_LINE_BYTES + 10))
    with pytest.raises(ConfigError, match=rf"long\.jsonl:2: line longer than {MAX_LINE_BYTES} bytes"):
        read_trace(long)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    assert len(read_trace(bom)) == 1


def test_decreasing_timestamps_are_refused(tmp_path: Path) -> None:
    trace = write_lines(tmp_path / "t.jsonl", json.dumps({**GOOD, "timestamp": 5000}), json.dumps(GOOD))
    with pytest.raises(ConfigError, match=r"t\.jsonl:2: timestamp 0 is before the previous line's 5000"):
        read_trace(trace)


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: opening it would block forever
    for path, kind in ((fifo, "not a regular file"), (tmp_path, "a directory"), (Path("/dev/zero"), "not a regular")):
        with pytest.raises(ConfigError, match=f"trace {path} is {kind}"):
            read_trace(path)
    with pytest.raises(ConfigError, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")


def test_the_bundled_trace_reads_whole() -> None:
    requests = read_trace(DEFAULT_TRACE)
    assert len(requests) == 12031
    assert all((len(r.hash_ids) - 1) * 512 < r.input_length <= len(r.hash_ids) * 512 for r in requests)


def test_tools_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_lines(tmp_path / "t.jsonl", json.dumps(GOOD), json.dumps({**GOOD, "hash_ids": [0, 7.9]}))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, message in ((trace, f"{trace}:2: hash_ids[1]"), (fifo, f"trace {fifo} is not a regular file")):
        capsys.readouterr()
        assert main(["simulate", "--trace", str(path), *FAST]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err
        assert main(["bench", "pool", "--trace", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err


def test_pool_bench_reads_the_trace_as_the_other_tools(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It fills only the prompt's blocks (``input_length``), and refuses an empty trace in one line."""
    trace = write_lines(tmp_path / "t.jsonl", json.dumps({**GOOD, "input_length": 520}))
    (request,) = record_trace(trace, 10, 16)
    assert len(request.hashes) == 520 // 16 and len(request.tokens) == 32 * 16
    empty = write_lines(tmp_path / "empty.jsonl", "")
    assert main(["bench", "pool", "--trace", str(empty)]) == 2
    assert capsys.readouterr().err == f"kvstore: error: trace {empty} holds no requests\n"
    assert main(["bench", "pool", "--limit", "20", "--repeat", "1", "--num-blocks", "256"]) == 0
