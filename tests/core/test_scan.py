"""The scan plan (``core.read.scan``): an engine that follows its rules over the parts' rows gets
exactly the contents and the updates as of ``as_of``, checked against a brute-force model."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_
from msgspec.structs import replace

from persist.core.arrow.keyrange import encode_keys, key_index
from persist.core.arrow.updates import (
    DIFF,
    TIME,
    checksum,
    decode_part,
    drop_zero_diffs,
    encode_part,
    full_schema,
    sort_consolidate,
)
from persist.core.read.scan import Consolidation, Scan, plan_scan
from persist.core.shard.types import HollowBatch, PartRef, RollupRef, State
from persist.errors import InvalidUsage

SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string())])
NAMES = SCHEMA.names
KEYS = [*NAMES, TIME]

Row = tuple[int | None, str | None]
Update = tuple[int | None, str | None, int, int]  # k, s, time, diff


@dataclass(frozen=True)
class Stored:
    """A shard as the state sees it, and what is stored: the blob's tables by key."""

    state: State
    blob: dict[str, pa.Table]
    updates: list[Update]  # every update as written, at its original time


def updates_table(updates: list[Update]) -> pa.Table:
    return pa.table(
        {
            "k": pa.array([u[0] for u in updates], pa.int64()),
            "s": pa.array([u[1] for u in updates], pa.string()),
            TIME: pa.array([u[2] for u in updates], pa.uint64()),
            DIFF: pa.array([u[3] for u in updates], pa.int64()),
        },
        schema=full_schema(SCHEMA),
    )


def part_ref(
    key: str,
    table: pa.Table,
    *,
    bounds: bool = True,
    index: bool = True,
    inline: bool = False,
    unsorted: bool = False,
) -> PartRef:
    """The ref a write or merge records for a sorted, consolidated part (``bounds=False``,
    ``index=False``: as parts written before diff bounds or key indexes were recorded; an
    inline part has no key index, as writes leave it), or with ``unsorted`` for an unsorted
    run (rows as written, no key index, as a big write leaves it)."""
    data = encode_part(table, row_group_rows=3, key_names=NAMES, unsorted=unsorted)
    index = index and not unsorted
    times, diffs = pc.min_max(table.column(TIME)), pc.min_max(table.column(DIFF))
    return PartRef(
        key,
        table.num_rows,
        len(data),
        checksum(data),
        times["min"].as_py(),
        times["max"].as_py(),
        table.nbytes,
        inline=data if inline else b"",
        key_index=encode_keys(key_index(table, NAMES, table.nbytes))
        if index and not inline
        else b"",
        min_diff=diffs["min"].as_py() if bounds else None,
        max_diff=diffs["max"].as_py() if bounds else None,
        unsorted=unsorted,
    )


def state_of(batches: list[HollowBatch], since: int, upper: int | None) -> State:
    return State(
        shard_id="s00000000-0000-0000-0000-000000000001",
        seqno=7,
        schema=SCHEMA.serialize().to_pybytes(),
        since=since,
        upper=upper,
        writers={},
        readers={},
        batches={b.id: b for b in batches},
        rollups={1: RollupRef(1, "r")},
    )


# --- the engine: what a reader following the plan does ----------------------------------------


class Refused(Exception):
    """The engine found a negative multiplicity (the contents are not a collection)."""


def rows_read(scan: Scan, blob: dict[str, pa.Table]) -> list[Update]:
    """The rows of the plan's parts (blob ones from ``blob``, inline ones decoded from their
    bytes), filtered if the plan says so."""
    tables = [blob[p.key] for p in scan.parts]
    tables += [decode_part(p.inline, p.checksum, p.key) for p in scan.inline_parts]
    out: list[Update] = []
    for t in tables:
        for r in t.to_pylist():
            if scan.filter_time and r[TIME] > scan.as_of:
                continue
            out.append((r["k"], r["s"], r[TIME], r[DIFF]))
    return out


