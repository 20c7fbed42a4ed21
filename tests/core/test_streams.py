"""core.stream.streams: what a shard records of streamed writes, and the one transition that commits a
server's group (its landed groups, named writes and fingerprints, other servers, other writers,
drops). The interleavings of all of them with the ledger are ``tests/core/test_ledger.py``'s."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st_

from persist.core.shard import codec
from persist.core.shard import lifecycle as life
from persist.core.shard.diff import apply_diff
from persist.core.shard.streamed import SeqRuns
from persist.core.shard.transitions import (
    Break,
    Continue,
    Outcome,
    StreamServer,
    Txn,
    compare_and_append,
    register_writer,
)
from persist.core.shard.types import State
from persist.core.stream.streams import (
    SEQ_BLOCK,
    GroupLanded,
    Named,
    Recorded,
    SeqsTaken,
    ShardGone,
    check_writer_id,
    commit_group,
    lookup,
    record_named,
    resolved_below,
)
from persist.errors import UpperMismatch
from tests.core.test_state import batch, commit, created

LEASE = 1 << 40


def _writing(*writers: str) -> State:
    s = created()
    for w in writers:
        s = commit(s, register_writer(s, w, "test", LEASE, 0))
    return s


def _group(
    s: State,
    server: str,
    lsn_end: int,
    named: list[Named],
    times: int,
    expected: int | None = None,
) -> Outcome[object]:
    upper = s.upper if expected is None else expected
    assert upper is not None
    hollows = [batch(f"b{s.seqno}", upper, upper + times, times)] if times else []
    return commit_group(s, "w", server, lsn_end, named, hollows, upper, times, f"t{s.seqno}", 1)


def _through_the_wire(s: State, out: Outcome[object]) -> State:
    assert isinstance(out, Continue), out
    return apply_diff(s, codec.decode_diff(codec.encode_diff(out.diff)))


@settings(max_examples=60, deadline=None)
@given(
    groups=st_.lists(
        st_.tuples(
            st_.sampled_from(["A", "B"]),
            st_.lists(
                st_.tuples(st_.sampled_from(["a", "b", "c"]), st_.sampled_from([1, 1, 1, 2, 40])),
                min_size=1,
                max_size=60,
            ),
        ),
        max_size=8,
    ),
    keep=st_.sampled_from([SEQ_BLOCK, 3 * SEQ_BLOCK, 100_000]),
)
def test_every_recent_named_write_is_found_where_it_landed(
    groups: list[tuple[str, list[tuple[str, int]]]], keep: int
) -> None:
    """Two servers commit groups of named writes, interleaved: each write is found at its
    server, LSN, time and fingerprint, for as long as it is among its writer's latest ``keep``
    seqs; no block lies wholly below them."""
    state = _writing("w")
    next_seq = {"a": 0, "b": 0, "c": 0}
    next_lsn = {"A": 0, "B": 0}
    landed: dict[tuple[str, int], Recorded] = {}
    for server, writes in groups:
        upper = state.upper
        assert upper is not None
        named = []
        for i, (writer, step) in enumerate(writes):
            seq = next_seq[writer] + (step - 1) * 37  # runs, gaps, and seqs across blocks
            next_seq[writer] = seq + 1
            lsn = next_lsn[server]
            next_lsn[server] += 1
            named.append(Named(writer, seq, lsn, i, fingerprint=seq * 7 + 1))
            landed[(writer, seq)] = Recorded(upper + i, server, lsn, seq * 7 + 1)
        txn = Txn(state, 0)
        record_named(txn, 1 if server == "A" else 2, upper, named, keep)
        txn.stream_servers.put(server, StreamServer(1 if server == "A" else 2, 0, upper))
        txn.upper = upper + len(writes)
        state = _through_the_wire(state, Continue(txn.finish(), None))
    tops = {w: n - 1 for w, n in next_seq.items()}
    for (writer, seq), where in landed.items():
        found = lookup(state, writer, seq)
        if seq > tops[writer] - keep:
            assert found == where, (writer, seq)
        else:
            assert found in (None, where)  # dropped with its block, or still in a kept block
    for key in state.stream_named:
        writer, _, block = key.rpartition("\n")
        assert (int(block) + 1) * SEQ_BLOCK > tops[writer] - keep + 1


def test_a_writer_alone_is_one_run_per_block() -> None:
    """Its seqs, LSNs and times all step by one: groups extend the block's last run."""
    state = _writing("w")
    upper = 0
    for start in range(0, 1000, 250):
        named = [Named("p", s, 100 + s, s - start, s + 1) for s in range(start, start + 250)]
        out = _group(state, "A", 100 + start + 250, named, 250)
        state = _through_the_wire(state, out)
        assert isinstance(out, Continue) and out.result == GroupLanded(upper)
        upper += 250
    blocks = {k: v.runs for k, v in state.stream_named.items()}
    assert blocks == {"p\n0": ((0, 512, 1, 100, 0),), "p\n1": ((512, 488, 1, 612, 512),)}
    assert lookup(state, "p", 511) == Recorded(511, "A", 611, 512)
    assert lookup(state, "p", 1000) is None
    # A commit's diff holds only the blocks it touched.
    more = [Named("p", 1000, 1100, 0, 1001)]
    out = _group(state, "A", 1101, more, 1)
    assert isinstance(out, Continue)
    assert [k for k, _ in out.diff.stream_named] == ["p\n1"]


