"""The ledger of streaming writes: every promise a server made about a write, as plain data.

A streaming write is the one place where persist acknowledges durability *before* the commit
that makes it visible: a write is acked ``MEMORY`` when taken, ``LOCAL_DISK`` once a write-ahead
log holding it is fsynced, ``OBJECT_STORAGE`` once a blob part holds it, and ``COMMITTED`` once
it is in the shard, with the shard time it is visible at. Between accepting a write and
committing it, the server must never forget it, never hand its LSN out twice, and never let
one client's bad write, one failed commit or one gone shard touch anybody else's writes. Those
rules live here, and only here, so that they can be tested on their own against every
interleaving of every actor around them (``tests/core/test_ledger.py``).

The ledger does no I/O, takes no lock and reads no clock: times (``now_us``) come in as
arguments, and what must be written (a WAL append, a blob part, a commit, an LSN reservation)
goes out as values for the caller (``persist.flight``) to carry out and report back. Its
caller holds one lock around every call.

**LSNs** are positions in this server's log of a shard, not shard times: strictly increasing
per shard in arrival order. LSNs below ``reserved`` may be handed out; the caller makes a higher
reservation durable (``reservation_due`` / ``reserved``) before the old one runs out, and a
restart starts above it, so an LSN acked even ``MEMORY`` is never handed out again, crash or not.
Nothing another writer does touches them: times are chosen when a group commits.

**Progress is a prefix.** A shard's pending writes are kept in LSN order; each reaches the tiers
in that order, and each step (``to_log``/``logged``, ``cut``/``staged``/``settle``) moves a
prefix of those not yet at the tier. So a tier's **mark** (every LSN below it reached the tier)
is the LSN of the first write that has not, found by counting.

**Acks.** Each call lists, per tier it asked for, its LSNs still waiting; when a mark moves,
every call of the shard pops what it passed, in LSN order, into its outbox (a ``COMMITTED`` ack
with the time the write landed at). A write's ``MEMORY`` ack is queued when it is taken (the
k-th ``MEMORY`` ack answers the call's k-th write).

**Replays.** A named write ``(writer_id, seq)`` already taken is not taken again. Pending here:
acked with the original's LSN, the tiers it reached at once, the rest as they come. Recorded in
the shard's state: with its original LSN when this server committed it, else with a new LSN of
this server; either way every tier at once, ``COMMITTED`` at the time it landed. A replay whose
rows' fingerprint differs from the original's is refused (``Refuse``), never acked.

**Commits.** ``cut`` hands out a group (a prefix of the logged writes); only one group of a
shard is out at a time. The caller commits it at whatever time is free (``core.stream.streams``
decides in the commit itself whether it landed, and which of its named writes landed
elsewhere: ``elsewhere``) and reports how it went (``settle``): ``Landed(at)``; ``Retry``
(nothing is known to have landed: the same group is offered again, its writes stay pending and
stay acked, and the shard takes no new write until it lands); ``Refused`` (writes that can
never commit: quarantined; only their calls end); ``Gone`` (the shard was dropped or finalized:
every write of it is quarantined and every call of it ends at once).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from persist.core.stream.durability import (
    Ack,
    Gone,
    Group,
    Landed,
    Outcome,
    Over,
    Refuse,
    Refused,
    Retry,
    Settled,
    Taken,
    Tier,
    Wait,
    Write,
)
from persist.core.stream.streams import Recorded
from persist.errors import InvalidUsage, PersistError

__all__ = ["Ledger", "Over", "Refuse", "Settled", "Taken", "Wait"]

P = TypeVar("P")


# The tiers a pending write may have reached beyond MEMORY (COMMITTED ones are not pending).
_COUNTED = (Tier.LOCAL_DISK, Tier.OBJECT_STORAGE)
_AFTER_MEMORY = (Tier.LOCAL_DISK, Tier.OBJECT_STORAGE, Tier.COMMITTED)


@dataclass(slots=True, eq=False)
class _Call:
    id: int
    shard: str
    writer_id: str | None
    levels: frozenset[Tier]
    top: Tier
    # Per tier after MEMORY that the call asked for: its LSNs not yet acked at it (sorted).
    waiting: dict[Tier, list[int]]
    outbox: list[Ack] = field(default_factory=list)
    ended: bool = False  # the client finished writing
    done: bool = False  # owes nothing more once the outbox is sent
    error: PersistError | None = None


@dataclass(slots=True, eq=False)
class _Shard(Generic[P]):
    name: str
    next_lsn: int
    reserved: int
    reserving: bool = False
    # Pending writes in LSN order: ``pending[head:]``; a commit pops from the front.
    pending: list[Write[P]] = field(default_factory=list)
    head: int = 0
    # How many pending writes reached LOCAL_DISK and OBJECT_STORAGE (by index; a prefix of
    # them, see the module docstring). The other two entries stay 0.
    at_least: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    seqs: dict[tuple[str, int], Write[P]] = field(default_factory=dict)  # pending named writes
    calls: set[int] = field(default_factory=set)
    group: Group[P] | None = None
    logging: bool = False
    held: int = 0  # bytes of its pending writes
    next_group: int = 0
    closed: bool = False  # draining: takes nothing more
    failing: bool = False  # its group's last try failed: takes nothing until it lands
    gone: str | None = None  # why it can never commit again
    # LSNs of its writes set aside for good (sorted): no mark ever counts them.
    quarantined: list[int] = field(default_factory=list)
    # The times the writes of the group that just landed are visible at, for their acks.
    landed_at: dict[int, int] = field(default_factory=dict)

    def live(self) -> list[Write[P]]:
        return self.pending[self.head :]

    def count(self) -> int:
        return len(self.pending) - self.head

    def nth(self, i: int) -> Write[P] | None:
        j = self.head + i
        return self.pending[j] if j < len(self.pending) else None


class Ledger(Generic[P]):
    """Every shard's streaming writes on one server (``server``: its id in shard states), and
    every call's acks.

    ``limit_bytes`` bounds the bytes of writes taken and not yet committed, over all shards; one
    shard holds at most half of it (``has_room``). ``reserve_block`` is how many LSNs one
    reservation covers.
    """

    def __init__(self, server: str, limit_bytes: int, reserve_block: int = 1 << 14) -> None:
        self.server = server
        self.limit_bytes = limit_bytes
        self.shard_limit_bytes = max(1, limit_bytes // 2)
        self.reserve_block = reserve_block
        self.held_bytes = 0
        self._shards: dict[str, _Shard[P]] = {}
        self._calls: dict[int, _Call] = {}
        self._next_call = 0

    # --- shards ----------------------------------------------------------------------------------

    def add_shard(
        self,
        shard: str,
        resolved: int,
        floor: int,
        recovered: Iterable[tuple[int, str, int, int, P]] = (),
        quarantined: Iterable[int] = (),
        now_us: int = 0,
    ) -> None:
        """Starts keeping ``shard``, whose state records every LSN of this server below
        ``resolved`` as resolved; no LSN below ``floor`` (the last durable reservation) is
        handed out again. ``recovered`` are writes ``(lsn, writer_id, seq, nbytes, payload)`` a
        WAL held: those not yet resolved are pending again (``LOCAL_DISK``). ``quarantined``:
        LSNs set aside before (no mark counts them). Nothing is reserved yet
        (``reservation_due``)."""
        if shard in self._shards:
            raise InvalidUsage(f"shard {shard} is already kept")
        writes: dict[int, Write[P]] = {}
        top = -1
        for lsn, writer_id, seq, nbytes, payload in recovered:
            top = max(top, lsn)
            if lsn < resolved or lsn in writes:
                continue  # committed (or the same record logged twice, after a failed fsync)
            writes[lsn] = Write(lsn, None, writer_id, seq, nbytes, payload, now_us)
            writes[lsn].reached = Tier.LOCAL_DISK
        start = max(resolved, floor, top + 1)
        s: _Shard[P] = _Shard(shard, start, start)
        s.quarantined = sorted(set(quarantined))
        for lsn in sorted(writes):
            w = writes[lsn]
            s.pending.append(w)
            if w.seq >= 0:
                s.seqs[(w.writer_id, w.seq)] = w
            s.held += w.nbytes
            self.held_bytes += w.nbytes
        s.at_least = [0, len(writes), 0, 0]
        self._shards[shard] = s

    def remove_shard(self, shard: str) -> None:
        """Stops keeping ``shard``: one that could not be opened (nothing of it was acked; its
        recovered writes are still in the WAL they came from), or one that is gone (whose
        writes were quarantined)."""
        s = self._shards.pop(shard)
        for w in s.live():
            self.held_bytes -= w.nbytes
        for call_id in s.calls:
            call = self._calls.get(call_id)
            if call is not None and not call.done:
                del self._calls[call_id]
            # An over call stays until its ack thread took its error (``take_acks``).

    def keeps(self, shard: str) -> bool:
        return shard in self._shards

    def reservation_due(self, shard: str) -> int | None:
        """The next LSN reservation to make durable (then report it with ``reserved``), when
        the current one is half used or used up; None when none is due."""
        s = self._shards[shard]
        if s.reserving or s.gone or s.next_lsn + self.reserve_block // 2 < s.reserved:
            return None
        s.reserving = True
        return s.next_lsn + self.reserve_block

    def reserved(self, shard: str, ceiling: int | None) -> None:
        """A reservation up to ``ceiling`` is durable (None: making it failed)."""
        s = self._shards[shard]
        s.reserving = False
        if ceiling is not None:
            s.reserved = max(s.reserved, ceiling)

    def reserving(self, shard: str) -> bool:
        """Whether a reservation was handed out and not yet reported (``reserved``)."""
        return self._shards[shard].reserving

    def close_shard(self, shard: str) -> None:
        """No write of ``shard`` is taken any more (the drain); writers wait."""
        self._shards[shard].closed = True

    def gone(self, shard: str) -> str | None:
        """Why ``shard`` can never commit again, once it is known to be gone."""
        return self._shards[shard].gone

    # --- calls -----------------------------------------------------------------------------------

    def open_call(self, shard: str, writer_id: str | None, levels: Iterable[Tier]) -> int:
        """A DoExchange call into ``shard`` (kept: ``add_shard``) that wants acks at ``levels``
        (``MEMORY`` always)."""
        s = self._shards[shard]
        if s.gone is not None:
            raise InvalidUsage(f"{s.gone}: it takes no more writes")
        wanted = frozenset(levels) | {Tier.MEMORY}
        self._next_call += 1
        call = _Call(
            self._next_call,
            shard,
            writer_id,
            wanted,
            max(wanted),
            {t: [] for t in sorted(wanted) if t is not Tier.MEMORY},
        )
        self._calls[call.id] = call
        s.calls.add(call.id)
        return call.id

    def accept(
        self,
        call_id: int,
        seq: int,
        nbytes: int,
        payload: P,
        now_us: int,
        recorded: Callable[[str, int], Recorded | None],
        fingerprint: Callable[[P], int],
    ) -> Taken | Wait | Over | Refuse:
        """Takes one write of a call (its rows checked by the caller: a write that could fail
        later must be refused before this). ``seq`` -1 is unnamed; a named write already taken,
        pending here or ``recorded`` in the shard's state, is a replay, checked to hold the same
        rows (``fingerprint``, asked only of replays and their originals). ``Over`` when the
        call ended meanwhile (it failed: ``take_acks`` says why)."""
        call = self._calls.get(call_id)
        if call is None or call.done:
            return Over()
        if call.ended:
            raise InvalidUsage("the call's client finished writing: it takes no more writes")
        s = self._shards[call.shard]
        if s.gone is not None:
            return Over()
        writer_id = call.writer_id or ""
        if seq >= 0:
            replay = self._replay(s, call, writer_id, seq, payload, now_us, recorded, fingerprint)
            if replay is not None:
                return replay
        if s.closed:
            return Wait("the server is draining")
        if s.next_lsn >= s.reserved:
            return Wait("the LSN reservation is used up")
        lsn = s.next_lsn
        s.next_lsn += 1
        w = Write(lsn, call.id, writer_id, seq, nbytes, payload, now_us)
        s.pending.append(w)
        if seq >= 0:
            s.seqs[(writer_id, seq)] = w
        s.held += nbytes
        self.held_bytes += nbytes
        call.outbox.append((lsn, Tier.MEMORY, now_us, -1))
        for lsns in call.waiting.values():
            lsns.append(lsn)  # the highest LSN yet: appending keeps the list sorted
        return Taken(lsn, False)

    def _replay(
        self,
        s: _Shard[P],
        call: _Call,
        writer_id: str,
        seq: int,
        payload: P,
        now_us: int,
        recorded: Callable[[str, int], Recorded | None],
        fingerprint: Callable[[P], int],
    ) -> Taken | Wait | Refuse | None:
        """A replay's answer, or None when ``(writer_id, seq)`` was never taken."""
        original = s.seqs.get((writer_id, seq))
        if original is not None:
            if not original.fingerprint:
                original.fingerprint = fingerprint(original.payload)
            if fingerprint(payload) != original.fingerprint:
                return self._refuse(call, writer_id, seq)
            self._replay_pending(s, call, original.lsn, now_us)
            return Taken(original.lsn, True)
        found = recorded(writer_id, seq)
        if found is None:
            return None
        if found.fingerprint and fingerprint(payload) != found.fingerprint:
            return self._refuse(call, writer_id, seq)
        if found.server == self.server and found.lsn is not None:
            lsn = found.lsn
        else:
            # Landed by another server (or before LSNs were positions): an LSN of ours answers
            # for it, resolved at once, so it never waits in the log.
            if s.closed:
                return Wait("the server is draining")
            if s.next_lsn >= s.reserved:
                return Wait("the LSN reservation is used up")
            lsn = s.next_lsn
            s.next_lsn += 1
        call.outbox.append((lsn, Tier.MEMORY, now_us, -1))
        for tier in call.waiting:
            call.outbox.append((lsn, tier, now_us, found.time if tier is Tier.COMMITTED else -1))
        return Taken(lsn, True)

    def _refuse(self, call: _Call, writer_id: str, seq: int) -> Refuse:
        error = InvalidUsage(
            f"({writer_id!r}, seq {seq}) was taken before with other rows: a resend must hold "
            f"the same rows (a restarted producer must go on from a seq it never used)"
        )
        out: Settled[P] = Settled()
        self._fail(call, error, out)
        return Refuse(error)

    def _replay_pending(self, s: _Shard[P], call: _Call, lsn: int, now_us: int) -> None:
        call.outbox.append((lsn, Tier.MEMORY, now_us, -1))
        for tier, lsns in call.waiting.items():
            if lsn < self._mark(s, tier):
                call.outbox.append((lsn, tier, now_us, -1))
            else:
                at = bisect.bisect_left(lsns, lsn)
                if at == len(lsns) or lsns[at] != lsn:
                    lsns.insert(at, lsn)

    def end_call(self, call_id: int) -> Settled[P]:
        """The client finished writing: the call ends once it owes no more acks."""
        out: Settled[P] = Settled()
        call = self._calls.get(call_id)
        if call is not None and not call.done:
            call.ended = True
            self._maybe_done(call, out)
        return out

    def fail_call(self, call_id: int, error: PersistError) -> Settled[P]:
        """Ends the call with ``error`` (say its write was bad). Its writes taken before go on;
        nothing else is touched."""
        out: Settled[P] = Settled()
        call = self._calls.get(call_id)
        if call is not None:
            self._fail(call, error, out)
        return out

    def drop_call(self, call_id: int) -> None:
        """The client went away: the call is owed nothing (its writes go on)."""
        call = self._calls.pop(call_id, None)
        if call is not None and call.shard in self._shards:
            self._shards[call.shard].calls.discard(call_id)

    def take_acks(self, call_id: int) -> tuple[list[Ack], bool, PersistError | None]:
        """The call's queued acks (in order), whether it is over (nothing more will come), and
        the error it ends with. An over call is forgotten."""
        call = self._calls.get(call_id)
        if call is None:
            return [], True, None
        acks, call.outbox = call.outbox, []
        if call.done:
            self.drop_call(call_id)
        return acks, call.done, call.error

    def is_over(self, call_id: int) -> bool:
        call = self._calls.get(call_id)
        return call is None or call.done

    def _fail(self, call: _Call, error: PersistError, out: Settled[P]) -> None:
        if call.done:
            return
        call.error = error
        call.done = True
        for lsns in call.waiting.values():
            lsns.clear()
        out.calls.add(call.id)

    def _maybe_done(self, call: _Call, out: Settled[P]) -> None:
        if call.ended and not call.done and not call.waiting.get(call.top):
            call.done = True
            out.calls.add(call.id)

    # --- the WAL ---------------------------------------------------------------------------------

    def to_log(self, shard: str) -> list[Write[P]]:
        """Every write taken and not yet logged, in LSN order, for one WAL append (with one
        fsync); none while an append is out. Report it with ``logged`` or ``log_failed``."""
        s = self._shards[shard]
        if s.logging or s.gone is not None:
            return []
        writes = s.pending[s.head + s.at_least[Tier.LOCAL_DISK] :]
        s.logging = bool(writes)
        return writes

    def logged(self, shard: str, writes: list[Write[P]], now_us: int) -> Settled[P]:
        """The WAL append of ``writes`` (from ``to_log``) is fsynced: they are ``LOCAL_DISK``."""
        s = self._shards[shard]
        s.logging = False
        return self._reach(s, writes, Tier.LOCAL_DISK, now_us)

    def log_failed(self, shard: str) -> None:
        """The WAL append ``to_log`` handed out failed: its writes wait for the next one (acked
        ``MEMORY`` only, so far)."""
        self._shards[shard].logging = False

    # --- commits ---------------------------------------------------------------------------------

    def next_cut_us(self, shard: str, interval_us: int) -> int | None:
        """When the next group is due (its oldest logged write waited ``interval_us``), if a
        logged write waits and no group is out."""
        s = self._shards[shard]
        first = s.nth(0)
        if s.group is not None or first is None or first.reached < Tier.LOCAL_DISK:
            return None
        return first.at_us + interval_us

    def cut(
        self, shard: str, now_us: int, interval_us: int, max_bytes: int, force: bool = False
    ) -> Group[P] | None:
        """The next group to commit: the group that last failed (``Retry``) again, else the
        logged writes from the front, cut when the oldest waited ``interval_us``, they hold
        ``max_bytes`` or ``force`` (the drain, recovery) asks; at most about ``max_bytes`` (at
        least one write). None while a group is out or none is due."""
        s = self._shards[shard]
        if s.gone is not None:
            return None
        if s.group is not None:
            if s.group.out:
                return None
            s.group.out = True
            return s.group
        logged = s.at_least[Tier.LOCAL_DISK]
        if not logged:
            return None
        first = s.nth(0)
        assert first is not None
        # The logged writes are pending, so they hold at most ``s.held``: below ``max_bytes``
        # only the clock or ``force`` can make a group due. Checked before the walk below, which
        # costs a step per logged write and runs at every WAL flush.
        if not force and s.held < max_bytes and now_us < first.at_us + interval_us:
            return None
        size = 0
        n = 0
        while n < logged:
            w = s.nth(n)
            assert w is not None
            if n and size + w.nbytes > max_bytes:
                break
            size += w.nbytes
            n += 1
        due = force or size >= max_bytes or n < logged or now_us >= first.at_us + interval_us
        if not due:
            return None
        s.next_group += 1
        s.group = Group(s.next_group, shard, s.pending[s.head : s.head + n])
        return s.group

    def staged(self, group: Group[P], now_us: int) -> Settled[P]:
        """The group's writes are in a blob part (not yet visible): ``OBJECT_STORAGE``."""
        return self._reach(self._shards[group.shard], group.writes, Tier.OBJECT_STORAGE, now_us)

    def elsewhere(self, group: Group[P], landed: dict[int, int]) -> None:
        """Writes of the out ``group`` (lsn -> shard time) already landed under another LSN: the
        group is committed without their rows, and they are acked at that time when it lands."""
        for w in group.writes:
            at = landed.get(w.lsn)
            if at is not None:
                w.elsewhere = at

    def _reach(self, s: _Shard[P], writes: list[Write[P]], tier: Tier, now_us: int) -> Settled[P]:
        """``writes`` (those still pending) reached ``tier``; the calls waiting hear of it."""
        out: Settled[P] = Settled()
        moved = 0
        for w in writes:
            if w.reached < tier and not w.gone:
                w.reached = tier
                moved += 1
        s.at_least[tier] += moved
        self._fan_out(s, tier, now_us, out)
        return out

    def settle(self, group: Group[P], outcome: Outcome, now_us: int) -> Settled[P]:
        """How the group's commit went (see the module docstring)."""
        s = self._shards[group.shard]
        if s.group is not group or not group.out:
            raise InvalidUsage("settle: this group is not out")
        out: Settled[P] = Settled()
        group.out = False
        if isinstance(outcome, Retry):
            group.attempts += 1
            s.failing = True
            return out
        s.group = None
        s.failing = False
        if isinstance(outcome, Landed):
            # The group's rows landed a write per time from ``at``, in LSN order.
            fresh = iter(range(outcome.at, outcome.at + len(group.writes)))
            s.landed_at = {
                w.lsn: (w.elsewhere if w.elsewhere is not None else next(fresh))
                for w in group.writes
            }
            end = group.lsn_end
            while (w := s.nth(0)) is not None and w.lsn < end:
                self._pop_front(s, w, out)
        elif isinstance(outcome, Refused):
            for w in list(s.live()):
                why = outcome.bad.get(w.lsn)
                if why is not None:
                    out.quarantined.append((w, why))
                    error = InvalidUsage(f"the write at LSN {w.lsn} can never be committed: {why}")
                    self._remove(s, w, error, out)
        elif isinstance(outcome, Gone):
            self._gone(s, outcome.why, out)
        self._fan_out_all(s, now_us, out)
        s.landed_at = {}
        return out

    def shard_gone(self, shard: str, why: str) -> Settled[P]:
        """``shard`` was found gone outside a commit (opening a new writer of it failed): as
        ``settle(..., Gone(why))`` of whatever it holds."""
        s = self._shards[shard]
        out: Settled[P] = Settled()
        if s.group is not None:
            s.group = None
        self._gone(s, why, out)
        return out

    def _gone(self, s: _Shard[P], why: str, out: Settled[P]) -> None:
        s.gone = why
        s.group = None
        s.failing = False
        error = InvalidUsage(f"{why}: its writes can never be committed")
        for w in list(s.live()):
            out.quarantined.append((w, why))
            self._remove(s, w, error, out)
        for call_id in list(s.calls):
            self._fail(self._calls[call_id], error, out)

    def _pop_front(self, s: _Shard[P], w: Write[P], out: Settled[P]) -> None:
        s.head += 1
        for tier in _COUNTED:
            if w.reached >= tier:
                s.at_least[tier] -= 1
        self._forget(s, w, out)
        # Cut often: the cut frees the writes (their batches) in one C call that no other
        # thread can interrupt; at 1,024 it held the GIL 4-7 ms, stalling the server's acks.
        if s.head > 64 and s.head * 2 > len(s.pending):
            del s.pending[: s.head]
            s.head = 0

    def _remove(self, s: _Shard[P], w: Write[P], error: PersistError, out: Settled[P]) -> None:
        """Gives up ``w`` for good: every call still waiting for it (its own, or one that
        replayed it) ends with ``error``; no other call is touched."""
        if s.nth(0) is w:
            self._pop_front(s, w, out)
        else:
            live = s.live()
            live.remove(w)
            s.pending, s.head = live, 0
            for tier in _COUNTED:
                if w.reached >= tier:
                    s.at_least[tier] -= 1
            self._forget(s, w, out)
        bisect.insort(s.quarantined, w.lsn)
        for call_id in list(s.calls):
            call = self._calls[call_id]
            if call_id == w.call or any(_has(lsns, w.lsn) for lsns in call.waiting.values()):
                self._fail(call, error, out)

    def _forget(self, s: _Shard[P], w: Write[P], out: Settled[P]) -> None:
        w.gone = True
        if w.seq >= 0 and s.seqs.get((w.writer_id, w.seq)) is w:
            del s.seqs[(w.writer_id, w.seq)]
        s.held -= w.nbytes
        self.held_bytes -= w.nbytes
        out.freed += w.nbytes

    # --- marks and acks --------------------------------------------------------------------------

    def _mark(self, s: _Shard[P], tier: Tier) -> int:
        """Every pending LSN below it reached ``tier`` (quarantined ones are not pending)."""
        if tier is Tier.MEMORY:
            return s.next_lsn
        first = s.nth(0) if tier is Tier.COMMITTED else s.nth(s.at_least[tier])
        return first.lsn if first is not None else s.next_lsn

    def _fan_out_all(self, s: _Shard[P], now_us: int, out: Settled[P]) -> None:
        # In tier order, so that a write that passed several tiers at once is acked in order.
        for tier in _AFTER_MEMORY:
            self._fan_out(s, tier, now_us, out)

    def _fan_out(self, s: _Shard[P], tier: Tier, now_us: int, out: Settled[P]) -> None:
        mark = self._mark(s, tier)
        for call_id in s.calls:
            call = self._calls[call_id]
            lsns = call.waiting.get(tier)
            if not lsns or lsns[0] >= mark:
                continue
            k = bisect.bisect_left(lsns, mark)
            if tier is Tier.COMMITTED:
                at = s.landed_at
                call.outbox.extend((lsn, tier, now_us, at[lsn]) for lsn in lsns[:k])
            else:
                call.outbox.extend((lsn, tier, now_us, -1) for lsn in lsns[:k])
            del lsns[:k]
            out.calls.add(call_id)
            if tier is call.top:
                self._maybe_done(call, out)

    # --- what the server asks --------------------------------------------------------------------

    def has_room(self, shard: str) -> bool:
        """Whether ``shard`` may take another write: the server's bytes are under the limit,
        the shard's under its share, and its commits are not failing."""
        s = self._shards.get(shard)
        if s is None or s.gone is not None:
            return True  # the call is about to hear that it is over
        return (
            self.held_bytes < self.limit_bytes and s.held < self.shard_limit_bytes and not s.failing
        )

    def marks(self, shard: str) -> dict[str, int]:
        """Per tier, every LSN of this server below it reached the tier. A quarantined LSN
        never does: no mark passes it (``MEMORY``: taken, passes)."""
        s = self._shards[shard]
        stop = s.quarantined[0] if s.quarantined else None
        out = {}
        for t in Tier:
            mark = self._mark(s, t)
            if t is not Tier.MEMORY and stop is not None:
                mark = min(mark, stop)
            out[t.name] = mark
        return out

    def pending(self, shard: str) -> int:
        """How many writes of the shard are taken and not yet committed (or given up)."""
        return self._shards[shard].count()

    def resolved_below(self, shard: str) -> int:
        """Every LSN below it is committed or given up: WAL segments wholly below may go."""
        s = self._shards[shard]
        first = s.nth(0)
        return first.lsn if first is not None else s.next_lsn

    def lag(self, shard: str, now_us: int) -> dict[str, tuple[int, float]]:
        """Per tier: (writes taken but not at it, seconds the oldest of them has waited)."""
        s = self._shards[shard]
        out: dict[str, tuple[int, float]] = {}
        for tier in Tier:
            behind = s.count() - s.at_least[tier] if tier is not Tier.MEMORY else 0
            first = s.nth(s.at_least[tier]) if behind else None
            age = (now_us - first.at_us) / 1e6 if first is not None else 0.0
            out[tier.name] = (behind, max(age, 0.0))
        return out

    def shard_bytes(self, shard: str) -> int:
        return self._shards[shard].held


def _has(lsns: list[int], lsn: int) -> bool:
    at = bisect.bisect_left(lsns, lsn)
    return at < len(lsns) and lsns[at] == lsn
