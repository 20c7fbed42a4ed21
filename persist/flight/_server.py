"""``FlightServer``: persist's shards behind Arrow Flight.

Two halves, two kinds of thread. pyarrow's Flight server (``_Service``) takes calls on gRPC's
own threads; every piece of persist work hops from there onto the server's one asyncio event
loop (``FlightServer``'s methods) and the gRPC thread waits for it, polling its call for a
cancellation. The loop does no blocking work: Parquet decoding runs in persist's worker threads
as everywhere, and Arrow IPC encoding, gRPC I/O and a DoPut's reading of its stream stay on the
gRPC thread. A DoGet stream asks the loop for its next batch while gRPC sends the current one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

import persist
from persist.client import PersistClient, connect
from persist.config import PersistConfig
from persist.core.frontier import frontier_le
from persist.core.updates import DIFF, TIME, full_schema
from persist.errors import InvalidUsage, LeaseExpired, PersistError
from persist.fetch import Split
from persist.flight._metrics import TIERS, Metrics
from persist.flight._protocol import (
    ACTIONS,
    ExchangeCommand,
    ListenCommand,
    PutCommand,
    SnapshotCommand,
    TicketInvalid,
    action_body,
    exchange_command,
    flight_error,
    info_command,
    put_command,
)
from persist.flight._stream import (
    ACK_SCHEMA,
    TIER_NAMES,
    Call,
    Room,
    ShardStream,
    check_levels,
    recovered_writes,
    writer_id_of,
)
from persist.flight._tickets import TicketBody, TicketSigner
from persist.ids import ShardId, new_id
from persist.read import ReadHandle
from persist.write import WriteHandle

__all__ = ["ENV_TOKEN", "FlightServer"]

T = TypeVar("T")

ENV_TOKEN = "PERSIST_FLIGHT_TOKEN"

# How often a waiting gRPC thread looks whether its call was cancelled (or its deadline passed).
_POLL_S = 0.1
# A DoGet of a snapshot decodes about this much of its split at a time (bounded memory).
_CHUNK_BYTES = 16 << 20
# Messages of a DoGet are cut to about this many bytes (zero-copy slices of decoded batches).
_MESSAGE_BYTES = 8 << 20
# A listen moves its reader's since up to what it delivered at most this often (each move is a
# consensus write); in between, compaction may be held back by at most this long.
_DOWNGRADE_EVERY_S = 1.0


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(eq=False)
class _Grant:
    """What one GetFlightInfo handed out: its tickets name it, and its reader holds the since
    at ``as_of`` until the tickets expire and no DoGet of them is running."""

    id: str
    shard: str
    reader: ReadHandle
    schema: pa.Schema  # full: data columns + _time + _diff
    expires_ms: int
    splits: tuple[Split, ...] = ()
    listen: ListenCommand | None = None
    streams: int = 0
    expired: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class _Info:
    schema: pa.Schema
    tickets: list[bytes]
    expires_ms: int
    total_bytes: int


class _Pull:
    """One DoGet's async generator, advanced on the loop, with at most one step in flight."""

    def __init__(self, agen: AsyncIterator[tuple[pa.RecordBatch, bytes | None]]) -> None:
        self._agen = agen
        self._ahead: asyncio.Task[tuple[pa.RecordBatch, bytes | None] | None] | None = None

    async def _step(self) -> tuple[pa.RecordBatch, bytes | None] | None:
        try:
            return await self._agen.__anext__()
        except StopAsyncIteration:
            return None

    async def advance(self) -> tuple[pa.RecordBatch, bytes | None] | None:
        """The next item (None at the end); the one after it starts at once. Cancelling this
        cancels the step it waits for."""
        task = self._ahead or asyncio.ensure_future(self._step())
        self._ahead = None
        item = await task
        if item is not None:
            self._ahead = asyncio.ensure_future(self._step())
        return item

    async def close(self) -> None:
        if self._ahead is not None:
            self._ahead.cancel()
            await asyncio.gather(self._ahead, return_exceptions=True)
        aclose = getattr(self._agen, "aclose", None)
        if aclose is not None:
            await aclose()


