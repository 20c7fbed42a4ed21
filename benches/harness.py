"""The harness every scenario runs on: scales, the run context, systems, lock-step rounds,
timing, statistics, result rows and the ratios against baselines.

A scenario declares only what is particular to it: its systems (``System``: a name, a role and
``make(ctx)`` returning an adapter), the op each round times, and its figures. ``Run`` does the
rest: adapters, lock-step rounds, repetitions, samples, rows, comparisons and the result.

- Roles: ``subject`` (persist), ``baseline`` (the plain thing persist is compared with: a bare
  Parquet write, a bare SQL statement) or ``peer`` (another table format, compared like
  persist). Every system reports the same figures.
- Speed is always shown as a ratio against a system measured in the same run: the machine is
  shared and noisy, absolute numbers are only context. Targets are reported, never asserted.
- Every loop is bounded in count and in time; a system stopped by its time budget says where
  (``cut_at``), and a sample that timed a database outage is dropped (``dropped_samples``).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from benches.fixtures import RECOVERIES
from benches.reporting.machine import machine_info

T = TypeVar("T")

SUBJECT = "subject"
BASELINE = "baseline"
PEER = "peer"


@dataclass(frozen=True)
class Scale:
    """How big each scenario runs. The defaults are ``full``, the reference; ``quick`` divides
    its counts so the whole run takes a few minutes; ``smoke`` only proves the code paths work."""

    name: str
    small_appends: int = 1000
    small_rows: int = 1000
    bulk_rows: int = 10_000_000
    bulk_batches: int = 10  # the "N appends of rows/N" comparison
    bulk_write_repeats: int = 3
    bulk_read_repeats: int = 3
    open_batches: int = 10_000
    open_repeats: int = 15
    # The time cap of any one measured loop (seconds); in lock-step loops, of each system's share.
    loop_budget_s: float = 300.0
    cas_ops: int = 5000
    # scale: one-row appends per shard as it grows, points sampled on the way, opens per point
    scale_batches: int = 10_000
    scale_points: int = 10
    scale_open_repeats: int = 3
    # scale: concurrent writers (each on its own shard) and appends per writer
    scale_writers: tuple[int, ...] = (1, 2, 4, 8)
    scale_writer_appends: int = 100
    # listen: processes x listeners waiting on one idle shard, and how long they are counted
    idle_processes: int = 10
    idle_listeners: int = 10
    idle_window_s: float = 10.0
    # contention: writer processes racing on ONE shard, the window each N runs for, and the
    # attempts a writer makes at most in it (bounded in time and in count)
    contention_writers: tuple[int, ...] = (1, 2, 4, 8)
    contention_window_s: float = 5.0
    contention_attempts: int = 20_000
    # spark: rows of the shard read and written through Spark (local[2]), timed repeats each
    spark_rows: int = 10_000_000
    spark_repeats: int = 3
    # flight: rows of the DoGet shard and its timed repeats; lock-step DoPuts of 1,000 rows;
    # pipelined 1-row streaming writes; seconds of writes offered at 1,000/s
    flight_rows: int = 10_000_000
    flight_repeats: int = 3
    flight_puts: int = 2000
    flight_stream_writes: int = 30_000
    flight_paced_s: float = 5.0
    # flight: 1-row writes streamed (pipelined) while the server's RSS is sampled
    flight_soak_writes: int = 1_000_000
    # tpch: the TPC-H scale factor (tpchgen-cli) of the data Spark queries, its timed rounds of
    # every query on every system, and the seconds after which no further round starts
    tpch_scale_factor: float = 1.0
    tpch_repeats: int = 3
    tpch_budget_s: float = 1200.0
    # the queries run (empty: every one of ``tpch.queries``)
    tpch_queries: tuple[str, ...] = ()
    # load: the TPC-H scale factor loaded, the rows of each append, the rounds (every system
    # loads every table in each) and the seconds after which no further round starts
    load_scale_factor: float = 1.0
    load_chunk_rows: int = 1_000_000
    load_repeats: int = 3
    load_budget_s: float = 1200.0


SCALES: dict[str, Scale] = {
    "full": Scale("full"),
    "quick": Scale(
        "quick",
        small_appends=100,
        bulk_rows=1_000_000,
        bulk_write_repeats=2,
        open_batches=1000,
        open_repeats=7,
        loop_budget_s=20.0,
        cas_ops=1000,
        scale_batches=1000,
        scale_points=5,
        scale_writer_appends=20,
        idle_processes=5,
        idle_listeners=10,
        idle_window_s=5.0,
        contention_window_s=2.0,
        contention_attempts=5000,
        spark_rows=1_000_000,
        spark_repeats=2,
        flight_rows=1_000_000,
        flight_repeats=2,
        flight_puts=300,
        flight_stream_writes=10_000,
        flight_paced_s=2.0,
        flight_soak_writes=200_000,
        tpch_scale_factor=0.1,
        tpch_repeats=2,
        tpch_budget_s=300.0,
        load_scale_factor=0.1,
        load_chunk_rows=100_000,
        load_budget_s=180.0,
    ),
    "smoke": Scale(
        "smoke",
        small_appends=12,
        small_rows=200,
        bulk_rows=10_000,
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
        idle_processes=2,
        idle_listeners=2,
        idle_window_s=1.0,
        contention_writers=(1, 2),
        contention_window_s=1.0,
        contention_attempts=500,
        spark_rows=20_000,
        spark_repeats=1,
        flight_rows=20_000,
        flight_repeats=1,
        flight_puts=20,
        flight_stream_writes=500,
        flight_paced_s=0.5,
        flight_soak_writes=5_000,
        tpch_scale_factor=0.01,
        tpch_repeats=0,  # the warm-up checks every answer; smoke proves paths, not speed
        tpch_budget_s=60.0,
        # One query of each shape (a scan and aggregate, a join with order and limit, a
        # filter, a join with case): the paths, in a third of the time of all of them.
        tpch_queries=("Q1", "Q3", "Q6", "Q14"),
        load_scale_factor=0.01,
        load_chunk_rows=10_000,
        load_repeats=1,
        load_budget_s=30.0,
    ),
}


@dataclass
class Context:
    """What a scenario gets from the runner."""

    scale: Scale
    postgres_uri: str
    workdir: Path  # a fresh directory for this scenario; removed by the runner afterwards
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    verbose: bool = True

    def log(self, msg: str) -> None:
        if self.verbose:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def table_name(self, base: str) -> str:
        """A Postgres table name unique to this run (concurrent runs never collide)."""
        return f"{base}_{self.run_id}"

    def deadline(self, seconds: float | None = None) -> float:
        """The ``time.monotonic()`` at which a loop capped at ``seconds`` (by default
        ``loop_budget_s``) stops."""
        return time.monotonic() + (self.scale.loop_budget_s if seconds is None else seconds)


@dataclass(frozen=True)
class System:
    """One thing a scenario measures: ``make(ctx, ...)`` returns the scenario's adapter for it
    (or an awaitable of it)."""

    name: str
    role: str
    make: Callable[..., Any]
    # Scenario-specific hints, e.g. which baseline is this system's limit.
    meta: dict[str, Any] = field(default_factory=dict)
    # Optional packages (``benches.peers`` names) it needs; when one is missing the system is
    # skipped, and the skip is recorded in the result and printed.
    requires: tuple[str, ...] = ()


def select_systems(all_systems: Sequence[System]) -> tuple[list[System], list[dict[str, str]]]:
    """The systems to run and the skip records of those whose optional packages are missing:
    ``{"system": name, "reason": why}``."""
    import benches.peers  # looked up at call time, so a test can pretend one is missing

    chosen: list[System] = []
    skipped: list[dict[str, str]] = []
    for s in all_systems:
        reasons = [r for r in map(benches.peers.unavailable_reason, s.requires) if r]
        if reasons:
            skipped.append({"system": s.name, "reason": "; ".join(reasons)})
        else:
            chosen.append(s)
    return chosen, skipped


async def timed(op: Awaitable[T], collect: bool = False) -> tuple[float, T]:
    """The seconds ``op`` took, and its result. ``collect`` runs the garbage collector first, so
    garbage the previous step left is not collected inside this one."""
    if collect:
        gc.collect()
    t0 = time.perf_counter()
    out = await op
    return time.perf_counter() - t0, out


def latency_stats(samples_s: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / mean in ms, the rate per second (count / total time) and flatness: the median
    of the last tenth over the median of the first tenth (at most 100 samples each; 1.0 = no
    drift, 2.0 = the calls got twice as slow)."""
    if not samples_s:
        raise ValueError("no samples")
    arr = np.asarray(samples_s, dtype=np.float64)
    window = max(1, min(100, len(arr) // 10))
    first = float(np.median(arr[:window]))
    return {
        "p50_ms": float(np.percentile(arr, 50)) * 1e3,
        "p99_ms": float(np.percentile(arr, 99)) * 1e3,
        "mean_ms": float(arr.mean()) * 1e3,
        "per_s": len(arr) / float(arr.sum()),
        "flatness": float(np.median(arr[-window:])) / first if first > 0 else float("nan"),
        "flatness_window": float(window),
        "n": float(len(arr)),
    }


def column(table: Mapping[str, Mapping[str, Any]], key: str) -> dict[str, Any]:
    """One figure of every system of a table."""
    return {name: row.get(key) for name, row in table.items()}


class Run(contextlib.AbstractAsyncContextManager["Run"]):
    """One scenario's run over its systems. ``async with`` closes the adapters (their extra
    figures land in ``extras``, and in every ``row``)."""

    def __init__(self, ctx: Context, name: str, systems: Sequence[System]) -> None:
        chosen, self.skipped = select_systems(systems)
        self.ctx, self.name = ctx, name
        self.systems = {s.name: s for s in chosen}
        self.roles = {s.name: s.role for s in chosen}
        self.adapters: dict[str, Any] = {}
        self.extras: dict[str, dict[str, Any]] = {}
        self.samples: dict[str, list[float]] = {n: [] for n in self.roles}
        self.dropped: dict[str, int] = {}
        self.spent = dict.fromkeys(self.roles, 0.0)
        self.cut: dict[str, int] = {}  # system -> the rounds it had done when its budget ran out

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def names(self, *roles: str) -> list[str]:
        return [n for n, r in self.roles.items() if not roles or r in roles]

    def log(self, msg: str) -> None:
        self.ctx.log(f"{self.name}: {msg}")

    async def make(self, name: str, *args: Any) -> Any:
        """A new adapter of system ``name`` (its ``make`` returns one, or an awaitable of one)."""
        made = self.systems[name].make(self.ctx, *args)
        return await made if inspect.isawaitable(made) else made

    async def open(self) -> None:
        for name in self.systems:
            self.adapters[name] = await self.make(name)

    async def close(self) -> None:
        adapters, self.adapters = self.adapters, {}
        for name, adapter in adapters.items():
            self.extras[name] = await adapter.close() or {}

    def count(self, name: str) -> int:
        """The ops system ``name`` did in lock-step rounds, dropped samples included."""
        return len(self.samples[name]) + self.dropped.get(name, 0)

    async def charge(self, name: str, op: Awaitable[T]) -> tuple[float, T, bool]:
        """Awaits ``op`` for system ``name``, charging its time to that system's budget: the
        seconds, the result, and whether the time is a clean sample (false when a lost database
        connection was recovered meanwhile: then it timed the outage, not the system)."""
        mark = RECOVERIES.count
        dt, out = await timed(op)
        self.spent[name] += dt
        return dt, out, RECOVERIES.count == mark

    async def lockstep(
        self,
        n: int,
        data: Callable[[int], Any] = lambda i: None,
        op: Callable[[Any, int, Any], Awaitable[object]] = lambda a, i, x: a.append(i, x),
        *,
        after: Callable[[int, list[str]], Awaitable[None]] | None = None,
        together: bool = False,
    ) -> int:
        """Up to ``n`` rounds; in round ``i`` every active system does ``op(adapter, i,
        data(i))`` in turn (the data is made once per round, untimed), timed into ``samples``:
        noise on the shared machine hits them alike.

        A system whose own measured time reaches ``loop_budget_s`` stops (``cut``) while the
        others go on, so one slow peer can't starve the rest or make the run unbounded; with
        ``together`` all stop then (they are compared at equal counts). ``after(i, active)``
        runs after each round. Returns the rounds done."""
        budget = self.ctx.scale.loop_budget_s
        done = 0
        for i in range(n):
            live = [m for m in self.roles if m not in self.cut]
            spent = [m for m in live if self.spent[m] >= budget]
            self.cut.update(dict.fromkeys(live if together and spent else spent, i))
            active = [m for m in live if m not in self.cut]
            if not active:
                break
            x = data(i)
            for name in active:
                dt, _, clean = await self.charge(name, op(self.adapters[name], i, x))
                if clean:
                    self.samples[name].append(dt)
                else:
                    self.dropped[name] = self.dropped.get(name, 0) + 1
            done += 1
            if after is not None:
                await after(i, active)
            if done % max(10, n // 10) == 0:
                self.log(f"{done}/{n} rounds")
        for name, at in self.cut.items():
            self.log(f"{name} stopped by its time budget after {at} rounds")
        return done

    async def repeat(self, times: int, body: Callable[[int], Awaitable[None]]) -> None:
        """``body(rep)`` (one round over the systems, interleaved) up to ``times`` times; after
        the first, only while ``loop_budget_s`` of wall time lasts."""
        deadline = self.ctx.deadline()
        for rep in range(times):
            if rep and time.monotonic() >= deadline:
                return
            await body(rep)

    async def read_back(
        self, kinds: dict[str, int | None], rows: Callable[[str, str], int], times: int
    ) -> dict[str, dict[str, list[float]]]:
        """Reads every system's table back, for each kind (``adapter.read(after)``: ``None``
        is the latest version, ``k`` the version right after append ``k``): once untimed (warms
        the page cache; a system that has no such version gives ``None`` and is left out), then
        ``times`` timed rounds, interleaved. Every read must hold ``rows(name, kind)`` rows.
        Returns the seconds, by system and kind."""
        out: dict[str, dict[str, list[float]]] = {}

        async def read(name: str, kind: str, collect: bool) -> tuple[float, bool]:
            dt, got = await timed(self.adapters[name].read(kinds[kind]), collect)
            if got is not None and got.num_rows != rows(name, kind):
                raise RuntimeError(f"{name} {kind} read {got.num_rows} of {rows(name, kind)} rows")
            return dt, got is not None

        for name in self.adapters:
            for kind in kinds:
                if (await read(name, kind, False))[1]:
                    out.setdefault(name, {})[kind] = []

        async def round_(rep: int) -> None:
            for name, times_of in out.items():
                for kind, xs in times_of.items():
                    xs.append((await read(name, kind, True))[0])
            first = next(iter(kinds))
            self.log(
                f"read round {rep + 1}: "
                + ", ".join(f"{n} {k[first][-1]:.2f}s" for n, k in out.items())
            )

        await self.repeat(times, round_)
        return out

    def row(self, name: str, **figures: Any) -> dict[str, Any]:
        """A table row of system ``name``: its role, ``figures``, then its adapter's extras."""
        return {"role": self.roles[name], **figures, **self.extras.get(name, {})}

    def latency_row(self, name: str, rate: str, count: str) -> dict[str, Any]:
        """The row of a system's lock-step samples: p50, p99, mean, ``rate`` per second,
        flatness, the ``count`` of ops, and where it was cut or dropped samples."""
        st = latency_stats(self.samples[name])
        figures = {k: st[k] for k in ("p50_ms", "p99_ms", "mean_ms")}
        figures |= {rate: st["per_s"], "flatness": st["flatness"], count: self.count(name)}
        figures |= {"cut_at": self.cut[name]} if name in self.cut else {}
        figures |= {"dropped_samples": self.dropped[name]} if name in self.dropped else {}
        return self.row(name, **figures)

    def samples_ms(self) -> dict[str, list[float]]:
        return {k: [round(x * 1e3, 4) for x in v] for k, v in self.samples.items()}

    def compare(
        self,
        figure: str,
        unit: str,
        subject: str,
        values: Mapping[str, float | None],
        limit: str | tuple[str, float | None] | None = None,
        target: tuple[str, str, float] | None = None,
        note: str = "",
    ) -> dict[str, Any]:
        """One headline figure (``values``, by system) of persist system ``subject`` against
        the best of this run's peers and ``limit`` (a system, or a name and a value).

        Lower is better for times (``unit`` ms or s), higher for rates. Ratios are always
        ``persist / other`` of the figure itself, so for times < 1 means persist is faster and
        for rates > 1 means persist is faster. A ``target`` (reported, never asserted) bounds
        the ratio vs the best peer or vs the limit: ``("best peer" | "limit", "<=" | ">=",
        bound)``."""
        if isinstance(limit, str):
            limit = (limit, values[limit]) if limit in values else None
        limit_name, limit_value = limit or (None, None)
        peers = {p: values[p] for p in self.names(PEER) if p in values}
        better = "lower" if unit in ("ms", "s") else "higher"
        known = {k: v for k, v in peers.items() if v is not None and v == v}
        pick = min if better == "lower" else max
        best = pick(known, key=known.__getitem__) if known else None
        value, best_value = values[subject], known[best] if best else None
        vs_peer, vs_limit = ratio(value, best_value), ratio(value, limit_value)
        met = None
        if target is not None:
            against, op, bound = target
            r = vs_peer if against == "best peer" else vs_limit
            met = None if r is None else r <= bound if op == "<=" else r >= bound
        return {
            "figure": figure,
            "unit": unit,
            "better": better,
            "subject": subject,
            "value": value,
            "peers": peers,
            "best_peer": best,
            "best_peer_value": best_value,
            "vs_best_peer": vs_peer,
            "limit": limit_name,
            "limit_value": limit_value,
            "vs_limit": vs_limit,
            "target": f"vs {target[0]} {target[1]} {target[2]:g}" if target else None,
            "met": met,
            "note": note,
        }

    async def result(self, **parts: Any) -> dict[str, Any]:
        """The scenario's result: ``parts`` (params, tables, ratios, comparisons, notes, raw
        samples, ...), the skipped systems and the machine."""
        machine = await machine_info(self.ctx.scale.name, self.ctx.postgres_uri, self.ctx.workdir)
        return {"scenario": self.name, **parts, "skipped": self.skipped, "machine": machine}


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def versus(
    table: Mapping[str, Mapping[str, Any]],
    key: str,
    a: str,
    b: str,
    label: str,
    name: str | None = None,
    formula: str | None = None,
    **target: float | None,
) -> dict[str, Any]:
    """The ratio of system ``a``'s figure ``key`` to system ``b``'s (``None`` when ``b`` has no
    row), named ``"<a> <label> vs <b> <label>"`` unless ``name`` is given."""
    value = ratio(table[a][key], table[b][key]) if b in table else None
    name = name or f"{a} {label} vs {b} {label}"
    return ratio_entry(name, value, formula or f"{label}({a}) / {label}({b})", **target)


def own_target(row: dict[str, Any]) -> dict[str, Any]:
    """Marks a ratio row whose target the docs page lists even in a scenario with comparisons
    (an absolute target of the issue's, say, which no comparison carries)."""
    return {**row, "own_target": True}


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
    target = None
    if at_least is not None:
        target, met = f">= {at_least:g}", None if value is None else value >= at_least
    elif at_most is not None:
        target, met = f"<= {at_most:g}", None if value is None else value <= at_most
    return {"name": name, "value": value, "formula": formula, "target": target, "met": met}
