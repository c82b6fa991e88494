"""kvstore core: hashing, block pool, KV cache manager, events and their transport.

No Ray here: every other package (workers, tiers, router, deploy) builds on this one. The layers above
live in this package too (``kvstore.workers``, ``kvstore.tiers``, ...), but nothing here imports them.
"""

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.config import CacheConfig, EventsConfig, PoolConfig
from kvstore.errors import ConfigError, EventDecodeError, InvalidRequestError, KVStoreError
from kvstore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecoder,
    EventEncoder,
    KVEvent,
)
from kvstore.hashing import BlockHash, BlockHasher, ExternalBlockHash, to_external
from kvstore.kv_cache_manager import CacheRequest, KVCacheManager, PrefixHit
from kvstore.producer_stream import ProducerStream, SyncState
from kvstore.publisher import NullEventPublisher, Snapshot, ZmqEventPublisher
from kvstore.subscriber import EventListener

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CacheRequest",
    "ConfigError",
    "EventBatch",
    "EventDecodeError",
    "EventDecoder",
    "EventEncoder",
    "EventListener",
    "EventsConfig",
    "ExternalBlockHash",
    "InvalidRequestError",
    "KVCacheBlock",
    "KVCacheManager",
    "KVEvent",
    "KVStoreError",
    "NullEventPublisher",
    "PoolConfig",
    "PrefixHit",
    "ProducerStream",
    "Snapshot",
    "SyncState",
    "ZmqEventPublisher",
    "to_external",
]
