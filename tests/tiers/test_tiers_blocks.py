"""check_blocks / check_tokens, on both paths: the compiled ``metas_ok`` and the builtin passes used without it.

Both must accept exactly the well-formed batches and leave every refusal to the block-by-block check, which
names the fault; a Hypothesis test checks that the compiled verdict agrees with that check on batches of
ints drawn around every edge of the ranges. Then the wire form a worker's reserves and acquires travel in.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.events import Medium
from kvstore.tiers import blocks
from kvstore.tiers.blocks import (
    BlockMeta,
    SlotGrant,
    _check_each,
    check_blocks,
    check_tokens,
    decode_grants,
    decode_metas,
    encode_grants,
    encode_metas,
)
from kvstore.tiers.errors import InvalidBlockError, TierError

SIZE = 4
NATIVE = blocks._metas_ok


@pytest.fixture(params=["compiled", "builtin"])
def check_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "compiled":
        if NATIVE is None:
            pytest.skip("the compiled kernel is not built in this install")
    else:
        monkeypatch.setattr(blocks, "_metas_ok", None)
    return str(request.param)


def chain(count: int) -> list[BlockMeta]:
    return [
        BlockMeta(index + 1, index or None, tuple(range(index * SIZE, (index + 1) * SIZE))) for index in range(count)
    ]  # type: ignore[arg-type]


def test_well_formed_batches_pass_both_checks(check_path: str) -> None:
    metas = chain(5)
    check_blocks(metas, SIZE)
    check_blocks(metas, SIZE, tokens=False)
    check_tokens(metas, SIZE)
    check_blocks(tuple(metas), SIZE)  # any sequence
    check_blocks([], SIZE)
    edge = BlockMeta((1 << 64) - 1, 0, (0, 0, 0, (1 << 63) - 1))  # type: ignore[arg-type]  # the largest of each
    check_blocks([edge], SIZE)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (BlockMeta(-1, None, (0, 1, 2, 3)), "unsigned 64-bit"),  # type: ignore[arg-type]
        (BlockMeta(1 << 64, None, (0, 1, 2, 3)), "unsigned 64-bit"),  # type: ignore[arg-type]
        (BlockMeta(7, -2, (0, 1, 2, 3)), "unsigned 64-bit"),  # type: ignore[arg-type]
        (BlockMeta(7, 1 << 64, (0, 1, 2, 3)), "unsigned 64-bit"),  # type: ignore[arg-type]
        (BlockMeta(7, None, (0, 1, 2)), "3 tokens, not a tuple of 4"),  # type: ignore[arg-type]
        (BlockMeta(7, None, (0, 1, 2, 3, 4)), "5 tokens"),  # type: ignore[arg-type]
        (BlockMeta(7, None, (0, -1, 2, 3)), "token id"),  # type: ignore[arg-type]
        (BlockMeta(7, None, (0, 1, 2, 1 << 63)), "token id"),  # type: ignore[arg-type]
        ((7, None, (0, 1, 2, 3)), "expected BlockMeta, got tuple"),
    ],
)
def test_each_fault_is_refused_by_name_wherever_it_sits(check_path: str, bad: object, message: str) -> None:
    metas = chain(4)
    for position in (0, 2, 4):
        batch = [*metas[:position], bad, *metas[position:]]
        with pytest.raises(InvalidBlockError, match=message):
            check_blocks(batch, SIZE)  # type: ignore[arg-type]


def test_the_token_range_is_left_out_only_when_asked(check_path: str) -> None:
    bad = BlockMeta(7, None, (0, 1, 2, -5))  # type: ignore[arg-type]
    check_blocks([bad], SIZE, tokens=False)  # a promotion checks tokens later, only for unmatched blocks
    with pytest.raises(InvalidBlockError, match="token id"):
        check_tokens([*chain(3), bad], SIZE)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (BlockMeta("x", None, (0, 1, 2, 3)), "unsigned 64-bit ints, got 'x'"),  # type: ignore[arg-type]
        (BlockMeta(1.0, None, (0, 1, 2, 3)), "unsigned 64-bit ints, got 1.0"),  # type: ignore[arg-type]
        (BlockMeta(7, "1", (0, 1, 2, 3)), "unsigned 64-bit"),  # type: ignore[arg-type]
        (BlockMeta(7, None, [0, 1, 2, 3]), "list tokens"),  # type: ignore[arg-type]
        (BlockMeta(7, None, (0, 1.5, 2, 3)), "token id"),  # type: ignore[arg-type]
        (BlockMeta(7, None, (0, "1", 2, 3)), "token id"),  # type: ignore[arg-type]
    ],
)
def test_a_field_of_the_wrong_type_is_refused_by_name_not_crashed_on(
    check_path: str, bad: BlockMeta, message: str
) -> None:
    with pytest.raises(InvalidBlockError, match=message):
        check_blocks([*chain(2), bad], SIZE)
    if message == "token id":  # tokens=False leaves the ids to check_tokens
        check_blocks([bad], SIZE, tokens=False)
        with pytest.raises(InvalidBlockError, match=message):
            check_tokens([bad], SIZE)
    else:
        with pytest.raises(InvalidBlockError, match=message):
            check_blocks([bad], SIZE, tokens=False)


EDGES = st.sampled_from([-(1 << 70), -(1 << 63), -1, 0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, 1 << 70])
VALUES = st.one_of(EDGES, st.integers(min_value=-(1 << 66), max_value=1 << 66))
METAS = st.builds(
    BlockMeta,
    VALUES,
    st.one_of(st.none(), VALUES),
    st.lists(VALUES, min_size=SIZE - 1, max_size=SIZE + 1).map(tuple),
)


@pytest.mark.skipif(NATIVE is None, reason="the compiled kernel is not built in this install")
@settings(max_examples=300, deadline=None)
@given(st.lists(METAS, max_size=5), st.booleans())
def test_the_compiled_verdict_agrees_with_the_block_by_block_check(metas: list[BlockMeta], tokens: bool) -> None:
    assert NATIVE is not None
    try:
        _check_each(
            metas if tokens else [BlockMeta(m.block_hash, m.parent_hash, (0,) * len(m.token_ids)) for m in metas], SIZE
        )
    except InvalidBlockError:
        expected = False
    else:
        expected = True
    assert NATIVE(metas, BlockMeta, SIZE, tokens) is expected


# ------------------------------------------------------------------------------------- the wire form


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.builds(
            BlockMeta,
            st.integers(min_value=0, max_value=(1 << 64) - 1),
            st.one_of(st.none(), st.integers(min_value=0, max_value=(1 << 64) - 1)),
            st.lists(st.integers(min_value=0, max_value=(1 << 63) - 1), min_size=SIZE, max_size=SIZE).map(tuple),
        ),
        max_size=8,
    )
)
def test_metas_and_grants_come_back_from_the_wire_form_as_they_went(metas: list[BlockMeta]) -> None:
    back = decode_metas(encode_metas(metas))
    assert back == metas and all(type(meta) is BlockMeta and type(meta.token_ids) is tuple for meta in back)
    grants: list[SlotGrant | None] = [
        None
        if index % 3 == 1
        else SlotGrant(index + 7, index, meta.block_hash, (Medium.CPU, Medium.STORAGE)[index % 2])
        for index, meta in enumerate(metas)
    ]
    answer = decode_grants(encode_grants(grants))
    assert answer == grants
    assert all(grant is None or (type(grant) is SlotGrant and type(grant.medium) is Medium) for grant in answer)


def test_the_wire_form_refuses_what_is_not_block_metas_by_name() -> None:
    with pytest.raises(InvalidBlockError, match="expected BlockMeta, got tuple"):
        encode_metas([*chain(2), (7, None, (0, 1, 2, 3))])  # type: ignore[list-item]
    with pytest.raises(InvalidBlockError, match="cannot be packed"):
        encode_metas([BlockMeta(1 << 70, None, (0, 1, 2, 3))])  # type: ignore[arg-type]
    with pytest.raises(InvalidBlockError, match="malformed"):
        decode_metas(b"\x93\xff garbage")
    with pytest.raises(InvalidBlockError, match=r"malformed: Expected `int`, got `float` - at `\$\[0\]\[2\]\[1\]`"):
        decode_metas(msgspec.msgpack.encode([[1, None, [0, 1.5, 2, 3]]]))
    with pytest.raises(InvalidBlockError, match="must be bytes"):
        decode_metas("not bytes")  # type: ignore[arg-type]
    # Types pass the wire, ranges are check_blocks' (as for metas that arrive unpacked).
    (negative,) = decode_metas(msgspec.msgpack.encode([[-1, None, [0, 1, 2, 3]]]))
    with pytest.raises(InvalidBlockError, match="unsigned 64-bit"):
        check_blocks([negative], SIZE)
    with pytest.raises(TierError, match="packed grants are malformed"):
        decode_grants(msgspec.msgpack.encode([[1, 2, 3, "TAPE"]]))