def engine_contents(scan: Scan, blob: dict[str, pa.Table]) -> Counter[Row]:
    rows = rows_read(scan, blob)
    out: Counter[Row] = Counter()
    if scan.contents is Consolidation.NONE:
        for k, s, _, _ in rows:
            out[(k, s)] += 1
    elif scan.contents is Consolidation.REPEAT:
        for k, s, _, d in rows:
            if d < 0:
                raise Refused((k, s))
            out[(k, s)] += d
    else:
        # The untouched parts' rows as they are (each a +1), the rest summed.
        kept = {p.key for p in scan.parts if p.untouched}
        apart = replace(scan, parts=tuple(p for p in scan.parts if p.key in kept), inline_parts=())
        rest = replace(scan, parts=tuple(p for p in scan.parts if p.key not in kept))
        for k, s, _, d in rows_read(apart, blob):
            assert d == 1
            out[(k, s)] += 1
        sums: Counter[Row] = Counter()
        for k, s, _, d in rows_read(rest, blob):
            sums[(k, s)] += d
        for row, m in sums.items():
            if m < 0:
                raise Refused(row)
            if m:
                # An untouched part's row may have more +1s in parts that are summed.
                out[row] += m
    return out


def engine_updates(scan: Scan, blob: dict[str, pa.Table]) -> list[Update]:
    rows = rows_read(scan, blob)
    if scan.updates is Consolidation.NONE:
        return sorted(((k, s, scan.as_of, d) for k, s, _, d in rows), key=repr)
    assert scan.updates is Consolidation.SUM
    sums: Counter[Row] = Counter()
    for k, s, _, d in rows:
        sums[(k, s)] += d
    return sorted(((k, s, scan.as_of, m) for (k, s), m in sums.items() if m), key=repr)


# --- the model ----------------------------------------------------------------------------------


def multiplicities(updates: list[Update], as_of: int) -> dict[Row, int]:
    sums: Counter[Row] = Counter()
    for k, s, t, d in updates:
        if t <= as_of:
            sums[(k, s)] += d
    return {row: m for row, m in sums.items() if m}


# --- generating shards --------------------------------------------------------------------------


