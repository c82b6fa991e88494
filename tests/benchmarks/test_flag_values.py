"""Nonsense option values (NaN, infinities, negative times, an empty list) are refused in one line, exit 2."""

from __future__ import annotations

import pytest

from kvstore.cli import main

FAST = ["--prefill-tps", "20000", "--decode-tps", "1000"]
REPLAY = ["replay", "--url", "http://127.0.0.1:1", "--limit", "1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "chaos", "--duration", "nan"], "--duration must be at least 3 seconds, got nan"),
        (["bench", "chaos", "--duration", "inf"], "--duration must be at least 3 seconds, got inf"),
        (["bench", "chaos", "--kill-every", "nan"], "--kill-every > 0"),
        (["bench", "chaos", "--loss", "nan"], "--loss in [0, 1)"),
        (["bench", "offload-serving", "--phase-timeout-s", "-1"], "--phase-timeout-s must be a number of seconds > 0"),
        (["bench", "offload-serving", "--phase-timeout-s", "nan"], "got nan"),
        (["bench", "offload-serving", "--batch", "0"], "--batch, --steps, --repeats and --doc-blocks must be >= 1"),
        (["bench", "offload", "--deadline-s", "nan"], "--deadline-s must be a number of seconds > 0, got nan"),
        (["bench", "offload", "--settle-s", "nan"], "--settle-s must be a number of seconds >= 0, got nan"),
        (["bench", "offload", "--settle-s", "inf"], "--settle-s must be a number of seconds >= 0, got inf"),
        (["bench", "overhead", "--ttft-ms", "nan"], "--ttft-ms and --itl-ms must be >= 0"),
        (["bench", "overhead", "--itl-ms", "inf"], "--ttft-ms and --itl-ms must be >= 0"),
        ([*REPLAY, "--speedup", "inf"], "--speedup must be > 0, got inf"),
        ([*REPLAY, "--speedup", "nan"], "--speedup must be > 0, got nan"),
        ([*REPLAY, "--rate", "inf"], "--rate must be > 0 requests/s, got inf"),
        (["simulate", "--policies", ",", *FAST], "--policies must name at least one of"),
        (["simulate", "--limit", "5", "--window-s", "1e-6", *FAST], "--window-s must be at least 0.01 s"),
        (["simulate", "--limit", "5", "--window-s", "nan", *FAST], "--window-s must be at least 0.01 s"),
    ],
)
def test_a_nonsense_value_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstore: error: ") and err.count("\n") == 1 and message in err, err
