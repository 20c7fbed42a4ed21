"""core.erasure: the erase transition and the rewrite under it, on their own."""

from __future__ import annotations

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist.core import erasure
from persist.core.arrow.evolution import Shapes, View
from persist.core.arrow.updates import checksum, decode_part, encode_part
from persist.core.shard.diff import StateDiff, apply_diff
from persist.core.shard.transitions import (
    Break,
    Continue,
    apply_merge,
    compare_and_append,
    register_writer,
)
from persist.core.shard.types import HollowBatch, PartRef, SchemaVersion, State
from persist.errors import InvalidUsage

from .test_state import LEASE, commit, created

TIMEOUT = 1_000
SCHEMA = pa.schema([pa.field("k", pa.int64())])
# The shard's one schema version, as a never-evolved shard's state implies it.
VIEW = View(Shapes(0, {0: SchemaVersion(SCHEMA.serialize().to_pybytes(), (0,))}, (0,)))
SECRET = pc.field("k") == 13


def table(keys: list[int], time: int = 0) -> pa.Table:
    return pa.table(
        {
            "k": pa.array(keys, pa.int64()),
            "_time": pa.array([time] * len(keys), pa.uint64()),
            "_diff": pa.array([1] * len(keys), pa.int64()),
        }
    )


def part(key: str, keys: list[int], inline: bool = False) -> tuple[PartRef, bytes]:
    data = encode_part(table(keys), dictionary=not inline)
    ref = PartRef(key, len(keys), len(data), checksum(data), 0, 0, inline=data if inline else b"")
    return ref, data


def rewritten(key: str, keys: list[int], inline: bool, new_key: str) -> erasure.Rewrite | None:
    ref, data = part(key, keys, inline)
    return erasure.rewrite(data, ref, SECRET, VIEW, new_key)


def appended(state: State, batches: list[HollowBatch], upper: int) -> State:
    if "w" not in state.writers:
        state = commit(state, register_writer(state, "w", "", LEASE, 0))
    out = compare_and_append(state, "w", batches, state.upper, upper, f"t{upper}", 0)
    return commit(state, out)


def shard() -> State:
    b1 = HollowBatch(
        "b1", 0, 2, 0, (part("p1", [1, 2])[0], part("p2", [13, 14])[0]), sorted_run=True
    )
    b2 = HollowBatch("b2", 2, 3, 0, (part("p3", [13], inline=True)[0],))
    b3 = HollowBatch("b3", 3, 4, 0, (part("p4", [3, 4])[0],))
    state = msgspec.structs.replace(created(), schema=SCHEMA.serialize().to_pybytes())
    return appended(state, [b1, b2, b3], 4)


def read_all(s: State, skip: str = "") -> erasure.Read:
    """What the edge would read of ``s`` (but part ``skip``): each part rewritten, or None."""
    sources = {"p1": [1, 2], "p2": [13, 14], "p3": [13], "p4": [3, 4]}
    parts = {}
    dirty = []
    for b in s.batches.values():
        for p in b.parts:
            if p.key != skip:
                parts[p.key] = rewritten(p.key, sources[p.key], bool(p.inline), f"{p.key}-e")
        if any(parts.get(p.key) is not None or p.key == skip for p in b.parts):
            dirty.append((b.lower, b.upper))
    return erasure.Read(parts, s.upper, tuple(dirty))


def test_a_rewrite_holds_the_rest_and_only_the_rest() -> None:
    done = rewritten("p", [1, 13, 13, 20], False, "p-e")
    assert done is not None and done.rows == 2 and done.part is not None
    assert done.part.key == "p-e" and done.part.rows == 2 and done.part.key_index
    kept = decode_part(done.data, done.part.checksum, done.part.key)
    assert kept.column("k").to_pylist() == [1, 20]
    inline = rewritten("q", [13, 5], True, "q-e")
    assert inline is not None and inline.data == b"" and inline.part is not None
    assert decode_part(inline.part.inline, inline.part.checksum, "q").column("k").to_pylist() == [5]
    assert rewritten("r", [1, 2], False, "r-e") is None  # nothing matched
    gone = rewritten("s", [13], False, "s-e")
    assert gone == erasure.Rewrite(None, 1)


def test_one_commit_replaces_every_batch_that_held_a_match() -> None:
    s = shard()
    out = erasure.erase(s, SECRET, read_all(s), 10, TIMEOUT, 20)
    assert isinstance(out, Continue)
    erased = out.result
    assert erased == erasure.Erased(s.seqno + 1, 2, 2, 2, frozenset({"p2-e"}))
    after = apply_diff(s, out.diff)
    assert "b1" not in after.batches and "b2" not in after.batches  # b2 held nothing else
    (new,) = [b for bid, b in after.batches.items() if bid != "b3"]
    # The same bounds and sortedness, the clean part as it was, the rewrite in place of p2.
    assert [p.key for p in new.parts] == ["p1", "p2-e"]
    assert msgspec.structs.replace(new, id="b1", parts=s.batches["b1"].parts) == s.batches["b1"]
    # Only the replaced part in blob is retired (at the erase); an inline part had no blob.
    assert after.retired == {"p2": after.seqno}
    assert after.since == s.since and after.upper == s.upper
    # Nothing left to erase: no commit.
    read = read_all(s)
    read = erasure.Read({**read.parts, "p2-e": None}, after.upper, ())
    again = erasure.erase(after, SECRET, read, 10, TIMEOUT, 20)
    assert isinstance(again, Break) and again.result == erasure.Erased()


