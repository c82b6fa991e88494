"""Ports of the three fronts' command lines: out-of-range ports are refused by name, ``--port 0`` prints the real one,
and a port that cannot be had is one line, not a banner followed by uvicorn's traceback."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import build_parser
from kvstore.deploy.config import load_config
from kvstore.errors import ConfigError


@pytest.mark.parametrize("argv", [["serve"], ["worker"], ["router", "--config", "x.toml"]])
def test_a_port_beyond_65535_or_below_0_is_refused_by_the_parser(argv: list[str]) -> None:
    parser = build_parser()
    assert parser.parse_args([*argv, "--port", "0"]).port == 0
    assert parser.parse_args([*argv, "--port", "65535"]).port == 65535
    for bad in ("70000", "-5", "http"):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--port", bad])


def test_router_port_in_the_config_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"router\.port"):
        load_config(overrides=["router.port=70000"], env={})
    assert load_config(overrides=["router.port=65535"], env={}).router.port == 65535


def _router(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    config = tmp_path / "router.toml"
    config.write_text('[[router.replicas]]\nname = "r0"\nurl = "http://127.0.0.1:9"\nevents = "tcp://127.0.0.1:9"\n')
    return subprocess.Popen(
        [sys.executable, "-m", "kvstore", "router", "--config", str(config), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def test_router_with_port_0_prints_the_port_it_listens_on(tmp_path: Path) -> None:
    proc = _router(tmp_path, "--port", "0")
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        printed = re.search(r"kvstore router: http://127\.0\.0\.1:(\d+)", line)
        assert printed and int(printed.group(1)) != 0, line
        with socket.create_connection(("127.0.0.1", int(printed.group(1))), timeout=10):
            pass  # listening there
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_port_in_use_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        proc = _router(tmp_path, "--port", str(taken.getsockname()[1]))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "cannot bind the router to 127.0.0.1:" in err and "Traceback" not in err, err
    assert "kvstore router: http" not in err  # no banner for a server that never served


def test_a_cluster_that_refuses_the_connection_is_one_line_naming_token_authentication(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray 2.59+ clusters started with `ray start` use token authentication; joining one from an environment
    without RAY_AUTH_MODE=token ends, after Ray's retries, in a ConnectionError: it becomes one ConfigError line
    naming the fix (Ray itself stands in here: what it raises is the input)."""
    from kvstore.deploy import launcher

    def refused(**kwargs: object) -> None:
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379.\nTraceback details")

    monkeypatch.setattr(launcher.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(launcher.ray, "init", refused)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(ConfigError) as info:
        launcher.start_ray("10.0.0.5:6379")
    message = str(info.value)
    assert "\n" not in message and "cannot connect to the Ray cluster at 10.0.0.5:6379" in message
    assert "set RAY_AUTH_MODE=token here too (now unset)" in message and "ray get-auth-token" in message


def test_a_taken_events_port_is_one_line_naming_the_field() -> None:
    from kvstore.config import EventsConfig
    from kvstore.publisher import ZmqEventPublisher

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ConfigError, match=r"cannot bind KV events to tcp://127\.0\.0\.1:\d+: .*events\.endpoint"):
            ZmqEventPublisher(EventsConfig(endpoint=endpoint))


def test_serve_refuses_a_fixed_events_port_in_one_line() -> None:
    """Every worker and each node's tier bind their own publisher from one [events] section: a fixed port
    would be refused to all but the first (a 60-line Ray traceback, before)."""
    from kvstore.deploy.serve_cli import check_one_port_per_producer

    with pytest.raises(ConfigError, match=r"events\.endpoint = 'tcp://127\.0\.0\.1:47123'.*port must be \*"):
        check_one_port_per_producer(load_config(overrides=['events.endpoint="tcp://127.0.0.1:47123"'], env={}))
    with pytest.raises(ConfigError, match=r"events\.replay_endpoint"):
        check_one_port_per_producer(load_config(overrides=['events.replay_endpoint="tcp://0.0.0.0:5558"'], env={}))
    check_one_port_per_producer(load_config(overrides=['events.endpoint="tcp://0.0.0.0:*"'], env={}))
    check_one_port_per_producer(load_config(overrides=["events.bind=false", 'events.endpoint="tcp://h:1"'], env={}))


def test_serve_refuses_events_off_in_one_line() -> None:
    """serve's router is built from the KV events: with them off, its tiers had no stream and serve died in an
    AttributeError traceback (found by a review)."""
    from kvstore.deploy.serve_cli import check_one_port_per_producer

    with pytest.raises(ConfigError, match=r"events\.enabled = false: kvstore serve's router builds its prefix index"):
        check_one_port_per_producer(load_config(overrides=["events.enabled=false"], env={}))


def test_the_banner_names_the_disk_tier_and_the_key_its_curl_needs_without_showing_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from types import SimpleNamespace

    from kvstore.deploy.serve_cli import _banner

    deployment = SimpleNamespace(workers=[], tiers=[])
    plain = load_config(env={})
    _banner(plain, deployment, "http://127.0.0.1:9", "CPU arena 1 GiB")  # type: ignore[arg-type]
    text = capsys.readouterr().out
    assert "tiers:       CPU arena 1 GiB\n" in text and "authorization" not in text
    keyed = load_config(
        env={}, overrides=["router.api_key=s3cret", "tiers.disk_dir=/data/kv", "tiers.disk_capacity_bytes=2147483648"]
    )
    _banner(keyed, deployment, "http://127.0.0.1:9", "CPU arena 1 GiB")  # type: ignore[arg-type]
    text = capsys.readouterr().out
    assert "tiers:       CPU arena 1 GiB; disk 2 GiB in /data/kv\n" in text
    assert "-H 'authorization: Bearer <router.api_key>'" in text and "s3cret" not in text
