"""A Hypothesis state machine that drives real persist handles against the reference model.

``shard_machine(location)`` returns a ``RuleBasedStateMachine`` class. Each example opens two
clients (two "processes") on one fresh shard of the location, with the location's Blob and
Consensus wrapped in fault injectors (``persist.testing.faults``), and runs random steps:
open writers and readers, ``compare_and_append`` (right, stale and ahead of the upper),
``append``, ``batch`` + ``compare_and_append_batch`` (moved between clients as bytes), two
writers racing one upper, ``snapshot`` (whole or in splits fetched by the other client),
``listen``, ``downgrade_since``, ``expire``, ``maintain``, a client restart, and a write held by
a paused location, a client stalling past its lease, and cancellations of the calls under test
(``persist.testing.cancel``). After each step the handles must agree with :class:`ShardModel`:

- an acknowledged write is in every later read, exactly once;
- a refusal (``UpperMismatch``, ``InvalidUsage``) or a determinate ``ExternalError`` changed
  nothing; a read never fails indeterminately;
- after an indeterminate ``ExternalError``, a cancellation, or (after a stall) ``LeaseExpired``,
  a read of the upper (or the same call retried) tells whether it happened, and it happened at
  most once; a handle whose call was cancelled goes on working;
- after a stall, a handle goes on working or raises ``LeaseExpired`` (then it is dropped).

At the end of an example a fresh client, with faults off, reads everything back and audits
every acknowledged write (present / lost / duplicated). Use it as::

    from hypothesis import settings
    from persist.testing import shard_machine, uri_location

    TestShard = shard_machine(uri_location("mem://t", "mem://t")).TestCase
    TestShard.settings = settings(max_examples=20, stateful_step_count=30, deadline=None)

Each example runs on its own event loop; don't use it from inside a running loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import pyarrow as pa
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from persist.batch import Batch
from persist.client import PersistClient
from persist.config import PersistConfig
from persist.errors import ExternalError, InvalidUsage, LeaseExpired, UpperMismatch
from persist.fetch import Split
from persist.ids import ShardId
from persist.location import Blob, Consensus, open_blob, open_consensus
from persist.read import ReadHandle
from persist.testing.cancel import CallCancelled, under_test
from persist.testing.faults import FaultCounts, Faults, FaultyBlob, FaultyConsensus
from persist.testing.lag import LoopLag
from persist.testing.model import (
    Audit,
    Row,
    ShardModel,
    Update,
    consolidate,
    contents_of,
    table_updates,
)
from persist.testing.stall import ManualClock
from persist.testing.strategies import as_table, place, relative_update_lists, schemas
from persist.write import WriteHandle

__all__ = [
    "NO_FAULTS",
    "FaultPlan",
    "LocationFactory",
    "MachineStats",
    "ShardMachine",
    "machine_config",
    "run_shard_machine",
    "shard_machine",
    "uri_location",
]

T = TypeVar("T")

LocationFactory = Callable[[], tuple[Blob, Consensus]]
"""Returns new Blob and Consensus handles on one location (each call: like another process)."""


def uri_location(blob_uri: str, consensus_uri: str) -> LocationFactory:
    """A location factory for URIs as ``persist.connect`` takes them."""
    return lambda: (open_blob(blob_uri), open_consensus(consensus_uri))


@dataclass(frozen=True)
class FaultPlan:
    """The faults an example may run with: each example draws one level of each fraction."""

    fail_before: Sequence[float] = (0.0, 0.05, 0.2, 0.4)
    fail_after: Sequence[float] = (0.0, 0.05, 0.2, 0.4)
    latency_s: tuple[float, float] = (0.0, 0.002)
    ops: frozenset[str] | None = None
    # Cancellation of the call under test when it calls its location (``Faults.cancel``).
    cancel: Sequence[float] = (0.0, 0.05, 0.2)
    # Whether steps may cancel the next call after k loop iterations (``arm_cancel``).
    cancel_calls: bool = True
    # Whether a client may stall past its lease (``stall``, ``lost_reply_then_stall``).
    stalls: bool = True
    # Whether data values include NaN, infinities and -0.0.
    special_floats: bool = False


NO_FAULTS = FaultPlan(
    fail_before=(0.0,),
    fail_after=(0.0,),
    latency_s=(0.0, 0.0),
    cancel=(0.0,),
    cancel_calls=False,
    stalls=False,
)


def machine_config(**overrides: Any) -> PersistConfig:
    """The config the machine's clients use: quick polls and retries, frequent rollups, and
    leases long enough that no handle of an example expires on its own."""
    base: dict[str, Any] = {
        "poll_interval_s": 0.01,
        "retry_initial_delay_s": 0.001,
        # Few retries, so that failures reach the caller too, not only persist's retry loops.
        "retry_attempts": 2,
        "rollup_interval": 4,
        "lease_duration_s": 3600.0,
        "heartbeat_interval_s": 600.0,
    }
    base.update(overrides)
    return PersistConfig(**base)


@dataclass
class MachineStats:
    """What the machine's examples did and found, summed over examples."""

    examples: int = 0
    steps: int = 0
    steps_with_faults: int = 0
    acknowledged: int = 0
    refused: int = 0
    determinate_errors: int = 0
    indeterminate_errors: int = 0
    resolved_landed: int = 0
    resolved_not_landed: int = 0
    resolved_by_retry: int = 0
    reads_checked: int = 0
    listens_checked: int = 0
    audit_checked: int = 0
    audit_merged: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    skipped: int = 0
    cancellations: int = 0  # calls under test that ended cancelled
    cancelled_by_iterations: int = 0  # of those, cancelled after k loop iterations
    cancelled_handles_checked: int = 0
    stalls: int = 0
    expired_by_stall: int = 0
    survived_stall: int = 0
    lost_reply_then_stall: int = 0
    worst_loop_stall_ms: float = 0.0
    faults: FaultCounts = field(default_factory=FaultCounts)
    rules: dict[str, int] = field(default_factory=dict)

    def add_audit(self, audit: Audit) -> None:
        self.audit_checked += audit.checked
        self.audit_merged += audit.merged
        self.lost += audit.lost
        self.duplicated += audit.duplicated
        self.wrong += audit.wrong


