"""Batched block copies between a KV pool tensor and the arena's slots.

A batch is a list of (source row, destination row) pairs; consecutive runs
are coalesced into one slice copy each, so neighbouring blocks move as one
large span.

- Host tensors (a CPU worker's pool, the tier store's own staging): each
  pair list is copied in one pass that coalesces and copies. Where the
  compiled kernel (``kvstore.tiers._copyrows``, built from
  ``tiers/_copyrows.c`` at install) is present, that pass is one call of the
  engine's ``Copier``, on the caller's thread: it checks every row, then
  copies with the GIL released, writing runs of at least
  ``stream_min_bytes`` with non-temporal (streaming) stores. A batch of at
  least ``SPLIT_MIN_BYTES`` is shared with the Copier's ``num_threads - 1``
  helper threads (C threads of its own, asleep between batches): the runs
  are cut into pieces and every thread, the caller's included, takes the
  next piece until none is left (in a job of more than two pieces a
  thread, claiming it before copying the one it holds, so the copy can
  prefetch it), so a helper that wakes late costs the caller at most the
  two pieces it holds. Every copy prefetches
  ``PREFETCH_BYTES`` (8 KiB) ahead of its loads, across the end of a run
  into the next one its thread copies. Without the kernel, a Python loop
  around libc ``memmove`` (bounds checked first); batches over 1 MiB are
  then split by pairs into ``num_threads`` shares, the caller's thread
  copying the first and a thread pool the others. The row view of the last
  pool tensor seen is reused (checked by identity, address, shape and dtype
  each call).
- CUDA tensors (*CUDA path*, kept thin; no GPU on the development
  machines, so it is exercised only where one exists): the arena is
  registered once per process as pinned memory (``cudaHostRegister``), the
  copies are issued on a side stream -- never the default stream -- that
  first waits on an event recorded on the caller's current stream (so a
  spill sees the KV the compute just wrote), and a second event marks
  completion; a waiter thread resolves the Future when it fires.

Why streaming stores (measured on the 2-core development host, scattered
rows, 32 blocks a call, against one large ``torch`` copy of the same bytes,
which glibc writes with non-temporal stores): glibc's ``memmove`` switches
to them only above ``glibc.cpu.x86_non_temporal_threshold`` (about 190 MiB
there), which no block copy reaches, so every destination line was first
read for ownership. Bare copies with the kernel's streaming stores against
``memmove``: 192 KiB blocks on two threads 0.89 against 0.78 of the large
copy, 2 MiB 1.27 against 1.0, 16 KiB on one thread 0.49 against 0.44. A
spill's destination (the arena) is not read back until a promotion, and a
promotion's is read once by the model, so nothing is lost by bypassing the
cache. ``stream_min_bytes=0`` turns them off.

Why the kernel's own threads (same host and baseline, 128 blocks a call):
sharing a batch through the Python thread pool cost two thread wake-ups
and two GIL hand-offs per call, about 120 us; a 16 KiB block then copied
at 2.94 us against the large copy's 1.55. The Copier's helpers take pieces
without the GIL and the caller waits at most for the two pieces a late helper
claimed: 1.56 against 1.35 (16 KiB), and 192 KiB blocks at 32 a call now match the
large copy (14.9 us against 16.1). Below 256 KiB a batch stays on the
caller's thread: there waking a helper cost more than it saved.

Why the prefetch (same host, 1 GiB of 16 KiB pool rows in random order into
consecutive arena slots, C loops outside Python): the hardware prefetchers
follow a stream only within a 4 KiB page and only once it has run a while,
so each scattered row began with a burst of cache misses. One thread copied
a row in 1.57 us without a software prefetch and 0.98-1.07 with one 4-16 KiB
ahead (one contiguous ``memcpy`` of the same bytes: 0.80); two threads 0.85-0.88
and 0.72-0.76. 32 KiB ahead, beyond the next row, was as slow as none; 192 KiB
and 2 MiB rows did not change either way.

Measured and not taken: torch ``index_select`` (gather into arena runs) and
``index_put_`` (scatter into pool rows) run on the calling thread's OpenMP
team: from the main thread of an idle machine they reached 0.8-0.9 of the
large copy even at 16 KiB, but from any other thread (the worker's offload
thread) they fell to 0.3-0.7, and with a second process busy on one core a
32-block spill took 200-1400 us instead of 150: an OpenMP team waits for its
slowest, descheduled thread. Handing half a small batch to a pool thread
costs a wake-up (+60 us per 512 KiB).

Contract: between the call and the Future's completion the caller keeps the
source rows unchanged and the destination rows unread, and holds leases on
the slots involved (``reserve`` for spills, ``acquire`` for promotions).
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvstore.tiers.config import MAX_COPY_THREADS
from kvstore.tiers.errors import InvalidBlockError, TierError

if TYPE_CHECKING:
    from kvstore.tiers._copyrows import Copier

_native: ModuleType | None
try:
    _native = importlib.import_module("kvstore.tiers._copyrows")
except ImportError:  # built without a C compiler: the ctypes.memmove loop copies the same bytes
    _native = None

NATIVE = _native is not None  # whether this process copies host rows with the compiled kernel
_INLINE_BYTES = 1 << 20  # memmove path: up to this a batch is copied on the caller's thread alone
SPLIT_MIN_BYTES = 256 * 1024  # kernel path: a batch this large is shared with the Copier's helper threads
STREAM_MIN_BYTES = 16 * 1024  # runs at least this long are written with streaming stores (0: never)


class Run(NamedTuple):
    src: int  # first source row
    dst: int  # first destination row
    length: int  # rows


def block_rows(tensor: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """A contiguous block-major tensor as ``uint8 [num_blocks, block_bytes]`` rows, aliasing it."""
    if not tensor.is_contiguous():
        raise InvalidBlockError("block tensors must be contiguous (the worker's pool is allocated so)")
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        raise InvalidBlockError(f"expected a block-major tensor with blocks, got shape {tuple(tensor.shape)}")
    rows = tensor.view(tensor.shape[0], -1).view(torch.uint8)
    if rows.shape[1] != block_bytes:
        raise InvalidBlockError(
            f"a block of this tensor is {rows.shape[1]} bytes ({tuple(tensor.shape[1:])} {tensor.dtype}); "
            f"the tier's blocks are {block_bytes} bytes"
        )
    return rows


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Runs of pairs that advance together by one row, in the order given."""
    if len(src) != len(dst):
        raise InvalidBlockError(f"{len(src)} source rows but {len(dst)} destination rows")
    runs: list[Run] = []
    if not src:
        return runs
    start_s, start_d, length = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:], strict=True):
        if s == start_s + length and d == start_d + length:
            length += 1
        else:
            runs.append(Run(start_s, start_d, length))
            start_s, start_d, length = s, d, 1
    runs.append(Run(start_s, start_d, length))
    return runs


