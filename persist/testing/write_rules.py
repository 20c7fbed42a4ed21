"""The shard machine's rules that write: ``compare_and_append`` (at, below and above the upper),
``append``, batches moved between clients and committed with ``compare_and_append_batch``, two
writers racing for one upper, and a write held by a paused location.

Each draws its inputs, makes its call, has the judge (``persist.testing.judge``) say whether the
write landed, and applies a landed write to the model."""

from __future__ import annotations

import asyncio
from functools import partial

from hypothesis import strategies as st
from hypothesis.stateful import rule

from persist.errors import InvalidUsage
from persist.internal.batch import Batch
from persist.testing.driver import PICK, MachineBase
from persist.testing.judge import Asked, Told
from persist.testing.strategies import as_table, place

__all__ = ["WriteRules"]


class WriteRules(MachineBase):
    @rule(
        data=st.data(),
        index=PICK,
        offset=st.sampled_from([0, 0, 0, -1, 1]),
        width=st.integers(0, 3),
        finish=st.integers(0, 59),
        by_retry=st.booleans(),
    )
    def compare_and_append(
        self, data: st.DataObject, index: int, offset: int, width: int, finish: int, by_retry: bool
    ) -> None:
        with self.step("compare_and_append"):
            if (drawn := self._write_inputs(data, index)) is None:
                return
            rel, w, upper = drawn
            expected, new = self._span(upper, offset, width, finish)
            ups = place(rel, expected, new)
            label = self._label("caa")
            call = partial(w.handle.compare_and_append, as_table(self.schema, ups), expected, new)
            told = self._attempt(call, w)
            # A wrong expectation is refused (or the call fails before it can tell).
            asked = Asked(
                w.client, upper, new, refused=expected != upper, what="compare_and_append"
            )
            if self.judge.write(told, asked, self._retry(w, call) if by_retry else None):
                self.model.compare_and_append(ups, expected, new, label)

    @rule(
        data=st.data(),
        index=PICK,
        lower_offset=st.integers(-3, 1),
        width=st.integers(0, 4),
        finish=st.integers(0, 59),
    )
    def append(
        self, data: st.DataObject, index: int, lower_offset: int, width: int, finish: int
    ) -> None:
        with self.step("append"):
            if (drawn := self._write_inputs(data, index)) is None:
                return
            rel, w, current = drawn
            lower, new = self._span(current, lower_offset, width, finish)
            ups = place(rel, lower, new)
            label = self._label("append")
            call = partial(w.handle.append, as_table(self.schema, ups), lower, new)
            told = self._attempt(call, w)
            # An append leaving a gap is refused. One in doubt is settled by retrying it: an
            # append is idempotent.
            what = f"append [{lower}, {new})"
            asked = Asked(w.client, current, new, refused=lower > current, what=what)
            if self.judge.write(told, asked, self._retry(w, call, idempotent=True)):
                self.model.append(ups, lower, new, label)

    @rule(
        data=st.data(),
        maker_index=PICK,
        committer_index=PICK,
        width=st.integers(1, 4),
        mid_offset=st.integers(0, 4),
        stale=st.integers(0, 3),
        delete=st.booleans(),
    )
    def batch_then_commit(
        self,
        data: st.DataObject,
        maker_index: int,
        committer_index: int,
        width: int,
        mid_offset: int,
        stale: int,
        delete: bool,
    ) -> None:
        """Two batches written by one writer, moved as bytes, committed by another."""
        with self.step("batch_then_commit"):
            rel_a = self._updates(data, "a")
            rel_b = self._updates(data, "b")
            maker = self._writer(maker_index)
            committer = self._writer(committer_index)
            upper = self.model.upper
            if maker is None or committer is None or upper is None:
                self.stats.skipped += 1
                return
            new = upper + width
            mid = upper + min(mid_offset, width)
            # A stale expectation, with the batches still inside [expected, new).
            expected = upper - 1 if stale == 0 and upper > 0 else upper
            a, b = place(rel_a, upper, mid), place(rel_b, mid, new)
            client = self.clients[committer.client]

            async def make() -> list[Batch]:
                made = [
                    await maker.handle.batch(as_table(self.schema, a), upper, mid),
                    await maker.handle.batch(as_table(self.schema, b), mid, new),
                ]
                return [Batch.from_bytes(x.to_bytes()) for x in made]

            batches = self._ask(make(), maker)
            if isinstance(batches, Told):
                return
            for x in batches:
                assert x.shard_id == self.shard_id and x.lower >= upper
            label = self._label("batch")
            call = partial(committer.handle.compare_and_append_batch, batches, expected, new)
            told = self._attempt(call, committer)
            refused = expected != upper
            asked = Asked(committer.client, upper, new, refused=refused, what="a batch commit")
            landed = self.judge.write(told, asked)
            if landed:
                self.model.compare_and_append(a + b, upper, new, label)
            # Throwing batches away is safe only when they were not appended; persist must
            # refuse otherwise (or, once compaction replaced them, be harmless: later reads
            # check that). Deleted or not when a delete fails, later reads check the batch is
            # intact if it landed.
            if delete:
                for x in batches:
                    try:
                        self._ask(client.delete_batch(x), None)
                    except InvalidUsage:
                        assert landed, "delete_batch refused a batch that was never appended"

    @rule(data=st.data(), first_index=PICK, second_index=PICK)
    def race(self, data: st.DataObject, first_index: int, second_index: int) -> None:
        """Two writers (often on different clients) race for the same upper."""
        with self.step("race"):
            rel = [self._updates(data, "first updates"), self._updates(data, "second updates")]
            first = self._writer(first_index)
            second = self._writer(second_index, avoid=first)
            e = self.model.upper
            if first is None or second is None or e is None:
                self.stats.skipped += 1
                return
            # Racer i writes [e, e + 1 + i): the upper afterwards names the winner.
            ups = [place(rel[0], e, e + 1), place(rel[1], e, e + 2)]
            label = self._label("race")
            racers = [
                (w, partial(w.handle.compare_and_append, as_table(self.schema, u), e, e + 1 + i))
                for i, (w, u) in enumerate(zip((first, second), ups, strict=True))
            ]

            async def both() -> list[Told]:
                return list(await asyncio.gather(*(self._outcome(c, w) for w, c in racers)))

            told = self.run(both())
            actual = self.read_upper(first.client)
            assert actual in (e, e + 1, e + 2), actual
            for i, t in enumerate(told):
                self.judge.raced(t, won=actual == e + 1 + i, upper=actual, what=f"racer {i}")
            if actual != e:
                self.model.compare_and_append(ups[actual - e - 1], e, actual, label)

    @rule(data=st.data(), index=PICK)
    def write_while_paused(self, data: st.DataObject, index: int) -> None:
        """A write can't finish while the location is paused, and goes on after ``resume``."""
        with self.step("write_while_paused"):
            if (drawn := self._write_inputs(data, index)) is None:
                return
            rel, w, e = drawn
            ups = place(rel, e, e + 1)
            label = self._label("paused")
            call = partial(w.handle.compare_and_append, as_table(self.schema, ups), e, e + 1)

            async def go() -> Told:
                self.faults.pause()
                try:
                    task = asyncio.ensure_future(self._outcome(call, w))
                    for _ in range(1000):
                        if self.faults.waiting or task.done():
                            break
                        await asyncio.sleep(0.001)
                    # Only a cancellation (armed, or by faults before the hold) ends it early.
                    assert not task.done() or task.result().interrupted, (
                        "a write finished while its location was paused"
                    )
                finally:
                    self.faults.resume()
                return await task

            told = self.run(go())
            if self.judge.write(told, Asked(w.client, e, e + 1, what="the paused write")):
                self.model.compare_and_append(ups, e, e + 1, label)
