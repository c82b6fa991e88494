"""CopyEngine: run coalescing, thread splitting, correctness of batched spills and promotions (through the
compiled kernel and through the ctypes.memmove loop), the kernel's own checks, CUDA path."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from tiers_helpers import IDENTITY, arena_name

from kvstore.tiers import copy_engine
from kvstore.tiers.copy_engine import CopyEngine, Run, block_rows, coalesce
from kvstore.tiers.errors import InvalidBlockError
from kvstore.tiers.shared_memory import SharedSlots


@pytest.fixture
def slots() -> Iterator[SharedSlots]:
    arena = SharedSlots.create(arena_name(), 64, IDENTITY.block_bytes, prefault=False)
    yield arena
    arena.close()


# Both host copy paths: the compiled kernel (built by the dev install; see test_the_install_built_the_kernel)
# and the ctypes.memmove loop it replaces where no C compiler was found.
PATHS = [pytest.param(True, id="native"), pytest.param(False, id="memmove")]


def _kernel(
    src: torch.Tensor, dst: torch.Tensor, src_rows: Sequence[int], dst_rows: Sequence[int], stream_min: int
) -> int:
    """The compiled kernel on the caller's thread alone: a Copier without helpers."""
    from kvstore.tiers._copyrows import Copier

    return copy_engine._copy_pairs_native(src, dst, src_rows, dst_rows, stream_min, Copier(0))


def test_coalesce() -> None:
    assert coalesce([3, 4, 5, 9, 1, 2], [0, 1, 2, 3, 7, 8]) == [Run(3, 0, 3), Run(9, 3, 1), Run(1, 7, 2)]
    assert coalesce([], []) == []


def test_the_install_built_the_kernel() -> None:
    """``scripts/dev setup`` builds tiers/_copyrows.c (setup.py); without it every copy would silently take
    the slower memmove loop, so the suite insists on it."""
    assert copy_engine.NATIVE, "kvstore.tiers._copyrows is missing: reinstall with a C compiler (scripts/dev setup)"
    assert CopyEngine(torch.zeros((1, 64), dtype=torch.uint8), num_threads=1, pin=False).native


@pytest.mark.parametrize("row_bytes", [1, 63, 64, 4099, 65536 + 17])  # odd sizes: unaligned heads and tails
@pytest.mark.parametrize("stream_min", [0, 1, 4096])
def test_kernel_copies_exactly_the_pairs_it_is_given(row_bytes: int, stream_min: int) -> None:
    """Each pair's row lands where asked, runs or not, streamed or not, and no other byte is written."""
    generator = torch.Generator().manual_seed(row_bytes + stream_min)
    src = torch.randint(0, 256, (40, row_bytes), dtype=torch.uint8, generator=generator)
    dst = torch.zeros((50, row_bytes), dtype=torch.uint8)
    src_rows = [3, 4, 5, 9, 0, 1, 39, 20, 21]
    dst_rows = [10, 11, 12, 0, 30, 31, 49, 40, 41]
    runs = _kernel(src, dst, src_rows, dst_rows, stream_min)
    assert runs == len(coalesce(src_rows, dst_rows)) == 5
    assert torch.equal(dst[dst_rows], src[src_rows])
    untouched = [row for row in range(50) if row not in set(dst_rows)]
    assert not dst[untouched].any()


@pytest.mark.parametrize("stream_min", [0, 1])
def test_kernel_copies_overlapping_runs_within_one_buffer_as_memmove_does(stream_min: int) -> None:
    """One buffer on both sides, a run shifted by one row onto itself: copied as the source was
    (streaming stores copy forward only, so an overlapping run goes to memmove)."""
    rows = torch.arange(6 * 4096, dtype=torch.int64).remainder(251).to(torch.uint8).view(6, 4096)
    before = rows.clone()
    assert _kernel(rows, rows, [0, 1, 2], [1, 2, 3], stream_min) == 1
    assert torch.equal(rows[1:4], before[0:3]) and torch.equal(rows[0], before[0])
    shifted = rows.clone()  # rows 0..5 now hold before's 0, 0, 1, 2, 4, 5
    assert _kernel(rows, rows, [3, 4], [2, 3], stream_min) == 1  # and backwards
    assert torch.equal(rows[2:4], shifted[3:5]) and torch.equal(rows[2:4], torch.stack([before[2], before[4]]))


