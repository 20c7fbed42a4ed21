"""The ``persist`` command: ``persist demo``, ``persist inspect SHARD_ID`` and ``persist serve``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import time
from typing import Any

import pyarrow as pa

import persist
from persist.client import ENV_BLOB, ENV_CONSENSUS, default_locations


def _print_table(title: str, table: pa.Table) -> None:
    print(f"  {title}:")
    rows = table.sort_by([(n, "ascending") for n in table.column_names]).to_pylist()
    for row in rows:
        print("    " + ", ".join(f"{k}={v}" for k, v in row.items()))
    if not rows:
        print("    (empty)")


async def demo(blob: str | None, consensus: str | None) -> None:
    blob_uri, consensus_uri = default_locations()
    blob_uri, consensus_uri = blob or blob_uri, consensus or consensus_uri
    print(f"persist {persist.__version__} demo")
    print(f"  blob:      {blob_uri}")
    print(f"  consensus: {consensus_uri}")
    schema = pa.schema([("user", pa.string()), ("balance", pa.int64())])
    async with await persist.connect(blob_uri, consensus_uri) as client:
        shard = persist.ShardId.new()
        write, read = await client.open(shard, schema, purpose="demo")
        print(f"opened shard {shard}: upper={write.upper} since={read.since}")

        listened: list[persist.ListenEvent] = []

        async def follow() -> None:
            async for event in read.listen(0):
                listened.append(event)
                if event.upper is not None and event.upper >= 3:
                    return

        follower = asyncio.create_task(follow())

        t0 = time.perf_counter()
        await write.compare_and_append(
            pa.table(
                {
                    "user": ["ada", "bob"],
                    "balance": [100, 50],
                    "_time": pa.array([0, 0], pa.uint64()),
                }
            ),
            expected_upper=0,
            new_upper=1,
        )
        print(
            f"t=0: inserted ada=100, bob=50 in {1000 * (time.perf_counter() - t0):.1f} ms; upper=1"
        )
        # An update is a retraction plus an insertion.
        await write.compare_and_append(
            pa.table(
                {
                    "user": ["ada", "ada", "cyd"],
                    "balance": [100, 70, 30],
                    "_time": pa.array([1, 1, 2], pa.uint64()),
                    "_diff": pa.array([-1, 1, 1], pa.int64()),
                }
            ),
            expected_upper=1,
            new_upper=3,
        )
        print("t=1: ada moved 30 to cyd (at t=2); upper=3")
        try:
            await write.compare_and_append(
                pa.table({"user": ["eve"], "balance": [1], "_time": pa.array([1], pa.uint64())}),
                expected_upper=1,
                new_upper=2,
            )
        except persist.UpperMismatch as exc:
            print(
                f"a stale writer was refused: UpperMismatch(expected={exc.expected}, current={exc.current})"
            )

        for as_of in (0, 1, 2):
            _print_table(f"contents as of {as_of}", await read.snapshot_and_fetch(as_of))

        await asyncio.wait_for(follower, timeout=10)
        print(f"listen from 0 saw {len(listened)} event(s):")
        for ev in listened:
            _print_table(f"updates below upper {ev.upper}", ev.updates)

        splits = await read.snapshot(2, num_splits=2)
        sizes = [len(s.to_bytes()) for s in splits]
        print(f"snapshot as of 2 in {len(splits)} splits ({sizes} bytes serialized)")
        await read.downgrade_since(2)
        print(f"downgraded since to {read.since}: history before 2 may now be compacted")
        print("state:", json.dumps(await client.inspect(shard), default=str))
        await write.expire()
        await read.expire()


async def inspect(shard_id: str, blob: str | None, consensus: str | None) -> None:
    blob_uri, consensus_uri = default_locations()
    async with await persist.connect(blob or blob_uri, consensus or consensus_uri) as client:
        print(json.dumps(await client.inspect(shard_id), indent=2, default=str))


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6}


def byte_size(text: str) -> int:
    """``8MiB``, ``512KiB``, ``1048576``: a size in bytes (argparse type)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"not a positive size like 8MiB: {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve shards over Arrow Flight",
        description="Serves the shards of one location over Arrow Flight until SIGTERM, then "
        "drains and exits 0 (within about --drain-grace-s + 5 s, whatever its clients do). "
        "Prints 'persist flight serving <uri>' once it accepts calls.",
    )
    p.add_argument("--blob", help=f"blob URI (default: ${ENV_BLOB} or ./persist-data/blob)")
    p.add_argument(
        "--consensus",
        help=f"consensus URI (default: ${ENV_CONSENSUS} or ./persist-data/consensus.db)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="0 picks a free port")
    p.add_argument("--token", help="bearer token every call must carry ($PERSIST_FLIGHT_TOKEN)")
    p.add_argument("--tls-cert", help="PEM certificate: serve grpc+tls (needs --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--wal-dir", default="./persist-data/wal", help="streaming writes' WAL")
    p.add_argument("--commit-interval-ms", type=float, default=50.0)
    p.add_argument("--commit-bytes", type=byte_size, default="8MiB")
    p.add_argument("--max-buffer-bytes", type=byte_size, default="64MiB")
    p.add_argument("--ticket-ttl-s", type=float, default=300.0)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus text at /metrics")
    p.add_argument(
        "--drain-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long calls in progress may go on before they are cancelled "
        "(listens end at once); a call stuck on a client that stopped reading or sending has "
        "its connection shut down then (default: 30)",
    )


def _serve(args: argparse.Namespace) -> None:
    from persist.flight import serve

    # The server's own story (recoveries, retried commits, quarantined writes, the drain) goes
    # to stderr through the "persist" logger; stdout carries only the lines a supervisor reads.
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
        )
    blob, consensus = default_locations()
    serve(
        blob=args.blob or blob,
        consensus=args.consensus or consensus,
        host=args.host,
        port=args.port,
        token=args.token,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        wal_dir=args.wal_dir,
        commit_interval_ms=args.commit_interval_ms,
        commit_bytes=args.commit_bytes,
        max_buffer_bytes=args.max_buffer_bytes,
        ticket_ttl_s=args.ticket_ttl_s,
        metrics_port=args.metrics_port,
        drain_grace_s=args.drain_grace_s,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="persist", description=persist.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("demo", "run persist end to end on the embedded default and say what it did"),
        ("inspect", "print the state of a shard"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--blob", help=f"blob URI (default: ${ENV_BLOB} or ./persist-data/blob)")
        p.add_argument(
            "--consensus",
            help=f"consensus URI (default: ${ENV_CONSENSUS} or ./persist-data/consensus.db)",
        )
        if name == "inspect":
            p.add_argument("shard_id")
    _serve_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            _serve(args)
        elif args.command == "demo":
            asyncio.run(demo(args.blob, args.consensus))
        else:
            asyncio.run(inspect(args.shard_id, args.blob, args.consensus))
    except persist.PersistError as exc:
        print(f"persist: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
