"""``FlightServer``: persist's shards behind Arrow Flight; its configuration and its life.

The server is four parts, each in its own module: the gRPC service and its hops onto the event
loop (``_service``), reads and tickets (``_reads``), writes and the registry of streaming writes
(``_writes``), and this module, which checks the configuration, starts the parts, answers the
actions and drains them at the end. Everything persist does runs on the server's one event
loop; gRPC's threads only wait for it (see ``_service``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow.flight as fl

import persist
from persist.bridge import LoopBridge
from persist.client import PersistClient, connect
from persist.config import PersistConfig
from persist.errors import InvalidUsage
from persist.flight._metrics import Metrics
from persist.flight._protocol import action_body
from persist.flight._reads import Reads
from persist.flight._service import Hops, Service, middleware
from persist.flight._writes import Writes

__all__ = ["ENV_TOKEN", "FlightServer"]

ENV_TOKEN = "PERSIST_FLIGHT_TOKEN"

log = logging.getLogger("persist")


class FlightServer:
    """Serves the shards of one location (blob + consensus) over Arrow Flight.

    ``async with FlightServer(blob, consensus, port=0) as server:`` starts it on the running
    event loop (``server.uri`` is where it listens) and stops it on exit; or call ``start`` and
    ``stop``. Keywords are the flags of ``persist serve`` (``persist serve --help``); ``token``
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
        self._client: PersistClient | None = None
        self._reads: Reads | None = None
        self._writes: Writes | None = None
        self._hops: Hops | None = None
        self._service: Service | None = None
        self._background: set[asyncio.Task[Any]] = set()
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
        """Connects to the location, recovers the streaming writes a crashed run logged, and
        starts accepting calls (``uri`` is then set)."""
        if self._stopped is not None:
            raise InvalidUsage("the server was already started")
        self._stopped = asyncio.Event()
        self._hops = Hops(LoopBridge(asyncio.get_running_loop()))
        self._client = client = await connect(self._blob, self._consensus, config=self._config)
        self._reads = Reads(client, self.metrics, self._spawn, self._ttl_ms)
        self._writes = Writes(
            client,
            self.metrics,
            wal_dir=self.wal_dir,
            commit_interval_ms=self.commit_interval_ms,
            commit_bytes=self.commit_bytes,
            max_buffer_bytes=self.max_buffer_bytes,
        )
        try:
            await self._writes.recover()
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
                Service,
                self,
                f"{scheme}://{self._host}:{self._port}",
                tls,
                middleware(self._token, self.metrics),
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
        (at most ``grace_s``, then cancels them), commits what streaming writes took, and
        releases every reader and writer it holds."""
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
        if service is not None:
            # Blocks until every call in progress has returned; those calls need the loop.
            shutdown = asyncio.ensure_future(asyncio.to_thread(service.shutdown))
            done, _ = await asyncio.wait({shutdown}, timeout=grace_s)
            if not done:
                hops.cancel(hops.streams)
            await shutdown
        if self._reads is not None:
            self._reads.close()
        if self._writes is not None:
            await self._writes.close()
        await self._drain_background()
        await self._close_backends()
        self._stopped.set()

    async def _close_backends(self) -> None:
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

    async def action(self, name: str, body: bytes) -> dict[str, Any]:
        args = action_body(name, body)
        if name == "health":
            return {"status": "ok", "version": persist.__version__}
        if name == "frontiers":
            since, upper = await self.client.frontiers(args["shard"])
            return {"since": since, "upper": upper}
        _, upper = await self.client.frontiers(args["shard"])
        return self.writes.durability(args["shard"], upper)

    def _lag(self) -> dict[str, tuple[int, float]]:
        return self._writes.lag() if self._writes is not None else {}


def _host_in_uri(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("persist flight: background cleanup failed: %r", task.exception())
