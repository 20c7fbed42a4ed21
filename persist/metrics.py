"""The library's own metrics, in a Prometheus registry, when the program asks for them.

Off by default (no cost but a ``None`` check): ``persist.enable_metrics()`` turns them on for
the whole process and returns the registry to expose (``prometheus_client`` serves it). Every
client of the process counts into it. No metric has a shard label: a process may touch many
shards, and a label per shard would grow the registry without bound.
"""

from __future__ import annotations

from typing import Any

from persist.errors import InvalidUsage, install_hint

__all__ = ["enable_metrics", "on"]


class _Metrics:
    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        self.registry = r = registry
        self.commits = Counter("persist_commits", "State changes committed", registry=r)
        self.commit_seconds = Histogram(
            "persist_commit_seconds",
            "Latency of a commit, over all its tries",
            registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
        )
        self.lost_races = Counter(
            "persist_commit_lost_races", "Compare-and-sets another commit won first", registry=r
        )
        self.retries = Counter(
            "persist_commit_retries", "Commits retried after consensus failed", registry=r
        )
        self.parts_written = Counter("persist_parts_written", "Parts written to blob", registry=r)
        self.bytes_written = Counter(
            "persist_part_bytes_written", "Bytes of parts written to blob", registry=r
        )
        self.parts_read = Counter("persist_parts_read", "Parts (or ranges) read", registry=r)
        self.bytes_read = Counter("persist_part_bytes_read", "Bytes of parts read", registry=r)
        self.merges = Counter("persist_merges", "Compaction merges applied", registry=r)
        self.merged_bytes = Counter(
            "persist_merged_bytes", "Bytes of parts compaction rewrote", registry=r
        )
        self.blobs_deleted = Counter(
            "persist_gc_blobs_deleted", "Blobs deleted by garbage collection", registry=r
        )
        self.listen_events = Counter(
            "persist_listen_events", "Events delivered to listens", registry=r
        )
        self.leases_expired = Counter(
            "persist_leases_expired", "Writers expired because their lease ran out", registry=r
        )


# The process's metrics, once enabled; None: off.
current: _Metrics | None = None


def on() -> _Metrics | None:
    """The process's metrics, or None while they are off (what the library counts into)."""
    return current


def enable_metrics(registry: Any = None) -> Any:
    """Turns on persist's library metrics for this process and returns the
    ``prometheus_client.CollectorRegistry`` they are in (``registry``, else a new one; a second
    call returns the first registry). Needs ``prometheus_client`` (the ``flight`` extra)."""
    global current
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise InvalidUsage(
            f"persist's metrics need prometheus_client: {install_hint('flight')}"
        ) from None
    if current is not None:
        return current.registry
    if registry is not None and not isinstance(registry, CollectorRegistry):
        raise InvalidUsage(f"registry must be a CollectorRegistry, not {type(registry).__name__}")
    registry = registry if registry is not None else CollectorRegistry()
    current = _Metrics(registry)
    return registry
