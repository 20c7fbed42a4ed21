"""Many OS processes race ``compare_and_append`` on one shard; the history must be one order.

N processes (4 at scale 1) each try a fixed number of rounds to append the next interval of the
shard, some commit replies lost on the way back (indeterminate errors), and record what they
were told. The checker then proves, from those records and the final snapshot:

- every time below the final upper holds exactly one write, once: the intervals written tile
  ``[0, upper)`` with no gap, overlap or duplicate (a single total order);
- every write a process was told it won is there, with exactly its interval; no write a process
  was told it lost (or that failed determinately) is; an indeterminate one is either way;
- the uppers shown in ``UpperMismatch`` were real uppers of that history, above the expected.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.testing import machine_config, scaled

from ._child import SCHEMA
from .conftest import Figures

CHILD = Path(__file__).with_name("_child.py")


def processes() -> int:
    return max(4, min(16, scaled(4)))


def _wait_for_lines(path: Path, count: int, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 120
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise AssertionError(f"a racer exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} has {len(lines)} lines, expected {count}")
        time.sleep(0.01)


def check_history(
    records: dict[int, list[dict[str, Any]]], final: list[dict[str, Any]], upper: int
) -> dict[str, int]:
    """Proves the acknowledged history is one total order matching the final contents."""
    # Whose write holds each time, from the data itself.
    holder: dict[int, tuple[int, int]] = {}
    for r in final:
        assert r["_diff"] == 1, f"row {r} is there {r['_diff']} times"
        assert r["_time"] == upper - 1
        assert r["t"] not in holder, f"time {r['t']} holds two writes"
        holder[r["t"]] = (r["gen"], r["attempt"])
    assert sorted(holder) == list(range(upper)), "the written times do not tile [0, upper)"
    spans: dict[tuple[int, int], list[int]] = {}
    for t, who in holder.items():
        spans.setdefault(who, []).append(t)
    landed = {who: (min(ts), max(ts) + 1) for who, ts in spans.items()}
    boundaries = {0} | {hi for _, hi in landed.values()}
    counts = {"won": 0, "lost": 0, "unknown": 0, "failed": 0, "unknown_landed": 0}
    for proc, recs in records.items():
        for rec in recs:
            who = (proc, rec["attempt"])
            interval = (rec["expected"], rec["new"])
            outcome = rec["outcome"]
            counts[outcome] += 1
            if outcome == "won":
                assert landed.get(who) == interval, f"{who} was told it won {interval}"
            elif outcome in ("lost", "failed"):
                assert who not in landed, f"{who} was told {outcome}, but its write is there"
                if outcome == "lost":
                    current = rec["current"]
                    assert current > rec["expected"], rec
                    assert current in boundaries, f"{who} was shown upper {current}, never real"
            else:
                if who in landed:
                    assert landed[who] == interval
                    counts["unknown_landed"] += 1
    # Every write in the data was attempted by a process that was told won or unknown.
    told = {
        (proc, rec["attempt"]): rec["outcome"] for proc, recs in records.items() for rec in recs
    }
    for who in landed:
        assert told.get(who) in ("won", "unknown"), (
            f"write {who} landed; it was told {told.get(who)}"
        )
    assert counts["won"] + counts["unknown_landed"] == len(landed)
    return counts


@pytest.mark.parametrize("kind", ["file+postgres", "file+sqlite"])
async def test_processes_race_compare_and_append(
    kind: str,
    location_uris: Callable[[str], tuple[str, str]],
    tmp_path: Path,
    figures: Figures,
) -> None:
    blob, consensus = location_uris(kind)
    shard = persist.ShardId.new()
    n, rounds = processes(), scaled(25)
    go = tmp_path / f"go-{kind}"
    async with await persist.connect(blob, consensus, config=machine_config()) as client:
        # A reader at since 0 keeps every time distinguishable for the checker.
        read = await client.open_leased_reader(shard, SCHEMA, "checker")
        outs = [tmp_path / f"racer-{kind}-{i}.jsonl" for i in range(n)]
        procs = []
        for i in range(n):
            args = {
                "blob": blob,
                "consensus": consensus,
                "shard": shard,
                "proc": i,
                "rounds": rounds,
                "seed": 1000 + i,
                "out": str(outs[i]),
                "go": str(go),
                "fail_after": 0.1,
            }
            procs.append(subprocess.Popen([sys.executable, str(CHILD), "race", json.dumps(args)]))
        try:
            for out in outs:
                _wait_for_lines(out, 1, procs)
            go.touch()  # all racers start together
            for p in procs:
                assert p.wait(timeout=300) == 0, f"a racer exited with {p.returncode}"
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        records: dict[int, list[dict[str, Any]]] = {}
        injected = 0
        for i, out in enumerate(outs):
            lines = [json.loads(x) for x in out.read_text().splitlines()]
            assert lines[0] == {"ready": True} and lines[-1].get("done"), lines[-1]
            injected += lines[-1]["faults"]
            records[i] = lines[1:-1]
            assert len(records[i]) == rounds
        upper = (await client.inspect(shard))["upper"]
        assert isinstance(upper, int) and upper > 0
        final = (await read.snapshot_and_fetch(upper - 1)).to_pylist()
    counts = check_history(records, final, upper)
    assert counts["won"] > 0 and counts["lost"] > 0, counts  # they did race
    figures.processes += n
    figures.operations_with_faults += n * rounds
    figures.faults_injected_after += injected
    figures.acknowledged_writes += counts["won"]
    figures.indeterminate_resolved += counts["unknown"]
    figures.note(f"{n} processes racing on {kind}", attempts=n * rounds, upper=upper, **counts)
    os.remove(go)


def test_the_checker_catches_a_broken_history() -> None:
    """The checker itself: a history that breaks each promise is refused."""

    def row(proc: int, attempt: int, t: int, diff: int = 1) -> dict[str, Any]:
        return {"gen": proc, "attempt": attempt, "t": t, "_time": 3, "_diff": diff}

    records = {
        0: [
            {"attempt": 0, "expected": 0, "new": 2, "outcome": "won"},
            {"attempt": 1, "expected": 2, "new": 3, "outcome": "lost", "current": 4},
        ],
        1: [
            {"attempt": 0, "expected": 0, "new": 1, "outcome": "lost", "current": 2},
            {"attempt": 1, "expected": 2, "new": 4, "outcome": "unknown"},
        ],
    }
    good = [row(0, 0, 0), row(0, 0, 1), row(1, 1, 2), row(1, 1, 3)]
    assert check_history(records, good, 4)["unknown_landed"] == 1
    broken = {
        "a write twice": [*good[:3], row(1, 1, 3, diff=2)],
        "a gap": good[:3],
        "a won write missing": [row(1, 1, 2), row(1, 1, 3)],
        "a lost write present": [row(0, 0, 0), row(0, 0, 1), row(0, 1, 2), row(1, 1, 3)],
        "two writes at one time": [*good, row(1, 0, 0)],
    }
    for what, final in broken.items():
        with pytest.raises(AssertionError):
            check_history(records, final, 4)
            raise RuntimeError(f"the checker accepted {what}")
    shown_unreal = {0: [records[0][0]], 1: [{**records[1][0], "current": 1}, records[1][1]]}
    with pytest.raises(AssertionError, match="never real"):
        check_history(shown_unreal, good, 4)