def test_an_unread_part_in_blob_makes_it_read_again_and_an_inline_one_is_rewritten() -> None:
    s = shard()
    read = read_all(s)
    later = appended(s, [HollowBatch("b4", 4, 5, 0, (part("p5", [13, 7])[0],))], 5)
    out = erasure.erase(later, SECRET, read, 10, TIMEOUT, 20)
    assert isinstance(out, Break) and out.result is None and out.error is None
    # An inline part appended since the read is at hand: the commit rewrites it itself.
    inline, _ = part("p6", [13, 8], inline=True)
    later = appended(s, [HollowBatch("b5", 4, 5, 0, (inline,))], 5)
    out = erasure.erase(later, SECRET, read, 10, TIMEOUT, 20)
    assert isinstance(out, Continue) and out.result.batches == 3 and out.result.rows == 3
    after = apply_diff(later, out.diff)
    (p6,) = [p for b in after.batches.values() for p in b.parts if p.inline]
    assert decode_part(p6.inline, p6.checksum, p6.key).column("k").to_pylist() == [8]
    # A fold (the same parts, another batch) needs no reading.
    folded = msgspec.structs.replace(s.batches["b1"], id="f", parts=s.batches["b1"].parts)
    moved = apply_diff(
        s,
        StateDiff(
            s.shard_id, s.seqno, s.seqno + 1, s.latest_rollup, batches=[("b1", None), ("f", folded)]
        ),
    )
    assert isinstance(erasure.erase(moved, SECRET, read, 10, TIMEOUT, 20), Continue)


def test_a_merge_nobody_read_needs_reading_only_where_a_match_was() -> None:
    s = shard()
    read = read_all(s)
    # b3 ([3, 4)) held no match: its merge with nothing dirty is known clean unread; b1
    # ([0, 2)) held one: a merge over it must be read.
    clean_merge = HollowBatch("m1", 3, 4, 0, (part("q1", [3, 4])[0],), sorted_run=True)
    merged = commit(s, apply_merge(s, ["b3"], clean_merge, 0, 99, 0))
    out = erasure.erase(merged, SECRET, read, 10, TIMEOUT, 20)
    assert isinstance(out, Continue) and out.result.batches == 2
    assert apply_diff(merged, out.diff).batches["m1"] == clean_merge
    dirty_merge = HollowBatch("m2", 0, 2, 0, (part("q2", [1, 2, 14])[0],), sorted_run=True)
    merged = commit(s, apply_merge(s, ["b1"], dirty_merge, 0, 99, 0))
    out = erasure.erase(merged, SECRET, read, 10, TIMEOUT, 20)
    assert isinstance(out, Break) and out.result is None
    # Nor is a batch past the read's upper known, whatever it overlaps.
    past = erasure.Read(read.parts, 3, read.dirty)
    merged = commit(s, apply_merge(s, ["b3"], clean_merge, 0, 99, 0))
    out = erasure.erase(merged, SECRET, past, 10, TIMEOUT, 20)
    assert isinstance(out, Break) and out.result is None


def test_rewrites_started_too_long_ago_are_refused() -> None:
    s = shard()
    late = erasure.erase(s, SECRET, read_all(s), 10, TIMEOUT, 10 + TIMEOUT + 1)
    assert isinstance(late, Break) and late.result is None
    in_time = erasure.erase(s, SECRET, read_all(s), 10, TIMEOUT, 10 + TIMEOUT)
    assert isinstance(in_time, Continue)


def test_a_finalized_shard_and_a_predicate_that_fails_are_refused() -> None:
    s = msgspec.structs.replace(shard(), finalized=True)
    out = erasure.erase(s, SECRET, erasure.Read({}, 0, ()), None, TIMEOUT, 0)
    assert isinstance(out, Break) and isinstance(out.error, InvalidUsage)
    s = shard()
    unread_inline = read_all(s, skip="p3")
    out = erasure.erase(s, pc.field("k") == "x", unread_inline, None, TIMEOUT, 0)
    assert isinstance(out, Break) and isinstance(out.error, InvalidUsage)


def test_unmatched_keeps_order_and_rows_the_predicate_is_null_for() -> None:
    t = pa.table(
        {
            "k": pa.array([1, 2, None, 4], pa.int64()),
            "_time": pa.array([0, 1, 2, 3], pa.uint64()),
            "_diff": pa.array([1, -1, 1, 1], pa.int64()),
        }
    )
    kept = erasure.unmatched(t, pc.field("k") >= 2)
    assert kept.column("k").to_pylist() == [1, None]
    assert kept.column("_time").to_pylist() == [0, 2]
    with pytest.raises(InvalidUsage, match="predicate"):
        erasure.unmatched(t, pc.field("k") == "a")
