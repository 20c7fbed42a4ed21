"""The streaming-write ledger against a model of the world around it, every interleaving Hypothesis
finds: calls that write good, bad, replayed and poisoned writes into two shards; WAL appends that
succeed, fail or tear; group commits that land, fail before or after landing, or meet another
writer; DoPuts; LSN reservations; crashes with recovery from what the disk kept.

The world is plain data (a WAL of durable records, a shard's upper, ``stream_upper``, committed
updates and recorded seqs, the durable LSN floor), changed only as the server's shell
(``persist.flight``) would change it, and driven by the same ledger calls in the same order. Each
ack is checked against that world when it is sent; the end of each example drains everything
and checks that every write acked ``LOCAL_DISK`` or later was committed exactly once at its LSN.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from persist.core.durability import (
    Group,
    Landed,
    Outcome,
    Refused,
    Retry,
    Tier,
    Write,
    judge,
)
from persist.core.ledger import Ledger, Over, Settled, Taken, Wait
from persist.errors import InvalidUsage, PersistError, UpperMismatch
from persist.testing import scaled

SHARDS = ("s1", "s2")
WRITERS = (None, "a", "b")
INTERVAL_US = 50
MAX_BYTES = 30
LIMIT = 60
BLOCK = 8  # LSNs per reservation: small, so that reservations run out and are renewed often


# What the examples covered, over a run (printed by the test with -s; checked to be non-zero).
TALLY: dict[str, int] = {}


def _count(what: str, n: int = 1) -> None:
    TALLY[what] = TALLY.get(what, 0) + n


@dataclass(frozen=True)
class Data:
    """A write's rows, as the model knows them: ``uid`` names its content."""

    uid: int
    writer_id: str
    seq: int
    poison: bool = False  # passes the edge, can never commit (the quarantine's case)


@dataclass
class Shard:
    """The world of one shard: what the disk and the blob/consensus hold."""

    upper: int = 0
    stream_upper: int = 0
    committed: list[tuple[int, int]] = field(default_factory=list)  # (lsn, uid)
    seqs: dict[tuple[str, int], int] = field(default_factory=dict)
    wal: dict[int, Data] = field(default_factory=dict)  # durable records by LSN
    floor: int = 0  # the durable LSN reservation
    moved_by_other: bool = False
    top_lsn: int = -1  # the highest LSN ever handed out (across crashes)
    # Truth per LSN: the highest tier it really reached (a blob part counts once written).
    truth: dict[int, Tier] = field(default_factory=dict)
    owner: dict[int, int] = field(default_factory=dict)  # lsn -> uid it was taken for


