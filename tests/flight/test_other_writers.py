"""Streaming writes beside every other actor that may touch their shard, on real servers.

Each test is one of the ways acknowledged writes were lost while the streaming server assumed
it was its shard's only writer and that shards live for ever:

- a DoPut racing a stream's first writes on the same server;
- two servers streaming into one shard (replicas behind one address, a blue/green overlap);
- a client that reconnects to another server and resends what it never heard back about,
  with the same rows or (a bug of the client's) other rows under a seq it used;
- a shard dropped while a stream writes into it, and one dropped while a crashed server's WAL
  still held writes of it.

Every write acked ``LOCAL_DISK`` or later must be in its shard exactly once, at the time its
``COMMITTED`` ack named, or (its shard gone) be listed by the ``quarantine`` action with why.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl
import pytest

import persist
from persist.flight import StreamingWriter
from tests.flight.conftest import (
    TOKEN,
    StartServer,
    consolidated,
    new_shard,
    times_of,
    updates,
)


def _rows(k: int) -> pa.Table:
    return pa.table({"k": [k], "v": [f"v{k}"]})


def _create(client: Any, shard: str) -> None:
    client.put(shard, updates([(0, "v0", 0, 1)]), 0, 1)


def _drop(loc: tuple[str, str], shard: str) -> None:
    async def drop() -> None:
        async with await persist.connect(*loc) as c:
            await c.drop_shard(shard, force=True)

    asyncio.run(drop())


def _sqlite(tmp_path: Path) -> tuple[str, str]:
    return (tmp_path / "blob").as_uri(), f"sqlite://{tmp_path / 'consensus.db'}"


def test_a_doput_racing_a_streams_first_writes_takes_nothing_from_them(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Found: a stream opening a shard read its upper, then awaited its WAL floor and LSN
    reservation; a DoPut in that window landed, and the stream's first writes (acked
    ``LOCAL_DISK``) got LSNs below the new upper: set aside, absent (13 of 30 tries)."""
    server = start_server(_sqlite(tmp_path), "--commit-interval-ms", "5")
    client = server.client()
    for attempt in range(15):
        shard = new_shard()
        _create(client, shard)
        acked: dict[int, int] = {}
        go = threading.Barrier(2)

        def stream(
            shard: str = shard, acked: dict[int, int] = acked, go: threading.Barrier = go
        ) -> None:
            with StreamingWriter(server.uri, shard, token=TOKEN, writer_id="w") as w:
                go.wait()
                lsns = {k: w.write(_rows(k), seq=k) for k in range(1, 21)}
                for k, lsn in lsns.items():
                    w.wait_durable(lsn, "COMMITTED", timeout=30)
                    acked[k] = w.committed_at(lsn) or -1

        t = threading.Thread(target=stream)
        t.start()
        go.wait()
        for i in range(3):
            upper = client.action("frontiers", {"shard": shard})["upper"]
            # The stream's commit may move the upper first: a DoPut's own race, not ours.
            with contextlib.suppress(fl.FlightServerError):
                client.put(shard, updates([(1000 + i, "put", upper, 1)]), upper, upper + 1)
        t.join(60)
        times = times_of(client, shard)
        assert {k: times.get(k) for k in acked} == {k: [t] for k, t in acked.items()}, attempt
        durability = client.action("durability", {"shard": shard})
        assert durability["COMMITTED"] == 20, durability


def test_two_servers_streaming_into_one_shard_lose_nothing(
    start_server: StartServer, write_location: tuple[str, str]
) -> None:
    """Found: both servers handed out the same LSNs and each took the other's commits for its
    own: 800 of 1,600 writes acked ``COMMITTED`` were not in the shard, and nothing failed."""
    a = start_server(write_location, "--commit-interval-ms", "10")
    b = start_server(write_location, "--commit-interval-ms", "10")
    client = a.client()
    shard = new_shard()
    _create(client, shard)
    acked: dict[int, int] = {}
    errors: list[BaseException] = []

    def produce(uri: str, writer: str, keys: range) -> None:
        try:
            with StreamingWriter(uri, shard, token=TOKEN, writer_id=writer) as w:
                lsns = {k: w.write(_rows(k), seq=k) for k in keys}
                for k, lsn in lsns.items():
                    w.wait_durable(lsn, "COMMITTED", timeout=60)
                    at = w.committed_at(lsn)
                    assert at is not None
                    acked[k] = at
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=produce, args=(a.uri, "a", range(1, 401))),
        threading.Thread(target=produce, args=(b.uri, "b", range(1001, 1401))),
    ]
    for t in threads:
        t.start()
    # DoPuts through both servers meanwhile.
    for i in range(10):
        c = (a if i % 2 else b).client()
        upper = c.action("frontiers", {"shard": shard})["upper"]
        with contextlib.suppress(fl.FlightServerError):
            c.put(shard, updates([(5000 + i, "put", upper, 1)]), upper, upper + 1)
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(acked) == 800
    times = times_of(client, shard)
    assert {k: times.get(k) for k in acked} == {k: [t] for k, t in acked.items()}
    # Each server's watermarks are its own log's.
    for server in (a, b):
        assert server.client().action("durability", {"shard": shard})["COMMITTED"] == 400


