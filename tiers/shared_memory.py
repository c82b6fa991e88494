"""Fixed-size slots in one POSIX shared-memory file that every process of a node can map.

Layout of ``<shm_dir>/<name>``::

    [0, 4096)                      header: magic, version, owner pid, slot count, slot bytes, tag
    [4096 + i*slot_bytes, +slot_bytes)   slot i

Slots start on a page boundary, so with ``slot_bytes`` a multiple of 4096
every slot is page-aligned (what O_DIRECT and pinned DMA want).

Why a /dev/shm file and not :mod:`multiprocessing.shared_memory`: the file
is reserved with ``posix_fallocate`` (a /dev/shm too small for the arena
fails at creation with a clear error instead of a SIGBUS on first touch),
and attaching processes are not enrolled in the multiprocessing resource
tracker, which unlinks segments it did not create when the attaching
process exits (Python < 3.13).

Ownership: the creator owns the name and unlinks it on :meth:`close` (and at
interpreter exit); attachers only unmap. The owner holds an exclusive
``flock`` on the file from the moment it is created until it is closed, so
"its owner is gone" is a fact the kernel keeps: the lock drops when the
owner's last descriptor closes, however it died. A killed owner runs no
clean-up, so every :meth:`create` first unlinks ``kvstore-*`` arenas of this
user whose lock it can take, and a name taken by a dead owner is reused.
The directory is every user's (/dev/shm is world-writable and sticky): a
sweep opens entries without blocking or following links and judges only
regular files of its own user, so no one's FIFO, link or arena can stall or
fail another user's tier start; another user's dead arena is theirs to
reclaim.

Why a lock and not the owner's pid in the header: the header is written only
after ``posix_fallocate`` and a ``MAP_POPULATE`` mmap, which take seconds for
a multi-GiB arena, so a creator killed in between leaves a file with no pid
to judge (its name could then never be created again); a pid can also be
reused, and is meaningless from another pid namespace sharing the directory.
A lock covers all three. (Creating under a temporary name and renaming it
into place would leave the same headerless file under the temporary name.)
A sweep therefore unlinks an unlocked file that holds an arena header or
nothing but zeros (what a killed creator leaves); any other file is not an
arena and stays. Arenas of format 3, whose owners took no lock, are still
judged by their owner's pid.

Rules that keep this sound: attachers take no lock (an arena whose owner
died is reclaimed while workers still map it: they keep the memory, the name
goes); a creator checks, once it holds the lock, that the name still is its
file (a sweep may take the fresh, not yet locked, empty file for a dead one),
and creates again if not; a sweep and a closing owner unlink the name only
while it still names the file they hold, so neither removes an arena created
since under the same name. The lock's descriptor is not inherited across
exec; a child forked by the owner shares the lock until it exits (and maps
the arena until then anyway).

Tensors and memoryviews handed out alias the mapping: after close() the name
is gone at once, and the memory stays mapped while any such view lives
(unmapping under a live tensor would crash its next access); it is unmapped
by a later close() or when the object is collected.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import stat
import struct
import weakref
from pathlib import Path
from typing import NamedTuple

import torch

from kvstore.tiers.control import SUFFIX as CONTROL_SUFFIX
from kvstore.tiers.errors import ArenaError

logger = logging.getLogger(__name__)

MAGIC = b"KVSARENA"
# 2: the owner's pid namespace joined the header; 3: an incarnation id; 4: the owner holds an exclusive flock
VERSION = 4
HEADER_BYTES = 4096
# magic, version, reserved, owner pid, owner's pid namespace (inode), num slots, slot bytes, incarnation, tag
_HEADER = struct.Struct("<8sHHIQQQQ64s")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


class ArenaInfo(NamedTuple):
    """What another process needs to map an arena: pass it to :meth:`SharedSlots.attach`."""

    name: str
    shm_dir: str
    num_slots: int
    slot_bytes: int
    tag: str  # the creator's label (the tier store puts its cache identity digest here)
    incarnation: int  # random per created arena: a re-created arena of the same name has another


class SharedSlots:
    """``num_slots`` slots of ``slot_bytes`` bytes in shared memory; no bookkeeping of their use.

    Create with :meth:`create` (owner) or :meth:`attach` (any other process
    of the node). :attr:`tensor` is a zero-copy ``uint8 [num_slots,
    slot_bytes]`` view; :meth:`view` a memoryview of one slot.
    """

    def __init__(self, path: Path, mapping: mmap.mmap, *, owner_fd: int | None = None) -> None:
        """Wrap a mapping whose header is written. ``owner_fd``: the creator's descriptor of the file, holding
        its lock; this object then owns it (closed, after unlinking the name, on close or collection)."""
        raw = mapping[: _HEADER.size]
        magic, version, _, _, _, num_slots, slot_bytes, incarnation, tag = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise ArenaError(f"{path} is not a kvstore arena (bad magic)")
        if version != VERSION:
            raise ArenaError(f"{path} has arena format {version}; this kvstore reads {VERSION}")
        if len(mapping) != HEADER_BYTES + num_slots * slot_bytes:
            raise ArenaError(f"{path} is {len(mapping)} bytes; its header says {num_slots} x {slot_bytes}")
        tag = tag.rstrip(b"\0")
        try:
            label = tag.decode()
        except UnicodeDecodeError:
            raise ArenaError(f"{path} has a corrupt tag {tag!r} (not UTF-8): not an arena this kvstore wrote") from None
        self.path = path
        self.name = path.name
        self.num_slots: int = num_slots
        self.slot_bytes: int = slot_bytes
        self.tag: str = label
        self.incarnation: int = incarnation
        self.owner = owner_fd is not None
        self._mmap = mapping
        # Built on a memoryview (not the mmap): the view's export makes mmap.close() refuse
        # while any tensor still aliases the memory, instead of unmapping under it.
        self._buffer: memoryview | None = memoryview(mapping)
        self.tensor: torch.Tensor = torch.frombuffer(
            self._buffer, dtype=torch.uint8, offset=HEADER_BYTES, count=num_slots * slot_bytes
        ).view(num_slots, slot_bytes)
        self._finalizer = weakref.finalize(self, _release, path, owner_fd) if owner_fd is not None else None

    # ------------------------------------------------------------ construction

    @classmethod
    def create(
        cls,
        name: str,
        num_slots: int,
        slot_bytes: int,
        *,
        shm_dir: str = "/dev/shm",
        tag: str = "",
        prefault: bool = True,
    ) -> SharedSlots:
        """Create and own a new arena; a stale one left by a dead owner is replaced.

        ``prefault`` reserves every byte (``posix_fallocate``) and maps the
        pages up front. Raises ArenaError when the name is taken by a live
        process or the directory lacks room.
        """
        _check_name(name)
        if num_slots < 1 or slot_bytes < 1:
            raise ArenaError(f"an arena needs at least one slot of at least one byte, got {num_slots} x {slot_bytes}")
        if len(tag.encode()) > 64:
            raise ArenaError(f"arena tag {tag!r} is longer than 64 bytes")
        path = Path(shm_dir) / name
        size = HEADER_BYTES + num_slots * slot_bytes
        reclaim_dead_arenas(Path(shm_dir))
        fd = _create_exclusive(path)  # holds the owner's lock from here on
        try:
            try:
                if prefault:
                    os.posix_fallocate(fd, 0, size)
                else:
                    os.ftruncate(fd, size)
            except OSError as exc:
                raise ArenaError(
                    f"cannot reserve {size:,} bytes for arena {path} ({exc.strerror}): give {shm_dir} more room "
                    "(docker --shm-size, a larger tmpfs) or lower tiers.cpu_capacity_bytes"
                ) from None
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
            mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            incarnation = int.from_bytes(os.urandom(8), "little")
            header = _HEADER.pack(
                MAGIC, VERSION, 0, os.getpid(), _pid_namespace(), num_slots, slot_bytes, incarnation, tag.encode()
            )
            mapping[: _HEADER.size] = header
            return cls(path, mapping, owner_fd=fd)
        except BaseException:
            _release(path, fd)
            raise

    @classmethod
    def attach(cls, name: str, *, shm_dir: str = "/dev/shm", expect_tag: str | None = None) -> SharedSlots:
        """Map an existing arena by name, without copying. Raises ArenaError if absent or foreign."""
        _check_name(name)
        path = Path(shm_dir) / name
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ArenaError(f"no arena {name!r} in {shm_dir}: is the tier actor of this node running?") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ArenaError(f"{path} is too small to be a kvstore arena")
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        slots = cls(path, mapping)
        if expect_tag is not None and slots.tag != expect_tag:
            slots.close()
            raise ArenaError(f"arena {name!r} holds {slots.tag!r}, not {expect_tag!r}: another cache identity")
        return slots

    # ------------------------------------------------------------------ access

    @property
    def info(self) -> ArenaInfo:
        return ArenaInfo(self.name, str(self.path.parent), self.num_slots, self.slot_bytes, self.tag, self.incarnation)

    @property
    def closed(self) -> bool:
        return self._buffer is None

    @property
    def mapped(self) -> bool:
        """Whether the memory is still mapped in this process (after close: while views live)."""
        return not self._mmap.closed

    def view(self, slot: int) -> memoryview:
        """Slot ``slot``'s bytes (writable), aliasing the arena."""
        if self._buffer is None:
            raise ArenaError(f"arena {self.name} is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is outside 0..{self.num_slots - 1}")
        start = HEADER_BYTES + slot * self.slot_bytes
        return self._buffer[start : start + self.slot_bytes]

    def close(self) -> None:
        """Unlink the name (owner) and unmap once no view is left. Idempotent; call again to
        unmap after the last views went."""
        if self._buffer is not None:
            # Drop our references only: torch keeps the memoryview alive while a tensor uses it, and
            # a live memoryview makes mmap.close() refuse (releasing it here would unmap under them).
            self._buffer = None
            del self.tensor
            if self._finalizer is not None:
                self._finalizer()
        if not self._mmap.closed:
            try:
                self._mmap.close()
            except BufferError:
                logger.debug("arena %s closed with views alive; unmapped when they go", self.name)

    def __enter__(self) -> SharedSlots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        return f"SharedSlots({self.path}, {self.num_slots} x {self.slot_bytes} B, {role})"


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ArenaError(f"arena name {name!r} must be 1-201 characters of letters, digits, '.', '_' or '-'")


