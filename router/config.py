"""The ``router`` section of the configuration, and what the router reads of the whole tree."""

from __future__ import annotations

from typing import Annotated, Literal, Protocol

import msgspec
from msgspec import Meta

from kvstore.config import CacheConfig, Fraction, NonNegativeInt, PositiveInt, check_zmq_endpoints, is_z85_key
from kvstore.openai.bounds import BodyBounds
from kvstore.openai.tool_calls import ToolCallParser
from kvstore.subscriber import CurveKeyPair, load_client_cert

PolicyName = Literal["kvstore", "round_robin", "random", "least_loaded"]
"""``kvstore``: cached prefix against load (the Scorer); the others: cache-blind baselines (router/policies.py)."""


MAX_PORT = 65535


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
    api_key: str | None = None
    """Its own API key (vLLM's ``--api-key``): sent as ``Authorization: Bearer`` with forwarded requests and
    with the router's polls of its ``/metrics`` and ``/v1/models``. Unset, a client's ``Authorization`` is
    passed on as sent -- unless ``router.api_key`` is set: that header is the router's key, never passed on."""
    curve_server_key: str | None = None
    """Its event publisher's CURVE public key (Z85, 40 characters) when it runs with CURVE; None = plain."""

    def __post_init__(self) -> None:
        check_zmq_endpoints(self, ("events", "replay"), "tcp://10.0.0.5:5557")
        key = self.curve_server_key
        if key is not None and not is_z85_key(key):
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
    port: Annotated[int, Meta(ge=0, le=MAX_PORT)] = 8000
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
    policy: PolicyName = "kvstore"
    """Routing policy: ``kvstore`` (cached prefix vs load, the Scorer); the others are baselines
    that ignore the cache (used by ``kvstore replay --compare``)."""
    model_name: str = "kvstore-toy"
    """Reported as ``model`` in completions when the request names none."""
    tokenizer: str = ""
    """The replicas' tokenizer: a model directory (tokenizer.json, tokenizer_config.json with its special tokens
    and chat template, or chat_template.jinja) or a lone tokenizer.json. Empty: our workers' own (``kvstore
    serve``); in front of external replicas (``kvstore router``), no tokenizer, so only token-id prompts route.
    ``bytes`` names the built-in model's byte tokenizer (a fleet of ``kvstore worker`` toy models)."""
    vocab_size: NonNegativeInt = 0
    """Token ids must be below this; 0 = ask the replicas (Ray workers) or no check beyond >= 0."""
    max_context: NonNegativeInt = 0
    """Prompt + max_tokens limit; 0 = ask the replicas (Ray workers)."""
    api_key: str = ""
    """When set, every route but /healthz (and /health) needs ``Authorization: Bearer <api_key>``."""
    max_body_bytes: PositiveInt = 4 << 20
    """Larger request bodies get 413."""
    trust_request_chat_template: bool = False
    """Render a ``chat_template`` sent in a chat request (vLLM's ``--trust-request-chat-template``). Off, such a
    request is a 400: a template is a program, and one request's could hold a core and memory for as long as it
    likes. In front of a vLLM fleet, off, the router routes such a request by load alone and forwards it."""
    tool_call_parser: Literal["", ToolCallParser] = ""
    """Parse tool calls out of chat answers with this parser (vLLM's ``--enable-auto-tool-choice
    --tool-call-parser``): ``hermes`` for models that answer ``<tool_call>{"name": ..., "arguments": ...}
    </tool_call>`` (Qwen2.5, Hermes), ``llama3_json`` for Llama 3.1+'s ``{"name": ..., "parameters": ...}``,
    ``mistral`` for Mistral's ``[TOOL_CALLS]`` (a JSON array, or ``name{...}`` per call from v11), ``pythonic``
    for Llama 3.2 / 4's ``[get_weather(city="Paris")]``, ``qwen3_coder`` for Qwen3-Coder's
    ``<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>`` (each value read by
    the type its parameter declares in ``tools``), ``deepseek_v3`` / ``deepseek_v31`` for DeepSeek-V3 / R1 /
    V3.1's ``<｜tool▁calls▁begin｜>`` calls (either name reads both forms), ``glm45`` for GLM-4.5 / 4.6's
    ``<tool_call>NAME<arg_key>..</arg_key><arg_value>..</arg_value></tool_call>``, ``kimi_k2`` for Kimi K2's
    ``<|tool_calls_section_begin|>`` calls.
    Set, a chat with ``tools`` and ``tool_choice`` ``"auto"`` (the default with tools) is served; unset, it is
    a 400. Our workers' fronts only: a vLLM fleet parses its own."""
    reasoning_parser: Literal["", "deepseek_r1", "qwen3"] = ""
    """Split chat answers' reasoning (before ``</think>``) from their content (vLLM's ``--reasoning-parser``):
    the message's ``reasoning`` / ``reasoning_content``. Our workers' fronts only: a vLLM fleet splits its own."""
    max_json_values: PositiveInt = 262_144
    """Array items plus object members a request body may hold (a 256k-token prompt as ids fits); counted on
    the raw bytes before the body is decoded, so a body of a million tiny values costs a scan, not a decode."""
    max_json_containers: PositiveInt = 10_000
    """Arrays plus objects a request body may hold (messages, content parts, tool schemas)."""
    max_json_depth: PositiveInt = 64
    """How deeply arrays and objects may nest in a request body."""
    header_timeout_s: Annotated[float, Meta(gt=0.0)] = 10.0
    """A connection must send a request's headers within this of connecting (or of its request's first byte
    after a keep-alive pause); else 408 and the connection is closed. The same for every HTTP front the
    config starts: ``kvstore serve``, ``kvstore router`` and ``kvstore worker``."""
    body_timeout_s: Annotated[float, Meta(gt=0.0)] = 30.0
    """A request's whole body must arrive within this of its headers; else 408 and the connection is closed."""
    keep_alive_s: Annotated[float, Meta(gt=0.0)] = 5.0
    """An idle keep-alive connection is closed after this."""
    max_connections: PositiveInt = 1024
    """Open HTTP connections beyond this are answered 503 and closed at once."""
    drain_timeout_s: Annotated[float, Meta(ge=0.0)] = 10.0
    """On SIGINT or SIGTERM, requests in flight get this long to finish; then they are cancelled and the
    deployment stops."""
    health_interval_s: Annotated[float, Meta(gt=0.0)] = 1.0
    """How often each replica's load/health is polled."""
    unhealthy_after: PositiveInt = 2
    """Consecutive failed polls before a replica stops being routed to (a failed request is enough)."""
    sync_timeout_s: Annotated[float, Meta(gt=0.0)] = 2.0
    """Deadline of one replay or snapshot request to a producer."""
    request_timeout_s: Annotated[float, Meta(gt=0.0)] = 300.0
    """How long the router waits for a replica's next piece of an answer (its first token, the next chunk, an
    HTTP read) before it gives the replica up: retried elsewhere before any output, else an error. Every
    backend takes it: our Ray workers and external HTTP servers."""
    hash_memo_blocks: NonNegativeInt = 65_536
    """Block hashes the router remembers for prompts that share a prefix, so that routing one costs dict
    lookups rather than SHA-256s (about 500 bytes each: 32 MiB at the default); 0 = hash every prompt anew."""
    replicas: list[ExternalReplica] = msgspec.field(default_factory=list)
    """External OpenAI-compatible replicas (``kvstore router``); ``kvstore serve`` places its own."""
    curve_client_cert: str = ""
    """A ZeroMQ secret certificate (``zmq.auth.create_certificates``' ``.key_secret`` file) with the key pair
    the router presents to CURVE event publishers: needed when they admit only listed clients
    (``events.curve_allowed_client_keys``); list its public key there. Empty: a key pair made at start."""

    def curve_client_keys(self) -> CurveKeyPair | None:
        """The key pair of :attr:`curve_client_cert`, read from its file (ConfigError naming the field); None
        when unset."""
        cert = self.curve_client_cert
        return load_client_cert(cert, field="router.curve_client_cert") if cert else None

    def body_bounds(self) -> BodyBounds:
        """What one request body may hold, for every HTTP front the config starts."""
        return BodyBounds(self.max_body_bytes, self.max_json_values, self.max_json_containers, self.max_json_depth)


class RouterSettings(Protocol):
    """The sections of the configuration tree the router reads (the whole tree satisfies it)."""

    @property
    def cache(self) -> CacheConfig: ...

    @property
    def router(self) -> RouterConfig: ...
