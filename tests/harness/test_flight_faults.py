"""The streaming-write path end to end, in a world that holds every actor and fault that can touch
what a streaming server owns, all at once.

The actors and faults (each round draws which of them act, and when):

- **two servers** (``_flight_child.py``: ``persist serve`` over fault-injecting locations,
  Postgres consensus), each with its own ``--wal-dir`` and its own fault switch, serving one
  location and streaming into the same shards at the same time; and once, a third started on a
  live server's ``--wal-dir`` (refused: the directory is locked);
- **producers**: named writers (``writer_id``, ``seq``) streaming into the shards through either
  server. One that loses its call (its server killed or drained), and at random one whose server
  is fine, reconnects to a live server (the other one when it can) and resends what it never
  heard ``LOCAL_DISK`` for, with the same rows; each round it restarts with a new
  ``StreamingWriter`` and goes on from its next seq;
- **a buggy client** that restarts and reuses a seq of its own with other rows, on the same
  server or the other one: refused, or (both copies taken) the second to commit set aside;
- **hostile clients** sending every kind of bad write the protocol lets them build;
- **DoPut clients** (compare-and-append at the upper) through either server;
- **a Python writer** in the test process (``persist.connect``: ``append_next`` and
  ``compare_and_append``) into the shards the servers stream into;
- **blob and consensus outages** on either server's commits (failing before, or after taking
  effect), on and off at random;
- **a DoGet client** that stops reading, holding its call open;
- **SIGKILL** of one server mid-round (the other goes on; the killed one restarts on its WAL),
  and **SIGKILL or SIGTERM** (a drain) of each at a round's end;
- **drops** (``drop_shard(force=True)``, from the test process) of a shard both servers stream
  into, mid-stream, and of a shard only one server streams into, between that server's SIGKILL
  and its restart (its WAL holds writes of it); then a client opening a new stream into the
  dropped shard. Extra shards: the others keep running;
- **WAL damage** between a SIGKILL and the restart: a bit flip, a truncation or a zeroed
  512-byte block at a random byte of a random segment of the killed server's WAL
  (``_wal_damage.py``);
- **clocks**: not injected. Both servers, their clients and the test share this machine's
  clock, and nothing here steps it, so a server's writer expired by a skewed committer while
  its shard lives on is not in this world (the skew guard, ``core.shard.clock``, is tested in
  ``tests/api/test_hostile.py``).

Then a last clean run of both servers (each producer resends what it never heard ``LOCAL_DISK``
for and waits for ``COMMITTED``), and the audit, over every ack any client ever got:

- a write acked ``LOCAL_DISK`` or later (by any server) is in its shard exactly once; or its
  shard was dropped and it is in the shard's last state (the tombstone records every named write
  that landed), or set aside by the server that acked it (listed by ``quarantine``, why: the
  shard is gone); or it is the losing copy of a seq reused with other rows, set aside so; or its
  WAL record was damaged and the restart reported it (an ERROR, the segment's copy in
  ``quarantine/``): those are counted. Nothing is ever silently missing;
- a write acked ``COMMITTED`` is at the time its ack's ``committed_at`` named (a listen from 0
  gives each row's ``_time``); no write is in twice, and never both rows of a reused seq;
- an LSN a server acked (even ``MEMORY``) for one write is never acked by it for another;
- a DoPut or Python write that succeeded is in once, at its time; one refused is not in;
- a bad write ends its own call with ``InvalidUsage`` before any ack of its own and is never
  applied; nothing else ends with it;
- a dropped shard's streams end with ``InvalidUsage`` within a bound, a new one is refused, and
  the other shards take writes after the drop;
- no call hangs: every call has a deadline or ends with its server, every thread is joined
  within a bound, and one still running is a failure.

The soak (``test_streaming_soak_two_servers_one_shard``) is the same world on one shard, with
longer rounds. ``PERSIST_TEST_SCALE`` multiplies the rounds of both and the soak's durations;
the figures are printed, and added to the harness's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import signal
import subprocess
import sys
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
from persist.core.stream.streams import lookup
from persist.flight import StreamingWriter
from persist.testing import scale, scaled
from tests.flight.conftest import FAULTY_CHILD, TOKEN, Server, cmd, faulty_server, payload
from tests.harness._wal_damage import KINDS as DAMAGE_KINDS
from tests.harness._wal_damage import Corruption, damage
from tests.harness.conftest import Figures

SCHEMA = pa.schema(
    [pa.field("k", pa.int64(), nullable=False), ("v", pa.string()), ("d", pa.date64())]
)
TIERS = ("MEMORY", "LOCAL_DISK", "OBJECT_STORAGE", "COMMITTED")
RANK = {tier: i for i, tier in enumerate(TIERS)}
SERVERS = ("a", "b")
OUTAGES = {
    "blob outage": (["blob.set"], 1.0, 0.0),
    "consensus outage": (["consensus.compare_and_set"], 1.0, 0.0),
    "consensus replies lost": (["consensus.compare_and_set"], 0.0, 1.0),
}
CALL_S = 20.0  # the deadline of every call the harness makes but the streams (they end with
JOIN_S = 30.0  # their server); and how long a thread may take to end once told to
DROP_NOTICED_S = 15.0  # how long a stream into a dropped shard may go on
SESSIONS = 400  # calls one producer may open in one round (each loop is bounded in count)
WRITES_PER_CALL = 200_000
# Where each actor's rows are (k): a write is known by its k alone.
BASE_PRODUCER = 10_000_000
BASE_PUT = 700_000_000
BASE_PYTHON = 800_000_000
BASE_BUGGY = 900_000_000
BASE_EXTRA = 1_000_000_000  # the producers of the extra shards (to be dropped)
OTHER_ROWS = 50_000_000  # a reused seq's other rows: k + this
BAD_LOW, BAD_HIGH = -5_000_000, 0  # bad writes' k; hostile calls' good writes are below
GOOD_HOSTILE = -10_000_000


def _rows(k: int, *, big: bool = False) -> pa.Table:
    # Big rows don't compress (their parts go to blob, not inline), and are the same bytes
    # every time: a resend must hold the rows it names.
    v = f"v{k}" + (random.Random(k).randbytes(600).hex() if big else "")
    return pa.table(
        {
            "k": pa.array([k], pa.int64()),
            "v": [v],
            "d": pa.array([86_400_000 * (k % 50)], pa.date64()),
        }
    )


def _stamped(k: int, t: int) -> pa.Table:
    """``_rows(k)`` at time ``t``, with the shard's schema: a DoPut's or a Python write's."""
    table = _rows(k).append_column(
        pa.field("_time", pa.uint64(), nullable=False), pa.array([t], pa.uint64())
    )
    return table.cast(pa.schema([*SCHEMA, pa.field("_time", pa.uint64(), nullable=False)]))


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


