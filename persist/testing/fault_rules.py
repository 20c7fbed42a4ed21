"""The shard machine's rules that make trouble beyond the drawn faults: arming a cancellation of
the next call under test, a client stalling past its lease, and the lethal sequence of a lost
reply then a stall then a retry."""

from __future__ import annotations

from functools import partial

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from persist.client import PersistClient
from persist.testing.driver import PICK, MachineBase, Reader, Writer
from persist.testing.judge import Asked, Interrupted
from persist.testing.model import contents_of
from persist.testing.strategies import as_table, place

__all__ = ["FaultRules"]


class FaultRules(MachineBase):
    @precondition(lambda self: self.plan.cancel_calls)
    @rule(k=st.one_of(st.integers(0, 8), st.integers(9, 300)))
    def arm_cancel(self, k: int) -> None:
        """The next call under test is cancelled after ``k`` loop iterations: wherever it is
        awaiting then (a lock, a thread, a retry's sleep), not only at a location call."""
        with self.step("arm_cancel"):
            self.armed = k

    @precondition(lambda self: self.plan.stalls)
    @rule(i=st.integers(0, 1))
    def stall(self, i: int) -> None:
        """Client ``i``'s process pauses for longer than a lease while the others go on."""
        with self.step("stall"):
            self._stall(i % len(self.clients))

    def _stall(self, stalled: int) -> None:
        """Time moves on by two leases in half-lease steps; after each, every handle of the
        other clients heartbeats (they are running: none may expire), and their commits may
        expire the stalled client's handles. Then the stalled client wakes up: each of its
        handles heartbeats, and goes on working or raises ``LeaseExpired`` (then dropped)."""
        self.stalls += 1
        self.stats.stalls += 1
        self.armed = None
        half = int(self.config.lease_duration_s * 1000) // 2 + 1000
        with self.faults.suspended():
            for _ in range(4):
                self.clock.advance(half)
                for h in self._handles():
                    if h.client != stalled:
                        assert self._heartbeat(h), "a handle that kept heartbeating expired"
            for h in self._handles():
                if h.client == stalled and self._heartbeat(h):
                    self.stats.survived_stall += 1
        if self.ghosts:
            # A ghost may have expired in the stall (a reader of a closed client surely stopped
            # heartbeating) or still hold its since (a reader left registered by a downgrade
            # that never settled keeps heartbeating): it may linger.
            for g in self.ghosts:
                self._may_linger(g)
            self.ghosts = []

    def _handles(self) -> list[Writer | Reader]:
        return [*self.writers, *self.readers]

    def _heartbeat(self, h: Writer | Reader) -> bool:
        """Renews ``h``'s lease by using it; False when it had expired (it is dropped)."""
        try:
            if isinstance(h, Writer):
                # The shard's upper, not the model's: a write in doubt may have moved it.
                upper = self.read_upper(h.client)
                if upper is None:
                    return True  # a finished shard takes no heartbeat; its writers are idle
                empty = as_table(self.schema, [])
                self.run(self._call(h.handle.compare_and_append(empty, upper, upper), h))
            else:
                self.run(self._call(h.handle.downgrade_since(h.handle.since), h))
        except Interrupted:
            return False
        return True

    @precondition(lambda self: self.plan.stalls)
    @rule(data=st.data(), index=PICK)
    def lost_reply_then_stall(self, data: st.DataObject, index: int) -> None:
        """The lethal sequence: a write lands but its reply is lost, the writer's process
        stalls past its lease (others may expire it), then it retries the same write. No data
        may be lost, the shard must keep opening, and a read of the upper settles it."""
        with self.step("lost_reply_then_stall"):
            if (drawn := self._write_inputs(data, index)) is None:
                return
            rel, w, e = drawn
            self.stats.lost_reply_then_stall += 1
            ups = place(rel, e, e + 1)
            label = self._label("lost-reply")
            call = partial(w.handle.compare_and_append, as_table(self.schema, ups), e, e + 1)
            told = self._attempt(call, w, lose="consensus.compare_and_set")
            self._stall(w.client)
            # Determinate or not, retrying the same write settles it: that retry after the
            # stall is what this sequence is about.
            asked = Asked(w.client, e, e + 1, what="the write whose reply was lost")
            if self.judge.write(told.in_doubt(), asked, self._retry(w, call)):
                self.model.compare_and_append(ups, e, e + 1, label)
            self.run(self._check_opens())

    async def _check_opens(self) -> None:
        """A fresh process opens the shard and reads what the model says (faults off)."""
        blob, consensus = type(self).location()
        async with PersistClient(blob, consensus, self._config()) as client:
            read = await client.open_leased_reader(self.shard_id, self.schema, "check")
            since = read.since
            assert since is not None
            if self.model.readable(since):
                as_of = since if self.model.upper is None else self.model.upper - 1
                got = contents_of(await read.snapshot_and_fetch(as_of), self.columns, as_of)
                assert got == self.model.contents_as_of(as_of), "contents differ after a stall"
            await read.expire()