@dataclass(eq=False)
class _Writer:
    handle: WriteHandle
    client: int
    stalls_at_open: int = 0  # the machine's stall count when it was opened


@dataclass(eq=False)
class _Reader:
    handle: ReadHandle
    client: int
    stalls_at_open: int = 0


class _Interrupted(Exception):
    """A call under test ended without an answer: cancelled, or its handle expired after a
    stall (and was dropped)."""


class _Outcome:
    """How a write call ended, as the caller was told."""

    OK = "ok"
    MISMATCH = "mismatch"
    DETERMINATE = "determinate"
    INDETERMINATE = "indeterminate"


def _classify(exc: BaseException | None) -> str:
    if exc is None:
        return _Outcome.OK
    if isinstance(exc, UpperMismatch):
        return _Outcome.MISMATCH
    if isinstance(exc, ExternalError):
        return _Outcome.DETERMINATE if exc.determinate else _Outcome.INDETERMINATE
    raise exc


class ShardMachine(RuleBasedStateMachine):
    """Random operations on one shard by two clients, checked against ``ShardModel``.

    Configure a subclass with ``shard_machine``; the class attributes below are its knobs.
    """

    location: ClassVar[LocationFactory]
    plan: ClassVar[FaultPlan] = FaultPlan()
    config: ClassVar[PersistConfig]
    stats: ClassVar[MachineStats]
    n_clients: ClassVar[int] = 2
    timeout_s: ClassVar[float] = 60.0
    resolve_attempts: ClassVar[int] = 20

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clients: list[PersistClient] = []
        self.writers: list[_Writer] = []
        self.readers: list[_Reader] = []
        # Readers that are certainly still registered but no longer used: their client was
        # closed without expiring them (as a crashed process leaves them), or their since is
        # unknown. Each holds the shard's since at or below the value kept here.
        self.ghosts: list[int | None] = []
        self.since_exact = True
        self.last_open_since: int | None = 0
        self.since_when_left: int | None = 0
        self.model = ShardModel()
        self.faults = Faults()
        self.schema = pa.schema([("k", pa.int64())])
        self.columns: list[str] = []
        self.shard_id = ShardId.new()
        self.started = False
        self.broken = False
        self.labels = 0
        self.clock = ManualClock()
        self.lag = LoopLag()
        self.stalls = 0
        self.armed: int | None = None  # cancel the next call under test after k iterations
        self.cancelled_writers: list[_Writer] = []

    # --- plumbing ------------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(self._lagged(coro))

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
        who: _Writer | _Reader | None,
        *,
        lose: str | None = None,
        cancel_at: str | None = None,
    ) -> T:
        """Runs a public call as the call under test: it may be cancelled at a location call
        (``Faults.cancel``) or after the armed number of loop iterations. Raises
        ``_Interrupted`` when it was cancelled, or when ``who`` met ``LeaseExpired`` after a
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
            if isinstance(who, _Writer):
                self.cancelled_writers.append(who)
            raise _Interrupted(str(exc)) from exc
        except LeaseExpired:
            if who is None or who.stalls_at_open >= self.stalls:
                raise  # no stall since it opened: its 3600 s lease can't have run out
            self._drop(who)
            raise _Interrupted("lease expired after a stall") from None

    def _drop(self, who: _Writer | _Reader) -> None:
        """Forgets a handle whose lease expired (an expired reader no longer holds since)."""
        self.stats.expired_by_stall += 1
        if isinstance(who, _Writer):
            if who in self.writers:
                self.writers.remove(who)
        elif who in self.readers:
            self.readers.remove(who)

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

    def _label(self, what: str) -> str:
        self.labels += 1
        return f"{what}#{self.labels}"

    def _config(self) -> PersistConfig:
        # Every client of an example reads one clock, which ``stall`` moves on.
        return dataclasses.replace(self.config, now_ms=self.clock)

    async def _new_client(self) -> PersistClient:
        blob, consensus = type(self).location()
        return PersistClient(
            FaultyBlob(blob, self.faults), FaultyConsensus(consensus, self.faults), self._config()
        )

    def _note(self, outcome: str) -> None:
        if outcome == _Outcome.DETERMINATE:
            self.stats.determinate_errors += 1
        elif outcome == _Outcome.INDETERMINATE:
            self.stats.indeterminate_errors += 1
        elif outcome == _Outcome.MISMATCH:
            self.stats.refused += 1

    async def _read_upper(self, client: int) -> int | None:
        """The shard's upper, read through ``client`` (faults on; retried while reads fail)."""
        machine_client = self.clients[client]
        for _ in range(self.resolve_attempts):
            try:
                return (await machine_client.inspect(self.shard_id))["upper"]  # type: ignore[no-any-return]
            except ExternalError as exc:
                assert exc.determinate, f"a read failed indeterminately: {exc}"
        with self.faults.suspended():
            return (await machine_client.inspect(self.shard_id))["upper"]  # type: ignore[no-any-return]

    async def _resolve(
        self, client: int, expected: int | None, new: int | None, *, unsure: bool = True
    ) -> bool:
        """Whether a write from ``expected`` (the upper before it) to ``new`` landed, by a read.
        ``unsure``: the caller was told the outcome is indeterminate (counted as resolved)."""
        actual = await self._read_upper(client)
        assert actual in (expected, new), f"after a write {expected}->{new} the upper is {actual}"
        landed = actual == new and expected != new
        if unsure:
            if landed:
                self.stats.resolved_landed += 1
            else:
                self.stats.resolved_not_landed += 1
        return landed

    async def _attempt(
        self,
        call: Coroutine[Any, Any, None],
        who: _Writer | None = None,
        *,
        lose: str | None = None,
    ) -> tuple[str, BaseException | None]:
        """A write under test and how it ended. A cancellation, or ``LeaseExpired`` after a
        stall, is indeterminate: the write may have landed before it (a retry meets it)."""
        try:
            await self._call(call, who, lose=lose)
        except (UpperMismatch, ExternalError) as exc:
            outcome = _classify(exc)
            self._note(outcome)
            return outcome, exc
        except _Interrupted as exc:
            return _Outcome.INDETERMINATE, exc
        return _Outcome.OK, None

    def _since_bound(self) -> int | None:
        """An upper bound of the shard's since: the least since of the readers known to be
        registered; with none, where it was when the last of them left (it stays there).
        Readers whose registration is uncertain can only hold it lower."""
        sinces = [r.handle.since for r in self.readers] + self.ghosts
        if not sinces:
            return self.since_when_left
        out: int | None = None
        for s in sinces:
            if s is not None and (out is None or s < out):
                out = s
        return out

    # --- setup and teardown --------------------------------------------------------------------

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
            with self.faults.suspended():
                w, r = await self.clients[0].open(self.shard_id, schema, purpose="machine")
            self.writers.append(_Writer(w, 0))
            self.readers.append(_Reader(r, 0))
            assert r.since == 0 and w.upper == 0

        self.started = True
        self.run(setup())

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
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

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

    # --- drawing --------------------------------------------------------------------------------
    # Every rule draws all of its choices first, with constraints that don't depend on the
    # state: outcomes under faults are nondeterministic, and Hypothesis needs the same choices
    # to draw the same way on every run. Handles are picked by an index taken modulo the count.

    _PICK = st.integers(0, 15)

    @staticmethod
    def _pick(items: Sequence[T], index: int) -> T | None:
        return items[index % len(items)] if items else None

    @staticmethod
    def _new_upper(lower: int, width: int, finish: int) -> int | None:
        # Rarely: finishing the shard ends its writes for the rest of the example.
        return None if finish == 37 else lower + width

    def _writer(self, index: int, *, avoid: _Writer | None = None) -> _Writer | None:
        """The writer ``index`` picks (other than ``avoid``), opening one when there is none."""
        pool = [w for w in self.writers if w is not avoid]
        if not pool:
            client = index % len(self.clients)
            try:
                handle = self.run(self.clients[client].open_writer(self.shard_id, self.schema))
            except ExternalError as exc:
                self._note(_classify(exc))
                return None
            pool = [_Writer(handle, client, self.stalls)]
            self.writers += pool
        return self._pick(pool, index)

    def _reader(self, index: int, margin: int = 0) -> _Reader | None:
        """A reader that can read as of its since (+ ``margin``), opening one when none can."""
        pool = self._readable_readers(margin)
        if not pool:
            self.open_reader(index)
            pool = self._readable_readers(margin)
        return self._pick(pool, index)

    def _updates(self, data: st.DataObject, label: str) -> list[Update]:
        return data.draw(
            relative_update_lists(self.schema, special_floats=self.plan.special_floats),
            label=label,
        )

    # --- handles -------------------------------------------------------------------------------

    @rule(i=st.integers(0, 1))
    def open_writer(self, i: int) -> None:
        with self.step("open_writer"):
            client = i % len(self.clients)
            call = self.clients[client].open_writer(self.shard_id, self.schema, "w")
            try:
                w = self.run(self._call(call, None))
            except ExternalError as exc:
                self._note(_classify(exc))
                return
            except _Interrupted:
                return  # it may be registered: unused, it expires with its lease
            self.writers.append(_Writer(w, client, self.stalls))

    @rule(i=st.integers(0, 1))
    def open_reader(self, i: int) -> None:
        with self.step("open_reader"):
            client = i % len(self.clients)
            call = self.clients[client].open_leased_reader(self.shard_id, self.schema, "r")
            try:
                r = self.run(self._call(call, None))
            except ExternalError as exc:
                if not exc.determinate:
                    self.since_exact = False  # it may be registered, holding the since
                self._note(_classify(exc))
                return
            except _Interrupted:
                self.since_exact = False  # it may be registered, holding the since
                return
            bound = self._since_bound()
            since = r.since
            assert since is not None and self.last_open_since is not None
            assert since >= self.last_open_since, "the shard's since went backwards"
            assert bound is not None and since <= bound, (since, bound)
            if self.since_exact:
                assert since == bound, (since, bound)
            self.last_open_since = since
            self.readers.append(_Reader(r, client, self.stalls))

    @rule(index=_PICK)
    def expire_writer(self, index: int) -> None:
        with self.step("expire_writer"):
            w = self._pick(self.writers, index)
            if w is None:
                self.stats.skipped += 1
                return
            self.writers.remove(w)
            try:
                self.run(self._call(w.handle.expire(), w))
            except ExternalError:
                pass
            except _Interrupted:
                return  # a cancelled expire may not have begun: the lease runs out unused
            empty = as_table(self.schema, [])
            with contextlib.suppress(LeaseExpired):
                self.run(w.handle.compare_and_append(empty, 0, 0))
                raise AssertionError("an expired writer kept writing")

    @rule(index=_PICK)
    def expire_reader(self, index: int) -> None:
        with self.step("expire_reader"):
            r = self._pick(self.readers, index)
            if r is None:
                self.stats.skipped += 1
                return
            self.readers.remove(r)
            try:
                self.run(self._call(r.handle.expire(), r))
            except ExternalError:
                self.since_exact = False  # it may still be registered, holding the since
            except _Interrupted:
                # A cancelled expire may not have begun: registered or not (then holding since
                # lower than the bound says), it is unused now.
                self.since_exact = False
                return
            with contextlib.suppress(LeaseExpired):
                self.run(r.handle.snapshot(0))
                raise AssertionError("an expired reader kept reading")

    @rule(i=st.integers(0, 1))
    def restart_client(self, i: int) -> None:
        """Closes a client without expiring its handles (as a crash would) and opens a new one."""
        with self.step("restart_client"):
            client = i % len(self.clients)
            self.run(self.clients[client].close())
            self.writers = [w for w in self.writers if w.client != client]
            self.ghosts += [r.handle.since for r in self.readers if r.client == client]
            self.readers = [r for r in self.readers if r.client != client]
            self.clients[client] = self.run(self._new_client())

    # --- writing -------------------------------------------------------------------------------

    @rule(
        data=st.data(),
        index=_PICK,
        offset=st.sampled_from([0, 0, 0, -1, 1]),
        width=st.integers(0, 3),
        finish=st.integers(0, 59),
        by_retry=st.booleans(),
    )
    def compare_and_append(
        self, data: st.DataObject, index: int, offset: int, width: int, finish: int, by_retry: bool
    ) -> None:
        with self.step("compare_and_append"):
            rel = self._updates(data, "updates")
            w = self._writer(index)
            upper = self.model.upper
            if w is None or upper is None:
                self.stats.skipped += 1
                return
            expected = max(0, upper + offset)
            new = self._new_upper(expected, width, finish)
            ups = place(rel, expected, new)
            table = as_table(self.schema, ups)
            label = self._label("caa")
            outcome, exc = self.run(
                self._attempt(w.handle.compare_and_append(table, expected, new), w)
            )
            if expected != upper:
                # A wrong expectation is refused (or the call failed before it could tell).
                assert outcome != _Outcome.OK, "a write with a wrong expected upper succeeded"
                if isinstance(exc, UpperMismatch):
                    assert exc.current == upper, (exc.current, upper)
                if outcome == _Outcome.INDETERMINATE:
                    assert not self.run(self._resolve(w.client, upper, upper))
                return
            if outcome == _Outcome.OK:
                self.model.compare_and_append(ups, expected, new, label)
            elif outcome == _Outcome.MISMATCH:
                raise AssertionError(f"refused a write at the right upper {upper}: {exc}")
            elif outcome == _Outcome.DETERMINATE:
                assert not self.run(self._resolve(w.client, expected, new, unsure=False))
            elif by_retry:
                self._retry_until_known(w, table, ups, expected, new, label)
            elif self.run(self._resolve(w.client, expected, new)):
                self.model.compare_and_append(ups, expected, new, label)

    def _retry_until_known(
        self,
        w: _Writer,
        table: pa.Table,
        ups: list[Update],
        expected: int,
        new: int | None,
        label: str,
    ) -> None:
        """Settles an indeterminate compare_and_append by retrying the same call: it must then
        apply the write, or find it already applied (``UpperMismatch`` at ``new``)."""
        for _ in range(self.resolve_attempts):
            if w not in self.writers:
                break  # expired after a stall: only a read can tell
            outcome, exc = self.run(
                self._attempt(w.handle.compare_and_append(table, expected, new), w)
            )
            if outcome == _Outcome.OK:
                self.stats.resolved_not_landed += 1
                self.model.compare_and_append(ups, expected, new, label)
                return
            if outcome == _Outcome.MISMATCH:
                assert isinstance(exc, UpperMismatch)
                # The first try had landed: the retry must not apply it again.
                assert exc.current == new, (exc.current, new)
                self.stats.resolved_landed += 1
                self.model.compare_and_append(ups, expected, new, label)
                return
        if self.run(self._resolve(w.client, expected, new)):
            self.model.compare_and_append(ups, expected, new, label)

    @rule(
        data=st.data(),
        index=_PICK,
        lower_offset=st.integers(-3, 1),
        width=st.integers(0, 4),
        finish=st.integers(0, 59),
    )
    def append(
        self, data: st.DataObject, index: int, lower_offset: int, width: int, finish: int
    ) -> None:
        with self.step("append"):
            rel = self._updates(data, "updates")
            w = self._writer(index)
            current = self.model.upper
            if w is None or current is None:
                self.stats.skipped += 1
                return
            lower = max(0, current + lower_offset)
            new = self._new_upper(lower, width, finish)
            ups = place(rel, lower, new)
            table = as_table(self.schema, ups)
            label = self._label("append")
            outcome, exc = self.run(self._attempt(w.handle.append(table, lower, new), w))
            if lower > current:
                assert outcome != _Outcome.OK, "an append leaving a gap succeeded"
                if isinstance(exc, UpperMismatch):
                    assert exc.current == current
                if outcome == _Outcome.INDETERMINATE:
                    assert not self.run(self._resolve(w.client, current, current))
                return
            if outcome == _Outcome.OK:
                self.model.append(ups, lower, new, label)
            elif outcome == _Outcome.MISMATCH:
                raise AssertionError(f"append [{lower}, {new}) at upper {current} refused: {exc}")
            elif outcome == _Outcome.DETERMINATE:
                actual = self.run(self._read_upper(w.client))
                assert actual == current, (actual, current)
            else:
                # An append is idempotent: retrying it is the way to be sure.
                for _ in range(self.resolve_attempts):
                    if w not in self.writers:
                        break  # expired after a stall: only a read can tell
                    outcome, exc = self.run(self._attempt(w.handle.append(table, lower, new), w))
                    if outcome == _Outcome.OK:
                        self.stats.resolved_by_retry += 1
                        self.model.append(ups, lower, new, label)
                        return
                    assert outcome != _Outcome.MISMATCH, exc
                if self.run(self._resolve(w.client, current, new)):
                    self.model.append(ups, lower, new, label)

    @rule(
        data=st.data(),
        maker_index=_PICK,
        committer_index=_PICK,
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

            try:
                batches = self.run(self._call(make(), maker))
            except ExternalError as failure:
                self._note(_classify(failure))
                return
            except _Interrupted:
                return
            for x in batches:
                assert x.shard_id == self.shard_id and x.lower >= upper
            label = self._label("batch")
            outcome, exc = self.run(
                self._attempt(
                    committer.handle.compare_and_append_batch(batches, expected, new), committer
                )
            )
            landed: bool
            if expected != upper:
                assert outcome != _Outcome.OK, "a batch commit at a wrong upper succeeded"
                if isinstance(exc, UpperMismatch):
                    assert exc.current == upper
                landed = False
                if outcome == _Outcome.INDETERMINATE:
                    assert not self.run(self._resolve(committer.client, upper, upper))
            elif outcome == _Outcome.OK:
                landed = True
            elif outcome == _Outcome.MISMATCH:
                raise AssertionError(f"a batch commit at the right upper was refused: {exc}")
            elif outcome == _Outcome.DETERMINATE:
                landed = False
                assert not self.run(self._resolve(committer.client, upper, new, unsure=False))
            else:
                landed = self.run(self._resolve(committer.client, upper, new))
            if landed:
                self.model.compare_and_append(a + b, upper, new, label)
            # Throwing batches away is safe only when they were not appended; persist must
            # refuse otherwise (or, once compaction replaced them, be harmless: later reads
            # check that).
            if delete:
                for x in batches:
                    try:
                        self.run(self._call(client.delete_batch(x), None))
                    except InvalidUsage:
                        assert landed, "delete_batch refused a batch that was never appended"
                    except ExternalError as failure:
                        self._note(_classify(failure))
                    except _Interrupted:
                        pass  # deleted or not: later reads check the batch is intact if landed

    @rule(data=st.data(), first_index=_PICK, second_index=_PICK)
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
            ups = [place(rel[0], e, e + 1), place(rel[1], e, e + 2)]
            label = self._label("race")

            async def both() -> list[tuple[str, BaseException | None]]:
                return list(
                    await asyncio.gather(
                        self._attempt(
                            first.handle.compare_and_append(
                                as_table(self.schema, ups[0]), e, e + 1
                            ),
                            first,
                        ),
                        self._attempt(
                            second.handle.compare_and_append(
                                as_table(self.schema, ups[1]), e, e + 2
                            ),
                            second,
                        ),
                    )
                )

            results = self.run(both())
            actual = self.run(self._read_upper(first.client))
            assert actual in (e, e + 1, e + 2), actual
            winner = None if actual == e else actual - e - 1
            for i, (outcome, error) in enumerate(results):
                won = winner == i
                if outcome == _Outcome.OK:
                    assert won, f"racer {i} was told it won, but the upper is {actual}"
                elif outcome == _Outcome.MISMATCH:
                    assert not won and isinstance(error, UpperMismatch), error
                    assert error.current == actual, (error.current, actual)
                elif outcome == _Outcome.DETERMINATE:
                    assert not won, f"racer {i} failed determinately but its write landed"
                elif won:
                    self.stats.resolved_landed += 1
                else:
                    self.stats.resolved_not_landed += 1
            if winner is not None:
                self.model.compare_and_append(ups[winner], e, actual, label)

    @rule(data=st.data(), index=_PICK)
    def write_while_paused(self, data: st.DataObject, index: int) -> None:
        """A write can't finish while the location is paused, and goes on after ``resume``."""
        with self.step("write_while_paused"):
            rel = self._updates(data, "updates")
            w = self._writer(index)
            e = self.model.upper
            if w is None or e is None:
                self.stats.skipped += 1
                return
            ups = place(rel, e, e + 1)
            label = self._label("paused")

            async def go() -> tuple[str, BaseException | None]:
                self.faults.pause()
                try:
                    task = asyncio.ensure_future(
                        self._attempt(
                            w.handle.compare_and_append(as_table(self.schema, ups), e, e + 1), w
                        )
                    )
                    for _ in range(1000):
                        if self.faults.waiting or task.done():
                            break
                        await asyncio.sleep(0.001)
                    # Only a cancellation (armed, or by faults before the hold) ends it early.
                    assert not task.done() or isinstance(task.result()[1], _Interrupted), (
                        "a write finished while its location was paused"
                    )
                finally:
                    self.faults.resume()
                return await task

            outcome, exc = self.run(go())
            if outcome == _Outcome.OK:
                self.model.compare_and_append(ups, e, e + 1, label)
            elif outcome == _Outcome.MISMATCH:
                raise AssertionError(f"refused a write at the right upper: {exc}")
            elif outcome == _Outcome.DETERMINATE:
                assert not self.run(self._resolve(w.client, e, e + 1, unsure=False))
            elif self.run(self._resolve(w.client, e, e + 1)):
                self.model.compare_and_append(ups, e, e + 1, label)

    @rule(index=_PICK)
    def fetch_recent_upper(self, index: int) -> None:
        with self.step("fetch_recent_upper"):
            w = self._writer(index)
            if w is None:
                self.stats.skipped += 1
                return
            try:
                got = self.run(self._call(w.handle.fetch_recent_upper(), w))
            except ExternalError as exc:
                assert exc.determinate, f"a read failed indeterminately: {exc}"
                self._note(_classify(exc))
                return
            except _Interrupted:
                return
            assert got == self.model.upper, (got, self.model.upper)

    # --- reading -------------------------------------------------------------------------------

    def _readable_readers(self, margin: int = 0) -> list[_Reader]:
        """Readers that can read as of their since (+ ``margin``) right now."""
        return [
            r
            for r in self.readers
            if r.handle.since is not None and self.model.readable(r.handle.since + margin)
        ]

    def _as_of(self, since: int, offset: int, margin: int = 0) -> int:
        """A time in ``[since, upper - 1 - margin]`` (or up to ``since + 5`` past a None upper)."""
        upper = self.model.upper
        top = since + 5 if upper is None else upper - 1 - margin
        return since + offset % (top - since + 1)

    @rule(index=_PICK, offset=st.integers(0, 7), n=st.integers(0, 3))
    def snapshot(self, index: int, offset: int, n: int) -> None:
        with self.step("snapshot"):
            r = self._reader(index)
            if r is None:
                self.stats.skipped += 1
                return
            handle = r.handle
            since = handle.since
            assert since is not None
            as_of = self._as_of(since, offset)
            other = self.clients[(r.client + 1) % len(self.clients)]

            async def read() -> dict[Row, int]:
                if n == 0:
                    table = await handle.snapshot_and_fetch(as_of)
                    return contents_of(table, self.columns, as_of)
                splits = await handle.snapshot(as_of, n)
                assert len(splits) == n
                rows: list[Update] = []
                for s in splits:
                    # Another process fetches each split from its bytes.
                    table = await other.fetch_split(Split.from_bytes(s.to_bytes()))
                    part = contents_of(table, self.columns, as_of)
                    rows += [(row, as_of, d) for row, d in part.items()]
                return {row: d for (row, _), d in consolidate(rows).items()}

            try:
                got = self.run(self._call(read(), r))
            except ExternalError as exc:
                assert exc.determinate, f"a read failed indeterminately: {exc}"
                self._note(_classify(exc))
                return
            except _Interrupted:
                return
            assert got == self.model.contents_as_of(as_of), f"contents as of {as_of} differ"
            self.stats.reads_checked += 1

    @precondition(lambda self: self.plan.cancel_calls)
    @rule(index=_PICK, offset=st.integers(0, 7))
    def split_outlives_a_cancelled_downgrade(self, index: int, offset: int) -> None:
        """A split stays fetchable while its reader holds since at or below its as_of: a
        ``downgrade_since`` past it, cancelled before it committed, must not drop the hold."""
        with self.step("split_outlives_a_cancelled_downgrade"):
            r = self._reader(index)
            if r is None:
                self.stats.skipped += 1
                return
            since = r.handle.since
            assert since is not None
            as_of = self._as_of(since, offset)
            other = self.clients[(r.client + 1) % len(self.clients)]
            with self.faults.suspended():
                try:
                    (split,) = self.run(self._call(r.handle.snapshot(as_of), r))
                except _Interrupted:
                    return
            # Cancelled at its commit, before it runs (not after k iterations, which could land
            # after the commit): it certainly did not happen.
            self.armed = None
            try:
                self.run(
                    self._call(
                        r.handle.downgrade_since(as_of + 1),
                        r,
                        cancel_at="consensus.compare_and_set",
                    )
                )
            except ExternalError as exc:
                self._note(_classify(exc))
                if not exc.determinate:
                    self._downgrade(r, as_of + 1)  # settles it; the split is no longer held
                    return
            except _Interrupted:
                pass
            if r not in self.readers:
                return
            if r.handle.since != since:
                # It met no commit to cancel, and moved: the split is no longer held.
                assert r.handle.since == as_of + 1, (r.handle.since, as_of + 1)
                return
            # A heartbeat (the same since) records the reader's holds again.
            if self._downgrade(r, since) is None:
                return
            with self.faults.suspended():
                for c in self.clients:
                    self.run(c.maintain(self.shard_id))
                table = self.run(other.fetch_split(Split.from_bytes(split.to_bytes())))
            got = contents_of(table, self.columns, as_of)
            assert got == self.model.contents_as_of(as_of), "a held split lost its contents"
            self.stats.reads_checked += 1

    @rule(index=_PICK, offset=st.integers(0, 7))
    def listen(self, index: int, offset: int) -> None:
        with self.step("listen"):
            # Listening from as_of needs an upper above as_of + 1 to hear anything.
            r = self._reader(index, margin=1)
            if r is None:
                self.stats.skipped += 1
                return
            since = r.handle.since
            assert since is not None
            as_of = self._as_of(since, offset, margin=1)
            try:
                got = self.run(self._call(self._listen_all(r.handle, as_of), r))
            except ExternalError as exc:
                assert exc.determinate, f"a read failed indeterminately: {exc}"
                self._note(_classify(exc))
                return
            except _Interrupted:
                return
            expected = self.model.updates_between(as_of + 1, self.model.upper)
            assert got == expected, "listen differs"
            self.stats.listens_checked += 1

    @rule(index=_PICK, backwards=st.integers(0, 5), offset=st.integers(0, 3))
    def downgrade_since(self, index: int, backwards: int, offset: int) -> None:
        with self.step("downgrade_since"):
            r = self._pick(self.readers, index)
            if r is None:
                self.stats.skipped += 1
                return
            since = r.handle.since
            assert since is not None
            if since > 0 and backwards == 0:
                with contextlib.suppress(InvalidUsage):
                    self.run(r.handle.downgrade_since(since - 1))
                    raise AssertionError("since moved backwards")
                assert r.handle.since == since
                return
            # Keep since below the upper, so the shard stays readable as of it.
            upper = self.model.upper
            top = since + 3 if upper is None else max(since, upper - 1)
            new = min(since + offset, top)
            self._downgrade(r, new)

    def _downgrade(self, r: _Reader, new: int) -> bool | None:
        """``r.handle.downgrade_since(new)`` under test, settled by retrying it: whether it
        moved (None: unknown, or the reader expired after a stall; it is no longer used)."""
        since = r.handle.since
        unsure = False
        for _ in range(self.resolve_attempts):
            try:
                self.run(self._call(r.handle.downgrade_since(new), r))
            except (ExternalError, _Interrupted) as exc:
                if r not in self.readers:
                    return None  # expired after a stall: its since is released
                if isinstance(exc, ExternalError):
                    self._note(_classify(exc))
                    unsure = unsure or not exc.determinate
                else:
                    unsure = True  # cancelled: it may have moved
                # The heartbeat may have learned that an earlier try landed.
                assert r.handle.since == since or (unsure and r.handle.since == new)
                if not unsure:
                    return False  # certainly did not happen
                continue  # it may have moved: retrying the same downgrade settles it
            assert r.handle.since == new
            if unsure:
                self.stats.resolved_by_retry += 1
            return new != since
        # Still unknown: this reader's since in the shard is either value, and the handle
        # can't tell which. Stop using it; it stays registered, holding at most ``new``.
        self.readers.remove(r)
        self.ghosts.append(new)
        self.since_exact = False
        return None

    # --- cancellations and stalls ---------------------------------------------------------------

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
            # Readers of closed clients stopped heartbeating long ago: registered or expired,
            # they can only hold since lower than the live readers do.
            self.ghosts = []
            self.since_exact = False

    def _handles(self) -> list[_Writer | _Reader]:
        return [*self.writers, *self.readers]

    def _heartbeat(self, h: _Writer | _Reader) -> bool:
        """Renews ``h``'s lease by using it; False when it had expired (it is dropped)."""
        try:
            if isinstance(h, _Writer):
                # The shard's upper, not the model's: a write in doubt may have moved it.
                upper = self.run(self._read_upper(h.client))
                if upper is None:
                    return True  # a finished shard takes no heartbeat; its writers are idle
                empty = as_table(self.schema, [])
                self.run(self._call(h.handle.compare_and_append(empty, upper, upper), h))
            else:
                self.run(self._call(h.handle.downgrade_since(h.handle.since), h))
        except _Interrupted:
            return False
        return True

    @precondition(lambda self: self.plan.stalls)
    @rule(data=st.data(), index=_PICK)
    def lost_reply_then_stall(self, data: st.DataObject, index: int) -> None:
        """The lethal sequence: a write lands but its reply is lost, the writer's process
        stalls past its lease (others may expire it), then it retries the same write. No data
        may be lost, the shard must keep opening, and a read of the upper settles it."""
        with self.step("lost_reply_then_stall"):
            rel = self._updates(data, "updates")
            w = self._writer(index)
            e = self.model.upper
            if w is None or e is None:
                self.stats.skipped += 1
                return
            self.stats.lost_reply_then_stall += 1
            ups = place(rel, e, e + 1)
            table = as_table(self.schema, ups)
            label = self._label("lost-reply")
            outcome, exc = self.run(
                self._attempt(
                    w.handle.compare_and_append(table, e, e + 1),
                    w,
                    lose="consensus.compare_and_set",
                )
            )
            self._stall(w.client)
            if outcome == _Outcome.OK:
                self.model.compare_and_append(ups, e, e + 1, label)
            elif outcome == _Outcome.MISMATCH:
                raise AssertionError(f"refused a write at the right upper {e}: {exc}")
            else:
                # Determinate or not, retrying the same write settles it.
                self._retry_until_known(w, table, ups, e, e + 1, label)
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

    # --- maintenance ---------------------------------------------------------------------------

    @rule(i=st.integers(0, 1))
    def maintain(self, i: int) -> None:
        with self.step("maintain"):
            try:
                done = self.run(
                    self._call(self.clients[i % len(self.clients)].maintain(self.shard_id), None)
                )
            except ExternalError as exc:
                self._note(_classify(exc))
                return
            except _Interrupted:
                return
            assert isinstance(done, dict)

    @invariant()
    def cached_uppers_are_not_ahead(self) -> None:
        for w in self.writers:
            cached, upper = w.handle.upper, self.model.upper
            assert upper is None or (cached is not None and cached <= upper), (cached, upper)


def shard_machine(
    location: LocationFactory,
    *,
    plan: FaultPlan = FaultPlan(),
    config: PersistConfig | None = None,
    stats: MachineStats | None = None,
    name: str = "ShardMachineOn",
) -> type[ShardMachine]:
    """A ``ShardMachine`` subclass running on ``location`` with faults drawn from ``plan``.

    ``stats`` (a fresh ``MachineStats`` by default, at ``cls.stats``) sums what its examples did.
    """
    attrs: dict[str, Any] = {
        "location": staticmethod(location),
        "plan": plan,
        "config": config or machine_config(),
        "stats": stats or MachineStats(),
    }
    return type(name, (ShardMachine,), attrs)


def run_shard_machine(
    location: LocationFactory,
    *,
    max_examples: int,
    steps: int = 30,
    plan: FaultPlan = FaultPlan(),
    config: PersistConfig | None = None,
    stats: MachineStats | None = None,
    hypothesis_settings: settings | None = None,
    name: str = "ShardMachineOn",
) -> MachineStats:
    """Runs ``max_examples`` examples of up to ``steps`` steps; returns what they did.

    ``name`` names the machine class, which keys Hypothesis's example database: give each
    location its own, so a failure saved on one is not replayed on another.
    """
    machine = shard_machine(location, plan=plan, config=config, stats=stats, name=name)
    base = hypothesis_settings or settings(deadline=None)
    for attempt in range(3):
        started = machine.stats.examples
        try:
            run_state_machine_as_test(
                machine,
                settings=settings(base, max_examples=max_examples, stateful_step_count=steps),
            )
            break
        except SystemError as exc:
            # CPython 3.11 can fail ast.parse with this in threaded programs (gh-106905);
            # Hypothesis parses the machine's source before the first example. Only that
            # spurious failure, before any example ran, is tried again.
            spurious = "AST constructor recursion depth mismatch" in str(exc)
            if not spurious or machine.stats.examples != started or attempt == 2:
                raise
    return machine.stats
