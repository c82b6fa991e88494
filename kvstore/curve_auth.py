"""CURVE client allow-lists for the event sockets, checked by ZeroMQ's ZAP handshake.

CURVE alone encrypts and authenticates the *server*: any client that knows
the server's public key may connect. With an allow-list, the handshake also
asks a ZAP handler whether the client's public key is listed, and refuses the
connection otherwise -- before a single frame flows, on PUB and ROUTER alike.

ZAP is per ZeroMQ context: one handler (pyzmq's ThreadAuthenticator) serves
every CURVE server socket of its context. Publishers that share a context
(the default one, ``zmq.Context.instance()``) share that handler: each one's
sockets carry a ZAP domain of their own, under which its allow-list is
registered; a CURVE socket of the context with no list of its own (another
publisher without one) is let through, as it would be with no handler at all.
The handler is started by the first allow-list of a context and stopped with
its last. ZeroMQ closes the stopped handler's socket in the background: a
client whose handshake starts in that moment, on a socket of the context
with no list, waits for an answer that never comes until its handshake
interval ends (``ZMQ_HANDSHAKE_IVL``), then reconnects; clients after it
pass at once.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable

import zmq
from zmq.auth.thread import ThreadAuthenticator

_ANY_DOMAIN = "*"  # pyzmq's name for the default domain, used for sockets that set none


class _ContextAuth:
    """The ZAP handler of one context and the allow-list of each domain registered with it."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.lists: dict[str, frozenset[bytes]] = {}
        self.authenticator = ThreadAuthenticator(context)
        self.authenticator.start()
        self.authenticator.configure_curve_callback(_ANY_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: may the client with public key ``key`` (Z85) connect?"""
        allowed = self.lists.get(domain)
        return allowed is None or key in allowed


_lock = threading.Lock()
_contexts: dict[int, _ContextAuth] = {}  # id(context) -> its handler, while it has allow-lists
_domains = itertools.count()


class ClientAllowList:
    """Admits to the sockets passed to :meth:`secure` only the clients whose public key is listed.

    Call :meth:`secure` on each CURVE server socket before it binds; call
    :meth:`close` once the sockets are closed (idempotent).
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], public_keys: Iterable[str]) -> None:
        self._context = context
        self.domain = f"kvstore-events-{next(_domains)}"
        keys = frozenset(key.encode() for key in public_keys)
        with _lock:
            auth = _contexts.get(id(context))
            if auth is None:
                auth = _contexts[id(context)] = _ContextAuth(context)
            auth.lists[self.domain] = keys
            auth.authenticator.configure_curve_callback(self.domain, credentials_provider=auth)
        self._closed = False

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt_string(zmq.ZAP_DOMAIN, self.domain)

    def close(self) -> None:
        with _lock:
            if self._closed:
                return
            self._closed = True
            auth = _contexts[id(self._context)]
            del auth.lists[self.domain]
            auth.authenticator.credentials_providers.pop(self.domain, None)
            if not auth.lists:
                del _contexts[id(self._context)]
                auth.authenticator.stop()
