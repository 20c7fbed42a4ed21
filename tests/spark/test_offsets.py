"""A stream's offsets without Spark (``persist.spark._offsets``): a simulated shard (parts with real
key indexes, appends, compactions that cut the parts anew) streamed under a row limit, batch by
batch, with offsets through JSON as Spark's checkpoint keeps them. Concatenated, the batches are
the shard's updates exactly; a batch replayed later (a restart) reads the same rows; every batch
moves on; where every index segment is one row, no batch holds more rows than the limit or the
smallest step."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
from hypothesis import event, given, settings
from hypothesis import strategies as st

from persist.core.arrow.keyrange import INDEX_BYTES, decode_keys, encode_keys, key_index
from persist.core.arrow.updates import DIFF, TIME, sort_consolidate
from persist.core.read.rowbounds import RowBounds
from persist.core.shard.types import PartRef
from persist.errors import InvalidUsage
from persist.spark._offsets import Position, Read, next_position, reads, settled

SCHEMA = pa.schema([("k", pa.int64())])
Update = tuple[int, int]  # (key, time)


@dataclass
class Shard:
    """Parts in memory, each with its table, as a shard's state lists them."""

    parts: list[tuple[PartRef, pa.Table]] = field(default_factory=list)
    upper: int = 0
    written: Counter[Update] = field(default_factory=Counter)
    compacted: bool = False
    names: int = 0

    def _cut(self, table: pa.Table, chunk: int, samples: int) -> None:
        table = sort_consolidate(table, ["k", TIME])
        for at in range(0, table.num_rows, chunk):
            part = table.slice(at, chunk)
            times = part.column(TIME).to_pylist()
            kix = encode_keys(key_index(part, ["k"], samples * INDEX_BYTES))
            self.names += 1
            ref = PartRef(
                f"p{self.names}", part.num_rows, 1, "x", min(times), max(times), 0, b"", kix
            )
            self.parts.append((ref, part))

    def append(self, keys: list[int], retract: list[int], gap: int, chunk: int) -> None:
        t = self.upper
        diffs = {k: 1 for k in keys} | {k: -1 for k in retract}
        table = pa.table(
            {
                "k": pa.array(list(diffs), pa.int64()),
                TIME: pa.array([t] * len(diffs), pa.uint64()),
                DIFF: pa.array(list(diffs.values()), pa.int64()),
            }
        )
        for k, d in diffs.items():
            self.written[(k, t)] += d
        self._cut(table, chunk, 16)  # parts of <= 16 rows: one row per index segment
        self.upper = t + gap

    def compact(self, chunk: int, samples: int) -> None:
        """All parts merged into one sorted run cut anew (times kept: the since is 0)."""
        tables = [t for _, t in self.parts]
        self.parts = []
        if tables:
            self._cut(pa.concat_tables(tables), chunk, samples)
        self.compacted = True

    def bounds(self, lower: int, upper: int) -> RowBounds:
        refs = [r for r, _ in self.parts if r.max_time >= lower and r.min_time < upper]
        return RowBounds(refs, SCHEMA, lower, upper)

    def read(self, r: Read) -> Counter[Update]:
        lo = decode_keys(r.lower_key, SCHEMA).column(0)[0].as_py() if r.lower_key else None
        hi = decode_keys(r.upper_key, SCHEMA).column(0)[0].as_py() if r.upper_key else None
        out: Counter[Update] = Counter()
        for _, t in self.parts:
            columns = (t.column(c).to_pylist() for c in ("k", TIME, DIFF))
            for k, time, d in zip(*columns, strict=True):
                if (lo is not None and k < lo) or (hi is not None and k >= hi):
                    continue
                if r.snapshot and time < r.upper:
                    out[(k, r.upper - 1)] += d
                elif not r.snapshot and r.lower <= time < r.upper:
                    out[(k, time)] += d
        return Counter({u: d for u, d in out.items() if d})


appends = st.tuples(
    st.lists(st.integers(0, 40), max_size=30, unique=True),
    st.integers(0, 5),  # how many earlier keys to retract
    st.integers(1, 3),  # gap to the next time
    st.integers(1, 16),  # rows per part
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), appends),
        st.tuples(st.just("batch"), st.one_of(st.none(), st.integers(1, 60))),
        st.tuples(st.just("compact"), st.tuples(st.integers(1, 40), st.integers(1, 16))),
        st.just(("replay", None)),
    ),
    max_size=25,
)


def through_json(p: Position) -> Position:
    return Position.parse(json.loads(json.dumps(p.to_offset())))


