"""The shard machine's rules that read: the upper, snapshots (whole, or in splits that the
other client fetches), listens, and moving a reader's since (``downgrade_since``).

A read changes nothing, so there is nothing to judge: it must answer what the model says, or
fail determinately (or be interrupted)."""

from __future__ import annotations

import contextlib
import datetime

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from persist.errors import InvalidUsage
from persist.internal.fetch import Split
from persist.testing.driver import PICK, Reader
from persist.testing.handle_rules import HandleRules
from persist.testing.judge import Interrupted, Outcome, Told
from persist.testing.model import Row, Update, consolidate, contents_of

__all__ = ["ReadRules"]


class ReadRules(HandleRules):
    """Extends the handle rules: a read opens a reader (``open_reader``) when none can read."""

    def _readable_readers(self, margin: int = 0) -> list[Reader]:
        """Readers that can read as of their since (+ ``margin``) right now."""
        return [
            r
            for r in self.readers
            if r.handle.since is not None and self.model.readable(r.handle.since + margin)
        ]

    def _reader(self, index: int, margin: int = 0) -> Reader | None:
        """A reader that can read as of its since (+ ``margin``), opening one when none can."""
        pool = self._readable_readers(margin)
        if not pool:
            self.open_reader(index)
            pool = self._readable_readers(margin)
        return self._pick(pool, index)

    def _as_of(self, since: int, offset: int, margin: int = 0) -> int:
        """A time in ``[since, upper - 1 - margin]`` (or up to ``since + 5`` past a None upper)."""
        upper = self.model.upper
        top = since + 5 if upper is None else upper - 1 - margin
        return since + offset % (top - since + 1)

    @rule(index=PICK)
    def fetch_recent_upper(self, index: int) -> None:
        with self.step("fetch_recent_upper"):
            w = self._writer(index)
            if w is None:
                self.stats.skipped += 1
                return
            got = self._ask(w.handle.fetch_recent_upper(), w, read=True)
            if not isinstance(got, Told):
                assert got == self.model.upper, (got, self.model.upper)

    @rule(index=PICK, offset=st.integers(0, 7), n=st.integers(0, 3))
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
                seen: set[Row] = set()
                for s in splits:
                    # Another process fetches each split from its bytes.
                    table = await other.fetch_split(Split.from_bytes(s.to_bytes()))
                    part = contents_of(table, self.columns, as_of)
                    # Cut by key: no row is in two splits, so each is exact on its own.
                    assert not seen & part.keys(), "a row is in two splits"
                    seen |= part.keys()
                    rows += [(row, as_of, d) for row, d in part.items()]
                return {row: d for (row, _), d in consolidate(rows).items()}

            got = self._ask(read(), r, read=True)
            if isinstance(got, Told):
                return
            assert got == self.model.contents_as_of(as_of), f"contents as of {as_of} differ"
            self.stats.reads_checked += 1

    @precondition(lambda self: self.retention_ms is not None)
    @rule(index=PICK, back=st.sampled_from([0, 10, 100, 250, 500]))
    def snapshot_at_an_instant(self, index: int, back: int) -> None:
        """Wall-clock time travel within the retention: whatever readers did (and however the
        clock jumped), the time ``as_of_at`` names for an instant in the newer half of the
        window is at or above the since, so a new reader reads it, exactly."""
        # Faults off for this rule's calls: what it checks is retention under stalls and races
        # (the other rules read under faults).
        with self.step("snapshot_at_an_instant"), self.faults.suspended():
            assert self.retention_ms is not None
            # An instant in the newer half of the window, after the shard was created.
            now = self.clock()
            when_ms = now - (now - max(self.created_ms, now - self.retention_ms // 2)) * back // 500
            when = datetime.datetime.fromtimestamp(when_ms / 1000, tz=datetime.UTC)
            client = self.clients[index % len(self.clients)]
            try:
                as_of = self._ask(client.as_of_at(self.shard_id, when), None, read=True)
            except InvalidUsage as exc:
                # Nothing written at that instant, or the shard younger than it: fine. The
                # since having passed it is what retention forbids.
                assert "no longer readable" not in str(exc), str(exc)
                self.stats.skipped += 1
                return
            if isinstance(as_of, Told) or not self.model.readable(as_of):
                return
            opened = len(self.readers)
            self.open_reader(index)
            if len(self.readers) == opened:
                return  # the open failed (faults): nothing was learned
            reader = self.readers[-1]
            since = reader.handle.since
            assert since is not None and since <= as_of, (since, as_of, "retention let go")
            got = self._ask(reader.handle.snapshot_and_fetch(as_of), reader, read=True)
            if isinstance(got, Told):
                return
            contents = contents_of(got, self.columns, as_of)
            assert contents == self.model.contents_as_of(as_of), f"contents as of {as_of} differ"
            self.stats.reads_checked += 1
            self.stats.instants_checked += 1

    @precondition(lambda self: self.plan.cancel_calls)
    @rule(index=PICK, offset=st.integers(0, 7))
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
                except Interrupted:
                    return
            # Cancelled at its commit, before it runs (not after k iterations, which could land
            # after the commit): it certainly did not happen.
            self.armed = None
            told = self._ask(
                r.handle.downgrade_since(as_of + 1), r, cancel_at="consensus.compare_and_set"
            )
            # An ExternalError in doubt (not a cancellation, which came before the commit).
            if (
                isinstance(told, Told)
                and told.outcome is Outcome.INDETERMINATE
                and not told.interrupted
            ):
                self._downgrade(r, as_of + 1)  # settles it; the split is no longer held
                return
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

    @rule(index=PICK, offset=st.integers(0, 7))
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
            got = self._ask(self._listen_all(r.handle, as_of), r, read=True)
            if isinstance(got, Told):
                return
            expected = self.model.updates_between(as_of + 1, self.model.upper)
            assert got == expected, "listen differs"
            self.stats.listens_checked += 1

    @rule(index=PICK, backwards=st.integers(0, 5), offset=st.integers(0, 3))
    def downgrade_since(self, index: int, backwards: int, offset: int) -> None:
        with self.step("downgrade_since"):
            r = self._pick(self.readers, index)
            since = None if r is None else r.handle.since
            if r is None or since is None:
                # None: no reader, or one of a finished shard whose since the retention moved
                # to the empty frontier before it registered (it holds nothing to move).
                self.stats.skipped += 1
                return
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

    def _downgrade(self, r: Reader, new: int) -> bool | None:
        """``r.handle.downgrade_since(new)`` under test, settled by retrying it: whether it
        moved (None: unknown, or the reader expired after a stall; it is no longer used)."""
        since = r.handle.since
        unsure = False
        for _ in range(self.resolve_attempts):
            told = self._ask(r.handle.downgrade_since(new), r)
            if isinstance(told, Told):
                if r not in self.readers:
                    return None  # expired after a stall: its since is released
                # Cancelled, or failed indeterminately: it may have moved.
                unsure = unsure or told.outcome is Outcome.INDETERMINATE
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
        # can't tell which. Stop using it; it stays registered, holding at most ``new`` (its
        # client's close leaves it so too).
        r.handle.detach()
        self.readers.remove(r)
        self.ghosts.append(new)
        self.since_exact = False
        return None
