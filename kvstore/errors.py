"""Typed errors for callers' mistakes.

Three channels (see STYLE.md): ``assert`` for our own bugs, these exceptions
for a caller's mistake (each message says what to do), and ``None`` for
back-pressure (e.g. the pool cannot hold a request right now).
"""


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


class EventDecodeError(KVStoreError, ValueError):
    """A frame on a KV event stream is not a valid event batch."""


class InvalidRequestError(KVStoreError, ValueError):
    """A request (prompt, token ids, sampling parameters) cannot be served as given."""
