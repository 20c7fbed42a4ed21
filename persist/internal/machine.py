"""A shard's state as one client knows it, and the one place where changes are committed.

``Machine.apply(transition)`` is the retry-CAS loop that joins the pure state machine
(``core.shard.transitions``) to consensus: run the transition on the cached state, encode its diff,
compare-and-set it at ``seqno + 1``; on a mismatch fetch the diffs that won and run the transition
again. An indeterminate failure of the CAS is handled the same way: the state is re-read and the
transition re-run. That is safe because two CAS with the same expected seqno can never both land,
and transitions that must not happen twice (``compare_and_append``) recognise their own earlier
commit by a token. When to sleep and when to give up is ``retry.CasRetry``, the rule the
catalog's compare-and-set loop follows too.

Every handle of a client on one shard shares one ``Machine``, so a commit by one handle is seen by
the others (and wakes their ``listen``) at once. Changes by other processes are pushed, once
someone has waited, by ``Consensus.watch`` where the consensus can (a push that carries the next
diff is applied without a read); a slow poll of ``head`` covers lost pushes, and where nothing is
pushed a waiter polls ``head`` every ``poll_interval_s``.

State versions: diffs live in consensus under the shard id; full rollups live in blob. Every diff
names the latest rollup, so the current state is the rollup named by the head diff plus the diffs
after it. A rollup is written in the background every ``rollup_interval`` versions.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from persist.config import PersistConfig, read_clock
from persist.core.shard import codec, keys
from persist.core.shard.clock import Clock, Now, held_back
from persist.core.shard.diff import StateDiff, apply_diff
from persist.core.shard.transitions import Break, Outcome, add_rollup, create_shard
from persist.core.shard.types import RollupRef, State, empty_state
from persist.errors import (
    ExternalError,
    IntegrityError,
    InvalidUsage,
    PersistError,
    UpperMismatch,
    WrongBlobLocation,
)
from persist.ids import new_id
from persist.internal.appends import NextAppends
from persist.internal.batch import RecentParts
from persist.internal.retry import CasRetry, Tries, retry_idempotent
from persist.internal.tasks import Tasks
from persist.location import Blob, Consensus, backoff_delays
from persist.metrics import on as metrics_on

log = logging.getLogger("persist")

R = TypeVar("R")
# A transition run ahead of its commit: the state it ran on, its outcome, the encoded diff.
_Planned = tuple[State, Outcome[R], bytes]

_SCAN_LIMIT = 1024
_INLINE_DECODE_BYTES = 64 * 1024


async def fetch_current(
    blob: Blob,
    consensus: Consensus,
    cfg: PersistConfig,
    shard_id: str,
    cached: State | None = None,
) -> State | None:
    """The latest state of a shard (None if it was never created): latest rollup + later diffs,
    or, from ``cached`` (a state of the shard read earlier), only the diffs after it unless
    they were truncated away. ``WrongBlobLocation`` when ``blob`` holds nothing of a shard that
    consensus has. The bytes are read first, then decoded and replayed in one go.

    Garbage collection may delete the rollup, or truncate the diffs after it, between our reads
    when a newer rollup lands meanwhile: then this starts over from the new head. Only tries that
    saw the head stand still count against the retry budget: a busy shard whose rollups keep
    moving is not an error, a head naming a rollup that stays missing is.
    """
    delays = iter(backoff_delays(cfg.retry_initial_delay_s, cfg.retry_attempts))
    last_seen: int | None = None
    while True:
        head = ref = data = None
        if cached is None:
            head = await retry_idempotent(
                functools.partial(consensus.head, shard_id),
                cfg.retry_attempts,
                cfg.retry_initial_delay_s,
            )
            if head is None:
                return None
            ref = codec.decode_diff(head.data).latest_rollup
            data = await retry_idempotent(
                functools.partial(blob.get, ref.key), cfg.retry_attempts, cfg.retry_initial_delay_s
            )
        entries = None
        if cached is not None:
            entries = await _entries_after(consensus, cfg, shard_id, cached.seqno)
        elif ref is not None and data is not None:
            entries = await _entries_after(consensus, cfg, shard_id, ref.seqno)
        if entries is None:
            # No rollup, or the diffs after what we hold were truncated: a newer rollup took
            # over (garbage collection), unless the head stands still.
            cached = None
            if head is None:
                continue
            if head.seqno != last_seen:
                last_seen = head.seqno
                continue
            delay = next(delays, None)
            if delay is None:
                raise await _rollup_lost(blob, cfg, shard_id)
            await asyncio.sleep(delay)
            continue
        if cached is None:
            assert data is not None and ref is not None
            cached = await _decode_rollup(data, ref, shard_id)
        return codec.replay(cached, entries)


async def _rollup_lost(blob: Blob, cfg: PersistConfig, shard_id: str) -> PersistError:
    """Why the rollup the head names stays missing."""
    # The blob location that holds a shard always holds a rollup of it (a newer one is written
    # before an older one is deleted; a tombstone keeps its last). A blob holding no key of the
    # shard at all was never its location: another location shares this consensus.
    held = await retry_idempotent(
        functools.partial(blob.list_keys, keys.shard_prefix(shard_id)),
        cfg.retry_attempts,
        cfg.retry_initial_delay_s,
    )
    if not held:
        return WrongBlobLocation(
            f"shard {shard_id} belongs to another blob location: this consensus holds its "
            f"state, but this blob location holds nothing of it, not even the rollup its state "
            f"names; connect with the blob location it was created through (if this is that "
            f"one, the shard's data here was deleted)"
        )
    return IntegrityError(f"shard {shard_id}: the rollup named by the latest state is missing")


async def _decode_rollup(data: bytes, ref: RollupRef, shard_id: str) -> State:
    # A rollup holds every batch of the shard: decode big ones off the event loop.
    if len(data) > _INLINE_DECODE_BYTES:
        state = await asyncio.to_thread(codec.decode_rollup, data)
    else:
        state = codec.decode_rollup(data)
    if state.shard_id != shard_id or state.seqno != ref.seqno:
        raise IntegrityError(f"rollup {ref.key} holds {state.shard_id}@{state.seqno}")
    return state


async def _entries_after(
    consensus: Consensus, cfg: PersistConfig, shard_id: str, seqno: int
) -> list[tuple[int, bytes]] | None:
    """The shard's stored diffs after ``seqno``, as ``(seqno, frame)``, read page by page;
    None when those right after it were truncated away (the caller reloads from a rollup)."""
    out: list[tuple[int, bytes]] = []
    while True:
        start = seqno + 1 + len(out)
        page = await retry_idempotent(
            functools.partial(consensus.scan, shard_id, start, _SCAN_LIMIT),
            cfg.retry_attempts,
            cfg.retry_initial_delay_s,
        )
        if page and page[0].seqno != start:
            return None
        out.extend((e.seqno, e.data) for e in page)
        if len(page) < _SCAN_LIMIT:
            return out


class Machine:
    """The cached state of one shard and the commit loop for it."""

    def __init__(
        self,
        shard_id: str,
        blob: Blob,
        consensus: Consensus,
        cfg: PersistConfig,
        tasks: Tasks,
        recent: RecentParts | None = None,
    ) -> None:
        self.shard_id = str(shard_id)  # plain str: it is encoded into state
        self.blob = blob
        # The parts this client wrote lately (shared by the client's machines), for its readers.
        self.recent = recent
        self.consensus = consensus
        self.cfg = cfg
        self.tasks = tasks
        # The append_next calls of this client's handles, committed in groups.
        self.next_appends = NextAppends(tasks, self.shard_id)
        self._state: State | None = None
        self._lock = asyncio.Lock()
        self._changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._poll: asyncio.Task[None] | None = None
        # Consensus is asked to push this shard's changes when someone first waits; what
        # ends that watch, None while not asked or when consensus can't push.
        self._asked_to_push = False
        self.stop_watching: Callable[[], None] | None = None
        self._last_push = 0.0
        # A push came in while a poll was in flight, which may have read too early to see it.
        self._poll_again = False
        self._rollup: asyncio.Task[Any] | None = None
        # Consensus entries below this seqno are known to be truncated (by this client).
        self.truncated_below = 0
        # The handles this client registered, and since when (by our clock) each handle in the
        # state has shown its current heartbeat: what lets a commit judge leases despite
        # clock skew (see core.shard.clock.Clock).
        self.own: set[str] = set()
        # Of those, the ones this client answers for: it registered them and did not hand them
        # to another process (``LeasedHandle.detach``). ``close`` expires them, and
        # ``drop_shard`` needs no force for them. Ids, not handles: a registration whose
        # open was cancelled before its handle existed is let go as well.
        self.registered: set[str] = set()
        # handle id -> (its heartbeat, when we first saw that heartbeat, its lease)
        self._watch: dict[str, tuple[int, int, int]] = {}
        self._warned_skew_ms = 0
        # Called after each commit that is not housekeeping: whoever runs this shard's
        # maintenance learns that some may be due.
        self.on_commit: Callable[[], None] | None = None

    @property
    def loaded(self) -> bool:
        return self._state is not None

    @property
    def state(self) -> State:
        if self._state is None:
            raise RuntimeError("the machine has not loaded its shard")
        return self._state

    def _set(self, state: State) -> None:
        if self._state is not None and state.seqno <= self._state.seqno:
            return
        self._state = state
        self._watch_heartbeats(state)
        changed, self._changed = self._changed, asyncio.get_running_loop().create_future()
        changed.set_result(None)

    def _watch_heartbeats(self, state: State) -> None:
        try:
            now = read_clock(self.cfg)
        except InvalidUsage:
            return  # commits will refuse this clock; there is nothing to measure with
        watch = {}
        for handles in (state.writers, state.readers):
            for hid, h in handles.items():
                seen = self._watch.get(hid)
                if seen is None or seen[0] != h.last_heartbeat_ms:
                    seen = (h.last_heartbeat_ms, now, h.lease_duration_ms)
                watch[hid] = seen
        self._watch = watch

    def _clock(self, state: State) -> Clock:
        """Now, with what this client may conclude about other clients' leases (``state`` is
        the cached state, whose handles ``_watch`` follows)."""
        now = read_clock(self.cfg)
        watched = frozenset(
            hid for hid, (_, since, lease) in self._watch.items() if now - since > lease
        )
        clock = Clock(now, frozenset(self.own), watched, guarded=True)
        kept = held_back(state, clock)
        if kept and now - self._warned_skew_ms > self.cfg.lease_duration_ms:
            self._warned_skew_ms = now
            # Most often their processes are simply gone (closed a while ago): nothing is
            # wrong, so this is no warning. Only a clock running ahead looks the same.
            log.info(
                "persist: shard %s: %d handle(s) stopped heartbeating more than a lease ago, "
                "longer than any other handle: expiring them once this client has watched "
                "them idle for a lease (their processes are gone, or this clock runs ahead)",
                self.shard_id,
                len(kept),
            )
        return clock

    async def load(self) -> State | None:
        """Loads the latest state; None when the shard was never created."""
        state = await fetch_current(self.blob, self.consensus, self.cfg, self.shard_id)
        if state is not None:
            self._set(state)
        return state

    async def load_or_create(self, schema: bytes) -> State:
        """The latest state, creating the shard with ``schema`` if it does not exist yet."""
        if await self.load() is not None:
            return self.state
        base = empty_state(self.shard_id)
        ref = RollupRef(1, keys.rollup_key(self.shard_id, 1, new_id("v")))
        out = create_shard(base, schema, ref, read_clock(self.cfg), self.cfg.retention_ms)
        assert not isinstance(out, Break)  # a fresh state is always created
        first = apply_diff(base, out.diff)
        await retry_idempotent(
            lambda: self.blob.set(ref.key, codec.encode_rollup(first)),
            self.cfg.retry_attempts,
            self.cfg.retry_initial_delay_s,
        )
        won: bool | None
        try:
            won = await self.consensus.compare_and_set(
                self.shard_id, None, codec.encode_diff(out.diff)
            )
        except ExternalError:
            won = None  # re-read below: either our creation landed or someone else's did
        if won:
            self._set(first)
            return first
        state = await self.load()
        if state is None:
            raise ExternalError(f"shard {self.shard_id} could not be created", determinate=False)
        # Only a certain loss frees the rollup: after an indeterminate failure our creation
        # may have landed, its rollup since retired by a newer one that readers may still be
        # reading; the orphan sweep deletes it once it is certainly unreferenced.
        if won is False and state.rollups.get(1) != ref:
            await self.blob.delete(ref.key)
        return state

    async def refresh(self) -> State:
        """Brings the cached state up to date with consensus."""
        state = await fetch_current(
            self.blob, self.consensus, self.cfg, self.shard_id, cached=self.state
        )
        if state is None:
            raise IntegrityError(f"shard {self.shard_id} vanished from consensus")
        self._set(state)
        return self.state

    async def apply(
        self,
        transition: Callable[[State, Now], Outcome[R]],
        *,
        housekeeping: bool = False,
        tries: Tries | None = None,
        ready: Callable[[], Awaitable[None]] | None = None,
    ) -> R:
        """Runs ``transition`` against the latest state and commits its diff.

        Raises the transition's refusal, or ``ExternalError`` when consensus keeps failing:
        indeterminate if any try may have committed without this call learning it. A refusal
        that comes after such a try is raised as an indeterminate ``ExternalError`` (caused by
        the refusal), since the change may be in the shard all the same; ``UpperMismatch`` is
        the exception: a write's token tells its own landed try from a mismatch.
        ``tries`` (optional) records what the tries may have done, for callers that clean up.

        A ``housekeeping`` commit (garbage collection forgetting what it deleted) neither kicks
        maintenance nor makes a rollup due: it follows from them, and with a small rollup
        interval each would otherwise set off the other forever.

        ``ready`` (optional) is what must be done before anything is committed: the writes of
        the parts the change names. It runs first, and the transition is run against the
        cached state meanwhile; that outcome is committed as it is if the state is still the
        one it was run on, so that a small append's commit costs only its CAS after its fsync
        or PUT. Raising or cancelled, ``ready`` has settled (its writes landed or never will)
        before this raises, and nothing was committed.
        """
        planned = None
        if ready is not None:
            planned = await self._plan_while(ready, transition)
        async with self._lock:
            return await self._apply_locked(transition, housekeeping, tries or Tries(), planned)

    async def _plan_while(
        self, ready: Callable[[], Awaitable[None]], transition: Callable[[State, Now], Outcome[R]]
    ) -> _Planned[R] | None:
        """Runs ``ready`` to its end, planning ``transition`` while it is out on I/O."""
        pending = asyncio.ensure_future(ready())
        try:
            await asyncio.sleep(0)  # its first step: the I/O is handed to a thread
            state = self.state
            out = transition(state, self._clock(state))
            planned = None if isinstance(out, Break) else (state, out, codec.encode_diff(out.diff))
            await pending
        except BaseException:
            # Cancelled while awaiting it, ``pending`` was cancelled too and has settled.
            if not pending.done():
                pending.cancel()
                await asyncio.wait([pending])
            if not pending.cancelled():
                pending.exception()  # retrieved: the first error is the one raised
            raise
        return planned

    async def _apply_locked(
        self,
        transition: Callable[[State, Now], Outcome[R]],
        housekeeping: bool,
        tries: Tries,
        planned: _Planned[R] | None = None,
    ) -> R:
        rule = CasRetry(self.cfg.retry_attempts, self.cfg.retry_initial_delay_s)
        refreshed = False
        started = time.monotonic()
        with rule.settling():
            while True:
                state = self.state
                if planned is not None and planned[0] is state:
                    # Planned on this very state while the change's data was written.
                    _, out, data = planned
                    planned = None
                else:
                    planned, data = None, None
                    out = transition(state, self._clock(state))
                if isinstance(out, Break):
                    if out.error is None:
                        return out.result  # type: ignore[return-value]
                    if refreshed:
                        if rule.uncertain and not isinstance(out.error, UpperMismatch):
                            raise ExternalError(
                                f"the change may have been committed before it was refused: "
                                f"{out.error}",
                                determinate=False,
                            ) from out.error
                        raise out.error
                    # The cache may be stale: a refusal is only given on the latest state.
                    await self.refresh()
                    refreshed = True
                    continue
                if data is None:
                    data = codec.encode_diff(out.diff)
                try:
                    won = await self.consensus.compare_and_set(self.shard_id, state.seqno, data)
                except asyncio.CancelledError:
                    # Settled (the location's promise) but unknown to us: it may have landed.
                    tries.maybe_committed = True
                    tries.last_seqno = max(tries.last_seqno, state.seqno + 1)
                    raise
                except ExternalError as exc:
                    if not exc.determinate:
                        tries.maybe_committed = tries.unsettled = True
                        tries.last_seqno = max(tries.last_seqno, state.seqno + 1)
                    delay = rule.failed(exc)
                    if delay is None:
                        raise
                    self._log_retry(state.seqno + 1, exc, rule, delay)
                    await asyncio.sleep(delay)
                    try:
                        await self.refresh()
                        refreshed = True
                    except ExternalError:
                        refreshed = False
                    continue
                if won:
                    self._set(apply_diff(state, out.diff))
                    _log_commit(self.shard_id, out.diff, rule.races, time.monotonic() - started)
                    if not housekeeping:
                        self._maybe_rollup()
                        if self.on_commit is not None:
                            self.on_commit()
                    if out.error is not None:
                        raise out.error
                    return out.result
                rule.lost_race()
                await self.refresh()
                refreshed = True

    def _log_retry(self, seqno: int, exc: ExternalError, rule: CasRetry, delay: float) -> None:
        if (counted := metrics_on()) is not None:
            counted.retries.inc()
        log.info(
            "persist: shard %s: commit at seqno %d failed (%s); retry %d of %d in %.2f s",
            self.shard_id,
            seqno,
            exc,
            rule.failures,
            rule.retries,
            delay,
        )

    # --- waiting for changes -----------------------------------------------------------------

    async def wait_for(self, ready: Callable[[State], bool]) -> State:
        """Waits until ``ready(state)``, waking on local commits and on pushed or polled remote
        ones."""
        if ready(self.state):
            return self.state
        pushed = self._watching()
        interval = self.cfg.push_poll_interval_s if pushed else self.cfg.poll_interval_s
        while not ready(self.state):
            changed = self._changed
            try:
                await asyncio.wait_for(asyncio.shield(changed), interval)
            except TimeoutError:
                # While pushes arrive, a lost one shows as a gap in the next one's seqno (and
                # that push polls): only a silent channel needs the fallback poll.
                if not pushed or time.monotonic() - self._last_push >= interval:
                    await self.poll()
        return self.state

    def _watching(self) -> bool:
        """Whether consensus pushes this shard's changes, asking it to on the first call."""
        if not self._asked_to_push:
            self._asked_to_push = True
            self.stop_watching = self.consensus.watch(self.shard_id, self._on_push)
            if self.stop_watching is not None:
                # What committed between our last read and the watch taking effect.
                self._poll_soon()
        return self.stop_watching is not None

    def _on_push(self, seqno: int | None, data: bytes | None) -> None:
        self._last_push = time.monotonic()
        state = self._state
        if state is None or self.tasks.closed or (seqno is not None and seqno <= state.seqno):
            return
        if data is not None and seqno == state.seqno + 1:
            # The next diff itself: apply it here instead of reading it back. Anything odd
            # about it falls back to a read, which checks everything.
            try:
                diff = codec.decode_diff(data)
                if diff.seqno_to == seqno:
                    self._set(apply_diff(state, diff))
                    return
            except Exception as exc:  # a bad push must not break the loop: read instead
                log.debug("persist: reading a pushed change of %s: %s", self.shard_id, exc)
        self._poll_again = True
        self._poll_soon()

    def _poll_soon(self) -> None:
        task = self._poll
        if task is None or task.done():
            self._poll = self.tasks.spawn(self._poll_once(), f"poll {self.shard_id}")

    async def poll(self) -> None:
        """Checks consensus ``head`` for a newer version (one check in flight per shard)."""
        self._poll_soon()
        task = self._poll
        if task is None:
            raise InvalidUsage("the persist client was closed")
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self.tasks.closed:
                raise InvalidUsage("the persist client was closed") from None
            raise

    async def _poll_once(self) -> None:
        while True:
            self._poll_again = False
            head = await self.consensus.head(self.shard_id)
            if head is not None and head.seqno > self.state.seqno:
                await self.refresh()
            if not self._poll_again:
                return

    # --- rollups -----------------------------------------------------------------------------

    def rollup_due(self) -> bool:
        state = self.state
        return state.seqno - state.latest_rollup.seqno >= self.cfg.rollup_interval

    def _maybe_rollup(self) -> None:
        if self.rollup_due() and (self._rollup is None or self._rollup.done()):
            self._rollup = self.tasks.spawn(self.write_rollup(), f"rollup {self.shard_id}")

    async def write_rollup(self) -> bool:
        """Writes a rollup of the current state and records it; False if a newer one won."""
        state = self.state
        ref = RollupRef(state.seqno, keys.rollup_key(self.shard_id, state.seqno, new_id("v")))
        data = await asyncio.to_thread(codec.encode_rollup, state)
        await retry_idempotent(
            lambda: self.blob.set(ref.key, data),
            self.cfg.retry_attempts,
            self.cfg.retry_initial_delay_s,
        )
        tries = Tries()
        try:
            added = await self.apply(lambda s, now: add_rollup(s, ref, now), tries=tries)
        except ExternalError as exc:
            if exc.determinate:
                await self.blob.delete(ref.key)
            raise
        # A try that may have landed may have been superseded by a newer rollup since, which
        # retired ours while readers can still use it: the orphan sweep takes it in time.
        if not added and not tries.maybe_committed:
            await self.blob.delete(ref.key)
        return added

    def rolling_up(self) -> bool:
        """Whether a background rollup is in flight."""
        return self._rollup is not None and not self._rollup.done()

    async def rollup_settled(self) -> None:
        """Waits for a background rollup in flight (its failure is the task's to log)."""
        if self._rollup is not None and not self._rollup.done():
            await asyncio.gather(self._rollup, return_exceptions=True)


