"""The core's configuration sections, and the loader of the whole configuration tree.

Each layer owns its section and writes each default once, next to the code
that reads it: ``cache``, ``pool`` and ``events`` here (the core's),
``worker`` in :mod:`kvstore.workers.config`, ``tiers`` in
:mod:`kvstore.tiers.config`, ``router`` in :mod:`kvstore.router.config`. The
tree that holds them all is assembled at the top, in
:mod:`kvstore.deploy.config`, the one layer that knows every part.

Precedence of the loader, lowest first: the defaults, a TOML file,
``KVSTORE_<SECTION>__<FIELD>`` environment variables, then ``--set
section.field=value`` flags. The merged tree is validated once, on load, and
never mutated afterwards (every Struct is frozen). Every validation failure
raises :class:`~kvstore.errors.ConfigError` with the dotted field path and,
for enumerations, the allowed values.
"""

from __future__ import annotations

import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from kvstore.errors import ConfigError

HashAlgo = Literal["sha256_cbor", "xxh3_128"]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
_Z85_ALPHABET = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")
T = TypeVar("T", bound=msgspec.Struct)


def is_z85_key(key: str) -> bool:
    """A CURVE key as Z85 text: 40 characters of the Z85 alphabet (``zmq.curve_keypair()``)."""
    return len(key) == 40 and _Z85_ALPHABET.issuperset(key)


ENV_PREFIX = "KVSTORE_"


ZMQ_TRANSPORTS = ("tcp", "ipc", "inproc", "pgm", "epgm", "udp", "ws", "wss", "vmci")


def is_zmq_endpoint(text: str) -> bool:
    """``transport://address`` with a transport ZeroMQ knows (the address itself is ZeroMQ's to judge; a TCP
    one needs a ``:port`` in 0..65535, or ``*``)."""
    transport, sep, address = text.partition("://")
    if not sep or transport not in ZMQ_TRANSPORTS or not address:
        return False
    if transport != "tcp":
        return True
    host, colon, port = address.rpartition(":")
    return bool(colon and host) and (port == "*" or (port.isascii() and port.isdigit() and int(port) <= 65535))


def check_zmq_endpoints(struct: msgspec.Struct, fields: tuple[str, ...], examples: str) -> None:
    """ValueError naming the first of ``fields`` of ``struct`` that is set and not a ZeroMQ endpoint."""
    for field in fields:
        endpoint = getattr(struct, field)
        if endpoint is not None and not is_zmq_endpoint(endpoint):
            raise ValueError(
                f"{field} must be a ZeroMQ endpoint, transport://address (such as {examples}), got {endpoint!r}"
            )


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What makes two processes agree on block identity."""

    block_size: PositiveInt = 16
    """Tokens per KV block; only full blocks are hashed and cached."""
    hash_algo: HashAlgo = "sha256_cbor"
    """Block hash function. ``sha256_cbor`` matches vLLM byte for byte."""
    hash_seed: str = "kvstore"
    """Seed of NONE_HASH. Set to vLLM's seed to share hashes with a vLLM fleet."""
    enable_prefix_caching: bool = True


class PoolConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The paged block pool of one worker."""

    num_blocks: PositiveInt = 1024
    watermark: Fraction = 0.01
    """Fraction of blocks kept free for running requests at admission."""


class EventsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ZeroMQ KV-event publisher of one producer."""

    enabled: bool = True
    endpoint: str = "tcp://127.0.0.1:*"
    """PUB endpoint. ``*`` as the port picks a free one at bind time."""
    replay_endpoint: str = "tcp://127.0.0.1:*"
    """ROUTER endpoint for replay and snapshot requests."""
    bind: bool = True
    """Bind the endpoints (the default) or connect them to a forwarder."""
    topic: str = ""
    buffer_batches: PositiveInt = 10_000
    """Batches kept for replay."""
    buffer_bytes: PositiveInt = 64 * 2**20
    """Bytes of encoded batches kept for replay: the bound that holds when batches are large (a request's
    strings, a LoRA name for one, ride in the events of every block it names). Whichever of the two bounds is
    reached first evicts the oldest batches; a subscriber that needs more falls back to a snapshot."""
    queue_batches: PositiveInt = 100_000
    """Batches waiting for the publisher thread before new ones are dropped."""
    hwm: PositiveInt = 100_000
    snapshot_batch_blocks: PositiveInt = 512
    curve_secret_key: str = ""
    """This publisher's CURVE secret key (Z85 text, 40 characters, as ``zmq.curve_keypair()`` makes); empty =
    no CURVE. With a key pair set, PUB and ROUTER are CURVE servers: traffic is encrypted, and a subscriber
    connects only if it gives this publisher's public key as its ``curve_server_key`` (plain ZeroMQ
    clients cannot connect at all). Clients are not authenticated: hand the public key only to the
    subscribers you trust."""
    curve_public_key: str = ""
    """The public half of ``curve_secret_key`` (``zmq.curve_public(secret)``); subscribers need it."""
    curve_allowed_client_keys: tuple[str, ...] = ()
    """With CURVE on, the client public keys (Z85) allowed to subscribe and to ask for replays and snapshots;
    empty = any client that has the server's public key. Checked in the CURVE handshake (ZeroMQ's ZAP): an
    unlisted client connects to nothing, on either socket. A subscriber presents its key pair as
    ``EventListener.add_producer(curve_client_keys=...)`` or ``kvstore events tail --curve-client-cert``."""
    include_token_ids: bool = True
    """Publish each BlockStored with its blocks' token ids (vLLM's format: consumers such as Dynamo's indexer
    rebuild hashes from them), or with an empty ``token_ids`` -- hashes only, so that a subscriber cannot read
    prompts. The router needs no token ids from our own producers: they hash exactly as it does. Re-keying a
    *foreign* producer (``rekey``: another hash seed or algorithm) needs them: leave this on for producers
    whose events are re-keyed."""

    def __post_init__(self) -> None:
        check_zmq_endpoints(
            self, ("endpoint", "replay_endpoint"), "tcp://127.0.0.1:5557, tcp://0.0.0.0:* or ipc:///run/kvstore/events"
        )
        for field in ("curve_secret_key", "curve_public_key"):
            key = getattr(self, field)
            if key and not is_z85_key(key):
                raise ValueError(f"{field} must be a 40-character Z85 key (see zmq.curve_keypair()), or empty")
        if bool(self.curve_secret_key) != bool(self.curve_public_key):
            raise ValueError("curve_secret_key and curve_public_key must be set together (or both left empty)")
        for key in self.curve_allowed_client_keys:
            if not is_z85_key(key):
                raise ValueError(f"curve_allowed_client_keys: {key!r} is not a 40-character Z85 public key")
        if self.curve_allowed_client_keys and not self.curve_secret_key:
            raise ValueError("curve_allowed_client_keys needs CURVE on: set curve_secret_key and curve_public_key")