@dataclass
class CallModel:
    id: int
    shard: str
    writer_id: str | None
    levels: frozenset[Tier]
    taken: list[int] = field(default_factory=list)  # LSNs returned by accept, in order
    replays: list[int] = field(default_factory=list)
    acks: list[tuple[int, int]] = field(default_factory=list)
    over: bool = False
    error: PersistError | None = None
    ended: bool = False
    stopped: bool = False  # its write was refused: the shell reads no more of it
    gone: bool = False  # dropped, or the server crashed
    # Why it may fail: its own bad write, a poison write it waits for, a lost write.
    may_fail: set[str] = field(default_factory=set)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.world = {s: Shard() for s in SHARDS}
        self.ledger: Ledger[Data] = self._new_ledger()
        self.calls: dict[int, CallModel] = {}
        self.uids = itertools.count()
        # Seqs name writes per shard: (shard, writer_id) -> next seq, (shard, writer_id, seq) ->
        # the content.
        self.next_seq: dict[tuple[str, str], int] = {}
        self.sent: dict[tuple[str, str, int], Data] = {}
        self.now = 0
        self.inflight_log: dict[str, list[Write[Data]]] = {}
        self.inflight_group: dict[str, Group[Data]] = {}
        # Groups whose part was written, by (ledger generation, shard, group id).
        self.staged_groups: set[tuple[int, str, int]] = set()
        self.generation = 0
        self.durable_acks: dict[tuple[str, int], int] = {}  # (shard, lsn) -> uid acked LD+
        self.quarantined: dict[tuple[str, int], Data] = {}
        self.lost: set[tuple[str, int]] = set()
        for s in SHARDS:
            self._open_shard(s, [])

    def _new_ledger(self) -> Ledger[Data]:
        return Ledger(LIMIT, reserve_block=BLOCK)

    def _open_shard(self, shard: str, recovered: list[tuple[int, Data]]) -> None:
        w = self.world[shard]
        out = self.ledger.add_shard(
            shard,
            w.upper,
            w.stream_upper,
            w.floor,
            [(lsn, d.writer_id, d.seq, 10, d) for lsn, d in recovered],
            self.now,
        )
        _count("writes recovered from the WAL", len(recovered))
        for lost in out.lost:
            # Recovered writes another writer passed: only possible after another writer.
            assert w.moved_by_other, f"recovery gave up LSN {lost.lsn} with no other writer"
            self.lost.add((shard, lost.lsn))
        self._reserve(shard, True)

    # --- helpers --------------------------------------------------------------------------------

    def _key(self, shard: str, group: Group[Data]) -> tuple[int, str, int]:
        return (self.generation, shard, group.id)

    def _tick(self) -> int:
        self.now += 7
        return self.now

    def _live_calls(self) -> list[CallModel]:
        return [c for c in self.calls.values() if not c.gone and not c.over]

    def _reserve(self, shard: str, ok: bool) -> None:
        due = self.ledger.reservation_due(shard)
        if due is None:
            return
        if ok:
            self.world[shard].floor = max(self.world[shard].floor, due)
        self.ledger.reserved(shard, due if ok else None)

    def _committed_lookup(self, shard: str) -> object:
        seqs = self.world[shard].seqs
        return lambda writer_id, seq: seqs.get((writer_id, seq))

    def _apply_settled(self, shard: str, settled: object) -> None:
        assert isinstance(settled, Settled)
        _count("writes quarantined", len(settled.quarantined))
        _count("writes lost to another writer", len(settled.lost))
        for w, _why in settled.quarantined:
            assert w.payload.poison, f"an honest write at LSN {w.lsn} was quarantined"
            self.quarantined[(shard, w.lsn)] = w.payload
        for w in settled.lost:
            assert self.world[shard].moved_by_other, f"LSN {w.lsn} lost with no other writer"
            self.lost.add((shard, w.lsn))
        self._drop_resolved_wal(shard)

    def _drop_resolved_wal(self, shard: str) -> None:
        """What the shell does after a commit settles: WAL records wholly below the resolved
        mark go (quarantined and lost ones were set aside first)."""
        below = self.ledger.resolved_below(shard)
        w = self.world[shard]
        for lsn in [x for x in w.wal if x < below]:
            assert (
                lsn < w.stream_upper
                or (shard, lsn) in self.quarantined
                or (
                    shard,
                    lsn,
                )
                in self.lost
            ), f"WAL record {lsn} dropped before it was committed or set aside"
            del w.wal[lsn]

    # --- calls ----------------------------------------------------------------------------------

    @rule(
        shard=st.sampled_from(SHARDS),
        writer=st.sampled_from(WRITERS),
        levels=st.one_of(st.just(set(Tier)), st.sets(st.sampled_from(list(Tier)), max_size=3)),
    )
    def open_call(self, shard: str, writer: str | None, levels: set[Tier]) -> None:
        if self.world[shard].upper is None:
            return
        call_id = self.ledger.open_call(shard, writer, levels)
        wanted = frozenset(levels) | {Tier.MEMORY}
        self.calls[call_id] = CallModel(call_id, shard, writer, wanted)

    def _pick(self, data: st.DataObject) -> CallModel | None:
        live = [c for c in self._live_calls() if not c.ended and not c.stopped]
        if not live:
            # A client reconnects: most writes go through some call.
            self.open_call(
                data.draw(st.sampled_from(SHARDS), "shard"),
                data.draw(st.sampled_from(WRITERS), "writer"),
                set(Tier),
            )
            live = [c for c in self._live_calls() if not c.ended and not c.stopped]
            if not live:
                return None
        return data.draw(st.sampled_from(live), "call")

    @rule(
        data=st.data(),
        kind=st.sampled_from(["fresh"] * 8 + ["replay"] * 2 + ["bad", "poison"]),
    )
    def write(self, data: st.DataObject, kind: str) -> None:
        call = self._pick(data)
        _count("write rule")
        if call is None:
            _count("write rule: no call")
            return
        if kind == "bad":
            # The shell refuses it at the edge, before any ack: only this call ends.
            call.may_fail.add("own bad write")
            call.stopped = True
            self._settled_calls(self.ledger.fail_call(call.id, InvalidUsage("bad write")))
            return
        writer = call.writer_id
        if kind == "replay":
            if writer is None:
                return
            used = [q for (sh, w, q) in self.sent if w == writer and sh == call.shard]
            if not used:
                return
            seq = data.draw(st.sampled_from(sorted(used)), "seq")
            payload = self.sent[(call.shard, writer, seq)]
        else:
            seq = -1
            if writer is not None:
                seq = self.next_seq.get((call.shard, writer), 0)
                self.next_seq[(call.shard, writer)] = seq + 1
            payload = Data(next(self.uids), writer or "", seq, poison=kind == "poison")
            if writer is not None:
                self.sent[(call.shard, writer, seq)] = payload
        world = self.world[call.shard]
        got = self.ledger.accept(
            call.id, seq, 10, payload, self._tick(), self._committed_lookup(call.shard)
        )
        # The shell makes the next reservation durable as soon as one is due.
        self._reserve(call.shard, data.draw(st.integers(0, 9), "reservation") > 0)
        if isinstance(got, Wait):
            _count(f"waits: {got.why}")
            return
        if isinstance(got, Over):
            call.stopped = True  # the shell stops reading a call that is over
            return
        assert isinstance(got, Taken)
        _count("replays" if got.replay else "writes taken")
        if got.replay:
            # The original LSN of this very content.
            assert world.owner.get(got.lsn) == payload.uid, (got, payload)
            call.replays.append(got.lsn)
        else:
            assert got.lsn > world.top_lsn, f"LSN {got.lsn} handed out again"
            # At least the upper the server knows of (another writer's moves it learns late).
            assert got.lsn >= (world.upper or 0) or world.moved_by_other, "an LSN below the upper"
            world.top_lsn = got.lsn
            world.owner[got.lsn] = payload.uid
            world.truth[got.lsn] = Tier.MEMORY
        if payload.poison:
            call.may_fail.add("poison")
        call.taken.append(got.lsn)

    @rule(data=st.data())
    def end_call(self, data: st.DataObject) -> None:
        call = self._pick(data)
        if call is not None:
            call.ended = True
            self._settled_calls(self.ledger.end_call(call.id))

    @rule(data=st.data())
    def drop_call(self, data: st.DataObject) -> None:
        live = self._live_calls()
        if live:
            call = data.draw(st.sampled_from(live), "call")
            self.ledger.drop_call(call.id)
            call.gone = True

    def _settled_calls(self, settled: object) -> None:
        pass  # the shell wakes these calls' ack threads; the model pumps acks in its own rule

    @rule(data=st.data())
    def pump_acks(self, data: st.DataObject) -> None:
        live = self._live_calls()
        if not live:
            return
        call = data.draw(st.sampled_from(live), "call")
        self._pump(call)

    def _pump(self, call: CallModel) -> None:
        acks, over, error = self.ledger.take_acks(call.id)
        world = self.world[call.shard]
        for lsn, tier, _at in acks:
            t = Tier(tier)
            assert t in call.levels, f"an ack at {t.name}, which the call did not ask for"
            if t is not Tier.MEMORY:
                assert world.truth.get(lsn, Tier.MEMORY) >= t, (
                    f"LSN {lsn} acked {t.name} but only reached {world.truth.get(lsn)}"
                )
                if t >= Tier.LOCAL_DISK:
                    self.durable_acks[(call.shard, lsn)] = world.owner[lsn]
                _count(f"acks {t.name}")
            call.acks.append((lsn, t))
        if over:
            call.over = True
            call.error = error
            _count(f"calls ended {type(error).__name__ if error else 'cleanly'}")
            if isinstance(error, UpperMismatch):
                assert world.moved_by_other, f"call {call.id} ended with {error!r}, no other writer"
            elif error is not None:
                assert call.may_fail, (
                    f"call {call.id} ended with {error!r} for no reason of its own"
                )
            else:
                self._check_complete(call)

    def _check_complete(self, call: CallModel) -> None:
        """A call that ended cleanly got every tier it asked for, for every write it made."""
        assert call.ended, "a call ended that was neither ended by its client nor failed"
        for lsn in set(call.taken):
            got = {t for (x, t) in call.acks if x == lsn}
            assert call.levels <= got, f"call {call.id} ended without {call.levels - got} of {lsn}"

    # --- the WAL --------------------------------------------------------------------------------

    @rule(shard=st.sampled_from(SHARDS))
    def flush_start(self, shard: str) -> None:
        if shard in self.inflight_log:
            return
        writes = self.ledger.to_log(shard)
        if writes:
            self.inflight_log[shard] = writes

    @rule(shard=st.sampled_from(SHARDS), ok=st.booleans(), torn=st.booleans())
    def flush_done(self, shard: str, ok: bool, torn: bool) -> None:
        writes = self.inflight_log.pop(shard, None)
        if writes is None:
            return
        world = self.world[shard]
        if ok:
            for w in writes:
                world.wal[w.lsn] = w.payload
                world.truth[w.lsn] = max(world.truth.get(w.lsn, Tier.MEMORY), Tier.LOCAL_DISK)
            self._apply_settled(shard, self.ledger.logged(shard, writes, self._tick()))
        else:
            if torn and writes:
                # Some records made it to disk before the failure: durable, never acked.
                world.wal[writes[0].lsn] = writes[0].payload
            self.ledger.log_failed(shard)

    # --- commits --------------------------------------------------------------------------------

    @rule(shard=st.sampled_from(SHARDS), force=st.booleans())
    def cut(self, shard: str, force: bool) -> None:
        if shard in self.inflight_group:
            return
        group = self.ledger.cut(shard, self._tick(), INTERVAL_US, MAX_BYTES, force)
        if group is None:
            return
        assert (
            group.expected_upper == self.world[shard].upper or self.world[shard].moved_by_other
        ), "a group cut from an upper that is not the shard's"
        assert [w.lsn for w in group.writes] == sorted(w.lsn for w in group.writes)
        assert group.new_upper == group.writes[-1].lsn + 1
        self.inflight_group[shard] = group

    @rule(shard=st.sampled_from(SHARDS))
    def stage(self, shard: str) -> None:
        group = self.inflight_group.get(shard)
        if group is None or self._key(shard, group) in self.staged_groups:
            return
        if any(w.payload.poison for w in group.writes):
            return  # its batch can't be written: the finish rule refuses it
        world = self.world[shard]
        for w in group.writes:
            world.truth[w.lsn] = max(world.truth.get(w.lsn, Tier.MEMORY), Tier.OBJECT_STORAGE)
        self.staged_groups.add(self._key(shard, group))
        self._apply_settled(shard, self.ledger.staged(group, self._tick()))

    def _cas(self, shard: str, group: Group[Data]) -> bool:
        """The commit in the world: lands iff the shard's upper is the group's expected one."""
        world = self.world[shard]
        if world.upper != group.expected_upper:
            return False
        for w in group.writes:
            world.committed.append((w.lsn, w.payload.uid))
            world.truth[w.lsn] = Tier.COMMITTED
            if w.seq >= 0:
                world.seqs.setdefault((w.writer_id, w.seq), w.lsn)
        world.upper = group.new_upper
        world.stream_upper = max(world.stream_upper, group.new_upper)
        return True

    @rule(
        shard=st.sampled_from(SHARDS),
        how=st.sampled_from(["ok", "ok", "fail_before", "fail_after", "no_refresh"]),
    )
    def finish(self, shard: str, how: str) -> None:
        group = self.inflight_group.get(shard)
        if group is None:
            return
        world = self.world[shard]
        outcome: Outcome
        poison = {w.lsn: "poison" for w in group.writes if w.payload.poison}
        if poison:
            # The batch fails deterministically; the shell checks each write alone.
            outcome = Refused(poison)
        elif self._key(shard, group) not in self.staged_groups:
            return  # the shell stages before it commits
        elif how == "ok":
            outcome = (
                Landed()
                if self._cas(shard, group)
                else judge(group, world.upper, world.stream_upper)
            )
        elif how == "fail_before":
            outcome = judge(group, world.upper, world.stream_upper)
        elif how == "fail_after":
            self._cas(shard, group)
            outcome = judge(group, world.upper, world.stream_upper)
        else:
            outcome = Retry("the state could not be read")
        del self.inflight_group[shard]
        _count(f"commits {type(outcome).__name__}")
        self._apply_settled(shard, self.ledger.settle(group, outcome, self._tick()))

    @rule(
        shard=st.sampled_from(SHARDS),
        ok=st.booleans(),
        how=st.sampled_from(["ok", "ok", "ok", "fail_before", "fail_after", "no_refresh"]),
    )
    def progress(self, shard: str, ok: bool, how: str) -> None:
        """The shard's next step of work, whichever is due (a WAL append, its end, a cut, a
        stage, a commit's end): the shell's tasks run these all the time."""
        _count("progress rule")
        if not self._step(shard, ok, how):
            self._step(SHARDS[1 - SHARDS.index(shard)], ok, how)
        for call in self._live_calls():
            self._pump(call)

    @rule(
        shard=st.sampled_from(SHARDS),
        hows=st.lists(st.sampled_from(["ok", "ok", "ok", "fail_before", "fail_after"]), max_size=8),
    )
    def progress_run(self, shard: str, hows: list[str]) -> None:
        """Several steps of work in a row: whole commits happen between two writes."""
        for how in hows:
            self._step(shard, how != "fail_before", how)
        for call in self._live_calls():
            self._pump(call)

    @rule(data=st.data(), n=st.integers(1, 6))
    def write_many(self, data: st.DataObject, n: int) -> None:
        for _ in range(n):
            self.write(data, "fresh")

    def _step(self, shard: str, ok: bool, how: str) -> bool:
        """One step of the shard's work, if any is due; whether there was one."""
        if shard in self.inflight_group:
            group = self.inflight_group[shard]
            if self._key(shard, group) in self.staged_groups or any(
                w.payload.poison for w in group.writes
            ):
                self.finish(shard, how)
            else:
                self.stage(shard)
        elif shard in self.inflight_log:
            self.flush_done(shard, ok or how == "ok", False)
        elif self._has_unlogged(shard):
            self.flush_start(shard)
        else:
            self.cut(shard, how != "ok")
            return shard in self.inflight_group
        return True

    def _has_unlogged(self, shard: str) -> bool:
        lag = self.ledger.lag(shard, self.now)
        return lag["LOCAL_DISK"][0] > 0

    @rule(shard=st.sampled_from(SHARDS), by=st.integers(1, 3), now=st.integers(0, 2))
    def another_writer(self, shard: str, by: int, now: int) -> None:
        # Another process appends at the shard's upper (the server is meant to be the only
        # writer: this is the case it must survive, not one it must make right).
        world = self.world[shard]
        if world.upper is None or now:
            return
        world.upper += by
        world.moved_by_other = True

    @rule(shard=st.sampled_from(SHARDS))
    def do_put(self, shard: str) -> None:
        """A DoPut into a streamed shard: hold, commit everything pending, append, go on."""
        if shard in self.inflight_log or shard in self.inflight_group:
            return
        world = self.world[shard]
        self.ledger.hold(shard)
        self._commit_all(shard)
        if world.upper is not None and not world.moved_by_other:
            assert self.ledger.pending(shard) == 0
            world.upper += 1
            self._apply_settled(shard, self.ledger.note_upper(shard, world.upper, self._tick()))
        self.ledger.release(shard)

    @rule(shard=st.sampled_from(SHARDS), ok=st.booleans())
    def reserve(self, shard: str, ok: bool) -> None:
        self._reserve(shard, ok)

    def _commit_all(self, shard: str) -> None:
        """Logs and commits everything the shard holds, with no faults (a drain, recovery)."""
        for _ in range(100):
            if self.ledger.pending(shard) == 0:
                return
            writes = self.ledger.to_log(shard)
            if writes:
                world = self.world[shard]
                for w in writes:
                    world.wal[w.lsn] = w.payload
                    world.truth[w.lsn] = max(world.truth.get(w.lsn, Tier.MEMORY), Tier.LOCAL_DISK)
                self._apply_settled(shard, self.ledger.logged(shard, writes, self._tick()))
            group = self.ledger.cut(shard, self._tick(), INTERVAL_US, MAX_BYTES, force=True)
            if group is None:
                continue
            poison = {w.lsn: "poison" for w in group.writes if w.payload.poison}
            if poison:
                outcome: Outcome = Refused(poison)
            else:
                world = self.world[shard]
                for w in group.writes:
                    world.truth[w.lsn] = max(world.truth[w.lsn], Tier.OBJECT_STORAGE)
                self._apply_settled(shard, self.ledger.staged(group, self._tick()))
                landed = self._cas(shard, group)
                outcome = Landed() if landed else judge(group, world.upper, world.stream_upper)
            _count(f"commits {type(outcome).__name__}")
            self._apply_settled(shard, self.ledger.settle(group, outcome, self._tick()))
        raise AssertionError(f"shard {shard} did not drain: {self.ledger.pending(shard)} pending")

    # --- crashes --------------------------------------------------------------------------------

    @rule(data=st.data(), now=st.integers(0, 5))
    def crash(self, data: st.DataObject, now: int) -> None:
        """SIGKILL: the ledger and every call are gone; the disk and the shard stay. A WAL
        append in flight may or may not have reached the disk; a commit in flight may or may
        not have landed."""
        if now:
            return  # not every step: a run needs time between crashes to build up writes
        for shard, writes in self.inflight_log.items():
            kept = data.draw(st.integers(0, len(writes)), "records kept")
            for w in writes[:kept]:
                self.world[shard].wal[w.lsn] = w.payload
        for shard, group in self.inflight_group.items():
            if self._key(shard, group) in self.staged_groups and data.draw(st.booleans(), "landed"):
                self._cas(shard, group)
        self.inflight_log.clear()
        self.inflight_group.clear()
        for call in self.calls.values():
            call.gone = True
        _count("crashes")
        self.generation += 1
        self.ledger = self._new_ledger()
        for shard in SHARDS:
            world = self.world[shard]
            self._open_shard(shard, sorted(world.wal.items()))
            # Recovery commits what the WAL held before the server takes calls.
            self._commit_all(shard)

    # --- invariants -----------------------------------------------------------------------------

    @invariant()
    def bytes_add_up(self) -> None:
        pending = sum(self.ledger.pending(s) for s in SHARDS)
        assert self.ledger.held_bytes == 10 * pending

    @invariant()
    def marks_are_ordered_and_true(self) -> None:
        for shard in SHARDS:
            world = self.world[shard]
            if world.upper is None:
                continue
            marks = self.ledger.marks(shard)
            assert marks["MEMORY"] >= marks["LOCAL_DISK"] >= marks["OBJECT_STORAGE"]
            assert marks["COMMITTED"] <= (world.upper or 0) or world.moved_by_other

    @invariant()
    def acks_come_in_order(self) -> None:
        for call in self.calls.values():
            memory = [lsn for lsn, t in call.acks if t is Tier.MEMORY]
            assert memory == call.taken[: len(memory)], "MEMORY acks answer the writes in order"
            replayed = set(call.replays)
            for tier in (Tier.LOCAL_DISK, Tier.OBJECT_STORAGE, Tier.COMMITTED):
                fresh = [lsn for lsn, t in call.acks if t is tier and lsn not in replayed]
                assert fresh == sorted(fresh), f"{tier.name} acks out of LSN order: {fresh}"
            seen: dict[int, list[Tier]] = {}
            for lsn, t in call.acks:
                seen.setdefault(lsn, []).append(t)
            for lsn, tiers in seen.items():
                times = call.taken.count(lsn)
                for t in set(tiers):
                    assert tiers.count(t) <= times, f"LSN {lsn} acked {t.name} twice"
                if times == 1:
                    assert tiers == sorted(tiers), f"LSN {lsn}'s tiers out of order: {tiers}"

    def teardown(self) -> None:
        _count("examples")
        # Drain: every write acked LOCAL_DISK or later must end up committed once at its LSN.
        for shard in list(self.inflight_log):
            self.flush_done(shard, True, False)
        for shard, group in list(self.inflight_group.items()):
            del self.inflight_group[shard]
            self._apply_settled(shard, self.ledger.settle(group, Retry("drain"), self._tick()))
        for shard in SHARDS:
            self._commit_all(shard)
        for shard in SHARDS:
            world = self.world[shard]
            lsns = [lsn for lsn, _ in world.committed]
            assert len(lsns) == len(set(lsns)), "an LSN committed twice"
            uids = [uid for _, uid in world.committed]
            assert len(uids) == len(set(uids)), "a write committed twice"
            at = dict(world.committed)
            for (s, lsn), uid in self.durable_acks.items():
                if s != shard or (s, lsn) in self.quarantined or (s, lsn) in self.lost:
                    continue
                assert at.get(lsn) == uid, f"write {uid} acked LOCAL_DISK at {lsn}, not committed"
            for (s, lsn), d in self.quarantined.items():
                if s == shard:
                    assert d.poison and lsn not in at
        for key, d in self.sent.items():
            times = sum(1 for _, uid in self.world[key[0]].committed if uid == d.uid)
            assert times <= 1, f"named write {key} committed {times} times"


LedgerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("PERSIST_LEDGER_EXAMPLES", scaled(300))),
    stateful_step_count=80,
    deadline=None,
    # The same examples on every run (CI must not turn on the draw): a longer search is
    # PERSIST_TEST_SCALE (more examples) or PERSIST_LEDGER_EXAMPLES.
    derandomize=os.environ.get("PERSIST_LEDGER_RANDOM") is None,
    # PERSIST_LEDGER_SHRINK=0 reports the first failing example as found (a quicker answer).
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    + ([Phase.shrink] if os.environ.get("PERSIST_LEDGER_SHRINK", "1") != "0" else []),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
_TestLedgerModel = LedgerMachine.TestCase


def test_ledger_model() -> None:
    TALLY.clear()
    _TestLedgerModel("runTest").runTest()
    print("ledger model:", ", ".join(f"{k} {v}" for k, v in sorted(TALLY.items())))
    for what in (
        "acks LOCAL_DISK",
        "acks OBJECT_STORAGE",
        "acks COMMITTED",
        "replays",
        "crashes",
        "writes recovered from the WAL",
        "writes quarantined",
        "writes lost to another writer",
        "commits Retry",
        "commits Moved",
        "commits Refused",
        "calls ended InvalidUsage",
        "calls ended UpperMismatch",
        "calls ended cleanly",
    ):
        assert TALLY.get(what), f"no example covered {what!r}: the model proved nothing of it"


