"""Streaming writes under the faults that once lost acknowledged writes, on a real server.

- A bad write (a null ``_diff``, a null under a NOT NULL column) is refused before its ``MEMORY``
  ack and ends only its own call; another client's writes in the same shard go on untouched.
- A logged write that can never be committed (a WAL an older server wrote) is set aside in the
  quarantine at restart: the server starts, and every other logged write is committed.
- A blob or consensus outage during group commits (failing before or after taking effect) loses
  nothing acked ``LOCAL_DISK``: the commits are retried until they land, no LSN is handed out
  twice, and a crash in the middle of the outage loses nothing either.
- A streaming write into a shard that does not exist creates it with the stream's columns.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl
import pytest

from persist.flight import StreamingWriter
from persist.flight._wal import WalRecord, encode_rows, frame, segment_header
from tests.flight.conftest import (
    TOKEN,
    Server,
    StartServer,
    cmd,
    consolidated,
    faulty_server,
    new_shard,
    payload,
    times_of,
)

# The shard's columns: k may not be null.
STRICT = pa.schema([pa.field("k", pa.int64(), nullable=False), ("v", pa.string())])
# What a stock client declares (pyarrow builds nullable fields), with a _diff.
LOOSE = pa.schema([("k", pa.int64()), ("v", pa.string()), ("_diff", pa.int64())])


def _sqlite(tmp_path: Path) -> tuple[str, str]:
    return (tmp_path / "blob").as_uri(), f"sqlite://{tmp_path / 'consensus.db'}"


def _create(client: Any, shard: str) -> None:
    """The shard, with k NOT NULL, holding (0, "start") at time 0."""
    table = pa.table(
        {
            "k": pa.array([0], pa.int64()),
            "v": pa.array(["start"]),
            "_time": pa.array([0], pa.uint64()),
        },
        schema=pa.schema([*STRICT, pa.field("_time", pa.uint64(), nullable=False)]),
    )
    assert client.put(shard, table, 0, 1) == {"upper": 1}


def _loose(k: int | None, diff: int | None = 1) -> pa.RecordBatch:
    return pa.record_batch(
        [pa.array([k], pa.int64()), pa.array([f"v{k}"]), pa.array([diff], pa.int64())],
        schema=LOOSE,
    )


def _row(k: int) -> pa.Table:
    # Big enough, and random enough not to compress, that a group's part goes to blob (a small
    # one is kept inline in the state).
    return pa.table({"k": [k], "v": [f"v{k}" + os.urandom(1000).hex()]})


def _contents(client: Any, shard: str) -> dict[tuple[Any, ...], int]:
    return consolidated(client.read({"shard": shard}))


def _honest_writer(uri: str, shard: str, keys: range, out: dict[str, Any]) -> None:
    """Another client streaming into the same shard, every write to COMMITTED."""
    try:
        with StreamingWriter(uri, shard, token=TOKEN, writer_id=f"honest-{keys[0]}") as w:
            lsns = [w.write(pa.table({"k": [k], "v": [f"v{k}"]}), seq=k) for k in keys]
            for lsn in lsns:
                w.wait_durable(lsn, "COMMITTED", timeout=60)
        out["lsns"] = lsns
    except BaseException as exc:
        out["error"] = exc


@pytest.mark.parametrize("bad", ["null _diff", "null under NOT NULL"])
def test_a_bad_write_ends_only_its_own_call(
    start_server: StartServer, tmp_path: Path, bad: str
) -> None:
    server = start_server(_sqlite(tmp_path), "--commit-interval-ms", "20")
    client = server.client()
    shard = new_shard()
    _create(client, shard)
    honest: dict[str, Any] = {}
    other = threading.Thread(
        target=_honest_writer, args=(server.uri, shard, range(100, 400), honest)
    )
    other.start()
    # A deadline: a call that never ends (as once when its writes were dropped) fails the test.
    writer, reader = client.flight.do_exchange(
        cmd({"shard": shard, "op": "streaming_write"}), client.options_with(30)
    )
    writer.begin(LOOSE)
    writer.write_batch(_loose(1))
    time.sleep(0.05)  # the honest client's writes are in the same groups as ours
    writer.write_batch(_loose(2, None) if bad == "null _diff" else _loose(None))
    acks: list[dict[str, Any]] = []
    with pytest.raises(fl.FlightServerError) as e:
        for chunk in reader:
            acks += chunk.data.to_pylist()
    assert payload(e.value)["error"] == "InvalidUsage"
    # Only the good write was taken: exactly one MEMORY ack, none for the bad one.
    assert [a["lsn"] for a in acks if a["durability_level"] == "MEMORY"] == [acks[0]["lsn"]]
    other.join(120)
    assert "error" not in honest, honest.get("error")
    assert len(honest["lsns"]) == 300 and len(set(honest["lsns"])) == 300
    rows = _contents(client, shard)
    keys = sorted(k for (k, _v, _t) in rows)
    assert keys == [0, 1, *range(100, 400)], "a write lost, or the bad one applied"
    assert all(d == 1 for d in rows.values())


def test_a_logged_write_that_can_never_commit_is_quarantined_at_restart(
    start_server: StartServer, tmp_path: Path
) -> None:
    loc = _sqlite(tmp_path)
    server = start_server(loc, "--metrics-port", "0")
    shard = new_shard()
    _create(server.client(), shard)
    server.terminate()
    # A WAL as an older server left it: its LOCAL_DISK writes include one with a null under the
    # NOT NULL column (it took it without looking), between honest ones.
    records = []
    for lsn, k in ((1, 1), (2, None), (3, 3)):
        rows = pa.table({"k": pa.array([k], pa.int64()), "v": [f"v{k}"], "_diff": [1]})
        records.append(WalRecord([lsn], "old", [lsn], [1], encode_rows(rows)))
    # Written as the WAL's format says (a segment header, then framed records).
    schema = pa.schema([*STRICT, pa.field("_diff", pa.int64(), nullable=False)])
    segment = tmp_path / "wal" / shard / f"{1:020d}.1.seg"
    segment.parent.mkdir(parents=True)
    segment.write_bytes(segment_header(schema) + frame(records))
    server = start_server(loc, "--metrics-port", "0")
    times = times_of(server.client(), shard)
    assert sorted(times) == [1, 3] and all(len(t) == 1 for t in times.values())
    assert _metric(server, f'persist_flight_quarantined_writes_total{{shard="{shard}"}}') == 1
    assert server.terminate() == 0
    server.wait_for_log("set aside")
    quarantine = tmp_path / "wal" / shard / "quarantine"
    note = json.loads((quarantine / f"{2:020d}.json").read_text())
    assert note["lsn"] == 2 and "not nullable" in note["why"], note
    assert not list((tmp_path / "wal" / shard).glob("*.seg")), "the resolved segment stays"
    # A second restart finds nothing left to do, and the shard takes writes again.
    server = start_server(loc)
    with StreamingWriter(server.uri, shard, token=TOKEN) as w:
        w.write_durable(pa.table({"k": [9], "v": ["v9"]}))
    assert sorted(times_of(server.client(), shard)) == [1, 3, 9]
    listed = server.client().action("quarantine", {"shard": shard})
    assert [(q["shard"], q["lsn"], q["writer_id"], q["seq"]) for q in listed] == [
        (shard, 2, "old", 2)
    ]
    assert "not nullable" in listed[0]["why"] and listed[0]["at"]


def _outage(tmp_path: Path, ops: list[str], before: float, after: float = 0.0) -> None:
    (tmp_path / "outage").write_text(json.dumps({"ops": ops, "before": before, "after": after}))


def _metric(server: Server, name: str) -> float:
    uri = next(line.split()[-1] for line in list(server.lines.queue) if "metrics at" in line)
    text = urllib.request.urlopen(uri, timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize(
    "outage",
    [
        (["blob.set"], 1.0, 0.0),
        (["consensus.compare_and_set"], 1.0, 0.0),
        (["consensus.compare_and_set"], 0.0, 1.0),  # it took effect, then the reply was lost
    ],
    ids=["blob", "consensus-before", "consensus-after"],
)
def test_an_outage_during_group_commits_loses_no_acked_write(
    tmp_path: Path, outage: tuple[list[str], float, float]
) -> None:
    loc = _sqlite(tmp_path)
    server = faulty_server(tmp_path, loc, commit_interval_ms=20, metrics=True)
    try:
        client = server.client()
        shard = new_shard()
        _create(client, shard)
        w = StreamingWriter(server.uri, shard, token=TOKEN, writer_id="feed")
        lsns = {k: w.write(_row(k), seq=k) for k in range(1, 101)}
        w.wait_durable(lsns[100], "COMMITTED", timeout=60)
        _outage(tmp_path, *outage)
        during = {k: w.write(_row(k), seq=k) for k in range(101, 201)}
        for lsn in during.values():
            w.wait_durable(lsn, "LOCAL_DISK", timeout=60)
        time.sleep(1.0)  # commits fail all along
        if outage[1]:
            # Failing before they take effect, the commits can't have landed meanwhile.
            with pytest.raises(TimeoutError):
                w.wait_durable(during[200], "COMMITTED", timeout=0.01)
        (tmp_path / "outage").unlink()
        after = {k: w.write(_row(k), seq=k) for k in range(201, 251)}
        for lsn in [*during.values(), *after.values()]:
            w.wait_durable(lsn, "COMMITTED", timeout=60)
        every = {**lsns, **during, **after}
        at = {k: w.committed_at(lsn) for k, lsn in every.items()}
        w.close()
        assert len(set(every.values())) == len(every), "an LSN handed out twice"
        assert times_of(client, shard) == {k: [t] for k, t in at.items()}, "lost, doubled, moved"
        assert server.terminate() == 0
        injected = _injected(server)
        assert all(injected.get(op) for op in outage[0]), ("the outage met no call", injected)
    finally:
        server.kill()


def _injected(server: Server) -> dict[str, int]:
    """The faults the child injected, by operation (it says so when it stops)."""
    line = next(line for line in server.stderr if line.startswith("faults injected"))
    counts: dict[str, int] = json.loads(line[line.index("{") :])
    return counts


def test_a_crash_during_an_outage_loses_no_write_acked_local_disk(tmp_path: Path) -> None:
    loc = _sqlite(tmp_path)
    server = faulty_server(tmp_path, loc, commit_interval_ms=20, metrics=True)
    shard = new_shard()
    try:
        _create(server.client(), shard)
        w = StreamingWriter(server.uri, shard, token=TOKEN, writer_id="feed", levels=["LOCAL_DISK"])
        _outage(tmp_path, ["blob.set"], 1.0)
        acked = {k: w.write(_row(k), seq=k) for k in range(1, 201)}
        for lsn in acked.values():
            w.wait_durable(lsn, "LOCAL_DISK", timeout=60)
        time.sleep(0.3)  # a few failed commits
        server.proc.kill()  # SIGKILL in the middle of the outage
        server.proc.wait()
        (tmp_path / "outage").unlink()
        server = faulty_server(tmp_path, loc, commit_interval_ms=20, metrics=True)
        client = server.client()
        times = times_of(client, shard)
        assert sorted(times) == sorted(acked) and all(len(t) == 1 for t in times.values())
        # The restarted server goes on above every LSN the crashed one handed out.
        again = StreamingWriter(server.uri, shard, token=TOKEN, writer_id="feed2")
        assert again.write(pa.table({"k": [500], "v": ["v500"]}), seq=0) > max(acked.values())
        again.close()
        assert server.terminate() == 0
    finally:
        server.kill()


def test_a_stream_into_a_new_shard_creates_it_with_its_columns(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(_sqlite(tmp_path))
    client = server.client()
    shard = new_shard()
    with StreamingWriter(server.uri, shard, token=TOKEN) as w:
        lsn = w.write_durable(pa.table({"name": ["ada"], "n": pa.array([3], pa.int32())}))
        at = w.committed_at(lsn)
    schema = client.flight.get_schema(cmd({"shard": shard}), client.options).schema
    assert schema.names == ["name", "n", "_time", "_diff"]
    assert schema.field("n").type == pa.int32()
    rows = client.read({"shard": shard}).to_pylist()
    assert (lsn, at) == (0, 0)  # the first LSN of this server's log, at the first time
    assert rows == [{"name": "ada", "n": 3, "_time": at, "_diff": 1}]


def test_a_damaged_wal_record_is_reported_and_the_records_after_it_are_recovered(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Found: one flipped byte in the middle of a segment made recovery keep the records before
    it, cut the file there and later delete the segment: 7 of 8 fsynced, acked writes gone,
    logged as "recovered 1 write(s)"."""
    loc = _sqlite(tmp_path)
    args = ("--commit-interval-ms", "60000", "--metrics-port", "0")
    server = start_server(loc, *args)
    shard = new_shard()
    _create(server.client(), shard)
    w = StreamingWriter(server.uri, shard, token=TOKEN, writer_id="w", levels=["LOCAL_DISK"])
    for k in range(1, 9):
        # Each waited to LOCAL_DISK before the next: a record (and an fsync) each.
        w.wait_durable(w.write(_row(k), seq=k), "LOCAL_DISK", timeout=30)
    server.proc.kill()
    server.proc.wait()
    (segment,) = (tmp_path / "wal" / shard).glob("*.seg")
    data = bytearray(segment.read_bytes())
    body = len(data) // 8  # about a record: the middle of the second one
    data[body + body // 2] ^= 0x10
    segment.write_bytes(bytes(data))
    server = start_server(loc, *args)
    client = server.client()
    # The seven records that pass their checksums are committed; the damaged one is reported.
    assert len(times_of(client, shard)) == 7
    assert _metric(server, "persist_flight_wal_failures_total") == 1
    listed = client.action("quarantine", {"shard": shard})
    assert [(q["lsn"], q["seq"]) for q in listed] == [(None, None)] and listed[0]["why"]
    assert server.terminate() == 0
    errors = [line for line in server.stderr if "damaged" in line]
    assert errors and "ERROR" in errors[0], server.stderr
    kept = list((tmp_path / "wal" / shard / "quarantine").glob("*.seg"))
    assert [p.name for p in kept] == [segment.name], "the damaged segment is kept aside"
    assert kept[0].read_bytes() == bytes(data)
    note = json.loads(kept[0].with_suffix(".seg.json").read_text())
    assert note["damage"] and note["at"]
