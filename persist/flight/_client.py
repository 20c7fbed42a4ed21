"""``StreamingWriter``: a thin Python client of one streaming-write DoExchange call."""

from __future__ import annotations

import collections
import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

from persist.core.stream.durability import TIER_NAMES as TIERS
from persist.errors import InvalidUsage, PersistError

__all__ = ["StreamingWriter"]

_RANK = {name: i for i, name in enumerate(TIERS)}
# How many LSNs that reached the top tier a writer remembers one by one (see ``_retire``).
_DONE_WINDOW = 100_000


class StreamingWriter:
    """Writes to one shard over a ``persist serve`` streaming-write call.

    ``write(table)`` sends one write (its rows: the shard's columns, optionally ``_diff``) and
    returns its LSN (its position in the server's log of the shard, not a shard time) as soon
    as the server took it (``MEMORY``). Later tiers (``LOCAL_DISK``, ``OBJECT_STORAGE``,
    ``COMMITTED``: visible to reads) are reported as they are reached: wait for one with
    ``wait_durable`` or ``write_durable``, or be called back with ``on_durable``; once a write is
    ``COMMITTED``, ``committed_at(lsn)`` is the shard time a snapshot must be ``as_of`` (or
    past) to hold it. ``close()`` (or leaving a ``with`` block) ends the call once every write
    reached the top tier asked for (``levels``, default all).

    With ``writer_id``, every write needs its own ``seq`` (``write(table, seq=n)``: a source
    offset, say) and ``reconnect()`` opens a new call and resends what was not yet
    ``LOCAL_DISK``: the server takes each ``(writer_id, seq)`` once (across reconnects, server
    restarts and servers) and refuses a resend whose rows differ. Thread-safe; callbacks run on
    the writer's ack thread and must not block.
    """

    def __init__(
        self,
        uri: str,
        shard: str,
        *,
        token: str | None = None,
        writer_id: str | None = None,
        levels: list[str] | None = None,
        tls_root_certs: bytes | None = None,
    ) -> None:
        if levels is not None:
            unknown = [x for x in levels if x not in _RANK]
            if unknown:
                raise InvalidUsage(f"unknown durability level(s) {unknown}; they are {TIERS}")
        self._uri = uri
        self._shard = str(shard)
        self._writer_id = writer_id
        self._levels = levels
        kwargs: dict[str, Any] = {}
        if tls_root_certs is not None:
            kwargs["tls_root_certs"] = tls_root_certs
        self._client = fl.FlightClient(uri, **kwargs)
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._options = fl.FlightCallOptions(headers=headers)
        self._top = max((_RANK[x] for x in levels or TIERS), default=0)
        self._cond = threading.Condition()
        # Writes sent on the current call and not yet MEMORY-acked, in order: [seq, batch, lsn].
        self._unacked: collections.deque[list[Any]] = collections.deque()
        # Named writes not yet LOCAL_DISK (resent by reconnect): seq -> [seq, batch, lsn].
        self._not_on_disk: dict[int, list[Any]] = {}
        self._lsn_seq: dict[int, int] = {}
        # lsn -> highest tier rank reported, until the top tier: then the LSN moves to the
        # window of done ones, and below that window every LSN of this writer is done.
        self._reached: dict[int, int] = {}
        self._done: collections.deque[int] = collections.deque()
        self._done_set: set[int] = set()
        self._done_below = -1
        self._committed_at: dict[int, int] = {}
        self._callbacks: dict[tuple[int, int], list[Callable[[], None]]] = {}
        self._error: BaseException | None = None
        self._closed = False
        self._schema: pa.Schema | None = None
        self._call: _Call | None = None
        self._open()

    # --- the call --------------------------------------------------------------------------------

    def _open(self) -> None:
        command: dict[str, Any] = {"shard": self._shard, "op": "streaming_write"}
        if self._writer_id is not None:
            command["writer_id"] = self._writer_id
        if self._levels is not None:
            command["levels"] = self._levels
        descriptor = fl.FlightDescriptor.for_command(json.dumps(command).encode())
        writer, reader = self._client.do_exchange(descriptor, self._options)
        thread = threading.Thread(target=self._read_acks, args=(reader,), daemon=True)
        self._call = _Call(writer, reader, thread)
        thread.start()

    def _read_acks(self, reader: Any) -> None:
        try:
            for chunk in reader:
                metadata = chunk.app_metadata
                info = json.loads(metadata.to_pybytes()) if metadata is not None else {}
                if "error" in info:
                    self._failed(info["error"])
                    return
                self._acked(chunk.data, info.get("committed_at") or {})
        except Exception as exc:
            with self._cond:
                if self._call is not None and self._call.reader is reader:
                    self._error = _as_persist(exc)
                self._cond.notify_all()
            return
        with self._cond:
            self._cond.notify_all()

    def _failed(self, payload: dict[str, Any]) -> None:
        """The server ended the call with an error it sent in band (say the shard was
        dropped): every wait fails with it now, and the call's sending side is closed so that
        the server can end the call."""
        error = _from_payload(payload, RuntimeError(str(payload)))
        with self._cond:
            if self._error is None:
                self._error = error
            call = self._call
            self._cond.notify_all()
        if call is not None:
            with contextlib.suppress(Exception):
                call.done_writing()

    def _acked(self, batch: pa.RecordBatch, committed_at: dict[str, int]) -> None:
        lsns = batch.column(0).to_pylist()
        tiers = batch.column(1).to_pylist()
        updates = batch.column(2).to_pylist()
        fire: list[Callable[[], None]] = []
        with self._cond:
            for lsn, tier, update in zip(lsns, tiers, updates, strict=True):
                rank = _RANK[tier]
                if not update:
                    entry = self._unacked.popleft()
                    entry[2] = lsn
                    if entry[0] is not None:
                        self._lsn_seq[lsn] = entry[0]
                if rank == _RANK["COMMITTED"] and str(lsn) in committed_at:
                    self._committed_at[lsn] = int(committed_at[str(lsn)])
                if rank > self._rank_of(lsn):
                    self._reached[lsn] = rank
                    for r in range(rank + 1):
                        fire.extend(self._callbacks.pop((lsn, r), ()))
                    if rank >= self._top:
                        self._retire(lsn)
                if rank >= _RANK["LOCAL_DISK"]:
                    seq = self._lsn_seq.pop(lsn, None)
                    if seq is not None:
                        self._not_on_disk.pop(seq, None)
            self._cond.notify_all()
        for callback in fire:
            callback()

    def _rank_of(self, lsn: int) -> int:
        """The highest tier ``lsn`` is known to have reached (-1: none)."""
        if lsn in self._reached:
            return self._reached[lsn]
        if lsn in self._done_set or lsn < self._done_below:
            return self._top
        return -1

    def _retire(self, lsn: int) -> None:
        """``lsn`` reached the top tier: it is kept in a window of done LSNs (the oldest leave
        it, and every LSN below the window counts as done), so a long-lived writer's memory
        stays flat."""
        self._reached.pop(lsn, None)
        self._done.append(lsn)
        self._done_set.add(lsn)
        while len(self._done) > _DONE_WINDOW:
            old = self._done.popleft()
            self._done_set.discard(old)
            self._done_below = max(self._done_below, old + 1)
            self._committed_at.pop(old, None)

    # --- writing ---------------------------------------------------------------------------------

    def _send(self, entry: list[Any]) -> None:
        call = self._call
        assert call is not None
        batch: pa.RecordBatch = entry[1]
        metadata = json.dumps({"seq": entry[0]}).encode() if entry[0] is not None else None
        # Before the write, so that its ack finds it; the ack thread takes it under ``_cond``,
        # which is held here.
        self._unacked.append(entry)
        if not call.write(batch, metadata):
            self._unacked.pop()
            self._check()
            raise InvalidUsage("the StreamingWriter's call has ended")

    def write(self, table: pa.Table | pa.RecordBatch, *, seq: int | None = None) -> int:
        """Sends one write; returns its LSN once the server took it (``MEMORY``).

        With a ``writer_id``, each write must be named by ``seq`` (a source offset, say): a seq
        already taken under this writer id, by any process or server, is a replay, acked as the
        write it names and not applied again; one whose rows differ is refused with
        ``InvalidUsage``. Numbers a client chose itself would collide with another instance's
        after a restart, so there is no default."""
        batch = _one_batch(table)
        if seq is not None and (
            self._writer_id is None or isinstance(seq, bool) or not isinstance(seq, int) or seq < 0
        ):
            raise InvalidUsage("seq is a non-negative int, and needs the writer's writer_id")
        if seq is None and self._writer_id is not None:
            raise InvalidUsage(
                f"writer {self._writer_id!r} names its writes: pass seq= (a number that names "
                f"this write's data, such as its source offset) with every write"
            )
        with self._cond:
            self._check()
            if self._schema is None:
                self._schema = batch.schema
            elif batch.schema != self._schema:
                raise InvalidUsage("every write of a StreamingWriter has the first one's schema")
            entry: list[Any] = [seq, batch, None]
            if seq is not None:
                self._not_on_disk[seq] = entry
            self._send(entry)
            while entry[2] is None:
                self._check()
                self._cond.wait(0.1)
            lsn: int = entry[2]
            return lsn

    def write_durable(
        self, table: pa.Table | pa.RecordBatch, level: str = "COMMITTED", *, seq: int | None = None
    ) -> int:
        """``write``, then waits until the write reached ``level``."""
        lsn = self.write(table, seq=seq)
        self.wait_durable(lsn, level)
        return lsn

    def on_durable(self, lsn: int, level: str, callback: Callable[[], None]) -> None:
        """Calls ``callback()`` once ``lsn`` reached ``level`` (at once if it has)."""
        rank = self._rank(level)
        with self._cond:
            if self._rank_of(lsn) < rank:
                self._callbacks.setdefault((lsn, rank), []).append(callback)
                return
        callback()

    def wait_durable(
        self, lsn: int, level: str = "COMMITTED", timeout: float | None = None
    ) -> None:
        """Waits until ``lsn`` reached ``level``; ``TimeoutError`` after ``timeout`` seconds."""
        rank = self._rank(level)
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._rank_of(lsn) >= rank or self._error is not None, timeout
            )
            if self._rank_of(lsn) >= rank:
                return
            self._check()
            if not ok:
                raise TimeoutError(f"LSN {lsn} did not reach {level} within {timeout} s")

    def committed_at(self, lsn: int) -> int | None:
        """The shard time the write at ``lsn`` is visible at (a snapshot ``as_of`` it holds the
        write), once it is ``COMMITTED``; None before, or when its ack did not say (a writer
        that did not ask for ``COMMITTED``). Kept for the latest 100,000 writes."""
        with self._cond:
            return self._committed_at.get(lsn)

    def _rank(self, level: str) -> int:
        if level not in _RANK:
            raise InvalidUsage(f"unknown durability level {level!r}; they are {TIERS}")
        rank = _RANK[level]
        if rank > self._top:
            raise InvalidUsage(f"{level} is not among the levels this writer asked for")
        return rank

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise InvalidUsage("the StreamingWriter was closed")

    # --- ending and reconnecting ---------------------------------------------------------------

    def close(self) -> None:
        """Ends the call: waits until every write reached the top tier asked for."""
        with self._cond:
            if self._closed or self._call is None:
                return
            self._closed = True
            call = self._call
        try:
            call.done_writing()
        finally:
            call.thread.join()
            try:
                call.writer.close()
            except fl.FlightError as exc:
                if self._error is None:
                    self._error = _as_persist(exc)
        if self._error is not None:
            raise self._error

    def reconnect(self) -> None:
        """A new call in place of the current one (say the server restarted); with a
        ``writer_id``, resends every write not yet ``LOCAL_DISK`` (the server dedups them)."""
        with self._cond:
            old = self._call
            self._call = None
        if old is not None:
            with contextlib.suppress(Exception):  # the old call may be gone already
                old.reader.cancel()
            old.thread.join(10)
        with self._cond:
            self._error = None
            self._unacked.clear()
            self._open()
            for seq in sorted(self._not_on_disk):
                self._send(self._not_on_disk[seq])

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass
class _Call:
    """One DoExchange call: its sending side, its reading side, and the thread reading acks."""

    writer: Any
    reader: Any
    thread: threading.Thread
    begun: bool = False
    finished: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, batch: pa.RecordBatch, metadata: bytes | None) -> bool:
        """Sends ``batch`` (its stream begun by the first); False once the sending side is
        closed. Never beside ``done_writing`` (``lock``)."""
        with self.lock:
            if self.finished:
                return False
            if not self.begun:
                self.writer.begin(batch.schema)
                self.begun = True
            if metadata is None:
                self.writer.write_batch(batch)
            else:
                self.writer.write_with_metadata(batch, pa.py_buffer(metadata))
            return True

    def done_writing(self) -> None:
        """Closes the sending side, once, and never beside a write (``lock``). Both the thread
        reading acks (the server failed the call in band) and ``close`` close it: two of gRPC's
        sending operations at once abort the whole process ("API misuse ... too many
        operations": a CI rehearsal's fault harness died so)."""
        with self.lock:
            if self.finished:
                return
            self.finished = True
            self.writer.done_writing()


