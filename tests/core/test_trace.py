"""The spine planner: logarithmic batches, logarithmic rewrites, neighbours only."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st_

from persist.core import state as st
from persist.core.trace import level, plan_merges


def batch(i: int, rows: int) -> st.HollowBatch:
    part = st.PartRef(f"p{i}", rows, rows, "c" * 32, i, i)
    return st.HollowBatch(f"b{i:06d}", i, i + 1, 0, (part,))


def merged(group: list[st.HollowBatch], name: str) -> st.HollowBatch:
    rows = sum(b.rows for b in group)
    part = st.PartRef(name, rows, rows, "c" * 32, group[0].lower, group[-1].lower)
    return st.HollowBatch(name, group[0].lower, group[-1].upper, 0, (part,), sorted_run=True)


def test_level() -> None:
    assert [level(n) for n in (0, 1, 2, 3, 4, 1023, 1024)] == [0, 0, 1, 1, 2, 9, 10]


@given(st_.lists(st_.integers(1, 5000), min_size=1, max_size=300))
def test_running_the_spine_keeps_batches_logarithmic(sizes: list[int]) -> None:
    batches: dict[str, st.HollowBatch] = {}
    rewrites = 0
    for i, rows in enumerate(sizes):
        b = batch(i, rows)
        batches[b.id] = b
        while groups := plan_merges(list(batches.values())):
            for j, group in enumerate(groups):
                ids = [g.id for g in group]
                lowers = [g.lower for g in group]
                assert lowers == sorted(lowers)  # oldest first
                in_order = [b.id for b in st.batches_in_order(batches)]
                start = in_order.index(ids[0])
                assert in_order[start : start + len(ids)] == ids  # neighbours only
                out = merged(group, f"m{i}-{j}-{ids[0]}")
                rewrites += out.rows
                for g in group:
                    del batches[g.id]
                batches[out.id] = out
    total = sum(sizes)
    levels = [level(b.rows) for b in st.batches_in_order(batches)]
    assert levels == sorted(set(levels), reverse=True)  # strictly decreasing, oldest first
    assert len(batches) <= math.log2(total) + 1
    assert rewrites <= total * (math.log2(total) + 1)


def test_busy_batches_are_left_alone() -> None:
    bs = [batch(i, 10) for i in range(4)]
    assert plan_merges(bs) == [bs]  # equal levels cascade into one merge
    groups = plan_merges(bs, busy={bs[1].id})
    assert groups == [[bs[2], bs[3]]]