# A commit slower than this (all its tries) is logged as a warning.
SLOW_COMMIT_S = 5.0


def _log_commit(shard_id: str, diff: StateDiff, races: int, took_s: float) -> None:
    """What a commit changed, at DEBUG (WARNING when slow); expiries of leases at INFO."""
    expired = [w for w, at in diff.expired_writers if at is not None]
    counted = metrics_on()
    if counted is not None:
        counted.commits.inc()
        counted.commit_seconds.observe(took_s)
        counted.lost_races.inc(races)
        counted.leases_expired.inc(len(expired))
    if expired:
        log.info("persist: shard %s: writer(s) %s expired", shard_id, ", ".join(expired))
    slow = took_s >= SLOW_COMMIT_S
    if not slow and not log.isEnabledFor(logging.DEBUG):
        return
    what = []
    if diff.upper:
        what.append(f"upper {diff.upper[-1]}")
    if diff.since:
        what.append(f"since {diff.since[-1]}")
    added = sum(1 for _, b in diff.batches if b is not None)
    removed = len(diff.batches) - added
    if added or removed:
        what.append(f"batches +{added}/-{removed}")
    for name, ops in (("writer", diff.writers), ("reader", diff.readers)):
        gone = [k for k, v in ops if v is None]
        if len(ops) > len(gone):
            what.append(f"{len(ops) - len(gone)} {name}(s) registered or renewed")
        if gone:
            what.append(f"{name}(s) {', '.join(gone)} gone")
    log.log(
        logging.WARNING if slow else logging.DEBUG,
        "persist: shard %s: committed seqno %d (%s) in %.1f ms%s",
        shard_id,
        diff.seqno_to,
        ", ".join(what) or "no change but time",
        took_s * 1000,
        f" after {races} lost race(s)" if races else "",
    )
