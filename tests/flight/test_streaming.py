"""Streaming writes over DoExchange: acks at every tier, exactly once, recovery, backpressure."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl
import pytest

import persist
from persist.flight import StreamingWriter
from tests.flight.conftest import TOKEN, StartServer, cmd, consolidated, new_shard, payload, updates

ACK = pa.schema(
    [
        pa.field("lsn", pa.uint64(), nullable=False),
        pa.field("durability_level", pa.utf8(), nullable=False),
        pa.field("is_durability_update", pa.bool_(), nullable=False),
        pa.field("timestamp", pa.timestamp("us"), nullable=False),
    ]
)
TIERS = ["MEMORY", "LOCAL_DISK", "OBJECT_STORAGE", "COMMITTED"]
ROWS = pa.schema([("k", pa.int64()), ("v", pa.string())])


def _sqlite(tmp_path: Path) -> tuple[str, str]:
    return (tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}"


def _rows(*ks: int) -> pa.RecordBatch:
    return pa.record_batch(
        [pa.array(list(ks), pa.int64()), pa.array([f"v{k}" for k in ks])], schema=ROWS
    )


def _create(client: Any, shard: str, upper: int = 1) -> None:
    client.put(shard, updates([(0, "v0", 0, 1)]), 0, upper)


def _exchange(client: Any, shard: str, **more: Any) -> tuple[Any, Any]:
    return client.flight.do_exchange(
        cmd({"shard": shard, "op": "streaming_write", **more}), client.options
    )


def _all_acks(reader: Any, committed_at: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """Every ack row of a call; ``committed_at`` collects the app_metadata of COMMITTED ones,
    checked to name exactly the LSNs acked COMMITTED in its message."""
    out = []
    for chunk in reader:
        assert chunk.data.schema == ACK
        rows = chunk.data.to_pylist()
        committed = {r["lsn"] for r in rows if r["durability_level"] == "COMMITTED"}
        md = json.loads(chunk.app_metadata.to_pybytes()) if chunk.app_metadata else {}
        if "error" in md:
            # The error that ends the call, sent in band first (the call's status follows).
            assert not rows and md["error"]["error"] in ("InvalidUsage", "UpperMismatch")
            continue
        at = md.get("committed_at", {})
        assert {int(k) for k in at} == committed
        if committed_at is not None:
            committed_at.update({int(k): v for k, v in at.items()})
        out.extend(rows)
    return out


def test_ack_schema_order_and_tiers(
    start_server: StartServer, write_location: tuple[str, str]
) -> None:
    client = start_server(write_location).client()
    shard = new_shard()
    _create(client, shard, upper=5)
    n = 300
    # Its reader holds the since at 4 while the writes go in.
    listen = client.info({"shard": shard, "listen": True, "as_of": 4, "until": 5 + n})
    writer, reader = _exchange(client, shard)
    writer.begin(ROWS)
    for i in range(n):
        writer.write_batch(_rows(i + 1, i + 1000) if i % 2 else _rows(i + 1))
    writer.done_writing()
    committed_at: dict[int, int] = {}
    acks = _all_acks(reader, committed_at)
    writer.close()

    memory = [a for a in acks if a["durability_level"] == "MEMORY"]
    # The k-th MEMORY row answers the k-th write. LSNs are positions in this server's log of
    # the shard: from 0, strictly increasing, whatever the shard's upper.
    assert [a["lsn"] for a in memory] == list(range(n))
    assert not any(a["is_durability_update"] for a in memory)
    by_lsn: dict[int, list[dict[str, Any]]] = {}
    for a in acks:
        by_lsn.setdefault(a["lsn"], []).append(a)
    for lsn, rows in by_lsn.items():
        # Per LSN: every tier once, in tier order, later tiers as updates, times not decreasing.
        assert [r["durability_level"] for r in rows] == TIERS, lsn
        assert [r["is_durability_update"] for r in rows] == [False, True, True, True]
        stamps = [r["timestamp"] for r in rows]
        assert stamps == sorted(stamps)
    # Times are chosen as writes commit, from the upper then; a later LSN never at an earlier
    # time.
    times = [committed_at[lsn] for lsn in range(n)]
    assert times == sorted(times) and times[0] >= 5

    # COMMITTED means visible: a fresh snapshot sees every write, at the time its ack named.
    contents = consolidated(client.read({"shard": shard}))
    assert sum(contents.values()) == 1 + n + n // 2
    rows = client.get(listen.endpoints[0].ticket).to_pylist()
    seen = {(r["k"], r["_time"]) for r in rows}
    for i in range(n):
        assert (i + 1, committed_at[i]) in seen  # read your own writes at committed_at
    durability = client.action("durability", {"shard": shard})
    assert durability == dict.fromkeys(TIERS, n)


def test_levels_filter_and_bad_writes(start_server: StartServer, tmp_path: Path) -> None:
    client = start_server(_sqlite(tmp_path)).client()
    shard = new_shard()
    _create(client, shard)
    writer, reader = _exchange(client, shard, levels=["COMMITTED"])
    writer.begin(ROWS)
    for i in range(5):
        writer.write_batch(_rows(i))
    writer.done_writing()
    acks = _all_acks(reader)
    writer.close()
    assert Counter(a["durability_level"] for a in acks) == {"MEMORY": 5, "COMMITTED": 5}

    # A bad write ends the call with the error; the writes before it still progress.
    writer, reader = _exchange(client, shard)
    writer.begin(ROWS)
    writer.write_batch(_rows(100))
    writer.write_with_metadata(_rows(101), pa.py_buffer(b'{"seq": 1}'))  # seq without writer_id
    writer.done_writing()
    with pytest.raises(fl.FlightServerError) as e:
        _all_acks(reader)
    assert payload(e.value)["error"] == "InvalidUsage"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (100, "v100") in {(k, v) for (k, v, _t) in consolidated(client.read({"shard": shard}))}:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the write acked before the bad one was not committed")

    for bad_schema in (
        pa.schema([("k", pa.float64()), ("v", pa.string())]),  # int32 would be taken as is
        pa.schema([("k", pa.int64()), ("v", pa.string()), ("_time", pa.uint64())]),
    ):
        writer, reader = _exchange(client, shard)
        writer.begin(bad_schema)
        writer.write_batch(
            pa.record_batch(
                [
                    pa.array([1.5 if f.type == pa.float64() else 1], f.type)
                    if f.type != pa.string()
                    else pa.array(["x"])
                    for f in bad_schema
                ],
                schema=bad_schema,
            )
        )
        writer.done_writing()
        with pytest.raises(fl.FlightServerError) as e:
            _all_acks(reader)
        assert payload(e.value)["error"] == "InvalidUsage"
    for bad_command in (
        {"shard": shard, "op": "nope"},
        {"shard": shard, "op": "streaming_write", "levels": ["DISK"]},
        {"shard": shard, "op": "streaming_write", "writer_id": ""},
        # No such shard, and no columns to create it with.
        {"shard": new_shard(), "op": "streaming_write"},
    ):
        writer, reader = client.flight.do_exchange(cmd(bad_command), client.options)
        with pytest.raises(fl.FlightServerError) as e:
            writer.done_writing()
            _all_acks(reader)
        assert payload(e.value)["error"] == "InvalidUsage"


def test_streaming_writer_and_replays(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(_sqlite(tmp_path))
    client = server.client()
    shard = new_shard()
    _create(client, shard)
    reached: list[int] = []
    with StreamingWriter(server.uri, shard, token=TOKEN, writer_id="producer-1") as w:
        # A writer that names its writes numbers each one itself (a source offset, say).
        with pytest.raises(persist.InvalidUsage, match="seq"):
            w.write(_rows(0))
        lsns = [w.write(_rows(i), seq=i - 1) for i in range(1, 21)]
        assert lsns == list(range(20))
        w.on_durable(lsns[-1], "COMMITTED", lambda: reached.append(lsns[-1]))
        lsn = w.write_durable(pa.Table.from_batches([_rows(21)]), "OBJECT_STORAGE", seq=20)
        w.wait_durable(lsn, "COMMITTED", timeout=30)
        assert lsn == 20
        at = w.committed_at(lsn)
        assert at is not None and at >= 1
    assert reached == [19]
    assert sum(consolidated(client.read({"shard": shard})).values()) == 22
    # Read your own write: a snapshot as of its committed_at holds it.
    assert (21, "v21", at) in consolidated(client.read({"shard": shard, "as_of": at}))
    assert 21 not in {k for (k, *_) in consolidated(client.read({"shard": shard, "as_of": at - 1}))}

    # Replaying seqs of producer-1 from a stock client, with the rows they had: acked at their
    # original LSNs, not applied again.
    writer, reader = _exchange(client, shard, writer_id="producer-1")
    writer.begin(ROWS)
    for seq in (3, 4, 19):  # the 4th, 5th and 20th writes
        rows = _rows(seq + 1)
        writer.write_with_metadata(rows, pa.py_buffer(json.dumps({"seq": seq}).encode()))
    writer.write_with_metadata(_rows(22), pa.py_buffer(json.dumps({"seq": 21}).encode()))
    writer.done_writing()
    committed_at: dict[int, int] = {}
    acks = _all_acks(reader, committed_at)
    writer.close()
    memory = [a["lsn"] for a in acks if a["durability_level"] == "MEMORY"]
    assert memory == [3, 4, 19, 21]
    contents = consolidated(client.read({"shard": shard}))
    assert sum(contents.values()) == 23
    # A replay is acked at the time its original landed: visible from then on, not before.
    t = committed_at[19]
    assert 20 in {k for (k, *_) in consolidated(client.read({"shard": shard, "as_of": t}))}
    assert 20 not in {k for (k, *_) in consolidated(client.read({"shard": shard, "as_of": t - 1}))}

    # A resend of a seq with other rows is refused, never acked.
    writer, reader = _exchange(client, shard, writer_id="producer-1")
    writer.begin(ROWS)
    writer.write_with_metadata(_rows(999), pa.py_buffer(b'{"seq": 4}'))
    writer.done_writing()
    with pytest.raises(fl.FlightServerError) as e:
        _all_acks(reader)
    assert payload(e.value)["error"] == "InvalidUsage"
    assert "other rows" in payload(e.value)["message"]

    # The same writer_id after a restart of the server still dedups, with the original LSNs.
    assert server.terminate() == 0
    server = start_server(_sqlite(tmp_path))
    with StreamingWriter(server.uri, shard, token=TOKEN, writer_id="producer-1") as w:
        # A producer restarting from its own last offsets: two replays, then a new write.
        assert w.write(_rows(20), seq=19) == 19
        assert w.write(_rows(22), seq=21) == 21
        # seq 22: new. A restarted server hands out LSNs above every one it used before.
        assert w.write(_rows(23), seq=22) > 21
        with pytest.raises(persist.InvalidUsage):
            w.write(_rows(1), seq=-1)
    # A resend with other rows ends the call: the write and everything after it fail.
    with (
        pytest.raises(persist.InvalidUsage, match="other rows"),
        StreamingWriter(server.uri, shard, token=TOKEN, writer_id="producer-1") as w,
    ):
        w.write(_rows(1000), seq=0)
    contents = consolidated(server.client().read({"shard": shard}))
    assert sum(contents.values()) == 24


def _wait(predicate: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail("timed out")
        time.sleep(0.02)


def test_backpressure_bounds_uncommitted_bytes(start_server: StartServer, tmp_path: Path) -> None:
    limit = 64 << 10
    server = start_server(
        _sqlite(tmp_path),
        "--max-buffer-bytes",
        str(limit),
        "--commit-interval-ms",
        "1500",
        "--metrics-port",
        "0",
    )
    metrics_url = server.lines.get(timeout=30).split()[-1]
    client = server.client()
    shard = new_shard()
    _create(client, shard)
    big = pa.record_batch(
        [pa.array([1] * 100, pa.int64()), pa.array(["x" * 100] * 100)], schema=ROWS
    )
    size = big.nbytes
    writer, reader = _exchange(client, shard)
    writer.begin(ROWS)
    acks: list[dict[str, Any]] = []

    def read() -> None:
        for chunk in reader:
            acks.extend(chunk.data.to_pylist())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    n = 3 * limit // size
    sender = threading.Thread(
        target=lambda: [writer.write_batch(big) for _ in range(n)] and None, daemon=True
    )
    sender.start()
    time.sleep(1.0)  # well before the first commit is due
    taken = sum(1 for a in list(acks) if a["durability_level"] == "MEMORY")
    committed = sum(1 for a in list(acks) if a["durability_level"] == "COMMITTED")
    assert committed == 0
    # One shard never holds more than half the limit, plus the one write a reading thread
    # holds: the rest is for the server's other shards.
    assert 0 < taken * size <= limit // 2 + size, (taken, size, limit)
    sender.join(60)
    writer.done_writing()
    t.join(60)
    writer.close()
    assert sum(1 for a in acks if a["durability_level"] == "COMMITTED") == n
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    waits = [
        ln for ln in text.splitlines() if ln.startswith("persist_flight_backpressure_waits_total")
    ]
    assert waits and float(waits[0].split()[-1]) > 0


def test_many_clients_into_one_shard_and_into_several(
    start_server: StartServer, write_location: tuple[str, str]
) -> None:
    server = start_server(write_location)
    client = server.client()
    shards = [new_shard() for _ in range(3)]
    for shard in shards:
        _create(client, shard)
    results: dict[tuple[int, str], list[int]] = {}
    errors: list[BaseException] = []

    def produce(i: int, shard: str) -> None:
        try:
            with StreamingWriter(server.uri, shard, token=TOKEN, writer_id=f"p{i}") as w:
                lsns = [w.write(_rows(i * 1000 + j), seq=j) for j in range(150)]
                w.wait_durable(lsns[-1], "COMMITTED", timeout=60)
            results[(i, shard)] = lsns
        except BaseException as exc:
            errors.append(exc)

    plan = [(0, shards[0]), (1, shards[0]), (2, shards[0]), (3, shards[1]), (4, shards[2])]
    threads = [threading.Thread(target=produce, args=p) for p in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for shard in shards:
        lsns = [x for (i, s), got in results.items() if s == shard for x in got]
        assert len(lsns) == len(set(lsns)), "an LSN was given twice"
        rows = consolidated(client.read({"shard": shard}))
        keys = {k for (k, _v, _t) in rows}
        expected = {i * 1000 + j for (i, s) in results if s == shard for j in range(150)}
        assert keys == expected | {0}
        assert sum(rows.values()) == len(expected) + 1  # each write exactly once


def test_doputs_and_other_writers_beside_a_stream_take_nothing_from_it(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Other writers may write a streamed shard at any time: the server's own DoPuts, another
    process's ``compare_and_append``. Every streamed write lands once, at the time its ack
    names, and no call fails for it."""
    loc = _sqlite(tmp_path)
    server = start_server(loc, "--commit-interval-ms", "300")
    client = server.client()
    shard = new_shard()
    _create(client, shard)
    w = StreamingWriter(server.uri, shard, token=TOKEN, writer_id="p")
    lsns = [w.write(_rows(k), seq=k) for k in (1, 2, 3)]
    w.wait_durable(lsns[-1], "LOCAL_DISK", timeout=30)
    # A DoPut while writes are pending: it goes in at once, the stream commits after it.
    upper = client.action("frontiers", {"shard": shard})["upper"]
    assert client.put(shard, updates([(9, "v9", upper, 1)]), upper, upper + 1) == {
        "upper": upper + 1
    }
    import asyncio

    async def other_writer() -> None:
        async with await persist.connect(*loc) as c:
            write = await c.open_writer(shard)
            for k in range(70, 75):
                await write.append_next(pa.table({"k": [k], "v": [f"v{k}"]}))
            await write.expire()

    more = threading.Thread(target=lambda: [w.write(_rows(k), seq=k) for k in range(4, 40)])
    more.start()
    asyncio.run(other_writer())
    more.join(60)
    lsn = w.write(_rows(40), seq=40)
    w.wait_durable(lsn, "COMMITTED", timeout=30)
    times = {k: w.committed_at(k - 1) for k in range(1, 41)}
    w.close()
    rows = consolidated(client.read({"shard": shard}))
    assert {k for (k, _v, _t) in rows} == {0, 9, *range(1, 41), *range(70, 75)}
    assert sum(rows.values()) == 1 + 1 + 40 + 5  # each exactly once
    upper = client.action("frontiers", {"shard": shard})["upper"]
    listen = client.info({"shard": shard, "listen": True, "as_of": 0, "until": upper})
    at = {r["k"]: r["_time"] for r in client.get(listen.endpoints[0].ticket).to_pylist()}
    assert {k: at[k] for k in times} == times  # each at the time its ack named


