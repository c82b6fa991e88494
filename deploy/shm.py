"""Whether this node's ``/dev/shm`` can hold the CPU arena, said before anything starts.

The tier actor reserves its whole arena in ``tiers.shm_dir`` when it starts
(prefaulted, so a short tmpfs fails then and not with SIGBUS later). Inside
an actor that failure surfaces as a long ``ActorDiedError`` trace whose one
useful line is at its bottom; checked here, from the same numbers, it is one
line naming the fix, before Ray starts. The arena is RAM too (tmpfs pages),
so it must also fit in the memory the kernel says is available.

Only this node is checked; a tier actor that cannot start on another node is
reported by the launcher, in one line too.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.tiers.config import TierConfig
from kvstore.tiers.shared_memory import HEADER_BYTES


def check_arena_fits(tiers: TierConfig) -> str:
    """What the arena takes here, as a line to print at start; ConfigError naming the fix when it does not fit."""
    if not tiers.enabled:
        return "off (tiers.enabled = false)"
    directory = Path(tiers.shm_dir)
    try:
        stats = os.statvfs(directory)
    except OSError as exc:
        raise ConfigError(f"tiers.shm_dir {directory} is not usable ({exc.strerror}): point it at a tmpfs") from None
    room = stats.f_bavail * stats.f_frsize
    memory = available_memory()
    fits = min(room, memory) if memory is not None else room
    need = tiers.cpu_capacity_bytes + HEADER_BYTES
    if need > fits:
        short = f"{directory} has {size(room)} free" + (
            f" and {size(memory)} of memory is available" if memory is not None and memory < room else ""
        )
        raise ConfigError(
            f"{short}: too little for the {size(tiers.cpu_capacity_bytes)} CPU arena (tiers.cpu_capacity_bytes); "
            f"give {directory} more room (docker run --shm-size=1g; on Kubernetes an emptyDir with medium: Memory), "
            f"or set tiers.cpu_capacity_bytes={max(0, fits - HEADER_BYTES) // 2} (half of what fits), "
            "or tiers.enabled=false"
        )
    return f"CPU arena {size(tiers.cpu_capacity_bytes)} in {directory} ({size(room)} free)"


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where there is none to read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def size(n: int) -> str:
    """Bytes for people: 256 MiB, 23.4 GiB."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n} bytes"
