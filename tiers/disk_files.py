"""Block files on POSIX: what one block file's life costs in system calls, run on an I/O thread.

Each of :func:`write_block_file` and :func:`read_block_file` is one file's
whole life on one side -- create the temporary, write, close, rename; or
open, read, check -- so that a block costs one hand-off to an I/O thread
rather than one per system call, and so that the checksum (computed for a
write, verified for a read) is hashed there, off the event loop.

Why the calls are the ones they are:

- A file is written to a temporary name in its final directory and renamed
  into place, so no reader ever sees a half-written file under a block's
  name; a crash leaves only temporaries, which the start-up scan removes.
- Header and payload move in one vectored ``pwritev`` / ``preadv`` from
  offset 0: one device I/O per block, not two.
- With O_DIRECT (the file system takes it and the caller's buffer is
  4096-aligned, as arena slots are) the payload moves between the file and
  the caller's buffer with no page-cache copy; the header then needs an
  aligned buffer too, kept per thread and per size (an mmap per I/O costs
  two more system calls).
- Reads open with O_NOATIME where the kernel allows it: on a ``relatime``
  mount the first read after a write would otherwise dirty the inode, one
  journal write per block file.

Nothing here knows about the index, the capacity or deadlines: a file that
is not what it claims raises :class:`~kvstore.tiers.disk_format.IntegrityError`,
the system's refusals raise ``OSError``, and the disk tier decides what each
means.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import uuid
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


class FileLayout(NamedTuple):
    """What a block file of one cache identity must look like: a reader checks every file against it."""

    identity_digest: bytes
    block_size: int
    block_bytes: int

    @property
    def header_len(self) -> int:
        return header_len(self.block_size)

    @property
    def file_bytes(self) -> int:
        return self.header_len + self.block_bytes


def write_block_file(
    temp: Path, final: Path, meta: BlockMeta, payload: memoryview, layout: FileLayout, direct: bool, fsync: bool
) -> None:
    """Checksum the header, create ``temp``, write header and payload, (fsync,) close, rename to ``final``.

    Raises OSError; the temporary is gone whatever happened.
    """
    head = _header(meta, payload, layout, direct)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o600)
    try:
        _write_and_close(fd, head, payload, fsync)
        os.replace(temp, final)
    except BaseException:
        remove(temp)
        raise


def overwrite_block_file(
    spare: Path, final: Path, meta: BlockMeta, payload: memoryview, layout: FileLayout, direct: bool, fsync: bool
) -> None:
    """:func:`write_block_file` into an existing spare file (a retired block's: its blocks are allocated
    already), then rename it to ``final``. Raises OSError; the spare stays where it was then."""
    head = _header(meta, payload, layout, direct)
    _write_and_close(os.open(spare, os.O_WRONLY | (os.O_DIRECT if direct else 0)), head, payload, fsync)
    os.replace(spare, final)


def _header(meta: BlockMeta, payload: memoryview, layout: FileLayout, direct: bool) -> memoryview:
    """The block's checksummed header; in an aligned buffer for O_DIRECT."""
    header = encode_header(meta, payload, layout.identity_digest)
    if not direct:
        return memoryview(header)
    head = _header_buffer(len(header))
    head[:] = header
    return head


def _write_and_close(fd: int, head: memoryview, payload: memoryview, fsync: bool) -> None:
    try:
        write_all(fd, [head, payload])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_block_file(path: Path, meta: BlockMeta, out: memoryview, direct: bool, layout: FileLayout) -> None:
    """Read ``meta``'s file into ``out`` and check all of it against ``meta`` and ``layout``.

    Raises IntegrityError (naming the reason) for a file that is not ``meta``'s intact block,
    OSError (FileNotFoundError included) for the system's refusals. ``out`` holds garbage then.
    """
    hlen = layout.header_len
    head = _header_buffer(hlen) if direct else memoryview(bytearray(hlen))
    fd = _open_for_read(path, direct)
    try:
        size = os.fstat(fd).st_size
        if size != layout.file_bytes:
            raise IntegrityError("short_read" if size < layout.file_bytes else "bad_length", f"file is {size} bytes")
        got = read_full(fd, [head, out])
    finally:
        os.close(fd)
    header = decode_header(
        head[: min(got, hlen)],
        identity_digest=layout.identity_digest,
        block_size=layout.block_size,
        block_bytes=layout.block_bytes,
    )
    if header.meta.block_hash != meta.block_hash:
        raise IntegrityError("wrong_hash", f"file holds block {header.meta.block_hash:#x}")
    if header.meta != meta:
        raise IntegrityError("wrong_tokens", "file holds other tokens or another parent for this hash")
    verify(header, out[: max(got - hlen, 0)])


def read_header_meta(path: Path, layout: FileLayout) -> BlockMeta:
    """The block a file's header names, checked against ``layout`` (the payload is not read).

    Raises IntegrityError or OSError like :func:`read_block_file`.
    """
    with path.open("rb") as fh:
        raw = fh.read(layout.header_len)
    header = decode_header(
        raw, identity_digest=layout.identity_digest, block_size=layout.block_size, block_bytes=layout.block_bytes
    )
    return header.meta


def direct_io_refusal(directory: Path) -> str | None:
    """None if files in ``directory`` take O_DIRECT writes, else why not (tmpfs before Linux 6.6 refuses)."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    probe = directory / f".probe-{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}"
    buffer = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
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


def write_all(fd: int, views: list[memoryview]) -> None:
    """Write ``views`` back to back from offset 0 in vectored writes (a raw or O_DIRECT file may
    take less than asked; the rest follows)."""
    offset = 0
    pending = views
    while pending:
        written = os.pwritev(fd, pending, offset)
        if not written:
            raise OSError(errno.EIO, "write made no progress")
        offset += written
        pending = _advance(pending, written)


def read_full(fd: int, views: list[memoryview]) -> int:
    """Fill ``views`` back to back from offset 0 with vectored reads; fewer bytes only at end of file."""
    offset = 0
    pending = views
    while pending:
        got = os.preadv(fd, pending, offset)
        if not got:
            break
        offset += got
        pending = _advance(pending, got)
    return offset


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


def _open_for_read(path: Path, direct: bool) -> int:
    """Open without updating the access time where allowed (O_NOATIME needs the file's owner --
    the tier's own files -- and is dropped when refused)."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    if _NOATIME:
        try:
            return os.open(path, flags | _NOATIME)
        except PermissionError:
            pass
    return os.open(path, flags)


_thread_buffers = threading.local()


def _header_buffer(nbytes: int) -> memoryview:
    """This I/O thread's page-aligned buffer of ``nbytes`` for O_DIRECT headers, made once per size."""
    buffers: dict[int, memoryview] | None = getattr(_thread_buffers, "headers", None)
    if buffers is None:
        buffers = _thread_buffers.headers = {}
    view = buffers.get(nbytes)
    if view is None:
        view = buffers[nbytes] = memoryview(mmap.mmap(-1, nbytes))
    return view


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