def _options(timeout: float = CALL_S) -> fl.FlightCallOptions:
    headers = [(b"authorization", f"Bearer {TOKEN}".encode())]
    return fl.FlightCallOptions(headers=headers, timeout=timeout)


def _action(uri: str, name: str, body: dict[str, Any]) -> Any:
    client = fl.FlightClient(uri)
    (result,) = client.do_action(fl.Action(name, json.dumps(body).encode()), _options())
    return json.loads(result.body.to_pybytes())


def _error_name(exc: fl.FlightError) -> str | None:
    try:
        return str(json.loads(exc.extra_info)["error"])
    except (TypeError, ValueError, KeyError):
        return None


# --- what the clients were told ------------------------------------------------------------------


@dataclass
class Ack:
    """What one server said of one write: under ``lsn`` (its log's), up to tier ``rank``."""

    server: str
    lsn: int
    rank: int = 0
    committed_at: int | None = None


@dataclass
class Sent:
    """One named write (``writer``, ``seq``: rows ``k``), over every call it was sent in."""

    writer: str
    seq: int
    shard: str
    k: int
    big: bool = False
    acks: dict[tuple[str, int], Ack] = field(default_factory=dict)  # (server, lsn) -> Ack
    taken: float | None = None  # when it was first acked MEMORY (time.monotonic)
    refused: bool = False  # a call ended with InvalidUsage on it (the buggy client's)

    def on_disk(self) -> bool:
        return any(a.rank >= RANK["LOCAL_DISK"] for a in self.acks.values())


@dataclass
class Put:
    """A DoPut (``how`` "put") or a Python write ("python"): ``outcome`` ok, refused, unknown."""

    how: str
    shard: str
    k: int
    time: int
    outcome: str


@dataclass
class Tally:
    rounds: int = 0
    processes: int = 0
    writes: int = 0
    replays_sent: int = 0
    switches: int = 0
    acks: Counter[str] = field(default_factory=Counter)
    bad: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    injected: Counter[str] = field(default_factory=Counter)
    drops: Counter[str] = field(default_factory=Counter)
    corruptions: Counter[str] = field(default_factory=Counter)
    buggy: Counter[str] = field(default_factory=Counter)
    recovered: int = 0
    drop_noticed_s: float = 0.0


# --- the world ------------------------------------------------------------------------------------


class World:
    """Two servers on one location, the shards, the clients' records, and what went wrong."""

    def __init__(self, tmp: Path, loc: tuple[str, str], rng: random.Random) -> None:
        self.tmp = tmp
        self.loc = loc
        self.rng = rng
        self.tally = Tally()
        self.lock = threading.RLock()
        self.live: dict[str, Server] = {}
        self.stopped: list[Server] = []  # every server that ran, once it stopped
        self.main: list[str] = []
        self.extra: list[str] = []  # shards made to be dropped (maybe)
        self.dropped: dict[str, float] = {}  # shard -> when it was dropped
        self.dropping: set[str] = set()  # shards a drop was started for
        self.sent: list[Sent] = []
        self.puts: list[Put] = []
        self.corruptions: list[Corruption] = []
        self.problems: list[str] = []
        self.hostile_k = itertools.count(1)
        self.story: list[str] = []
        self.began = time.monotonic()

    def problem(self, text: str) -> None:
        self.say(f"PROBLEM {text}")
        with self.lock:
            self.problems.append(text)

    def say(self, text: str) -> None:
        """A line of the run's story (printed when the test fails)."""
        with self.lock:
            self.story.append(f"{time.monotonic() - self.began:7.2f} {text}")

    # servers

    def wal(self, name: str) -> Path:
        return self.tmp / f"wal-{name}"

    def control(self, name: str) -> Path:
        path = self.tmp / f"ctl-{name}"
        path.mkdir(exist_ok=True)
        return path

    def start(self, names: list[str], interval_ms: int | None = None) -> None:
        """Starts the servers ``names`` at once (each recovers its WAL before it takes calls).
        One that does not come up within the bound (60 s) is a problem, and is started again
        once, so that the run goes on to its audit."""
        intervals = {n: interval_ms or self.rng.choice([10, 50, 200]) for n in names}
        for attempt in range(2):
            made: dict[str, Server] = {}
            errors: dict[str, BaseException] = {}

            def one(
                name: str, made: dict[str, Server] = made, errors: dict[str, Any] = errors
            ) -> None:
                (self.control(name) / "outage").unlink(missing_ok=True)
                try:
                    made[name] = faulty_server(
                        self.tmp,
                        self.loc,
                        wal_dir=str(self.wal(name)),
                        control=str(self.control(name)),
                        commit_interval_ms=intervals[name],
                        drain_grace_s=2.0,
                    )
                except BaseException as failed:
                    errors[name] = failed

            threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in names]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            self.tally.processes += len(made) + len(errors)
            with self.lock:
                self.live.update(made)
            for name, server in made.items():
                self.say(f"server {name} started: {server.uri} {server.proc.pid}")
            for name, exc in errors.items():
                self.problem(f"server {name} did not come up (try {attempt + 1}): {exc!s:.1500}")
            names = [n for n in names if n not in made]
            if not names:
                return
        raise AssertionError(f"servers {names} did not come up, twice: {self.problems[-2:]}")

    def pick(self, only: str | None = None, avoid: str | None = None) -> tuple[str, str] | None:
        """A live server (name, uri): ``only`` that one; else not ``avoid`` when another is."""
        with self.lock:
            names = [n for n in self.live if only is None or n == only]
            if avoid is not None and len(names) > 1:
                names = [n for n in names if n != avoid]
            if not names:
                return None
            name = random.choice(names)
            return name, self.live[name].uri

    def uri(self, name: str) -> str:
        with self.lock:
            return self.live[name].uri

    def kill(self, name: str) -> None:
        with self.lock:
            server = self.live.pop(name)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        self.say(f"server {name} SIGKILLed")
        with self.lock:
            self.tally.faults["SIGKILL"] += 1
            self._stopped(server)

    def terminate(self, name: str) -> None:
        (self.control(name) / "outage").unlink(missing_ok=True)  # a drain commits what it can
        with self.lock:
            server = self.live.pop(name)
        started = time.monotonic()
        code = server.terminate(timeout=60)
        if code != 0:
            self.problem(f"server {name} drained with exit code {code}: {server.stderr[-20:]}")
        if time.monotonic() - started > 2.0 + 10:
            self.problem(f"the drain of server {name} overran its grace")
        self.say(f"server {name} drained (SIGTERM) in {time.monotonic() - started:.2f} s")
        with self.lock:
            self.tally.faults["SIGTERM"] += 1
            self._stopped(server)

    def _stopped(self, server: Server) -> None:
        self.stopped.append(server)
        # The last word: the counts so far, said as they changed (a kill may cut the last line
        # short, or another thread's log may run into it).
        for line in reversed([x for x in server.stderr if x.startswith("faults injected")]):
            with contextlib.suppress(ValueError):
                counts, _ = json.JSONDecoder().raw_decode(line[line.index("{") :])
                for op, n in counts.items():
                    self.tally.injected[op] += n
                break

    def outage(self, name: str, kind: str) -> None:
        ops, before, after = OUTAGES[kind]
        (self.control(name) / "outage").write_text(
            json.dumps({"ops": ops, "before": before, "after": after})
        )
        self.tally.faults[kind] += 1
        self.say(f"server {name}: {kind} on")

    def outage_off(self, name: str) -> None:
        if (self.control(name) / "outage").exists():
            self.say(f"server {name}: outage off")
        (self.control(name) / "outage").unlink(missing_ok=True)

    # shards

    def create(self, shards: list[str]) -> None:
        """Creates ``shards`` (a first row at time 0), from the test process; a reader of ours
        holds each one's since at 0 (its lease outlives the test), so that the audit can read
        every write at its own time."""

        async def make() -> None:
            async with await persist.connect(*self.loc) as client:
                for i, shard in enumerate(shards):
                    writer = await client.open_writer(shard, SCHEMA, purpose="harness setup")
                    await writer.compare_and_append(_stamped(i, 0), 0, 1)
                    await writer.expire()
                    reader = await client.open_leased_reader(
                        shard, purpose="audit", lease_duration_s=3600
                    )
                    assert reader.since == 0

        asyncio.run(asyncio.wait_for(make(), CALL_S * 3))

    def drop(self, shard: str, why: str) -> None:
        with self.lock:
            self.dropping.add(shard)  # a stream may hear of it before this returns

        async def go() -> None:
            async with await persist.connect(*self.loc) as client:
                await client.drop_shard(shard, force=True)

        asyncio.run(asyncio.wait_for(go(), CALL_S))
        with self.lock:
            self.dropped[shard] = time.monotonic()
        self.tally.drops[why] += 1
        self.say(f"dropped {shard} ({why})")

    def record(self, sent: Sent) -> Sent:
        with self.lock:
            self.sent.append(sent)
        return sent