# --- plain cases that name one rule each ---------------------------------------------------------


def _ledger() -> Ledger[str]:
    ledger: Ledger[str] = Ledger(1000, reserve_block=100)
    ledger.add_shard("s", 5, 5, 0)
    due = ledger.reservation_due("s")
    ledger.reserved("s", due)
    return ledger


def _none(writer_id: str, seq: int) -> int | None:
    return None


def test_a_bad_write_touches_only_its_own_call() -> None:
    ledger = _ledger()
    a = ledger.open_call("s", "a", list(Tier))
    b = ledger.open_call("s", "b", list(Tier))
    assert ledger.accept(a, 0, 1, "a0", 1, _none) == Taken(5, False)
    assert ledger.accept(b, 0, 1, "b0", 1, _none) == Taken(6, False)
    ledger.fail_call(b, InvalidUsage("null _diff"))
    writes = ledger.to_log("s")
    assert [w.payload for w in writes] == ["a0", "b0"]  # b's earlier write goes on too
    ledger.logged("s", writes, 2)
    acks, over, error = ledger.take_acks(a)
    assert [(lsn, Tier(t)) for lsn, t, _ in acks] == [(5, Tier.MEMORY), (5, Tier.LOCAL_DISK)]
    assert not over and error is None
    _, over_b, error_b = ledger.take_acks(b)
    assert over_b and isinstance(error_b, InvalidUsage)