def test_a_client_that_reconnects_to_another_server_is_applied_once(
    start_server: StartServer, tmp_path: Path
) -> None:
    """A client resends, to server B, writes server A acked ``LOCAL_DISK`` and still holds: the
    first commit of each ``(writer_id, seq)`` applies it, the second finds it taken and acks
    it at the first one's time. A seq resent with other rows is never applied twice either:
    whichever lands second is set aside, with why."""
    loc = _sqlite(tmp_path)
    slow = start_server(loc, "--commit-interval-ms", "2000")
    fast = start_server(loc, "--commit-interval-ms", "10")
    client = fast.client()
    shard = new_shard()
    _create(client, shard)
    first = StreamingWriter(slow.uri, shard, token=TOKEN, writer_id="feed")
    held = {k: first.write(_rows(k), seq=k) for k in range(1, 11)}
    for lsn in held.values():
        first.wait_durable(lsn, "LOCAL_DISK", timeout=30)
    # The client "reconnects" to the other server and resends all of it; seq 10 with other
    # rows (a bug of the client's: it reused a seq).
    with StreamingWriter(fast.uri, shard, token=TOKEN, writer_id="feed") as second:
        again = {k: second.write(_rows(k), seq=k) for k in range(1, 10)}
        again[10] = second.write(_rows(999), seq=10)
        for lsn in again.values():
            second.wait_durable(lsn, "COMMITTED", timeout=30)
        at = {k: second.committed_at(lsn) for k, lsn in again.items()}
    # The slow server's group finds every seq taken: its calls end, nothing lands twice.
    with pytest.raises(persist.InvalidUsage, match="other rows"):
        first.close()
    times = times_of(client, shard)
    assert times == {**{k: [at[k]] for k in range(1, 10)}, 999: [at[10]]}
    listed = slow.client().action("quarantine", {"shard": shard})
    assert [(q["lsn"], q["seq"]) for q in listed] == [(held[10], 10)]
    assert "other rows" in listed[0]["why"]


