"""Every benchmark command checks its output files before any work, and ends quietly when stdout's reader leaves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.benchmarks.outputs import check_output, check_plot
from kvstore.cli import BENCHMARKS, main
from kvstore.errors import ConfigError

FAST = ["--prefill-tps", "20000", "--decode-tps", "1000"]
# Each command with a flag that would fail later, or work that would take long: the output check comes first.
COMMANDS = [
    ["simulate", "--trace", "/nonexistent.jsonl", *FAST],
    ["replay", "--url", "http://127.0.0.1:1", "--trace", "/nonexistent.jsonl"],
    *(["bench", name] for name in BENCHMARKS),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_an_unwritable_json_path_is_refused_before_any_work(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "missing-dir" / "r.json"
    assert main([*command, "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert err == f"kvstore: error: cannot write --json {target}: No such file or directory\n"


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if c[0] != "bench" or c[1] == "offload"], ids=lambda c: " ".join(c[:2])
)
def test_a_plot_type_matplotlib_cannot_write_is_refused_before_any_work(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    assert main([*command, "--plot", str(tmp_path / "out.xyz")]) == 2
    assert "matplotlib cannot write .xyz files; use one of" in capsys.readouterr().err
    assert not (tmp_path / "out.xyz").exists()


def test_check_output_leaves_the_file_system_as_it_was(tmp_path: Path) -> None:
    check_output("--json", tmp_path / "new.json")
    assert list(tmp_path.iterdir()) == []
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    check_output("--json", kept)
    assert kept.read_text() == "old"
    with pytest.raises(ConfigError, match=f"--json {tmp_path} is a directory"):
        check_output("--json", tmp_path)
    with pytest.raises(ConfigError, match="Not a directory"):
        check_output("--json", kept / "r.json")
    pytest.importorskip("matplotlib")
    check_plot(tmp_path / "figure.svg")
    check_plot(tmp_path / "figure")  # no suffix: matplotlib writes its default type


def test_simulate_ends_quietly_when_stdout_is_closed(tmp_path: Path) -> None:
    """``kvstore simulate ... | head -1``: exit 0 and nothing on stderr, as a tool killed by SIGPIPE would end --
    and the ``--json`` it was asked for is written all the same."""
    report = tmp_path / "sim.json"
    argv = ["simulate", "--limit", "30", "--policies", "kvstore", "--json", str(report), *FAST]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the first line
    _, err = proc.communicate(timeout=300)
    assert (proc.returncode, err) == (0, "")
    assert json.loads(report.read_text())["requests"] == 30