@settings(max_examples=500, deadline=None)
@given(
    st.lists(appends, min_size=1, max_size=3),
    ops,
    st.one_of(st.none(), st.integers(0, 3)),
    st.integers(1, 10),
)
def test_batches_under_a_row_limit_are_the_updates_exactly(
    first: list, steps: list, as_of_option: int | None, drain_rows: int
) -> None:
    shard = Shard()

    def append(spec: tuple[list[int], int, int, int]) -> None:
        keys, retract, gap, chunk = spec
        earlier = sorted({k for k, _ in shard.written})[:retract]
        shard.append([k for k in keys if k not in earlier], earlier, gap, chunk)

    for spec in first:
        append(spec)
    pos = Position(0)
    emitted: Counter[Update] = Counter()
    done: list[tuple[Position, Position, Counter[Update]]] = []
    as_of: int | None = as_of_option

    def batch(max_rows: int | None) -> None:
        nonlocal pos, as_of
        start = through_json(pos)
        end = settled(start, shard.upper, max_rows, as_of_option)
        if end is None:
            assert max_rows is not None
            bounds = shard.bounds(start.frontier, shard.upper)
            end = next_position(start, shard.upper, max_rows, as_of_option, bounds)
        end = through_json(end)
        readable = start.key is not None or (
            shard.upper > start.frontier
            and not (
                start == Position(0) and as_of_option is not None and shard.upper <= as_of_option
            )
        )
        assert (end != start) == readable  # moves on whenever there is something to read
        if end == start:
            return
        if start == Position(0) and as_of is None:  # the default as_of: the first batch's
            as_of = (end.frontier if end.until is None else end.until) - 1
        got: Counter[Update] = Counter()
        for r in reads(start, end, as_of_option):
            got.update(shard.read(r))
        got = Counter({u: d for u, d in got.items() if d})
        if max_rows is not None and not shard.compacted:
            # Parts of distinct keys, one row per index segment: a batch holds what it is
            # charged, at most the limit, or the smallest step: one row of each part.
            assert len(got) <= max(max_rows, len(shard.parts))
        emitted.update(got)
        done.append((start, end, got))
        event("a batch inside a bucket" if end.key is not None else "a batch to a frontier")
        pos = end

    for op, arg in steps:
        if op == "append":
            append(arg)
        elif op == "batch":
            batch(arg)
        elif op == "compact":
            shard.compact(*arg)
        elif done:  # replay the last batch, as after a restart: the same rows
            start, end, got = done[-1]
            again: Counter[Update] = Counter()
            for r in reads(start, end, as_of_option):
                again.update(shard.read(r))
            assert Counter({u: d for u, d in again.items() if d}) == got
    for _ in range(500):  # drain, then everything below the upper is out
        if pos == Position(shard.upper):
            break
        before = pos
        batch(drain_rows)
        if pos == before:
            break
    batch(None)
    if as_of is None or pos.frontier <= as_of:
        assert not {u: d for u, d in emitted.items() if d}
        return
    want: Counter[Update] = Counter()
    for (k, t), d in shard.written.items():
        want[(k, max(t, as_of))] += d
    assert {u: d for u, d in emitted.items() if d} == {u: d for u, d in want.items() if d}
    assert pos == Position(shard.upper)


def test_offsets_read_back_and_refuse_what_is_not_one() -> None:
    key = encode_keys(pa.table({"k": pa.array([5], pa.int64())}))
    for p in (Position(0), Position(7), Position(3, 9, key)):
        assert through_json(p) == p
    assert Position(7).to_offset() == {"frontier": 7}  # as offsets checkpointed before limits
    for bad in (
        {},
        {"frontier": -1},
        {"frontier": "3"},
        {"frontier": 3, "until": 3, "key": key.hex()},
        {"frontier": 3, "until": 5, "key": "zz"},
        {"frontier": 3, "until": 5},
        {"frontier": 3, "other": 1},
    ):
        try:
            Position.parse(bad)
        except InvalidUsage:
            continue
        raise AssertionError(f"{bad!r} was taken for an offset")


def test_reads_between_positions() -> None:
    k1 = encode_keys(pa.table({"k": pa.array([5], pa.int64())}))
    k2 = encode_keys(pa.table({"k": pa.array([9], pa.int64())}))
    # The snapshot cut by key, then its rest and the updates after it.
    assert reads(Position(0), Position(0, 4, k1), None) == [Read(0, 4, True, b"", k1)]
    assert reads(Position(0, 4, k1), Position(0, 4, k2), None) == [Read(0, 4, True, k1, k2)]
    assert reads(Position(0, 4, k2), Position(6), None) == [
        Read(0, 4, True, k2, b""),
        Read(4, 6, False),
    ]
    # A time bucket cut by key.
    assert reads(Position(6), Position(6, 7, k1), None) == [Read(6, 7, False, b"", k1)]
    assert reads(Position(6, 7, k1), Position(8), None) == [
        Read(6, 7, False, k1, b""),
        Read(7, 8, False),
    ]
    # As before limits: the snapshot at as_of (or end - 1), then the updates after it.
    assert reads(Position(0), Position(5), 2) == [Read(0, 3, True), Read(3, 5, False)]
    assert reads(Position(0), Position(5), None) == [Read(0, 5, True)]
    assert reads(Position(5), Position(5), None) == []
    try:
        reads(Position(6, 9, k1), Position(7), None)
    except InvalidUsage:
        return
    raise AssertionError("an end inside the start's bucket was taken")
