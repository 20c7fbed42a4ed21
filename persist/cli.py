"""The ``persist`` command: a demo, a shard's life from the shell (list, inspect, rename, drop,
maintain, export) and ``persist serve``. Every ``S`` is a shard id or a name."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

import persist
from persist.client import ENV_BLOB, ENV_CONSENSUS, default_locations
from persist.core.arrow.predicates import check_predicate
from persist.location import redact


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
    print(f"  blob:      {redact(blob_uri)}")
    print(f"  consensus: {redact(consensus_uri)}")
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
        history = await client.history(shard)
        print(f"history: {[(h['seqno'], h['upper'], h['rows_added']) for h in history]}")
        retention = (await client.inspect(shard))["retention_s"]
        print(f"retention {retention} s: everything readable in that window stays readable")
        await client.set_retention(shard, None)
        await read.downgrade_since(2)
        print("retention None, since downgraded to 2: history before 2 may now be compacted")
        print("state:", json.dumps(await client.inspect(shard), default=str))
        await write.expire()
        await read.expire()


async def _with_client(args: argparse.Namespace) -> None:
    blob_uri, consensus_uri = default_locations()
    blob, consensus = args.blob or blob_uri, args.consensus or consensus_uri
    async with await persist.connect(blob, consensus) as client:
        await _COMMANDS[args.command][1](client, args)


def _json(value: object) -> None:
    print(json.dumps(value, indent=2, default=str))


async def _inspect(client: persist.PersistClient, args: argparse.Namespace) -> None:
    _json(await client.inspect(args.shard, storage=True))


async def _list(client: persist.PersistClient, args: argparse.Namespace) -> None:
    shards = await client.list_shards(args.prefix)
    if args.json:
        _json(shards)
        return
    cols = ("name", "shard_id", "since", "upper", "rows", "bytes")
    lines = [cols] + [tuple(str(e.get(c, "?")) for c in cols) for e in shards]
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
    for line in lines:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
    for e in shards:
        if "error" in e:
            print(f"{e['name']}: {e['error']}", file=sys.stderr)


async def _retention_cmd(client: persist.PersistClient, args: argparse.Namespace) -> None:
    if args.seconds is not _UNSET:
        await client.set_retention(args.shard, args.seconds)
    print(json.dumps({"retention_s": (await client.inspect(args.shard))["retention_s"]}))


async def _du(client: persist.PersistClient, args: argparse.Namespace) -> None:
    _json(await client.storage(args.shard))


async def _history(client: persist.PersistClient, args: argparse.Namespace) -> None:
    _json(await client.history(args.shard))


async def _schema(client: persist.PersistClient, args: argparse.Namespace) -> None:
    versions = await client.schemas(args.shard)
    made = _schema_times(await client.history(args.shard), len(versions))
    shown: list[dict[str, Any]] = [
        {
            "version": number,
            "at": made.get(number),
            "current": number == versions[-1][0],
            "fields": [
                {"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema
            ],
        }
        for number, schema in versions
    ]
    if args.json:
        _json(shown)
        return
    for version in shown:
        at = version["at"]
        when = f"  made {at.isoformat()}" if at is not None else ""
        current = " (current)" if version["current"] else ""
        print(f"version {version['version']}{current}{when}")
        for f in version["fields"]:
            print(f"  {f['name']}: {f['type']}{'' if f['nullable'] else ' NOT NULL'}")


def _schema_times(history: list[dict[str, Any]], count: int) -> dict[int, datetime.datetime]:
    """When each schema version was made, where the history says so plainly: version 0 at the
    shard's creation (its first commit, seqno 1), each later one at its "evolve schema" commit,
    in order. Where that is not sure (history beyond the retention, or several commits kept as
    one entry), the time is left out rather than guessed."""
    made: dict[int, datetime.datetime] = {}
    if history and history[0]["seqno"] == 1:
        made[0] = history[0]["at"]
    evolutions = [
        h
        for h in history
        if h["purpose"] == "evolve schema"
        and h["commits"] == 1
        and h["rows_added"] == h["rows_retracted"] == 0
    ]
    if len(evolutions) == count - 1:
        made.update({n: h["at"] for n, h in enumerate(evolutions, start=1)})
    return made


async def _rename(client: persist.PersistClient, args: argparse.Namespace) -> None:
    await client.rename_shard(args.shard, args.new_name)
    print(f"{args.shard} is now named {args.new_name}")


async def _drop(client: persist.PersistClient, args: argparse.Namespace) -> None:
    try:
        sid = await client.drop_shard(args.shard, force=args.force)
    except persist.InvalidUsage as exc:
        # The API's refusal names its keyword argument; on the command line it is the flag.
        said = str(exc)
        if said.endswith("force=True"):
            raise persist.InvalidUsage(said.removesuffix("force=True") + "--force") from None
        raise
    print(f"dropped {args.shard} ({sid})")


async def _purge(client: persist.PersistClient, args: argparse.Namespace) -> None:
    print(f"purging {args.shard}...", file=sys.stderr, flush=True)
    _json(await client.purge(args.shard))


async def _erase(client: persist.PersistClient, args: argparse.Namespace) -> None:
    predicate = _where(await client.shard_schema(args.shard), args.where)
    # Not the values: they are what is being erased, and stderr often ends up in a log.
    print(f"erasing from {args.shard}...", file=sys.stderr, flush=True)
    _json(await client.erase(args.shard, predicate))


def _where(schema: pa.Schema, terms: list[tuple[str, str]]) -> pc.Expression:
    """The rows whose every ``COLUMN`` equals its ``VALUE`` (``--where``): each value is text
    cast to its column's type by Arrow, so nothing the user types is evaluated."""
    predicate: pc.Expression | None = None
    for column, text in terms:
        if column not in schema.names:
            # The shared check says why (a column the shard lacks, ``_time``, ``_diff``);
            # the value stays out of its message.
            check_predicate(pc.field(column).is_valid(), schema)
        kind = schema.field(column).type
        try:
            value = pa.scalar(text, pa.string()).cast(kind)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise persist.InvalidUsage(
                f"--where {column}=...: the value is not one of column {column!r} ({kind})"
            ) from exc
        term = pc.field(column) == value
        predicate = term if predicate is None else predicate & term
    assert predicate is not None  # argparse requires one --where
    return check_predicate(predicate, schema)