def test_a_dropped_shard_ends_its_streams_and_leaves_the_others_alone(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Found: with a live stream into a dropped shard the server kept acking its writes,
    retried its commit for ever and never ended the call, and the dropped shard's bytes
    filled ``--max-buffer-bytes``: other shards' writers took 0 writes in 10 s."""
    loc = _sqlite(tmp_path)
    server = start_server(loc, "--commit-interval-ms", "20", "--max-buffer-bytes", "200000")
    client = server.client()
    doomed, other = new_shard(), new_shard()
    for shard in (doomed, other):
        _create(client, shard)
    w = StreamingWriter(server.uri, doomed, token=TOKEN, writer_id="d")
    first = w.write(_rows(1), seq=1)
    w.wait_durable(first, "COMMITTED", timeout=30)
    _drop(loc, doomed)
    # The writer goes on writing; the server finds the shard gone at its next commit at the
    # latest: the call ends with InvalidUsage, and a writer blocked waiting hears it at once.
    started = time.monotonic()
    with pytest.raises(persist.InvalidUsage):
        for k in range(2, 10_000):
            lsn = w.write(pa.table({"k": [k], "v": ["x" * 2000]}), seq=k)
        w.wait_durable(lsn, "COMMITTED", timeout=60)
    assert time.monotonic() - started < 30
    with pytest.raises(persist.InvalidUsage):
        w.close()
    # The other shard's writer is not held up.
    with StreamingWriter(server.uri, other, token=TOKEN, writer_id="o") as o:
        started = time.monotonic()
        lsns = [o.write(_rows(k), seq=k) for k in range(1, 201)]
        o.wait_durable(lsns[-1], "COMMITTED", timeout=30)
        assert time.monotonic() - started < 20
    listed = client.action("quarantine", {})
    assert listed and {q["shard"] for q in listed} == {doomed}
    assert all("dropped" in q["why"] or "finalized" in q["why"] for q in listed)
    # A new stream into the dropped shard is refused at once.
    with (
        pytest.raises(persist.InvalidUsage),
        StreamingWriter(server.uri, doomed, token=TOKEN) as again,
    ):
        again.write(_rows(1))


def test_a_restart_with_a_backlog_of_a_dropped_shard_starts(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Found: a restart whose WAL held writes of a shard dropped since exited with
    ``InvalidUsage ... was finalized``: the whole server stayed down."""
    loc = _sqlite(tmp_path)
    args = ("--commit-interval-ms", "60000")
    server = start_server(loc, *args)
    client = server.client()
    doomed, other = new_shard(), new_shard()
    for shard in (doomed, other):
        _create(client, shard)
    w = StreamingWriter(server.uri, doomed, token=TOKEN, writer_id="d", levels=["LOCAL_DISK"])
    lsns = [w.write(_rows(k), seq=k) for k in range(1, 6)]
    for lsn in lsns:
        w.wait_durable(lsn, "LOCAL_DISK", timeout=30)
    server.proc.kill()
    server.proc.wait()
    _drop(loc, doomed)
    # Starts, with the dropped shard's writes set aside; a short commit interval now, so
    # the other shard's durable write below does not wait out the long one.
    server = start_server(loc, "--commit-interval-ms", "50")
    client = server.client()
    listed = client.action("quarantine", {"shard": other}) + client.action("quarantine", {})
    assert sorted(q["lsn"] for q in listed if q["shard"] == doomed) == lsns
    server.wait_for_log("set aside")
    with StreamingWriter(server.uri, other, token=TOKEN, writer_id="o") as o:
        o.write_durable(_rows(7), seq=7)
    assert sorted(k for (k, *_) in consolidated(client.read({"shard": other}))) == [0, 7]


async def test_a_stream_opened_as_its_shard_is_dropped_is_refused_with_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the fault harness at ``PERSIST_TEST_SCALE=4``: a new stream into a shard whose
    drop the server found while the call was being set up (it awaits the shard's schema
    versions) failed with ``InternalError`` (a ``KeyError`` of the server's bookkeeping), not
    the refusal that names the drop. Actors: a live stream into the shard, a client that drops
    it, and a second stream opening at that moment (the interleaving is forced here)."""
    from persist.flight import FlightServer

    loc = _sqlite(tmp_path)
    server = FlightServer(*loc, port=0, token=None, wal_dir=tmp_path / "wal", commit_interval_ms=20)
    await server.start()
    shard = new_shard()
    live = StreamingWriter(server.uri, shard, writer_id="live")
    try:
        first = await asyncio.to_thread(live.write, _rows(1), seq=1)
        await asyncio.to_thread(live.wait_durable, first, "COMMITTED", 30)
        assert server._writes is not None
        streams = server._writes.streams
        hub_client = streams._hub.client
        schemas = hub_client.schemas

        async def drop_meanwhile(shard_id: str) -> Any:
            got = await schemas(shard_id)
            monkeypatch.setattr(hub_client, "schemas", schemas)  # once
            async with await persist.connect(*loc) as c:
                await c.drop_shard(shard, force=True)
            # The live stream's next write makes the server commit, and find the shard gone.
            with contextlib.suppress(persist.PersistError):
                await asyncio.to_thread(live.write, _rows(2), seq=2)
            deadline = time.monotonic() + 30
            while streams.streams(shard) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert not streams.streams(shard), "the server never found the shard gone"
            return got

        monkeypatch.setattr(hub_client, "schemas", drop_meanwhile)

        def open_another() -> None:
            with StreamingWriter(server.uri, shard, writer_id="late") as late:
                late.write(_rows(3), seq=1)

        # Refused as any stream into a shard that can take no more writes (a dropped shard's
        # upper is None), never an internal error.
        with pytest.raises(persist.InvalidUsage, match=r"sealed|dropped"):
            await asyncio.to_thread(open_another)
    finally:
        with contextlib.suppress(persist.PersistError):
            await asyncio.to_thread(live.close)
        await server.stop()
