"""The spine planner: logarithmic batches, logarithmic rewrites, neighbours only."""

from __future__ import annotations

import math
import re

import msgspec
from hypothesis import given
from hypothesis import strategies as st_

from persist.core.shard.diff import apply_diff
from persist.core.shard.trace import fold, fold_small, folded, is_fold, level, plan_merges, span
from persist.core.shard.transitions import Break, Continue, Txn
from persist.core.shard.types import (
    HollowBatch,
    PartRef,
    RollupRef,
    State,
    batches_in_order,
    empty_state,
)


def batch(i: int, rows: int) -> HollowBatch:
    part = PartRef(f"p{i}", rows, rows, "c" * 32, i, i)
    return HollowBatch(f"b{i:06d}", i, i + 1, 0, (part,))


def merged(group: list[HollowBatch], name: str) -> HollowBatch:
    rows = sum(b.rows for b in group)
    part = PartRef(name, rows, rows, "c" * 32, group[0].lower, group[-1].lower)
    return HollowBatch(name, group[0].lower, group[-1].upper, 0, (part,), sorted_run=True)


def test_level() -> None:
    assert [level(n) for n in (0, 1, 2, 3, 4, 1023, 1024)] == [0, 0, 1, 1, 2, 9, 10]


@given(st_.lists(st_.integers(1, 5000), min_size=1, max_size=300))
def test_running_the_spine_keeps_batches_logarithmic(sizes: list[int]) -> None:
    batches: dict[str, HollowBatch] = {}
    rewrites = 0
    for i, rows in enumerate(sizes):
        b = batch(i, rows)
        batches[b.id] = b
        while groups := plan_merges(list(batches.values())):
            for j, group in enumerate(groups):
                ids = [g.id for g in group]
                lowers = [g.lower for g in group]
                assert lowers == sorted(lowers)  # oldest first
                in_order = [b.id for b in batches_in_order(batches)]
                start = in_order.index(ids[0])
                assert in_order[start : start + len(ids)] == ids  # neighbours only
                out = merged(group, f"m{i}-{j}-{ids[0]}")
                rewrites += out.rows
                for g in group:
                    del batches[g.id]
                batches[out.id] = out
    total = sum(sizes)
    levels = [level(b.rows) for b in batches_in_order(batches)]
    assert levels == sorted(set(levels), reverse=True)  # strictly decreasing, oldest first
    assert len(batches) <= math.log2(total) + 1
    assert rewrites <= total * (math.log2(total) + 1)


def test_busy_batches_are_left_alone() -> None:
    bs = [batch(i, 10) for i in range(4)]
    assert plan_merges(bs) == [bs]  # equal levels cascade into one merge
    groups = plan_merges(bs, busy={bs[1].id})
    assert groups == [[bs[2], bs[3]]]


def state_of(batches: dict[str, HollowBatch]) -> State:
    rollups = {0: RollupRef(0, "r")}
    return msgspec.structs.replace(
        empty_state("s"), since=0, upper=0, batches=dict(batches), rollups=rollups
    )


@given(st_.lists(st_.integers(1, 5000), min_size=1, max_size=200), st_.integers(1, 10))
def test_folding_keeps_every_part_and_bounds_the_unmerged_ones(
    sizes: list[int], min_parts: int
) -> None:
    """Appends fold the small merges in their own commit; the rest are rewritten. No part is
    lost or listed twice, a fold never gathers ``min_parts`` parts, and the batches stay
    logarithmic."""
    batches: dict[str, HollowBatch] = {}
    rewritten: set[str] = set()  # parts replaced by a rewrite's output
    for i, rows in enumerate(sizes):
        b = batch(i, rows)
        txn = Txn(state_of({**batches, b.id: b}), 0)
        fold_small(txn, min_parts)
        batches = dict(apply_diff(txn.state, txn.finish()).batches)
        while groups := [
            g for g in plan_merges(list(batches.values())) if not is_fold(g, min_parts)
        ]:
            for j, group in enumerate(groups):
                out = merged(group, f"m{i}-{j}-{group[0].id}")
                rewritten.update(p.key for g in group for p in g.parts)
                for g in group:
                    del batches[g.id]
                batches[out.id] = out
    parts = [p.key for b in batches.values() for p in b.parts]
    assert len(parts) == len(set(parts))
    appended = {f"p{i}" for i in range(len(sizes))}
    assert appended - rewritten == {k for k in parts if k.startswith("p")}
    assert sum(b.rows for b in batches.values()) == sum(sizes)
    for b in batches.values():
        assert b.sorted_run or len(b.parts) < max(min_parts, 2)
    assert len(batches) <= math.log2(sum(sizes)) + 1