class CopyEngine:
    """Copies batches of blocks between pool tensors and one arena (``uint8 [slots, block_bytes]``)."""

    def __init__(
        self,
        arena: torch.Tensor,
        *,
        num_threads: int = 2,
        pin: bool | None = None,
        native: bool | None = None,
        stream_min_bytes: int = STREAM_MIN_BYTES,
    ) -> None:
        """``native``: copy host rows with the compiled kernel (None: where it was built; True: it must
        be; False: the ``ctypes.memmove`` loop). ``stream_min_bytes``: the kernel writes runs at least
        this long with streaming stores (0: never)."""
        if arena.dtype != torch.uint8 or arena.dim() != 2 or arena.device.type != "cpu":
            raise InvalidBlockError("the arena must be a host uint8 tensor [num_slots, block_bytes]")
        if not 1 <= num_threads <= MAX_COPY_THREADS:
            raise ValueError(f"num_threads must be in 1..{MAX_COPY_THREADS}, got {num_threads}")
        if stream_min_bytes < 0:
            raise ValueError(f"stream_min_bytes must be >= 0, got {stream_min_bytes}")
        if native and not NATIVE:
            raise TierError("the compiled copy kernel (kvstore.tiers._copyrows) is not built in this install")
        self._arena = arena
        self.block_bytes = int(arena.shape[1])
        self._stream_min = stream_min_bytes
        self._threads = num_threads
        # The kernel's Copier shares batches with threads of its own; the memmove path uses a Python pool.
        self._copier: Copier | None = None
        self._pool: ThreadPoolExecutor | None = None
        if (NATIVE if native is None else native) and _native is not None:
            self._copier = _native.Copier(num_threads - 1)
        else:
            self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="kv-copy")
        use_cuda = torch.cuda.is_available() if pin is None else pin
        self._cuda = _CudaCopier(arena) if use_cuda else None
        self._rows_cache: tuple[torch.Tensor, int, torch.Size, torch.dtype, torch.Tensor] | None = None

    @property
    def pinned(self) -> bool:
        return self._cuda is not None

    @property
    def native(self) -> bool:
        """Whether host rows are copied by the compiled kernel (else the ``ctypes.memmove`` loop)."""
        return self._copier is not None

    def spill(self, src: torch.Tensor, src_blocks: Sequence[int], dst_slots: Sequence[int]) -> Future[None]:
        """Copy pool rows ``src_blocks`` of ``src`` into arena slots ``dst_slots`` (pairwise)."""
        return self._submit(self._rows(src), src_blocks, self._arena, dst_slots)

    def promote(self, src_slots: Sequence[int], dst: torch.Tensor, dst_blocks: Sequence[int]) -> Future[None]:
        """Copy arena slots ``src_slots`` into pool rows ``dst_blocks`` of ``dst`` (pairwise)."""
        return self._submit(self._arena, src_slots, self._rows(dst), dst_blocks)

    def _rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """``block_rows(tensor)``, the last one reused while the tensor is the same object at the same
        address with the same shape and dtype (a worker passes its one pool tensor on every call)."""
        cached = self._rows_cache
        if (
            cached is not None
            and cached[0] is tensor
            and cached[1] == tensor.data_ptr()
            and cached[2] == tensor.shape
            and cached[3] == tensor.dtype
            and not tensor.is_cuda
        ):
            return cached[4]
        rows = block_rows(tensor, self.block_bytes)
        self._rows_cache = (tensor, tensor.data_ptr(), tensor.shape, tensor.dtype, rows)
        return rows

    def close(self) -> None:
        """Finish queued copies, stop the threads and unpin the arena. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._copier is not None:
            self._copier.close()
        if self._cuda is not None:
            self._cuda.close()
            self._cuda = None

    def _submit(
        self, src: torch.Tensor, src_rows: Sequence[int], dst: torch.Tensor, dst_rows: Sequence[int]
    ) -> Future[None]:
        if len(src_rows) != len(dst_rows):
            raise InvalidBlockError(f"{len(src_rows)} source rows but {len(dst_rows)} destination rows")
        if src.is_cuda or dst.is_cuda:
            _check_pairs(src, src_rows, dst, dst_rows)
            if self._cuda is None:
                raise TierError("a CUDA tensor was given but this copy engine was built without pinning (pin=False)")
            return self._cuda.copy(src, dst, coalesce(src_rows, dst_rows))
        if self._copier is not None:
            # The kernel checks every row before any byte moves, and shares a large batch with its helpers.
            return _copied_here(_copy_pairs_native, src, dst, src_rows, dst_rows, self._stream_min, self._copier)
        _check_pairs(src, src_rows, dst, dst_rows)
        count = len(src_rows)
        if count * self.block_bytes <= _INLINE_BYTES or self._threads == 1:
            return _copied_here(_copy_pairs, src, dst, src_rows, dst_rows)  # a hand-off would cost more
        # Split by pairs (every row checked above): the caller's thread copies the first share itself (it would
        # only wait otherwise) and the pool the others.
        pool = self._pool
        assert pool is not None, "the memmove path has a thread pool"
        share = -(-count // self._threads)
        cuts = range(share, count, share)
        handed = [
            pool.submit(_copy_pairs, src, dst, src_rows[cut : cut + share], dst_rows[cut : cut + share]) for cut in cuts
        ]
        mine = _copied_here(_copy_pairs, src, dst, src_rows[:share], dst_rows[:share])
        return _gather([mine, *handed])


def _copied_here(copy: Callable[..., object], *args: object) -> Future[None]:
    """Run ``copy(*args)`` on this thread, as a done Future: a copy's failure is its exception, but a bad
    batch (InvalidBlockError, the caller's mistake) is raised here, as every other bad batch is."""
    done: Future[None] = Future()
    try:
        copy(*args)
    except InvalidBlockError:
        raise
    except BaseException as exc:
        done.set_exception(exc)
    else:
        done.set_result(None)
    return done


def _copy_pairs_native(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_rows: Sequence[int],
    dst_rows: Sequence[int],
    stream_min: int,
    copier: Copier,
    split_min: int = SPLIT_MIN_BYTES,
) -> int:
    """:func:`_copy_pairs` in one call of the compiled kernel's ``copier`` (rows checked there, before any
    byte moves; streaming stores for runs of at least ``stream_min`` bytes; a batch of at least
    ``split_min`` bytes shared with its helper threads). Returns the number of runs copied."""
    row = src.shape[1]
    assert dst.shape[1] == row and src.is_contiguous() and dst.is_contiguous(), "host rows must be contiguous"
    try:
        return copier.copy_rows(
            dst.data_ptr(), dst.shape[0], src.data_ptr(), src.shape[0], row, src_rows, dst_rows, stream_min, split_min
        )
    except IndexError as exc:
        raise InvalidBlockError(str(exc)) from None


def _copy_pairs(src: torch.Tensor, dst: torch.Tensor, src_rows: Sequence[int], dst_rows: Sequence[int]) -> None:
    """Pool rows to arena rows (or back) with libc memmove, which releases the GIL: runs of pairs that
    advance together are coalesced and copied as one span, in one pass over the pairs (no run objects).
    The rows must have been checked."""
    if not src_rows:
        return
    row = src.shape[1]
    assert dst.shape[1] == row and src.is_contiguous() and dst.is_contiguous(), "host rows must be contiguous"
    src_base, dst_base = src.data_ptr(), dst.data_ptr()
    memmove = ctypes.memmove
    pairs = zip(src_rows, dst_rows, strict=True)
    start_s, start_d = next(pairs)
    end_s, end_d = start_s + 1, start_d + 1
    for s, d in pairs:
        if s == end_s and d == end_d:
            end_s += 1
            end_d += 1
            continue
        memmove(dst_base + start_d * row, src_base + start_s * row, (end_s - start_s) * row)
        start_s, start_d, end_s, end_d = s, d, s + 1, d + 1
    memmove(dst_base + start_d * row, src_base + start_s * row, (end_s - start_s) * row)


def _check_pairs(src: torch.Tensor, src_rows: Sequence[int], dst: torch.Tensor, dst_rows: Sequence[int]) -> None:
    """InvalidBlockError unless every row is inside its tensor."""
    _check_rows(src_rows, src.shape[0], "source")
    _check_rows(dst_rows, dst.shape[0], "destination")


def _check_rows(rows: Sequence[int], limit: int, what: str) -> None:
    if rows and (min(rows) < 0 or max(rows) >= limit):
        bad = next(row for row in rows if not 0 <= row < limit)
        raise InvalidBlockError(f"{what} row {bad} is outside 0..{limit - 1}")


def _gather(parts: list[Future[None]]) -> Future[None]:
    """One Future for several: done when all are, failed with the first failure."""
    combined: Future[None] = Future()
    if not parts:
        combined.set_result(None)
        return combined
    remaining = [len(parts)]

    def done(part: Future[None]) -> None:
        error = part.exception()
        if error is not None and not combined.done():
            combined.set_exception(error)
        remaining[0] -= 1
        if remaining[0] == 0 and not combined.done():
            combined.set_result(None)

    for part in parts:
        part.add_done_callback(done)
    return combined


class _CudaCopier:
    """CUDA path: pinned arena, side-stream copies ordered by events. Thin on purpose."""

    def __init__(self, arena: torch.Tensor) -> None:
        self._arena = arena
        status = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel() * arena.element_size(), 0)
        if int(status) != 0:
            raise TierError(f"cudaHostRegister of the arena failed with CUDA error {int(status)}")
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="kv-copy-cuda")

    def copy(self, src: torch.Tensor, dst: torch.Tensor, runs: list[Run]) -> Future[None]:
        device = src.device if src.is_cuda else dst.device
        stream = self._streams.get(device.index or 0)
        if stream is None:
            stream = self._streams[device.index or 0] = torch.cuda.Stream(device=device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            for s, d, n in runs:
                dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
            done.record(stream)
        return self._waiter.submit(done.synchronize)

    def close(self) -> None:
        self._waiter.shutdown(wait=True)
        torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())
