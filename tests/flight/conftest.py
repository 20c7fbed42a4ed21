"""Fixtures for the Flight tests: a real ``persist serve`` subprocess and stock pyarrow clients."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl
import pytest

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])
TOKEN = "test-token"


class Server:
    """``persist serve`` in a subprocess; ``client()`` is a stock FlightClient for it."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, argv: list[str] | None = None
    ) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-m", "persist.cli", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=_pump, args=(self.proc.stdout, lines), daemon=True).start()
        self.stderr: list[str] = []
        assert self.proc.stderr is not None
        threading.Thread(target=_collect, args=(self.proc.stderr, self.stderr), daemon=True).start()
        try:
            line = lines.get(timeout=60)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"persist serve did not come up: {''.join(self.stderr)}") from None
        assert line.startswith("persist flight serving "), (line, "".join(self.stderr))
        self.uri = line.split()[-1]
        self.lines = lines

    def client(self, token: str | None = TOKEN, **kw: Any) -> Client:
        return Client(fl.FlightClient(self.uri, **kw), token)

    def wait_for_log(self, *needles: str, timeout: float = 60) -> str:
        """The server's stderr once it holds every one of ``needles``: a line logged is read
        by a thread, some time after the call it tells of has answered."""
        deadline = time.monotonic() + timeout
        while True:
            log = "".join(self.stderr)
            if all(n in log for n in needles):
                return log
            if time.monotonic() > deadline:
                raise AssertionError(f"not logged within {timeout} s: {needles}\n{log[-4000:]}")
            time.sleep(0.02)

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _pump(stream: Any, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


def _collect(stream: Any, into: list[str]) -> None:
    for line in stream:
        into.append(line)


class Client:
    """A stock ``pyarrow.flight.FlightClient`` plus the JSON conventions of the spec."""

    def __init__(self, flight: fl.FlightClient, token: str | None) -> None:
        self.flight = flight
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self.options = fl.FlightCallOptions(headers=headers)

    def options_with(self, timeout: float) -> fl.FlightCallOptions:
        return fl.FlightCallOptions(headers=self.options.headers, timeout=timeout)

    def info(self, command: dict[str, Any], timeout: float | None = None) -> fl.FlightInfo:
        opts = self.options if timeout is None else self.options_with(timeout)
        return self.flight.get_flight_info(cmd(command), opts)

    def get(self, ticket: fl.Ticket) -> pa.Table:
        return self.flight.do_get(ticket, self.options).read_all()

    def read(self, command: dict[str, Any]) -> pa.Table:
        info = self.info(command)
        tables = [self.get(ep.ticket) for ep in info.endpoints]
        return pa.concat_tables(tables) if tables else info.schema.empty_table()

    def put(self, shard: str, table: pa.Table, expected: int | None, new: int | None) -> Any:
        writer, reader = self.flight.do_put(
            cmd({"shard": shard, "expected_upper": expected, "new_upper": new}),
            table.schema,
            self.options,
        )
        if table.num_rows:
            writer.write_table(table)
        writer.done_writing()
        result = reader.read()
        writer.close()
        return json.loads(result.to_pybytes())

    def action(self, name: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        results = list(self.flight.do_action(fl.Action(name, data), self.options))
        assert len(results) == 1
        return json.loads(results[0].body.to_pybytes())


def cmd(command: dict[str, Any]) -> fl.FlightDescriptor:
    return fl.FlightDescriptor.for_command(json.dumps(command).encode())


def payload(exc: fl.FlightError) -> dict[str, Any]:
    """The JSON error payload, checked to be the same in ``extra_info`` and the message."""
    from_extra = json.loads(exc.extra_info)
    message = str(exc)
    assert "persist: " in message
    text = message.split("persist: ", 1)[1]
    from_message, _ = json.JSONDecoder().raw_decode(text)
    assert from_extra == from_message
    return dict(from_extra)


def updates(rows: list[tuple[int, str, int, int]]) -> pa.Table:
    """(k, v, time, diff) rows as a DoPut table."""
    return pa.table(
        {
            "k": pa.array([r[0] for r in rows], pa.int64()),
            "v": pa.array([r[1] for r in rows], pa.string()),
            "_time": pa.array([r[2] for r in rows], pa.uint64()),
            "_diff": pa.array([r[3] for r in rows], pa.int64()),
        }
    )


def consolidated(table: pa.Table) -> dict[tuple[Any, ...], int]:
    """Row -> summed diff (zero sums dropped) over every column but ``_diff``."""
    keys = [n for n in table.column_names if n != "_diff"]
    sums: dict[tuple[Any, ...], int] = {}
    for row in table.to_pylist():
        key = tuple(row[k] for k in keys)
        sums[key] = sums.get(key, 0) + row["_diff"]
    return {k: d for k, d in sums.items() if d}


def times_of(client: Client, shard: str) -> dict[int, list[int]]:
    """k -> the times its rows are at (every row after time 0, each ``_diff`` 1), from a listen
    from 0 to the upper."""
    upper = client.action("frontiers", {"shard": shard})["upper"]
    info = client.info({"shard": shard, "listen": True, "as_of": 0, "until": upper})
    out: dict[int, list[int]] = {}
    for row in client.get(info.endpoints[0].ticket).to_pylist():
        assert row["_diff"] == 1
        out.setdefault(row["k"], []).append(row["_time"])
    return out


def new_shard() -> str:
    return f"s{uuid.uuid4()}"


LOCATIONS = ["file+sqlite", "file+postgres", "s3+postgres"]


@pytest.fixture(scope="session")
def flight_bucket(s3_endpoint: str) -> str:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="persist-flight")
    return "persist-flight"


def location_of(kind: str, request: pytest.FixtureRequest, root: Path) -> tuple[str, str]:
    blob = (root / "blob").as_uri()
    if kind == "file+sqlite":
        return blob, f"sqlite://{root / 'consensus.db'}"
    postgres: str = request.getfixturevalue("postgres_uri")
    if kind == "file+postgres":
        return blob, postgres
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("flight_bucket")
    unique = uuid.uuid4().hex
    return f"s3://{bucket}/{unique}?endpoint_url={endpoint}&region=us-east-1", postgres


@pytest.fixture(params=LOCATIONS)
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(blob, consensus) of each kind the reads are proven on."""
    return location_of(request.param, request, tmp_path)


@pytest.fixture(params=LOCATIONS[:2])
def write_location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(blob, consensus) of each kind the writes are proven on."""
    return location_of(request.param, request, tmp_path)


StartServer = Callable[..., Server]


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[StartServer]:
    """Starts ``persist serve`` on a location; every server is killed at the end of the test."""
    servers: list[Server] = []

    def start(
        loc: tuple[str, str],
        *extra: str,
        token: str | None = TOKEN,
        env: dict[str, str] | None = None,
    ) -> Server:
        args = ["--blob", loc[0], "--consensus", loc[1], "--port", "0"]
        # A WAL directory is one server's at a time: a restart takes the last one's, a server
        # started beside a live one gets its own.
        busy = {s.args[s.args.index("--wal-dir") + 1] for s in servers if s.proc.poll() is None}
        wal = str(tmp_path / "wal")
        n = 1
        while wal in busy:
            n += 1
            wal = str(tmp_path / f"wal-{n}")
        args += ["--wal-dir", wal]
        if token is not None:
            args += ["--token", token]
        server = Server([*args, *extra], env)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.kill()


FAULTY_CHILD = str(Path(__file__).resolve().parent.parent / "harness" / "_flight_child.py")


def faulty_server(root: Path, loc: tuple[str, str], **extra: Any) -> Server:
    """A ``persist serve`` over fault-injecting locations (``tests/harness/_flight_child.py``):
    writing ``root / "outage"`` switches faults on, removing it switches them off."""
    cfg = {
        "blob": loc[0],
        "consensus": loc[1],
        "control": str(root),
        "wal_dir": str(root / "wal"),
        "token": TOKEN,
        **extra,
    }
    return Server([], argv=[sys.executable, FAULTY_CHILD, json.dumps(cfg)])
