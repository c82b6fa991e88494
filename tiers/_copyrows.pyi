# Type stub for the compiled copy kernel (tiers/_copyrows.c).
from collections.abc import Sequence
from typing import Any

STREAMING_STORES: int
PIECE_BYTES: int
PREFETCH_BYTES: int
MAX_HELPERS: int

class Copier:
    """copy_rows shared with helper threads of its own (tiers/_copyrows.c)."""

    def __init__(self, helpers: int) -> None: ...
    @property
    def helpers(self) -> int: ...
    @property
    def started(self) -> int: ...
    def copy_rows(
        self,
        dst: int,
        dst_count: int,
        src: int,
        src_count: int,
        row_bytes: int,
        src_rows: Sequence[int],
        dst_rows: Sequence[int],
        stream_min: int,
        split_min: int,
        /,
    ) -> int: ...
    def close(self) -> None: ...

def metas_ok(blocks: Sequence[object], meta_type: type, block_size: int, tokens: bool, /) -> bool: ...

# The CPU arena's batch loops (tiers/_books.c): see kvstore.tiers.cpu_arena.
class LeaseCore:
    """The fields of an arena lease (kvstore.tiers.cpu_arena.Lease subclasses it)."""

    _arena: Any
    lease_id: int
    slot: int
    meta: Any
    kind: Any
    granted_at: float | None

def lease_many(
    cls: type[LeaseCore],
    arena: object,
    held: dict[int, Any],
    pins: list[int],
    slot_meta: list[Any] | None,
    index: dict[int, int] | None,
    first_id: int,
    pairs: Sequence[tuple[int, Any]],
    kind: object,
    /,
) -> tuple[list[Any], int]: ...
def match_prefix(index: dict[int, int], slot_meta: list[Any], metas: Sequence[Any], /) -> list[tuple[int, Any]]: ...
def commit_many(
    held: dict[int, Any],
    pins: list[int],
    writing: dict[int, int],
    index: dict[int, int],
    lease_ids: Sequence[int],
    write_kind: object,
    /,
) -> tuple[list[Any], int] | None: ...
def release_many(
    held: dict[int, Any],
    pins: list[int],
    writing: dict[int, int],
    index: dict[int, int],
    slot_meta: list[Any],
    lease_ids: Sequence[int],
    write_kind: object,
    /,
) -> tuple[list[Any], int, list[int]] | None: ...
def grant_many(
    grant_type: type[tuple[Any, ...]], leases: Sequence[LeaseCore], medium: object, now: float, /
) -> list[Any]: ...
def earliest_grant(leases: Sequence[LeaseCore], kind: object, /) -> tuple[int, float | None]: ...
def drop_lru(
    index: dict[int, int], pins: list[int], slot_meta: list[Any], count: int, /
) -> tuple[list[int], list[Any]]: ...
def use_meta_type(meta_type: type, /) -> bool: ...