def _where_term(text: str) -> tuple[str, str]:
    """``COLUMN=VALUE`` (argparse type); the value may hold ``=``."""
    column, eq, value = text.partition("=")
    if not eq or not column:
        raise argparse.ArgumentTypeError(f"not COLUMN=VALUE: {text!r}")
    return column, value


async def _maintain(client: persist.PersistClient, args: argparse.Namespace) -> None:
    print(f"maintaining {args.shard}...", file=sys.stderr, flush=True)

    def progress(done: dict[str, Any]) -> None:
        did = ", ".join(f"{k}={v}" for k, v in done.items() if v) or "nothing due"
        print(f"  round: {did}", file=sys.stderr, flush=True)

    _json(await client.maintain(args.shard, progress=progress))


async def _export(client: persist.PersistClient, args: argparse.Namespace) -> None:
    from persist.export import export_contents

    _json(await export_contents(client, args.shard, Path(args.to), args.as_of))


_COMMANDS: dict[str, tuple[str, Any]] = {
    "list": ("list the named shards (name, id, since, upper, rows, bytes)", _list),
    "inspect": ("print a shard's state and storage (JSON)", _inspect),
    "history": ("list a shard's commits within its retention (JSON)", _history),
    "du": ("every byte a shard holds, in blob and consensus, by kind (JSON)", _du),
    "retention": (
        "show, or set (seconds, or 'none'), how long a shard keeps history",
        _retention_cmd,
    ),
    "purge": ("rewrite what lies below the since so retracted rows leave storage", _purge),
    "erase": (
        "remove the rows where every --where COLUMN=VALUE holds from all history and storage",
        _erase,
    ),
    "schema": (
        "every version of a shard's schema: its number, when it was made, its fields",
        _schema,
    ),
    "rename": ("give a shard a new name", _rename),
    "drop": ("seal, finalize and unname a shard (its data is deleted)", _drop),
    "maintain": (
        "run a shard's due maintenance (compaction, rollups, GC) to completion",
        _maintain,
    ),
    "export": ("write a shard's contents as plain Parquet files into a directory", _export),
}


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6}


def byte_size(text: str) -> int:
    """``8MiB``, ``512KiB``, ``1048576``: a size in bytes (argparse type)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"not a positive size like 8MiB: {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


_UNSET: Any = object()


class _Help(argparse.HelpFormatter):
    """Shows each option's default, where it has one its help doesn't already give."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            default in (None, False, argparse.SUPPRESS)
            or default is _UNSET
            or "default" in text
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)".strip()


