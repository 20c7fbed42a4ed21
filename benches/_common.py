"""Shared pieces of the benchmark suite: scales, timing statistics, data generation, temp dirs,
counting location wrappers, machine info, and result writing/rendering.

Conventions every scenario follows:

- A scenario runs a list of *systems* (``System``) over the same data. A system has a role:
  ``subject`` (persist itself), ``baseline`` (the plain thing the subject is compared with:
  a bare Parquet write, a bare SQL statement) or ``peer`` (another table format, e.g. Delta Lake
  or Iceberg, compared like persist is). Each system reports the same figures.
- Speed is always shown as a *ratio* against a baseline measured in the same run: the machine
  is shared and noisy, absolute numbers are only context.
- Every loop is bounded in count and in time (``Budget``); a loop cut short by its time budget
  says so in the result (``completed`` / ``cut_by_budget``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as _dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from benches.schema import SCHEMA as SCHEMA  # re-exported: the scenarios take it from here
from persist.location import Blob, Consensus, VersionedData

DEFAULT_POSTGRES_URI = "postgresql://postgres@127.0.0.1:5432/test"
ENV_POSTGRES = "PERSIST_BENCH_POSTGRES_URI"

SUBJECT = "subject"
BASELINE = "baseline"
PEER = "peer"


# --- scales ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scale:
    """How big each scenario runs. ``full`` is the reference; ``quick`` divides its counts so the
    whole quick run takes well under a minute; ``smoke`` only proves the code paths work."""

    name: str
    # small_append
    small_appends: int
    small_rows: int
    # bulk
    bulk_rows: int
    bulk_batches: int  # the "N appends of rows/N" comparison
    bulk_write_repeats: int
    bulk_read_repeats: int
    # open_shard
    open_batches: int
    open_repeats: int
    # time cap of any one measured loop (seconds); in lockstep loops, of each system's share
    loop_budget_s: float
    # consensus: sequential compare-and-set operations per system
    cas_ops: int = 5000
    # scale: one-row appends per shard as it grows, how many points are sampled on the way,
    # fresh-client opens per point
    scale_batches: int = 10_000
    scale_points: int = 10
    scale_open_repeats: int = 3
    # scale: concurrent writers (each on its own shard) and appends per writer
    scale_writers: tuple[int, ...] = (1, 2, 4, 8)
    scale_writer_appends: int = 100


SCALES: dict[str, Scale] = {
    "full": Scale(
        name="full",
        small_appends=1000,
        small_rows=1000,
        bulk_rows=10_000_000,
        bulk_batches=10,
        bulk_write_repeats=3,
        bulk_read_repeats=3,
        open_batches=10_000,
        open_repeats=15,
        loop_budget_s=300.0,
        cas_ops=5000,
        scale_batches=10_000,
        scale_points=10,
        scale_open_repeats=3,
        scale_writers=(1, 2, 4, 8),
        scale_writer_appends=100,
    ),
    "quick": Scale(
        name="quick",
        small_appends=100,
        small_rows=1000,
        bulk_rows=1_000_000,
        bulk_batches=10,
        bulk_write_repeats=2,
        bulk_read_repeats=3,
        open_batches=1000,
        open_repeats=7,
        loop_budget_s=20.0,
        cas_ops=1000,
        scale_batches=1000,
        scale_points=5,
        scale_open_repeats=3,
        scale_writers=(1, 2, 4, 8),
        scale_writer_appends=20,
    ),
    "smoke": Scale(
        name="smoke",
        small_appends=12,
        small_rows=200,
        bulk_rows=10_000,
        bulk_batches=10,
        bulk_write_repeats=1,
        bulk_read_repeats=1,
        open_batches=50,
        open_repeats=2,
        loop_budget_s=10.0,
        cas_ops=30,
        scale_batches=12,
        scale_points=1,
        scale_open_repeats=1,
        scale_writers=(1, 2),
        scale_writer_appends=2,
    ),
}


# --- run context -------------------------------------------------------------------------------


@dataclass
class Context:
    """What a scenario gets from the runner."""

    scale: Scale
    postgres_uri: str
    workdir: Path  # a fresh directory for this run; removed by the runner afterwards
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    verbose: bool = True

    def log(self, msg: str) -> None:
        if self.verbose:
            stamp = time.strftime("%H:%M:%S")
            print(f"[{stamp}] {msg}", file=sys.stderr, flush=True)

    def table_name(self, base: str) -> str:
        """A Postgres table name unique to this run (concurrent runs never collide)."""
        return f"{base}_{self.run_id}"

    def budget(self, seconds: float | None = None) -> Budget:
        return Budget(self.scale.loop_budget_s if seconds is None else seconds)


@dataclass(frozen=True)
class System:
    """One thing a scenario measures. ``make(ctx)`` returns the scenario's adapter for it (the
    adapter protocol is defined by each scenario module)."""

    name: str
    role: str
    make: Callable[[Context], Any]
    note: str = ""
    # Scenario-specific hints, e.g. which baseline completes this system's "limit".
    meta: dict[str, Any] = field(default_factory=dict)
    # Optional packages (``benches.peers`` names) this system needs; when one is missing the
    # system is skipped, and the skip is recorded in the result and printed.
    requires: tuple[str, ...] = ()


def select_systems(
    all_systems: Sequence[System], only: Sequence[str] | None = None
) -> tuple[list[System], list[dict[str, str]]]:
    """The systems to run (``only`` filters by name) and the skip records of those whose
    optional packages are missing: ``{"system": name, "reason": why}``."""
    from benches.peers import unavailable_reason

    chosen: list[System] = []
    skipped: list[dict[str, str]] = []
    for s in all_systems:
        if only is not None and s.name not in only:
            continue
        reasons = [r for r in (unavailable_reason(p) for p in s.requires) if r]
        if reasons:
            skipped.append({"system": s.name, "reason": "; ".join(reasons)})
        else:
            chosen.append(s)
    return chosen, skipped


class SystemBudgets:
    """Per-system time caps for lockstep loops: each system's own measured time is charged to
    it, and a system whose share is spent stops (the others go on), so one slow peer can't
    starve the rest or make the run unbounded."""

    def __init__(self, names: Sequence[str], seconds: float) -> None:
        self.seconds = seconds
        self.spent = dict.fromkeys(names, 0.0)
        self.cut: dict[str, int] = {}  # name -> how many operations it had done when cut

    def charge(self, name: str, seconds: float) -> None:
        self.spent[name] += seconds

    async def sample(
        self,
        name: str,
        call: Callable[[], Awaitable[object]],
        samples: dict[str, list[float]],
        dropped: dict[str, int],
    ) -> None:
        """Times ``call()`` for system ``name`` and charges it; the time is a sample unless a
        database outage was recovered meanwhile (then it is counted in ``dropped``)."""
        mark = RECOVERIES.count
        t0 = time.perf_counter()
        await call()
        dt = time.perf_counter() - t0
        self.charge(name, dt)
        if RECOVERIES.count != mark:
            dropped[name] = dropped.get(name, 0) + 1
        else:
            samples[name].append(dt)

    def active(self, name: str, done: int) -> bool:
        if name in self.cut:
            return False
        if self.spent[name] >= self.seconds:
            self.cut[name] = done
            return False
        return True


class Budget:
    """A time cap for a loop: ``while budget.left(): ...``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def left(self) -> bool:
        return time.monotonic() < self.deadline


