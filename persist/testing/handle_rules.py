"""The shard machine's rules on handles and clients: open and expire writers and readers,
restart a client (as a crash would), run maintenance."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import rule

from persist.core.frontier import frontier_le
from persist.errors import ExternalError, LeaseExpired
from persist.testing.driver import PICK, MachineBase, Reader, Writer
from persist.testing.judge import Interrupted, Outcome, Told
from persist.testing.strategies import as_table

__all__ = ["HandleRules"]

H = TypeVar("H", Writer, Reader)


class HandleRules(MachineBase):
    @rule(i=st.integers(0, 1))
    def open_writer(self, i: int) -> None:
        with self.step("open_writer"):
            client = i % len(self.clients)
            w = self._ask(self.clients[client].open_writer(self.shard_id, self.schema, "w"), None)
            if isinstance(w, Told):
                return  # if interrupted, it may be registered: unused, it expires with its lease
            self.writers.append(Writer(w, client, self.stalls))

    @rule(i=st.integers(0, 1))
    def open_reader(self, i: int) -> None:
        with self.step("open_reader"):
            client = i % len(self.clients)
            call = self.clients[client].open_leased_reader(self.shard_id, self.schema, "r")
            r = self._ask(call, None)
            if isinstance(r, Told):
                if r.outcome is Outcome.INDETERMINATE:
                    self.since_exact = False  # it may be registered, holding the since
                return
            bound = self._since_bound()
            since = r.since
            if self.retention_ms is None:
                assert since is not None and bound is not None
            else:
                # A sealed shard's window lets everything go: the since may be None.
                assert since is not None or self.model.upper is None, since
            assert frontier_le(self.last_open_since, since), "the shard's since went backwards"
            assert frontier_le(since, bound), (since, bound)
            if self.since_exact:
                assert since == bound, (since, bound)
            self.last_open_since = since
            self.readers.append(Reader(r, client, self.stalls))

    @rule(index=PICK)
    def expire_writer(self, index: int) -> None:
        with self.step("expire_writer"):
            empty = as_table(self.schema, [])
            self._expire(
                self.writers,
                index,
                lambda w: w.handle.compare_and_append(empty, 0, 0),
                "an expired writer kept writing",
            )

    @rule(index=PICK)
    def expire_reader(self, index: int) -> None:
        with self.step("expire_reader"):
            self._expire(
                self.readers,
                index,
                lambda r: r.handle.snapshot(0),
                "an expired reader kept reading",
            )

    def _expire(
        self, pool: list[H], index: int, use: Callable[[H], Coroutine[Any, Any, Any]], kept: str
    ) -> None:
        """Forgets the handle of ``pool`` that ``index`` picks and expires it under test; after
        that, ``use`` of it must raise ``LeaseExpired``."""
        h = self._pick(pool, index)
        if h is None:
            self.stats.skipped += 1
            return
        pool.remove(h)
        try:
            self.run(self._call(h.handle.expire(), h))
        except ExternalError:
            if isinstance(h, Reader):
                self._may_linger(h.handle.since)
        except Interrupted:
            # A cancelled expire may not have begun: the lease runs out unused; a reader,
            # registered or not, is unused now.
            if isinstance(h, Reader):
                self._may_linger(h.handle.since)
            return
        with contextlib.suppress(LeaseExpired):
            self.run(use(h))
            raise AssertionError(kept)

    @rule(i=st.integers(0, 1))
    def restart_client(self, i: int) -> None:
        """Closes a client without expiring its handles (as a crash would) and opens a new one."""
        with self.step("restart_client"):
            client = i % len(self.clients)
            # Else the close would expire them: a crash leaves them to their leases.
            for w in self.writers:
                if w.client == client:
                    w.handle.detach()
            for r in self.readers:
                if r.client == client:
                    r.handle.detach()
            self.run(self.clients[client].close())
            self.writers = [w for w in self.writers if w.client != client]
            self.ghosts += [r.handle.since for r in self.readers if r.client == client]
            self.readers = [r for r in self.readers if r.client != client]
            self.clients[client] = self.run(self._new_client())

    @rule(i=st.integers(0, 1))
    def maintain(self, i: int) -> None:
        with self.step("maintain"):
            done = self._ask(self.clients[i % len(self.clients)].maintain(self.shard_id), None)
            if not isinstance(done, Told):
                assert isinstance(done, dict)
