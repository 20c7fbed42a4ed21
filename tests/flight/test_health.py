"""The ``health`` action: ``ok`` means a commit can land (the blob store takes a write, gives it
back and deletes it; consensus answers), ``unavailable`` names the store that can't."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

import pyarrow as pa
import pyarrow.flight as fl
import pytest

import persist
import persist.location.file as file_blob
from persist.flight import FlightServer
from persist.location import Blob, Consensus, open_blob, open_consensus
from persist.testing.faults import Faults, FaultyBlob, FaultyConsensus
from tests.flight.conftest import SCHEMA, StartServer, new_shard, payload

Health = Callable[[], Awaitable[dict[str, Any]]]

OK = {"status": "ok", "version": persist.__version__, "blob": "ok", "consensus": "ok"}


@contextlib.asynccontextmanager
async def _serving(
    blob: Blob, consensus: Consensus, tmp_path: Path
) -> AsyncIterator[tuple[FlightServer, Health]]:
    """A server in this process (so its stores can be wrapped), and its ``health`` action."""
    server = FlightServer(blob, consensus, port=0, token=None, wal_dir=tmp_path / "wal")
    # Threads of its own for the calls, which block until answered: in the loop's executor,
    # a few of them would hold up the blob calls that answer them.
    callers = concurrent.futures.ThreadPoolExecutor(16, "health-caller")
    async with server:
        client = fl.FlightClient(server.uri)

        def health() -> dict[str, Any]:
            [result] = list(client.do_action(fl.Action("health", b"{}")))
            return dict(json.loads(result.body.to_pybytes()))

        loop = asyncio.get_running_loop()
        try:
            yield server, lambda: loop.run_in_executor(callers, health)
        finally:
            client.close()
            callers.shutdown()


def _file_location(tmp_path: Path) -> tuple[Blob, Consensus]:
    return open_blob((tmp_path / "blob").as_uri()), open_consensus(f"sqlite://{tmp_path / 'c.db'}")


def _big(time: int = 0) -> pa.Table:
    # Too big to be kept inline in consensus: committing it needs the blob store.
    n = 10_000
    return pa.table(
        {
            "k": pa.array(range(n), pa.int64()),
            "v": pa.array(["x" * 20] * n),
            "_time": pa.array([time] * n, pa.uint64()),
        }
    )


def test_health_is_ok_on_a_good_location(
    start_server: StartServer, location: tuple[str, str]
) -> None:
    client = start_server(location).client()
    assert client.action("health") == OK
    assert client.action("health") == OK

    async def keys() -> list[str]:
        blob = open_blob(location[0])
        try:
            return await blob.list_keys("")
        finally:
            await blob.close()

    assert asyncio.run(keys()) == [], "each probe deletes what it wrote"


async def test_concurrent_health_calls_share_the_probe_key(tmp_path: Path) -> None:
    async with _serving(*_file_location(tmp_path), tmp_path) as (server, health):
        assert await asyncio.gather(*(health() for _ in range(8))) == [OK] * 8
        assert await server.client.blob.list_keys("") == []


def test_health_is_unavailable_when_the_blob_root_is_replaced_by_a_file(
    start_server: StartServer, tmp_path: Path
) -> None:
    # The finding: health said ok while every commit failed. It read one key (missing) and the
    # file blob read "a path through a file" as "no such key", so the read passed. Both are
    # fixed: the probe writes, and the file blob fails every call on a root that is no
    # directory (tests/location/test_blob_file.py).
    root = tmp_path / "blob"
    client = start_server((root.as_uri(), f"sqlite://{tmp_path / 'c.db'}")).client()
    assert client.action("health") == OK
    shard = new_shard()
    assert client.put(shard, _big(), 0, 1) == {"upper": 1}

    shutil.rmtree(root)
    root.write_bytes(b"")

    with pytest.raises(fl.FlightError) as e:
        client.put(shard, _big(1), 1, 2)
    assert payload(e.value)["error"] == "ExternalError"
    got = client.action("health")
    assert got["status"] == "unavailable"
    assert got["consensus"] == "ok"
    assert got["blob"].startswith("ExternalError: ")
    assert f"the blob's root {root} is not a directory" in got["blob"]

    root.unlink()
    assert client.action("health") == OK


def _refuse_writes(
    kind: str, faults: Faults, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, Callable[[], None]]:
    """Makes the blob's writes fail as ``kind`` says: the words of the failure, and what undoes
    it. ``full`` and ``read-only`` fail inside the file blob, as the file system would."""
    if kind == "refused":
        faults.fail_before = 1.0

        def restore() -> None:
            faults.fail_before = 0.0

        return "injected fault: blob.set failed before it ran", restore
    if kind == "full":

        def full(fd: int, value: bytes) -> NoReturn:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(file_blob, "_write_durably", full)
        return "No space left on device", monkeypatch.undo

    def read_only(directory: str) -> NoReturn:
        raise OSError(errno.EROFS, "Read-only file system", directory)

    monkeypatch.setattr(file_blob, "_make_dirs", read_only)
    return "Read-only file system", monkeypatch.undo


@pytest.mark.parametrize("kind", ["refused", "full", "read-only"])
async def test_health_is_unavailable_when_the_blob_refuses_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    blob, consensus = _file_location(tmp_path)
    faults = Faults(ops={"blob.set"})
    async with _serving(FaultyBlob(blob, faults), consensus, tmp_path) as (server, health):
        assert await health() == OK
        words, undo = _refuse_writes(kind, faults, monkeypatch)
        got = await health()
        assert got["status"] == "unavailable" and got["consensus"] == "ok"
        assert got["blob"].startswith("ExternalError: ") and words in got["blob"]
        # What the old probe did (one read of the blob, one of consensus) still passes.
        assert await server.client.blob.get("health") is None
        assert await server.client.consensus.head("health") is None
        undo()
        assert await health() == OK


async def test_health_is_unavailable_when_consensus_is_down(tmp_path: Path) -> None:
    blob, consensus = _file_location(tmp_path)
    faults = Faults()
    async with _serving(blob, FaultyConsensus(consensus, faults), tmp_path) as (_, health):
        assert await health() == OK
        faults.fail_before = 1.0  # every consensus call fails before it runs
        got = await health()
        assert got["status"] == "unavailable" and got["blob"] == "ok"
        assert got["consensus"].startswith("ExternalError: ")
        faults.fail_before = 0.0
        assert await health() == OK


async def test_a_probe_stopped_half_way_leaves_one_key_no_shard_counts_or_sweeps(
    tmp_path: Path,
) -> None:
    blob, consensus = _file_location(tmp_path)
    faults = Faults(ops={"blob.delete"})
    async with _serving(FaultyBlob(blob, faults), consensus, tmp_path) as (server, health):
        persist_client = server.client
        shard = persist.ShardId.new()
        write, read = await persist_client.open(shard, SCHEMA)
        await write.compare_and_append(_big(), 0, 1)
        storage = await persist_client.storage(shard)
        shard_keys = await persist_client.blob.list_keys(f"{shard}/")

        faults.fail_before = 1.0  # the probe's delete fails: its key stays
        for _ in range(3):
            got = await health()
            assert got["status"] == "unavailable" and "blob.delete" in got["blob"]
        faults.fail_before = 0.0
        [left] = await persist_client.blob.list_keys("health/")
        assert set(await persist_client.blob.list_keys("")) == {left, *shard_keys}

        assert await persist_client.storage(shard) == storage
        await persist_client.maintain(shard)
        assert await persist_client.blob.list_keys("health/") == [left]
        assert (await read.snapshot_and_fetch(0)).num_rows == _big().num_rows

        assert await health() == OK
        assert await persist_client.blob.list_keys("health/") == []
        await write.expire()
        await read.expire()
