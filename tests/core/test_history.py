"""Retention and the history of uppers (``core.shard.history``), on the pure state machine: a model
check over every interleaving of appends, readers, clock moves and maintenance."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st_
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from persist.core.frontier import frontier_le
from persist.core.shard import history as hist
from persist.core.shard import lifecycle as life
from persist.core.shard.diff import apply_diff
from persist.core.shard.transitions import (
    Continue,
    Outcome,
    compare_and_append,
    create_shard,
    downgrade_since,
    expire_reader,
    register_reader,
    register_writer,
)
from persist.core.shard.types import HollowBatch, PartRef, RollupRef, State, empty_state
from persist.errors import InvalidUsage

SHARD = "s00000000-0000-0000-0000-000000000002"
LEASE = 10 * 60_000


def _commit(state: State, out: Outcome[object]) -> State:
    assert isinstance(out, Continue), out
    return apply_diff(state, out.diff)


def _created(now: int, retention_ms: int | None) -> State:
    base = empty_state(SHARD)
    out = create_shard(base, b"schema", RollupRef(1, "rollup-1"), now, retention_ms)
    return _commit(base, out)


def _batch(bid: str, lower: int, upper: int, added: int, retracted: int) -> HollowBatch:
    rows = added + retracted
    part = PartRef(f"{bid}/0", rows, 10, "c" * 32, lower, lower, 0, b"", b"", -1, 1, retracted)
    return HollowBatch(bid, lower, upper, 0, (part,))


class Retention(RuleBasedStateMachine):
    """A shard with a fixed retention R: whatever readers and the clock do, every time that was
    readable at an instant within the last R stays readable; without readers the since follows
    the window; the record stays bounded."""

    @initialize(retention_s=st_.integers(1, 600))
    def create(self, retention_s: int) -> None:
        self.now = 1_000_000
        self.retention = retention_s * 1000
        self.state = _created(self.now, self.retention)
        self.state = _commit(
            self.state, register_writer(self.state, "w", "loader", 10**12, self.now)
        )
        # (instant, upper) of every upper reached: the ground truth as_of_at must agree with.
        self.reached: list[tuple[int, int]] = [(self.now, 0)]
        self.readers: list[str] = []
        self.last_since: int | None = 0
        self.n = 0

    def _apply(self, out: Outcome[object]) -> object:
        if isinstance(out, Continue):
            self.state = apply_diff(self.state, out.diff)
            return out.result
        return out.result

    @rule(ms=st_.sampled_from([1, 50, 999, 5_000, 61_000, 250_000, 900_000]))
    def tick(self, ms: int) -> None:
        self.now += ms

    @rule(step=st_.integers(1, 3), added=st_.integers(0, 5), retracted=st_.integers(0, 2))
    def append(self, step: int, added: int, retracted: int) -> None:
        upper = self.state.upper
        assert upper is not None
        self.n += 1
        batches = [_batch(f"b{self.n}", upper, upper + step, added, retracted)]
        out = compare_and_append(
            self.state, "w", batches, upper, upper + step, f"t{self.n}", self.now
        )
        self._apply(out)
        self.reached.append((max(self.now, self.reached[-1][0]), upper + step))

    @rule()
    def register(self) -> None:
        rid = f"r{len(self.readers)}"
        self._apply(register_reader(self.state, rid, "", LEASE, self.now))
        self.readers.append(rid)

    @precondition(lambda self: self.readers)
    @rule(data=st_.data())
    def downgrade(self, data: st_.DataObject) -> None:
        rid = data.draw(st_.sampled_from(self.readers))
        reader = self.state.readers.get(rid)
        if reader is None or reader.since is None or self.state.upper is None:
            return
        to = data.draw(st_.integers(reader.since, max(reader.since, self.state.upper + 5)))
        self._apply(downgrade_since(self.state, rid, to, self.state.seqno, self.now))

    @precondition(lambda self: self.readers)
    @rule(data=st_.data())
    def expire(self, data: st_.DataObject) -> None:
        rid = data.draw(st_.sampled_from(self.readers))
        self._apply(expire_reader(self.state, rid, self.now))

    @rule()
    def maintain(self) -> None:
        self._apply(life.advance_since(self.state, self.now))

    @invariant()
    def since_never_regresses(self) -> None:
        assert frontier_le(self.last_since, self.state.since)
        self.last_since = self.state.since

    @invariant()
    def every_instant_within_retention_reads(self) -> None:
        s = self.state
        window = self.now - self.retention
        instants = [w for w, _ in self.reached if w >= window] + [window, self.now]
        for when in instants:
            truth = max((u for w, u in self.reached if w <= when), default=None)
            if truth is None or truth == 0:
                continue  # nothing readable then
            # Never refused for the since; exact for the newest FINE commits, else at most a
            # granule older (a time readable then, never a later one).
            got = hist.as_of_at(s.history, s.retention_ms, self.now, s.since, when)
            assert got <= truth - 1
            recent = [w for w, _ in self.reached[-hist.FINE :]]
            if recent and when >= recent[0]:
                assert got == truth - 1, (when, got, truth)
            else:
                g = hist.granule(self.retention)
                earlier = max((u for w, u in self.reached if w <= when - g), default=0)
                assert got >= earlier - 1

    @invariant()
    def without_readers_the_since_follows_the_window(self) -> None:
        s = self.state
        if s.readers:
            return
        since = life.advance_since(s, self.now).result
        bound = hist.bound(s.history, self.retention, self.now, s.since)
        assert bound is not None and s.since is not None  # never sealed here
        assert since == max(bound, s.since)

    @invariant()
    def the_record_is_bounded(self) -> None:
        assert len(self.state.history) <= hist.FINE + hist.COARSE + 3


TestRetention = Retention.TestCase
TestRetention.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def test_a_reader_can_not_pass_the_window_and_the_window_moves_on() -> None:
    state = _created(0, 60_000)
    state = _commit(state, register_writer(state, "w", "", 10**12, 0))
    state = _commit(state, register_reader(state, "r", "", 10**12, 0))
    for i in range(10):
        out = compare_and_append(state, "w", [], i, i + 1, f"t{i}", 1000 * i)
        state = _commit(state, out)
    state = _commit(state, downgrade_since(state, "r", 9, state.seqno, 10_000))
    assert state.since == 0  # every time was readable within the last minute
    # 61 s + the skew allowance after time 4 became readable (upper 5, at 4 s): up to 4 may go.
    later = 4_000 + 60_000 + hist.SKEW_MS + 1
    state = _commit(state, life.advance_since(state, later))
    assert state.since == 4
    # Retention None: the reader alone holds.
    state = _commit(state, life.set_retention(state, None, later))
    assert state.since == 9


def test_as_of_at_refuses_outside_what_it_knows() -> None:
    state = _created(1_000, 60_000)
    state = _commit(state, register_writer(state, "w", "", 10**12, 1_000))
    with pytest.raises(InvalidUsage, match="nothing had been written"):
        hist.as_of_at(state.history, 60_000, 2_000, 0, 1_500)
    state = _commit(state, compare_and_append(state, "w", [], 0, 3, "t", 2_000))
    assert hist.as_of_at(state.history, 60_000, 2_500, 0, 2_000) == 2
    with pytest.raises(InvalidUsage, match="future"):
        hist.as_of_at(state.history, 60_000, 2_500, 0, 2_600)
    with pytest.raises(InvalidUsage, match="retention"):
        hist.as_of_at(state.history, 60_000, 100_000, 0, 2_000)
    with pytest.raises(InvalidUsage, match="does not reach back"):
        hist.as_of_at(state.history, 60_000, 2_500, 0, 500)
    with pytest.raises(InvalidUsage, match="no longer readable"):
        hist.as_of_at(state.history, None, 2_500, 5, 2_000)


def test_history_records_what_each_commit_wrote() -> None:
    state = _created(0, None)
    state = _commit(state, register_writer(state, "w", "loader", 10**12, 0))
    state = _commit(state, compare_and_append(state, "w", [_batch("a", 0, 1, 3, 1)], 0, 1, "t", 5))
    state = _commit(state, compare_and_append(state, "w", [], 1, 1, "t2", 6))  # no move
    marks = [m for _, m in hist.within(state.history, None, 10)]
    assert [(m.upper, m.added, m.retracted, m.purpose) for m in marks] == [
        (0, 0, 0, ""),
        (1, 3, 1, "loader"),
    ]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_thousands_of_commits_keep_a_bounded_record_precise_to_a_granule(seed: int) -> None:
    import random

    rng = random.Random(seed)
    retention = [600_000, 3_600_000, 3_600_000][seed - 1]
    now = 1_000_000
    state = _created(now, retention)
    state = _commit(state, register_writer(state, "w", "", 10**12, now))
    reached = [(now, 0)]
    for i in range(3 * hist.FINE + 2 * hist.COARSE):
        now += rng.choice([1, 10, 200, 3_000])
        upper = state.upper
        assert upper is not None
        state = _commit(state, compare_and_append(state, "w", [], upper, upper + 1, f"t{i}", now))
        reached.append((now, upper + 1))
        assert len(state.history) <= hist.FINE + hist.COARSE + 3
    g = hist.granule(retention)
    for _ in range(300):
        when = rng.randint(max(now - retention, reached[1][0]), now)
        truth = max(u for w, u in reached if w <= when)
        got = hist.as_of_at(state.history, retention, now, state.since, when)
        earlier = max((u for w, u in reached if w <= when - g), default=0)
        assert earlier - 1 <= got <= truth - 1
        if when >= reached[-hist.FINE][0]:
            assert got == truth - 1
    coarse = [m for m in state.history.values() if m.commits > 1]
    assert coarse, "no mark was folded: the test never left the fine zone"
    folded = sum(m.commits for m in state.history.values())
    assert folded <= len(reached)  # each commit counted at most once, old ones dropped