def _one_batch(table: pa.Table | pa.RecordBatch) -> pa.RecordBatch:
    if isinstance(table, pa.RecordBatch):
        return table
    if not isinstance(table, pa.Table):
        raise InvalidUsage(f"a write is a pyarrow Table or RecordBatch, not {type(table).__name__}")
    batches = table.combine_chunks().to_batches()
    if not batches:
        return pa.RecordBatch.from_pylist([], schema=table.schema)
    return batches[0]


def _as_persist(exc: BaseException) -> BaseException:
    """A persist error from the JSON payload of a Flight error, when it carries one."""
    extra = getattr(exc, "extra_info", None)
    if not extra:
        return exc
    try:
        payload = json.loads(extra)
    except (ValueError, UnicodeDecodeError):
        return exc
    return _from_payload(payload, exc)


def _from_payload(payload: Any, otherwise: BaseException) -> BaseException:
    """The persist error a JSON error payload names (``otherwise`` if it names none)."""
    import persist

    if not isinstance(payload, dict):
        return otherwise
    name = payload.get("error")
    message = payload.get("message", str(otherwise))
    cls = getattr(persist, str(name), None)
    if name == "UpperMismatch":
        return persist.UpperMismatch(payload.get("expected"), payload.get("current"))
    if name == "SchemaChanged":
        return persist.SchemaChanged(int(payload["expected"]), int(payload["current"]))
    if isinstance(cls, type) and issubclass(cls, persist.ExternalError):
        return cls(message, determinate=bool(payload.get("determinate")))
    if isinstance(cls, type) and issubclass(cls, PersistError):
        return cls(message)
    return otherwise