@st_.composite
def shards(draw: st_.DrawFn) -> tuple[Stored, int]:
    """Random batches of random parts, as writes and merges leave them, and an ``as_of``.

    Regimes are drawn per example so that every rule gets exercised: with or without
    retractions and multiplicities, parts of one time, parts of disjoint keys, old parts
    without diff bounds or key indexes, inline parts, merged batches whose times were moved
    up to their since (possibly past their upper), unsorted runs (a big write's parts: rows
    in the order written, the same row and time possibly more than once), which an engine
    reads as they are stored, and merged batches whose rows of one +1 are parts apart (some
    folded with a write's part). Actors: writers (parts of any diffs, times and keys), merges
    (times moved to a since, the split), folds; a reader's ``as_of`` anywhere readable."""
    unsorted_runs = draw(st_.booleans())
    retractions = draw(st_.booleans())
    multiples = draw(st_.booleans())
    one_time = draw(st_.booleans())
    disjoint = draw(st_.booleans())
    # Few distinct rows: the same row at several times in a part, and in several parts.
    narrow = draw(st_.booleans())
    # Only merges' outputs hold diffs other than +1 (their alone parts then untouched).
    merges_alone_retract = draw(st_.booleans())
    strings = ["a"] if narrow else ["a", "b"]
    diffs = [1] + ([2, 3] if multiples else []) + ([-1, -2] if retractions else [])
    upper = draw(st_.integers(1, 9))
    since = draw(st_.integers(0, upper - 1))
    as_of = draw(st_.integers(since, upper - 1))
    batches: list[HollowBatch] = []
    blob: dict[str, pa.Table] = {}
    written: list[Update] = []
    for b in range(draw(st_.sampled_from([0, 1, 1, 2, 3, 4]))):
        # Mostly batches that as_of reads from.
        lower = draw(st_.one_of(st_.integers(0, as_of), st_.integers(0, upper - 1)))
        b_upper = draw(st_.integers(lower + 1, upper))
        # A merged batch's times were moved up to its since (at most the shard's).
        b_since = draw(st_.sampled_from([0, 0, since]))
        parts: list[PartRef] = []
        # A merge's output (see below), where the other batches may hold inserts alone.
        merged = draw(st_.booleans())
        for p in range(draw(st_.sampled_from([1, 1, 2, 3]))):
            base = 10 * (len(blob) + 1) if disjoint else 0
            t0 = draw(st_.integers(lower, b_upper - 1))
            single = one_time and draw(st_.sampled_from([True, True, False]))
            # Some parts of inserts alone beside others' retractions (untouched, if apart).
            part_diffs = [1] if draw(st_.sampled_from([False, False, True])) else diffs
            if merges_alone_retract and not merged:
                part_diffs = [1]
            ups = draw(
                st_.lists(
                    st_.tuples(
                        st_.one_of(st_.none(), st_.integers(base, base + (1 if narrow else 3))),
                        st_.one_of(st_.none(), st_.sampled_from(strings)),
                        st_.just(t0) if single else st_.integers(lower, b_upper - 1),
                        st_.sampled_from(part_diffs),
                    ),
                    max_size=8,
                )
            )
            written.extend(ups)
            stored = [(k, s, max(t, b_since), d) for k, s, t, d in ups]
            # Only writes leave unsorted runs (a merge's times moved to its since are sorted).
            unsorted = unsorted_runs and b_since == 0 and not merged and draw(st_.booleans())
            if unsorted:
                table = drop_zero_diffs(updates_table(stored))
            else:
                table = sort_consolidate(updates_table(stored), KEYS)
            if table.num_rows == 0:
                continue  # a write or merge keeps no empty part
            key = f"s/w/w1/b{b}-{p:05}"
            blob[key] = table
            parts.append(
                part_ref(
                    key,
                    table,
                    bounds=draw(st_.booleans()) or draw(st_.booleans()),
                    index=draw(st_.booleans()) or draw(st_.booleans()),
                    # As writes leave them: an unsorted run is never inline.
                    inline=draw(st_.booleans())
                    and not draw(st_.booleans())
                    and not unsorted
                    and not merged,
                    unsorted=unsorted,
                )
            )
        if merged:
            # A merge's output instead: the same updates, the rows of one +1 apart.
            parts = split_merge_output(f"b{b}", [blob.pop(p.key) for p in parts], blob, draw)
        batches.append(HollowBatch(f"b{b}", lower, b_upper, b_since, tuple(parts), merged))
        if merged and draw(st_.booleans()):
            # Folded with a write's part of keys of its own (a fold keeps parts as they are).
            k0 = 10 * (len(blob) + 1) if disjoint else 0
            ups = [(k0 + i % 2, "a", b_upper - 1, draw(st_.sampled_from(diffs))) for i in range(3)]
            written.extend(ups)
            table = sort_consolidate(updates_table(ups), KEYS)
            if table.num_rows:
                key = f"s/w/w1/f{b}-00000"
                blob[key] = table
                last = batches.pop()
                batches.append(
                    HollowBatch(
                        f"f{b}",
                        last.lower,
                        last.upper,
                        last.since,
                        (*last.parts, part_ref(key, table)),
                    )
                )
    shard_upper = draw(st_.sampled_from([upper, None]))
    return Stored(state_of(batches, since, shard_upper), blob, written), as_of