@contextlib.contextmanager
def temp_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A fresh directory under ``parent``, removed afterwards."""
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- timing ------------------------------------------------------------------------------------


class Timer:
    """``with Timer() as t: ...``; then ``t.s`` seconds."""

    s: float = 0.0

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self._t0


async def time_async(fn: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = await fn()
    return time.perf_counter() - t0, out


def percentile(samples_s: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples_s, dtype=np.float64), q))


def latency_stats(samples_s: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / mean in ms, the rate per second (count / total time) and flatness: the median
    of the last tenth over the median of the first tenth (at most 100 samples each; 1.0 = no
    drift, 2.0 = the calls got twice as slow)."""
    if not samples_s:
        raise ValueError("no samples")
    arr = np.asarray(samples_s, dtype=np.float64)
    window = max(1, min(100, len(arr) // 10))
    first = float(np.median(arr[:window]))
    last = float(np.median(arr[-window:]))
    return {
        "p50_ms": float(np.percentile(arr, 50)) * 1e3,
        "p99_ms": float(np.percentile(arr, 99)) * 1e3,
        "mean_ms": float(arr.mean()) * 1e3,
        "per_s": len(arr) / float(arr.sum()),
        "flatness": last / first if first > 0 else float("nan"),
        "flatness_window": float(window),
        "n": float(len(arr)),
    }


# --- data --------------------------------------------------------------------------------------

_MIX = np.int64(-7046029254386353131)  # odd 64-bit constant: key -> pseudo-random string


def make_updates(
    n: int, *, key_start: int = 0, time: int | np.ndarray = 0, seed: int = 0
) -> pa.Table:
    """``n`` updates of ``SCHEMA`` plus ``_time`` (uint64), built vectorized (no per-row Python).

    ``key`` ascends from ``key_start`` (distinct across calls with disjoint ranges); ``s`` is a
    16-char decimal string derived from the key by a multiplicative hash (so it does not sort
    like the key and compresses like an id column); ``value`` is random.
    """
    keys = np.arange(key_start, key_start + n, dtype=np.int64)
    with np.errstate(over="ignore"):
        mixed = (keys * _MIX) & np.int64((1 << 53) - 1)  # < 10**16: at most 16 digits
    s = pc.utf8_lpad(pc.cast(pa.array(mixed), pa.string()), 16, "0")
    rng = np.random.default_rng(seed + key_start)
    values = rng.integers(0, 1 << 40, size=n, dtype=np.int64)
    times = np.full(n, time, dtype=np.uint64) if np.isscalar(time) else np.asarray(time, np.uint64)
    return pa.table(
        {
            "key": pa.array(keys),
            "s": s,
            "value": pa.array(values),
            "_time": pa.array(times, type=pa.uint64()),
        }
    )


def with_time(table: pa.Table, time: int) -> pa.Table:
    """``table`` with every ``_time`` set to ``time``."""
    idx = table.schema.get_field_index("_time")
    col = pa.array(np.full(table.num_rows, time, dtype=np.uint64), type=pa.uint64())
    return table.set_column(idx, "_time", col)


# --- counting location wrappers ----------------------------------------------------------------


@dataclass
class IoCounts:
    blob_gets: int = 0
    blob_get_bytes: int = 0
    blob_sets: int = 0
    blob_set_bytes: int = 0
    blob_deletes: int = 0
    blob_lists: int = 0
    cons_heads: int = 0
    cons_cas: int = 0
    cons_cas_bytes: int = 0
    cons_scans: int = 0
    cons_scanned_entries: int = 0
    cons_scanned_bytes: int = 0
    cons_truncates: int = 0

    def snapshot(self) -> IoCounts:
        return dataclasses.replace(self)

    def minus(self, earlier: IoCounts) -> IoCounts:
        return IoCounts(
            **{
                f.name: getattr(self, f.name) - getattr(earlier, f.name)
                for f in dataclasses.fields(self)
            }
        )

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class CountingBlob(Blob):
    """A Blob that counts the calls (and bytes) going to the Blob it wraps."""

    def __init__(self, inner: Blob, counts: IoCounts | None = None) -> None:
        self.inner = inner
        self.counts = counts if counts is not None else IoCounts()

    async def get(self, key: str) -> bytes | None:
        data = await self.inner.get(key)
        self.counts.blob_gets += 1
        self.counts.blob_get_bytes += len(data) if data is not None else 0
        return data

    async def set(self, key: str, value: bytes) -> None:
        await self.inner.set(key, value)
        self.counts.blob_sets += 1
        self.counts.blob_set_bytes += len(value)

    async def delete(self, key: str) -> None:
        self.counts.blob_deletes += 1
        await self.inner.delete(key)

    async def list_keys(self, prefix: str) -> list[str]:
        self.counts.blob_lists += 1
        return await self.inner.list_keys(prefix)

    async def delete_partial_writes(self, prefix: str, older_than_s: float) -> int:
        self.counts.blob_lists += 1
        return await self.inner.delete_partial_writes(prefix, older_than_s)

    async def close(self) -> None:
        await self.inner.close()


class CountingConsensus(Consensus):
    """A Consensus that counts the calls (and entries scanned) going to the one it wraps."""

    def __init__(self, inner: Consensus, counts: IoCounts | None = None) -> None:
        self.inner = inner
        self.counts = counts if counts is not None else IoCounts()

    async def head(self, key: str) -> VersionedData | None:
        self.counts.cons_heads += 1
        return await self.inner.head(key)

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        self.counts.cons_cas += 1
        self.counts.cons_cas_bytes += len(data)
        return await self.inner.compare_and_set(key, expected_seqno, data)

    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        entries = await self.inner.scan(key, from_seqno, limit)
        self.counts.cons_scans += 1
        self.counts.cons_scanned_entries += len(entries)
        self.counts.cons_scanned_bytes += sum(len(e.data) for e in entries)
        return entries

    async def truncate(self, key: str, seqno: int) -> int:
        self.counts.cons_truncates += 1
        return await self.inner.truncate(key, seqno)

    async def close(self) -> None:
        await self.inner.close()


# --- surviving a restarted database ------------------------------------------------------------


class Recoveries:
    """Operations that had to be retried because the database connection was lost (the shared
    Postgres of the test machines is restarted by crash tests). A measuring loop compares
    ``count`` before and after an operation and drops that sample (it timed the outage, not the
    system); the runner reports the events with each scenario."""

    def __init__(self) -> None:
        self.count = 0
        self.events: list[str] = []

    def note(self, what: str, exc: BaseException) -> None:
        self.count += 1
        if len(self.events) < 50:
            stamp = time.strftime("%H:%M:%S")
            self.events.append(f"{stamp} {what}: {type(exc).__name__}: {str(exc)[:120]}")


RECOVERIES = Recoveries()
RECOVERY_ATTEMPTS = 60
RECOVERY_DELAY_S = 0.5


def _lost_connection(exc: BaseException) -> bool:
    import psycopg

    from persist.errors import ExternalError, IntegrityError

    if isinstance(exc, psycopg.OperationalError):
        return True
    return isinstance(exc, ExternalError) and not isinstance(exc, IntegrityError)


async def resilient(
    op: Callable[[], Awaitable[Any]],
    what: str,
    landed: Callable[[], Awaitable[bool]] | None = None,
) -> Any:
    """``await op()``, retried (every ``RECOVERY_DELAY_S``, for about 30 s) while it fails with a
    lost database connection (``psycopg.OperationalError``, or persist's ``ExternalError``
    after its own retries). ``landed`` says whether an attempt that failed took effect anyway
    (then it is not repeated)."""
    for attempt in range(RECOVERY_ATTEMPTS):
        try:
            return await op()
        except Exception as exc:
            if not _lost_connection(exc) or attempt == RECOVERY_ATTEMPTS - 1:
                raise
            RECOVERIES.note(what, exc)
            await asyncio.sleep(RECOVERY_DELAY_S)
            if landed is not None:
                try:
                    if await landed():
                        return None
                except Exception as again:
                    if not _lost_connection(again):
                        raise
    raise AssertionError("unreachable")


async def persist_append(write: Any, table: pa.Table, lower: int, upper: int) -> None:
    """``write.compare_and_append(table, lower, upper)``, surviving a database restart: a retry
    after an indeterminate failure that finds the upper already at ``upper`` means the first
    attempt landed (the only writer of the shard is this one)."""
    from persist.errors import UpperMismatch

    async def op() -> None:
        try:
            await write.compare_and_append(table, lower, upper)
        except UpperMismatch as exc:
            if exc.current != upper:
                raise

    await resilient(op, "compare_and_append")


class PgConn:
    """One psycopg async connection (autocommit, prepared statements) that reconnects when the
    server drops it. ``execute`` is for idempotent statements or ones whose caller checks."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.conn: Any = None

    async def connect(self) -> PgConn:
        import psycopg

        self.conn = await psycopg.AsyncConnection.connect(
            self.uri, autocommit=True, prepare_threshold=0
        )
        return self

    async def execute(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        import psycopg

        try:
            if self.conn is None or self.conn.closed:
                await self.connect()
            return await self.conn.execute(sql, params)
        except psycopg.OperationalError:
            if self.conn is not None:
                await self.conn.close()
            self.conn = None
            raise

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()
            self.conn = None


async def pg_cas_insert(
    conn: PgConn, sql: str, params: Sequence[Any], table: str, shard: str, seqno: int
) -> None:
    """A conditional INSERT of ``seqno`` that must apply, surviving a restarted server."""

    async def op() -> None:
        cur = await conn.execute(sql, params)
        if cur.rowcount != 1:
            raise RuntimeError(f"conditional insert {seqno} into {table} did not apply")

    async def landed() -> bool:
        cur = await conn.execute(f'SELECT max(seqno) FROM "{table}" WHERE shard = %s', (shard,))
        row = await cur.fetchone()
        return row is not None and row[0] == seqno

    await resilient(op, f"conditional insert into {table}", landed)


# --- Postgres helpers --------------------------------------------------------------------------


async def pg_drop_table(uri: str, table: str) -> None:
    import psycopg

    async def drop() -> None:
        async with await psycopg.AsyncConnection.connect(uri, autocommit=True) as conn:
            await conn.execute(f'DROP TABLE IF EXISTS "{table}"')

    await resilient(drop, f"dropping {table}")


async def pg_settings(uri: str) -> dict[str, str]:
    """The server settings that decide what a commit costs."""
    import psycopg

    out: dict[str, str] = {}
    try:
        async with await psycopg.AsyncConnection.connect(uri, connect_timeout=5) as conn:
            for name in ("server_version", "fsync", "synchronous_commit", "wal_sync_method"):
                cur = await conn.execute(f"SHOW {name}")
                row = await cur.fetchone()
                out[name] = str(row[0]) if row else "?"
    except Exception as exc:  # reported, not fatal: the scenarios fail loudly on their own
        out["error"] = str(exc)
    return out


# --- machine info and results ------------------------------------------------------------------


def machine_info(
    scale: str, extra: dict[str, Any] | None = None, workdir: Path | None = None
) -> dict[str, Any]:
    import persist

    try:
        import psycopg

        psycopg_version = psycopg.__version__
    except Exception:  # pragma: no cover - psycopg is a dependency
        psycopg_version = "?"
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 0
    info: dict[str, Any] = {
        "persist_git": _git_state(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "scale": scale,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "psycopg": psycopg_version,
        "persist": getattr(persist, "__version__", "?"),
        "cpu_model": _cpu_model(),
        "memory_GB": _memory_gb(),
        "disk": disk_info(workdir or Path(tempfile.gettempdir())),
        "packages": package_versions(),
    }
    if extra:
        info.update(extra)
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except (OSError, ValueError):
        pass
    return None


def disk_info(path: Path) -> dict[str, Any]:
    """The filesystem the benchmark data is written to: mount point, device, type, size."""
    out: dict[str, Any] = {"path": str(path)}
    try:
        st = os.statvfs(path)
        out["size_GB"] = round(st.f_blocks * st.f_frsize / 1e9, 1)
        out["free_GB"] = round(st.f_bavail * st.f_frsize / 1e9, 1)
    except OSError:
        pass
    try:
        real = os.path.realpath(path)
        best = ("", "?", "?")
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, dev, fstype)
        out.update(mount=best[0], device=best[1], fstype=best[2])
        dev_name = os.path.basename(best[1])
        rot = Path(f"/sys/block/{dev_name}/queue/rotational")
        if rot.exists():
            out["rotational"] = rot.read_text().strip() == "1"
    except OSError:
        pass
    return out


def package_versions() -> dict[str, str]:
    """Versions of the optional benchmark packages (``"-"`` when not installed)."""
    from importlib import metadata

    out: dict[str, str] = {}
    for name in ("deltalake", "pyiceberg", "sqlalchemy", "matplotlib", "pyinstrument", "msgspec"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def _git_state() -> dict[str, Any]:
    """The commit of the persist checkout measured, and whether ``persist/`` had local edits."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "persist"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "persist_dirty": bool(dirty)}


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def ratio_entry(
    name: str,
    value: float | None,
    formula: str,
    *,
    at_least: float | None = None,
    at_most: float | None = None,
) -> dict[str, Any]:
    """A ratio with an optional target (reported, never asserted)."""
    met: bool | None = None
    if value is not None:
        if at_least is not None:
            met = value >= at_least
        elif at_most is not None:
            met = value <= at_most
    target = None
    if at_least is not None:
        target = f">= {at_least:g}"
    elif at_most is not None:
        target = f"<= {at_most:g}"
    return {"name": name, "value": value, "formula": formula, "target": target, "met": met}


def comparison(
    figure: str,
    unit: str,
    better: str,
    subject: str,
    value: float | None,
    *,
    peers: dict[str, float | None] | None = None,
    limit: tuple[str, float | None] | None = None,
    peer_at_most: float | None = None,
    peer_at_least: float | None = None,
    limit_at_most: float | None = None,
    limit_at_least: float | None = None,
    note: str = "",
) -> dict[str, Any]:
    """One headline figure of one persist system against the best peer and the limit.

    ``better`` is ``"lower"`` (latencies, times) or ``"higher"`` (rates). Ratios are always
    ``persist / other`` of the figure itself, so for latencies < 1 means persist is faster and
    for rates > 1 means persist is faster. The best peer is the one with the best figure. A
    target (reported, never asserted) applies to the ratio vs the best peer or vs the limit.
    """
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', not {better!r}")
    known = {k: v for k, v in (peers or {}).items() if v is not None and v == v}
    best_peer: str | None = None
    if known:
        pick = min if better == "lower" else max
        best_peer = pick(known, key=lambda k: known[k])
    best_value = known.get(best_peer) if best_peer else None
    limit_name, limit_value = limit if limit else (None, None)
    vs_peer = ratio(value, best_value)
    vs_limit = ratio(value, limit_value)
    targets: list[str] = []
    met: list[bool] = []
    for bound, against, r in (
        (("<=", peer_at_most), "best peer", vs_peer),
        ((">=", peer_at_least), "best peer", vs_peer),
        (("<=", limit_at_most), "limit", vs_limit),
        ((">=", limit_at_least), "limit", vs_limit),
    ):
        op, t = bound
        if t is None:
            continue
        targets.append(f"vs {against} {op} {t:g}")
        if r is not None:
            met.append(r <= t if op == "<=" else r >= t)
    return {
        "figure": figure,
        "unit": unit,
        "better": better,
        "subject": subject,
        "value": value,
        "peers": dict(peers or {}),
        "best_peer": best_peer,
        "best_peer_value": best_value,
        "vs_best_peer": vs_peer,
        "limit": limit_name,
        "limit_value": limit_value,
        "vs_limit": vs_limit,
        "target": "; ".join(targets) or None,
        "met": (all(met) if met else None) if targets else None,
        "note": note,
    }


def write_result(out_dir: Path, name: str, result: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False, default=str) + "\n")
    return path


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:  # NaN
            return "nan"
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def render_markdown(result: dict[str, Any], comparisons: bool = True) -> str:
    """One scenario's result as Markdown: a table of systems x figures, then the ratios."""
    lines = [f"### {result['scenario']} ({result['machine']['scale']} scale)", ""]
    for title, systems in result.get("tables", {}).items():
        if title:
            lines += [f"**{title}**", ""]
        metrics: list[str] = []
        for figures in systems.values():
            for k in figures:
                if k != "role" and k not in metrics:
                    metrics.append(k)
        lines.append("| system | role | " + " | ".join(metrics) + " |")
        lines.append("|---|---|" + "---:|" * len(metrics))
        for sys_name, figures in systems.items():
            cells = [fmt(figures.get(m)) for m in metrics]
            lines.append(f"| {sys_name} | {figures.get('role', '')} | " + " | ".join(cells) + " |")
        lines.append("")
    ratios = result.get("ratios", [])
    if ratios:
        lines.append("| ratio | value | target | met | formula |")
        lines.append("|---|---:|---|---|---|")
        for r in ratios:
            lines.append(
                f"| {r['name']} | {fmt(r['value'])} | {r['target'] or ''} | "
                f"{'' if r['met'] is None else fmt(r['met'])} | {r['formula']} |"
            )
        lines.append("")
    if comparisons and result.get("comparisons"):
        lines += render_comparisons(result["comparisons"])
    for note in result.get("notes", []):
        lines.append(f"- {note}")
    for skip in result.get("skipped", []):
        lines.append(f"- SKIPPED {skip['system']}: {skip['reason']}")
    if result.get("notes") or result.get("skipped"):
        lines.append("")
    return "\n".join(lines)


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def render_comparisons(comparisons: Sequence[dict[str, Any]]) -> list[str]:
    """The headline table: each persist figure against the best peer and the limit.
    Ratios are persist / other; the arrow says which way is better."""
    lines = [
        "| figure | persist | value | best peer | peer value | persist / peer | limit | "
        "limit value | persist / limit | target | met |",
        "|---|---|---:|---|---:|---:|---|---:|---:|---|---|",
    ]
    for c in comparisons:
        arrow = "↓" if c["better"] == "lower" else "↑"
        unit = f" ({c['unit']})" if c.get("unit") else ""
        lines.append(
            f"| {c['figure']}{unit} {arrow} | {c['subject']} | {fmt(c['value'])} | "
            f"{c['best_peer'] or '-'} | {fmt(c['best_peer_value'])} | "
            f"{fmt_ratio(c['vs_best_peer'])} | {c['limit'] or '-'} | {fmt(c['limit_value'])} | "
            f"{fmt_ratio(c['vs_limit'])} | {c['target'] or ''} | "
            f"{'' if c['met'] is None else fmt(c['met'])} |"
        )
    lines += [
        "",
        "(↓ lower is better: a ratio < 1 means persist is faster; ↑ higher is better: a "
        "ratio > 1 means persist is faster)",
        "",
    ]
    notes = list(dict.fromkeys(f"{c['figure']}: {c['note']}" for c in comparisons if c.get("note")))
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    return lines


async def close_client(client: Any, timeout_s: float = 60.0) -> None:
    """``await client.close()``, bounded: a close that hangs (a persist bug) fails the scenario
    instead of the whole run."""
    try:
        await asyncio.wait_for(client.close(), timeout_s)
    except TimeoutError as exc:
        raise RuntimeError(
            f"persist client.close() did not finish within {timeout_s:g} s (a background task "
            "ignored cancellation?)"
        ) from exc


def run_in_thread(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
    return asyncio.to_thread(fn, *args)
