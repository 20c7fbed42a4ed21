"""Writers in N OS processes (the ``scale`` scenario's process mode; ``contention``'s writers).

``run_processes(target, args, run_s)`` is the frame: process ``j`` (``multiprocessing``,
"spawn") runs ``target(*args[j], out, go)``, which sets itself up, says ready (``started``),
waits for the start event, works, and reports one ``"done"`` message (``report_done``). The
parent sets the event once every process is ready, so spawning and imports are not timed, and
reaps every process whatever happens.

``run_writers(spec, n, ...)`` starts ``n`` processes (``multiprocessing``, "spawn": nothing of
the parent's event loop, connections or threads is inherited). Process ``j`` sets itself up and
makes one untimed append (persist: its own client on ``spec``'s location, a new shard; Parquet:
its own directory ``<root>/<j>``), reports ready, and waits for the start event; the parent sets
it once every process is ready, so spawning and imports are not timed. Each then appends the
same tables as the in-process writers (``writer_tables``) and reports its latencies and the
moment its last append returned. Every process is reaped: waited for a bounded time, then
terminated, then killed.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from benches.fixtures import RECOVERIES, close_client, make_updates, persist_append, with_time
from benches.harness import Context
from benches.systems import PARQUET, ParquetFiles, PersistLocation

READY_TIMEOUT_S = 120.0  # spawn + imports + the first append, of all n processes
EXIT_TIMEOUT_S = 90.0  # a persist client's close is bounded at 60 s (``close_client``)


@dataclass(frozen=True)
class Spec:
    """Where the writer processes append: persist shards at ``PersistLocation(ctx, root,
    kind)`` (``kind`` postgres / sqlite: the same blob root and consensus table / db as a
    parent's location of that root), or Parquet files under ``root/<j>`` (``kind`` parquet)."""

    ctx: Context
    kind: str
    root: Path


def writer_tables(appends: int, rows: int) -> list[pa.Table]:
    """What each writer appends, in either mode: one untimed table, then ``appends``."""
    return [make_updates(rows, key_start=j * rows, time=0, seed=17) for j in range(appends + 1)]


async def _write(
    spec: Spec, j: int, appends: int, rows: int, budget_s: float, out: Any, go: Any
) -> None:
    tables = writer_tables(appends, rows)
    client: Any = None
    append: Callable[[int, pa.Table], Awaitable[None]]
    try:
        if spec.kind == PARQUET:
            store = ParquetFiles(spec.root / str(j))

            async def append(i: int, table: pa.Table) -> None:
                store.append(table)  # blocking: the process has nothing else to do

        else:
            loc = PersistLocation(spec.ctx, spec.root, spec.kind)
            client = await loc.connect()
            write = await loc.writer(client)
            base = write.upper
            assert base is not None

            async def append(i: int, table: pa.Table) -> None:
                at = base + i
                await persist_append(write, with_time(table, at), at, at + 1)

        await append(0, tables[0])  # creates the shard / directory, warms the connection
        if not await started(j, out, go):
            return  # the parent gave up
        deadline = time.monotonic() + budget_s
        mark = RECOVERIES.count
        lat: list[float] = []
        for i, table in enumerate(tables[1:], 1):
            if time.monotonic() >= deadline:
                break
            t0 = time.perf_counter()
            await append(i, table)
            lat.append(time.perf_counter() - t0)
        report_done(out, j, mark, lat)
    finally:
        if client is not None:
            await close_client(client)


def _child(spec: Spec, j: int, appends: int, rows: int, budget_s: float, out: Any, go: Any) -> None:
    run_child(j, out, _write(spec, j, appends, rows, budget_s, out, go))


# --- the frame: the child's side ---------------------------------------------------------------


def run_child(j: int, out: Any, main: Coroutine[Any, Any, None]) -> None:
    """Runs process ``j``'s ``main``; a failure is reported to the parent (then re-raised)."""
    try:
        asyncio.run(main)
    except BaseException:
        out.put(("error", j, traceback.format_exc()))
        raise


async def started(j: int, out: Any, go: Any) -> bool:
    """Says process ``j`` is ready and waits for the start: false when the parent gave up."""
    out.put(("ready", j))
    return bool(await asyncio.to_thread(go.wait, READY_TIMEOUT_S))


def report_done(out: Any, j: int, mark: int, *figures: Any) -> None:
    """Process ``j``'s ``"done"``: the moment its work ended, ``figures``, and the recoveries
    (lost database connections) since ``RECOVERIES.count`` was ``mark``."""
    # CLOCK_MONOTONIC is one clock for every process of the machine.
    out.put(("done", j, time.monotonic(), *figures, RECOVERIES.count - mark, RECOVERIES.events))


# --- the frame: the parent's side --------------------------------------------------------------


def _collect(out: Any, children: list[Any], tag: str, timeout_s: float) -> list[tuple[Any, ...]]:
    """One ``tag`` message of every child, by child; raises when one fails, dies or is late."""
    got: dict[int, tuple[Any, ...]] = {}
    end = time.monotonic() + timeout_s
    while len(got) < len(children):
        try:
            msg = out.get(timeout=0.5)
        except queue.Empty:
            dead = [c.exitcode for c in children if c.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"writer process(es) died (exit codes {dead})") from None
            if time.monotonic() > end:
                late = f"{len(children) - len(got)} writer process(es) not {tag}"
                raise TimeoutError(f"{late} after {timeout_s:g} s") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"writer process {msg[1]} failed:\n{msg[2]}")
        if msg[0] == tag:
            got[msg[1]] = msg
    return [got[j] for j in sorted(got)]


