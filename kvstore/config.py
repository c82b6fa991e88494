"""One configuration tree for every part of kvstore.

Precedence, lowest first: the defaults written below (each exactly once), a
TOML file, ``KVSTORE_<SECTION>__<FIELD>`` environment variables, then
``--set section.field=value`` flags. The merged tree is validated once, on
load, and never mutated afterwards (every Struct is frozen).

Every validation failure raises :class:`~kvstore.errors.ConfigError` with the
dotted field path and, for enumerations, the allowed values.
"""

from __future__ import annotations

import os
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvstore.errors import ConfigError

HashAlgo = Literal["sha256_cbor", "xxh3_128"]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
_Z85_ALPHABET = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")

ENV_PREFIX = "KVSTORE_"


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

    def __post_init__(self) -> None:
        for field in ("curve_secret_key", "curve_public_key"):
            key = getattr(self, field)
            if key and (len(key) != 40 or not _Z85_ALPHABET.issuperset(key)):
                raise ValueError(f"{field} must be a 40-character Z85 key (see zmq.curve_keypair()), or empty")
        if bool(self.curve_secret_key) != bool(self.curve_public_key):
            raise ValueError("curve_secret_key and curve_public_key must be set together (or both left empty)")


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """KV workers and their model (owned by the workers package).

    The defaults are a toy model small enough for fast CPU tests; raise the
    shape (and ``max_context``) for benchmarks. The MLP width is 4 x
    ``hidden_size``. Pool size comes from ``pool.num_blocks``, block size from
    ``cache.block_size``.
    """

    num_workers: NonNegativeInt = 0
    """Workers to start; 0 sizes to the machine."""
    num_layers: PositiveInt = 2
    num_heads: PositiveInt = 4
    """Query heads."""
    num_kv_heads: PositiveInt = 2
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    head_dim: PositiveInt = 32
    """Must be even (rotary embeddings rotate pairs)."""
    hidden_size: PositiveInt = 128
    vocab_size: PositiveInt = 512
    """Token ids are 0..vocab_size-1 (the router's byte tokenizer needs >= 256)."""
    max_context: PositiveInt = 2048
    """Longest prompt + max_tokens a request may have."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Weights, activations and the KV pool."""
    seed: NonNegativeInt = 0
    """Seed of the model's weights: equal seeds and shapes give equal outputs everywhere."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA when the process sees a GPU, else CPU."""
    max_num_seqs: PositiveInt = 64
    """Requests running (holding blocks) at once."""
    max_num_batched_tokens: PositiveInt = 2048
    """Tokens computed per step; longer prefills are chunked."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


class TierConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """CPU arena and disk tier of each node (owned by the tiers package).

    Sizes that depend on the model (slots = capacity // block bytes) are
    checked when the tier store starts, where the block size is known.
    """

    enabled: bool = True
    """Start a tier actor on each node; off, evicted GPU blocks are simply dropped."""
    cpu_capacity_bytes: Annotated[int, Meta(ge=1)] = 2 * 1024**3
    """Bytes of the shared-memory CPU arena per node, one slot per block (at least one block:
    disk reads and writes are staged through it)."""
    shm_dir: str = "/dev/shm"
    """Directory of the POSIX shared-memory arena file; must be a tmpfs with room for the arena."""
    cpu_prefault: bool = True
    """Reserve and touch every arena page at start: a too-small /dev/shm fails then, not with SIGBUS later."""
    copy_threads: Annotated[int, Meta(ge=1)] = 2
    """Threads of the copy engine (host copies; one waits on CUDA events when there is a GPU)."""
    disk_dir: str | None = None
    """Root of the disk tier (one subdirectory per cache identity); None turns the disk tier off."""
    disk_capacity_bytes: Annotated[int, Meta(ge=0)] = 64 * 1024**3
    """Bytes of block files (headers included) kept under the identity's directory; LRU beyond that."""
    disk_direct_io: bool = True
    """Use O_DIRECT where the file system and the block size allow it; else buffered I/O."""
    disk_fsync: bool = False
    """fsync each file before its rename (survives power loss; the checksum already turns torn files into misses)."""
    io_deadline_s: Annotated[float, Meta(gt=0.0)] = 5.0
    """Deadline of every disk I/O (queueing included); a late I/O is a miss or "not stored"."""
    max_concurrent_io: Annotated[int, Meta(ge=1)] = 16
    """Disk I/Os in flight at once (also the size of their thread pool)."""
    write_through: bool = False
    """Also write every spilled block to disk at once; the default writes back on CPU eviction."""
    admit_after_spills: Annotated[int, Meta(ge=1)] = 1
    """Admit a block on its N-th spill (1 admits every block; 2 keeps one-off blocks out)."""
    admission_window_blocks: Annotated[int, Meta(ge=1)] = 65_536
    """Hashes remembered by the admission filter (LRU) while they wait for their N-th spill."""


class ExternalReplica(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One replica the router does not manage: a vLLM server or ``kvstore worker``."""

    name: str
    url: str
    """Base URL of its OpenAI-compatible API, e.g. ``http://10.0.0.5:8000``."""
    events: str
    """Its KV events PUB endpoint, e.g. ``tcp://10.0.0.5:5557``."""
    replay: str | None = None
    """Its replay ROUTER endpoint (gap recovery); None = no recovery beyond the live stream."""
    node: str | None = None
    """Node it runs on (tier streams of that node count for it)."""
    rekey: bool = False
    """True when it hashes differently (another algorithm or seed): re-key from token ids."""
    model: str | None = None
    """``model`` to send it; None = forward the client's."""
    curve_server_key: str | None = None
    """Its event publisher's CURVE public key (Z85, 40 characters) when it runs with CURVE; None = plain."""

    def __post_init__(self) -> None:
        key = self.curve_server_key
        if key is not None and (len(key) != 40 or not _Z85_ALPHABET.issuperset(key)):
            raise ValueError("curve_server_key must be a 40-character Z85 public key (zmq.curve_keypair()), or unset")


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The cache-aware router (owned by the router package).

    Scoring (router/scoring.py): the replica with the lowest cost wins, where
    cost = prefill_weight * tokens still to prefill after hit credits
         + outstanding_weight * outstanding work (token equivalents)
         + running_weight * running requests + waiting_weight * waiting requests
         + kv_usage_weight * KV usage (0..1).
    """

    host: str = "127.0.0.1"
    port: NonNegativeInt = 8000
    gpu_hit_credit: Fraction = 1.0
    """Share of a block's prefill saved when the replica holds it on GPU."""
    cpu_hit_credit: Fraction = 0.8
    """Share saved by a CPU-tier hit (the block must still be copied to the GPU)."""
    storage_hit_credit: Fraction = 0.5
    """Share saved by a disk-tier hit (read from disk, then copied to the GPU)."""
    prefill_weight: Annotated[float, Meta(ge=0.0)] = 1.0
    """Cost per token the chosen replica would have to prefill."""
    outstanding_weight: Annotated[float, Meta(ge=0.0)] = 0.5
    """Cost per token of work already queued or running on the replica. Below 1 a replica
    holding the prefix keeps a request even if that costs it some queueing: measured with
    ``kvstore simulate`` on the Mooncake conversation trace (docs/router.md)."""
    running_weight: Annotated[float, Meta(ge=0.0)] = 0.0
    """Cost per running request, in tokens."""
    waiting_weight: Annotated[float, Meta(ge=0.0)] = 0.0
    """Cost per waiting (admitted but not yet scheduled) request, in tokens."""
    kv_usage_weight: Annotated[float, Meta(ge=0.0)] = 0.0
    """Cost of a full KV pool (usage 1.0), in tokens; scales linearly with usage."""
    prefill_tps: Annotated[float, Meta(ge=0.0)] = 0.0
    """Each replica's prefill throughput (tokens/s), at which the router's estimate of its queued prefill
    drains (router/load.py); 0 = learn it from the timings responses report."""
    temperature: Annotated[float, Meta(ge=0.0)] = 0.0
    """0 picks the lowest cost (ties at random); > 0 samples a softmax over normalised costs."""
    policy: Literal["kvstore", "round_robin", "random", "least_loaded"] = "kvstore"
    """Routing policy: ``kvstore`` (cached prefix vs load, the Scorer); the others are baselines
    that ignore the cache (used by ``kvstore replay --compare``)."""
    model_name: str = "kvstore-toy"
    """Reported as ``model`` in completions when the request names none."""
    tokenizer: str = ""
    """Path to a ``tokenizer.json`` for text prompts; empty = byte-level (our workers' model)."""
    vocab_size: NonNegativeInt = 0
    """Token ids must be below this; 0 = ask the replicas (Ray workers) or no check beyond >= 0."""
    max_context: NonNegativeInt = 0
    """Prompt + max_tokens limit; 0 = ask the replicas (Ray workers)."""
    api_key: str = ""
    """When set, every route but /healthz needs ``Authorization: Bearer <api_key>``."""
    max_body_bytes: PositiveInt = 4 << 20
    """Larger request bodies get 413."""
    health_interval_s: Annotated[float, Meta(gt=0.0)] = 1.0
    """How often each replica's load/health is polled."""
    unhealthy_after: PositiveInt = 2
    """Consecutive failed polls before a replica stops being routed to (a failed request is enough)."""
    sync_timeout_s: Annotated[float, Meta(gt=0.0)] = 2.0
    """Deadline of one replay or snapshot request to a producer."""
    request_timeout_s: Annotated[float, Meta(gt=0.0)] = 300.0
    """Deadline of one completion on a replica."""
    replicas: list[ExternalReplica] = msgspec.field(default_factory=list)
    """External OpenAI-compatible replicas (``kvstore router``); ``kvstore serve`` places its own."""


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole tree: one section per part, each default written once."""

    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    pool: PoolConfig = msgspec.field(default_factory=PoolConfig)
    events: EventsConfig = msgspec.field(default_factory=EventsConfig)
    worker: WorkerConfig = msgspec.field(default_factory=WorkerConfig)
    tiers: TierConfig = msgspec.field(default_factory=TierConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Build the config tree: defaults < TOML file < environment < overrides.

    ``overrides`` are ``section.field=value`` strings; values are parsed as
    TOML scalars (``32``, ``true``, ``"x"``) and fall back to plain strings.
    Raises ConfigError naming the offending field.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        tree = _read_toml(Path(path))
    environ = os.environ if env is None else env
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
        _set_dotted(tree, dotted, _parse_scalar(raw, dotted), origin=f"environment variable {key}")
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        if not sep or not dotted.strip():
            raise ConfigError(f"override {item!r} must look like section.field=value")
        _set_dotted(tree, dotted.strip(), _parse_scalar(raw.strip(), dotted.strip()), origin=f"override {item!r}")
    return config_from_dict(tree)


def config_from_dict(tree: Mapping[str, Any]) -> Config:
    """Validate a plain mapping into a Config, with errors that name the field."""
    try:
        return msgspec.convert(tree, Config, str_keys=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc))) from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _parse_scalar(raw: str, dotted: str) -> Any:
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    # A string field takes the text as written: KVSTORE_CACHE__HASH_SEED=0 is the seed "0".
    if _field_type(dotted) is str and not isinstance(value, str):
        return raw
    return value


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, *, origin: str) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _explain(message: str) -> str:
    """Turn msgspec's ``... - at `$.a.b``` into ``a.b: ...`` plus allowed values."""
    text, sep, where = message.rpartition(" - at `")
    if not sep:  # msgspec gives no location for the root object
        text, where = message, "$`"
    dotted = where.rstrip("`").removeprefix("$").lstrip(".")
    allowed = _allowed_values(dotted)
    hint = f" (allowed: {', '.join(map(str, allowed))})" if allowed else ""
    if text.startswith("Object contains unknown field"):
        known = _known_fields(dotted)
        hint = f" (known fields: {', '.join(known)})" if known else ""
    return f"config field {dotted or '<root>'}: {text}{hint}"


def _field_type(dotted: str) -> Any:
    node: Any = Config
    for part in [p for p in dotted.split(".") if p]:
        hints = typing.get_type_hints(node, include_extras=True) if isinstance(node, type) else {}
        if part not in hints:
            return None
        node = hints[part]
    return node


def _allowed_values(dotted: str) -> tuple[Any, ...]:
    tp = _field_type(dotted)
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return ()


def _known_fields(dotted: str) -> tuple[str, ...]:
    tp = _field_type(dotted) if dotted else Config
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp.__struct_fields__
    return ()