def test_kernel_checks_every_row_before_copying() -> None:
    src = torch.ones((4, 100), dtype=torch.uint8)
    dst = torch.zeros((4, 100), dtype=torch.uint8)
    with pytest.raises(InvalidBlockError, match=r"destination row 4 is outside 0\.\.3"):
        _kernel(src, dst, [0, 1], [0, 4], 0)
    with pytest.raises(InvalidBlockError, match=r"source row -1 is outside 0\.\.3"):
        _kernel(src, dst, [0, -1], [0, 1], 0)
    assert not dst.any()  # the good first pair was not copied either
    with pytest.raises(ValueError, match="2 source rows but 1 destination rows"):
        _kernel(src, dst, [0, 1], [0], 0)
    with pytest.raises(TypeError):
        _kernel(src, dst, [0, "1"], [0, 1], 0)  # type: ignore[list-item]
    with pytest.raises(OverflowError):
        _kernel(src, dst, [2**80], [0], 0)
    with pytest.raises(TypeError, match="sequence"):
        _kernel(src, dst, 5, [0], 0)  # type: ignore[arg-type]
    assert _kernel(src, dst, [], [], 0) == 0
    assert not dst.any()


needs_kernel = pytest.mark.skipif(not copy_engine.NATIVE, reason="the compiled copy kernel is not built")


def _copier_copy(copier: object, src: torch.Tensor, dst: torch.Tensor, pairs: tuple[list[int], list[int]]) -> int:
    return copy_engine._copy_pairs_native(src, dst, *pairs, copy_engine.STREAM_MIN_BYTES, copier, 0)  # type: ignore[arg-type]


@needs_kernel
@pytest.mark.parametrize("helpers", [1, 3])
@pytest.mark.parametrize("row_bytes", [4099, 16384, 300 * 1024])  # odd; a small block; runs cut into pieces
def test_copier_shares_a_batch_and_copies_exactly_the_pairs(helpers: int, row_bytes: int) -> None:
    """Shared with helper threads (split_min 0), every pair lands where asked -- runs longer than a piece
    included -- and no other byte is written; the helpers start at the first shared copy."""
    from kvstore.tiers._copyrows import Copier

    generator = torch.Generator().manual_seed(row_bytes + helpers)
    src = torch.randint(0, 256, (48, row_bytes), dtype=torch.uint8, generator=generator)
    dst = torch.zeros((60, row_bytes), dtype=torch.uint8)
    copier = Copier(helpers)
    assert (copier.helpers, copier.started) == (helpers, 0)
    try:
        for attempt in range(20):  # many batches: pieces land on whichever thread takes them
            dst.zero_()
            order = torch.randperm(48, generator=generator)[:20].tolist()
            targets = (20 + torch.randperm(40, generator=generator)[:20]).tolist()  # rows 20..59
            src_rows = order[:10] + list(range(20, 30)) + order[10:20]  # a run of 10 rows in the middle
            dst_rows = targets[:10] + list(range(attempt % 10, attempt % 10 + 10)) + targets[10:20]
            runs = _copier_copy(copier, src, dst, (src_rows, dst_rows))
            assert runs == len(coalesce(src_rows, dst_rows))
            assert torch.equal(dst[dst_rows], src[src_rows])
            untouched = [row for row in range(60) if row not in set(dst_rows)]
            assert not dst[untouched].any()
        assert copier.started == helpers
    finally:
        copier.close()
    assert copier.started == 0


