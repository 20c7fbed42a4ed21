"""Order kernels: row comparison, binary search, run detection and the merge's final cut,
against the order the sort itself gives."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st_

from persist.core.arrow import order
from persist.core.arrow import updates as up
from persist.core.arrow.keyrange import key_index_rows
from tests.core.test_updates import as_counter, model, rows_st, table

KEYS = ["k", "s", "_time"]


def sorted_part(rows: list[tuple[int | None, str | None, int, int]]) -> pa.Table:
    return up.sort_consolidate(table(rows), KEYS)


def keys_of(t: pa.Table) -> list[tuple[object, ...]]:
    return [tuple(r[k] for k in KEYS) for r in t.select(KEYS).to_pylist()]


def is_sorted(t: pa.Table) -> bool:
    idx = pc.sort_indices(t.select(KEYS), sort_keys=[(k, "ascending") for k in KEYS])
    return keys_of(t.take(idx)) == keys_of(t)


@given(rows_st, rows_st.filter(bool))
def test_count_le_agrees_with_the_sort(rows: list, probe_rows: list) -> None:  # type: ignore[type-arg]
    part = sorted_part(rows)
    probe = table(probe_rows[:1]).select(KEYS)
    n = order.count_le(part, probe, KEYS)
    # Sorting the part with the probe appended last: the probe's place is the count, as ties
    # keep the part's rows first (the sort is stable).
    merged = pa.concat_tables([part.select(KEYS), probe])
    idx = pc.sort_indices(merged, sort_keys=[(k, "ascending") for k in KEYS]).to_pylist()
    assert idx.index(part.num_rows) == n


@given(st_.lists(rows_st.filter(bool), min_size=1, max_size=5))
def test_is_one_run_agrees_with_concatenation_being_sorted(runs: list) -> None:  # type: ignore[type-arg]
    parts = [p for p in (sorted_part(r) for r in runs) if p.num_rows]
    bounds = [pa.concat_tables([p.slice(0, 1), p.slice(p.num_rows - 1, 1)]) for p in parts]
    expected = not parts or is_sorted(pa.concat_tables(parts))
    assert order.is_one_run(bounds, KEYS) == expected
    # A write hands it the rows of each part's key index instead (first and last among them).
    sampled = [p.take(key_index_rows(p.num_rows, p.nbytes)) for p in parts]
    assert order.is_one_run(sampled, KEYS) == expected


@settings(max_examples=200)
@given(st_.lists(st_.lists(rows_st, min_size=1, max_size=3), min_size=1, max_size=4))
def test_merging_by_final_cuts_matches_the_model(runs: list) -> None:  # type: ignore[type-arg]
    # Each run is a list of sorted parts laid end to end; a merge reads them part by part and
    # emits only what take_final says no unread row can precede.
    queues = []
    everything: list[tuple[int | None, str | None, int, int]] = []
    for parts in runs:
        whole = sorted_part([r for p in parts for r in p])
        everything += [(r["k"], r["s"], r["_time"], r["_diff"]) for r in whole.to_pylist()]
        size = max(1, whole.num_rows // max(1, len(parts)))
        queues.append([whole.slice(i, size) for i in range(0, whole.num_rows, size)])
    buffers: list[pa.Table | None] = [None] * len(queues)
    out: list[pa.Table] = []
    while True:
        for i, q in enumerate(queues):
            while (buffers[i] is None or buffers[i].num_rows == 0) and q:  # type: ignore[union-attr]
                buffers[i] = q.pop(0)
        waiting = [i for i, q in enumerate(queues) if q]
        if not waiting:
            rest = [b for b in buffers if b is not None and b.num_rows]
            if rest:
                out.append(up.merge_consolidate(rest, KEYS))
            break
        cut = order.take_final(buffers, waiting, KEYS)
        if cut is not None:
            out.append(cut)
    merged = up.consolidate_sorted(pa.concat_tables(out), KEYS) if out else None
    got = as_counter(merged) if merged is not None else Counter()
    assert got == model(everything)
    assert merged is None or is_sorted(merged)


@given(rows_st, st_.integers(0, 5))
def test_advance_to_since_keeps_sorted_and_moves_only_earlier_times(rows: list, since: int) -> None:  # type: ignore[type-arg]
    part = sorted_part(rows)
    advanced = up.advance_to_since(part, since)
    times = advanced.column("_time").to_pylist()
    assert times == [max(t, since) for t in part.column("_time").to_pylist()]
    assert is_sorted(advanced)