class FlightServer:
    """Serves the shards of one location (blob + consensus) over Arrow Flight.

    ``async with FlightServer(blob, consensus, port=0) as server:`` starts it on the running
    event loop (``server.uri`` is where it listens) and stops it on exit; or call ``start`` and
    ``stop``. Keywords are the flags of ``persist serve`` (``shared/spec/flight.md``); ``token``
    defaults to ``$PERSIST_FLIGHT_TOKEN``. ``wal_dir``, ``commit_interval_ms``, ``commit_bytes``
    and ``max_buffer_bytes`` configure streaming writes.
    """

    def __init__(
        self,
        blob: str | None = None,
        consensus: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        wal_dir: str | os.PathLike[str] | None = None,
        commit_interval_ms: float = 50.0,
        commit_bytes: int = 8 << 20,
        max_buffer_bytes: int = 64 << 20,
        ticket_ttl_s: float = 300.0,
        metrics_port: int | None = None,
        config: PersistConfig | None = None,
    ) -> None:
        if not isinstance(host, str) or not host:
            raise InvalidUsage(f"host must be a host name or address, not {host!r}")
        for name, value in (("port", port), ("metrics_port", metrics_port)):
            if value is None and name == "metrics_port":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536:
                raise InvalidUsage(f"{name} must be an int in [0, 65535], not {value!r}")
        if (tls_cert is None) != (tls_key is None):
            raise InvalidUsage("TLS needs both tls_cert and tls_key")
        for name, num in (
            ("commit_interval_ms", commit_interval_ms),
            ("ticket_ttl_s", ticket_ttl_s),
        ):
            if isinstance(num, bool) or not isinstance(num, int | float) or not 0 < num < 1e9:
                raise InvalidUsage(f"{name} must be a positive number, not {num!r}")
        for name, size in (("commit_bytes", commit_bytes), ("max_buffer_bytes", max_buffer_bytes)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise InvalidUsage(f"{name} must be a positive number of bytes, not {size!r}")
        token = token if token is not None else os.environ.get(ENV_TOKEN) or None
        if token is not None and (not isinstance(token, str) or not token.isprintable()):
            raise InvalidUsage("the token must be printable text")
        self._blob, self._consensus, self._config = blob, consensus, config
        self._host, self._port = host, port
        self._token = token
        self._tls = (Path(tls_cert), Path(tls_key)) if tls_cert and tls_key else None
        self.wal_dir = Path(wal_dir) if wal_dir is not None else Path("persist-data") / "wal"
        self.commit_interval_ms = float(commit_interval_ms)
        self.commit_bytes = commit_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self._ttl_ms = int(ticket_ttl_s * 1000)
        self._metrics_port = metrics_port

        self.metrics = Metrics(self._lag)
        self._signer = TicketSigner()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: PersistClient | None = None
        self._service: _Service | None = None
        self._grants: dict[str, _Grant] = {}
        self._writers: dict[str, WriteHandle] = {}
        self._writer_locks: dict[str, asyncio.Lock] = {}
        self._shard_streams: dict[str, ShardStream] = {}
        self.room = Room(max_buffer_bytes)
        self._background: set[asyncio.Task[Any]] = set()
        # Futures of calls that wait without bound (listens, snapshots of a future as_of): a
        # drain cancels them at once; other calls get a grace period.
        self._waits: set[concurrent.futures.Future[Any]] = set()
        self._streams: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        self._draining = False
        self._stopped: asyncio.Event | None = None
        self.uri = ""
        self.metrics_uri: str | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> FlightServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        if self._service is None:
            raise InvalidUsage("the server is not started")
        return int(self._service.port)

    async def start(self) -> None:
        """Connects to the location and starts accepting calls (``uri`` is then set)."""
        if self._loop is not None:
            raise InvalidUsage("the server was already started")
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._client = await connect(self._blob, self._consensus, config=self._config)
        try:
            await self._recover()
        except BaseException:
            await self._close_backends()
            raise
        tls: list[fl.CertKeyPair] = []
        scheme = "grpc"
        if self._tls is not None:
            cert, key = await asyncio.to_thread(lambda: [p.read_bytes() for p in self._tls or ()])
            tls = [fl.CertKeyPair(cert=cert, key=key)]
            scheme = "grpc+tls"
        try:
            # Binding and starting gRPC's threads blocks: off the loop.
            self._service = await asyncio.to_thread(
                _Service,
                self,
                f"{scheme}://{self._host}:{self._port}",
                tls,
                {"persist": _CallMiddlewareFactory(self._token, self.metrics)},
            )
            if self._metrics_port is not None:
                port = await asyncio.to_thread(self.metrics.serve, self._host, self._metrics_port)
                self.metrics_uri = f"http://{_host_in_uri(self._host)}:{port}/metrics"
        except BaseException:
            await self._close_backends()
            raise
        self.uri = f"{scheme}://{_host_in_uri(self._host)}:{self._service.port}"

    async def stop(self, grace_s: float = 30.0) -> None:
        """Drains: refuses new calls, ends listens and waits at once, lets other calls finish
        (at most ``grace_s``, then cancels them), releases every reader and writer it holds."""
        if self._loop is None or self._stopped is None:
            return
        if self._draining:
            await self._stopped.wait()
            return
        self._draining = True
        self._cancel(self._waits)
        service = self._service
        if service is not None:
            # Blocks until every call in progress has returned; those calls need the loop.
            shutdown = asyncio.ensure_future(asyncio.to_thread(service.shutdown))
            done, _ = await asyncio.wait({shutdown}, timeout=grace_s)
            if not done:
                self._cancel(self._streams)
            await shutdown
        for grant in list(self._grants.values()):
            if grant.timer is not None:
                grant.timer.cancel()
            self._drop_grant(grant)
        for stream in self._shard_streams.values():
            # Whatever was taken is committed before the writer goes (else the next start
            # recovers it from the WAL).
            with contextlib.suppress(PersistError):
                await stream.flush_and_commit()
            await stream.close()
        await self._drain_background()
        await asyncio.gather(*(w.expire() for w in self._writers.values()), return_exceptions=True)
        self._writers.clear()
        await self._close_backends()
        self._stopped.set()

    async def _close_backends(self) -> None:
        if self._client is not None:
            await self._client.close()
        await asyncio.to_thread(self.metrics.close)

    def _cancel(self, futures: set[concurrent.futures.Future[Any]]) -> None:
        with self._lock:
            pending = list(futures)
        for fut in pending:
            fut.cancel()

    async def _drain_background(self) -> None:
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs cleanup that must finish even when the call that started it was cancelled."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    @property
    def client(self) -> PersistClient:
        if self._client is None:
            raise InvalidUsage("the server is not started")
        return self._client

    # --- calls from gRPC threads ---------------------------------------------------------------

    def call(
        self,
        coro: Coroutine[Any, Any, T],
        context: fl.ServerCallContext,
        *,
        registry: set[concurrent.futures.Future[Any]] | None = None,
    ) -> T:
        """Runs ``coro`` on the loop and waits for it on this (gRPC) thread; a cancelled call
        cancels it. Errors come back as the Flight errors the spec maps them to. A drain cancels
        the futures in ``registry`` (at once for ``_waits``, after its grace for ``_streams``)."""
        assert self._loop is not None
        if self._draining:
            coro.close()
            raise _shutting_down()
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        if registry is not None:
            with self._lock:
                registry.add(fut)
        try:
            while True:
                done, _ = concurrent.futures.wait((fut,), timeout=_POLL_S)
                if done:
                    break
                if context.is_cancelled():
                    fut.cancel()
                    raise fl.FlightCancelledError("the call was cancelled")
            try:
                return fut.result()
            except concurrent.futures.CancelledError:
                raise _shutting_down() from None
            except fl.FlightError:
                raise
            except Exception as exc:
                raise _translated(exc) from None
        finally:
            if registry is not None:
                with self._lock:
                    registry.discard(fut)

    def stream(
        self,
        agen: AsyncIterator[tuple[pa.RecordBatch, bytes | None]],
        context: fl.ServerCallContext,
        schema: pa.Schema,
        *,
        waits: bool,
        on_close: Callable[[], None],
    ) -> Iterator[pa.RecordBatch | tuple[pa.RecordBatch, pa.Buffer]]:
        """A DoGet's messages, pulled from an async generator on the loop one ahead of gRPC:
        the loop reads the next batch while this thread encodes and sends the current one."""
        assert self._loop is not None
        loop = self._loop
        pull = _Pull(agen)
        registry = self._waits if waits else self._streams
        try:
            while (item := self.call(pull.advance(), context, registry=registry)) is not None:
                batch, metadata = item
                if batch.schema != schema:
                    batch = pa.RecordBatch.from_arrays(batch.columns, schema=schema)
                for piece in _messages(batch, metadata is not None):
                    self.metrics.doget_rows.inc(piece.num_rows)
                    self.metrics.doget_bytes.inc(piece.nbytes)
                    yield piece if metadata is None else (piece, pa.py_buffer(metadata))
        finally:
            loop.call_soon_threadsafe(self._close_stream, pull, on_close)

    def _close_stream(self, pull: _Pull, on_close: Callable[[], None]) -> None:
        self._spawn(pull.close())
        on_close()

    # --- reads ---------------------------------------------------------------------------------

    async def flight_info(self, command: SnapshotCommand | ListenCommand) -> _Info:
        """Opens a reader holding ``as_of``, cuts the snapshot (or sets up the listen) and signs
        a ticket per endpoint."""
        client = self.client
        # The shard must exist: opening a reader without a schema says so (InvalidUsage).
        reader = await client.open_leased_reader(command.shard, purpose="persist flight tickets")
        schema = full_schema(reader.schema)
        try:
            as_of = command.as_of
            if as_of is None:
                as_of = _default_as_of(command.shard, (await client.frontiers(command.shard))[1])
            if not frontier_le(reader.since, as_of):
                raise InvalidUsage(f"as_of {as_of} is below the shard's since {reader.since}")
            splits: tuple[Split, ...] = ()
            hold = as_of
            if isinstance(command, SnapshotCommand):
                # Waits while as_of >= upper; only then may the since move up to as_of (a since
                # never moves back, and a wait that is cancelled must leave it where it was).
                cut = await reader.snapshot(as_of, command.splits)
                splits = tuple(s for s in cut if s.parts)
            else:
                _, upper = await client.frontiers(command.shard)
                hold = as_of if upper is None else min(as_of, max(upper - 1, 0))
            if reader.since is not None and reader.since < hold:
                await reader.downgrade_since(hold)
        except BaseException:
            self._spawn(reader.expire())
            raise
        expires_ms = _now_ms() + self._ttl_ms
        if isinstance(command, SnapshotCommand) and not splits:
            self._spawn(reader.expire())  # empty contents: no endpoint, nothing to hold
            return _Info(schema, [], expires_ms, 0)
        grant = _Grant(
            new_id("g"),
            command.shard,
            reader,
            schema,
            expires_ms,
            splits,
            command if isinstance(command, ListenCommand) else None,
        )
        self._grants[grant.id] = grant
        self.metrics.readers_held.inc()
        assert self._loop is not None
        grant.timer = self._loop.call_later(self._ttl_ms / 1000, self._grant_expired, grant)
        n = max(1, len(splits))
        tickets = [self._signer.sign(TicketBody(grant.id, i, expires_ms)) for i in range(n)]
        self.metrics.tickets.inc(n)
        return _Info(schema, tickets, expires_ms, sum(s.size for s in splits))

    def _grant_expired(self, grant: _Grant) -> None:
        grant.expired = True
        if grant.streams == 0:
            self._drop_grant(grant)

    def _drop_grant(self, grant: _Grant) -> None:
        if self._grants.pop(grant.id, None) is not None:
            self.metrics.readers_held.dec()
            self._spawn(grant.reader.expire())

    async def open_ticket(self, ticket: bytes) -> tuple[_Grant, int]:
        """The grant a ticket names, now counted as streaming (``release_ticket`` undoes it)."""
        body = self._signer.verify(ticket, _now_ms())
        grant = self._grants.get(body.grant)
        if grant is None or grant.expired:
            raise TicketInvalid("the ticket's reader was released; ask GetFlightInfo again")
        if body.index >= max(1, len(grant.splits)):
            raise TicketInvalid("the ticket names no endpoint of its flight")
        grant.streams += 1
        return grant, body.index

    def release_ticket(self, grant: _Grant) -> None:
        grant.streams -= 1
        if grant.expired and grant.streams == 0:
            self._drop_grant(grant)

    async def snapshot_batches(
        self, grant: _Grant, index: int
    ) -> AsyncIterator[tuple[pa.RecordBatch, bytes | None]]:
        # The updates as stored, unmerged: the spec promises that the union of all endpoints,
        # consolidated, is the contents, not that each row comes once. Row group by row group,
        # so the first batch leaves early and memory holds a chunk, not the split.
        async for batch in self.client.fetch_split_updates(grant.splits[index], _CHUNK_BYTES):
            yield batch, None

    async def listen_batches(self, grant: _Grant) -> AsyncIterator[tuple[pa.RecordBatch, bytes]]:
        """A listen under its own reader, which follows what it delivered (it never holds back
        compaction for longer than ``_DOWNGRADE_EVERY_S``); the grant's reader keeps ``as_of``
        readable for other DoGets of the ticket until it expires."""
        listen = grant.listen
        assert listen is not None
        try:
            reader = await self.client.open_leased_reader(
                grant.shard, purpose="persist flight listen"
            )
        finally:
            # From here the listen's own reader holds what it needs: the grant's may expire
            # on time, not pin as_of for as long as the listen runs.
            self.release_ticket(grant)
        try:
            if not frontier_le(reader.since, listen.as_of):
                raise InvalidUsage(
                    f"as_of {listen.as_of} is below the shard's since {reader.since}"
                )
            moved = time.monotonic()
            async for event in reader.listen(listen.as_of):
                metadata = json.dumps({"upper": event.upper}).encode()
                yield _one_batch(event.updates, grant.schema), metadata
                if event.upper is None or (
                    listen.until is not None and event.upper >= listen.until
                ):
                    return
                if time.monotonic() - moved >= _DOWNGRADE_EVERY_S:
                    await reader.downgrade_since(event.upper - 1)
                    moved = time.monotonic()
        finally:
            self._spawn(reader.expire())

    # --- writes and actions --------------------------------------------------------------------

    async def put(self, command: PutCommand, table: pa.Table) -> int | None:
        """One ``compare_and_append`` of every row of a DoPut, under the server's writer of the
        shard (created with the stream's columns if the shard is new)."""
        names = table.schema.names
        if TIME not in names:
            raise InvalidUsage(
                f"a DoPut stream needs the shard's columns, {TIME!r} (uint64) and optionally "
                f"{DIFF!r} (int64); it has {names}"
            )
        data = pa.schema([f for f in table.schema if f.name not in (TIME, DIFF)])
        self.metrics.writes.labels("do_put").inc()
        self.metrics.write_bytes.labels("do_put").inc(table.nbytes)
        stream = self._shard_streams.get(command.shard)
        if stream is None:
            return await self._put(command, table, data)
        # The server is the shard's only writer while it streams: pending streamed writes are
        # committed first, and no LSN is handed out until this append is done.
        async with stream.holding():
            await stream.flush_and_commit()
            upper = await self._put(command, table, data)
            stream.note_upper(upper)
            return upper

    async def _put(self, command: PutCommand, table: pa.Table, data: pa.Schema) -> int | None:
        for attempt in (1, 2):
            writer = await self._writer(command.shard, data)
            try:
                with self.metrics.commit():
                    await writer.compare_and_append(
                        table, command.expected_upper, command.new_upper
                    )
            except LeaseExpired:
                # The writer lapsed (the server stalled past its lease): nothing was written.
                self._writers.pop(command.shard, None)
                if attempt == 2:
                    raise
                continue
            break
        return command.new_upper

    async def _writer(self, shard: str, schema: pa.Schema) -> WriteHandle:
        writer = self._writers.get(shard)
        if writer is not None:
            return writer
        lock = self._writer_locks.setdefault(shard, asyncio.Lock())
        async with lock:
            writer = self._writers.get(shard)
            if writer is None:
                writer = await self.client.open_writer(shard, schema, purpose="persist flight")
                self._writers[shard] = writer
        return writer

    async def action(self, name: str, body: bytes) -> dict[str, Any]:
        args = action_body(name, body)
        if name == "health":
            return {"status": "ok", "version": persist.__version__}
        if name == "frontiers":
            since, upper = await self.client.frontiers(args["shard"])
            return {"since": since, "upper": upper}
        return await self.durability(args["shard"])

    async def durability(self, shard: str) -> dict[str, Any]:
        """Per tier, every LSN below it has reached the tier. Without streaming writes pending,
        every tier is the shard's upper."""
        _, upper = await self.client.frontiers(shard)
        stream = self._shard_streams.get(shard)
        if stream is None or stream.failed is not None or upper is None:
            return dict.fromkeys(TIERS, upper)
        marks = stream.durability()
        # COMMITTED is the upper itself (another process may have moved it on); a tier is never
        # behind the one after it.
        out: dict[str, Any] = {"COMMITTED": upper}
        floor = upper
        for tier in reversed(TIERS[:-1]):
            floor = max(marks[tier], floor)
            out[tier] = floor
        return {t: out[t] for t in TIERS}

    def _lag(self) -> dict[str, tuple[int, float]]:
        total: dict[str, tuple[int, float]] = {}
        for stream in list(self._shard_streams.values()):
            for tier, (n, secs) in stream.lag().items():
                m, w = total.get(tier, (0, 0.0))
                total[tier] = (m + n, max(w, secs))
        return total

    # --- streaming writes ----------------------------------------------------------------------

    async def open_exchange(self, command: ExchangeCommand) -> Call:
        """A DoExchange call's side of its shard's stream."""
        writer_id = writer_id_of(command.writer_id)
        levels = check_levels(command.levels)
        stream = await self._stream(command.shard)
        call = Call(stream, writer_id, levels)
        stream.open_call(call)
        return call

    async def _stream(self, shard: str) -> ShardStream:
        stream = self._shard_streams.get(shard)
        if stream is not None and stream.failed is None:
            return stream
        lock = self._writer_locks.setdefault(shard, asyncio.Lock())
        async with lock:
            stream = self._shard_streams.get(shard)
            if stream is None or stream.failed is not None:
                if stream is not None:
                    await stream.close()
                writer = self._writers.get(shard)
                if writer is None:
                    writer = await self.client.open_writer(shard, purpose="persist flight")
                    self._writers[shard] = writer
                await writer.fetch_recent_upper()
                stream = ShardStream(
                    shard,
                    writer,
                    self.wal_dir,
                    commit_interval_s=self.commit_interval_ms / 1000,
                    commit_bytes=self.commit_bytes,
                    room=self.room,
                    metrics=self.metrics,
                )
                self._shard_streams[shard] = stream
        return stream

    async def _recover(self) -> None:
        """Commits, at their LSNs, the writes a crashed run logged but did not commit."""
        if not await asyncio.to_thread(self.wal_dir.is_dir):
            return
        dirs = await asyncio.to_thread(lambda: sorted(self.wal_dir.iterdir()))
        for directory in dirs:
            try:
                shard = str(ShardId(directory.name))
            except InvalidUsage:
                continue
            _, writes, paths = await asyncio.to_thread(recovered_writes, directory)
            if writes:
                await self._recommit(shard, writes)
            for path in paths:
                await asyncio.to_thread(path.unlink, missing_ok=True)

    async def _recommit(self, shard: str, writes: list[tuple[int, str, int, pa.Table]]) -> None:
        writer = await self.client.open_writer(shard, purpose="persist flight")
        self._writers[shard] = writer
        upper = await writer.fetch_recent_upper()
        done = writer._stream_upper
        todo = [w for w in writes if w[0] >= done]
        lost = [w for w in todo if upper is None or w[0] < upper]
        todo = [w for w in todo if upper is not None and w[0] >= upper]
        if lost:
            print(
                f"persist flight: {len(lost)} logged write(s) of {shard} can't be committed at "
                f"their LSNs (LSN {lost[0][0]}..{lost[-1][0]}): another writer moved the upper "
                f"to {upper} past them",
                file=sys.stderr,
            )
        if not todo or upper is None:
            return
        table = pa.concat_tables([w[3] for w in todo])
        times = [w[0] for w in todo for _ in range(w[3].num_rows)]
        table = table.append_column(
            pa.field(TIME, pa.uint64(), nullable=False), pa.array(times, pa.uint64())
        )
        new_upper = todo[-1][0] + 1
        batch = await writer.batch(table, upper, new_upper)
        seqs = [(w[1], w[2], w[0]) for w in todo if w[2] >= 0]
        await writer._append_streamed(batch, upper, new_upper, seqs)
        print(
            f"persist flight: recovered {len(todo)} write(s) of {shard} from the WAL "
            f"(LSN {todo[0][0]}..{todo[-1][0]})",
            file=sys.stderr,
        )


# --- the gRPC side -------------------------------------------------------------------------------


class _Service(fl.FlightServerBase):  # type: ignore[misc]
    """pyarrow's Flight server: each method runs on a gRPC thread and hops to the loop."""

    def __init__(
        self,
        server: FlightServer,
        location: str,
        tls: list[fl.CertKeyPair],
        middleware: dict[str, fl.ServerMiddlewareFactory],
    ) -> None:
        super().__init__(location, tls_certificates=tls or None, middleware=middleware)
        self._server = server

    def get_flight_info(
        self, context: fl.ServerCallContext, descriptor: fl.FlightDescriptor
    ) -> fl.FlightInfo:
        command = _checked(info_command, descriptor)
        s = self._server
        info = s.call(s.flight_info(command), context, registry=s._waits)
        expires = pa.scalar(info.expires_ms * 1000, pa.timestamp("us", tz="UTC"))
        endpoints = [fl.FlightEndpoint(t, [], expiration_time=expires) for t in info.tickets]
        return fl.FlightInfo(info.schema, descriptor, endpoints, -1, info.total_bytes)

    def get_schema(
        self, context: fl.ServerCallContext, descriptor: fl.FlightDescriptor
    ) -> fl.SchemaResult:
        command = _checked(info_command, descriptor)
        s = self._server
        schema = s.call(s.client.shard_schema(command.shard), context)
        return fl.SchemaResult(full_schema(schema))

    def do_get(self, context: fl.ServerCallContext, ticket: fl.Ticket) -> fl.GeneratorStream:
        s = self._server
        grant, index = s.call(s.open_ticket(ticket.ticket), context)
        assert s._loop is not None
        loop = s._loop

        def release() -> None:
            s.release_ticket(grant)

        agen: AsyncIterator[tuple[pa.RecordBatch, bytes | None]]
        if grant.listen is not None:
            agen = s.listen_batches(grant)  # releases the grant once its own reader holds

            def release() -> None:
                pass

        else:
            agen = s.snapshot_batches(grant, index)
        stream = s.stream(
            agen, context, grant.schema, waits=grant.listen is not None, on_close=release
        )
        try:
            return fl.GeneratorStream(grant.schema, stream)
        except BaseException:
            loop.call_soon_threadsafe(release)
            raise

    def do_put(
        self,
        context: fl.ServerCallContext,
        descriptor: fl.FlightDescriptor,
        reader: fl.MetadataRecordBatchReader,
        writer: fl.FlightMetadataWriter,
    ) -> None:
        command = _checked(put_command, descriptor)
        # Read on this thread: decoding the stream is not the loop's work.
        table = reader.read_all()
        s = self._server
        upper = s.call(s.put(command, table), context)
        writer.write(pa.py_buffer(json.dumps({"upper": upper}).encode()))

    def do_exchange(
        self,
        context: fl.ServerCallContext,
        descriptor: fl.FlightDescriptor,
        reader: fl.MetadataRecordBatchReader,
        writer: fl.MetadataRecordBatchWriter,
    ) -> None:
        command = _checked(exchange_command, descriptor)
        s = self._server
        call = s.call(s.open_exchange(command), context)
        writer.begin(ACK_SCHEMA)

        def write(acks: list[tuple[int, int, int]]) -> None:
            writer.write_batch(_ack_batch(acks))

        acker = threading.Thread(target=_send_acks, args=(call, write), daemon=True)
        acker.start()
        room = s.room

        def stop() -> bool:
            return call.finished.is_set() or context.is_cancelled()

        try:
            while not call.finished.is_set():
                if room.held >= room.limit:
                    s.metrics.backpressure_waits.inc()
                    if not room.wait(stop):
                        break
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    call.stream.end_call(call)
                    break
                data = chunk.data
                if data is None:
                    continue  # metadata alone names no write
                metadata = chunk.app_metadata
                nbytes = data.nbytes
                room.take(nbytes)
                md = metadata.to_pybytes() if metadata is not None else None
                call.stream.accept(call, data, md, nbytes)
            while not call.finished.wait(_POLL_S):
                if context.is_cancelled():
                    raise fl.FlightCancelledError("the call was cancelled")
        finally:
            if not call.finished.is_set():
                call.stream.drop_call(call)
            acker.join()
        if call.error is not None:
            raise _translated(call.error)

    def list_actions(self, context: fl.ServerCallContext) -> list[tuple[str, str]]:
        return list(ACTIONS)

    def do_action(self, context: fl.ServerCallContext, action: fl.Action) -> list[fl.Result]:
        s = self._server
        body = action.body.to_pybytes() if action.body is not None else b""
        result = s.call(s.action(action.type, body), context)
        return [fl.Result(pa.py_buffer(json.dumps(result).encode()))]


class _CallMiddleware(fl.ServerMiddleware):  # type: ignore[misc]
    def __init__(self, metrics: Metrics, rpc: str) -> None:
        self._gauge = metrics.open_calls.labels(rpc)
        self._gauge.inc()

    def call_completed(self, exception: BaseException | None) -> None:
        self._gauge.dec()


class _CallMiddlewareFactory(fl.ServerMiddlewareFactory):  # type: ignore[misc]
    """Refuses a call without the bearer token (when the server has one); counts open calls."""

    def __init__(self, token: str | None, metrics: Metrics) -> None:
        self._expected = f"Bearer {token}".encode() if token is not None else None
        self._metrics = metrics

    def start_call(self, info: fl.CallInfo, headers: dict[str, list[str]]) -> _CallMiddleware:
        if self._expected is not None:
            given = headers.get("authorization") or headers.get("Authorization") or []
            if not any(hmac.compare_digest(v.encode(), self._expected) for v in given):
                raise fl.FlightUnauthenticatedError(
                    "persist: a bearer token is required (header authorization: Bearer <token>)"
                )
        return _CallMiddleware(self._metrics, info.method.name.lower())


# --- helpers ---------------------------------------------------------------------------------------


def _send_acks(call: Call, write: Callable[[list[tuple[int, int, int]]], None]) -> None:
    """The ack thread of a DoExchange call: sends whatever acks are queued, as one batch."""
    try:
        while call.flush(write):
            call.wait_acks(_POLL_S)
    except Exception as exc:  # the client went away: nothing more can reach it
        call.finish(exc)


_TIER_ARRAY = pa.array(TIER_NAMES, pa.utf8())


def _ack_batch(acks: list[tuple[int, int, int]]) -> pa.RecordBatch:
    cols = np.array(acks, dtype=np.int64).reshape(-1, 3)
    tiers = cols[:, 1]
    return pa.RecordBatch.from_arrays(
        [
            pa.array(cols[:, 0].astype(np.uint64), pa.uint64()),
            _TIER_ARRAY.take(pa.array(tiers)),
            pa.array(tiers != 0),
            pa.array(cols[:, 2], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        ],
        schema=ACK_SCHEMA,
    )


def _checked(parse: Callable[[fl.FlightDescriptor], T], descriptor: fl.FlightDescriptor) -> T:
    try:
        return parse(descriptor)
    except Exception as exc:
        raise _translated(exc) from None


def _translated(exc: BaseException) -> fl.FlightError:
    error = flight_error(exc)
    if isinstance(error, fl.FlightInternalError) and not isinstance(exc, persist.PersistError):
        traceback.print_exception(exc, file=sys.stderr)
    return error


def _shutting_down() -> fl.FlightUnavailableError:
    text = json.dumps({"error": "Unavailable", "message": "the server is shutting down"})
    return fl.FlightUnavailableError(f"persist: {text}", extra_info=text.encode())


def _default_as_of(shard: str, upper: int | None) -> int:
    if upper is None:
        raise InvalidUsage(f"shard {shard} is finished: give as_of")
    if upper == 0:
        raise InvalidUsage(f"shard {shard} has nothing to read yet (its upper is 0): give as_of")
    return upper - 1


def _messages(batch: pa.RecordBatch, whole: bool) -> Iterator[pa.RecordBatch]:
    """``batch`` cut into zero-copy slices of about ``_MESSAGE_BYTES`` (``whole``: one)."""
    n = batch.num_rows
    if whole or n == 0 or batch.nbytes <= _MESSAGE_BYTES:
        yield batch
        return
    step = max(1, n * _MESSAGE_BYTES // batch.nbytes)
    for start in range(0, n, step):
        yield batch.slice(start, step)


def _one_batch(table: pa.Table, schema: pa.Schema) -> pa.RecordBatch:
    """A listen event's rows as one message (its upper covers all of them)."""
    if table.num_rows == 0:
        return pa.RecordBatch.from_pylist([], schema=schema)
    batches = table.combine_chunks().to_batches()
    batch = batches[0]
    return (
        batch
        if batch.schema == schema
        else pa.RecordBatch.from_arrays(batch.columns, schema=schema)
    )


def _host_in_uri(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        print(f"persist flight: background cleanup failed: {exc!r}", file=sys.stderr)
