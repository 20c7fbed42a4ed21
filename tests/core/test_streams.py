"""core.streams: a committed write's (writer_id, seq) -> LSN, recorded with its commit."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st_

from persist.core import codec
from persist.core import state as st
from persist.core.streams import (
    SEQ_BLOCK,
    check_writer_id,
    latest_seq,
    lookup_seq,
    record_seqs,
)
from tests.core.test_state import commit, created


def _commit_seqs(state: st.State, entries: list[tuple[str, int, int]], keep: int) -> st.State:
    txn = st.Txn(state, 0)
    record_seqs(txn, entries, keep)
    txn.stream_upper = max(txn.stream_upper, max((e[2] for e in entries), default=-1) + 1)
    diff = txn.finish()
    # Through the wire encoding, as every diff travels.
    return commit(state, st.Continue(codec.decode_diff(codec.encode_diff(diff)), None))


@settings(max_examples=60, deadline=None)
@given(
    groups=st_.lists(
        st_.lists(
            st_.tuples(st_.sampled_from(["a", "b", "c"]), st_.sampled_from([1, 1, 1, 2, 40])),
            max_size=60,
        ),
        max_size=8,
    ),
    keep=st_.sampled_from([SEQ_BLOCK, 3 * SEQ_BLOCK, 100_000]),
)
def test_every_recent_seq_is_found_at_its_lsn(
    groups: list[list[tuple[str, int]]], keep: int
) -> None:
    # Writers stream interleaved: each write takes the next LSN; a writer's seqs go up by steps.
    state = created()
    next_seq = {"a": 0, "b": 0, "c": 0}
    lsn = 0
    taken: dict[tuple[str, int], int] = {}
    for group in groups:
        entries = []
        for writer, step in group:
            seq = next_seq[writer] + (step - 1) * 37  # runs, gaps, and seqs across blocks
            next_seq[writer] = seq + 1
            entries.append((writer, seq, lsn))
            taken[(writer, seq)] = lsn
            lsn += 1
        state = _commit_seqs(state, entries, keep)
    assert state.stream_upper == lsn
    for (writer, seq), at in taken.items():
        top = latest_seq(state.stream_seqs, writer)
        assert top is not None and top >= seq
        found = lookup_seq(state.stream_seqs, writer, seq)
        if seq > top - keep:
            assert found == at, (writer, seq)
        else:
            assert found in (None, at)  # dropped with its block, or still in a kept block
    # No block of a writer lies wholly below its latest `keep` seqs.
    for key in state.stream_seqs:
        writer, _, block = key.rpartition("\n")
        top = latest_seq(state.stream_seqs, writer)
        assert top is not None and (int(block) + 1) * SEQ_BLOCK > top - keep + 1


def test_a_seq_is_taken_once() -> None:
    state = _commit_seqs(created(), [("w", 0, 10), ("w", 1, 11)], 100)
    state = _commit_seqs(state, [("w", 1, 99), ("w", 2, 12)], 100)
    assert [lookup_seq(state.stream_seqs, "w", s) for s in range(4)] == [10, 11, 12, None]
    assert state.stream_seqs["w\n0"].runs == ((0, 10, 3),)


def test_a_writer_alone_is_one_run_per_block() -> None:
    state = created()
    lsn = 100
    for start in range(0, 3000, 250):
        entries = [("w", seq, lsn + seq) for seq in range(start, start + 250)]
        state = _commit_seqs(state, entries, 100_000)
    assert {k: v.runs for k, v in state.stream_seqs.items()} == {
        "w\n0": ((0, 100, 1024),),
        "w\n1": ((1024, 1124, 1024),),
        "w\n2": ((2048, 2148, 952),),
    }
    # A gap starts a new run; a replayed seq keeps its LSN.
    state = _commit_seqs(state, [("w", 3010, 9000), ("w", 3011, 9001), ("w", 5, 1)], 100_000)
    assert state.stream_seqs["w\n2"].runs == ((2048, 2148, 952), (3010, 9000, 2))
    assert lookup_seq(state.stream_seqs, "w", 5) == 105


def test_writer_ids() -> None:
    assert check_writer_id("producer-1") is None
    for bad in ("", None, 3, "a\nb", "x" * 257):
        assert check_writer_id(bad) is not None