def split_merge_output(
    origin: str, tables: list[pa.Table], blob: dict[str, pa.Table], draw: st_.DrawFn
) -> list[PartRef]:
    """The parts a merge of ``tables`` (already at their since) writes: its rows summed, those
    whose only update is a +1 apart from the others, each run cut at random into sorted parts,
    stored in ``blob``. The model's own grouping (Python equality on (k, s)), not the merge's."""
    if not tables:
        return []
    merged = sort_consolidate(pa.concat_tables(tables), KEYS)
    rows = [(r["k"], r["s"]) for r in merged.to_pylist()]
    per_row = Counter(rows)
    diffs = merged.column(DIFF).to_pylist()
    single = [per_row[r] == 1 and d == 1 for r, d in zip(rows, diffs, strict=True)]
    out: list[PartRef] = []
    for alone in (True, False):
        run = merged.filter(pa.array([x == alone for x in single]))
        cut = draw(st_.integers(0, run.num_rows))
        for table in (run.slice(0, cut), run.slice(cut)):
            if table.num_rows:
                key = f"s/c/{origin}-{len(out):05}"
                blob[key] = table
                out.append(replace(part_ref(key, table), origin=origin, alone=alone))
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shards())
def test_following_the_plan_gives_the_snapshot(shard: tuple[Stored, int]) -> None:
    stored, as_of = shard
    scan = plan_scan(stored.state, as_of)
    truth = multiplicities(stored.updates, as_of)
    # Contents: each row as many times as its multiplicity; a negative one is refused.
    if any(m < 0 for m in truth.values()):
        with pytest.raises(Refused):
            engine_contents(scan, stored.blob)
    else:
        assert engine_contents(scan, stored.blob) == Counter(truth)
    # Updates: each distinct row once, at as_of, with its multiplicity.
    expected = sorted(((k, s, as_of, m) for (k, s), m in truth.items()), key=repr)
    assert engine_updates(scan, stored.blob) == expected
    # What the plan claims of the rows holds.
    rows = rows_read(scan, stored.blob)
    if not scan.filter_time:
        assert all(t <= as_of for _, _, t, _ in rows)
    if scan.min_diff is not None and scan.max_diff is not None:
        assert all(scan.min_diff <= d <= scan.max_diff for *_, d in rows)
    if scan.distinct_rows:
        assert len({(k, s) for k, s, _, _ in rows}) == len(rows)
    if scan.contents is Consolidation.NONE:
        assert all(d == 1 for *_, d in rows)


# --- the rules, case by case ---------------------------------------------------------------------


def one_part_batch(
    name: str, updates: list[Update], lower: int, upper: int, since: int = 0, **kw: bool
) -> tuple[HollowBatch, pa.Table]:
    moved = [(k, s, max(t, since), d) for k, s, t, d in updates]  # as a merge at since does
    table = sort_consolidate(updates_table(moved), KEYS)
    ref = part_ref(f"s/w/w1/{name}-00000", table, **kw)
    return HollowBatch(name, lower, upper, since, (ref,)), table


def test_appends_of_inserts_read_as_they_are() -> None:
    b1, _ = one_part_batch("b1", [(1, "a", 0, 1), (2, "a", 0, 1)], 0, 1)
    b2, _ = one_part_batch("b2", [(1, "a", 1, 1), (3, "b", 1, 1)], 1, 2)  # a row again
    scan = plan_scan(state_of([b1, b2], 0, 2), 1)
    assert scan.plain and scan.contents is Consolidation.NONE
    assert (scan.min_diff, scan.max_diff) == (1, 1)
    # Row (1, "a") is in both parts: its updates must be summed.
    assert not scan.distinct_rows and scan.updates is Consolidation.SUM
    assert [p.key for p in scan.parts] == ["s/w/w1/b1-00000", "s/w/w1/b2-00000"]
    assert scan.rows == 4 and scan.size == sum(p.size for p in scan.parts)


def test_a_retraction_anywhere_means_summing() -> None:
    b1, _ = one_part_batch("b1", [(1, "a", 0, 1), (2, "a", 0, 1)], 0, 1)
    b2, _ = one_part_batch("b2", [(1, "a", 1, -1)], 1, 2)
    scan = plan_scan(state_of([b1, b2], 0, 2), 1)
    assert scan.contents is Consolidation.SUM and scan.updates is Consolidation.SUM
    # As of 0 the retraction is not read at all.
    early = plan_scan(state_of([b1, b2], 0, 2), 0)
    assert early.contents is Consolidation.NONE and [p.key for p in early.parts] == [
        "s/w/w1/b1-00000"
    ]


