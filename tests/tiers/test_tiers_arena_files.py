"""Arena files in a directory every user of the node shares: what others put there must not stop a tier.

Each case runs over a real directory under /dev/shm (world-writable and sticky, as /dev/shm is), and the
steps that could hang or must run with another identity run in a subprocess with a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstore
from kvstore.tiers.errors import ArenaError
from kvstore.tiers.shared_memory import _HEADER, HEADER_BYTES, MAGIC, VERSION, SharedSlots, reclaim_dead_arenas

ROOT = Path(kvstore.__file__).resolve().parent.parent
NOBODY = 65534


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory like /dev/shm: mode 1777, owned by another user (so the sticky bit binds root without
    capabilities too)."""
    directory = Path(tempfile.mkdtemp(prefix="test-arena-files.", dir="/dev/shm"))
    os.chmod(directory, 0o1777)
    if os.geteuid() == 0:
        os.chown(directory, NOBODY - 1, NOBODY - 1)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _python(code: str, *prefix: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (under ``prefix``, e.g. setpriv); TimeoutExpired if it hangs."""
    return subprocess.run(
        [*prefix, sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def _env() -> dict[str, str]:
    """This environment, with the package this test imports first on the child's path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _leave_dead_arena(directory: Path, name: str) -> Path:
    """An arena whose owner process was killed: it ran no clean-up."""
    code = (
        "import os\nfrom kvstore.tiers.shared_memory import SharedSlots\n"
        f"s = SharedSlots.create({name!r}, 1, 4096, shm_dir={str(directory)!r})\n"
        "s._finalizer.detach()\nos._exit(0)\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    return directory / name


def test_a_fifo_named_like_an_arena_blocks_no_start(shared_dir: Path) -> None:
    """Any user may mkfifo in /dev/shm: opening it to read a header would block every tier start (and the
    launcher's sweep at shutdown) until someone writes to it."""
    fifo = shared_dir / "kvstore-fifo"
    os.mkfifo(fifo)
    code = (
        "from pathlib import Path\nfrom kvstore.tiers.shared_memory import SharedSlots, reclaim_dead_arenas\n"
        f"SharedSlots.create('kvstore-mine-1', 4, 4096, shm_dir={str(shared_dir)!r}).close()\n"
        f"print(reclaim_dead_arenas(Path({str(shared_dir)!r})))\n"
    )
    result = _python(code, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]" and fifo.exists()  # someone else's entry: left alone


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_another_users_dead_arena_is_left_to_them(shared_dir: Path) -> None:
    """A sweep judges only this user's files: another user's arena is theirs to reclaim."""
    theirs = _leave_dead_arena(shared_dir, "kvstore-theirs")
    os.chown(theirs, NOBODY, NOBODY)
    assert reclaim_dead_arenas(shared_dir) == []
    with SharedSlots.create("kvstore-mine-1", 1, 4096, shm_dir=str(shared_dir)):
        assert theirs.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_another_users_dead_arena_fails_no_start(shared_dir: Path) -> None:
    """A readable arena of a dead owner that belongs to another user cannot be unlinked from a sticky directory:
    it must not turn every other user's tier start into a PermissionError. Root without capabilities is held to
    the sticky bit like any user, and (unlike uid 65534 here) can still run this interpreter."""
    theirs = _leave_dead_arena(shared_dir, "kvstore-theirs")
    os.chown(theirs, NOBODY, NOBODY)
    os.chmod(theirs, 0o644)
    code = (
        "from kvstore.tiers.shared_memory import SharedSlots\n"
        f"with SharedSlots.create('kvstore-mine-1', 1, 4096, shm_dir={str(shared_dir)!r}) as s:\n"
        "    print(s.num_slots)\n"
    )
    result = _python(code, "setpriv", "--bounding-set=-all", "--inh-caps=-all")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1" and theirs.exists()


def test_a_tag_that_is_not_utf8_is_an_arena_error(shared_dir: Path) -> None:
    """A corrupt header is refused as a bad arena, naming the tag, not with a UnicodeDecodeError."""
    path = shared_dir / "kvstore-corrupt"
    header = _HEADER.pack(MAGIC, VERSION, 0, os.getpid(), 0, 1, 4096, 1, b"ok\xff\xfe")
    path.write_bytes(header.ljust(HEADER_BYTES + 4096, b"\0"))
    with pytest.raises(ArenaError, match=r"corrupt tag b'ok\\xff\\xfe'"):
        SharedSlots.attach(path.name, shm_dir=str(shared_dir))


def test_a_creator_killed_before_its_header_leaves_a_reusable_name(shared_dir: Path) -> None:
    """The header is written after posix_fallocate and a populating mmap (seconds for a large arena): a creator
    killed in between leaves a file with no owner pid. While it lives its name is in use; once it is killed the
    name is free again, and the launcher's sweep removes the file."""
    name = "kvstore-half-made"
    code = (
        "import os, sys, time\nfrom kvstore.tiers.shared_memory import SharedSlots\n"
        "def slow(fd, offset, length):\n    print('reserving', flush=True)\n    time.sleep(600)\n"
        f"os.posix_fallocate = slow\nSharedSlots.create({name!r}, 4, 4096, shm_dir={str(shared_dir)!r})\n"
    )
    creator = subprocess.Popen([sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert creator.stdout is not None and creator.stdout.readline().strip() == "reserving"
        with pytest.raises(ArenaError, match="in use by another process"):
            SharedSlots.create(name, 1, 4096, shm_dir=str(shared_dir))  # its creator is alive: not taken
        assert reclaim_dead_arenas(shared_dir) == [] and (shared_dir / name).exists()
    finally:
        creator.kill()
        creator.wait(30)
    assert (shared_dir / name).read_bytes() == b""  # no header: nothing says whose it was but the lock
    with SharedSlots.create(name, 2, 4096, shm_dir=str(shared_dir)) as mine:
        assert mine.num_slots == 2
    (shared_dir / name).write_bytes(bytes(HEADER_BYTES + 4096))  # as a killed creator leaves it: zeros
    assert reclaim_dead_arenas(shared_dir) == [name]
    other = shared_dir / "kvstore-not-an-arena"
    other.write_bytes(b"some other program's file")
    assert reclaim_dead_arenas(shared_dir) == [] and other.exists()  # not an arena: kept


def test_close_unlinks_only_its_own_arena(shared_dir: Path) -> None:
    """An owner whose name was taken over (its file unlinked, a new arena created under the name) must not
    unlink the newcomer's arena when it closes."""
    first = SharedSlots.create("kvstore-taken-over", 1, 4096, shm_dir=str(shared_dir))
    os.unlink(first.path)
    second = SharedSlots.create("kvstore-taken-over", 2, 4096, shm_dir=str(shared_dir))
    first.close()
    assert second.path.exists()
    with SharedSlots.attach(second.name, shm_dir=str(shared_dir)) as seen:
        assert seen.incarnation == second.incarnation
    second.close()
    assert not second.path.exists()


def test_a_live_owner_is_judged_by_its_lock_not_its_pid(shared_dir: Path) -> None:
    """A header naming a dead pid (reused pids, another pid namespace) does not make a locked arena dead."""
    with SharedSlots.create("kvstore-live", 1, 4096, shm_dir=str(shared_dir)) as live:
        dead_pid = _exited_pid()
        live._mmap[12:16] = dead_pid.to_bytes(4, "little")  # the owner pid field
        assert reclaim_dead_arenas(shared_dir) == [] and live.path.exists()
        with pytest.raises(ArenaError, match="in use by another process"):
            SharedSlots.create(live.name, 1, 4096, shm_dir=str(shared_dir))


def _exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_format_3_arenas_are_still_judged_by_their_owners_pid(shared_dir: Path) -> None:
    """Owners of format 3 took no lock: their arena is reclaimed only once the pid in its header is gone."""
    namespace = os.stat("/proc/self/ns/pid").st_ino
    for name, pid in (("kvstore-v3-live", os.getpid()), ("kvstore-v3-dead", _exited_pid())):
        header = _HEADER.pack(MAGIC, 3, 0, pid, namespace, 1, 4096, 1, b"")
        (shared_dir / name).write_bytes(header.ljust(HEADER_BYTES + 4096, b"\0"))
    assert reclaim_dead_arenas(shared_dir) == ["kvstore-v3-dead"]
    assert (shared_dir / "kvstore-v3-live").exists()


def test_an_attacher_does_not_keep_a_dead_owners_arena(shared_dir: Path) -> None:
    """Attachers take no lock: once the owner is killed its name is reclaimed while a worker still maps it,
    and the worker keeps reading the memory it mapped."""
    name = "kvstore-attached"
    code = (
        "import sys\nfrom kvstore.tiers.shared_memory import SharedSlots\n"
        f"s = SharedSlots.create({name!r}, 1, 4096, shm_dir={str(shared_dir)!r})\n"
        "s.tensor[0].fill_(5)\nprint('ready', flush=True)\nsys.stdin.readline()\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == b"ready"
        worker = SharedSlots.attach(name, shm_dir=str(shared_dir))
        assert reclaim_dead_arenas(shared_dir) == []  # its owner lives
    finally:
        owner.kill()
        owner.wait(30)
    assert reclaim_dead_arenas(shared_dir) == [name]
    assert bytes(worker.view(0)) == b"\x05" * 4096
    worker.close()