def test_a_group_that_landed_is_found_landed_whatever_else_happened() -> None:
    state = _writing("w", "other")
    out = _group(state, "A", 5, [Named("p", 0, 4, 0, 9)], 1)
    state = commit(state, out)
    # Other writers move the upper; the shard is even dropped: the group's own record answers.
    state = commit(state, compare_and_append(state, "other", [batch("o", 1, 3)], 1, 3, "x", 1))
    again = _group(state, "A", 5, [Named("p", 0, 4, 0, 9)], 1, expected=0)
    assert isinstance(again, Break) and again.result == GroupLanded(0, already=True)
    state = commit(state, life.drop(state, True, 2))
    again = _group(state, "A", 5, [Named("p", 0, 4, 0, 9)], 1, expected=0)
    assert isinstance(again, Break) and again.result == GroupLanded(0, already=True)
    later = _group(state, "A", 9, [], 1, expected=0)
    assert isinstance(later, Break) and isinstance(later.result, ShardGone)


def test_a_named_write_another_server_committed_is_taken_and_nothing_lands() -> None:
    state = _writing("w")
    state = commit(state, _group(state, "B", 1, [Named("p", 7, 0, 0, 33)], 1))
    out = _group(state, "A", 3, [Named("p", 6, 1, 0, 5), Named("p", 7, 2, 1, 33)], 2)
    assert isinstance(out, Break)
    assert out.result == SeqsTaken({("p", 7): Recorded(0, "B", 0, 33)})
    # Without it the group lands; a group of nothing but such writes moves no upper.
    out = _group(state, "A", 3, [Named("p", 6, 1, 0, 5)], 1)
    state = commit(state, out)
    assert state.upper == 2 and resolved_below(state, "A") == 3
    out = _group(state, "A", 7, [], 0)
    state = commit(state, out)
    assert state.upper == 2 and resolved_below(state, "A") == 7
    assert resolved_below(state, "B") == 1 and resolved_below(state, "C") == 0


def test_a_part_the_upper_passed_is_written_again_ahead_of_it() -> None:
    state = _writing("w", "other")
    state = commit(state, compare_and_append(state, "other", [batch("o", 0, 4)], 0, 4, "x", 1))
    out = _group(state, "A", 1, [Named("p", 0, 0, 0, 1)], 1, expected=0)
    assert isinstance(out, Break) and isinstance(out.error, UpperMismatch)
    assert out.error.current == 4
    # Written again ahead of the upper, it lands while the upper has not passed it: the times
    # between stay empty.
    state = commit(state, compare_and_append(state, "other", [batch("o2", 4, 5)], 4, 5, "y", 1))
    out = _group(state, "A", 1, [Named("p", 0, 0, 0, 1)], 1, expected=8)
    state = commit(state, out)
    assert state.upper == 9 and lookup(state, "p", 0) == Recorded(8, "A", 0, 1)


def test_the_previous_releases_records_are_still_read() -> None:
    """Before LSNs were log positions, a shard recorded ``stream_upper`` (every streamed LSN
    below it committed, an LSN being a time) and seqs in runs of (seq, lsn, count)."""
    state = _writing("w")
    txn = Txn(state, 0)
    txn.stream_upper = 50
    txn.stream_seqs.put("p\n0", SeqRuns(((0, 40, 10),)))
    state = commit(state, Continue(txn.finish(), None))
    assert lookup(state, "p", 3) == Recorded(43, None, None, 0)
    assert lookup(state, "p", 10) is None
    # Every server's LSNs start above it, so that none is taken for one of those.
    assert resolved_below(state, "A") == 50


def test_writer_ids() -> None:
    assert check_writer_id("producer-1") is None
    for bad in ("", None, 3, "a\nb", "x" * 257):
        assert check_writer_id(bad) is not None
