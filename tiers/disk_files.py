"""Slab files on POSIX: what a run of slots costs in system calls, run on an I/O thread.

Each of :func:`write_run` and :func:`read_run` is one run's whole life on
one side -- open the slab, one vectored ``pwritev`` / ``preadv`` of every
block's header and payload, close; then (reads) check each block -- so a
run of blocks costs one hand-off to an I/O thread and one device I/O, and
the checksums (computed for a write, verified for a read) are hashed there,
off the event loop.

Why the calls are the ones they are:

- A run is consecutive slots of one slab: headers and payloads alternate in
  the file exactly as they do in the iovec list, so one call moves them all
  (at most :data:`MAX_RUN_BLOCKS` blocks: the kernel takes 1024 iovecs).
- The slab is opened per run rather than kept open: a file held open for
  writing would stop a read-only remount, and an ``open`` is cheap beside a
  run of several blocks.
- Slabs are allocated in full when they grow (:func:`grow_slab`,
  ``posix_fallocate``): writes into them then allocate nothing, which is
  what a small-block write used to cost most (a new file per block), and a
  full disk shows up when a slab grows, not in the middle of a run.
- With O_DIRECT (the file system takes it and every buffer of the run is
  4096-aligned, as arena slots are) the payloads move between the slab and
  the caller's buffers with no page-cache copy; the headers then need
  aligned buffers too, kept per thread (an mmap per I/O costs two more
  system calls).
- Reads open with O_NOATIME where the kernel allows it: on a ``relatime``
  mount the first read after a write would otherwise dirty the inode.
- Every open goes through :func:`open_slab`: O_NOFOLLOW, O_NONBLOCK, then
  ``fstat``. A slab name is never followed out of the tier's directory (a
  symlink there -- dangling or to a user's file -- would have the kernel
  write slab data into whatever it names), and anything but a regular file
  (a FIFO would block the I/O thread, a directory takes no slab) is refused
  with an OSError: ``ELOOP`` for a link, ``EINVAL`` for the rest.

Nothing here knows about the index, the capacity or deadlines: a block that
is not what it claims is answered with an
:class:`~kvstore.tiers.disk_format.IntegrityError` in its place, the
system's refusals raise ``OSError``, and the disk tier decides what each
means.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import stat
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.disk_format import (
    ALIGN,
    TEMP_SUFFIX,
    IntegrityError,
    decode_header,
    encode_header,
    header_len,
    verify,
)

logger = logging.getLogger(__name__)

MAX_RUN_BLOCKS = 512  # two iovecs per block; the kernel's limit is 1024


class FileLayout(NamedTuple):
    """What a slot of one cache identity must look like: a reader checks every slot against it."""

    identity_digest: bytes
    block_size: int
    block_bytes: int

    @property
    def header_len(self) -> int:
        return header_len(self.block_size)

    @property
    def file_bytes(self) -> int:
        """Bytes of one slot: header, then payload."""
        return self.header_len + self.block_bytes


class RunWrite(NamedTuple):
    """One block of a run to write: its meta, payload and write sequence number."""

    meta: BlockMeta
    payload: memoryview
    sequence: int


def write_run(
    path: Path, offset: int, blocks: Sequence[RunWrite], layout: FileLayout, direct: bool, fsync: bool
) -> None:
    """Checksum each block's header, then write headers and payloads of consecutive slots from ``offset``
    of slab ``path`` in one vectored write (fsync if asked). Raises OSError; the slots hold anything then."""
    hlen = layout.header_len
    heads = _header_buffer(hlen * len(blocks)) if direct else memoryview(bytearray(hlen * len(blocks)))
    views: list[memoryview] = []
    for i, block in enumerate(blocks):
        head = heads[i * hlen : (i + 1) * hlen]
        head[:] = encode_header(block.meta, block.payload, layout.identity_digest, block.sequence)
        views += (head, block.payload)
    fd = open_slab(path, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0))  # made again if removed
    try:
        write_all(fd, views, offset)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_run(
    path: Path, offset: int, blocks: Sequence[tuple[BlockMeta, memoryview]], direct: bool, layout: FileLayout
) -> list[IntegrityError | None]:
    """Read consecutive slots from ``offset`` of slab ``path`` into each block's buffer in one vectored
    read, then check each against its meta and ``layout``: one answer per block, None when intact.

    Raises OSError (FileNotFoundError included) for the system's refusals: then no buffer holds anything
    to use. A block answered with an IntegrityError leaves garbage in its buffer.
    """
    hlen = layout.header_len
    heads = _header_buffer(hlen * len(blocks)) if direct else memoryview(bytearray(hlen * len(blocks)))
    views: list[memoryview] = []
    for i, (_, out) in enumerate(blocks):
        views += (heads[i * hlen : (i + 1) * hlen], out)
    fd = _open_for_read(path, direct)
    try:
        got = read_full(fd, views, offset)
    finally:
        os.close(fd)
    answers: list[IntegrityError | None] = []
    for i, (meta, out) in enumerate(blocks):
        have = got - i * layout.file_bytes
        try:
            if have < layout.file_bytes:
                raise IntegrityError("short_read", f"slot ends {max(have, 0)} bytes in (the slab is short)")
            check_block(heads[i * hlen : (i + 1) * hlen], meta, out, layout)
        except IntegrityError as exc:
            answers.append(exc)
        else:
            answers.append(None)
    return answers


def check_block(head: memoryview, meta: BlockMeta, payload: memoryview, layout: FileLayout) -> None:
    """Raise IntegrityError unless ``head`` and ``payload`` are ``meta``'s intact block."""
    header = decode_header(
        head, identity_digest=layout.identity_digest, block_size=layout.block_size, block_bytes=layout.block_bytes
    )
    if header.meta.block_hash != meta.block_hash:
        raise IntegrityError("wrong_hash", f"slot holds block {header.meta.block_hash:#x}")
    if header.meta != meta:
        raise IntegrityError("wrong_tokens", "slot holds other tokens or another parent for this hash")
    verify(header, payload)


