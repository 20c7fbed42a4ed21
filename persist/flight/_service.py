"""The gRPC half of the server: pyarrow's ``FlightServerBase``, whose methods run on gRPC's own
threads and hop onto the server's event loop for every piece of persist work (``Hops``).

A handler checks its command on its gRPC thread, then waits there for the loop, asking every
100 ms whether its call was cancelled (a client's cancel or deadline), which cancels the work.
Arrow IPC encoding, gRPC I/O and a DoPut's reading of its stream stay on the gRPC thread; a
DoGet asks the loop for its next batch while gRPC sends the current one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

import persist
from persist.bridge import Cancelled, LoopBridge
from persist.core.arrow.updates import DIFF, full_schema
from persist.core.stream.durability import TIER_NAMES
from persist.errors import InvalidUsage
from persist.flight._metrics import Metrics
from persist.flight._protocol import (
    ACK_SCHEMA,
    ACTIONS,
    SnapshotCommand,
    error_payload,
    exchange_command,
    flight_error,
    info_command,
    put_command,
)
from persist.flight._stream import CallInfo, Streams

if TYPE_CHECKING:
    from persist.client import PersistClient
    from persist.flight._reads import Reads
    from persist.flight._writes import Writes

__all__ = ["Hops", "Server", "Service", "middleware"]

T = TypeVar("T")

log = logging.getLogger("persist")
access = logging.getLogger("persist.flight.access")

# How often a waiting gRPC thread looks whether its call was cancelled (or its deadline passed).
_POLL_S = 0.1
# Messages of a DoGet are cut to about this many bytes (zero-copy slices of decoded batches).
_MESSAGE_BYTES = 8 << 20

Futures = set[concurrent.futures.Future[Any]]


class Hops:
    """gRPC threads waiting for the loop. A drain refuses new hops and cancels the futures of
    calls that wait without bound (``waits``: listens, snapshots of a future ``as_of``) at
    once, and the others (``streams``) after its grace."""

    def __init__(self, bridge: LoopBridge) -> None:
        self.bridge = bridge
        self.draining = False
        self.waits: Futures = set()
        self.streams: Futures = set()
        self._lock = threading.Lock()

    def cancel(self, futures: Futures) -> None:
        with self._lock:
            pending = list(futures)
        for fut in pending:
            fut.cancel()

    def _track(
        self, registry: Futures | None
    ) -> Callable[[concurrent.futures.Future[Any]], Callable[[], None]]:
        def track(fut: concurrent.futures.Future[Any]) -> Callable[[], None]:
            if registry is None:
                return lambda: None
            with self._lock:
                registry.add(fut)
                # A wait that starts once the drain began (a listen's next step) ends at once
                # too: the drain's cancel of ``waits`` may have come before it.
                late = self.draining and registry is self.waits
            if late:
                fut.cancel()

            def untrack() -> None:
                with self._lock:
                    registry.discard(fut)

            return untrack

        return track

    def call(
        self,
        coro: Coroutine[Any, Any, T],
        context: fl.ServerCallContext,
        *,
        registry: Futures | None = None,
    ) -> T:
        """Runs ``coro`` on the loop and waits for it on this (gRPC) thread; a cancelled call
        cancels it. Errors come back as the Flight errors the spec maps them to."""
        if self.draining:
            coro.close()
            raise _shutting_down()
        fut = self.bridge.submit(coro)
        untrack = self._track(registry)(fut)
        try:
            return self.bridge.wait(fut, context.is_cancelled, _POLL_S)
        except Exception as exc:
            raise _hop_error(exc) from None
        finally:
            untrack()

    def stream(
        self,
        agen: AsyncIterator[tuple[pa.RecordBatch, bytes | None]],
        context: fl.ServerCallContext,
        schema: pa.Schema,
        shard: str,
        metrics: Metrics,
        *,
        waits: bool,
        on_close: Callable[[], None],
    ) -> Iterator[pa.RecordBatch | tuple[pa.RecordBatch, pa.Buffer]]:
        """A DoGet's messages, pulled from an async generator on the loop one ahead of gRPC:
        the loop reads the next batch while this thread encodes and sends the current one."""
        registry = self.waits if waits else self.streams
        label = metrics.shard(shard)
        rows, nbytes = metrics.doget_rows.labels(label), metrics.doget_bytes.labels(label)
        items = self.bridge.iterate(
            agen, context.is_cancelled, ahead=True, track=self._track(registry)
        )
        try:
            while True:
                try:
                    item = next(items, None)
                except Exception as exc:
                    raise _hop_error(exc) from None
                if item is None:
                    return
                batch, metadata = item
                if batch.schema != schema:
                    batch = pa.RecordBatch.from_arrays(batch.columns, schema=schema)
                for piece in _messages(batch, metadata is not None):
                    rows.inc(piece.num_rows)
                    nbytes.inc(piece.nbytes)
                    yield piece if metadata is None else (piece, pa.py_buffer(metadata))
        finally:
            items.close()
            # A call left behind by a drain may end after the loop closed: nothing to release.
            self.bridge.call_soon(on_close)


def _hop_error(exc: Exception) -> fl.FlightError:
    """An error of a hop as the Flight error a client sees."""
    if isinstance(exc, Cancelled):
        return fl.FlightCancelledError("the call was cancelled")
    if isinstance(exc, concurrent.futures.CancelledError):
        return _shutting_down()  # the drain cancelled it
    if isinstance(exc, fl.FlightError):
        return exc
    return translated(exc)


class Server(Protocol):
    """What the service needs of the server that starts it (``FlightServer``): its parts and
    its actions. The server imports this module to start the service, so the service knows it
    only by this shape, lest the two modules import each other."""

    @property
    def client(self) -> PersistClient: ...

    @property
    def hops(self) -> Hops: ...

    @property
    def reads(self) -> Reads: ...

    @property
    def writes(self) -> Writes: ...

    @property
    def metrics(self) -> Metrics: ...

    async def action(self, name: str, body: bytes) -> Any: ...


class Service(fl.FlightServerBase):  # type: ignore[misc]
    """pyarrow's Flight server: each method runs on a gRPC thread and hops to the loop."""

    def __init__(
        self,
        server: Server,
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
        info = s.hops.call(s.reads.flight_info(command), context, registry=s.hops.waits)
        expires = pa.scalar(info.expires_ms * 1000, pa.timestamp("us", tz="UTC"))
        endpoints = [fl.FlightEndpoint(t, [], expiration_time=expires) for t in info.tickets]
        return fl.FlightInfo(
            info.schema, descriptor, endpoints, info.total_records, info.total_bytes
        )

    def get_schema(
        self, context: fl.ServerCallContext, descriptor: fl.FlightDescriptor
    ) -> fl.SchemaResult:
        command = _checked(info_command, descriptor)
        s = self._server
        schema = s.hops.call(s.client.shard_schema(command.shard), context)
        contents = isinstance(command, SnapshotCommand) and command.contents
        return fl.SchemaResult(schema if contents else full_schema(schema))

    def list_flights(
        self, context: fl.ServerCallContext, criteria: bytes
    ) -> Iterator[fl.FlightInfo]:
        """The named shards (``criteria``: a name prefix, UTF-8), each as the path descriptor
        that reads its contents: no endpoints (GetFlightInfo of the descriptor hands them out,
        holding a snapshot), ``total_bytes`` its parts' bytes."""
        s = self._server
        try:
            prefix = (criteria or b"").decode()
        except UnicodeDecodeError:
            raise translated(InvalidUsage("ListFlights criteria must be UTF-8 text")) from None
        listed = s.hops.call(s.client.list_shards(prefix), context)
        for entry in listed:
            if "error" in entry:
                continue  # a shard this server can't read has no schema to show
            schema = s.hops.call(s.client.shard_schema(entry["shard_id"]), context)
            descriptor = fl.FlightDescriptor.for_path(entry["name"])
            yield fl.FlightInfo(schema, descriptor, [], -1, entry["bytes"])

    def do_get(self, context: fl.ServerCallContext, ticket: fl.Ticket) -> fl.GeneratorStream:
        s = self._server
        reads = s.reads
        grant, index = s.hops.call(reads.open_ticket(ticket.ticket), context)

        def release() -> None:
            reads.release_ticket(grant)

        agen: AsyncIterator[tuple[pa.RecordBatch, bytes | None]]
        if grant.listen is not None:
            agen = reads.listen_batches(grant)  # releases the grant once its own reader holds

            def release() -> None:
                pass

        elif grant.contents:
            agen = reads.contents_batches(grant, index)
        else:
            agen = reads.snapshot_batches(grant, index)
        stream = s.hops.stream(
            agen,
            context,
            grant.schema,
            grant.shard,
            s.metrics,
            waits=grant.listen is not None,
            on_close=release,
        )
        try:
            return fl.GeneratorStream(grant.schema, stream)
        except BaseException:
            s.hops.bridge.call_soon(release)
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
        upper = s.hops.call(s.writes.put(command, table), context)
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
        writes = s.writes
        schema: pa.Schema | None = None
        shard = s.hops.call(writes.existing(command.shard), context)
        if shard is None:
            # A new shard takes the stream's columns: they come with the client's first write.
            schema = _checked(_data_schema, reader)
            shard = s.hops.call(writes.resolve(command.shard, schema), context)
        # The stream's columns (with the client's first write) say which version of the
        # shard's schema its writes are of: the current one or an earlier one.
        stream = _stream_schema(reader)
        # The streams are keyed by id: a name is resolved once, here.
        command = dataclasses.replace(command, shard=shard)
        call = s.hops.call(writes.open_exchange(command, schema, stream), context)
        streams = writes.streams
        writer.begin(ACK_SCHEMA)
        over = threading.Event()
        ending: list[BaseException | None] = [None]
        acker = threading.Thread(
            target=_send_acks, args=(streams, call, writer, over, ending), daemon=True
        )
        acker.start()

        def gone() -> bool:
            return over.is_set() or context.is_cancelled()

        try:
            # Between writes only ``over`` is looked at: gRPC's ``is_cancelled`` holds the GIL
            # while it takes a lock of gRPC's (25 us on average, 100 us at p99, measured), once
            # per write, and the ack threads wait for that GIL; a cancelled call fails its next
            # read anyway. A thread that waits (for room, an LSN) still asks.
            while not over.is_set() and streams.wait_room(call, gone):
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    streams.end_call(call)
                    break
                if chunk.data is None:
                    continue  # metadata alone names no write
                metadata = chunk.app_metadata
                md = metadata.to_pybytes() if metadata is not None else None
                if not streams.accept(call, chunk.data, md, gone):
                    break  # a bad write (or the call failed): its error ends the call
            while not over.wait(_POLL_S):
                if context.is_cancelled():
                    raise fl.FlightCancelledError("the call was cancelled")
        finally:
            # A call that is over is forgotten already; one whose client went away is owed
            # nothing more (its writes go on).
            streams.drop_call(call)
            acker.join()
        if ending[0] is not None:
            raise translated(ending[0])

    def list_actions(self, context: fl.ServerCallContext) -> list[tuple[str, str]]:
        return list(ACTIONS)

    def do_action(self, context: fl.ServerCallContext, action: fl.Action) -> list[fl.Result]:
        s = self._server
        body = action.body.to_pybytes() if action.body is not None else b""
        result = s.hops.call(s.action(action.type, body), context)
        return [fl.Result(pa.py_buffer(json.dumps(result).encode()))]


class _CallMiddleware(fl.ServerMiddleware):  # type: ignore[misc]
    """Counts a call while it is open, then its duration and error; logs it to the access log
    (logger ``persist.flight.access``, INFO)."""

    def __init__(self, metrics: Metrics, rpc: str) -> None:
        self._metrics = metrics
        self._rpc = rpc
        self._started = time.monotonic()
        self._gauge = metrics.open_calls.labels(rpc)
        self._gauge.inc()

    def call_completed(self, exception: BaseException | None) -> None:
        self._gauge.dec()
        took = time.monotonic() - self._started
        self._metrics.rpc_seconds.labels(self._rpc).observe(took)
        if exception is None:
            access.info("%s ok %.1f ms", self._rpc, took * 1000)
            return
        error = _error_name(exception)
        self._metrics.rpc_errors.labels(self._rpc, error).inc()
        access.info("%s %s %.1f ms: %s", self._rpc, error, took * 1000, str(exception)[:200])


# Why a call was refused for its token, by the ``reason`` label it is counted under: what the
# caller is told and the log says. Never any of the token given (a log is read by more people).
_AUTH_REFUSALS = {
    "missing": "no token given (send the header authorization: Bearer <token>)",
    "rejected": "token not accepted (the bearer token given is not this server's)",
}


class _CallMiddlewareFactory(fl.ServerMiddlewareFactory):  # type: ignore[misc]
    """Refuses a call without the bearer token (when the server has one), logging and counting
    the refusal; counts open calls."""

    def __init__(self, token: str | None, metrics: Metrics) -> None:
        self._expected = f"Bearer {token}".encode() if token is not None else None
        self._metrics = metrics

    def start_call(self, info: fl.CallInfo, headers: dict[str, list[str]]) -> _CallMiddleware:
        rpc = info.method.name.lower()
        if self._expected is not None:
            given = headers.get("authorization") or headers.get("Authorization") or []
            if not any(hmac.compare_digest(v.encode(), self._expected) for v in given):
                reason = "rejected" if any(_bearer_token(v) for v in given) else "missing"
                self._metrics.auth_failures.labels(reason).inc()
                access.warning("%s Unauthenticated: %s", rpc, _AUTH_REFUSALS[reason])
                raise fl.FlightUnauthenticatedError(f"persist: {_AUTH_REFUSALS[reason]}")
        return _CallMiddleware(self._metrics, rpc)


def _bearer_token(header: str) -> bool:
    """Whether an ``authorization`` header value carries a bearer token (any, even a wrong one):
    the scheme is case-insensitive (RFC 7235)."""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and bool(token.strip())


def _error_name(exc: BaseException) -> str:
    """The persist error a Flight error carries (its JSON payload), else its own class."""
    extra = getattr(exc, "extra_info", None)
    if isinstance(extra, bytes):
        with contextlib.suppress(ValueError):
            name = json.loads(extra).get("error")
            if isinstance(name, str):
                return name
    return type(exc).__name__


def middleware(token: str | None, metrics: Metrics) -> dict[str, fl.ServerMiddlewareFactory]:
    return {"persist": _CallMiddlewareFactory(token, metrics)}


# --- helpers ---------------------------------------------------------------------------------------


def _send_acks(
    streams: Streams,
    call: CallInfo,
    writer: fl.MetadataRecordBatchWriter,
    over: threading.Event,
    ending: list[BaseException | None],
) -> None:
    """The ack thread of a DoExchange call: sends whatever acks the ledger queued for it, as
    one batch, until the call is over. An error that ends the call is sent as a message first
    (``{"error": ...}``): a client blocked waiting for acks hears it at once, though gRPC ends
    the call only once the reading thread is free of its client."""
    try:
        while True:
            acks, done, error = streams.take_acks(call, _POLL_S)
            if acks:
                cols = np.array(acks, dtype=np.int64).reshape(-1, 4)
                streams.count_acks(cols[:, 1])
                batch, metadata = ack_message(cols)
                if metadata is None:
                    writer.write_batch(batch)
                else:
                    writer.write_with_metadata(batch, metadata)
            if done:
                if error is not None:
                    _, payload = error_payload(error)
                    body = json.dumps({"error": payload}).encode()
                    with contextlib.suppress(Exception):  # the client may be gone
                        writer.write_with_metadata(_NO_ACKS, pa.py_buffer(body))
                ending[0] = error
                return
    except Exception as exc:  # the client went away: nothing more can reach it
        ending[0] = exc
    finally:
        over.set()


def _stream_schema(reader: fl.MetadataRecordBatchReader) -> pa.Schema | None:
    """The stream's schema; None when it ended (or failed) before one came: no write will."""
    try:
        schema: pa.Schema = reader.schema
    except Exception:  # pyarrow says so in several ways (no data message, EOF)
        return None
    return schema


def _data_schema(reader: fl.MetadataRecordBatchReader) -> pa.Schema:
    """A new shard's columns: the stream's, less ``_diff``."""
    try:
        schema = reader.schema
    except Exception as exc:  # pyarrow says so in several ways (no data message, EOF)
        raise InvalidUsage(
            f"the shard does not exist, and the stream ended before its columns came: {exc}"
        ) from None
    return pa.schema([f for f in schema if f.name != DIFF]).remove_metadata()


_COMMITTED = TIER_NAMES.index("COMMITTED")
_TIER_NAMES = np.array(TIER_NAMES, dtype=object)
_TIMESTAMP = ACK_SCHEMA.field("timestamp").type
# The columns of a message whose acks are of one tier (most are), sliced from these: an ack
# message is on every write's path, and building these two anew cost more than the rest.
_UNIFORM = 64
_ONE_TIER = [
    (pa.array([name] * _UNIFORM, pa.utf8()), pa.array([i != 0] * _UNIFORM, pa.bool_()))
    for i, name in enumerate(TIER_NAMES)
]


def ack_message(cols: np.ndarray[Any, Any]) -> tuple[pa.RecordBatch, pa.Buffer | None]:
    """One message of acks (rows ``(lsn, tier, at_us, committed_at)``), and its
    ``app_metadata``: ``{"committed_at": {lsn: time}}`` for the ``COMMITTED`` rows in it (None
    when it has none)."""
    n = len(cols)
    tiers = cols[:, 1]
    first = int(tiers[0])
    if n <= _UNIFORM and (n == 1 or bool((tiers == first).all())):
        names, updates = (a.slice(0, n) for a in _ONE_TIER[first])
    else:
        names = pa.array(_TIER_NAMES[tiers], pa.utf8())
        updates = pa.array(tiers != 0)
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(cols[:, 0].astype(np.uint64), pa.uint64()),
            names,
            updates,
            pa.array(cols[:, 2], _TIMESTAMP),
        ],
        schema=ACK_SCHEMA,
    )
    committed = cols[tiers == _COMMITTED]
    if not len(committed):
        return batch, None
    at = {str(lsn): int(t) for lsn, t in zip(committed[:, 0], committed[:, 3], strict=True)}
    return batch, pa.py_buffer(json.dumps({"committed_at": at}).encode())