def _quiet_close(w: StreamingWriter) -> None:
    """Ends a call the client moves away from, in the background: its acks still count."""

    def close() -> None:
        with contextlib.suppress(Exception):
            w.close()

    threading.Thread(target=close, daemon=True).start()


class Producer:
    """A named writer streaming into one shard, round after round, through either server (or
    ``only`` one); it restarts with a new ``StreamingWriter`` each round and on every switch."""

    def __init__(
        self, world: World, name: str, shard: str, base: int, only: str | None = None
    ) -> None:
        self.world = world
        self.name = name
        self.shard = shard
        self.base = base
        self.only = only
        self.next = 0
        self.sent: dict[int, Sent] = {}
        self.big = False
        self.error: BaseException | None = None
        self.ended: float | None = None  # when its shard's drop ended its call
        self.rng = random.Random(base)

    def run(self, stop: threading.Event, final: bool = False) -> None:
        try:
            avoid = None
            for _ in range(SESSIONS):
                if self.ended is not None or (stop.is_set() and not final):
                    return
                target = self.world.pick(self.only, avoid)
                if target is None:
                    if final:
                        return
                    stop.wait(0.05)
                    continue
                switched = self._session(*target, stop, final)
                if switched is None:
                    return
                avoid = target[0] if switched else None
        except BaseException as exc:
            self.error = exc

    def _session(self, server: str, uri: str, stop: threading.Event, final: bool) -> bool | None:
        """One call: resends, then new writes. True: it switched away from a fine server;
        False: the server went away; None: done."""
        try:
            w = StreamingWriter(uri, self.shard, token=TOKEN, writer_id=self.name)
            with self.world.lock:
                resend = sorted(q for q, s in self.sent.items() if not s.on_disk())
            for seq in resend:  # what was never acked LOCAL_DISK: the servers dedup
                self._write(w, server, self.sent[seq])
                with self.world.lock:
                    self.world.tally.replays_sent += 1
            if final:
                w.close()  # every write to every tier, then the call ends
                return None
            switch_after = self.rng.randrange(10, 150) if self.rng.random() < 0.5 else None
            n = 0
            while not stop.is_set() and n < WRITES_PER_CALL:
                seq = self.next
                self.next += 1
                s = Sent(self.name, seq, self.shard, self.base + seq, self.big)
                with self.world.lock:
                    self.sent[seq] = s
                self.world.record(s)
                self._write(w, server, s)
                n += 1
                if switch_after is not None and n >= switch_after:
                    _quiet_close(w)  # a client moving to the other server
                    with self.world.lock:
                        self.world.tally.switches += 1
                    return True
                if seq % 20 == 0:
                    time.sleep(0.002)
            return None
        except persist.InvalidUsage as exc:
            if self.shard in self.world.dropping:
                self.ended = time.monotonic()
                return None
            self.error = exc
            return None
        except (fl.FlightError, OSError, persist.ExternalError):
            return False  # its server was killed or drained: reconnect
        except Exception as exc:
            if "closed" in str(exc):
                return False
            raise

    def _write(self, w: StreamingWriter, server: str, s: Sent) -> None:
        lsn = w.write(_rows(s.k, big=s.big), seq=s.seq)
        _taken(self.world, w, server, s, lsn)


