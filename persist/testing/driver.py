"""The shard machine's engine: an example's state, its calls under test, and its final audit.

``MachineBase`` is the ``RuleBasedStateMachine`` that the rule modules extend
(``persist.testing.handle_rules``, ``read_rules``, ``write_rules``, ``fault_rules``);
``persist.testing.machine.ShardMachine`` joins them. It holds an example's clients, handles and
``ShardModel``, and gives every rule what rules share:

- ``step(name)``: the body of every rule runs in it;
- ``_write_inputs(data, index)``, ``_updates``, ``_writer``, ``_span``, ``_pick``: a
  rule's inputs and handles;
- ``_attempt(call, who)``: a write under test, and what its caller was ``Told``;
  ``_retry(who, call)``: that write again, for the judge to settle it when in doubt;
- ``_ask(coro, who)``: any other call under test: its value, or the ``Told`` of its failure;
- ``judge``: whether a write landed (``persist.testing.judge``).

A rule draws its inputs, makes its call, has the judge say what happened, and applies that to
the model. A new write rule reads, for instance::

    @rule(data=st.data(), index=PICK)
    def append_next(self, data: st.DataObject, index: int) -> None:
        with self.step("append_next"):
            if (drawn := self._write_inputs(data, index)) is None:
                return
            rel, w, e = drawn
            ups = place(rel, e, e + 1)
            call = partial(w.handle.append, as_table(self.schema, ups), e, e + 1)
            told = self._attempt(call, w)
            retry = self._retry(w, call, idempotent=True)
            if self.judge.write(told, Asked(w.client, e, e + 1, what="append"), retry):
                self.model.append(ups, e, e + 1, self._label("append"))
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import pyarrow as pa
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant

from persist.bridge import CallerLoop
from persist.client import PersistClient
from persist.config import PersistConfig
from persist.errors import ExternalError, LeaseExpired, UpperMismatch
from persist.ids import ShardId
from persist.read import ReadHandle
from persist.testing.cancel import CallCancelled, under_test
from persist.testing.faults import Faults, FaultyBlob, FaultyConsensus
from persist.testing.judge import TOLD_OK, Interrupted, Judge, Retry, Told
from persist.testing.lag import LoopLag
from persist.testing.model import Row, ShardModel, Update, consolidate, contents_of, table_updates
from persist.testing.plan import FaultPlan, LocationFactory
from persist.testing.stall import ManualClock
from persist.testing.stats import MachineStats
from persist.testing.strategies import as_table, relative_update_lists, schemas
from persist.write import WriteHandle

__all__ = ["PICK", "MachineBase", "Reader", "Writer"]

T = TypeVar("T")

# Every rule draws all of its choices first, with constraints that don't depend on the state:
# outcomes under faults are nondeterministic, and Hypothesis needs the same choices to draw the
# same way on every run. Handles are picked by an index taken modulo the count.
PICK = st.integers(0, 15)


@dataclass(eq=False)
class Writer:
    handle: WriteHandle
    client: int
    stalls_at_open: int = 0  # the machine's stall count when it was opened


@dataclass(eq=False)
class Reader:
    handle: ReadHandle
    client: int
    stalls_at_open: int = 0


class MachineBase(RuleBasedStateMachine):
    """An example's state and the plumbing its rules share; the class attributes are the
    knobs that ``shard_machine`` sets."""

    location: ClassVar[LocationFactory]
    plan: ClassVar[FaultPlan] = FaultPlan()
    config: ClassVar[PersistConfig]
    stats: ClassVar[MachineStats]
    n_clients: ClassVar[int] = 2
    timeout_s: ClassVar[float] = 60.0
    resolve_attempts: ClassVar[int] = 20

    def __init__(self) -> None:
        super().__init__()
        # The loop runs only while a step waits for it (``CallerLoop``): between steps nothing
        # of persist runs, no heartbeat and no lag ticker.
        self.runner = CallerLoop()
        self.clients: list[PersistClient] = []
        self.writers: list[Writer] = []
        self.readers: list[Reader] = []
        # Readers that are certainly still registered but no longer used: their client was
        # closed without expiring them (as a crashed process leaves them), or their since is
        # unknown. Each holds the shard's since at or below the value kept here.
        self.ghosts: list[int | None] = []
        # With a retention the since may rest below every reader's (history the window keeps)
        # and move on with no reader at all: only bounds are known then.
        self.retention_ms = self.config.retention_ms
        self.since_exact = self.retention_ms is None
        self.last_open_since: int | None = 0
        self.since_when_left: int | None = 0
        # The highest since of the readers that left unsure (an expire that failed or was
        # cancelled, ghosts a stall may or may not have expired, a reader whose own call found
        # its lease run out after a stall): each may still be registered,
        # holding the since at most there. They never lower the bound while live readers set it,
        # but once those leave, the since may rest as high as the highest of them.
        self.linger_since: int | None = None
        self.model = ShardModel()
        self.judge = Judge(self.stats, self.read_upper, self.resolve_attempts)
        self.faults = Faults()
        self.schema = pa.schema([("k", pa.int64())])
        self.columns: list[str] = []
        self.shard_id = ShardId.new()
        self.started = False
        self.broken = False
        self.labels = 0
        self.clock = ManualClock()
        self.created_ms = 0  # when the example's shard was created, by ``clock``
        self.lag = LoopLag()
        self.stalls = 0
        self.armed: int | None = None  # cancel the next call under test after k iterations
        self.cancelled_writers: list[Writer] = []
        self.made_clients = 0

    # --- running calls --------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(self._lagged(coro))

    async def _lagged(self, coro: Coroutine[Any, Any, T]) -> T:
        # The ticker runs only while the loop does: between steps the loop is stopped, and
        # that gap is the harness's, not persist's.
        self.lag.start()
        try:
            return await asyncio.wait_for(coro, self.timeout_s)
        finally:
            await self.lag.stop()

    async def _call(
        self,
        coro: Coroutine[Any, Any, T],
        who: Writer | Reader | None,
        *,
        lose: str | None = None,
        cancel_at: str | None = None,
    ) -> T:
        """Runs a public call as the call under test: it may be cancelled at a location call
        (``Faults.cancel``) or after the armed number of loop iterations. Raises
        ``Interrupted`` when it was cancelled, or when ``who`` met ``LeaseExpired`` after a
        stall (then ``who`` is dropped)."""
        k, self.armed = self.armed, None
        try:
            return await under_test(
                coro, self.faults, cancel_after=k, lose_reply=lose, cancel_at=cancel_at
            )
        except CallCancelled as exc:
            self.stats.cancellations += 1
            if exc.how != "faults":
                self.stats.cancelled_by_iterations += 1
            if isinstance(who, Writer):
                self.cancelled_writers.append(who)
            raise Interrupted(str(exc)) from exc
        except LeaseExpired:
            if who is None or who.stalls_at_open >= self.stalls:
                raise  # no stall since it opened: its 3600 s lease can't have run out
            self._drop(who)
            raise Interrupted("lease expired after a stall") from None

    async def _outcome(
        self,
        call: Callable[[], Coroutine[Any, Any, None]],
        who: Writer | None = None,
        *,
        lose: str | None = None,
    ) -> Told:
        """A write under test and what its caller was told. A cancellation, or
        ``LeaseExpired`` after a stall, is indeterminate: the write may have landed before it
        (a retry meets it)."""
        try:
            await self._call(call(), who, lose=lose)
        except (UpperMismatch, ExternalError, Interrupted) as exc:
            told = Told.of(exc)
            self.judge.note(told)
            return told
        return TOLD_OK

    def _attempt(
        self,
        call: Callable[[], Coroutine[Any, Any, None]],
        who: Writer | None = None,
        *,
        lose: str | None = None,
    ) -> Told:
        """``_outcome`` run to its end, for a rule that makes one call at a time."""
        return self.run(self._outcome(call, who, lose=lose))

    def _retry(
        self,
        who: Writer,
        call: Callable[[], Coroutine[Any, Any, None]],
        *,
        idempotent: bool = False,
    ) -> Retry:
        """``who``'s write ``call`` made again, to settle it when in doubt."""

        def again() -> Told | None:
            # A writer that expired after a stall can't try again: only a read can tell.
            return self._attempt(call, who) if who in self.writers else None

        return Retry(again, idempotent=idempotent)

    def _ask(
        self,
        coro: Coroutine[Any, Any, T],
        who: Writer | Reader | None,
        *,
        read: bool = False,
        cancel_at: str | None = None,
    ) -> T | Told:
        """A call under test that writes no data: its value, or what the caller was told of
        its failure (an ``ExternalError``, or an interruption). ``read``: it reads, and a read
        never fails indeterminately."""
        try:
            return self.run(self._call(coro, who, cancel_at=cancel_at))
        except ExternalError as exc:
            assert not read or exc.determinate, f"a read failed indeterminately: {exc}"
            told = Told.of(exc)
        except Interrupted as exc:
            told = Told.of(exc)
        self.judge.note(told)
        return told

    def read_upper(self, client: int) -> int | None:
        """The shard's upper, read through ``client`` (faults on; retried while reads fail)."""
        return self.run(self._read_upper(client))

    async def _read_upper(self, client: int) -> int | None:
        machine_client = self.clients[client]
        for _ in range(self.resolve_attempts):
            try:
                return (await machine_client.inspect(self.shard_id))["upper"]  # type: ignore[no-any-return]
            except ExternalError as exc:
                assert exc.determinate, f"a read failed indeterminately: {exc}"
        with self.faults.suspended():
            return (await machine_client.inspect(self.shard_id))["upper"]  # type: ignore[no-any-return]

    # --- steps and handles ----------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.stats.steps += 1
        self.stats.rules[name] = self.stats.rules.get(name, 0) + 1
        if self.faults.active:
            self.stats.steps_with_faults += 1
        try:
            yield
            self._check_cancelled_writers()
        except BaseException:
            self.broken = True
            raise
        if self.readers or self.ghosts:
            self.since_when_left = self._since_bound()

    def _check_cancelled_writers(self) -> None:
        """A writer whose call was cancelled must go on working: a no-op heartbeat at the
        (settled) upper succeeds, or raises ``LeaseExpired`` if a stall may have expired it."""
        writers, self.cancelled_writers = self.cancelled_writers, []
        upper = self.model.upper
        if upper is None:
            return
        for w in writers:
            if w not in self.writers:
                continue
            with self.faults.suspended():
                try:
                    self.run(w.handle.compare_and_append(as_table(self.schema, []), upper, upper))
                except LeaseExpired:
                    assert w.stalls_at_open < self.stalls, "a cancelled call expired its writer"
                    self._drop(w)
                    continue
            self.stats.cancelled_handles_checked += 1

    def _drop(self, who: Writer | Reader) -> None:
        """Forgets a handle whose lease expired. A reader may linger: its own call can find its
        lease run out without committing its removal, which waits for another commit (whose
        client may not judge it expired yet), holding the since meanwhile."""
        self.stats.expired_by_stall += 1
        if isinstance(who, Writer):
            if who in self.writers:
                self.writers.remove(who)
        elif who in self.readers:
            self.readers.remove(who)
            self._may_linger(who.handle.since)

    def _may_linger(self, since: int | None) -> None:
        """A reader at ``since`` left the machine's readers but may still be registered."""
        self.since_exact = False
        if since is not None:
            self.linger_since = (
                since if self.linger_since is None else max(self.linger_since, since)
            )

    def _since_bound(self) -> int | None:
        """An upper bound of the shard's since: the least since of the readers known to be
        registered; with none, where it was when the last of them left (it stays there) or the
        highest since of the readers that may linger (the since moves up to theirs when the
        others leave)."""
        sinces = [r.handle.since for r in self.readers] + self.ghosts
        if not sinces and self.retention_ms is not None:
            # The window moves the since on by itself, at most to the upper - 1.
            upper = self.model.upper
            return None if upper is None else max(upper - 1, self.since_when_left or 0)
        if not sinces:
            if self.since_when_left is None or self.linger_since is None:
                return self.since_when_left
            return max(self.since_when_left, self.linger_since)
        out: int | None = None
        for s in sinces:
            if s is not None and (out is None or s < out):
                out = s
        return out

    def _label(self, what: str) -> str:
        self.labels += 1
        return f"{what}#{self.labels}"

    def _config(self) -> PersistConfig:
        # Every client of an example reads one clock, which ``stall`` moves on.
        return dataclasses.replace(self.config, now_ms=self.clock)

    async def _new_client(self) -> PersistClient:
        blob, consensus = type(self).location()
        config = self._config()
        self.made_clients += 1
        if self.made_clients % 2 == 0:
            # Every other client stores each part of more than one row as an unsorted run, as
            # a big write does: one shard then holds both kinds of run, in every mix.
            config = dataclasses.replace(config, sorted_part_max_bytes=0)
        return PersistClient(
            FaultyBlob(blob, self.faults), FaultyConsensus(consensus, self.faults), config
        )

    # --- drawing --------------------------------------------------------------------------------

    @staticmethod
    def _pick(items: Sequence[T], index: int) -> T | None:
        return items[index % len(items)] if items else None

    @staticmethod
    def _span(upper: int, offset: int, width: int, finish: int) -> tuple[int, int | None]:
        """``[lower, new)``: from ``offset`` off the ``upper`` (not below 0), ``width`` wide."""
        lower = max(0, upper + offset)
        # Rarely: finishing the shard ends its writes for the rest of the example.
        return lower, None if finish == 37 else lower + width

    def _writer(self, index: int, *, avoid: Writer | None = None) -> Writer | None:
        """The writer ``index`` picks (other than ``avoid``), opening one when there is none."""
        pool = [w for w in self.writers if w is not avoid]
        if not pool:
            client = index % len(self.clients)
            try:
                handle = self.run(self.clients[client].open_writer(self.shard_id, self.schema))
            except ExternalError as exc:
                self.judge.note(Told.of(exc))
                return None
            pool = [Writer(handle, client, self.stalls)]
            self.writers += pool
        return self._pick(pool, index)

    def _updates(self, data: st.DataObject, label: str) -> list[Update]:
        return data.draw(
            relative_update_lists(self.schema, special_floats=self.plan.special_floats),
            label=label,
        )

    def _write_inputs(
        self, data: st.DataObject, index: int
    ) -> tuple[list[Update], Writer, int] | None:
        """What a write by one writer starts from: its updates (at times relative to where it
        writes), the writer ``index`` picks, and the shard's upper. None, counted as skipped,
        when no writer can be opened or the shard is finished."""
        rel = self._updates(data, "updates")
        w = self._writer(index)
        upper = self.model.upper
        if w is None or upper is None:
            self.stats.skipped += 1
            return None
        if len(rel) > 1 and self.clients[w.client].config.sorted_part_max_bytes == 0:
            self.stats.unsorted_writes += 1
        return rel, w, upper

    # --- setup, invariants and the final audit --------------------------------------------------

    @initialize(schema=schemas(max_columns=3), data=st.data())
    def start(self, schema: pa.Schema, data: st.DataObject) -> None:
        plan = self.plan
        self.faults = Faults(
            seed=data.draw(st.integers(0, 2**32 - 1), label="seed"),
            fail_before=data.draw(st.sampled_from(list(plan.fail_before)), label="fail_before"),
            fail_after=data.draw(st.sampled_from(list(plan.fail_after)), label="fail_after"),
            cancel=data.draw(st.sampled_from(list(plan.cancel)), label="cancel"),
            latency_s=plan.latency_s,
            ops=plan.ops,
        )
        self.schema = schema
        self.columns = schema.names
        self.stats.examples += 1

        async def setup() -> None:
            for _ in range(self.n_clients):
                self.clients.append(await self._new_client())
            self.created_ms = self.clock()
            with self.faults.suspended():
                w, r = await self.clients[0].open(self.shard_id, schema, purpose="machine")
            self.writers.append(Writer(w, 0))
            self.readers.append(Reader(r, 0))
            assert r.since == 0 and w.upper == 0

        self.started = True
        self.run(setup())

    @invariant()
    def cached_uppers_are_not_ahead(self) -> None:
        for w in self.writers:
            cached, upper = w.handle.upper, self.model.upper
            assert upper is None or (cached is not None and cached <= upper), (cached, upper)

    def teardown(self) -> None:
        try:
            if self.started and not self.broken:
                self.run(self._verify())
        finally:
            self.stats.faults.add(self.faults.counts)
            self.stats.worst_loop_stall_ms = max(self.stats.worst_loop_stall_ms, self.lag.worst_ms)
            self.faults.resume()
            with contextlib.suppress(Exception):
                self.run(self._close_all())
            self.runner.close()

    async def _close_all(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    async def _verify(self) -> None:
        """Reads everything back through a fresh client with faults off and audits it."""
        blob, consensus = type(self).location()
        async with PersistClient(blob, consensus, self._config()) as client:
            info = await client.inspect(self.shard_id)
            assert info["upper"] == self.model.upper, (info["upper"], self.model.upper)
            read = await client.open_leased_reader(self.shard_id, self.schema, "verify")
            since = read.since
            bound = self._since_bound()
            if since is None and self.retention_ms is not None and self.model.upper is None:
                # Sealed, and the window passed the seal: nothing is readable any more, which
                # is what a retention promises after its window. Nothing to audit by reading.
                self.stats.audits_skipped += 1
                await read.expire()
                return
            assert since is not None and (bound is None or since <= bound), (since, bound)
            if self.model.readable(since):
                table = await read.snapshot_and_fetch(since)
                got = contents_of(table, self.columns, since)
                assert got == self.model.contents_as_of(since), "final contents differ"
            actual: dict[tuple[Row, int], int] = {}
            if self.model.upper is None or self.model.upper > since + 1:
                actual = await self._listen_all(read, since)
                assert actual == self.model.updates_between(since + 1, self.model.upper)
            audit = self.model.audit(actual, since)
            self.stats.add_audit(audit)
            self.stats.acknowledged += len(self.model.writes)
            assert audit.ok, audit.problems
            await read.expire()

    async def _listen_all(self, read: ReadHandle, as_of: int) -> dict[tuple[Row, int], int]:
        """Listens from ``as_of`` up to the model's upper; the updates, per (row, time)."""
        target = self.model.upper
        got: list[Update] = []
        progress = as_of + 1
        events = read.listen(as_of)
        try:
            async for event in events:
                for row, time, diff in table_updates(event.updates, self.columns):
                    assert time >= progress and (event.upper is None or time < event.upper), (
                        f"listen delivered time {time} in an event [{progress}, {event.upper})"
                    )
                    assert time > as_of
                    got.append((row, time, diff))
                if event.upper is not None:
                    assert event.upper > progress - 1 and (
                        target is None or event.upper <= target
                    ), (progress, event.upper, target)
                    progress = event.upper
                if event.upper == target:
                    break
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        return consolidate(got)
