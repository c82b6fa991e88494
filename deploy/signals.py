"""SIGINT and SIGTERM in ``kvstore serve``: whenever one arrives, an orderly stop.

Python turns SIGINT into KeyboardInterrupt but leaves SIGTERM deadly: the
process dies at once, leaving Ray's processes and the tier's shared-memory
arena behind. :func:`stop_on_signals` makes both raise :class:`StopRequested`
in the main thread, so the code that started something (Ray, the actors,
the HTTP server) stops it on the way out, wherever the signal lands.
StopRequested is a KeyboardInterrupt because that is the one exception
Ray's blocking calls (``ray.get``) let through from a signal handler: any
other becomes a SystemError, and inside them it arrives as a plain
KeyboardInterrupt -- so catch KeyboardInterrupt. While
the deployment is being stopped (:meth:`SignalGuard.shielded`), further
signals are only noted: a second Ctrl-C must not abandon the clean-up
half-way.

Ray installs its own SIGTERM handler while it starts; the launcher puts this
one back afterwards (:func:`kvstore.deploy.launcher.start_ray`).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(KeyboardInterrupt):
    """A stop signal arrived (see the module docstring for why it is a KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalGuard:
    """The installed handlers' switch: raise on a signal, or (shielded) only note it."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._shielded = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if not self._shielded:
            raise StopRequested(signum)

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """Signals arriving inside are noted, not raised (a clean-up runs to its end)."""
        self._shielded = True
        try:
            yield
        finally:
            self._shielded = False


@contextlib.contextmanager
def stop_on_signals() -> Iterator[SignalGuard]:
    """SIGINT and SIGTERM raise StopRequested (a KeyboardInterrupt) inside; the previous handlers come back after.

    Call from the main thread (the only one Python delivers signals to).
    """
    guard = SignalGuard()
    previous = {sig: signal.signal(sig, guard.handle) for sig in SIGNALS}
    try:
        yield guard
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