def _taken(world: World, w: StreamingWriter, server: str, s: Sent, lsn: int) -> None:
    """``s`` was acked MEMORY at ``lsn`` by ``server``: records it, and every later tier."""
    now = time.monotonic()
    with world.lock:
        s.acks.setdefault((server, lsn), Ack(server, lsn))
        if s.taken is None:
            s.taken = now
        world.tally.acks["MEMORY"] += 1
        world.tally.writes += 1

    def acked(tier: str) -> None:
        at = w.committed_at(lsn) if tier == "COMMITTED" else None
        with world.lock:
            a = s.acks[(server, lsn)]
            a.rank = max(a.rank, RANK[tier])
            world.tally.acks[tier] += 1
            if tier == "COMMITTED":
                if at is None:
                    world.problems.append(f"{s.writer}/{s.seq}: COMMITTED without committed_at")
                elif a.committed_at not in (None, at):
                    world.problems.append(f"{s.writer}/{s.seq}: acked at {a.committed_at}, {at}")
                a.committed_at = at

    for tier in TIERS[1:]:
        w.on_durable(lsn, tier, lambda t=tier: acked(t))


def _buggy(world: World, shards: list[str], stop: threading.Event, state: dict[str, int]) -> None:
    """A client that restarts and reuses a seq of its own with other rows: five writes through
    one server, then one of their seqs again, other rows, through either server."""
    rng = random.Random(state.setdefault("seed", 7) + state.get("next", 0))
    for _ in range(40):
        if stop.wait(rng.uniform(0.05, 0.2)):
            return
        first = world.pick()
        if first is None:
            continue
        shard = rng.choice(shards)
        seqs = list(range(state.get("next", 0), state.get("next", 0) + 5))
        state["next"] = seqs[-1] + 1
        calls: list[StreamingWriter] = []
        try:
            w1 = StreamingWriter(first[1], shard, token=TOKEN, writer_id="buggy")
            calls.append(w1)
            for seq in seqs:
                s = world.record(Sent("buggy", seq, shard, BASE_BUGGY + seq))
                _taken(world, w1, first[0], s, w1.write(_rows(s.k), seq=seq))
            second = world.pick()
            if second is None:
                continue
            seq = rng.choice(seqs)
            again = world.record(Sent("buggy", seq, shard, BASE_BUGGY + OTHER_ROWS + seq))
            world.tally.buggy["seqs reused"] += 1
            world.tally.buggy["on the other server" if second[0] != first[0] else "same"] += 1
            w2 = StreamingWriter(second[1], shard, token=TOKEN, writer_id="buggy")
            calls.append(w2)
            try:
                lsn = w2.write(_rows(again.k), seq=seq)
                _taken(world, w2, second[0], again, lsn)
                w2.wait_durable(lsn, "COMMITTED", timeout=3)
            except persist.InvalidUsage:
                again.refused = True
                world.tally.buggy["refused"] += 1
            except TimeoutError:
                pass
        except (fl.FlightError, OSError, persist.ExternalError, persist.InvalidUsage):
            pass  # a server went away (or the first call's write was set aside meanwhile)
        finally:
            for w in calls:
                _quiet_close(w)


