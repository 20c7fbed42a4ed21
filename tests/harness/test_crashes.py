"""Crashes: writers killed with SIGKILL at random points, and PostgreSQL restarted mid-run.

After each crash the shard must open, hold every acknowledged write exactly once (and each
write whole or not at all), and take more writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import persist
from persist.location.postgres import PostgresConsensus
from persist.testing import machine_config, scaled

from ._child import SCHEMA, rows
from .conftest import Figures

CHILD = Path(__file__).with_name("_child.py")


# --- SIGKILL ------------------------------------------------------------------------------------


def read_log(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # never expected: lines are atomic
            out.append(json.loads(line))
    return out


def check_crash_history(
    logs: dict[int, list[dict[str, Any]]], final: list[dict[str, Any]], upper: int
) -> dict[str, int]:
    """Every acknowledged write is there once, whole; refused ones aren't; in-flight ones are
    whole or absent; the times written tile ``[0, upper)``."""
    holder: dict[int, tuple[int, int]] = {}
    for r in final:
        assert r["_diff"] == 1, f"row {r} is there {r['_diff']} times"
        assert r["t"] not in holder, f"time {r['t']} holds two writes"
        holder[r["t"]] = (r["gen"], r["attempt"])
    assert sorted(holder) == list(range(upper)), "the written times do not tile [0, upper)"
    spans: dict[tuple[int, int], list[int]] = {}
    for t, who in holder.items():
        spans.setdefault(who, []).append(t)
    landed = {who: (min(ts), max(ts) + 1) for who, ts in spans.items()}
    counts = {"acknowledged": 0, "refused": 0, "in_flight": 0, "in_flight_landed": 0}
    attempted: set[tuple[int, int]] = set()
    for gen, log in logs.items():
        before = {r["attempt"]: (r["expected"], r["new"]) for r in log if r.get("ev") == "B"}
        after = {r["attempt"]: r for r in log if r.get("ev") == "A"}
        for attempt, interval in before.items():
            who = (gen, attempt)
            attempted.add(who)
            told = after.get(attempt, {}).get("outcome")
            if told == "ok":
                counts["acknowledged"] += 1
                assert landed.get(who) == interval, f"acknowledged write {who} is not there"
            elif told in ("mismatch", "failed"):
                counts["refused"] += 1
                assert who not in landed, f"write {who} was refused ({told}) but is there"
            else:  # killed before it was told, or told it is unknown
                counts["in_flight"] += 1
                if who in landed:
                    counts["in_flight_landed"] += 1
                    assert landed[who] == interval, f"write {who} is there only in part"
    assert set(landed) <= attempted, "data no writer attempted"
    return counts


async def _check_shard(
    blob: str, consensus: str, shard: str, logs: dict[int, list[dict[str, Any]]]
) -> tuple[int, dict[str, int]]:
    """A fresh client: the shard opens, its contents match the logs, and a writer can open."""
    async with await persist.connect(blob, consensus, config=machine_config()) as client:
        write = await client.open_writer(shard, SCHEMA, "checker")
        upper = await write.fetch_recent_upper()
        assert isinstance(upper, int)
        info = await client.inspect(shard)
        assert info["since"] == 0  # the parent's reader holds it
        read = await client.open_leased_reader(shard, SCHEMA, "checker")
        final = (await read.snapshot_and_fetch(upper - 1)).to_pylist() if upper else []
        await read.expire()
        await write.expire()
    return upper, check_crash_history(logs, final, upper)


@pytest.mark.parametrize("kind", ["file+sqlite", "file+postgres"])
async def test_writer_killed_at_random_points(
    kind: str,
    location_uris: Callable[[str], tuple[str, str]],
    tmp_path: Path,
    figures: Figures,
) -> None:
    blob, consensus = location_uris(kind)
    shard = persist.ShardId.new()
    rng = random.Random(f"kill-{kind}")
    kills = scaled(20)
    logs: dict[int, list[dict[str, Any]]] = {}
    totals = {"acknowledged": 0, "in_flight": 0, "in_flight_landed": 0}
    async with await persist.connect(blob, consensus, config=machine_config()) as client:
        # Held for the whole test: since stays 0, so every write stays distinguishable.
        holder = await client.open_leased_reader(shard, SCHEMA, "since holder")
        for gen in range(kills):
            out = tmp_path / f"crash-{kind}-{gen}.jsonl"
            args = {
                "blob": blob,
                "consensus": consensus,
                "shard": shard,
                "gen": gen,
                "seed": rng.randrange(2**32),
                "out": str(out),
            }
            proc = subprocess.Popen([sys.executable, str(CHILD), "crash", json.dumps(args)])
            try:
                deadline = time.monotonic() + 60
                while not (out.exists() and out.read_text()):
                    assert proc.poll() is None, f"the writer exited with {proc.returncode}"
                    assert time.monotonic() < deadline, "the writer never got ready"
                    await asyncio.sleep(0.01)
                # A random point of its write path: a few dozen writes and maintenance runs.
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                assert proc.poll() is None, f"the writer exited with {proc.returncode}"
                proc.send_signal(signal.SIGKILL)
                assert proc.wait(timeout=30) == -signal.SIGKILL
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            logs[gen] = read_log(out)
            upper, counts = await _check_shard(blob, consensus, shard, logs)
            figures.crashes_survived += 1
            figures.processes += 1
        for key in totals:
            totals[key] = counts[key]
        # After the last crash, writing goes on.
        write = await client.open_writer(shard, SCHEMA, "after the crashes")
        await write.compare_and_append(rows(kills, 0, upper, upper + 1), upper, upper + 1)
        logs[kills] = [
            {"ev": "B", "attempt": 0, "expected": upper, "new": upper + 1},
            {"ev": "A", "attempt": 0, "outcome": "ok"},
        ]
        await holder.expire()
    final_upper, final_counts = await _check_shard(blob, consensus, shard, logs)
    assert final_upper == upper + 1
    assert final_counts["acknowledged"] == totals["acknowledged"] + 1
    assert totals["acknowledged"] > kills, totals  # the writers got work done between kills
    figures.acknowledged_writes += final_counts["acknowledged"]
    figures.note(f"SIGKILL of a writer on {kind}", kills=kills, **totals)


# --- PostgreSQL restart -------------------------------------------------------------------------


def _cluster() -> tuple[str, str]:
    """(version, cluster) of the local PostgreSQL this machine kind runs."""
    versions = sorted(os.listdir("/etc/postgresql"), key=lambda v: [int(x) for x in v.split(".")])
    for version in reversed(versions):
        if os.path.isdir(f"/etc/postgresql/{version}/main"):
            return version, "main"
    raise AssertionError(f"no PostgreSQL cluster 'main' under /etc/postgresql ({versions})")


def _pg_ctl(action: str) -> None:
    version, cluster = _cluster()
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, cluster, action],
        check=True,
        timeout=120,
        capture_output=True,
    )


def _accepts(uri: str) -> bool:
    try:
        with psycopg.connect(uri, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def _ensure_running(uri: str) -> None:
    """Starts PostgreSQL if it is not up, and waits until it accepts connections."""
    deadline = time.monotonic() + 120
    while not _accepts(uri):
        with contextlib.suppress(subprocess.CalledProcessError):
            _pg_ctl("start")
        if time.monotonic() > deadline:
            raise AssertionError("PostgreSQL does not come back up")
        time.sleep(0.2)


@pytest.fixture
def restartable_postgres(postgres_uri: str) -> Iterator[str]:
    """The Postgres URI; whatever the test does, PostgreSQL is running when it ends."""
    _cluster()
    try:
        yield postgres_uri
    finally:
        _ensure_running(postgres_uri)


async def test_postgres_restart_during_writes(
    restartable_postgres: str, tmp_path: Path, figures: Figures
) -> None:
    """A writer keeps writing while PostgreSQL is stopped and started again under it; the same
    client (its connection pool) recovers, and no acknowledged write is lost or doubled."""
    uri = restartable_postgres
    restarts = scaled(1)
    blob = (tmp_path / "blob").as_uri()
    shard = persist.ShardId.new()
    cfg = machine_config(retry_attempts=2, retry_initial_delay_s=0.05)
    # A short pool timeout, so that the outage reaches the writer as errors (with the default
    # 30 s, calls would just wait for the server to come back).
    consensus = PostgresConsensus(uri, timeout=0.5)
    acked: list[tuple[int, int]] = []
    outcomes = {"errors": 0, "indeterminate": 0, "landed": 0}
    stop = asyncio.Event()
    async with await persist.connect(blob, consensus, config=cfg) as client:
        write, read = await client.open(shard, SCHEMA, "restart")

        async def upper_now() -> int:
            for _ in range(600):
                try:
                    upper = await write.fetch_recent_upper()
                    assert isinstance(upper, int)
                    return upper
                except persist.ExternalError as exc:
                    assert exc.determinate, f"a read failed indeterminately: {exc}"
                    await asyncio.sleep(0.1)
            raise AssertionError("the upper could not be read for a minute")

        async def writer() -> None:
            e, attempt = 0, 0
            while not stop.is_set():
                try:
                    await write.compare_and_append(rows(0, attempt, e, e + 1), e, e + 1)
                    landed = True
                except persist.ExternalError as exc:
                    outcomes["errors"] += 1
                    actual = await upper_now()
                    if exc.determinate:
                        assert actual == e, "a determinate failure had moved the upper"
                    else:
                        outcomes["indeterminate"] += 1
                        assert actual in (e, e + 1)
                    landed = actual == e + 1
                    outcomes["landed"] += landed
                    await asyncio.sleep(0.05)
                if landed:
                    acked.append((attempt, e))
                    e += 1
                attempt += 1

        async def acks(count: int, within_s: float) -> None:
            deadline = time.monotonic() + within_s
            while len(acked) < count:
                assert not task.done(), task.exception()
                assert time.monotonic() < deadline, f"{len(acked)} of {count} writes in time"
                await asyncio.sleep(0.02)

        task = asyncio.create_task(writer())
        try:
            await acks(20, 60)
            for _ in range(restarts):
                errors = outcomes["errors"]
                await asyncio.to_thread(_pg_ctl, "stop")
                try:
                    assert not await asyncio.to_thread(_accepts, uri)
                    # The writer runs into the outage: its call fails (after persist's own
                    # retries), then it waits in its read of the upper for the server.
                    for _ in range(1500):
                        if outcomes["errors"] > errors:
                            break
                        await asyncio.sleep(0.02)
                finally:
                    await asyncio.to_thread(_pg_ctl, "start")
                    await asyncio.to_thread(_ensure_running, uri)
                assert outcomes["errors"] > errors, "the outage never reached the writer"
                await acks(len(acked) + 20, 120)  # the same client's pool recovered
                figures.postgres_restarts_survived += 1
        finally:
            stop.set()
            await asyncio.wait_for(task, 120)
        upper = await upper_now()
        assert upper == len(acked)
        final = (await read.snapshot_and_fetch(upper - 1)).to_pylist()
    by_time = {r["t"]: (r["attempt"], r["_diff"]) for r in final}
    assert len(final) == upper and sorted(by_time) == list(range(upper))
    for attempt, t in acked:
        assert by_time[t] == (attempt, 1), f"acknowledged write {attempt} at {t}"
    figures.acknowledged_writes += len(acked)
    figures.operations_with_faults += outcomes["errors"]
    figures.indeterminate_resolved += outcomes["indeterminate"]
    figures.note("PostgreSQL restart", restarts=restarts, acknowledged=len(acked), **outcomes)


def test_the_crash_checker_catches_a_broken_history() -> None:
    def row(gen: int, attempt: int, t: int, diff: int = 1) -> dict[str, Any]:
        return {"gen": gen, "attempt": attempt, "t": t, "_time": 2, "_diff": diff}

    logs = {
        0: [
            {"ev": "B", "attempt": 0, "expected": 0, "new": 2},
            {"ev": "A", "attempt": 0, "outcome": "ok"},
            {"ev": "B", "attempt": 1, "expected": 2, "new": 3},  # killed in flight
        ],
        1: [
            {"ev": "B", "attempt": 0, "expected": 2, "new": 3},
            {"ev": "A", "attempt": 0, "outcome": "mismatch", "current": 3},
        ],
    }
    good = [row(0, 0, 0), row(0, 0, 1), row(0, 1, 2)]
    counts = check_crash_history(logs, good, 3)
    assert counts == {"acknowledged": 1, "refused": 1, "in_flight": 1, "in_flight_landed": 1}
    broken = {
        "an acknowledged write lost": [row(0, 1, 2)],
        "an acknowledged write doubled": [row(0, 0, 0, 2), row(0, 0, 1), row(0, 1, 2)],
        "a refused write present": [row(0, 0, 0), row(0, 0, 1), row(1, 0, 2)],
        "an in-flight write in part": [row(0, 0, 0), row(0, 0, 1), row(0, 1, 2), row(0, 1, 3)],
        "data nobody wrote": [row(0, 0, 0), row(0, 0, 1), row(5, 5, 2)],
    }
    for what, final in broken.items():
        upper = max(r["t"] for r in final) + 1
        with pytest.raises(AssertionError):
            check_crash_history(logs, final, upper)
            raise RuntimeError(f"the checker accepted {what}")
