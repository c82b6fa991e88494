"""``kvstore simulate``: the replica time model, the router-side load signal, and runs on Mooncake slices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.benchmarks.mooncake import DEFAULT_TRACE, TraceExpander, read_trace
from kvstore.benchmarks.simulate import policies as sim_policies
from kvstore.benchmarks.simulate.engine import (
    POLICIES,
    PolicyResult,
    SimulationSettings,
    percentile,
    simulate_policy,
    speedup_for_utilization,
)
from kvstore.benchmarks.simulate.replica import PrefillServer
from kvstore.cli import main
from kvstore.hashing import BlockHasher
from kvstore.router import policies as router_policies
from kvstore.router import routing as router_routing
from kvstore.router.config import RouterConfig
from kvstore.router.load import PrefillLoad
from kvstore.router.policies import LeastLoaded, RandomChoice, RoundRobin
from kvstore.router.scoring import Decision, ReplicaState, Scorer

FAST = ["--prefill-tps", "20000", "--decode-tps", "1000"]  # skip measuring the worker model


def test_prefill_server_steps_in_arrival_order_under_the_token_budget() -> None:
    server = PrefillServer(prefill_tps=100.0, step_tokens=50)
    assert server.submit(0, 120, now=0.0) == pytest.approx(0.5)  # step 1: 50 of request 0
    assert server.submit(1, 30, now=0.2) is None  # joins at the next step boundary
    assert server.outstanding(0.2) == pytest.approx(150 - 20)
    assert server.end_step() == ([], pytest.approx(1.0))  # step 2: 50 more of request 0
    done, end = server.end_step()  # step 3: request 0's last 20, then 30 of request 1
    assert done == [] and end == pytest.approx(1.5)
    assert server.end_step() == ([0, 1], None)  # both complete at t=1.5; idle
    assert server.queued_tokens == 0 and server.outstanding(1.5) == 0.0
    # Outstanding fell at 100 tokens/s from 120 (t=0) and 150 (t=0.2) to 0 at t=1.5:
    # area = (120 + 100) / 2 * 0.2 + 130 * 1.3 / 2 token-seconds.
    assert server.take_area(2.0) == pytest.approx(22.0 + 84.5)
    assert server.take_area(3.0) == 0.0
    assert server.submit(2, 10, now=3.0) == pytest.approx(3.1)


def test_prefill_load_drains_at_the_rate_and_never_exceeds_what_is_in_flight() -> None:
    load = PrefillLoad(tokens_per_s=100.0)
    load.dispatched(200, now=0.0)
    load.dispatched(100, now=1.0)  # queued behind the first: busy until t=3
    assert load.outstanding(1.0) == pytest.approx(200.0)
    assert load.outstanding(2.5) == pytest.approx(50.0)
    assert load.outstanding(3.5) == 0.0  # prefill done, responses still decoding
    assert (load.inflight_requests, load.inflight_tokens) == (2, 300)
    load.finished(200)
    load.finished(100)
    load.dispatched(50, now=10.0)
    load.finished(50)  # the response came back before the estimate drained: nothing is outstanding
    assert load.outstanding(10.1) == 0.0


def test_prefill_load_learns_its_rate_and_falls_back_to_in_flight_tokens() -> None:
    load = PrefillLoad()
    load.dispatched(300, now=0.0)
    assert load.outstanding(100.0) == 300.0  # no rate yet: the conservative bound
    load.observe(1000, 2.0)
    assert load.tokens_per_s == 500.0
    load.observe(1000, 1.0)
    assert load.tokens_per_s == pytest.approx(500.0 + 0.2 * 500.0)
    load.observe(0, 1.0)  # a full cache hit teaches nothing
    assert load.tokens_per_s == pytest.approx(600.0)
    fixed = PrefillLoad(tokens_per_s=50.0)
    fixed.observe(1000, 1.0)
    assert fixed.tokens_per_s == 50.0
    with pytest.raises(ValueError):
        PrefillLoad(-1.0)


def test_percentile_interpolates_and_speedup_targets_the_offered_load() -> None:
    assert percentile([], 0.99) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    trace = read_trace(DEFAULT_TRACE, 50)
    span_s = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000
    offered = sum(r.input_length for r in trace) / span_s
    assert speedup_for_utilization(trace, 4, 1000.0, 0.5) == pytest.approx(0.5 * 4 * 1000.0 / offered)


def simulate_slice(policy: str, replicas: int, requests: int) -> PolicyResult:
    """``policy`` over the trace's first ``requests`` on ``replicas``, 512-token blocks, fixed rates."""
    trace = read_trace(DEFAULT_TRACE, requests)
    settings = SimulationSettings(replicas, 200_000, 512, 20_000.0, 500.0, 2048, 2.0, 10.0, 0)
    expander = TraceExpander(BlockHasher("sha256_cbor", "kvstore", 512), "derived")
    return simulate_policy(policy, trace, settings, expander, RouterConfig())