def reclaim_dead_arenas(directory: Path) -> list[str]:
    """Unlink ``kvstore-*`` arenas in ``directory`` whose owner died without closing them (a killed
    actor, or a creator killed before it wrote the header, runs no clean-up); returns their names.
    An arena whose owner's lock is held (by a live owner in any pid namespace) is never touched.

    The directory is shared with every user of the node (/dev/shm is world-writable), so what any
    of them puts there under a ``kvstore-*`` name must neither block nor fail this sweep: an entry
    is opened without blocking or following links, and judged only if it is a regular file of this
    process's user (a sticky directory forbids unlinking anyone else's). An arena that cannot be
    unlinked is logged and left in place."""
    reclaimed = []
    for path in directory.glob("kvstore-*"):
        if path.name.endswith(CONTROL_SUFFIX):  # a tier's control socket, not an arena: see below
            continue
        if _reclaim(path):
            reclaimed.append(path.name)
    # A live tier always has its arena: a control socket file without one was left by a tier that is gone.
    for socket_file in directory.glob(f"kvstore-*{CONTROL_SUFFIX}"):
        if not (directory / socket_file.name.split(".", 1)[0]).exists():
            with contextlib.suppress(OSError):
                socket_file.unlink()
    return reclaimed


def _create_exclusive(path: Path) -> int:
    """Create ``path`` and return its descriptor holding the owner's lock, the name checked to still be
    this file once locked; a name held by a dead owner is reclaimed once.

    Between the exclusive create and the lock a sweep may judge the new, empty, unlocked file one whose
    creator died and unlink it: then the name no longer is ours once locked, and the file is created again.
    """
    reclaimed = False
    for _ in range(8):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            if reclaimed or not _reclaim(path):
                raise ArenaError(
                    f"arena {path} is in use by another process (or is another user's file): "
                    "stop it or choose another name"
                ) from None
            reclaimed = True
            continue
        except FileNotFoundError:
            raise ArenaError(f"shared-memory directory {path.parent} does not exist (tiers.shm_dir)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a sweep holds it only while it judges the file
        except BaseException:
            os.close(fd)
            raise
        if _names(path, fd):
            return fd
        os.close(fd)
    raise ArenaError(f"arena {path} was unlinked by another process each time it was created: is a sweep misbehaving?")


def _reclaim(path: Path) -> bool:
    """Unlink ``path`` if it is this user's arena and its owner is gone; whether it did. Never blocks and
    raises nothing: an arena that cannot be unlinked (a read-only directory) is logged and kept."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)  # a FIFO must not block the open
    except OSError:
        return False  # gone, a symbolic link, or not ours to read
    try:
        # Under the lock _dead_arena took: no owner can appear for this file, and the name is unlinked
        # only while it still is this file (not an arena created since under the same name).
        if not _dead_arena(fd) or not _names(path, fd):
            return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            logger.warning("cannot reclaim arena %s of a dead owner (%s): it was left in place", path, exc.strerror)
            return False
    finally:
        os.close(fd)  # drops the lock
    logger.warning("reclaimed arena %s: its owner process is gone", path)
    return True


def _dead_arena(fd: int) -> bool:
    """Whether the file open as ``fd`` is an arena of this user with no owner; when True, ``fd`` holds its lock."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return False  # a FIFO, socket or directory; or another user's, whose sweep it is to judge
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        raw = os.pread(fd, _HEADER.size, 0)
    except OSError:
        return False  # BlockingIOError: its owner (or a sweep judging it right now) holds the lock
    if raw[:8] != MAGIC:
        return not raw.strip(b"\0")  # only zeros (or nothing): its creator died before writing the header
    if len(raw) < _HEADER.size:
        return False  # not an arena
    _, version, _, pid, namespace, _, _, _, _ = _HEADER.unpack(raw)
    if version < 4:  # its owner took no lock: judge it by its pid
        return bool(namespace == _pid_namespace() and not _pid_alive(pid))
    return True


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        named, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _release(path: Path, fd: int) -> None:
    """The owner's clean-up: unlink ``path`` if it still names our file (after a sweep took it for dead, it
    can be another owner's arena), then close ``fd``. In that order: no sweep sees the name unlocked."""
    try:
        if _names(path, fd):
            _unlink(path)
    finally:
        os.close(fd)


def _pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid); 0 where there is no /proc."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
