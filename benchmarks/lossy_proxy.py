"""A lossy hop for a KV event stream: SUB from a publisher, PUB on 127.0.0.1, dropping some messages.

The chaos benchmark puts one between each worker and the router, and the
event-stream tests put one between a publisher and its listener, so that a
real stream loses batches as over a lossy network. Only the live stream goes
through it: replay and snapshot requests go to the publisher directly, which
is what lets the listener repair the holes.

Both of its sockets have no high-water mark, so a message is lost only when
the proxy decides to drop it, and ``dropped`` counts every loss.
"""

from __future__ import annotations

import random
import threading

import zmq

LOOPBACK = "tcp://127.0.0.1:*"


class LossyProxy:
    """Forwards every message from ``upstream`` to :attr:`endpoint` on its own thread, but for those it drops.

    A message is dropped with probability ``loss`` (a seeded RNG, so the
    pattern is a function of the message order; ``loss`` may be changed while
    it runs), and also, when ``drop_every`` is set, every ``drop_every``-th
    message (the 1st to pass is message 1), for a test that needs an exact
    pattern. ``close`` stops the thread and closes both sockets.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        upstream: str,
        *,
        loss: float = 0.0,
        seed: int = 0,
        drop_every: int | None = None,
    ) -> None:
        if drop_every is not None and drop_every < 1:
            raise ValueError(f"drop_every must be >= 1, got {drop_every}")
        self.loss = loss
        self.drop_every = drop_every
        self.forwarded = 0
        self.dropped = 0
        self._seen = 0
        self._rng = random.Random(seed)
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.bind(LOOPBACK)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lossy-proxy", daemon=True)
        self._thread.start()

    def _drop(self) -> bool:
        self._seen += 1
        every = self.drop_every is not None and self._seen % self.drop_every == 0
        return self._rng.random() < self.loss or every

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(10):
                continue
            frames = self._sub.recv_multipart()
            if self._drop():
                self.dropped += 1
            else:
                self._pub.send_multipart(frames)
                self.forwarded += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(linger=0)
        self._pub.close(linger=0)
