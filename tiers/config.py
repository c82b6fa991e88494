"""The ``tiers`` section of the configuration: each node's CPU arena and disk tier."""

from __future__ import annotations

import os
from typing import Annotated

import msgspec
from msgspec import Meta

MAX_COPY_THREADS = 65  # the calling thread and at most 64 helpers (the copy kernel's limit)


class TierConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """CPU arena and disk tier of each node (owned by the tiers package).

    Sizes that depend on the model (slots = capacity // block bytes) are
    checked when the tier store starts, where the block size is known.
    """

    enabled: bool = True
    """Start a tier actor on each node; off, evicted GPU blocks are simply dropped."""
    cpu_capacity_bytes: Annotated[int, Meta(ge=1)] = 256 * 1024**2
    """Bytes of the shared-memory CPU arena per node, one slot per block (at least one block:
    disk reads and writes are staged through it). Reserved in full at start, in ``shm_dir`` and so in RAM:
    the default suits the built-in model and fits any host's /dev/shm; size it to the model for real work
    (a block of an 8B model is about 2 MiB). ``kvstore serve`` refuses to start, in one line naming the
    fix, when this node's ``shm_dir`` or memory cannot hold it (Docker's default /dev/shm is 64 MiB)."""
    shm_dir: str = "/dev/shm"
    """Directory of the POSIX shared-memory arena file; must be a tmpfs with room for the arena."""
    cpu_prefault: bool = True
    """Reserve and touch every arena page at start: a too-small /dev/shm fails then, not with SIGBUS later."""
    copy_threads: Annotated[int, Meta(ge=1, le=MAX_COPY_THREADS)] = 2
    """Threads a worker's TierLink copies host blocks with: the calling thread and ``copy_threads - 1``
    helpers (one waits on CUDA events when there is a GPU). The tier actor copies nothing itself:
    workers move the KV."""
    control_socket: bool = True
    """Workers make their hot tier calls (lookup, reserve, commit, acquire, release) over a Unix socket in
    ``shm_dir`` into the tier actor's event loop, about 0.16 ms a round trip against 1.2 ms for a Ray actor
    call on a 2-core VM; off, every call goes through Ray. A worker that cannot see the socket uses Ray."""
    disk_dir: str | None = None
    """Root of the disk tier (one subdirectory per cache identity); None turns the disk tier off. An absolute
    path: the tier actor runs in Ray's working directory, not the directory ``kvstore serve`` was started
    in, so a relative path (or an empty one) would put the cache somewhere nobody meant."""
    disk_capacity_bytes: Annotated[int, Meta(ge=0)] = 64 * 1024**3
    """Bytes of slab files (a slot per block, header included) under the identity's directory; LRU beyond."""
    disk_direct_io: bool = True
    """Use O_DIRECT where the file system and the block size allow it; else buffered I/O."""
    disk_fsync: bool = False
    """fsync a run's slab after its write (survives power loss; the checksum turns torn slots into misses anyway)."""
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

    def __post_init__(self) -> None:
        if self.disk_dir is not None and not os.path.isabs(self.disk_dir):
            got = "empty" if not self.disk_dir else f"relative ({self.disk_dir!r})"
            raise ValueError(
                f"disk_dir must be an absolute path, got {got}: the tier actor's working directory is Ray's, "
                "not yours; leave it unset to turn the disk tier off"
            )
