"""freeze_startup_heap: what a serving process holds at start-up leaves the collector's walks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import gc, json
    from kvstore.deploy import router_cli  # what `kvstore router` imports: torch, FastAPI, prometheus, ...
    from kvstore.heap import freeze_startup_heap

    before = len(gc.get_objects())
    frozen = freeze_startup_heap()
    after = len(gc.get_objects())
    garbage = [[]]
    garbage[0].append(garbage)  # a cycle made after the freeze is still collected
    del garbage
    print(json.dumps({"before": before, "frozen": frozen, "after": after, "collected": gc.collect()}))
    """
)


def test_freezing_moves_the_start_up_objects_out_of_the_collectors_walks() -> None:
    # In a process of its own: frozen objects are never collected, which the test session must not suffer.
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result["before"] > 50_000
    assert result["frozen"] >= result["before"] - 1_000
    assert result["after"] < 1_000  # what a full collection still walks
    assert result["collected"] >= 2
