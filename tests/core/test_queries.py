"""The read queries over state, without an event loop."""

from __future__ import annotations

import msgspec

from persist.core.read.queries import parts_as_of, parts_between
from persist.core.shard.types import HollowBatch, PartRef, State

from .test_state import created


def _with_batches(*batches: HollowBatch) -> State:
    return msgspec.structs.replace(created(), batches={b.id: b for b in batches})


def _part(key: str, min_time: int, max_time: int) -> PartRef:
    return PartRef(key, 1, 10, "c" * 32, min_time, max_time)


def _batch(bid: str, lower: int, upper: int | None, *parts: PartRef) -> HollowBatch:
    return HollowBatch(bid, lower, upper, 0, parts)


def test_parts_as_of_skip_later_batches_and_parts() -> None:
    early = _batch("a", 0, 5, _part("a0", 0, 1), _part("a1", 3, 4))
    late = _batch("b", 5, 9, _part("b0", 5, 8))
    state = _with_batches(early, late)
    assert {p.key for p in parts_as_of(state, 2)} == {"a0"}
    assert {p.key for p in parts_as_of(state, 4)} == {"a0", "a1"}
    assert {p.key for p in parts_as_of(state, 5)} == {"a0", "a1", "b0"}


def test_parts_between_take_the_batches_overlapping_the_window() -> None:
    a = _batch("a", 0, 5, _part("a0", 0, 4))
    b = _batch("b", 5, 9, _part("b0", 5, 8))
    c = _batch("c", 9, None, _part("c0", 9, 12))
    state = _with_batches(a, b, c)
    assert {p.key for p in parts_between(state, 5, 9)} == {"b0"}
    assert {p.key for p in parts_between(state, 4, 6)} == {"a0", "b0"}
    assert {p.key for p in parts_between(state, 9, None)} == {"c0"}
    # A batch with no upper overlaps every window past its lower, but a part whose times all
    # lie outside the window is left out.
    assert parts_between(state, 20, 21) == []
    assert {p.key for p in parts_between(state, 12, 21)} == {"c0"}
    assert parts_between(state, 0, 0) == []


def test_parts_between_skip_the_parts_of_a_fold_outside_the_window() -> None:
    folded = _batch("f", 0, 9, _part("f0", 0, 2), _part("f1", 3, 5), _part("f2", 6, 8))
    state = _with_batches(folded)
    assert {p.key for p in parts_between(state, 4, 7)} == {"f1", "f2"}
    assert {p.key for p in parts_between(state, 6, None)} == {"f2"}
    assert {p.key for p in parts_between(state, 0, 1)} == {"f0"}
