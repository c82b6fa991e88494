# Type stub for the compiled copy kernel (tiers/_copyrows.c).
from collections.abc import Sequence

STREAMING_STORES: int
PIECE_BYTES: int
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
