"""Programs the process and crash tests run as separate OS processes.

    python _child.py race  '{"blob": ..., "consensus": ..., "shard": ..., ...}'
    python _child.py crash '{"blob": ..., "consensus": ..., "shard": ..., ...}'

``race``: opens a writer and, once the parent creates the ``go`` file, tries ``rounds`` times to
``compare_and_append`` the next interval of the shard, recording in ``out`` (one JSON line per
attempt) what it was told: ``won``, ``lost`` (with the upper it was shown), ``unknown``
(indeterminate) or ``failed`` (determinate).

``crash``: writes forever, recording ``B`` (before) and ``A`` (after, with the outcome) lines
for every call in ``out``, and runs ``maintain`` now and then, until the parent kills it.

Lines are written with one ``os.write`` on an ``O_APPEND`` descriptor: a SIGKILL can cut the
record of a call short, never leave half a line. Rows are ``(gen, attempt, t)`` with one row at
every time of the attempt's interval, so the checker can tell whose write every time holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from typing import Any

import pyarrow as pa

import persist
from persist.location import open_blob, open_consensus
from persist.testing import Faults, FaultyBlob, FaultyConsensus, machine_config

SCHEMA = pa.schema([("gen", pa.int64()), ("attempt", pa.int64()), ("t", pa.int64())])


def rows(gen: int, attempt: int, lower: int, upper: int) -> pa.Table:
    times = list(range(lower, upper))
    return pa.table(
        {
            "gen": pa.array([gen] * len(times), pa.int64()),
            "attempt": pa.array([attempt] * len(times), pa.int64()),
            "t": pa.array(times, pa.int64()),
            "_time": pa.array(times, pa.uint64()),
        }
    )


class Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **record: Any) -> None:
        os.write(self.fd, (json.dumps(record) + "\n").encode())


async def upper_of(write: persist.WriteHandle) -> int:
    for _ in range(200):
        try:
            upper = await write.fetch_recent_upper()
            assert upper is not None
            return upper
        except persist.ExternalError:
            await asyncio.sleep(0.01)
    raise SystemExit("could not read the upper")


async def race(args: dict[str, Any]) -> None:
    rng = random.Random(args["seed"])
    faults = Faults(
        seed=args["seed"], fail_after=args["fail_after"], ops={"consensus.compare_and_set"}
    )
    # No retries: every lost commit reply reaches the racer as an indeterminate error.
    cfg = machine_config(retry_attempts=1)
    blob = FaultyBlob(open_blob(args["blob"]), faults)
    consensus = FaultyConsensus(open_consensus(args["consensus"]), faults)
    log = Log(args["out"])
    proc = args["proc"]
    async with persist.PersistClient(blob, consensus, cfg) as client:
        with faults.suspended():
            write = await client.open_writer(args["shard"], SCHEMA, f"racer {proc}")
        log.write(ready=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(args["go"]):
            if time.monotonic() > deadline:
                raise SystemExit("no go")
            await asyncio.sleep(0.005)
        expected = await upper_of(write)
        for attempt in range(args["rounds"]):
            new = expected + rng.randint(1, 3)
            record: dict[str, Any] = {"attempt": attempt, "expected": expected, "new": new}
            try:
                await write.compare_and_append(rows(proc, attempt, expected, new), expected, new)
                record["outcome"] = "won"
                expected = new
            except persist.UpperMismatch as exc:
                record["outcome"] = "lost"
                record["current"] = exc.current
                assert exc.current is not None
                expected = exc.current
            except persist.ExternalError as exc:
                record["outcome"] = "failed" if exc.determinate else "unknown"
                expected = await upper_of(write)
            log.write(**record)
        log.write(done=True, faults=faults.counts.injected)


async def crash(args: dict[str, Any]) -> None:
    rng = random.Random(args["seed"])
    gen = args["gen"]
    # Frequent rollups, so kills land in their writes too; maintenance now and then. Short
    # leases: the writers of earlier, killed generations expire, and maintenance then collects
    # what they left behind while this one writes.
    cfg = machine_config(
        rollup_interval=2, retry_attempts=5, lease_duration_s=2.0, heartbeat_interval_s=0.5
    )
    log = Log(args["out"])
    async with await persist.connect(args["blob"], args["consensus"], config=cfg) as client:
        write = await client.open_writer(args["shard"], SCHEMA, f"crash writer {gen}")
        expected = await upper_of(write)
        log.write(ready=True, upper=expected)
        attempt = 0
        while True:
            new = expected + rng.randint(1, 2)
            log.write(ev="B", attempt=attempt, expected=expected, new=new)
            try:
                await write.compare_and_append(rows(gen, attempt, expected, new), expected, new)
                log.write(ev="A", attempt=attempt, outcome="ok")
                expected = new
            except persist.UpperMismatch as exc:
                log.write(ev="A", attempt=attempt, outcome="mismatch", current=exc.current)
                assert exc.current is not None
                expected = exc.current
            except persist.ExternalError as exc:
                outcome = "failed" if exc.determinate else "unknown"
                log.write(ev="A", attempt=attempt, outcome=outcome)
                expected = await upper_of(write)
            attempt += 1
            if rng.random() < 0.2:
                log.write(ev="M")
                await client.maintain(args["shard"])


def main() -> None:
    mode, raw = sys.argv[1], sys.argv[2]
    args = json.loads(raw)
    asyncio.run({"race": race, "crash": crash}[mode](args))


if __name__ == "__main__":
    main()