def test_a_failed_commit_keeps_every_write_and_offers_the_same_group_again() -> None:
    ledger = _ledger()
    a = ledger.open_call("s", None, list(Tier))
    for i in range(3):
        ledger.accept(a, -1, 1, f"w{i}", i, _none)
    ledger.logged("s", ledger.to_log("s"), 10)
    group = ledger.cut("s", 10, 50, 1 << 20, force=True)
    assert group is not None and (group.expected_upper, group.new_upper) == (5, 8)
    ledger.settle(group, Retry("blob outage"), 11)
    assert ledger.pending("s") == 3 and ledger.held_bytes == 3
    again = ledger.cut("s", 12, 50, 1 << 20)
    assert again is group, "the same group again (its staged batch can be reused)"
    ledger.settle(again, Landed(), 13)
    assert ledger.pending("s") == 0 and ledger.held_bytes == 0
    assert ledger.marks("s")["COMMITTED"] == 8
    # An LSN is never handed out twice, even after a commit failed.
    assert ledger.accept(a, -1, 1, "w3", 14, _none) == Taken(8, False)


def test_an_lsn_waits_for_a_durable_reservation() -> None:
    ledger: Ledger[str] = Ledger(1000, reserve_block=4)
    ledger.add_shard("s", 0, 0, floor=10)
    a = ledger.open_call("s", None, [])
    assert isinstance(ledger.accept(a, -1, 1, "x", 0, _none), Wait)
    due = ledger.reservation_due("s")
    assert due == 14
    assert ledger.reservation_due("s") is None, "one reservation at a time"
    ledger.reserved("s", due)
    assert ledger.accept(a, -1, 1, "x", 0, _none) == Taken(10, False)


