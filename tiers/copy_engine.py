"""Batched block copies between a KV pool tensor and the arena's slots.

A batch is a list of (source row, destination row) pairs; consecutive runs
are coalesced into one slice copy each, so neighbouring blocks move as one
large span.

- Host tensors (a CPU worker's pool, the tier store's own staging): the
  runs are split by rows into ``num_threads`` shares, copied with libc
  ``memmove`` (bounds checked first; it releases the GIL): the caller's
  thread copies the first share and the thread pool the others, so the
  caller waits for at most ``num_threads - 1`` hand-offs. Batches of at
  most 1 MiB are copied on the caller's thread alone, where a hand-off
  (a wake-up: tens of microseconds on a loaded machine) would cost more
  than it saves; that path coalesces and copies in one pass over the pairs
  (no run objects, no shares) and reuses the row view of the last pool
  tensor seen (checked by identity, address, shape and dtype each call):
  on 16 KiB blocks the per-call Python was a fifth of the copy.
- CUDA tensors (*CUDA path*, kept thin; no GPU on the development
  machines, so it is exercised only where one exists): the arena is
  registered once per process as pinned memory (``cudaHostRegister``), the
  copies are issued on a side stream -- never the default stream -- that
  first waits on an event recorded on the caller's current stream (so a
  spill sees the KV the compute just wrote), and a second event marks
  completion; a waiter thread resolves the Future when it fires.

Measured and not taken (16 KiB / 192 KiB / 2 MiB blocks, 32 a call, 2-core
host, against one large copy of the same bytes): torch ``index_select``
(gather into arena runs) and ``index_put_`` on a ``complex128`` view (scatter
into pool rows) run on the calling thread's OpenMP team. From the main
thread of an idle machine they reached 0.8-0.9 of the large copy even at
16 KiB, but from any other thread (the worker's offload thread) they fell
to 0.3-0.7 (two OpenMP teams on two cores, the likely cause), and with a second process
busy on one core a 32-block spill took 200-1400 us instead of 150: an
OpenMP team waits for its slowest, descheduled thread. Handing half a small
batch to a pool thread costs a wake-up (+60 us per 512 KiB). libc
``memmove`` on the caller's thread is the steady choice; what it cannot
reach is non-temporal stores, which glibc uses only above
``glibc.cpu.x86_non_temporal_threshold`` (190 MiB on the development host:
no block copy reaches it). Setting it to 128 KiB in a worker's environment
(a process-wide, start-time setting, so a deployment's choice) took 192 KiB blocks from about 0.5 to 1.0 of the
large copy and 2 MiB from 0.9 to 1.3 in two runs each (its baseline moved
too: that setting changes every copy in the process).

Contract: between the call and the Future's completion the caller keeps the
source rows unchanged and the destination rows unread, and holds leases on
the slots involved (``reserve`` for spills, ``acquire`` for promotions).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from kvstore.tiers.errors import InvalidBlockError, TierError

_INLINE_BYTES = 1 << 20  # up to this a batch is copied on the caller's thread alone (a hand-off costs more)


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


def split_runs(runs: list[Run], parts: int) -> list[list[Run]]:
    """At most ``parts`` groups of runs with (nearly) equal rows, cutting runs where needed."""
    total = sum(run.length for run in runs)
    share = -(-total // parts)
    groups: list[list[Run]] = [[]]
    room = share
    for run in runs:
        s, d, n = run
        while n:
            if room == 0:
                groups.append([])
                room = share
            take = min(n, room)
            groups[-1].append(Run(s, d, take))
            s, d, n, room = s + take, d + take, n - take, room - take
    return groups


class CopyEngine:
    """Copies batches of blocks between pool tensors and one arena (``uint8 [slots, block_bytes]``)."""

    def __init__(self, arena: torch.Tensor, *, num_threads: int = 2, pin: bool | None = None) -> None:
        if arena.dtype != torch.uint8 or arena.dim() != 2 or arena.device.type != "cpu":
            raise InvalidBlockError("the arena must be a host uint8 tensor [num_slots, block_bytes]")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._arena = arena
        self.block_bytes = int(arena.shape[1])
        self._threads = num_threads
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="kv-copy")
        use_cuda = torch.cuda.is_available() if pin is None else pin
        self._cuda = _CudaCopier(arena) if use_cuda else None
        self._rows_cache: tuple[torch.Tensor, int, torch.Size, torch.dtype, torch.Tensor] | None = None

    @property
    def pinned(self) -> bool:
        return self._cuda is not None

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
        self._pool.shutdown(wait=True)
        if self._cuda is not None:
            self._cuda.close()
            self._cuda = None

    def _submit(
        self, src: torch.Tensor, src_rows: Sequence[int], dst: torch.Tensor, dst_rows: Sequence[int]
    ) -> Future[None]:
        _check_rows(src_rows, src.shape[0], "source")
        _check_rows(dst_rows, dst.shape[0], "destination")
        if len(src_rows) != len(dst_rows):
            raise InvalidBlockError(f"{len(src_rows)} source rows but {len(dst_rows)} destination rows")
        nbytes = len(src_rows) * self.block_bytes
        if nbytes <= _INLINE_BYTES and not (src.is_cuda or dst.is_cuda):
            # Small batches: copied here, in one pass (the threads' hand-off would cost more than it saves).
            done: Future[None] = Future()
            try:
                _copy_pairs(src, dst, src_rows, dst_rows)
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)
            return done
        runs = coalesce(src_rows, dst_rows)
        if src.is_cuda or dst.is_cuda:
            if self._cuda is None:
                raise TierError("a CUDA tensor was given but this copy engine was built without pinning (pin=False)")
            return self._cuda.copy(src, dst, runs)
        groups = split_runs(runs, self._threads)
        # The caller's thread copies the first share itself (it would only wait otherwise): one hand-off
        # fewer, and a batch too small to be worth a hand-off (tens of microseconds) is copied inline.
        handed = [self._pool.submit(_copy_runs, src, dst, group) for group in groups[1:]]
        mine: Future[None] = Future()
        try:
            _copy_runs(src, dst, groups[0])
        except BaseException as exc:
            mine.set_exception(exc)
        else:
            mine.set_result(None)
        return _gather([mine, *handed]) if handed else mine


def _copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: list[Run]) -> None:
    """Host rows to host rows with libc memmove: it releases the GIL, and -- unlike one ``copy_`` per
    block, which starts an OpenMP team each time -- runs near one large copy's speed (docs/tiers.md)."""
    row = src.shape[1]
    assert dst.shape[1] == row and src.is_contiguous() and dst.is_contiguous(), "host rows must be contiguous"
    src_base, dst_base = src.data_ptr(), dst.data_ptr()
    for s, d, n in runs:
        ctypes.memmove(dst_base + d * row, src_base + s * row, n * row)


def _copy_pairs(src: torch.Tensor, dst: torch.Tensor, src_rows: Sequence[int], dst_rows: Sequence[int]) -> None:
    """:func:`_copy_runs` of ``coalesce(src_rows, dst_rows)``, coalescing and copying in one pass."""
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