def _hostile(world: World, shards: list[str], stop: threading.Event) -> None:
    """Calls that each make one good write, then one bad one: the bad one must end only that
    call, with InvalidUsage, and get no ack of its own."""
    rng = random.Random(len(world.sent))
    for kind in rng.sample(BAD_KINDS, 5):
        if stop.is_set():
            return
        target = world.pick()
        if target is None:
            continue
        client = fl.FlightClient(target[1])
        shard = rng.choice(shards)
        n = next(world.hostile_k)
        batch, metadata, named = _bad(kind, BAD_LOW + n)
        command: dict[str, Any] = {"shard": shard, "op": "streaming_write"}
        if named:
            command["writer_id"] = f"hostile-{n}"
        try:
            writer, reader = client.do_exchange(cmd(command), _options())
            good = pa.record_batch(
                _rows(GOOD_HOSTILE - n).to_batches()[0].columns, names=["k", "v", "d"]
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
                world.problem(f"{kind}: the call ended without an error")
                continue
            except fl.FlightServerError as exc:
                if shard in world.dropping:
                    continue
                if payload(exc)["error"] != "InvalidUsage":
                    world.problem(f"{kind}: {payload(exc)}")
            memory = [a for a in acks if a["durability_level"] == "MEMORY"]
            if len(memory) != memory_expected:
                world.problem(f"{kind}: {len(memory)} MEMORY acks, expected {memory_expected}")
            world.tally.bad[kind] += 1
        except fl.FlightTimedOutError:
            world.problem(f"{kind}: the call hung past its deadline")
        except (fl.FlightUnavailableError, fl.FlightCancelledError, OSError):
            continue  # its server was killed


def _doputs(world: World, shards: list[str], stop: threading.Event, ks: itertools.count) -> None:
    """Compare-and-appends at the upper, through either server."""
    rng = random.Random(next(ks))
    for _ in range(200):
        if stop.wait(rng.uniform(0.03, 0.12)):
            return
        target = world.pick()
        if target is None:
            continue
        shard = rng.choice(shards)
        k = BASE_PUT + next(ks)
        try:
            upper = _action(target[1], "frontiers", {"shard": shard})["upper"]
        except fl.FlightError:
            continue
        put = Put("put", shard, k, upper, "unknown")
        with world.lock:
            world.puts.append(put)
        try:
            table = _stamped(k, upper)
            client = fl.FlightClient(target[1])
            writer, reader = client.do_put(
                cmd({"shard": shard, "expected_upper": upper, "new_upper": upper + 1}),
                table.schema,
                _options(),
            )
            writer.write_table(table)
            writer.done_writing()
            reader.read()
            writer.close()
            put.outcome = "ok"
        except fl.FlightError as exc:
            if _error_name(exc) == "UpperMismatch":
                put.outcome = "refused"
            elif isinstance(exc, fl.FlightTimedOutError):
                world.problem(f"a DoPut of {shard} hung past its deadline")


def _python_writer(world: World, stop: threading.Event) -> None:
    """``append_next`` and ``compare_and_append`` from this process into the main shards."""

    async def go() -> None:
        rng = random.Random(99)
        ks = itertools.count(1)
        async with await persist.connect(*world.loc) as client:
            writers = {s: await client.open_writer(s, purpose="harness") for s in world.main}
            for _ in range(100_000):
                if stop.is_set():
                    return
                await asyncio.sleep(rng.uniform(0.02, 0.08))
                shard = rng.choice(world.main)
                w = writers[shard]
                k = BASE_PYTHON + next(ks)
                if rng.random() < 0.5:
                    put = Put("python", shard, k, -1, "unknown")
                    with world.lock:
                        world.puts.append(put)
                    try:
                        put.time = await asyncio.wait_for(w.append_next(_rows(k)), CALL_S)
                        put.outcome = "ok"
                    except TimeoutError:
                        world.problem(f"append_next into {shard} hung past {CALL_S} s")
                    continue
                upper = await w.fetch_recent_upper()
                assert upper is not None
                put = Put("python", shard, k, upper, "unknown")
                with world.lock:
                    world.puts.append(put)
                try:
                    await asyncio.wait_for(
                        w.compare_and_append(_stamped(k, upper), upper, upper + 1), CALL_S
                    )
                    put.outcome = "ok"
                except persist.UpperMismatch:
                    put.outcome = "refused"
                except TimeoutError:
                    world.problem(f"compare_and_append into {shard} hung past {CALL_S} s")

    try:
        asyncio.run(go())
    except BaseException as exc:
        world.problem(f"the Python writer failed: {exc!r}")


def _stall_a_reader(uri: str, shard: str, holder: list[Any]) -> None:
    """A DoGet client that reads one batch and stops reading, holding its call open."""
    client = fl.FlightClient(uri)
    try:
        info = client.get_flight_info(cmd({"shard": shard}), _options())
        if info.endpoints:
            stream = client.do_get(info.endpoints[0].ticket, _options(120))
            stream.read_chunk()
            holder.append((client, stream))
    except fl.FlightError:
        pass


def _contents(uri: str, shard: str) -> dict[int, list[int]]:
    """k -> the times its rows are at (a listen from 0 to the upper)."""
    client = fl.FlightClient(uri)
    upper = _action(uri, "frontiers", {"shard": shard})["upper"]
    info = client.get_flight_info(
        cmd({"shard": shard, "listen": True, "as_of": 0, "until": upper}), _options()
    )
    out: dict[int, list[int]] = {}
    table = client.do_get(info.endpoints[0].ticket, _options(120)).read_all()
    for row in table.to_pylist():
        assert row["_diff"] == 1, row
        out.setdefault(row["k"], []).append(row["_time"])
    return out


def _tombstones(loc: tuple[str, str], wanted: list[Sent]) -> dict[tuple[str, str, int], int | None]:
    """(shard, writer, seq) -> the time a dropped shard's last state records it landed at (None: it
    never landed). A drop keeps the shard's record of its named writes in its tombstone."""

    async def go() -> dict[tuple[str, str, int], int | None]:
        out: dict[tuple[str, str, int], int | None] = {}
        async with await persist.connect(*loc) as client:
            states = {}
            for s in wanted:
                if s.shard not in states:
                    machine = await client._shards.loaded(s.shard)
                    assert machine.state.finalized, s.shard
                    states[s.shard] = machine.state
                found = lookup(states[s.shard], s.writer, s.seq)
                out[(s.shard, s.writer, s.seq)] = None if found is None else found.time
        return out

    return asyncio.run(asyncio.wait_for(go(), CALL_S * 3))


def _join(world: World, threads: list[threading.Thread], what: str) -> None:
    deadline = time.monotonic() + JOIN_S
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
        if t.is_alive():
            world.problem(f"{what}: thread {t.name} did not end within {JOIN_S} s (a hang)")


def _third_server_refused(world: World) -> None:
    """A server started on a live server's ``--wal-dir`` is refused, and the live one goes on."""
    cfg = {
        "blob": world.loc[0],
        "consensus": world.loc[1],
        "control": str(world.control("c")),
        "wal_dir": str(world.wal("a")),
        "token": TOKEN,
    }
    try:
        done = subprocess.run(
            [sys.executable, FAULTY_CHILD, json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        world.problem("a server on a live server's --wal-dir did not exit")
        return
    world.tally.processes += 1
    if done.returncode == 0 or "in use by another server" not in done.stderr:
        world.problem(f"a server on a live --wal-dir: {done.returncode} {done.stderr[-500:]}")
    else:
        world.tally.faults["servers refused a live --wal-dir"] += 1


# --- one run ---------------------------------------------------------------------------------------


@dataclass
class Plan:
    name: str
    seed: int
    rounds: int
    shards: int
    producers: int
    dwell: float  # the length of a round's quiet stretches, in seconds (before the scale)


@dataclass
class Audit:
    durable: int = 0
    lost: int = 0
    duplicated: int = 0
    false_acks: int = 0
    both_versions: int = 0
    excused_by_damage: int = 0
    lost_to_a_torn_tail: int = 0  # of lost: damage the restart called a tail torn by a crash
    set_aside: Counter[str] = field(default_factory=Counter)
    puts: Counter[str] = field(default_factory=Counter)
    details: list[str] = field(default_factory=list)


class Run:
    """The rounds of one plan, then the last clean run and the audit."""

    def __init__(self, tmp: Path, loc: tuple[str, str], plan: Plan) -> None:
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.world = World(tmp, loc, self.rng)
        self.producers: list[Producer] = []
        self.homes: dict[str, Producer] = {}  # server -> the producer of its own extra shard
        self.extras: list[Producer] = []
        self.buggy: dict[str, int] = {"seed": plan.seed}
        self.put_keys = itertools.count(1)
        self.progress: list[tuple[str, float]] = []  # (dropped shard, when its drop was seen)
        self.damage_kinds = itertools.cycle(DAMAGE_KINDS)

    def sleep(self, low: float, high: float) -> None:
        time.sleep(self.rng.uniform(low, high) * self.plan.dwell)

    def run(self) -> Audit:
        w = self.world
        w.main = [f"s{uuid.uuid4()}" for _ in range(self.plan.shards)]
        w.create(w.main)
        self.producers = [
            Producer(w, f"p{i}", w.main[i % len(w.main)], (i + 1) * BASE_PRODUCER)
            for i in range(self.plan.producers)
        ]
        python_stop = threading.Event()
        python = threading.Thread(target=_python_writer, args=(w, python_stop), daemon=True)
        python.start()
        try:
            for r in range(self.plan.rounds):
                self.round(r)
            python_stop.set()
            _join(w, [python], "the Python writer")
            return self.last_run()
        finally:
            python_stop.set()
            for server in list(w.live.values()) + w.stopped:
                server.kill()

    def home(self, name: str) -> Producer:
        """The producer of the extra shard only server ``name`` streams into (a new one once
        that shard was dropped)."""
        p = self.homes.get(name)
        if p is None or p.shard in self.world.dropped:
            shard = f"s{uuid.uuid4()}"
            self.world.create([shard])
            self.world.extra.append(shard)
            n = len(self.extras)
            base = BASE_EXTRA + n * BASE_PRODUCER
            p = Producer(self.world, f"home-{name}-{n}", shard, base, name)
            self.homes[name] = p
            self.extras.append(p)
        return p

    def round(self, r: int) -> None:
        w, rng = self.world, self.rng
        w.tally.rounds += 1
        w.say(f"round {r}")
        w.start([n for n in SERVERS if n not in w.live])
        if r == 0 and self.plan.name == "faults":
            _third_server_refused(w)
        # The round's doomed shard: both servers stream into it, and it is dropped mid-stream.
        doomed: list[Producer] = []
        if r % 2 == 0 or rng.random() < 0.5:
            shard = f"s{uuid.uuid4()}"
            w.create([shard])
            w.extra.append(shard)
            for name in SERVERS:
                n = len(self.extras)
                base = BASE_EXTRA + n * BASE_PRODUCER
                p = Producer(w, f"doomed-{name}-{n}", shard, base, name)
                doomed.append(p)
                self.extras.append(p)
        homes = [self.home(name) for name in SERVERS]
        stop = threading.Event()
        big = rng.random() < 0.5  # parts in blob (else inline in the state)
        producers = self.producers + homes + doomed
        for p in producers:
            p.big = big
        threads = [
            threading.Thread(target=p.run, args=(stop,), daemon=True, name=p.name)
            for p in producers
        ]
        threads += [
            threading.Thread(
                target=_buggy, args=(w, w.main, stop, self.buggy), daemon=True, name="buggy"
            ),
            threading.Thread(
                target=_hostile, args=(w, w.main + [p.shard for p in homes], stop), daemon=True
            ),
            threading.Thread(
                target=_doputs, args=(w, w.main, stop, self.put_keys), daemon=True, name="doputs"
            ),
        ]
        for t in threads:
            t.start()
        stalled: list[Any] = []
        self.sleep(0.3, 0.6)
        if doomed:
            self.drop_mid_stream(doomed)
        if rng.random() < 0.5:
            target = w.pick()
            if target is not None:
                _stall_a_reader(target[1], rng.choice(w.main), stalled)
                w.tally.faults["stalled DoGet readers"] += len(stalled)
        kind = rng.choice([*OUTAGES, None])
        if kind is not None:
            where = rng.choice(SERVERS)
            w.outage(where, kind)
            self.sleep(0.3, 1.0)
            if rng.random() < 0.7:
                w.outage_off(where)
        if r == 1 or rng.random() < 0.6:
            # One server killed mid-round: the other goes on; the killed one restarts.
            name = rng.choice(SERVERS)
            w.kill(name)
            w.tally.faults["SIGKILL mid-round"] += 1
            self.after_kill(name, force=r == 1)
            w.start([name])
        self.sleep(0.2, 0.6)
        # The round's end: each server killed or drained (at once).
        killed = [name for name in SERVERS if rng.random() < 0.7]
        ends = [
            threading.Thread(target=w.kill if name in killed else w.terminate, args=(name,))
            for name in SERVERS
        ]
        for t in ends:
            t.start()
        for t in ends:
            t.join(90)
        stop.set()
        for name in killed:
            self.after_kill(name)
        _join(w, threads, f"round {r}")
        stalled.clear()
        for name in SERVERS:
            w.outage_off(name)

    def drop_mid_stream(self, doomed: list[Producer]) -> None:
        """Drops the shard ``doomed`` stream into, both servers live: their calls must end
        with InvalidUsage within a bound, a new one is refused, and other shards go on."""
        w = self.world
        shard = doomed[0].shard

        # Mid-stream: each server took writes into it (a server's first write into a shard
        # waits for the shard to be opened there).
        def taken() -> list[int]:
            with w.lock:
                return [sum(s.taken is not None for s in p.sent.values()) for p in doomed]

        deadline = time.monotonic() + CALL_S
        while time.monotonic() < deadline and min(taken()) < 3:
            time.sleep(0.02)
        w.say(f"{taken()} writes taken into {shard} through each server, then its drop")
        if min(taken()) == 0:
            w.problem(f"a server took no write into the doomed shard {shard} before its drop")
        w.drop(shard, "mid-stream")
        dropped = w.dropped[shard]
        deadline = dropped + DROP_NOTICED_S
        while any(p.ended is None for p in doomed) and time.monotonic() < deadline:
            time.sleep(0.02)
        for p in doomed:
            if p.ended is None:
                w.problem(f"{p.name}: its stream into dropped {shard} went on past the bound")
            else:
                w.tally.drop_noticed_s = max(w.tally.drop_noticed_s, p.ended - dropped)
        # A new stream into it is refused at once.
        refused: list[bool] = []

        def again() -> None:
            target = w.pick()
            if target is None:
                return
            try:
                with StreamingWriter(target[1], shard, token=TOKEN, writer_id="late") as late:
                    late.write(_rows(-1), seq=0)
            except persist.InvalidUsage:
                refused.append(True)
            except Exception as exc:
                w.problem(f"a new stream into dropped {shard}: {exc!r}")

        t = threading.Thread(target=again, daemon=True, name="a late stream")
        t.start()
        _join(w, [t], "a new stream into a dropped shard")
        if not refused:
            w.problem(f"a new stream into dropped {shard} was not refused")
        self.progress.append((shard, time.monotonic()))
        time.sleep(0.3)  # the other shards must take writes now

    def after_kill(self, name: str, force: bool = False) -> None:
        """Between a server's SIGKILL and its restart: maybe a drop of the shard only it streams
        into (its WAL holds writes of it), maybe damage to its WAL."""
        w, rng = self.world, self.rng
        home = self.homes.get(name)
        if home is not None and home.shard not in w.dropped and (force or rng.random() < 0.4):
            w.drop(home.shard, "between a kill and the restart")
        if force or rng.random() < 0.5:
            kind = next(self.damage_kinds)
            c = damage(w.wal(name), name, rng, kind)
            if c is None:
                w.tally.corruptions["no segment to damage"] += 1
            else:
                w.tally.corruptions[kind] += 1
                w.corruptions.append(c)
                w.say(f"damaged: {c}")

    def last_run(self) -> Audit:
        """Both servers once more, no faults: every producer resends what it never heard
        LOCAL_DISK for and waits for COMMITTED; then what the servers set aside, and the
        contents."""
        w = self.world
        w.start(list(SERVERS), interval_ms=50)
        stop = threading.Event()
        stop.set()
        finals = [
            p for p in self.producers + self.extras if p.shard not in w.dropped and p.ended is None
        ]
        threads = [
            threading.Thread(target=p.run, args=(stop, True), daemon=True, name=p.name)
            for p in finals
        ]
        for t in threads:
            t.start()
        _join(w, threads, "the last run")
        quarantine: dict[tuple[str, str, int], str] = {}
        for name in SERVERS:
            for q in _action(w.uri(name), "quarantine", {}):
                if q["lsn"] is not None:
                    quarantine[(name, q["shard"], q["lsn"])] = q["why"]
                else:
                    w.tally.corruptions["damaged segments listed"] += 1
        readable = w.main + [s for s in w.extra if s not in w.dropped]
        contents = {shard: _contents(w.uri("a"), shard) for shard in readable}
        ends = [threading.Thread(target=w.terminate, args=(name,)) for name in SERVERS]
        for t in ends:
            t.start()
        for t in ends:
            t.join(90)
        for c in w.corruptions:
            c.judge([line for s in w.stopped for line in s.stderr])
        for server in w.stopped:
            for line in server.stderr:
                if "recovered" in line and "logged write(s)" in line:
                    w.tally.recovered += int(line.split("recovered ")[1].split()[0])
        gone = [s for s in w.sent if s.shard in w.dropped]
        landed = _tombstones(w.loc, gone) if gone else {}
        return self.audit(contents, quarantine, landed)

    def audit(
        self,
        contents: dict[str, dict[int, list[int]]],
        quarantine: dict[tuple[str, str, int], str],
        landed: dict[tuple[str, str, int], int | None],
    ) -> Audit:
        w = self.world
        out = Audit()
        for p in self.producers + self.extras:
            if p.error is not None:
                w.problem(f"producer {p.name}: {p.error!r}")
        # No LSN of a server is acked for two writes.
        owner: dict[tuple[str, str, int], int] = {}
        for s in w.sent:
            for server, lsn in s.acks:
                other = owner.setdefault((server, s.shard, lsn), s.k)
                if other != s.k:
                    out.false_acks += 1
                    out.details.append(f"LSN {lsn} of {server}:{s.shard} acked for {other}, {s.k}")

        def damaged(s: Sent, a: Ack) -> bool:
            return any(
                c.reported and c.server == a.server and c.shard == s.shard and a.lsn in c.at_risk
                for c in w.corruptions
            )

        # Every named write.
        versions: dict[tuple[str, str, int], list[Sent]] = {}
        for s in w.sent:
            versions.setdefault((s.shard, s.writer, s.seq), []).append(s)
            durable = [a for a in s.acks.values() if a.rank >= RANK["LOCAL_DISK"]]
            committed = [a for a in s.acks.values() if a.rank >= RANK["COMMITTED"]]
            if s.shard in w.dropped:
                at = landed[(s.shard, s.writer, s.seq)]
                times = [] if at is None else [at]
                gone_reason = ("dropped", "finalized", "sealed", "gone")
            else:
                times = contents[s.shard].get(s.k, [])
                gone_reason = ("other rows",)
            if durable:
                out.durable += 1
            for a in committed:
                if times != [a.committed_at]:
                    out.false_acks += 1
                    out.details.append(
                        f"{s.writer}/{s.seq} (k {s.k}) acked COMMITTED at {a.committed_at} by "
                        f"{a.server} (LSN {a.lsn}), is at {times}"
                    )
            if times or not durable:
                continue
            # Acked LOCAL_DISK and not there: each server that acked it must say why.
            whys = []
            for a in durable:
                why = quarantine.get((a.server, s.shard, a.lsn))
                if why is not None and any(word in why for word in gone_reason):
                    whys.append("set aside")
                elif damaged(s, a):
                    whys.append("damaged")
                else:
                    whys.append(f"{a.server} LSN {a.lsn} rank {a.rank}: {why!r}")
            if all(x == "set aside" for x in whys):
                out.set_aside["shard dropped" if s.shard in w.dropped else "seq taken"] += 1
            elif all(x in ("set aside", "damaged") for x in whys):
                out.excused_by_damage += 1
            else:
                out.lost += 1
                out.lost_to_a_torn_tail += any(
                    c.torn and c.server == a.server and c.shard == s.shard and a.lsn in c.at_risk
                    for a in durable
                    for c in w.corruptions
                )
                risky = [f"#{i}" for i, c in enumerate(w.corruptions) if c.shard == s.shard]
                out.details.append(
                    f"LOST {s.writer}/{s.seq} (k {s.k}) of {s.shard}: {whys}; damage done to "
                    f"its shard's WALs: {risky or 'none'}"
                )
        # A write set aside on a shard that is not gone: only the losing copy of a reused seq.
        by_ack = {(a.server, s.shard, a.lsn): s for s in w.sent for a in s.acks.values()}
        for (server, shard, lsn), why in quarantine.items():
            if shard in w.dropped:
                continue
            s = by_ack.get((server, shard, lsn))
            if s is None or s.writer != "buggy" or "other rows" not in why:
                out.false_acks += 1
                who = None if s is None else (s.writer, s.seq)
                out.details.append(f"{server} set aside LSN {lsn} of {shard} ({who}): {why}")
            elif s.k in contents[shard]:
                out.false_acks += 1
                out.details.append(f"{server} set aside {s.writer}/{s.seq}, yet it is applied")
        for s in w.sent:
            if s.refused and s.k in contents.get(s.shard, {}):
                out.false_acks += 1
                out.details.append(f"{s.writer}/{s.seq} (k {s.k}) was refused, yet it is applied")
        for (shard, writer, seq), copies in versions.items():
            present = {c.k for c in copies if c.k in contents.get(shard, {})}
            if len(present) > 1:
                out.both_versions += 1
                out.details.append(f"both rows of {writer}/{seq} applied: {present}")
        # Nothing in twice; no bad write in.
        for shard, rows in contents.items():
            for k, times in rows.items():
                if len(times) > 1:
                    out.duplicated += 1
                    out.details.append(f"k {k} of {shard} is in {len(times)} times: {times}")
                if BAD_LOW <= k < BAD_HIGH:
                    out.false_acks += 1
                    out.details.append(f"bad write {k} applied")
        # DoPuts and Python writes.
        for put in w.puts:
            times = contents[put.shard].get(put.k, [])
            out.puts[f"{put.how} {put.outcome}"] += 1
            if put.outcome == "ok" and times != [put.time]:
                out.lost += not times
                out.false_acks += bool(times)
                out.details.append(f"{put.how} {put.k} acked at {put.time}, is at {times}")
            elif put.outcome == "refused" and times:
                out.false_acks += 1
                out.details.append(f"{put.how} {put.k} refused, is at {times}")
            elif put.outcome == "unknown" and (
                len(times) > 1 or (put.time >= 0 and times not in ([], [put.time]))
            ):
                out.false_acks += 1
                out.details.append(f"{put.how} {put.k} (outcome unknown) is at {times}")
        # The other shards went on after each drop.
        for shard, seen in self.progress:
            after = [s for s in w.sent if s.shard in w.main and (s.taken or 0) > seen]
            if not after:
                w.problem(f"no write was taken into the other shards after {shard} was dropped")
        return out


def _report(
    run: Run, audit: Audit, figures: Figures, title: str, note: str, started: float
) -> None:
    w, t = run.world, run.world.tally
    reported = sum(c.reported for c in w.corruptions)
    torn = sum(c.torn for c in w.corruptions)
    print(
        f"{title}: {t.rounds} rounds in {time.monotonic() - started:.0f} s, {t.processes} server "
        f"processes, {t.writes} writes ({t.replays_sent} resent, {t.switches} switches to the "
        f"other server), {audit.durable} acked LOCAL_DISK or later, acks {dict(t.acks)}, "
        f"recovered from WALs {t.recovered}; faults {dict(t.faults)}; injected "
        f"{dict(t.injected)}; kills {t.faults['SIGKILL']}; corruptions {dict(t.corruptions)} "
        f"({reported} reported as damage, {torn} called torn; {audit.excused_by_damage} acked "
        f"writes excused by reported damage); drops {dict(t.drops)} (streams ended within "
        f"{t.drop_noticed_s:.2f} s); set aside {dict(audit.set_aside)}; buggy client "
        f"{dict(t.buggy)}; DoPuts and Python writes {dict(audit.puts)}; bad writes refused "
        f"{sum(t.bad.values())} of {len(t.bad)} kinds; lost={audit.lost} "
        f"({audit.lost_to_a_torn_tail} to damage called a torn tail), "
        f"duplicated={audit.duplicated}, false acks={audit.false_acks}, both rows of a reused "
        f"seq={audit.both_versions}"
    )
    for line in audit.details[:20]:
        print("  ", line)
    if len(audit.details) > 20:
        print(f"   ... and {len(audit.details) - 20} more")
    for i, c in enumerate(w.corruptions):
        print(f"   damage #{i}: {c}")
    figures.processes += t.processes
    figures.crashes_survived += t.faults["SIGKILL"]
    figures.acknowledged_writes += audit.durable + audit.puts["put ok"] + audit.puts["python ok"]
    figures.acknowledged_lost += audit.lost
    figures.acknowledged_duplicated += audit.duplicated
    figures.bad_inputs_refused += sum(t.bad.values())
    figures.faults_injected_before += sum(t.injected.values())
    figures.note(
        note,
        rounds=t.rounds,
        writes=t.writes,
        acked_local_disk=audit.durable,
        **{f"acks_{tier.lower()}": t.acks[tier] for tier in TIERS},
        recovered=t.recovered,
        sigkills=t.faults["SIGKILL"],
        sigterms=t.faults["SIGTERM"],
        outages=sum(t.faults[k] for k in OUTAGES),
        faults=sum(t.injected.values()),
        corruptions=len(w.corruptions),
        corruptions_reported=reported,
        excused_by_damage=audit.excused_by_damage,
        drops=sum(t.drops.values()),
        set_aside=sum(audit.set_aside.values()),
        doputs=audit.puts["put ok"],
        python_writes=audit.puts["python ok"],
        bad_writes=sum(t.bad.values()),
        bad_kinds=len(t.bad),
        stalled_readers=t.faults["stalled DoGet readers"],
        lost=audit.lost,
        lost_to_a_torn_tail=audit.lost_to_a_torn_tail,
        duplicated=audit.duplicated,
        false_acks=audit.false_acks,
    )


def _check(run: Run, audit: Audit) -> None:
    w, t = run.world, run.world.tally
    if w.problems or audit.details:
        print("\n".join(w.story))
    assert not w.problems, w.problems[:20]
    assert audit.lost == 0, audit.details[:20]
    assert audit.duplicated == 0, audit.details[:20]
    assert audit.false_acks == 0, audit.details[:20]
    assert audit.both_versions == 0, audit.details[:20]
    # The world did what it is for.
    assert audit.durable > 100 and t.faults["SIGKILL"] and t.faults["SIGKILL mid-round"]
    assert t.drops["mid-stream"] and t.drops["between a kill and the restart"]
    assert w.corruptions, "no WAL was damaged"
    assert t.switches and t.replays_sent and t.buggy["seqs reused"]
    assert audit.puts["put ok"] and audit.puts["python ok"]


def test_streaming_writes_survive_every_fault_at_once(
    tmp_path: Path, postgres_uri: str, figures: Figures
) -> None:
    started = time.monotonic()
    loc = ((tmp_path / "blob").as_uri(), postgres_uri)
    plan = Plan("faults", seed=20261125, rounds=scaled(5), shards=3, producers=4, dwell=1.0)
    run = Run(tmp_path, loc, plan)
    audit = run.run()
    _report(run, audit, figures, "flight faults", "flight streaming writes", started)
    _check(run, audit)
    assert sum(run.world.tally.injected.values()), "no fault was injected"
    assert len(run.world.tally.bad) >= 8, "the hostile clients tried too few kinds"


def test_streaming_soak_two_servers_one_shard(
    tmp_path: Path, postgres_uri: str, figures: Figures
) -> None:
    """Two servers streaming into one shard, DoPuts and a Python writer beside them, every
    fault of the test above: rounds and their lengths grow with ``PERSIST_TEST_SCALE``."""
    started = time.monotonic()
    loc = ((tmp_path / "blob").as_uri(), postgres_uri)
    plan = Plan("soak", seed=777, rounds=scaled(3), shards=1, producers=4, dwell=max(1.0, scale()))
    run = Run(tmp_path, loc, plan)
    audit = run.run()
    _report(run, audit, figures, "flight soak", "flight streaming soak", started)
    _check(run, audit)