_NO_ACKS = pa.RecordBatch.from_pylist([], schema=ACK_SCHEMA)


def _checked(parse: Callable[[fl.FlightDescriptor], T], descriptor: fl.FlightDescriptor) -> T:
    try:
        return parse(descriptor)
    except Exception as exc:
        raise translated(exc) from None


def translated(exc: BaseException) -> fl.FlightError:
    error = flight_error(exc)
    if isinstance(error, fl.FlightInternalError) and not isinstance(exc, persist.PersistError):
        log.error("persist flight: internal error", exc_info=exc)
    return error


def _shutting_down() -> fl.FlightUnavailableError:
    text = json.dumps({"error": "Unavailable", "message": "the server is shutting down"})
    return fl.FlightUnavailableError(f"persist: {text}", extra_info=text.encode())


def _messages(batch: pa.RecordBatch, whole: bool) -> Iterator[pa.RecordBatch]:
    """``batch`` cut into zero-copy slices of about ``_MESSAGE_BYTES`` (``whole``: one)."""
    n = batch.num_rows
    if whole or n == 0 or batch.nbytes <= _MESSAGE_BYTES:
        yield batch
        return
    step = max(1, n * _MESSAGE_BYTES // batch.nbytes)
    for start in range(0, n, step):
        yield batch.slice(start, step)
