"""The streaming-write path end to end, under every fault it is meant to survive at once.

Rounds of a real server (``_flight_child.py``: ``persist serve`` over fault-injecting locations,
Postgres consensus) with producers streaming named writes into three shards while, at random:
hostile clients send every kind of bad write the protocol lets them build; blob and consensus
outages hit the group commits (failing before, or after taking effect); a DoGet client stops
reading; and each round ends with SIGKILL or SIGTERM. Producers reconnect each round and resend
what they never heard ``LOCAL_DISK`` for, as ``StreamingWriter.reconnect`` does.

Then one last clean run, and the audit, over every ack any client ever got:
- every write acked ``LOCAL_DISK`` or later is in its shard exactly once, at the LSN it was acked
  with; no write is in twice; no bad write is in at all;
- an LSN acked (even ``MEMORY``) for one write is never acked for another: LSNs are not reused,
  crash or not;
- a bad write ends its own call with ``InvalidUsage`` before any ack of its own, and nothing
  else: the honest producers' calls only end with the round.

``PERSIST_TEST_SCALE`` multiplies the rounds; the figures are printed with the harness's.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

import persist
from persist.flight import StreamingWriter
from persist.testing import scaled
from tests.flight.conftest import TOKEN, Server, cmd, faulty_server, payload
from tests.harness.conftest import Figures

SCHEMA = pa.schema(
    [pa.field("k", pa.int64(), nullable=False), ("v", pa.string()), ("d", pa.date64())]
)
RANK = {"MEMORY": 0, "LOCAL_DISK": 1, "OBJECT_STORAGE": 2, "COMMITTED": 3}
ROUNDS = scaled(6)
PRODUCERS = 4
SHARDS = 3
OUTAGES = {
    "blob outage": (["blob.set"], 1.0, 0.0),
    "consensus outage": (["consensus.compare_and_set"], 1.0, 0.0),
    "consensus replies lost": (["consensus.compare_and_set"], 0.0, 1.0),
}


def _rows(k: int, *, big: bool = False) -> pa.Table:
    v = f"v{k}" + (os.urandom(600).hex() if big else "")
    return pa.table(
        {
            "k": pa.array([k], pa.int64()),
            "v": [v],
            "d": pa.array([86_400_000 * (k % 50)], pa.date64()),
        }
    )


def _bad(kind: str, k: int) -> tuple[pa.RecordBatch, bytes | None, bool]:
    """A bad write of ``kind``: (its batch, its app_metadata, whether the call has a writer_id)."""
    good = pa.record_batch(_rows(k).to_batches()[0].columns, names=["k", "v", "d"])

    def with_col(name: str, arr: pa.Array) -> pa.RecordBatch:
        cols = [*good.columns, arr]
        return pa.record_batch(cols, names=[*good.schema.names, name])

    if kind == "null _diff":
        return with_col("_diff", pa.array([None], pa.int64())), None, False
    if kind == "null under NOT NULL":
        b = pa.record_batch(
            [pa.array([None], pa.int64()), *good.columns[1:]], names=good.schema.names
        )
        return b, None, False
    if kind == "lossy type":
        b = pa.record_batch([pa.array([k + 0.5]), *good.columns[1:]], names=good.schema.names)
        return b, None, False
    if kind == "_time column":
        return with_col("_time", pa.array([7], pa.uint64())), None, False
    if kind == "extra column":
        return with_col("extra", pa.array([1])), None, False
    if kind == "missing column":
        return pa.record_batch(good.columns[:2], names=["k", "v"]), None, False
    if kind == "_diff not an int":
        return with_col("_diff", pa.array(["1"])), None, False
    if kind == "diffs overflow":
        two = pa.Table.from_batches([good, good]).combine_chunks().to_batches()[0]
        diff = pa.array([2**62, 2**62], pa.int64())
        return (
            pa.record_batch([*two.columns, diff], names=[*two.schema.names, "_diff"]),
            None,
            False,
        )
    if kind == "date64 not a whole day":
        b = pa.record_batch(
            [*good.columns[:2], pa.array([1], pa.date64())], names=good.schema.names
        )
        return b, None, False
    if kind == "metadata not JSON":
        return good, b"{seq", True
    if kind == "seq without writer_id":
        return good, b'{"seq": 1}', False
    if kind == "seq negative":
        return good, b'{"seq": -1}', True
    if kind == "seq not an int":
        return good, b'{"seq": true}', True
    if kind == "metadata with other keys":
        return good, b'{"seq": 1, "x": 2}', True
    raise AssertionError(kind)


BAD_KINDS = [
    "null _diff",
    "null under NOT NULL",
    "lossy type",
    "_time column",
    "extra column",
    "missing column",
    "_diff not an int",
    "diffs overflow",
    "date64 not a whole day",
    "metadata not JSON",
    "seq without writer_id",
    "seq negative",
    "seq not an int",
    "metadata with other keys",
]


@dataclass
class Sent:
    """One named write of a producer, over every round it was sent in."""

    shard: str
    k: int
    lsns: set[int] = field(default_factory=set)  # every LSN it was acked MEMORY with
    durable: dict[int, int] = field(default_factory=dict)  # lsn -> highest tier rank acked


@dataclass
class Tally:
    rounds: int = 0
    writes: int = 0
    replays_sent: int = 0
    acks: Counter[str] = field(default_factory=Counter)
    bad: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    injected: Counter[str] = field(default_factory=Counter)
    recovered: int = 0


class Producer:
    """A named writer streaming into one shard, round after round."""

    def __init__(self, name: str, shard: str, base: int, figures: Tally) -> None:
        self.name = name
        self.shard = shard
        self.base = base
        self.next = 0
        self.sent: dict[int, Sent] = {}  # seq -> the write
        self.figures = figures
        self.lock = threading.Lock()
        self.error: BaseException | None = None

    def _acked(self, seq: int, lsn: int, tier: str) -> None:
        with self.lock:
            s = self.sent[seq]
            s.durable[lsn] = max(s.durable.get(lsn, 0), RANK[tier])
            self.figures.acks[tier] += 1

    def run(self, uri: str, stop: threading.Event, big: bool) -> None:
        try:
            w = StreamingWriter(uri, self.shard, token=TOKEN, writer_id=self.name)
            with self.lock:
                resend = [q for q, s in self.sent.items() if not any(s.durable.values())]
            for seq in resend:  # what was never acked LOCAL_DISK: the server dedups
                self._write(w, seq, big)
                self.figures.replays_sent += 1
            if stop.is_set():
                w.close()  # the last run: every write to every tier, then the call ends
                return
            while not stop.is_set():
                seq = self.next
                self.next += 1
                with self.lock:
                    self.sent[seq] = Sent(self.shard, self.base + seq)
                self._write(w, seq, big)
                if seq % 20 == 0:
                    time.sleep(0.002)
        except Exception as exc:  # the round ended under it (a kill, a drain)
            if not isinstance(exc, (fl.FlightError, OSError)) and "closed" not in str(exc):
                self.error = exc

    def _write(self, w: StreamingWriter, seq: int, big: bool) -> None:
        lsn = w.write(_rows(self.base + seq, big=big), seq=seq)
        with self.lock:
            self.sent[seq].lsns.add(lsn)
            self.figures.writes += 1
        for tier in ("LOCAL_DISK", "COMMITTED"):
            w.on_durable(lsn, tier, lambda s=seq, t=tier, x=lsn: self._acked(s, x, t))


def _hostile(
    uri: str, shards: list[str], rng: random.Random, figures: Tally, out: list[str]
) -> None:
    """Calls that each make one good write, then one bad one: the bad one must end only that
    call, with InvalidUsage, and get no ack of its own."""
    client = fl.FlightClient(uri)
    options = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
    for kind in rng.sample(BAD_KINDS, 5):
        shard = rng.choice(shards)
        batch, metadata, named = _bad(kind, -1_000_000 - rng.randrange(10**6))
        command: dict[str, Any] = {"shard": shard, "op": "streaming_write"}
        if named:
            command["writer_id"] = f"hostile-{rng.randrange(10**9)}"
        try:
            writer, reader = client.do_exchange(cmd(command), options)
            good = pa.record_batch(
                _rows(-5_000_000 - rng.randrange(10**6)).to_batches()[0].columns,
                names=["k", "v", "d"],
            )
            if batch.schema == good.schema:
                writer.begin(good.schema)
                writer.write_batch(good)
                memory_expected = 1
            else:
                writer.begin(batch.schema)
                memory_expected = 0
            if metadata is None:
                writer.write_batch(batch)
            else:
                writer.write_with_metadata(batch, pa.py_buffer(metadata))
            acks: list[dict[str, Any]] = []
            try:
                for chunk in reader:
                    acks += chunk.data.to_pylist()
                out.append(f"{kind}: the call ended without an error")
                continue
            except fl.FlightServerError as exc:
                if payload(exc)["error"] != "InvalidUsage":
                    out.append(f"{kind}: {payload(exc)}")
            memory = [a for a in acks if a["durability_level"] == "MEMORY"]
            if len(memory) != memory_expected:
                out.append(f"{kind}: {len(memory)} MEMORY acks, expected {memory_expected}")
            figures.bad[kind] += 1
        except (fl.FlightUnavailableError, fl.FlightCancelledError, OSError):
            return  # the round ended (a kill)


def _stall_a_reader(uri: str, shard: str, holder: list[Any]) -> None:
    """A DoGet client that reads one batch and stops reading, holding its call open."""
    client = fl.FlightClient(uri)
    options = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
    try:
        info = client.get_flight_info(cmd({"shard": shard}), options)
        if info.endpoints:
            stream = client.do_get(info.endpoints[0].ticket, options)
            stream.read_chunk()
            holder.append((client, stream))
    except fl.FlightError:
        pass


async def _hold_since(loc: tuple[str, str], shards: list[str]) -> None:
    async with await persist.connect(*loc) as client:
        for shard in shards:
            reader = await client.open_leased_reader(shard, purpose="audit", lease_duration_s=3600)
            assert reader.since == 0


def _injected(server: Server, figures: Tally) -> None:
    said = [line for line in server.stderr if line.startswith("faults injected")]
    if said:  # the last word: the counts so far, said as they changed
        for op, n in json.loads(said[-1][said[-1].index("{") :]).items():
            figures.injected[op] += n
    for line in server.stderr:
        if "recovered" in line and "from the WAL" in line:
            figures.recovered += int(line.split("recovered ")[1].split()[0])


def _contents(uri: str, shard: str) -> dict[int, list[int]]:
    """k -> the times its rows are at (a listen from 0 to the upper)."""
    client = fl.FlightClient(uri)
    options = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
    body = json.dumps({"shard": shard}).encode()
    (result,) = client.do_action(fl.Action("frontiers", body), options)
    upper = json.loads(result.body.to_pybytes())["upper"]
    info = client.get_flight_info(
        cmd({"shard": shard, "listen": True, "as_of": 0, "until": upper}), options
    )
    out: dict[int, list[int]] = {}
    for row in client.do_get(info.endpoints[0].ticket, options).read_all().to_pylist():
        assert row["_diff"] == 1, row
        out.setdefault(row["k"], []).append(row["_time"])
    return out


def test_streaming_writes_survive_every_fault_at_once(
    tmp_path: Path, postgres_uri: str, figures: Figures
) -> None:
    rng = random.Random(20261125)
    loc = ((tmp_path / "blob").as_uri(), postgres_uri)
    tally = Tally()
    problems: list[str] = []
    server = faulty_server(tmp_path, loc, commit_interval_ms=50, drain_grace_s=2.0)
    shards = []
    try:
        client = server.client()
        for i in range(SHARDS):
            shard = f"s{uuid.uuid4()}"
            t = _rows(i).append_column(
                pa.field("_time", pa.uint64(), nullable=False), pa.array([0], pa.uint64())
            )
            t = t.cast(pa.schema([*SCHEMA, pa.field("_time", pa.uint64(), nullable=False)]))
            assert client.put(shard, t, 0, 1) == {"upper": 1}
            shards.append(shard)
        server.terminate()
        # The audit reads every write at its own time: a reader of ours holds each shard's
        # since at 0 (its lease outlives the test; GetFlightInfo's readers would move it up).
        asyncio.run(_hold_since(loc, shards))
        producers = [
            Producer(f"p{i}", shards[i % SHARDS], (i + 1) * 10_000_000, tally)
            for i in range(PRODUCERS)
        ]
        for _ in range(ROUNDS):
            tally.rounds += 1
            server = faulty_server(
                tmp_path, loc, commit_interval_ms=rng.choice([10, 50, 200]), drain_grace_s=2.0
            )
            stop = threading.Event()
            big = rng.random() < 0.5  # parts in blob (else inline in the state)
            threads = [
                threading.Thread(target=p.run, args=(server.uri, stop, big), daemon=True)
                for p in producers
            ]
            threads.append(
                threading.Thread(
                    target=_hostile, args=(server.uri, shards, rng, tally, problems), daemon=True
                )
            )
            for t in threads:
                t.start()
            stalled: list[Any] = []
            time.sleep(rng.uniform(0.3, 0.8))
            if rng.random() < 0.5:
                _stall_a_reader(server.uri, rng.choice(shards), stalled)
                tally.faults["stalled DoGet readers"] += len(stalled)
            kind = rng.choice([*OUTAGES, None])
            if kind is not None:
                ops, before, after = OUTAGES[kind]
                (tmp_path / "outage").write_text(
                    json.dumps({"ops": ops, "before": before, "after": after})
                )
                tally.faults[kind] += 1
                time.sleep(rng.uniform(0.3, 1.0))
                if rng.random() < 0.7:
                    (tmp_path / "outage").unlink()
            time.sleep(rng.uniform(0.2, 0.6))
            if rng.random() < 0.75:
                server.proc.send_signal(signal.SIGKILL)
                server.proc.wait()
                tally.faults["SIGKILL"] += 1
            else:
                (tmp_path / "outage").unlink(missing_ok=True)  # a drain commits what it can
                started = time.monotonic()
                code = server.terminate(timeout=60)
                assert code == 0, server.stderr[-20:]
                assert time.monotonic() - started < 2.0 + 10, "the drain overran its grace"
                tally.faults["SIGTERM"] += 1
            stop.set()
            for t in threads:
                t.join(30)
            _injected(server, tally)
            (tmp_path / "outage").unlink(missing_ok=True)
            stalled.clear()
        # The last run: no faults; every producer resends what it never heard LOCAL_DISK for.
        server = faulty_server(tmp_path, loc, commit_interval_ms=50, drain_grace_s=2.0)
        stop = threading.Event()
        stop.set()
        for p in producers:
            p.run(server.uri, stop, False)
        time.sleep(0.5)
        assert server.terminate() == 0
        _injected(server, tally)
        server = faulty_server(tmp_path, loc, commit_interval_ms=50, drain_grace_s=2.0)
        contents = {shard: _contents(server.uri, shard) for shard in shards}
        assert server.terminate() == 0
    finally:
        server.kill()

    assert not problems, problems
    for p in producers:
        assert p.error is None, f"producer {p.name}: {p.error!r}"
    lost = duplicated = durable = 0
    owner: dict[tuple[str, int], int] = {}
    for p in producers:
        for s in p.sent.values():
            for lsn in s.lsns:
                other = owner.setdefault((s.shard, lsn), s.k)
                assert other == s.k, f"LSN {lsn} of {s.shard} acked for {other} and {s.k}"
            times = contents[s.shard].get(s.k, [])
            duplicated += len(times) > 1
            acked = [lsn for lsn, rank in s.durable.items() if rank >= RANK["LOCAL_DISK"]]
            if acked:
                durable += 1
                if times != acked:
                    lost += 1
            assert set(times) <= s.lsns, f"write {s.k} is at {times}, never acked there"
    bad_present = [k for c in contents.values() for k in c if k < 0 and k > -5_000_000]
    print(
        f"flight faults: {tally.rounds} rounds, {tally.writes} writes "
        f"({tally.replays_sent} resent), {durable} acked LOCAL_DISK or later, "
        f"acks {dict(tally.acks)}, recovered from WALs {tally.recovered}; "
        f"faults {dict(tally.faults)}; injected {dict(tally.injected)}; "
        f"bad writes refused {sum(tally.bad.values())} of {len(tally.bad)} kinds "
        f"{dict(tally.bad)}; lost {lost}, duplicated {duplicated}"
    )
    figures.processes += tally.rounds + 3
    figures.crashes_survived += tally.faults["SIGKILL"]
    figures.acknowledged_writes += durable
    figures.acknowledged_lost += lost
    figures.acknowledged_duplicated += duplicated
    figures.bad_inputs_refused += sum(tally.bad.values())
    figures.faults_injected_before += sum(tally.injected.values())
    figures.note(
        "flight streaming writes",
        rounds=tally.rounds,
        writes=tally.writes,
        acked_local_disk=durable,
        recovered=tally.recovered,
        sigkills=tally.faults["SIGKILL"],
        outages=sum(tally.faults[k] for k in OUTAGES),
        faults=sum(tally.injected.values()),
        bad_writes=sum(tally.bad.values()),
        bad_kinds=len(tally.bad),
        stalled_readers=tally.faults["stalled DoGet readers"],
        lost=lost,
        duplicated=duplicated,
    )
    assert lost == 0 and duplicated == 0
    assert not bad_present, f"bad writes applied: {bad_present}"
    assert durable > 100 and tally.faults["SIGKILL"] and sum(tally.injected.values())
    assert len(tally.bad) >= 8, "the hostile clients tried too few kinds"