def test_multiplicities_are_repeated_without_grouping() -> None:
    b1, _ = one_part_batch("b1", [(1, "a", 0, 3), (2, "a", 0, 1)], 0, 1)
    b2, _ = one_part_batch("b2", [(1, "a", 1, 2)], 1, 2)
    scan = plan_scan(state_of([b1, b2], 0, 2), 1)
    assert scan.contents is Consolidation.REPEAT and scan.updates is Consolidation.SUM


def test_parts_of_disjoint_keys_at_one_time_need_no_grouping() -> None:
    b1, _ = one_part_batch("b1", [(1, "a", 0, 1), (2, "a", 0, -1)], 0, 1)
    b2, _ = one_part_batch("b2", [(3, "a", 1, 2), (4, None, 1, 1)], 1, 2)
    scan = plan_scan(state_of([b1, b2], 0, 2), 1)
    assert scan.distinct_rows
    assert scan.updates is Consolidation.NONE
    # A retraction of a row no other part holds: repeating refuses it, as summing would.
    assert scan.contents is Consolidation.REPEAT
    # Keys that meet (4 is b2's last key) prove nothing.
    b3, _ = one_part_batch("b3", [(4, None, 2, 1)], 2, 3)
    assert not plan_scan(state_of([b1, b2, b3], 0, 3), 2).distinct_rows


def test_parts_written_before_bounds_and_indexes_are_summed() -> None:
    b1, _ = one_part_batch("b1", [(1, "a", 0, 1)], 0, 1, bounds=False)
    scan = plan_scan(state_of([b1], 0, 1), 0)
    assert scan.min_diff is None and scan.max_diff is None
    # One part at one time holds each row once: its diffs are the multiplicities.
    assert scan.contents is Consolidation.REPEAT and scan.updates is Consolidation.NONE
    b2, _ = one_part_batch("b2", [(5, "a", 1, 1)], 1, 2, index=False)
    scan = plan_scan(state_of([b1, b2], 0, 2), 1)
    assert scan.contents is Consolidation.SUM and scan.updates is Consolidation.SUM


def test_times_after_as_of_are_filtered() -> None:
    b1, _ = one_part_batch("b1", [(1, "a", 0, 1), (1, "a", 3, 1)], 0, 4)
    scan = plan_scan(state_of([b1], 0, 4), 2)
    assert scan.filter_time and scan.parts[0].filter_time and not scan.plain
    # The times kept lie in [0, 2]: one row may appear at two of them, as far as the state
    # tells. As of 0 only time 0 is kept: each row once.
    assert not scan.distinct_rows
    assert plan_scan(state_of([b1], 0, 4), 0).distinct_rows
    assert not plan_scan(state_of([b1], 0, 4), 3).filter_time


def test_a_merged_batch_may_hold_times_past_its_upper() -> None:
    # Merged at since 5: the times 0 and 1 of batch [0, 2) were moved up to 5.
    b1, _ = one_part_batch("b1", [(1, "a", 0, 1), (2, "a", 1, 1)], 0, 2, since=5)
    assert b1.parts[0].min_time == b1.parts[0].max_time == 5
    b2, _ = one_part_batch("b2", [(3, "a", 6, 1)], 2, 7)
    scan = plan_scan(state_of([b1, b2], 5, 7), 6)
    assert not scan.filter_time and scan.rows == 3
    assert not plan_scan(state_of([b1, b2], 5, 7), 5).filter_time


def test_inline_parts_come_with_their_bytes() -> None:
    b1, t1 = one_part_batch("b1", [(1, "a", 0, 1)], 0, 1, inline=True)
    b2, _ = one_part_batch("b2", [(2, "a", 1, 1)], 1, 2)
    scan = plan_scan(state_of([b1, b2], 0, 2), 1)
    assert [p.key for p in scan.parts] == ["s/w/w1/b2-00000"]
    (inline,) = scan.inline_parts
    assert decode_part(inline.inline, inline.checksum, inline.key).equals(t1)
    assert scan.size == scan.parts[0].size  # only what is in blob
    # An inline part has no key index: beside another part it proves nothing.
    assert not scan.distinct_rows