@needs_kernel
def test_copier_shares_one_long_run() -> None:
    """One pair of 1 MiB rows is cut into pieces and shared too (a single large block is a batch worth
    sharing), with an unaligned tail piece."""
    from kvstore.tiers._copyrows import Copier

    row = (1 << 20) + 3
    src = torch.randint(0, 256, (2, row), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    dst = torch.zeros((3, row), dtype=torch.uint8)
    copier = Copier(1)
    try:
        assert _copier_copy(copier, src, dst, ([1], [2])) == 1
        assert copier.started == 1
        assert torch.equal(dst[2], src[1]) and not dst[:2].any()
    finally:
        copier.close()


@needs_kernel
def test_copier_checks_rows_before_sharing_and_copies_one_buffer_in_order() -> None:
    """A bad row raises before any byte moves; source and destination in one buffer are copied in order
    by the caller alone (pieces copied at once have no order), exactly as the single-thread kernel does."""
    from kvstore.tiers import _copyrows
    from kvstore.tiers._copyrows import Copier
    from kvstore.tiers.config import MAX_COPY_THREADS

    copier = Copier(2)
    try:
        src = torch.ones((8, 65536), dtype=torch.uint8)
        dst = torch.zeros((8, 65536), dtype=torch.uint8)
        with pytest.raises(InvalidBlockError, match=r"destination row 8 is outside 0\.\.7"):
            _copier_copy(copier, src, dst, ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 8]))
        assert not dst.any()
        with pytest.raises(ValueError, match="split_min"):
            copier.copy_rows(dst.data_ptr(), 8, src.data_ptr(), 8, 65536, [0], [0], 0, -1)
        with pytest.raises(TypeError, match="9 arguments"):
            copier.copy_rows(dst.data_ptr(), 8, src.data_ptr(), 8, 65536, [0], [0], 0)  # type: ignore[call-arg]
        rows = torch.arange(12 * 65536, dtype=torch.int64).remainder(251).to(torch.uint8).view(12, 65536)
        expected = rows.clone()
        pairs = ([0, 1, 2, 3, 7, 8], [1, 2, 3, 4, 6, 7])  # each run shifted onto itself, then a chain
        _kernel(expected, expected, *pairs, 0)
        _copier_copy(copier, rows, rows, pairs)
        assert torch.equal(rows, expected)
    finally:
        copier.close()
    with pytest.raises(ValueError, match=r"0\.\.64"):
        Copier(-1)
    with pytest.raises(ValueError, match=r"0\.\.64, got 65"):
        Copier(65)
    assert _copyrows.MAX_HELPERS == MAX_COPY_THREADS - 1  # the config's bound is the kernel's, plus the caller


