"""``kvstore bench ttft --model`` measures a checkpoint end to end (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.benchmarks import ttft_bench
from kvstore.cli import build_parser
from kvstore.errors import ConfigError
from tests.checkpoints import TinyCheckpoint


def test_ttft_bench_runs_on_a_checkpoint_and_reports_it(
    llama_checkpoint: TinyCheckpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ttft.json"
    argv = ["bench", "ttft", "--model", str(llama_checkpoint.path), "--served-model-name", "tiny-llama",
            "--lengths", "40,80", "--repeats", "1", "--set", "worker.device=cpu", "--json", str(out)]  # fmt: skip
    assert ttft_bench.run(build_parser().parse_args(argv)) == 0
    assert "tiny-llama (LlamaForCausalLM, 2 layers, hidden 64" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["model"]["name"] == "tiny-llama" and report["model"]["spec"]["vocab_size"] == 320
    assert [row["cached_tokens"] for row in report["rows"]] == [16, 64]  # 40 - 16 and 80 - 16, block-aligned
    too_long = build_parser().parse_args(["bench", "ttft", "--model", str(llama_checkpoint.path), "--lengths", "600"])
    with pytest.raises(ConfigError, match="context"):  # the checkpoint's 512 positions cap worker.max_context
        ttft_bench.run(too_long)
