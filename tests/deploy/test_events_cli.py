"""``kvstore events tail`` against a real publisher: a reader that leaves, a replay endpoint that never answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kvstore.cli import main
from kvstore.config import EventsConfig
from kvstore.events import AllBlocksCleared
from kvstore.publisher import ZmqEventPublisher


@pytest.fixture
def publisher() -> Iterator[ZmqEventPublisher]:
    """A publisher sending a batch every 20 ms until the test ends."""
    pub = ZmqEventPublisher(EventsConfig())
    stop = threading.Event()

    def keep_publishing() -> None:
        while not stop.wait(0.02):
            pub.publish([AllBlocksCleared()])

    thread = threading.Thread(target=keep_publishing, daemon=True)
    thread.start()
    try:
        yield pub
    finally:
        stop.set()
        thread.join()
        pub.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_tail_stops_quietly_when_its_reader_leaves(publisher: ZmqEventPublisher) -> None:
    """``kvstore events tail ... | head -n 2``: the tool ends with exit code 0 and says nothing."""
    argv = [sys.executable, "-m", "kvstore", "events", "tail", "--endpoint", publisher.endpoint]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        lines = [proc.stdout.readline() for _ in range(2)]
        assert all('"AllBlocksCleared"' in line for line in lines), lines
        proc.stdout.close()  # as `head` does
        assert proc.wait(timeout=30) == 0
        assert proc.stderr.read() == ""
    finally:
        proc.kill()
        proc.wait()


def test_tail_says_once_that_the_replay_endpoint_does_not_answer(
    publisher: ZmqEventPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    time.sleep(0.5)  # a history to recover: the tail joins late, so it holds the live stream until a sync ends
    argv = ["events", "tail", "--endpoint", publisher.endpoint, "--replay-endpoint", nowhere, "--duration", "10"]
    assert main(argv) == 0
    out, err_text = capsys.readouterr()
    err = err_text.splitlines()
    assert out == "" and len(err) == 1 and f"no answer from --replay-endpoint {nowhere}" in err[0], err


def test_tail_streams_through_a_replay_endpoint_that_answers(
    publisher: ZmqEventPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["events", "tail", "--endpoint", publisher.endpoint, "--replay-endpoint", publisher.replay_endpoint]
    started = time.monotonic()
    assert main([*argv, "--count", "3", "--duration", "20"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.count('"AllBlocksCleared"') == 3 and time.monotonic() - started < 10


@pytest.mark.parametrize("duration", ["nan", "inf", "-1", "0"])
def test_tail_refuses_a_duration_that_is_not_a_positive_time(duration: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["events", "tail", "--endpoint", "tcp://127.0.0.1:1", "--duration", duration]) == 2
    assert "--duration must be a number of seconds > 0" in capsys.readouterr().err