def test_a_fold_lists_its_inputs_parts_under_an_id_of_its_inputs() -> None:
    a, b = batch(0, 10), batch(1, 10)
    b = msgspec.structs.replace(b, since=1)
    out = folded([a, b])
    assert out.parts == a.parts + b.parts and not out.sorted_run
    assert (out.lower, out.upper, out.since) == (0, 2, 1)
    assert out.id == folded([a, b]).id != folded([a, batch(2, 10)]).id
    assert re.fullmatch(r"b[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}", out.id)
    assert span([a, b, msgspec.structs.replace(batch(2, 1), upper=None)]) == (0, None)


def test_the_fold_transition_folds_what_is_due_and_retires_nothing() -> None:
    bs = [batch(i, 10) for i in range(4)]
    state = state_of({b.id: b for b in bs})
    assert isinstance(fold(state, 1, 0), Break)  # min_parts 1: every merge rewrites
    assert isinstance(fold(state, 4, 0), Break)  # four parts: due for a rewrite
    done = fold(state, 5, 0)
    assert isinstance(done, Continue) and done.result == 1
    after = apply_diff(state, done.diff)
    [only] = after.batches.values()
    assert only == folded(bs) and not after.retired
    assert isinstance(fold(after, 5, 0), Break)  # nothing left to fold


def unsorted_batch(i: int, rows: int) -> HollowBatch:
    b = batch(i, rows)
    part = msgspec.structs.replace(b.parts[0], unsorted=True)
    return msgspec.structs.replace(b, parts=(part,))


@given(
    st_.lists(st_.tuples(st_.integers(1, 5000), st_.booleans()), min_size=1, max_size=60),
    st_.integers(1, 16),
)
def test_unsorted_runs_are_rewritten_never_folded_and_the_spine_ends_sorted(
    sizes: list[tuple[int, bool]], min_parts: int
) -> None:
    """A batch holding an unsorted run is due for a rewrite whether or not a merge is due for
    it (alone, if none is), no group holding one is a fold, and once every due rewrite is
    made (rewrites write sorted runs) none is due again and the spine is logarithmic."""
    batches: dict[str, HollowBatch] = {}
    for i, (rows, unsorted) in enumerate(sizes):
        b = unsorted_batch(i, rows) if unsorted else batch(i, rows)
        batches[b.id] = b
        rounds = 0
        while groups := plan_merges(list(batches.values())):
            rounds += 1
            members = [m.id for g in groups for m in g]
            assert len(members) == len(set(members)), "a batch in two merges"
            for bid, held in batches.items():
                if any(p.unsorted for p in held.parts):
                    assert bid in members, "an unsorted run no rewrite is due for"
            for j, group in enumerate(groups):
                if any(p.unsorted for g in group for p in g.parts):
                    assert not is_fold(group, min_parts)
                name = f"m{i}-{rounds}-{j}"
                out = folded(group) if is_fold(group, min_parts) else merged(group, name)
                for g in group:
                    del batches[g.id]
                batches[out.id] = out
    assert not plan_merges(list(batches.values()))
    assert not any(p.unsorted for b in batches.values() for p in b.parts)
    total = sum(b.rows for b in batches.values())
    assert len(batches) <= math.log2(total) + 2


def test_a_busy_unsorted_batch_is_left_to_its_merge() -> None:
    lone = unsorted_batch(0, 100)
    assert plan_merges([lone]) == [[lone]]
    assert plan_merges([lone], busy={lone.id}) == []