def _reap(children: list[Any], timeout_s: float) -> None:
    """Waits up to ``timeout_s`` for the children to exit, then terminates, then kills them."""
    end = time.monotonic() + timeout_s
    for c in children:
        c.join(max(0.0, end - time.monotonic()))
    for stop in ("terminate", "kill"):
        for c in children:
            if c.is_alive():
                getattr(c, stop)()
                c.join(5)


async def run_processes(
    target: Callable[..., None], args: Sequence[tuple[Any, ...]], run_s: float
) -> tuple[float, list[tuple[Any, ...]]]:
    """``len(args)`` processes, process ``j`` running ``target(*args[j], out, go)`` (a
    module-level function: "spawn" pickles it by name), started together once all are ready,
    expected done within ``run_s`` (plus ``EXIT_TIMEOUT_S``): the start (``time.monotonic()``)
    and every process's ``"done"`` message, by ``j``. Recoveries from a lost database connection
    in the children (the messages' last two fields) count in this process's ``RECOVERIES``."""
    mp = multiprocessing.get_context("spawn")
    out, go = mp.Queue(), mp.Event()
    children = [mp.Process(target=target, args=(*a, out, go), daemon=True) for a in args]
    ok = False
    try:
        for c in children:
            c.start()
        await asyncio.to_thread(_collect, out, children, "ready", READY_TIMEOUT_S)
        t0 = time.monotonic()
        go.set()
        done = await asyncio.to_thread(_collect, out, children, "done", run_s + EXIT_TIMEOUT_S)
        ok = True
    finally:
        # After a failure nobody waits for the rest: they are stopped at once.
        await asyncio.to_thread(_reap, children, EXIT_TIMEOUT_S if ok else 0.0)
        out.close()
    for _, j, *_, recovered, events in done:
        if recovered:  # the last ``recovered`` events are the timed work's
            RECOVERIES.count += recovered
            room = max(0, 50 - len(RECOVERIES.events))
            RECOVERIES.events += [f"writer process {j}: {e}" for e in events[-recovered:]][:room]
    return t0, done


async def run_writers(
    spec: Spec, n: int, appends: int, rows: int, budget_s: float
) -> tuple[float, list[float]]:
    """``n`` writer processes on ``spec``, each making ``appends`` appends of ``rows`` rows (or
    fewer, when ``budget_s`` runs out), started together: the wall time from the start to the
    last append returning, and every append's latency. Recoveries from a lost database
    connection in the children count in this process's ``RECOVERIES``."""
    args = [(spec, j, appends, rows, budget_s) for j in range(n)]
    t0, done = await run_processes(_child, args, budget_s)
    return max(end for _, _, end, *_ in done) - t0, [x for msg in done for x in msg[3]]


def _work_in_child(
    work: Callable[[dict[str, Any]], dict[str, Any]], spec: dict[str, Any], out: Any
) -> None:
    try:
        out.put(("ok", work(spec)))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def run_in_child(
    work: Callable[[dict[str, Any]], dict[str, Any]], spec: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """``work(spec)`` in a spawned process (a Spark session's JVM is then the bench's own);
    its result, or ``RuntimeError`` with the child's traceback, its exit code, or the timeout.
    The child is reaped however this ends. ``work`` must be a module-level function."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_work_in_child, args=(work, spec, results))
    proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                status, got = results.get(timeout=5)
                break
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"the child exited with {proc.exitcode}") from None
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"the child ran over {timeout_s:.0f}s") from None
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    if status != "ok":
        raise RuntimeError(f"the child failed:\n{got}")
    return dict(got)


def local_spark(**conf: str) -> Any:
    """A ``local[2]`` Spark session for a bench's child process (no UI, 4 GiB driver, errors
    only in the log), with ``conf`` on top."""
    import os
    import sys

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "4g")
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