def _time_or_instant(text: str) -> int | datetime.datetime:
    """A time (an int) or an ISO-8601 instant (naive: UTC), for ``--as-of`` (argparse type)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return datetime.datetime.fromisoformat(text)  # naive: UTC, as ``as_of_at`` takes it
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time or an ISO-8601 instant (2026-11-27T09:30:00Z): {text!r}"
        ) from None


def _retention(text: str) -> float | None:
    """``none`` or a positive number of seconds (argparse type)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"not a number of seconds or 'none': {text!r}")
    return value


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        formatter_class=_Help,
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
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument(
        "--port", type=int, required=True, help="the port to listen on; 0 picks a free one"
    )
    p.add_argument(
        "--token",
        help="bearer token every call must carry (default: $PERSIST_FLIGHT_TOKEN, else none)",
    )
    p.add_argument("--tls-cert", help="PEM certificate: serve grpc+tls (needs --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument(
        "--wal-dir",
        default="./persist-data/wal",
        help="the streamed writes' write-ahead log and the server's identity (one server's)",
    )
    p.add_argument(
        "--commit-interval-ms",
        type=float,
        default=50.0,
        help="streamed writes are committed at least this often",
    )
    p.add_argument(
        "--commit-bytes",
        type=byte_size,
        default="8MiB",
        help="a commit is made sooner once this much streamed data waits",
    )
    p.add_argument(
        "--max-buffer-bytes",
        type=byte_size,
        default="64MiB",
        help="uncommitted streamed data held at most (one shard: half); beyond it writers wait",
    )
    p.add_argument(
        "--ticket-ttl-s", type=float, default=300.0, help="how long a DoGet ticket stays valid"
    )
    p.add_argument(
        "--metrics-port", type=int, help="serve Prometheus text at /metrics (default: none)"
    )
    p.add_argument(
        "--retention-s",
        type=_retention,
        default=24 * 3600.0,
        help="history retention of the shards this server creates, in seconds, or 'none' "
        "(readers alone hold history) (default: 86400, a day)",
    )
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
        config=persist.PersistConfig(retention_s=args.retention_s),
    )


def _location_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blob", help=f"blob URI (default: ${ENV_BLOB} or ./persist-data/blob)")
    p.add_argument(
        "--consensus",
        help=f"consensus URI (default: ${ENV_CONSENSUS} or ./persist-data/consensus.db)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="persist",
        description="persist: durable, definite time-varying collections of Arrow data. "
        "S is a shard id or a name; --blob and --consensus default to $PERSIST_BLOB_URI and "
        "$PERSIST_CONSENSUS_URI, else ./persist-data/. Every command and flag: docs/cli.md.",
    )
    parser.add_argument("--version", action="version", version=f"persist {persist.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_p = sub.add_parser(
        "demo",
        help="run persist end to end on the embedded default",
        description="Runs persist end to end on a new shard (writes, a refused stale write, "
        "snapshots, a listen, splits, history, retention) and says what it did.",
        formatter_class=_Help,
    )
    _location_args(demo_p)
    for name, (help_text, _) in _COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=_Help,
        )
        _location_args(p)
        if name in ("list", "schema"):
            p.add_argument("--json", action="store_true", help="print JSON, with every field")
        if name == "list":
            p.add_argument(
                "prefix",
                metavar="PREFIX",
                nargs="?",
                default="",
                help="only the names that start with it (default: all)",
            )
            continue
        p.add_argument("shard", metavar="S", help="a shard id or name")
        if name == "rename":
            p.add_argument("new_name", metavar="NEW", help="the shard's new name")
        elif name == "drop":
            p.add_argument(
                "--force", action="store_true", help="expire live readers and writers too"
            )
        elif name == "erase":
            p.add_argument(
                "--where",
                metavar="COLUMN=VALUE",
                type=_where_term,
                action="append",
                required=True,
                help="a data column and the value (text, cast to the column's type) of the "
                "rows to erase; given again, every one must hold (required)",
            )
        elif name == "retention":
            p.add_argument(
                "seconds",
                metavar="SECONDS",
                nargs="?",
                type=_retention,
                default=_UNSET,
                help="the new retention, in seconds, or 'none' (readers alone hold history); "
                "without it, the shard's retention is shown",
            )
        elif name == "export":
            p.add_argument(
                "--to", metavar="DIR", required=True, help="a new or empty directory (required)"
            )
            p.add_argument(
                "--as-of",
                metavar="T",
                type=_time_or_instant,
                help="a time, or an ISO-8601 instant: the contents as they stood then "
                "(default: the newest readable)",
            )
    _serve_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            _serve(args)
        elif args.command == "demo":
            asyncio.run(demo(args.blob, args.consensus))
        else:
            asyncio.run(_with_client(args))
    except persist.PersistError as exc:
        # Whatever a message quotes of the locations, their secrets stay out of it.
        given = (getattr(args, "blob", None), getattr(args, "consensus", None))
        known = [u for u in (*given, *default_locations()) if u]
        said = redact(str(exc), *known)
        print(f"persist: {type(exc).__name__}: {said}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
