"""The KV event streams the router follows: what identifies one, and subscribing to it."""

from __future__ import annotations

from typing import NamedTuple

from kvstore.subscriber import CurveKeyPair, EventListener


class ProducerSpec(NamedTuple):
    """One KV event stream; ``rekey`` when it hashes differently from us (e.g. a vLLM fleet).

    ``curve_server_key``: the publisher's CURVE public key (Z85) when it runs with CURVE
    (``events.curve_public_key`` of its config); None for a plain publisher.
    ``curve_client_keys``: the key pair the router presents to it (``router.curve_client_cert``), for a
    publisher that admits only listed clients; None: one made once by the listener.
    """

    name: str
    endpoint: str
    replay_endpoint: str | None
    rekey: bool = False
    topic: str = ""
    curve_server_key: str | None = None
    curve_client_keys: CurveKeyPair | None = None


def subscribe(listener: EventListener, producer: ProducerSpec) -> None:
    """Subscribe ``listener`` to the stream; it starts with a replay (or a snapshot) of what the producer holds."""
    listener.add_producer(
        producer.name,
        producer.endpoint,
        producer.replay_endpoint,
        topic=producer.topic,
        curve_server_key=producer.curve_server_key,
        curve_client_keys=producer.curve_client_keys,
    )