def test_an_empty_shard_reads_nothing() -> None:
    scan = plan_scan(state_of([], 0, 1), 0)
    assert scan.parts == () and scan.inline_parts == () and scan.plain
    assert scan.updates is Consolidation.NONE and scan.min_diff is None


def test_as_of_outside_since_and_upper_is_refused() -> None:
    b1, _ = one_part_batch("b1", [(1, "a", 2, 1)], 2, 3)
    with pytest.raises(InvalidUsage, match="below the shard's since 2"):
        plan_scan(state_of([b1], 2, 3), 1)
    with pytest.raises(InvalidUsage, match="not below the shard's upper 3"):
        plan_scan(state_of([b1], 2, 3), 3)
    assert plan_scan(state_of([b1], 2, None), 100).rows == 1  # a finished shard
    with pytest.raises(InvalidUsage):
        plan_scan(msgspec_replace(state_of([b1], 2, None), since=None), 100)


def msgspec_replace(state: State, **changes: object) -> State:
    import msgspec

    return msgspec.structs.replace(state, **changes)


def test_a_scan_round_trips_through_msgpack() -> None:
    import msgspec

    b1, _ = one_part_batch("b1", [(1, "a", 0, 1)], 0, 1, inline=True)
    scan = plan_scan(state_of([b1], 0, 1), 0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(scan), type=Scan) == scan


def test_many_parts_of_disjoint_keys_are_checked_in_one_sort() -> None:
    # 200 appends of increasing keys, each at its own time: every row once.
    batches = []
    for i in range(200):
        ks = np.arange(10 * i, 10 * i + 10)
        b, _ = one_part_batch(f"b{i}", [(int(k), "x", i, 1) for k in ks], i, i + 1)
        batches.append(b)
    scan = plan_scan(state_of(batches, 0, 200), 199)
    assert scan.distinct_rows and scan.updates is Consolidation.NONE
    assert scan.contents is Consolidation.NONE and len(scan.parts) == 200


def test_parts_no_retraction_can_reach_are_untouched() -> None:
    # Keys 0-9 retracted in their own range; 20-29 inserts only; 9-12 inserts meeting the
    # retracting part's range at key 9 only.
    ins, _ = one_part_batch("b1", [(k, "a", 0, 1) for k in range(10)], 0, 1)
    far, _ = one_part_batch("b2", [(k, "a", 0, 1) for k in range(20, 30)], 0, 1)
    edge, _ = one_part_batch("b3", [(k, "a", 0, 1) for k in range(9, 13)], 0, 1)
    gone, _ = one_part_batch("b4", [(k, "a", 1, -1) for k in (0, 9)], 1, 2)
    scan = plan_scan(state_of([ins, far, edge, gone], 0, 2), 1)
    assert scan.contents is Consolidation.SUM
    assert {p.key[7:9]: p.untouched for p in scan.parts} == {
        "b1": False,  # its own range holds the retractions
        "b2": True,
        "b3": False,  # meets the retractions' range at one key
        "b4": False,
    }
    # A part with retractions and no key range (unsorted, inline, or written before indexes)
    # may meet every part: nothing is untouched.
    for kw in ({"unsorted": True}, {"inline": True}, {"index": False}):
        odd, _ = one_part_batch("b4", [(k, "a", 1, -1) for k in (0, 9)], 1, 2, **kw)
        scan = plan_scan(state_of([ins, far, odd], 0, 2), 1)
        assert not any(p.untouched for p in scan.parts), kw
    # Nor is a part without a key range of its own.
    loose, _ = one_part_batch("b2", [(k, "a", 0, 1) for k in range(20, 30)], 0, 1, index=False)
    scan = plan_scan(state_of([ins, loose, gone], 0, 2), 1)
    assert not any(p.untouched for p in scan.parts)
