"""The server's Prometheus metrics (``--metrics-port``): one registry per server, so two servers
in one process (tests) never share counts. Updated from gRPC threads and the event loop alike
(prometheus_client's metrics are thread-safe).

Writes, commits, reads and tickets carry a ``shard`` label (the shard id, which a rename does
not change). A server may see shards without end, so the label set is bounded: the first
``MAX_SHARD_LABELS`` shards seen get their own, the rest count under ``OTHER_SHARDS``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from persist.core.stream.durability import TIER_NAMES
from persist.errors import UpperMismatch

__all__ = ["MAX_SHARD_LABELS", "OTHER_SHARDS", "Metrics"]

MAX_SHARD_LABELS = 1000
OTHER_SHARDS = "_other"
# The ``reason`` of a call refused for its token: none given, or one that is not the server's.
AUTH_FAILURE_REASONS = ("missing", "rejected")

# Per tier: (LSNs written but not yet at the tier, seconds the oldest of them has waited).
LagSource = Callable[[], Mapping[str, tuple[int, float]]]


class _Lag(Collector):
    """Durability lag, read at scrape time from the server's own bookkeeping."""

    def __init__(self, source: LagSource) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        lag = self._source()
        lsns = GaugeMetricFamily(
            "persist_flight_durability_lag_lsns",
            "LSNs taken (MEMORY) but not yet at the tier, over all shards",
            labels=["tier"],
        )
        seconds = GaugeMetricFamily(
            "persist_flight_durability_lag_seconds",
            "How long the oldest write not yet at the tier has waited",
            labels=["tier"],
        )
        for tier in TIER_NAMES:
            n, s = lag.get(tier, (0, 0.0))
            lsns.add_metric([tier], n)
            seconds.add_metric([tier], s)
        yield lsns
        yield seconds


class Metrics:
    def __init__(self, lag: LagSource) -> None:
        r = self.registry = CollectorRegistry()
        self.writes = Counter(
            "persist_flight_writes_received", "Writes received", ["method", "shard"], registry=r
        )
        self.write_bytes = Counter(
            "persist_flight_write_bytes_received",
            "Bytes of Arrow data received in writes",
            ["method", "shard"],
            registry=r,
        )
        self.acks = Counter(
            "persist_flight_acks_sent", "Durability acks sent, per tier", ["tier"], registry=r
        )
        self.open_calls = Gauge(
            "persist_flight_open_calls", "Calls in progress, per RPC", ["rpc"], registry=r
        )
        self.backpressure_waits = Counter(
            "persist_flight_backpressure_waits",
            "Times a streaming write waited for the buffer to drain",
            registry=r,
        )
        self.commit_retries = Counter(
            "persist_flight_commit_retries",
            "Group commits of streamed writes that failed and will be tried again",
            registry=r,
        )
        self.commit_rewrites = Counter(
            "persist_flight_commit_rewrites",
            "Group commits whose part was written again at a later time because another "
            "writer had moved the shard's upper",
            registry=r,
        )
        self.wal_failures = Counter(
            "persist_flight_wal_failures",
            "WAL failures: appends that failed (their writes wait for the next append) and "
            "damage found when a WAL was read back (the segment is kept in quarantine/)",
            registry=r,
        )
        self.quarantined = Counter(
            "persist_flight_quarantined_writes",
            "Streamed writes that can never be committed, set aside in the WAL's quarantine/",
            ["shard"],
            registry=r,
        )
        self.commits = Counter(
            "persist_flight_commits",
            "Commits to shards, by outcome",
            ["outcome", "shard"],
            registry=r,
        )
        self.commit_seconds = Histogram(
            "persist_flight_commit_seconds",
            "Latency of a commit (compare_and_append) made by the server",
            registry=r,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
        )
        self.rpc_seconds = Histogram(
            "persist_flight_rpc_seconds",
            "Duration of each Flight call, by method",
            ["rpc"],
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0),
        )
        self.rpc_errors = Counter(
            "persist_flight_rpc_errors",
            "Flight calls that ended in an error, by method and error",
            ["rpc", "error"],
            registry=r,
        )
        self.auth_failures = Counter(
            "persist_flight_auth_failures",
            "Calls refused for their token: none given (missing) or not this server's (rejected)",
            ["reason"],
            registry=r,
        )
        for reason in AUTH_FAILURE_REASONS:
            self.auth_failures.labels(reason)  # at 0 from the start: an alert needs a series
        self.doget_rows = Counter(
            "persist_flight_doget_rows", "Rows sent by DoGet", ["shard"], registry=r
        )
        self.doget_bytes = Counter(
            "persist_flight_doget_bytes", "Bytes of Arrow data sent by DoGet", ["shard"], registry=r
        )
        self.tickets = Counter(
            "persist_flight_tickets_issued",
            "Tickets issued by GetFlightInfo",
            ["shard"],
            registry=r,
        )
        self.readers_held = Gauge(
            "persist_flight_readers_held", "Readers held for unexpired tickets", registry=r
        )
        r.register(_Lag(lag))
        self._http: Any = None
        self._labelled: set[str] = set()
        self._labels_lock = threading.Lock()

    def shard(self, shard_id: str) -> str:
        """The ``shard`` label value of ``shard_id``: itself, or ``OTHER_SHARDS`` once
        ``MAX_SHARD_LABELS`` other shards have labels of their own."""
        if shard_id in self._labelled:
            return shard_id
        with self._labels_lock:
            if len(self._labelled) < MAX_SHARD_LABELS:
                self._labelled.add(shard_id)
                return shard_id
        return OTHER_SHARDS

    @contextlib.contextmanager
    def commit(self, shard_id: str) -> Iterator[None]:
        """Counts one commit to ``shard_id`` by its outcome (ok, mismatch, error) and times the
        ok ones."""
        shard = self.shard(shard_id)
        started = time.perf_counter()
        try:
            yield
        except UpperMismatch:
            self.commits.labels("mismatch", shard).inc()
            raise
        except BaseException:
            self.commits.labels("error", shard).inc()
            raise
        self.commits.labels("ok", shard).inc()
        self.commit_seconds.observe(time.perf_counter() - started)

    def serve(self, host: str, port: int) -> int:
        """Serves ``/metrics`` on a daemon thread; returns the port (``port`` 0 picks one)."""
        self._http, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound: int = self._http.server_address[1]
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
