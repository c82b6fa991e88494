"""``kvstore bench overhead`` at toy size writes its JSON: every arm, both prompt kinds (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.benchmarks import router_overhead
from kvstore.cli import build_parser
from kvstore.errors import ConfigError

TINY = ["--streams", "2", "--requests", "2", "--warmup", "1", "--repeats", "3", "--max-tokens", "3",
        "--ttft-ms", "5", "--itl-ms", "1", "--prompt-tokens", "40"]  # fmt: skip


def run_bench(argv: list[str]) -> int:
    args = build_parser().parse_args(["bench", "overhead", *argv])
    return int(args.func(args))


def test_overhead_bench_reports_every_arm_for_ids_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "overhead.json"
    assert run_bench([*TINY, "--prompts", "both", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "overhead" and set(report["runs"]) == {"token_ids", "text"}
    for kind, run in report["runs"].items():
        assert run["settings"]["text"] == (kind == "text") and run["settings"]["warm_index"] is True
        assert set(run["arms"]) == {"direct", "relay", "router"}
        for arm, stats in run["arms"].items():
            assert stats["requests"] == 2 * 2 * 3  # streams x requests x repeats
            assert 0 < stats["ttft_p50_ms"] <= stats["ttft_p90_ms"] <= stats["ttft_p99_ms"]
            assert stats["ttft_p50_ms"] < stats["total_p50_ms"]
            assert (stats["proxy_cpu_ms_per_request"] is None) == (arm == "direct")
        assert [r["order"] for r in run["per_repeat"]] == [
            ["direct", "relay", "router"], ["relay", "router", "direct"], ["router", "direct", "relay"]
        ]  # fmt: skip
        assert run["added_ttft_p50_ms"] == pytest.approx(
            run["arms"]["router"]["ttft_p50_ms"] - run["arms"]["direct"]["ttft_p50_ms"]
        )
        assert run["events_per_stream"] == 3 + 1  # three tokens, then data: [DONE]
        for key in ("added_ttft_p50_ms_median_of_repeats", "added_ttft_p99_ms", "relay_added_ttft_p50_ms"):
            assert isinstance(run[key], float)
    assert report["runs"]["token_ids"]["prompt_token_ids"] == 40
    assert report["runs"]["text"]["prompt_token_ids"] > 40  # 40 words, tokenised by the trained BPE
    text = capsys.readouterr().out
    assert "the router adds" in text and "a bare TCP relay adds" in text


def test_overhead_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="streams"):
        run_bench(["--streams", "0"])
    with pytest.raises(ConfigError, match="itl"):
        run_bench(["--itl-ms", "-1"])


def test_prompts_are_one_per_stream() -> None:
    settings = router_overhead.Settings(3, 1, 0, 2, 0.0, 0.0, 10, False, False)
    prompts = router_overhead._prompts(settings, seed=1)
    assert len(prompts) == 3 and all(len(p) == 10 for p in prompts) and prompts[0] != prompts[1]