def grow_slab(path: Path, old_bytes: int, new_bytes: int) -> None:
    """Create (0600) or extend slab ``path`` from ``old_bytes`` to ``new_bytes``, allocated in full.

    Raises OSError (ENOSPC: the file system is full; ELOOP / EINVAL / EISDIR: the name is taken by a link or
    by something that is not a regular file, left as it is); the slab is cut back to ``old_bytes`` then (a
    slab it created is removed).
    """
    fd = open_slab(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.posix_fallocate(fd, old_bytes, new_bytes - old_bytes)
    except OSError:
        try:
            os.ftruncate(fd, old_bytes)
        except OSError as exc:
            logger.warning("could not cut %s back to %d bytes: %s", path, old_bytes, exc)
        if not old_bytes:
            remove(path)
        raise
    finally:
        os.close(fd)


def invalidate_slot(path: Path, offset: int, hlen: int) -> bool:
    """Zero a slot's header so no later start-up scan takes it for a block; False if refused (logged)."""
    try:
        fd = open_slab(path, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes(hlen), offset)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.warning("could not invalidate the slot at byte %d of %s: %s", offset, path, exc)
        return False
    return True


def read_header_at(fd: int, offset: int, layout: FileLayout) -> tuple[BlockMeta, int] | None:
    """The block and write sequence a slot's header names, checked against ``layout`` (payload not read);
    None for a header of zeros -- a free slot: never written, or invalidated.

    Raises IntegrityError (``bad_magic`` for a header that is neither zeros nor a block's: damage, or
    bytes that were never a slab's) or OSError like :func:`read_run`.
    """
    raw = os.pread(fd, layout.header_len, offset)
    if raw.count(0) == len(raw) == layout.header_len:
        return None
    header = decode_header(
        raw, identity_digest=layout.identity_digest, block_size=layout.block_size, block_bytes=layout.block_bytes
    )
    return header.meta, header.sequence


def direct_io_refusal(directory: Path) -> str | None:
    """None if files in ``directory`` take O_DIRECT writes, else why not (tmpfs before Linux 6.6 refuses)."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    probe = directory / f".probe-{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}"
    buffer = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | _NOFOLLOW, 0o600)
        try:
            os.write(fd, buffer)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"the file system rejects O_DIRECT: {exc.strerror}"
    finally:
        remove(probe)
        buffer.close()
    return None


def aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can use ``view``: writable, contiguous, start and length 4096-aligned."""
    if view.readonly or not view.c_contiguous or view.nbytes % ALIGN:
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return address % ALIGN == 0


def write_all(fd: int, views: list[memoryview], offset: int = 0) -> None:
    """Write ``views`` back to back from ``offset`` in vectored writes (a raw or O_DIRECT file may
    take less than asked; the rest follows)."""
    pending = views
    while pending:
        written = os.pwritev(fd, pending, offset)
        if not written:
            raise OSError(errno.EIO, "write made no progress")
        offset += written
        pending = _advance(pending, written)


def read_full(fd: int, views: list[memoryview], offset: int = 0) -> int:
    """Fill ``views`` back to back from ``offset`` with vectored reads; bytes read (fewer only at end
    of file)."""
    start = offset
    pending = views
    while pending:
        got = os.preadv(fd, pending, offset)
        if not got:
            break
        offset += got
        pending = _advance(pending, got)
    return offset - start


def remove(path: Path, *, log: bool = True) -> bool:
    """Unlink ``path``; True once it is gone (already gone is fine). Any other failure -- a read-only
    file system, say -- is logged (unless ``log`` is off) and answered False, never raised: the caller
    keeps counting the file."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if log:
            logger.warning("could not remove %s: %s", path, exc)
        return False
    return True


def errno_name(exc: OSError) -> str:
    """``ENOSPC``, ``EIO``, ...: how the tier counts system errors (a metric label)."""
    return errno.errorcode.get(exc.errno or 0, "unknown")


_NOATIME = getattr(os, "O_NOATIME", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def open_slab(path: Path, flags: int) -> int:
    """``os.open`` of a slab (created 0600 with O_CREAT) that follows no symlink and opens nothing but a
    regular file: a link at ``path`` raises ELOOP, any other non-regular file EINVAL (O_NONBLOCK keeps a
    FIFO from blocking the open; it changes nothing for a regular file). Raises OSError."""
    fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_for_read(path: Path, direct: bool) -> int:
    """Open without updating the access time where allowed (O_NOATIME needs the file's owner --
    the tier's own files -- and is dropped when refused)."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    if _NOATIME:
        try:
            return open_slab(path, flags | _NOATIME)
        except PermissionError:
            pass
    return open_slab(path, flags)


_thread_buffers = threading.local()


def _header_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of this I/O thread's page-aligned buffer for O_DIRECT headers (grown when a longer
    run needs it, never shrunk: one run's headers at a time per thread)."""
    view: memoryview | None = getattr(_thread_buffers, "headers", None)
    if view is None or view.nbytes < nbytes:
        view = _thread_buffers.headers = memoryview(mmap.mmap(-1, max(nbytes, ALIGN)))
    return view[:nbytes]


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """What is left of ``views`` after their first ``done`` bytes."""
    rest = []
    for view in views:
        if done >= view.nbytes:
            done -= view.nbytes
            continue
        rest.append(view[done:])
        done = 0
    return rest