def test_the_simulated_router_decides_with_the_production_scoring_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """One Scorer, one state builder, one PrefillLoad: the simulator and the router service cannot drift apart."""
    assert sim_policies.Scorer is router_routing.Scorer
    assert sim_policies.replica_state is router_routing.replica_state
    assert sim_policies.PrefillLoad is router_policies.PrefillLoad
    calls: list[tuple[dict[str, ReplicaState], Decision]] = []
    production_choose = Scorer.choose

    def spy(self: Scorer, states, matches, num_blocks, rng):  # type: ignore[no-untyped-def]
        decision = production_choose(self, states, matches, num_blocks, rng)
        calls.append((dict(states), decision))
        return decision

    monkeypatch.setattr(Scorer, "choose", spy)
    result = simulate_slice("kvstore", replicas=4, requests=150)
    assert len(calls) == result.requests == 150
    assert result.index_mismatches == 0
    assert any(state.outstanding_tokens > 0 for states, _ in calls for state in states.values())
    assert all(set(states) == {f"replica-{i}" for i in range(4)} for states, _ in calls)


@pytest.mark.parametrize(
    ("policy", "baseline"),
    [
        ("round_robin", RoundRobin),
        ("random", RandomChoice),
        ("least_loaded", LeastLoaded),
        ("global_cache", LeastLoaded),
    ],
)
def test_the_simulated_baselines_are_the_routers(
    monkeypatch: pytest.MonkeyPatch, policy: str, baseline: type[router_policies.Baseline]
) -> None:
    """The simulator's cache-blind policies are the router's baseline classes, as the router service makes them."""
    assert router_routing.make_baseline is router_policies.make_baseline
    calls: list[tuple[list[str], str]] = []
    production_choose = baseline.choose

    def spy(self: router_policies.Baseline, states):  # type: ignore[no-untyped-def]
        choice = production_choose(self, states)
        calls.append((list(states), choice))
        return choice

    monkeypatch.setattr(baseline, "choose", spy)
    result = simulate_slice(policy, replicas=12, requests=40)
    names = [f"replica-{i}" for i in range(12)]
    assert len(calls) == result.requests == 40
    assert all(candidates == names for candidates, _ in calls)  # every replica, in the simulator's order
    if policy == "round_robin":
        assert [choice for _, choice in calls] == [names[i % 12] for i in range(40)]


def test_simulate_slice_reports_ttft_and_imbalance_per_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    code = main(["simulate", "--limit", "800", "--replicas", "8", *FAST, "--json", str(out), "--plot", str(png)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 800 and report["replicas"] == 8 and report["hash_mode"] == "tokens"
    assert report["prefill_tps"] == 20000.0 and report["decode_tps"] == 1000.0 and report["rates_from"] == "flags"
    assert report["offered_utilization"] == pytest.approx(0.8) and report["speedup"] > 0
    assert set(report["policies"]) == set(POLICIES)
    for name, result in report["policies"].items():
        assert 0.0 <= result["hit_rate"] <= 1.0, name
        assert result["max_mean_load"] >= 1.0 and result["window_load_imbalance_p99"] >= 1.0, name
        assert 0 < result["ttft_p50_s"] <= result["ttft_p90_s"] <= result["ttft_p99_s"], name
        assert 0 < result["utilization"] <= 1.0, name
        assert len(result["work_per_replica"]) == 8
        assert result["prefill_tokens_saved"] + result["prefill_tokens"] == result["prompt_tokens"]
    policies = report["policies"]
    assert policies["kvstore"]["index_mismatches"] == 0, "the index must predict every replica's real cache"
    assert policies["kvstore"]["hit_rate"] > 1.5 * policies["round_robin"]["hit_rate"]
    assert policies["kvstore"]["hit_rate"] <= policies["global_cache"]["hit_rate"] + 1e-9
    assert policies["kvstore"]["ttft_p99_s"] < policies["round_robin"]["ttft_p99_s"]
    assert report["kvstore_ttft_p99_vs_round_robin"] == pytest.approx(
        policies["kvstore"]["ttft_p99_s"] / policies["round_robin"]["ttft_p99_s"]
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "kvstore" in table and "dynamo" in table and "offered prefill load" in table


def test_simulate_measures_the_worker_model_by_default(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    argv = ["simulate", "--limit", "60", "--policies", "kvstore", "--json", str(out), "--set", "worker.device=cpu"]
    code = main(argv)
    assert code == 0
    report = json.loads(out.read_text())
    assert report["rates_from"].startswith("measured on the worker model (cpu")
    assert report["prefill_tps"] > 0 and report["decode_tps"] > 0


def test_simulate_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--block-tokens", "100", "--limit", "5", *FAST]) == 2
    assert main(["simulate", "--policies", "kvstore,bogus", "--limit", "5", *FAST]) == 2
    assert main(["simulate", "--trace", "/nonexistent.jsonl", *FAST]) == 2
    assert main(["simulate", "--limit", "5", "--prefill-tps", "-3", "--decode-tps", "1"]) == 2
    assert main(["simulate", "--limit", "5", *FAST, "--speedup", "0"]) == 2
    assert main(["simulate", "--limit", "5", *FAST, "--utilization", "0"]) == 2
    assert main(["simulate", "--limit", "5", *FAST, "--step-tokens", "0"]) == 2
    assert main(["simulate", "--limit", "5", *FAST, "--speedup", "1", "--policies", "round_robin"]) == 0  # no span
    err = capsys.readouterr().err
    assert "--block-tokens" in err and "bogus" in err and "--prefill-tps" in err and "--speedup" in err
    with pytest.raises(SystemExit):
        main(["simulate", *FAST, "--speedup", "2", "--utilization", "0.5"])


def test_trace_reader() -> None:
    requests = read_trace(DEFAULT_TRACE, 3)
    assert len(requests) == 3 and requests[0].hash_ids[:2] == (0, 1) and requests[0].input_length == 6758
