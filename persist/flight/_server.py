"""``FlightServer``: persist's shards behind Arrow Flight; its configuration and its life.

The server is four parts, each in its own module: the gRPC service and its hops onto the event
loop (``_service``), reads and tickets (``_reads``), writes and the registry of streaming writes
(``_writes``), and this module, which checks the configuration, starts the parts, answers the
actions and drains them at the end. Everything persist does runs on the server's one event
loop; gRPC's threads only wait for it (see ``_service``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import threading
import uuid
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

import persist
from persist.bridge import LoopBridge
from persist.client import PersistClient, connect
from persist.config import PersistConfig
from persist.errors import InvalidUsage, PersistError
from persist.flight._metrics import Metrics
from persist.flight._protocol import action_body
from persist.flight._reads import Reads
from persist.flight._service import Hops, Service, middleware
from persist.flight._wal import WalDir
from persist.flight._writes import Writes
from persist.location import Blob, Consensus

__all__ = ["ENV_TOKEN", "FlightServer"]

ENV_TOKEN = "PERSIST_FLIGHT_TOKEN"

# Health writes, reads back and deletes a blob under this prefix, one key per server: no shard's
# keys start with it (``s`` + UUID, see core/shard/keys.py), so no listing of a shard (inspect, du,
# purge, garbage collection) counts or sweeps it, and a probe that stopped half way leaves at
# most that one small key, which the next probe overwrites. In consensus it reads a key that
# need not exist. Each store gets ``_HEALTH_TIMEOUT_S`` in all.
_HEALTH_PREFIX = "health/"
_HEALTH_KEY = "health"
_HEALTH_TIMEOUT_S = 5.0

log = logging.getLogger("persist")

# Past the drain's grace: how long the calls get to notice that their futures were cancelled,
# then how long gRPC gets to fail the calls on the connections the drain shut down.
_CANCELLED_S = 1.0
_SEVERED_S = 3.0


class FlightServer:
    """Serves the shards of one location (blob + consensus) over Arrow Flight.

    ``async with FlightServer(blob, consensus, port=0) as server:`` starts it on the running
    event loop (``server.uri`` is where it listens) and stops it on exit; or call ``start`` and
    ``stop``. Keywords are the flags of ``persist serve`` (``persist serve --help``); ``token``
    defaults to ``$PERSIST_FLIGHT_TOKEN``. ``wal_dir``, ``commit_interval_ms``, ``commit_bytes``
    and ``max_buffer_bytes`` configure streaming writes; ``drain_grace_s`` is how long ``stop``
    lets calls in progress finish. ``blob`` and ``consensus`` are URIs, or ``Blob`` and
    ``Consensus`` objects (say ``persist.testing``'s fault-injecting wrappers).
    """

    def __init__(
        self,
        blob: str | Blob | None = None,
        consensus: str | Consensus | None = None,
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
        drain_grace_s: float = 30.0,
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
        if (
            isinstance(drain_grace_s, bool)
            or not isinstance(drain_grace_s, int | float)
            or not 0 <= drain_grace_s < 1e9
        ):
            raise InvalidUsage(
                f"drain_grace_s must be a number of seconds >= 0, not {drain_grace_s!r}"
            )
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
        self.drain_grace_s = float(drain_grace_s)

        self.metrics = Metrics(self._lag)
        self._health_key = f"{_HEALTH_PREFIX}{uuid.uuid4().hex}"
        self._health_lock = asyncio.Lock()
        self._client: PersistClient | None = None
        self._reads: Reads | None = None
        self._writes: Writes | None = None
        self._wal: WalDir | None = None
        self._hops: Hops | None = None
        self._service: Service | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._draining = False
        self._stopped: asyncio.Event | None = None
        # Set by a drain that had to leave a gRPC thread stuck in a call behind (see ``stop``).
        self.left_behind = False
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
        """Connects to the location, recovers the streaming writes a crashed run logged, and
        starts accepting calls (``uri`` is then set).

        A port that is taken or can't be listened on (``port`` or ``metrics_port``) and a TLS
        file that can't be read raise ``InvalidUsage`` naming it, once whatever the start
        took (the location, the WAL directory) is let go."""
        if self._stopped is not None:
            raise InvalidUsage("the server was already started")
        self._stopped = asyncio.Event()
        self._hops = Hops(LoopBridge(asyncio.get_running_loop()))
        self._client = client = await connect(self._blob, self._consensus, config=self._config)
        self._reads = Reads(client, self.metrics, self._spawn, self._ttl_ms)
        try:
            # The WAL directory is this server's alone (a lock), and names it in shard states.
            self._wal = wal = await asyncio.to_thread(WalDir.open, self.wal_dir)
        except BaseException:
            await self._close_backends()
            raise
        self._writes = Writes(
            client,
            self.metrics,
            self._spawn,
            wal_dir=self.wal_dir,
            server=wal.server_id,
            commit_interval_ms=self.commit_interval_ms,
            commit_bytes=self.commit_bytes,
            max_buffer_bytes=self.max_buffer_bytes,
        )
        try:
            await self._writes.recover(wal.was_clean)
        except BaseException:
            await self._close_backends()
            raise
        tls: list[fl.CertKeyPair] = []
        scheme = "grpc"
        try:
            if self._tls is not None:
                tls = [await asyncio.to_thread(_read_cert_key, *self._tls)]
                scheme = "grpc+tls"
            metrics_uri = None
            if self._metrics_port is not None:
                # Before gRPC's port: a start that fails here has no gRPC server to stop.
                port = await asyncio.to_thread(self._serve_metrics, self._metrics_port)
                metrics_uri = f"http://{_host_in_uri(self._host)}:{port}/metrics"
            # gRPC says only "Server did not start properly" (and logs the cause to stderr in
            # its own format): find a port it can't have first, to name the cause.
            refused = await asyncio.to_thread(_cannot_listen, self._host, self._port)
            if refused is not None:
                raise InvalidUsage(_listen_failure("port", self._host, self._port, refused))
            try:
                # Binding and starting gRPC's threads blocks: off the loop.
                self._service = await asyncio.to_thread(
                    Service,
                    self,
                    f"{scheme}://{self._host}:{self._port}",
                    tls,
                    middleware(self._token, self.metrics),
                )
            except pa.ArrowException as exc:
                # Taken since the look above, say.
                refused = await asyncio.to_thread(_cannot_listen, self._host, self._port)
                if refused is None:
                    raise
                raise InvalidUsage(
                    _listen_failure("port", self._host, self._port, refused)
                ) from exc
        except BaseException:
            await self._close_backends()
            raise
        self.metrics_uri = metrics_uri
        self.uri = f"{scheme}://{_host_in_uri(self._host)}:{self._service.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains: refuses new calls, ends listens and waits at once, lets other calls finish
        (at most ``grace_s``, default ``drain_grace_s``, then cancels them), commits what
        streaming writes took, and releases every reader and writer it holds.

        Returns within about ``grace_s`` + 5 s whatever the clients do. A call that its
        cancellation can't reach (see ``_shut_down``) may leave a gRPC thread behind
        (``left_behind``): everything is released all the same, and ``serve`` then ends the
        process itself."""
        if self._stopped is None or self._hops is None:
            return
        if self._draining:
            await self._stopped.wait()
            return
        self._draining = True
        hops = self._hops
        hops.draining = True
        hops.cancel(hops.waits)
        service = self._service
        grace = self.drain_grace_s if grace_s is None else grace_s
        if service is not None:
            await self._shut_down(service, hops, grace)
        if self._reads is not None:
            self._reads.close()
        if self._writes is not None:
            # Pending streamed writes get the grace too; what is left stays in the WAL.
            await self._writes.close(max(grace, 1.0))
            if self._wal is not None:
                # A WAL append that failed left a torn tail behind: the next start must not
                # take it for damage, so the stop is not called clean.
                clean = not self._writes.streams.wal_failed
                await asyncio.to_thread(self._wal.close, clean)
                self._wal = None
        await self._drain_background()
        await self._close_backends()
        self._stopped.set()

    async def _shut_down(self, service: Service, hops: Hops, grace_s: float) -> None:
        """gRPC's shutdown (no new calls; it returns once every call has), bounded.

        pyarrow's ``FlightServerBase.shutdown()`` takes no deadline (the C++ ``Shutdown`` does,
        and gRPC would cancel the calls still running at it, but the binding never passes one)
        and waits for every call. Calls waiting for the loop end when their futures are
        cancelled; a call stuck inside gRPC does not: a DoGet whose client stopped reading
        waits in a flow-controlled write, a DoPut whose client stopped sending in a read. Those
        are ended by shutting their TCP connections down, which gRPC meets as a broken
        connection and fails the calls on it. Should even that not release gRPC's threads, the
        shutdown is left running and the drain goes on without it."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def shutdown() -> None:
            try:
                service.shutdown()
            except Exception as exc:
                log.warning("persist flight: gRPC's shutdown failed: %r", exc)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop may be gone by now
                    loop.call_soon_threadsafe(finished)

        # A thread of its own, not the loop's executor: a shutdown left running must not hold
        # up the executor's shutdown at the end of ``asyncio.run``.
        threading.Thread(target=shutdown, name="persist-flight-shutdown", daemon=True).start()
        if await _within(done, grace_s):
            return
        log.warning("persist flight: calls still running after the %g s grace: cancelling", grace_s)
        hops.cancel(hops.streams)
        if await _within(done, _CANCELLED_S):
            return
        severed = _sever_connections(service.port)
        log.warning(
            "persist flight: calls stuck in gRPC (a client that stopped reading or sending): "
            "shut down their %d connection(s)",
            severed,
        )
        if await _within(done, _SEVERED_S):
            return
        self.left_behind = True
        log.error("persist flight: gRPC's shutdown did not finish; leaving its threads behind")
        # What the stuck calls were pulling is closed here (a listen expires its reader).
        await hops.bridge.close_iterators()

    def _serve_metrics(self, port: int) -> int:
        try:
            return self.metrics.serve(self._host, port)
        except OSError as exc:
            raise InvalidUsage(_listen_failure("metrics port", self._host, port, exc)) from exc

    async def _close_backends(self) -> None:
        if self._wal is not None:
            # A start that failed: the WAL is as it was found (not clean: nothing drained).
            await asyncio.to_thread(self._wal.close, False)
            self._wal = None
        if self._client is not None:
            await self._client.close()
        await asyncio.to_thread(self.metrics.close)

    async def _drain_background(self) -> None:
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs cleanup that must finish even when the call that started it was cancelled."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    # --- the parts -----------------------------------------------------------------------------

    @property
    def client(self) -> PersistClient:
        if self._client is None:
            raise InvalidUsage("the server is not started")
        return self._client

    @property
    def hops(self) -> Hops:
        if self._hops is None:
            raise InvalidUsage("the server is not started")
        return self._hops

    @property
    def reads(self) -> Reads:
        if self._reads is None:
            raise InvalidUsage("the server is not started")
        return self._reads

    @property
    def writes(self) -> Writes:
        if self._writes is None:
            raise InvalidUsage("the server is not started")
        return self._writes

    # --- actions -------------------------------------------------------------------------------

    async def action(self, name: str, body: bytes) -> Any:
        """The JSON answer of an action (``docs/flight.md``, "Actions")."""
        args = action_body(name, body)
        if name == "health":
            return await self._health()
        if name == "quarantine" and "shard" not in args:
            return await self.writes.quarantine(None)
        shard = await self.client.shard_id(args["shard"])  # a name: the id it has now
        if name == "frontiers":
            since, upper = await self.client.frontiers(shard)
            return {"since": since, "upper": upper}
        if name == "quarantine":
            return await self.writes.quarantine(shard)
        if name == "evolve_schema":
            # Calls opened before keep their version; a later call with the new columns (or
            # a group holding its writes) moves the server's writers on (``_writes``).
            version = await self.client.evolve_schema(
                shard,
                args["schema"],
                renames=args["renames"],
                expected_version=args.get("expected_version"),
            )
            return {"version": version}
        return await self.writes.durability(shard)

    async def _health(self) -> dict[str, Any]:
        """``ok`` when the blob store takes a write of a probe key, reads it back and deletes
        it, and consensus answers a read, each store within ``_HEALTH_TIMEOUT_S``; else
        ``unavailable``, with each failure's words.

        A read alone passes on a store that fails every commit: one that is full or read-only
        still answers reads, and a missing key reads as "none" however the store is broken."""

        async def probe(check: Coroutine[Any, Any, str]) -> str:
            try:
                return await asyncio.wait_for(check, _HEALTH_TIMEOUT_S)
            except TimeoutError:
                return f"no answer within {_HEALTH_TIMEOUT_S:g} s"
            except PersistError as exc:
                return f"{type(exc).__name__}: {exc}"

        client = self.client
        key = self._health_key

        async def blob() -> str:
            # One probe at a time: concurrent calls would read back or delete each other's.
            async with self._health_lock:
                # Fresh bytes: what an earlier probe left at the key can't pass for this one's.
                value = os.urandom(16)
                await client.blob.set(key, value)
                got = await client.blob.get(key)
                if got != value:
                    found = "nothing" if got is None else f"{len(got)} other bytes"
                    return f"wrote {len(value)} bytes at {key} and read back {found}"
                await client.blob.delete(key)
            return "ok"

        async def consensus() -> str:
            await client.consensus.head(_HEALTH_KEY)
            return "ok"

        blob_says, consensus_says = await asyncio.gather(probe(blob()), probe(consensus()))
        status = "ok" if blob_says == consensus_says == "ok" else "unavailable"
        return {
            "status": status,
            "version": persist.__version__,
            "blob": blob_says,
            "consensus": consensus_says,
        }

    def _lag(self) -> dict[str, tuple[int, float]]:
        return self._writes.lag() if self._writes is not None else {}


async def _within(fut: asyncio.Future[None], timeout_s: float) -> bool:
    """Whether ``fut`` is done within ``timeout_s`` (it goes on either way)."""
    await asyncio.wait({fut}, timeout=timeout_s)
    return fut.done()


def _sever_connections(port: int) -> int:
    """Shuts down this process's TCP connections accepted on ``port`` (the server's, and only
    those: a connection this process made has the port at its other end); how many. The file
    descriptors come from ``/proc/self/fd`` (``/dev/fd`` elsewhere): none where neither is."""
    for fd_dir in ("/proc/self/fd", "/dev/fd"):
        try:
            names = os.listdir(fd_dir)
            break
        except OSError:
            continue
    else:
        return 0
    severed = 0
    for name in names:
        try:
            dup = os.dup(int(name))
        except (ValueError, OSError):
            continue  # closed meanwhile (the listing's own, say)
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)  # not a socket
            continue
        # Shutting the duplicate down shuts the connection down; closing it closes only it.
        with sock:
            try:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != port:
                    continue
                sock.getpeername()  # the listening socket has no peer: not severed
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue
            severed += 1
    return severed


def _read_cert_key(cert: Path, key: Path) -> fl.CertKeyPair:
    pems: list[bytes] = []
    for what, path in (("certificate", cert), ("key", key)):
        try:
            pems.append(path.read_bytes())
        except OSError as exc:
            raise InvalidUsage(f"TLS {what} file {path}: {exc.strerror or exc}") from exc
    return fl.CertKeyPair(cert=pems[0], key=pems[1])


def _cannot_listen(host: str, port: int) -> OSError | None:
    """Why nothing could listen on ``port`` at any of ``host``'s addresses (None: it could).

    Binds as gRPC does: ``SO_REUSEADDR`` (a previous run's connections in TIME_WAIT don't
    count) and no ``SO_REUSEPORT`` (Arrow's Flight server turns it off)."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return exc
    first: OSError | None = None
    for family, kind, proto, _name, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
                return None
        except OSError as exc:
            first = first or exc
    return first


def _listen_failure(what: str, host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"{what} {port} on {host} is in use (another server or program listens on it)"
    return f"{what} {port} on {host} can't be listened on: {exc.strerror or exc}"


def _host_in_uri(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("persist flight: background cleanup failed: %r", task.exception())
