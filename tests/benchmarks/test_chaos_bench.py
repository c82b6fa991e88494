"""The chaos bench reads each answer's routing from the router's headers, which both of its answer paths carry."""

from __future__ import annotations

from kvstore.benchmarks.chaos_bench import _Answer, _phase_row, routing_of


def test_an_answer_is_read_from_the_routing_headers_and_retries_are_counted() -> None:
    relayed = {"x-kvstore-replica": "chaos-1", "x-kvstore-retried": "true", "x-kvstore-route-s": "0.000047"}
    assert routing_of(relayed) == ("chaos-1", True, 0.000047)
    assert routing_of({"x-kvstore-replica": "chaos-0", "x-kvstore-retried": "false"}) == ("chaos-0", False, None)
    assert routing_of({}) == (None, False, None)  # a refused connection: no headers at all
    answers = [
        _Answer("chaos", 0.0, 200, 0.1, *routing_of(relayed)),
        _Answer("chaos", 0.0, 200, 0.2, *routing_of({"x-kvstore-replica": "chaos-0", "x-kvstore-retried": "false"})),
        _Answer("chaos", 0.0, -1, 0.3, *routing_of({})),
    ]
    row = _phase_row(answers, 1.0)
    assert (row["requests"], row["ok"], row["failed"], row["retried"]) == (3, 2, 1, 1)
    assert row["decision_p50_s"] == 0.000047 and row["failures"] == {-1: 1}