@needs_kernel
def test_copier_serves_calls_from_several_threads_and_restarts_after_close() -> None:
    """Calls from several Python threads on one Copier queue and each copies its own batch; close() stops
    the helpers and the next shared copy starts them again."""
    from concurrent.futures import ThreadPoolExecutor

    from kvstore.tiers._copyrows import Copier

    copier = Copier(1)
    src = torch.randint(0, 256, (64, 16384), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    outs = [torch.zeros((64, 16384), dtype=torch.uint8) for _ in range(4)]
    perms = [torch.randperm(64, generator=torch.Generator().manual_seed(k)).tolist() for k in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:
            for _ in range(10):
                list(pool.map(lambda k: _copier_copy(copier, src, outs[k], (perms[k], list(range(64)))), range(4)))
                for k in range(4):
                    assert torch.equal(outs[k], src[perms[k]])
                    outs[k].zero_()
        copier.close()
        copier.close()  # idempotent
        assert copier.started == 0
        _copier_copy(copier, src, outs[0], (perms[0], list(range(64))))
        assert copier.started == 1 and torch.equal(outs[0], src[perms[0]])
    finally:
        copier.close()


@needs_kernel
def test_copier_in_a_forked_child_starts_helpers_of_its_own() -> None:
    """A forked child gets the Copier's memory but not its threads: its first shared copy starts new ones
    (and copies correctly) instead of waiting on helpers that do not exist there."""
    import os
    import signal

    from kvstore.tiers._copyrows import Copier

    copier = Copier(1)
    src = torch.randint(0, 256, (32, 16384), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    dst = torch.zeros_like(src)
    child_dst = torch.zeros_like(src)  # made here: torch's OpenMP pool must not be used in a forked child
    order = list(reversed(range(32)))
    expected = src[order].numpy().tobytes()
    _copier_copy(copier, src, dst, (order, list(range(32))))
    assert copier.started == 1
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if the copy worked with a helper of its own
        code = 1
        signal.alarm(30)  # a hang kills the child (SIGALRM's default) instead of the test run
        try:
            ok = copier.started == 0
            _copier_copy(copier, src, child_dst, (order, list(range(32))))
            ok = ok and copier.started == 1 and child_dst.numpy().tobytes() == expected
            copier.close()
            code = 0 if ok else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    copier.close()


def test_engine_shares_large_batches_with_its_copier(slots: SharedSlots) -> None:
    """On the kernel path the engine copies on the caller's thread through its Copier, which shares a
    batch of at least SPLIT_MIN_BYTES with its num_threads - 1 helpers (no Python thread pool)."""
    engine = CopyEngine(slots.tensor, num_threads=2, pin=False)
    if not engine.native:
        pytest.skip("the compiled copy kernel is not built")
    try:
        copier = engine._copier
        assert copier is not None and copier.helpers == 1
        pool = torch.randn((64, *IDENTITY.layout.block_shape)).to(IDENTITY.torch_dtype)
        small = copy_engine.SPLIT_MIN_BYTES // IDENTITY.block_bytes - 1
        engine.spill(pool, list(range(small)), list(range(small))).result()
        assert copier.started == 0  # under the threshold: the caller's thread alone
        engine.spill(pool, list(range(64)), list(reversed(range(64)))).result()
        assert copier.started == 1
        assert torch.equal(slots.tensor[list(reversed(range(64)))], block_rows(pool, IDENTITY.block_bytes))
    finally:
        engine.close()
    assert copier.started == 0
    for bad in (0, copy_engine.MAX_COPY_THREADS + 1):  # the caller and at most the kernel's 64 helpers
        with pytest.raises(ValueError, match=r"num_threads must be in 1\.\.65"):
            CopyEngine(slots.tensor, num_threads=bad, pin=False)


def test_block_rows_views_without_copying() -> None:
    pool = torch.zeros((3, *IDENTITY.layout.block_shape), dtype=IDENTITY.torch_dtype)
    rows = block_rows(pool, IDENTITY.block_bytes)
    assert rows.shape == (3, 4096) and rows.data_ptr() == pool.data_ptr()
    with pytest.raises(InvalidBlockError, match="4096"):
        block_rows(torch.zeros((3, 100)), IDENTITY.block_bytes)
    with pytest.raises(InvalidBlockError, match="contiguous"):
        block_rows(pool.transpose(1, 2), IDENTITY.block_bytes)
    with pytest.raises(InvalidBlockError, match="with blocks"):
        block_rows(torch.zeros((0, 2048), dtype=torch.float16), IDENTITY.block_bytes)


@pytest.mark.parametrize("native", PATHS)
def test_spill_and_promote_scattered_batches(slots: SharedSlots, native: bool) -> None:
    engine = CopyEngine(slots.tensor, num_threads=3, pin=False, native=native)
    try:
        pool = torch.randn((400, *IDENTITY.layout.block_shape)).to(IDENTITY.torch_dtype)  # > 1 MiB: split over threads
        generator = torch.Generator().manual_seed(1)
        blocks = torch.randperm(400, generator=generator)[:64].tolist()
        arena_slots = torch.randperm(64, generator=generator).tolist()
        engine.spill(pool, blocks, arena_slots).result(timeout=10)
        for block, slot in zip(blocks, arena_slots, strict=True):
            assert bytes(slots.view(slot)) == pool[block].view(-1).view(torch.uint8).numpy().tobytes()
        target = torch.zeros_like(pool)
        engine.promote(arena_slots, target, list(range(64))).result(timeout=10)
        assert torch.equal(target[:64], pool[blocks])
        assert not target[64:].any()
    finally:
        engine.close()


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("pool_blocks", [100, 400])  # 400 blocks > 1 MiB: the threads' path; 100: copied inline
def test_runs_of_neighbours_and_a_new_pool_each_call(slots: SharedSlots, pool_blocks: int, native: bool) -> None:
    """Runs (rows and slots advancing together) mixed with scattered pairs, through both paths; a second
    pool tensor -- of the same shape, then another one reshaped -- is copied from its own rows."""
    engine = CopyEngine(slots.tensor, num_threads=2, pin=False, native=native)
    try:
        generator = torch.Generator().manual_seed(2)
        blocks = [5, 6, 7, 40, 2, 3, 90, 91, 92, 93, 11]
        arena_slots = [10, 11, 12, 0, 30, 31, 50, 51, 52, 53, 63]
        for round_ in range(3):
            pool = torch.randn((pool_blocks, *IDENTITY.layout.block_shape), generator=generator)
            pool = pool.to(IDENTITY.torch_dtype)
            if round_ == 2:  # the same bytes per block, viewed with another shape
                pool = pool.view(pool_blocks, -1)
            order = [row for row in torch.randperm(pool_blocks, generator=generator).tolist() if row not in blocks][:16]
            engine.spill(pool, blocks + order, arena_slots + list(range(13, 29))).result(timeout=10)
            target = torch.zeros_like(pool)
            engine.promote(arena_slots + list(range(13, 29)), target, blocks + order).result(timeout=10)
            rows = blocks + order
            assert torch.equal(target[rows], pool[rows])
            untouched = [row for row in range(pool_blocks) if row not in set(rows)]
            assert not target[untouched].any()
    finally:
        engine.close()


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("threads", [1, 2])
def test_bad_batches_raise_before_copying(slots: SharedSlots, native: bool, threads: int) -> None:
    engine = CopyEngine(slots.tensor, num_threads=threads, pin=False, native=native)
    pool = torch.zeros((4, *IDENTITY.layout.block_shape), dtype=IDENTITY.torch_dtype)
    try:
        with pytest.raises(InvalidBlockError, match="destination row 64"):
            engine.spill(pool, [0], [64])
        with pytest.raises(InvalidBlockError, match="source row 4"):
            engine.spill(pool, [4], [0])
        with pytest.raises(InvalidBlockError, match="2 source rows but 1"):
            engine.promote([0, 1], pool, [0])
        assert engine.spill(pool, [], []).result(timeout=1) is None
        # Over 1 MiB (split over the threads when there are two): the last pair is bad, nothing is copied.
        slots.tensor.fill_(7)
        big = torch.zeros((400, *IDENTITY.layout.block_shape), dtype=IDENTITY.torch_dtype)
        with pytest.raises(InvalidBlockError, match="destination row 400"):
            engine.promote([i % 64 for i in range(300)], big, [*range(299), 400])
        assert not big.any()
    finally:
        engine.close()


@pytest.mark.gpu
def test_cuda_spill_and_promote_through_pinned_arena(slots: SharedSlots) -> None:
    engine = CopyEngine(slots.tensor, num_threads=1, pin=True)
    try:
        assert engine.pinned and slots.tensor.is_pinned()
        pool = torch.randn((32, *IDENTITY.layout.block_shape), device="cuda").to(IDENTITY.torch_dtype)
        engine.spill(pool, [5, 6, 7, 30], [0, 1, 2, 3]).result(timeout=10)
        back = torch.zeros_like(pool)
        engine.promote([3, 0], back, [0, 1]).result(timeout=10)
        assert torch.equal(back[0], pool[30]) and torch.equal(back[1], pool[5])
    finally:
        engine.close()
