"""Closing a client lets go of what it registered: its writers and readers are expired, not left
for their leases to run out, so a ``drop_shard`` (or ``persist drop``) right after works. A handle
handed to another process (``detach``) is the exception."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import persist

from .conftest import SCHEMA, Connect, fast_config, updates


async def _live(client: persist.PersistClient, shard: str) -> tuple[int, int]:
    state = await client.inspect(shard)
    return state["writers"], state["readers"]


async def test_closing_a_client_expires_the_handles_it_opened(connect: Connect) -> None:
    other = await connect()
    shard = persist.ShardId.new()
    async with await connect() as client:
        write, _read = await client.open(shard, SCHEMA, "script")
        await write.compare_and_append(updates([1, 2], 0), 0, 1)
        plan = await client.plan_snapshot(shard, as_of=0)
        assert plan.reader is not None
        await client.open_writer(shard, purpose="never used")  # its handle dropped at once
        assert await _live(other, shard) == (2, 2)
    assert await _live(other, shard) == (0, 0)
    # Nothing holds the shard now: no force is needed.
    assert await other.drop_shard(shard) == shard
    assert (await other.inspect(shard))["finalized"]


async def test_closing_leaves_handles_resumed_from_another_process(connect: Connect) -> None:
    """A resumed handle is someone else's registration (a Spark task heartbeats the job's):
    the client that resumed it stops heartbeating it but leaves it registered."""
    driver = await connect()
    shard = persist.ShardId.new()
    write, read = await driver.open(shard, SCHEMA)
    async with await connect() as task:
        await task.resume_writer(shard, write.writer_id)
        await task.resume_reader(shard, read.reader_id)
    assert await _live(driver, shard) == (1, 1)
    await write.heartbeat()
    await read.heartbeat()


async def test_a_detached_handle_outlives_its_clients_close(connect: Connect) -> None:
    other = await connect()
    shard = persist.ShardId.new()
    async with await connect() as client:
        write, read = await client.open(shard, SCHEMA)
        await write.compare_and_append(updates([1], 0), 0, 1)
        read.detach()
        read.detach()  # idempotent
        plan = await client.plan_snapshot(shard, as_of=0, splits=1)
        assert plan.reader is not None
        plan.reader.detach()
        assert read.since == 0  # still usable until the client closes
    assert await _live(other, shard) == (0, 2)
    # The other process picks them up by id and lets them go.
    again = await other.resume_reader(shard, plan.reader.reader_id)
    assert (await other.fetch_split(plan.splits[0])).num_rows == 1
    await again.expire()
    with pytest.raises(persist.InvalidUsage, match=read.reader_id):
        await other.drop_shard(shard)  # the handed-over reader is live: someone else's
    await other.drop_shard(shard, force=True)


async def test_drop_shard_expires_the_callers_own_handles_without_force(
    connect: Connect,
) -> None:
    client = await connect()
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    await write.compare_and_append(updates([1], 0), 0, 1)
    plan = await client.plan_snapshot(shard, as_of=0)
    assert plan.reader is not None
    assert await client.drop_shard(shard) == shard
    with pytest.raises(persist.LeaseExpired):
        await write.compare_and_append(updates([2], 1), 1, 2)
    with pytest.raises(persist.LeaseExpired):
        await read.downgrade_since(1)
    await client.close()  # nothing left to expire: the shard is gone


async def test_drop_shard_still_needs_force_for_other_clients_handles(
    connect: Connect,
) -> None:
    client, other = await connect(), await connect()
    shard = persist.ShardId.new()
    mine = await client.open_writer(shard, SCHEMA)
    kept = await client.open_leased_reader(shard)
    kept.detach()
    theirs = await other.open_leased_reader(shard)
    with pytest.raises(persist.InvalidUsage) as refused:
        await client.drop_shard(shard)
    said = str(refused.value)
    assert theirs.reader_id in said and kept.reader_id in said
    assert mine.writer_id not in said
    # Refused: nothing changed, the caller's own writer included.
    assert await _live(other, shard) == (1, 2)
    await mine.heartbeat()
    await theirs.expire()
    await kept.expire()
    await client.drop_shard(shard)
    with pytest.raises(persist.LeaseExpired):
        await mine.heartbeat()


# --- consensus down at close ---------------------------------------------------------------------


class _Proxy:
    """A TCP relay on 127.0.0.1 to Postgres that can go silent: connections stay open (new ones
    are accepted) but nothing passes any more, as a network partition looks to a client."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.silent = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        if self.silent:
            return  # accepted, never answered
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self._writers.append(up_writer)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await src.read(1 << 16):
                if self.silent:
                    continue  # swallowed
                dst.write(data)
                await dst.drain()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for w in self._writers:
            w.close()
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def proxied_postgres(postgres_uri: str) -> AsyncIterator[tuple[str, _Proxy]]:
    import urllib.parse

    parts = urllib.parse.urlsplit(postgres_uri)
    proxy = _Proxy(parts.port or 5432)
    port = await proxy.start()
    user = f"{parts.username}@" if parts.username else ""
    uri = urllib.parse.urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{port}"))
    yield uri, proxy
    await proxy.close()


async def test_close_is_bounded_when_consensus_is_down(
    proxied_postgres: tuple[str, _Proxy],
    postgres_uri: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uri, proxy = proxied_postgres
    blob = (tmp_path / "blob").as_uri()
    client = await persist.connect(blob, uri, config=fast_config())
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    proxy.silent = True
    with caplog.at_level(logging.WARNING, logger="persist"):
        # A guard, not a measurement: without a bound, each try waits out the location's
        # 30 s timeout, five tries a handle.
        await asyncio.wait_for(client.close(), timeout=120)
    said = caplog.text
    assert "could not expire" in said
    assert write.writer_id in said and read.reader_id in said
    async with await persist.connect(blob, postgres_uri, config=fast_config()) as other:
        # Left to their leases, as the log says.
        assert await _live(other, shard) == (1, 1)
        await other.drop_shard(shard, force=True)


# --- the command line right after a script -------------------------------------------------------

_SCRIPT = """
import asyncio, sys
import pyarrow as pa
import persist

async def main(blob, consensus, name):
    async with await persist.connect(blob, consensus) as client:
        write, read = await client.open(name, pa.schema([("k", pa.int64())]), "script")
        await write.compare_and_append(
            pa.table({"k": [1], "_time": pa.array([0], pa.uint64()), "_diff": [1]}), 0, 1
        )
        print((await read.snapshot_and_fetch(0)).num_rows)

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.fixture(params=["sqlite", "postgres"])
def shared_location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """A location two processes share (no ``mem://``)."""
    blob = (tmp_path / "blob").as_uri()
    if request.param == "sqlite":
        return blob, f"sqlite://{tmp_path / 'consensus.db'}"
    return blob, request.getfixturevalue("postgres_uri")


def test_persist_drop_right_after_a_script_ends(shared_location: tuple[str, str]) -> None:
    blob, consensus = shared_location
    name = f"scratch.t{uuid.uuid4().hex[:12]}"
    script = textwrap.dedent(_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-c", script, blob, consensus, name],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    loc = ["--blob", blob, "--consensus", consensus]
    persist_cli = [sys.executable, "-m", "persist.cli"]
    dropped = subprocess.run(
        [*persist_cli, "drop", name, *loc], capture_output=True, text=True, timeout=300
    )
    assert dropped.returncode == 0, dropped.stderr
    assert f"dropped {name}" in dropped.stdout