def load_tree(
    root: type[T],
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Build a config tree of type ``root``: defaults < TOML file < environment < overrides.

    ``overrides`` are ``section.field=value`` strings; values are parsed as
    TOML scalars (``32``, ``true``, ``"x"``) and fall back to plain strings.
    Raises ConfigError naming the offending field.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        tree = _read_toml(Path(path))
    environ = os.environ if env is None else env
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        if "__" not in key:
            section = key[len(ENV_PREFIX) :].lower().partition("_")[0]
            if section in _known_fields(root, ""):  # KVSTORE_TIERS_DISK_DIR: meant for a setting, silently lost
                raise ConfigError(
                    f"environment variable {key}: a setting is KVSTORE_<SECTION>__<FIELD>, two underscores "
                    f"between them (such as KVSTORE_{section.upper()}__...)"
                )
            continue
        dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
        _set_dotted(tree, dotted, _parse_scalar(root, raw, dotted), origin=f"environment variable {key}")
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        if not sep or not dotted.strip():
            raise ConfigError(f"override {item!r} must look like section.field=value")
        _set_dotted(tree, dotted.strip(), _parse_scalar(root, raw.strip(), dotted.strip()), origin=f"override {item!r}")
    return tree_from_dict(root, tree)


def tree_from_dict(root: type[T], tree: Mapping[str, Any]) -> T:
    """Validate a plain mapping into a ``root`` tree, with errors that name the field."""
    try:
        return msgspec.convert(tree, root, str_keys=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(root, str(exc))) from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}): TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _parse_scalar(root: type, raw: str, dotted: str) -> Any:
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    # A string field takes the text as written: KVSTORE_CACHE__HASH_SEED=0 is the seed "0", and an optional
    # one (str | None) too: KVSTORE_TIERS__DISK_DIR=2024-01-01 is a directory, not a date.
    if _takes_text(_field_type(root, dotted)) and not isinstance(value, str):
        return raw
    return value


def _takes_text(tp: Any) -> bool:
    """A field whose type is ``str``, or a union (``str | None``) or Annotated ``str`` with one."""
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if tp is str:
        return True
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, *, origin: str) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _explain(root: type, message: str) -> str:
    """Turn msgspec's ``... - at `$.a.b``` into ``a.b: ...`` plus allowed values."""
    text, sep, where = message.rpartition(" - at `")
    if not sep:  # msgspec gives no location for the root object
        text, where = message, "$`"
    dotted = where.rstrip("`").removeprefix("$").lstrip(".")
    allowed = _allowed_values(root, dotted)
    hint = f" (allowed: {', '.join(map(str, allowed))})" if allowed else ""
    if text.startswith("Object contains unknown field"):
        known = _known_fields(root, dotted)
        hint = f" (known fields: {', '.join(known)})" if known else ""
    return f"config field {dotted or '<root>'}: {text}{hint}"


def _field_type(root: type, dotted: str) -> Any:
    node: Any = root
    for part in [p for p in dotted.split(".") if p]:
        name, index, _ = part.partition("[")  # "replicas[0]": an element of a list or tuple field
        hints = typing.get_type_hints(node, include_extras=True) if isinstance(node, type) else {}
        if name not in hints:
            return None
        node = hints[name]
        if index:
            if typing.get_origin(node) is typing.Annotated:
                node = typing.get_args(node)[0]
            elements = typing.get_args(node)
            node = elements[0] if elements else None
    return node


def _allowed_values(root: type, dotted: str) -> tuple[Any, ...]:
    tp = _field_type(root, dotted)
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return ()


def _known_fields(root: type, dotted: str) -> tuple[str, ...]:
    tp = _field_type(root, dotted) if dotted else root
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp.__struct_fields__
    return ()
