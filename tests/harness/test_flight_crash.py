"""The Flight server killed (SIGKILL) mid-stream, again and again: every write acked
``LOCAL_DISK`` or later is committed exactly once by the restart, and one acked ``COMMITTED`` at
the time its ack named."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

from persist.flight._wal import WalRecord, encode_rows, frame
from tests.flight.conftest import TOKEN, Server, cmd, new_shard, updates

ROWS = pa.schema([("k", pa.int64()), ("v", pa.string())])
RANK = {"MEMORY": 0, "LOCAL_DISK": 1, "OBJECT_STORAGE": 2, "COMMITTED": 3}
ROUNDS = 10


def _serve(loc: tuple[str, str], wal: Path, interval_ms: int) -> Server:
    return Server(
        [
            "--blob", loc[0], "--consensus", loc[1], "--port", "0", "--token", TOKEN,
            "--wal-dir", str(wal), "--commit-interval-ms", str(interval_ms),
        ]
    )  # fmt: skip


def _stream_until_killed(server: Server, shard: str, round_: int, seconds: float) -> dict[int, Any]:
    """Streams writes (k = round * 1e6 + j) until the server is killed after ``seconds``;
    returns k -> [lsn or None, highest tier rank acked, committed_at or None]."""
    client = server.client()
    writer, reader = client.flight.do_exchange(
        cmd({"shard": shard, "op": "streaming_write", "writer_id": f"round-{round_}"}),
        client.options,
    )
    writer.begin(ROWS)
    sent: list[int] = []
    seen: dict[int, Any] = {}
    lsn_k: dict[int, int] = {}
    lock = threading.Lock()

    def read() -> None:
        memory = 0
        try:
            for chunk in reader:
                md = json.loads(chunk.app_metadata.to_pybytes()) if chunk.app_metadata else {}
                at = {int(k): t for k, t in md.get("committed_at", {}).items()}
                with lock:
                    for a in chunk.data.to_pylist():
                        lsn, rank = a["lsn"], RANK[a["durability_level"]]
                        if rank == 0:
                            k = sent[memory]
                            memory += 1
                            seen[k] = [lsn, 0, None]
                            lsn_k[lsn] = k
                        else:
                            entry = seen[lsn_k[lsn]]
                            assert rank == entry[1] + 1, "tiers come in order, each once"
                            entry[1] = rank
                            if rank == RANK["COMMITTED"]:
                                entry[2] = at[lsn]
        except fl.FlightError:
            pass  # the server was killed

    acks = threading.Thread(target=read, daemon=True)
    acks.start()
    stop = time.monotonic() + seconds
    j = 0
    try:
        while time.monotonic() < stop:
            k = round_ * 1_000_000 + j
            with lock:
                sent.append(k)
            writer.write_with_metadata(
                pa.record_batch([pa.array([k], pa.int64()), pa.array([f"r{round_}"])], schema=ROWS),
                pa.py_buffer(json.dumps({"seq": j}).encode()),
            )
            j += 1
            if j % 50 == 0:
                time.sleep(0.005)  # a producer, not a flood: commits happen meanwhile
    except fl.FlightError:
        pass
    server.proc.kill()  # SIGKILL: no drain, no commit of what is pending
    server.proc.wait()
    acks.join(30)
    return seen


def test_sigkill_mid_stream_loses_no_write_acked_local_disk(tmp_path: Path) -> None:
    rng = random.Random(1234)
    loc = ((tmp_path / "blob").as_uri(), f"sqlite://{tmp_path / 'consensus.db'}")
    wal = tmp_path / "wal"
    shard = new_shard()
    server = _serve(loc, wal, 50)
    server.client().put(shard, updates([(0, "start", 0, 1)]), 0, 1)
    acked: dict[int, Any] = {}
    try:
        for round_ in range(ROUNDS):
            if round_:
                server = _serve(loc, wal, rng.choice([20, 50, 200, 1000]))
            acked.update(_stream_until_killed(server, shard, round_, rng.uniform(0.3, 0.8)))
        server = _serve(loc, wal, 50)
        client = server.client()
        upper = client.action("frontiers", {"shard": shard})["upper"]
        listen = client.info({"shard": shard, "listen": True, "as_of": 0, "until": upper})
        rows = client.get(listen.endpoints[0].ticket).to_pylist() if upper > 1 else []
    finally:
        server.kill()
    where: dict[int, list[int]] = {}
    for r in rows:
        assert r["_diff"] == 1
        where.setdefault(r["k"], []).append(r["_time"])
    durable = {k: lsn for k, (lsn, rank, _) in acked.items() if rank >= RANK["LOCAL_DISK"]}
    assert durable, "no write reached LOCAL_DISK: the test proved nothing"
    for k, lsn in durable.items():
        assert where.get(k) is not None, f"write {k} acked LOCAL_DISK (LSN {lsn}) is not there"
    for k, times in where.items():
        assert len(times) == 1, f"write {k} was committed {len(times)} times"
        if k in acked and acked[k][2] is not None:
            assert times == [acked[k][2]], "a write is at the time its COMMITTED ack named"
    # Some writes were taken but never reached the disk before a kill, others were pending in
    # the WAL (recovered by a restart): the rounds covered both.
    pending_at_kill = [k for k, (_, rank, _) in acked.items() if rank in (1, 2)]
    print(
        f"{len(acked)} acked, {len(durable)} on disk, {len(pending_at_kill)} recovered, {len(where)} present"
    )
    assert pending_at_kill


def test_a_torn_last_wal_record_is_dropped_at_restart(tmp_path: Path) -> None:
    loc = ((tmp_path / "blob").as_uri(), f"sqlite://{tmp_path / 'consensus.db'}")
    wal = tmp_path / "wal"
    shard = new_shard()
    # Commits a minute away: the writes stay in the WAL when the server is killed.
    server = _serve(loc, wal, 60_000)
    try:
        client = server.client()
        client.put(shard, updates([(0, "start", 0, 1)]), 0, 1)
        writer, reader = client.flight.do_exchange(
            cmd({"shard": shard, "op": "streaming_write", "levels": ["LOCAL_DISK"]}),
            client.options,
        )
        writer.begin(ROWS)
        for k in (1, 2, 3):
            writer.write_batch(
                pa.record_batch([pa.array([k], pa.int64()), pa.array(["x"])], schema=ROWS)
            )
        on_disk: set[int] = set()
        for chunk in reader:
            on_disk |= {
                a["lsn"] for a in chunk.data.to_pylist() if a["durability_level"] == "LOCAL_DISK"
            }
            if len(on_disk) == 3:
                break
        server.proc.kill()
        server.proc.wait()
    finally:
        server.kill()
    (segment,) = (wal / shard).glob("*.seg")
    # A record torn in the middle of its write: the next append, cut short by the crash in its
    # payload (its header holds, its length says more than is there). Junk would be damage, not
    # a torn tail (``persist.flight._wal``).
    rows = pa.table({"k": [4], "v": ["torn"], "_diff": [1]})
    torn = frame([WalRecord([max(on_disk) + 1], "torn", [-1], [1], encode_rows(rows))])
    with segment.open("ab") as f:
        f.write(torn[: len(torn) // 2])
    server = _serve(loc, wal, 50)
    try:
        client = server.client()
        assert client.action("frontiers", {"shard": shard})["upper"] == 4
        listen = client.info({"shard": shard, "listen": True, "as_of": 0, "until": 4})
        rows = client.get(listen.endpoints[0].ticket).to_pylist()
        # The three logged writes, each once; the torn record named none.
        assert sorted(r["k"] for r in rows) == [1, 2, 3]
        deadline = time.monotonic() + 10
        while "recovered 3 logged write(s)" not in "".join(server.stderr):
            assert time.monotonic() < deadline, server.stderr
            time.sleep(0.05)
        assert "ends in a write torn by a crash" in "".join(server.stderr), server.stderr
    finally:
        server.kill()
    assert not list((wal / shard).glob("*.seg")), "recovered segments are deleted"
    assert not (wal / shard / "quarantine").exists(), "a torn tail is no damage"