def test_reconnect_after_a_crash_resends_and_the_server_dedups(
    start_server: StartServer, tmp_path: Path
) -> None:
    import socket

    loc = _sqlite(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    wal = str(tmp_path / "wal")
    args = ("--wal-dir", wal, "--commit-interval-ms", "60000")
    server = start_server(loc, *args)
    shard = new_shard()
    _create(server.client(), shard)
    server.terminate()
    server = start_server(loc, *args, "--port", port)
    w = StreamingWriter(server.uri, shard, token=TOKEN, writer_id="feed", levels=["LOCAL_DISK"])
    lsns = [w.write(_rows(k), seq=k - 1) for k in (1, 2, 3)]
    w.wait_durable(lsns[-1], "LOCAL_DISK", timeout=30)
    server.proc.kill()  # SIGKILL: the writes are only in the WAL
    server.proc.wait()
    # Say the LOCAL_DISK ack of the last write had been lost with the connection: the writer
    # must resend it. (Every write it never heard LOCAL_DISK for is resent.)
    last = [2, _rows(3), lsns[-1]]
    w._not_on_disk[2] = last
    server = start_server(loc, *args, "--port", port)  # recovers the WAL before taking calls
    w.reconnect()
    # The resent write kept its LSN; this one is new, above every LSN of the crashed run.
    assert w.write(_rows(4), seq=3) > lsns[-1]
    w.close()
    assert server.terminate() == 0  # the drain commits what is pending
    server = start_server(loc, *args)
    rows = consolidated(server.client().read({"shard": shard}))
    assert sorted(k for (k, _v, _t) in rows) == [0, 1, 2, 3, 4]
    assert sum(rows.values()) == 5  # each exactly once


def test_put_and_exchange_take_what_tools_produce(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Lossless casts over Flight as in process: large and view strings, dictionaries, a
    narrower integer, nullable columns for NOT NULL fields holding no null."""
    server = start_server(_sqlite(tmp_path))
    client = server.client()
    shard = new_shard()
    strict = pa.schema([pa.field("k", pa.int64(), nullable=False), ("v", pa.string())])
    client.put(
        shard,
        pa.table(
            {"k": [0], "v": ["v0"], "_time": pa.array([0], pa.uint64())},
            schema=strict.append(pa.field("_time", pa.uint64())),
        ),
        0,
        1,
    )
    loose = pa.table(
        {
            "k": pa.array([1], pa.int32()),
            "v": pa.array(["v1"], pa.large_string()),
            "_time": pa.array([1], pa.uint64()),
        }
    )
    assert client.put(shard, loose, 1, 2) == {"upper": 2}
    streamed = pa.schema([("k", pa.int16()), ("v", pa.dictionary(pa.int8(), pa.string()))])
    with StreamingWriter(server.uri, shard, token=TOKEN, writer_id="tools") as w:
        batch = pa.record_batch(
            [pa.array([2], pa.int16()), pa.array(["v2"]).dictionary_encode()], schema=streamed
        )
        w.write_durable(pa.Table.from_batches([batch]), "COMMITTED", seq=0)
    # A stream has one schema (Flight's): views come on a stream of their own.
    with StreamingWriter(server.uri, shard, token=TOKEN, writer_id="views") as w:
        view = pa.record_batch(
            [pa.array([3]), pa.array(["v3"], pa.string_view())], names=["k", "v"]
        )
        w.write_durable(pa.Table.from_batches([view]), "COMMITTED", seq=0)
    rows = consolidated(client.read({"shard": shard}))
    assert sorted((k, v) for k, v, *_ in rows) == [(0, "v0"), (1, "v1"), (2, "v2"), (3, "v3")]
    # A lossy one is still refused, naming the column.
    with pytest.raises(fl.FlightServerError, match="'k'"):
        client.put(shard, loose.set_column(0, "k", pa.array([1.5])), 2, 3)


def test_a_long_lived_writer_remembers_a_window_of_lsns(
    start_server: StartServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found: ``StreamingWriter`` kept every LSN it was acked for, for good (about 80 bytes a
    write). An LSN that reached the top tier leaves its maps; past a window of them, every
    older LSN counts as done."""
    from persist.flight import _client

    monkeypatch.setattr(_client, "_DONE_WINDOW", 50)
    server = start_server(_sqlite(tmp_path))
    shard = new_shard()
    _create(server.client(), shard)
    with StreamingWriter(server.uri, shard, token=TOKEN, writer_id="w") as w:
        lsns = [w.write(_rows(k), seq=k) for k in range(300)]
        w.wait_durable(lsns[-1], "COMMITTED", timeout=30)
        _wait(lambda: not w._reached)
        assert len(w._done) == 50 and len(w._committed_at) <= 50
        # Old and recent LSNs alike are known to be done.
        w.wait_durable(lsns[0], "COMMITTED", timeout=0.01)
        w.wait_durable(lsns[-1], "COMMITTED", timeout=0.01)
        assert w.committed_at(lsns[-1]) is not None


def test_a_calls_sending_side_is_closed_once_and_never_beside_a_write() -> None:
    """The thread reading acks closes a call's sending side when the server fails it in band,
    and ``close`` does too, each outside the writer's lock: two of gRPC's sending operations at
    once abort the process (a CI rehearsal's fault harness died so). However the closes and a
    write interleave, the sending side is closed once and no write overlaps it."""
    from persist.flight._client import _Call

    class Sending:
        def __init__(self) -> None:
            self.busy = 0
            self.overlaps = 0
            self.closes = 0

        def _op(self) -> None:
            self.busy += 1
            if self.busy > 1:
                self.overlaps += 1
            time.sleep(0.001)
            self.busy -= 1

        def done_writing(self) -> None:
            self.closes += 1
            self._op()

        def begin(self, schema: Any) -> None:
            self._op()

        def write_batch(self, batch: Any) -> None:
            self._op()

    for _ in range(50):
        sending = Sending()
        call = _Call(sending, None, threading.Thread(target=lambda: None))
        go = threading.Barrier(3)

        def close(call: _Call = call, go: threading.Barrier = go) -> None:
            go.wait()
            call.done_writing()

        def write(call: _Call = call, go: threading.Barrier = go) -> None:
            go.wait()
            call.write(pa.record_batch({"x": [1]}), None)

        threads = [threading.Thread(target=f) for f in (close, close, write)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sending.closes == 1 and sending.overlaps == 0
