"""``persist serve`` with faults: a FlightServer over fault-injecting locations that a test
switches on and off from outside, for the Flight fault harness.

    python _flight_child.py '{"blob": URI, "consensus": URI, "control": DIR, "wal_dir": DIR,
                             "commit_interval_ms": 50, "metrics": true}'

It prints ``persist flight serving <uri>`` (and the metrics line) like ``persist serve``, and
every 10 ms looks at ``control``: a file ``outage`` holding JSON ``{"ops": [...], "before": p,
"after": q}`` makes those operations fail (``Faults.fail_before``/``fail_after``) until it is
removed. SIGTERM drains as ``persist serve`` does; SIGKILL is the crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from persist.flight import FlightServer
from persist.location import open_blob, open_consensus
from persist.testing import Faults, FaultyBlob, FaultyConsensus


async def main(cfg: dict[str, Any]) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    faults = Faults(seed=cfg.get("seed", 0))
    blob = FaultyBlob(open_blob(cfg["blob"]), faults)
    consensus = FaultyConsensus(open_consensus(cfg["consensus"]), faults)
    server = FlightServer(
        blob,
        consensus,
        port=0,
        token=cfg.get("token"),
        wal_dir=cfg["wal_dir"],
        commit_interval_ms=cfg.get("commit_interval_ms", 50),
        max_buffer_bytes=cfg.get("max_buffer_bytes", 64 << 20),
        metrics_port=0 if cfg.get("metrics") else None,
        **({"drain_grace_s": cfg["drain_grace_s"]} if "drain_grace_s" in cfg else {}),
    )
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print(f"persist flight serving {server.uri}", flush=True)
    if server.metrics_uri is not None:
        print(f"persist flight metrics at {server.metrics_uri}", flush=True)
    control = Path(cfg["control"]) / "outage"
    on = False
    said: dict[str, int] = {}
    while not stop.is_set():
        try:
            outage = json.loads(control.read_text())
        except (FileNotFoundError, ValueError):
            outage = None
        if outage is not None and not on:
            faults.ops = frozenset(outage["ops"])
            faults.fail_before = float(outage.get("before", 1.0))
            faults.fail_after = float(outage.get("after", 0.0))
            on = True
            print(f"outage on: {outage}", file=sys.stderr, flush=True)
        elif outage is None and on:
            faults.fail_before = faults.fail_after = 0.0
            on = False
            print("outage off", file=sys.stderr, flush=True)
        if faults.counts.by_op != said:
            said = _say(faults)  # as they happen: a SIGKILL may come at any time
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.01)
    faults.fail_before = faults.fail_after = 0.0
    await server.stop()
    _say(faults)


def _say(faults: Faults) -> dict[str, int]:
    counts = faults.counts
    print(
        f"faults injected: {counts.failed_before} before, {counts.failed_after} after "
        f"{json.dumps(counts.by_op)}",
        file=sys.stderr,
        flush=True,
    )
    return dict(counts.by_op)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
