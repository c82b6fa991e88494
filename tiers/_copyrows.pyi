# Type stub for the compiled copy kernel (tiers/_copyrows.c).
from collections.abc import Sequence

STREAMING_STORES: int

def copy_rows(
    dst: int,
    dst_count: int,
    src: int,
    src_count: int,
    row_bytes: int,
    src_rows: Sequence[int],
    dst_rows: Sequence[int],
    stream_min: int,
    /,
) -> int: ...
