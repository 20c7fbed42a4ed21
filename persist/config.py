"""Tunables of a client, with the clock it reads. Frozen: a client's config never changes."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from persist.errors import InvalidUsage

# Times are stored in state as msgpack integers; the clock must stay well inside int64.
_MAX_MS = 2**62
# Bounds that keep every derived quantity (ms, backoff lists, thread counts) representable.
_MAX_SECONDS = 1e9
_MAX_INT = {
    "retry_attempts": 1000,
    "io_concurrency": 1024,
    "compaction_concurrency": 1024,
    "compaction_min_parts": 1024,
    # A pushed commit (a Postgres NOTIFY payload is at most 8000 bytes) still carries its diff.
    "inline_writes_max_bytes": 4096,
}
_MIN_INT = {
    "recent_parts_bytes": 0,
    "inline_writes_max_bytes": 0,
    "inline_writes_total_max_bytes": 0,
    "sorted_part_max_bytes": 0,
}


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class PersistConfig:
    """Everything a client can be tuned with. Defaults suit a production workload."""

    # A handle that has not heart-beaten for this long is expired by whoever next commits.
    lease_duration_s: float = 60.0
    # Handles heartbeat in the background this often (and on every normal use).
    heartbeat_interval_s: float = 15.0
    # How often a waiting listen/snapshot polls consensus for changes made by other processes,
    # when the consensus cannot push them.
    poll_interval_s: float = 0.05
    # When it can (Postgres, SQLite, mem), a waiting listen/snapshot is woken by each change and
    # polls only this often: a safety net for pushes that were lost.
    push_poll_interval_s: float = 2.0
    # A rollup of the full state is written every this many state versions; opening a shard
    # reads the latest rollup plus at most about this many diffs.
    rollup_interval: int = 128
    # Target in-memory size of one part of a batch; bounds the memory a write needs beyond its
    # input, and sets how parts spread over threads.
    part_target_bytes: int = 64 * 1024 * 1024
    # How many parts one write or read encodes, decodes or moves at once.
    io_concurrency: int = 4
    # A part a write makes is sorted and consolidated as it is written when it holds at most
    # this many bytes (decoded, in memory). A bigger one is stored as it comes, an unsorted
    # run: the write then costs one Parquet encode and no sort, and whoever reads the part
    # sorts it as it decodes it, until compaction rewrites it sorted. A write whose rows come
    # in key order is stored sorted at any size (that costs no sort).
    sorted_part_max_bytes: int = 256 * 1024
    # The client keeps the decoded tables of the small parts it wrote lately, up to this many
    # bytes, so that its own listens and reads of them need no blob read (0: keep none).
    recent_parts_bytes: int = 16 * 1024 * 1024
    # A written part whose Parquet encoding is at most this many bytes is kept in the state
    # itself, not in blob: the commit is then the write's only I/O, and a listener that is
    # pushed the commit holds the data too. 0: every part goes to blob.
    inline_writes_max_bytes: int = 4096
    # Inline parts in one shard's state, in bytes, at most (about: concurrent writers may each
    # add one past it); beyond it parts go to blob until merges move inline ones out.
    inline_writes_total_max_bytes: int = 1024 * 1024
    # Compaction and garbage collection run in the background after writes (see compact.py).
    compaction_enabled: bool = True
    # How many merges one client runs at once, over all its shards.
    compaction_concurrency: int = 1
    # A merge rewrites its inputs only once they hold this many parts; below that it folds them
    # (the merged batch lists their parts as they are) in the commit of the append that makes
    # it due, at no I/O. 1: every merge rewrites. Also bounds how many parts a fold leaves.
    compaction_min_parts: int = 8
    # A merge must be committed within this long of its start, else it is discarded; garbage
    # collection deletes unreferenced compaction output older than twice this.
    compaction_timeout_s: float = 600.0
    # The merges background compaction makes run in a worker process of the client, at a lower
    # CPU priority, when its blob can be opened there too (file://, s3://): a writer keeps its
    # cores. False, or another blob: they run in the client's own process (``maintain`` always).
    maintenance_process: bool = False
    # Tries of an operation whose external failures may be retried, determinate or not (each
    # after an exponential backoff from this delay); a commit's lost race costs none.
    retry_attempts: int = 5
    retry_initial_delay_s: float = 0.05
    # A shard this client creates keeps its contents as of every time made readable within
    # this many seconds readable, whatever readers do (``client.set_retention`` changes it per
    # shard). None: readers alone hold history (the since never moves with no reader).
    retention_s: float | None = 24 * 3600.0
    # The clock leases and retention are measured with (milliseconds since the epoch).
    now_ms: Callable[[], int] = field(default=wall_clock_ms, compare=False)

    def __post_init__(self) -> None:
        # Values end up in the shard's state, shared with every other client: a bad one must be
        # refused here, not committed where it would break everyone's next open.
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "now_ms":
                if not callable(value):
                    raise InvalidUsage(f"now_ms must be a callable returning ms, not {value!r}")
            elif f.name == "retention_s" and value is None:
                continue
            elif f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise InvalidUsage(f"{f.name} must be a bool, not {value!r}")
            elif f.type in ("int", int):
                low, top = _MIN_INT.get(f.name, 1), _MAX_INT.get(f.name, 2**40)
                if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
                    raise InvalidUsage(f"{f.name} must be an int in [{low}, {top}], not {value!r}")
            elif not is_seconds(value, _MAX_SECONDS):
                raise InvalidUsage(
                    f"{f.name} must be a number of seconds in (0, {_MAX_SECONDS:g}], not {value!r}"
                )
        if self.lease_duration_ms < 1 or self.lease_duration_ms > _MAX_MS:
            raise InvalidUsage(f"lease_duration_s {self.lease_duration_s!r} is out of range")

    @property
    def lease_duration_ms(self) -> int:
        return int(self.lease_duration_s * 1000)

    @property
    def retention_ms(self) -> int | None:
        return None if self.retention_s is None else int(self.retention_s * 1000)


def is_seconds(value: object, top: float) -> bool:
    """Whether ``value`` is a number of seconds in ``(0, top]`` (not a bool, not NaN)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and 0 < value <= top
    )


def read_clock(cfg: PersistConfig) -> int:
    """The config's clock, checked: milliseconds as an int that state can hold."""
    now = cfg.now_ms()
    if isinstance(now, bool) or not isinstance(now, int) or not 0 <= now < _MAX_MS:
        raise InvalidUsage(f"the config's now_ms() must return int milliseconds, not {now!r}")
    return now