def test_judge_tells_landed_retry_and_moved_apart() -> None:
    g: Group[object] = Group(1, "s", [], 5, 9)
    assert judge(g, 9, 9) == Landed()
    assert judge(g, 12, 9) == Landed()
    assert isinstance(judge(g, 5, 5), Retry)
    moved = judge(g, 7, 5)
    assert moved.__class__.__name__ == "Moved"


@pytest.mark.parametrize("upper", [7, None])
def test_another_writer_passing_pending_writes_ends_only_their_calls(upper: int | None) -> None:
    ledger = _ledger()
    a = ledger.open_call("s", None, list(Tier))
    b = ledger.open_call("s", None, [Tier.MEMORY])
    ledger.accept(a, -1, 1, "a", 0, _none)
    ledger.logged("s", ledger.to_log("s"), 1)
    group = ledger.cut("s", 1, 50, 1 << 20, force=True)
    assert group is not None
    out = ledger.settle(group, judge(group, upper, 5), 2)
    assert [w.payload for w in out.lost] == ["a"]
    _, over, error = ledger.take_acks(a)
    assert over and isinstance(error, UpperMismatch)
    if upper is not None:
        assert not ledger.is_over(b)
        assert ledger.accept(b, -1, 1, "b", 3, _none) == Taken(7, False)
