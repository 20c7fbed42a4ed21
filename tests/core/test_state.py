"""The pure state machine, on its own: transitions, invariants, diffs and replay."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st_
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import persist.core
from persist.core.frontier import frontier_le, frontier_min
from persist.core.shard import codec, garbage
from persist.core.shard import lifecycle as life
from persist.core.shard.diff import DIFFED_FIELDS, StateDiff, apply_diff
from persist.core.shard.transitions import (
    Break,
    Committed,
    Continue,
    Outcome,
    add_rollup,
    apply_merge,
    compare_and_append,
    create_shard,
    downgrade_since,
    evolve_schema,
    expire_reader,
    expire_writer,
    heartbeat_writer,
    register_reader,
    register_writer,
)
from persist.core.shard.types import (
    HollowBatch,
    PartRef,
    RollupRef,
    SchemaVersion,
    State,
    empty_state,
)
from persist.errors import InvalidUsage, LeaseExpired, SchemaChanged, UpperMismatch

SHARD = "s00000000-0000-0000-0000-000000000001"
LEASE = 1_000


def created(now: int = 0) -> State:
    base = empty_state(SHARD)
    out = create_shard(base, b"schema", RollupRef(1, "rollup-1"), now)
    assert isinstance(out, Continue)
    return apply_diff(base, out.diff)


def commit(state: State, out: Outcome[object]) -> State:
    assert isinstance(out, Continue), out
    return apply_diff(state, out.diff)


def batch(bid: str, lower: int, upper: int | None, rows: int = 1) -> HollowBatch:
    part = PartRef(f"{bid}/0", rows, 10 * rows, "c" * 32, lower, lower)
    return HollowBatch(bid, lower, upper, 0, (part,))


def test_every_state_field_is_diffed() -> None:
    state_fields = {f for f in State.__struct_fields__}
    bookkeeping = {"shard_id", "seqno"}
    diff_fields = set(StateDiff.__struct_fields__) - {
        "shard_id",
        "seqno_from",
        "seqno_to",
        "latest_rollup",
    }
    assert state_fields - bookkeeping == DIFFED_FIELDS == diff_fields


def test_core_does_no_io() -> None:
    """Every module of ``core``, in every one of its folders, is pure."""
    banned = {"asyncio", "time", "uuid", "random", "os", "socket", "persist.location"}
    paths = sorted(Path(persist.core.__file__).parent.rglob("*.py"))
    assert {p.parent.name for p in paths} >= {"core", "arrow", "read", "shard", "stream"}
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in banned - {"persist.location"}, (path, name)
                assert not name.startswith("persist.location"), (path, name)


def test_create_then_register_and_append() -> None:
    s = created()
    assert (s.seqno, s.since, s.upper, s.schema) == (1, 0, 0, b"schema")
    assert s.latest_rollup == RollupRef(1, "rollup-1")
    s = commit(s, register_writer(s, "w1", "test", LEASE, 0))
    out = compare_and_append(s, "w1", [batch("b1", 0, 5)], 0, 5, "t1", 1)
    assert isinstance(out, Continue) and out.result == Committed(5)
    s = apply_diff(s, out.diff)
    assert s.upper == 5 and list(s.batches) == ["b1"]
    assert out.diff.batches == [("b1", batch("b1", 0, 5))]
    assert out.diff.readers == [] and out.diff.rollups == []  # proportional to the change


def test_upper_mismatch_and_idempotent_retry() -> None:
    s = created()
    s = commit(s, register_writer(s, "w1", "", LEASE, 0))
    s = commit(s, compare_and_append(s, "w1", [batch("b1", 0, 5)], 0, 5, "t1", 1))
    again = compare_and_append(s, "w1", [batch("b1", 0, 5)], 0, 5, "t1", 2)
    assert isinstance(again, Break) and again.error is None
    assert again.result == Committed(5, already=True)
    other = compare_and_append(s, "w1", [batch("b2", 0, 5)], 0, 5, "t2", 2)
    assert isinstance(other, Break) and isinstance(other.error, UpperMismatch)
    assert (other.error.expected, other.error.current) == (0, 5)


def test_batch_appended_twice_is_refused() -> None:
    s = created()
    s = commit(s, register_writer(s, "w1", "", LEASE, 0))
    s = commit(s, compare_and_append(s, "w1", [batch("b1", 0, 5)], 0, 5, "t1", 1))
    out = compare_and_append(s, "w1", [batch("b1", 5, 6)], 5, 6, "t2", 1)
    assert isinstance(out, Break) and isinstance(out.error, InvalidUsage)


def test_new_upper_below_expected_is_refused() -> None:
    s = commit(created(), register_writer(created(), "w1", "", LEASE, 0))
    out = compare_and_append(s, "w1", [], 3, 2, "t", 0)
    assert isinstance(out, Break) and isinstance(out.error, InvalidUsage)


def test_since_is_min_of_readers_and_never_regresses() -> None:
    s = created()
    s = commit(s, register_reader(s, "r1", "", LEASE, 0))
    s = commit(s, register_reader(s, "r2", "", LEASE, 0))
    s = commit(s, downgrade_since(s, "r1", 5, s.seqno, 1))
    assert s.since == 0
    s = commit(s, downgrade_since(s, "r2", 3, s.seqno, 1))
    assert s.since == 3
    back = downgrade_since(s, "r2", 2, s.seqno, 1)
    assert isinstance(back, Break) and isinstance(back.error, InvalidUsage)
    s = commit(s, expire_reader(s, "r2", 2))
    assert s.since == 5
    s = commit(s, expire_reader(s, "r1", 2))
    assert s.since == 5 and not s.readers  # with no readers, since stays
    s = commit(s, register_reader(s, "r3", "", LEASE, 3))
    assert s.readers["r3"].since == 5


def test_leases_expire_on_the_next_commit() -> None:
    s = created()
    s = commit(s, register_writer(s, "w1", "", LEASE, 0))
    s = commit(s, register_reader(s, "r1", "", LEASE, 0))
    s = commit(s, register_reader(s, "r2", "", LEASE, 0))
    s = commit(s, downgrade_since(s, "r2", 7, s.seqno, 0))
    # r2 heartbeats, r1 and w1 go silent past their lease.
    s = commit(s, downgrade_since(s, "r2", 7, s.seqno, LEASE))
    s = commit(s, downgrade_since(s, "r2", 7, s.seqno, 2 * LEASE))
    assert "r1" not in s.readers and "w1" not in s.writers
    assert s.since == 7  # r1's hold was released
    out = compare_and_append(s, "w1", [], 0, 1, "t", 2 * LEASE)
    assert isinstance(out, Break) and isinstance(out.error, LeaseExpired)
    out2 = downgrade_since(s, "r1", 8, s.seqno, 2 * LEASE)
    assert isinstance(out2, Break) and isinstance(out2.error, LeaseExpired)


def test_a_handle_that_finds_its_own_lease_run_out_is_expired_at_once() -> None:
    s = created()
    s = commit(s, register_writer(s, "w1", "", LEASE, 0))
    s = commit(s, register_reader(s, "r1", "", LEASE, 0))
    s = commit(s, register_reader(s, "r2", "", LEASE, 0))
    s = commit(s, downgrade_since(s, "r2", 7, s.seqno, LEASE))  # r2 stays live
    assert s.since == 0  # r1 holds it
    # Past r1's and w1's leases, and nobody committed since: each one's own call finds it
    # run out.
    late = LEASE + LEASE // 2
    out = downgrade_since(s, "r1", 3, s.seqno, late)
    assert isinstance(out, Continue) and isinstance(out.error, LeaseExpired)
    s = apply_diff(s, out.diff)
    assert "r1" not in s.readers and s.since == 7  # released now, not at someone's next commit
    assert "w1" not in s.writers and "w1" in s.expired_writers  # every stale lease goes
    # Once expired, the same calls are refused with nothing to commit.
    again = downgrade_since(s, "r1", 3, s.seqno, late)
    assert isinstance(again, Break) and isinstance(again.error, LeaseExpired)
    w = heartbeat_writer(s, "w1", late)
    assert isinstance(w, Break) and isinstance(w.error, LeaseExpired)
    # A writer's own call commits its expiry the same way.
    s = commit(s, register_writer(s, "w2", "", LEASE, late))
    out2 = heartbeat_writer(s, "w2", late + 2 * LEASE)
    assert isinstance(out2, Continue) and isinstance(out2.error, LeaseExpired)
    assert "w2" not in apply_diff(s, out2.diff).writers


def test_finalize_needs_empty_frontiers() -> None:
    s = created()
    s = commit(s, register_writer(s, "w1", "", LEASE, 0))
    s = commit(s, register_reader(s, "r1", "", LEASE, 0))
    s = commit(s, compare_and_append(s, "w1", [batch("b1", 0, 5)], 0, 5, "t", 0))
    refused = life.finalize(s, 0)
    assert isinstance(refused, Break) and isinstance(refused.error, InvalidUsage)
    s = commit(s, compare_and_append(s, "w1", [], 5, None, "t2", 0))
    s = commit(s, downgrade_since(s, "r1", None, s.seqno, 0))
    out = life.finalize(s, 0)
    assert isinstance(out, Continue) and [b.id for b in out.result] == ["b1"]
    s = apply_diff(s, out.diff)
    assert s.finalized and not s.batches and not s.readers and not s.writers
    for refused2 in (
        register_writer(s, "w2", "", LEASE, 0),
        register_reader(s, "r2", "", LEASE, 0),
    ):
        assert isinstance(refused2, Break) and isinstance(refused2.error, InvalidUsage)


def test_add_rollup_only_moves_forward() -> None:
    s = created()
    for i in range(3):
        s = commit(s, register_writer(s, f"w{i}", "", LEASE, 0))
    s = commit(s, add_rollup(s, RollupRef(3, "r3"), 0))
    assert s.latest_rollup.seqno == 3
    stale = add_rollup(s, RollupRef(2, "r2"), 0)
    assert isinstance(stale, Break) and stale.result is False


def test_apply_diff_refuses_a_gap() -> None:
    s = created()
    out = register_writer(s, "w", "", LEASE, 0)
    assert isinstance(out, Continue)
    s2 = apply_diff(s, out.diff)
    with pytest.raises(ValueError):
        apply_diff(s2, out.diff)


class ShardModel(RuleBasedStateMachine):
    """Random transitions; after each, check invariants and that the diffs replay exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.state = created()
        self.rollup = self.state  # the state at the latest rollup
        self.diffs: list[bytes] = []
        self.next_id = 0
        self.contents: dict[str, int] = {}

    def _do(self, out: Outcome[object]) -> object:
        if isinstance(out, Break):
            return out
        encoded = codec.encode_diff(out.diff)
        assert codec.decode_diff(encoded) == out.diff
        self.diffs.append(encoded)
        before = self.state
        self.state = apply_diff(self.state, out.diff)
        assert self.state.seqno == before.seqno + 1
        return out.result

    def _fresh(self, kind: str) -> str:
        self.next_id += 1
        return f"{kind}{self.next_id}"

    @rule(dt=st_.integers(0, LEASE // 2))
    def tick(self, dt: int) -> None:
        self.now += dt

    @rule()
    def add_writer(self) -> None:
        self._do(register_writer(self.state, self._fresh("w"), "", LEASE, self.now))

    @rule()
    def add_reader(self) -> None:
        self._do(register_reader(self.state, self._fresh("r"), "", LEASE, self.now))

    @precondition(lambda self: bool(self.state.writers))
    @rule(data=st_.data(), width=st_.integers(0, 3), rows=st_.integers(0, 3), stale=st_.booleans())
    def append(self, data: st_.DataObject, width: int, rows: int, stale: bool) -> None:
        wid = data.draw(st_.sampled_from(sorted(self.state.writers)))
        upper = self.state.upper
        if upper is None:
            return
        expected = upper - 1 if stale and upper > 0 else upper
        new = expected + width
        batches = [batch(self._fresh("b"), expected, new, rows)] if rows and width else []
        before = self.state
        outcome = compare_and_append(
            self.state, wid, batches, expected, new, self._fresh("t"), self.now
        )
        self._do(outcome)
        w = before.writers[wid]
        stale_lease = w.last_heartbeat_ms + w.lease_duration_ms < self.now
        if expected != before.upper or stale_lease:
            assert outcome.error is not None
            assert isinstance(outcome.error, LeaseExpired) == stale_lease
            # A lease the writer's own call finds run out is expired in that same commit.
            assert isinstance(outcome, Continue) == stale_lease
            assert wid not in self.state.writers or not stale_lease
        else:
            assert self.state.upper == new and self.state.writers[wid].last_heartbeat_ms == self.now

    @precondition(lambda self: bool(self.state.readers))
    @rule(data=st_.data(), step=st_.integers(-1, 3))
    def downgrade(self, data: st_.DataObject, step: int) -> None:
        rid = data.draw(st_.sampled_from(sorted(self.state.readers)))
        current = self.state.readers[rid].since
        if current is None:
            return
        self._do(downgrade_since(self.state, rid, current + step, self.state.seqno, self.now))

    @precondition(lambda self: bool(self.state.readers))
    @rule(data=st_.data())
    def expire_reader(self, data: st_.DataObject) -> None:
        rid = data.draw(st_.sampled_from(sorted(self.state.readers)))
        self._do(expire_reader(self.state, rid, self.now))

    @precondition(lambda self: bool(self.state.writers))
    @rule(data=st_.data())
    def expire_writer(self, data: st_.DataObject) -> None:
        wid = data.draw(st_.sampled_from(sorted(self.state.writers)))
        self._do(expire_writer(self.state, wid, self.now))

    @rule()
    def rollup(self) -> None:
        snapshot = self.state
        if (
            self._do(
                add_rollup(self.state, RollupRef(snapshot.seqno, f"v{snapshot.seqno}"), self.now)
            )
            is True
        ):
            self.rollup = codec.decode_rollup(codec.encode_rollup(snapshot))
            self.diffs = self.diffs[-1:]

    @rule(stale=st_.booleans(), same=st_.booleans())
    def evolve(self, stale: bool, same: bool) -> None:
        current = max(self.state.schemas, default=0)
        new = None if same else SchemaVersion(f"schema{current + 1}".encode(), (current + 1,))
        expected = current - 1 if stale else current
        seed = SchemaVersion(self.state.schema, (0,))
        out = evolve_schema(self.state, seed, new, expected, self.now)
        if stale:
            assert isinstance(out, Break) and isinstance(out.error, SchemaChanged)
            return
        if same:
            assert isinstance(out, Break) and out.error is None and out.result == current
            return
        assert self._do(out) == current + 1

    @invariant()
    def schema_versions_are_consecutive_and_the_newest_is_the_schema(self) -> None:
        s = self.state
        if s.schemas:
            assert sorted(s.schemas) == list(range(len(s.schemas)))
            assert s.schema == s.schemas[max(s.schemas)].schema
            assert s.schemas[0].schema == b"schema"

    @invariant()
    def frontiers_are_consistent(self) -> None:
        s = self.state
        if s.readers:
            assert s.since == frontier_min(r.since for r in s.readers.values())
        for b in s.batches.values():
            assert frontier_le(b.upper, s.upper)
            for p in b.parts:
                assert b.lower <= p.min_time and (b.upper is None or p.max_time < b.upper)
        for w in s.writers.values():
            assert w.last_heartbeat_ms + w.lease_duration_ms >= 0

    @invariant()
    def replay_from_rollup_is_exact(self) -> None:
        state = self.rollup
        for d in self.diffs:
            diff = codec.decode_diff(d)
            if diff.seqno_from < state.seqno:
                continue
            state = apply_diff(state, diff)
        assert state == self.state
        assert codec.decode_rollup(codec.encode_rollup(self.state)) == self.state


TestShardModel = ShardModel.TestCase
TestShardModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st_.lists(st_.one_of(st_.none(), st_.integers(0, 10)), min_size=1))
def test_frontier_min_matches_definition(values: list[int | None]) -> None:
    ints = [v for v in values if v is not None]
    assert frontier_min(values) == (min(ints) if ints else None)
    for v in values:
        assert frontier_le(frontier_min(values), v)


def test_structs_are_frozen() -> None:
    s = created()
    with pytest.raises(AttributeError):
        s.upper = 3  # type: ignore[misc]
    assert dataclasses.is_dataclass(Continue)
    assert msgspec.structs.fields(HollowBatch)


def test_maintenance_transitions_recognise_their_own_landed_commit() -> None:
    """A retry after an indeterminate failure re-runs the transition on a state that already
    holds its effect: it must answer "done", not "lost" (the caller would delete live blobs)."""
    s = created()
    s = commit(s, register_writer(s, "w", "", LEASE, 0))
    s = commit(s, compare_and_append(s, "w", [batch("b1", 0, 1)], 0, 1, "t1", 0))
    s = commit(s, compare_and_append(s, "w", [batch("b2", 1, 2)], 1, 2, "t2", 0))
    out = HollowBatch("m", 0, 2, 0, (PartRef("m/0", 2, 20, "c" * 32, 0, 1),), True)
    s = commit(s, apply_merge(s, ["b1", "b2"], out, 0, 1_000, 0))
    again = apply_merge(s, ["b1", "b2"], out, 0, 1_000, 0)
    assert isinstance(again, Break) and again.result is True
    other = apply_merge(s, ["b1", "b2"], None, 0, 1_000, 0)
    assert isinstance(other, Break) and other.result is False

    ref = RollupRef(s.seqno, "rollup-x")
    s = commit(s, add_rollup(s, ref, 0))
    assert set(s.retired) == {"rollup-1", "b1/0", "b2/0"}
    landed = add_rollup(s, ref, 0)
    assert isinstance(landed, Break) and landed.result is True
    stale = add_rollup(s, RollupRef(s.seqno - 1, "rollup-y"), 0)
    assert isinstance(stale, Break) and stale.result is False


def test_merge_refused_when_an_input_is_gone_or_too_old() -> None:
    s = created()
    s = commit(s, register_writer(s, "w", "", LEASE, 0))
    s = commit(s, compare_and_append(s, "w", [batch("b1", 0, 1)], 0, 1, "t1", 0))
    out = HollowBatch("m", 0, 1, 0, (PartRef("m/0", 1, 10, "c" * 32, 0, 0),), True)
    late = apply_merge(s, ["b1"], out, started_ms=0, timeout_ms=10, now_ms=11)
    assert isinstance(late, Break) and late.result is False
    gone = apply_merge(s, ["b1", "nope"], out, 0, 10, 0)
    assert isinstance(gone, Break) and gone.result is False


def test_gc_horizon_follows_reader_holds() -> None:
    s = created()
    s = commit(s, register_reader(s, "r", "", LEASE, 0))
    hold = s.seqno
    s = commit(s, register_writer(s, "w", "", LEASE, 0))
    s = commit(s, compare_and_append(s, "w", [batch("b1", 0, 1)], 0, 1, "t1", 0))
    out = HollowBatch("m", 0, 1, 0, (PartRef("m/0", 1, 10, "c" * 32, 0, 0),), True)
    s = commit(s, apply_merge(s, ["b1"], out, 0, 1_000, 0))
    assert s.retired == {"b1/0": s.seqno}
    assert garbage.deletable(s) == []  # the reader still reads through seqno `hold`
    assert s.readers["r"].seqno_since == hold
    s = commit(s, downgrade_since(s, "r", 0, s.seqno, 0))
    assert garbage.deletable(s) == ["b1/0"]
    s = commit(s, garbage.forget_retired(s, ["b1/0"], 0))
    assert not s.retired and "m/0" in garbage.referenced_keys(s)
