"""flight: ``persist serve`` against bare ``pyarrow.flight`` servers, measured in the same run.

- DoGet: a shard of ``flight_rows`` rows (``k`` unique int64, ``g`` int64, ``v`` float64; five
  appends, then maintained; file blob + Postgres) read as 4 endpoints by 4 parallel DoGets of a
  stock client, against a bare Flight server (own process) serving the same number of rows
  (the same columns, ``_time`` and ``_diff`` too) from memory as 4 endpoints, and against
  ``snapshot_and_fetch`` in this process. Best of ``flight_repeats`` after a warm-up read.
- DoPut: ``flight_puts`` lock-step DoPuts of 1,000-row tables against in-process
  ``compare_and_append`` of the same tables (same location kind): p50 and p99.
- Streaming writes (DoExchange): ``flight_stream_writes`` 1-row writes pipelined by one client
  (writes/s until the last MEMORY ack) against a bare DoExchange echo server that answers each
  write with one ack row, and the same writes named ``(writer_id, seq)`` (each fingerprinted
  and recorded in the shard as it commits); then writes offered at 1,000/s for
  ``flight_paced_s``: MEMORY and COMMITTED ack latency (p50, p99) at the default
  ``--commit-interval-ms`` 50, against the bare echo offered the same writes, and against a
  second ``persist serve`` whose commit interval outlasts the window (a new shard: no group
  commit runs in its process while the writes are offered; what the MEMORY ack would cost if the
  group commit ran in another process); then two servers on one location streaming into one shard at
  500/s each for the same time (their group commits race each other: the loser writes its part
  again at the new upper): COMMITTED p99 over both.
- Memory: ``flight_soak_writes`` 1-row writes pipelined by one client (at most 20,000 unacked)
  while the server's RSS (``/proc/<pid>/status``) is sampled every tenth: the RSS after the
  first fifth (warm-up) and at the end, and the growth per 1,000 writes between.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

import persist
from benches.fixtures import NoAdapter, keyed_rows
from benches.harness import BASELINE, SUBJECT, Context, Run, System, ratio
from benches.harness import ratio_entry as entry

NAME = "flight"
TITLE = "Flight: persist serve against bare pyarrow.flight servers"

PERSIST = "persist serve (file+postgres)"
BARE = "bare pyarrow.flight (memory)"
INPROC = "persist in process"
SCHEMA = pa.schema([("k", pa.int64()), ("g", pa.int64()), ("v", pa.float64())])
_PARTS = 5
_ENDPOINTS = 4
_PUT_ROWS = 1000
COMMIT_INTERVAL_MS = 50


def systems() -> list[System]:
    return [
        System(PERSIST, SUBJECT, lambda ctx: NoAdapter()),
        System(BARE, BASELINE, lambda ctx: NoAdapter()),
        System(INPROC, BASELINE, lambda ctx: NoAdapter()),
    ]


def _rows(n: int, part: int, rng: np.random.Generator) -> pa.Table:
    return keyed_rows(n, part, _PARTS, rng)


# --- the bare server (a child process) --------------------------------------------------------

ACK = pa.schema(
    [
        pa.field("lsn", pa.uint64(), nullable=False),
        pa.field("durability_level", pa.utf8(), nullable=False),
        pa.field("is_durability_update", pa.bool_(), nullable=False),
        pa.field("timestamp", pa.timestamp("us"), nullable=False),
    ]
)


def _bare_child(rows: int, port_out: Any) -> None:
    n = rows
    table = pa.table(
        {
            "k": np.arange(n, dtype=np.int64),
            "g": np.random.default_rng(1).integers(0, 100, n),
            "v": np.random.default_rng(2).random(n),
            "_time": pa.array(np.zeros(n, np.uint64)),
            "_diff": pa.array(np.ones(n, np.int64)),
        }
    )
    step = -(-n // _ENDPOINTS)

    class Bare(fl.FlightServerBase):  # type: ignore[misc]
        def get_flight_info(self, context: Any, descriptor: Any) -> Any:
            eps = [fl.FlightEndpoint(str(i).encode(), []) for i in range(_ENDPOINTS)]
            return fl.FlightInfo(table.schema, descriptor, eps, n, -1)

        def do_get(self, context: Any, ticket: Any) -> Any:
            i = int(ticket.ticket)
            return fl.RecordBatchStream(table.slice(i * step, step))

        def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
            # The floor of a DoPut: read the stream, answer one PutResult, store nothing.
            reader.read_all()
            writer.write(pa.py_buffer(b'{"upper": 1}'))

        def do_exchange(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
            # Echo: one ack row per write, sent as each arrives.
            writer.begin(ACK)
            now = pa.scalar(0, pa.timestamp("us"))
            for lsn, _chunk in enumerate(reader):
                writer.write_batch(
                    pa.record_batch(
                        [
                            pa.array([lsn], pa.uint64()),
                            pa.array(["MEMORY"]),
                            pa.array([False]),
                            pa.array([now.value], pa.timestamp("us")),
                        ],
                        schema=ACK,
                    )
                )

    server = Bare("grpc://127.0.0.1:0")
    port_out.put(server.port)
    server.serve()


class _BareServer:
    def __enter__(self) -> str:
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_bare_child, args=(self.rows, q), daemon=True)
        self.proc.start()
        return f"grpc://127.0.0.1:{q.get(timeout=300)}"

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.join(30)


class _PersistServer:
    def __init__(self, blob: str, consensus: str, wal: str, *extra: str) -> None:
        self.wal = wal
        self.args = [
            *("--blob", blob, "--consensus", consensus, "--port", "0", "--wal-dir", wal),
            *extra,
        ]

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "persist.cli", "serve", *self.args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.pid = self.proc.pid
        line = self.proc.stdout.readline()
        if not line.startswith("persist flight serving "):
            self.proc.kill()
            raise RuntimeError(f"persist serve did not start: {line!r}")
        return line.split()[-1]

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- measurements (blocking: run in a worker thread) ------------------------------------------


def _doget(uri: str, command: bytes, repeats: int) -> tuple[float, int]:
    """Best seconds of 4 parallel DoGets of a flight's endpoints (after a warm-up), and rows."""
    client = fl.FlightClient(uri)

    def one(ticket: fl.Ticket) -> int:
        rows = 0
        for chunk in client.do_get(ticket):
            rows += chunk.data.num_rows
        return rows

    best, rows = float("inf"), 0
    with ThreadPoolExecutor(_ENDPOINTS) as pool:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            info = client.get_flight_info(fl.FlightDescriptor.for_command(command))
            rows = sum(pool.map(one, [ep.ticket for ep in info.endpoints]))
            if i:  # the first read warms the page cache and both processes
                best = min(best, time.perf_counter() - t0)
    client.close()
    return best, rows


def _doputs(
    uri: str, shard: str, tables: list[pa.Table], first: int = 0, client: Any = None
) -> list[float]:
    """Lock-step DoPuts of ``tables`` at uppers ``first``, ``first + 1``, ...: seconds each."""
    own = client is None
    client = client or fl.FlightClient(uri)
    out = []
    for i, table in enumerate(tables, first):
        cmd = json.dumps({"shard": shard, "expected_upper": i, "new_upper": i + 1}).encode()
        t0 = time.perf_counter()
        writer, reader = client.do_put(fl.FlightDescriptor.for_command(cmd), table.schema)
        writer.write_table(table)
        writer.done_writing()
        reader.read()
        writer.close()
        out.append(time.perf_counter() - t0)
    if own:
        client.close()
    return out


def _pipelined(uri: str, command: bytes, n: int, named: bool = False) -> float:
    """Writes/s of ``n`` 1-row writes sent without waiting, until the last MEMORY ack
    (``named``: each with its ``{"seq"}``)."""
    client = fl.FlightClient(uri)
    writer, reader = client.do_exchange(fl.FlightDescriptor.for_command(command))
    schema = pa.schema([("k", pa.int64()), ("g", pa.int64()), ("v", pa.float64())])
    batches = [
        pa.record_batch(
            [pa.array([i], pa.int64()), pa.array([i % 100], pa.int64()), pa.array([0.5])],
            schema=schema,
        )
        for i in range(n)
    ]
    done = threading.Event()
    seen = [0]

    def read() -> None:
        for chunk in reader:
            levels = chunk.data.column(1)
            seen[0] += levels.to_pylist().count("MEMORY")
            if seen[0] >= n:
                done.set()
        done.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    writer.begin(schema)
    seqs = [pa.py_buffer(json.dumps({"seq": i}).encode()) for i in range(n)] if named else []
    t0 = time.perf_counter()
    if named:
        for b, seq in zip(batches, seqs, strict=True):
            writer.write_with_metadata(b, seq)
    else:
        for b in batches:
            writer.write_batch(b)
    done.wait(600)
    elapsed = time.perf_counter() - t0
    writer.done_writing()
    t.join(600)
    writer.close()
    client.close()
    if seen[0] < n:
        raise RuntimeError(f"only {seen[0]} of {n} writes were acked")
    return n / elapsed


def _paced(uri: str, shard: str, rate: float, seconds: float) -> dict[str, list[float]]:
    """Writes offered at ``rate``/s: per write, seconds to its MEMORY and COMMITTED acks."""
    client = fl.FlightClient(uri)
    cmd = json.dumps({"shard": shard, "op": "streaming_write"}).encode()
    writer, reader = client.do_exchange(fl.FlightDescriptor.for_command(cmd))
    n = int(rate * seconds)
    sent: list[float] = []
    lsn_of: list[int] = []
    memory: dict[int, float] = {}
    committed: dict[int, float] = {}

    def read() -> None:
        for chunk in reader:
            now = time.perf_counter()
            d = chunk.data
            for lsn, level in zip(d.column(0).to_pylist(), d.column(1).to_pylist(), strict=True):
                if level == "MEMORY":
                    memory[len(lsn_of)] = now
                    lsn_of.append(lsn)
                elif level == "COMMITTED":
                    committed[lsn] = now

    t = threading.Thread(target=read, daemon=True)
    t.start()
    writer.begin(SCHEMA)
    # The client's own threads (the pacer and the ack reader) hand the GIL over quickly too:
    # at the default 5 ms a client alone would add milliseconds to what it measures.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    start = time.perf_counter()
    for i in range(n):
        due = start + i / rate
        while (now := time.perf_counter()) < due:
            time.sleep(min(0.0005, due - now))
        sent.append(time.perf_counter())
        writer.write_batch(
            pa.record_batch(
                [pa.array([i], pa.int64()), pa.array([0], pa.int64()), pa.array([0.0])],
                schema=SCHEMA,
            )
        )
    writer.done_writing()
    t.join(120)
    sys.setswitchinterval(switch)
    writer.close()
    client.close()
    mem = [memory[i] - sent[i] for i in range(len(sent)) if i in memory]
    com = [committed[lsn_of[i]] - sent[i] for i in range(len(lsn_of)) if lsn_of[i] in committed]
    return {"memory": mem, "committed": com}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _soak(uri: str, command: bytes, n: int, pid: int) -> list[tuple[int, float]]:
    """``n`` 1-row writes pipelined (at most 20,000 unacked); (writes acked, server RSS MiB)
    after every tenth of them."""
    client = fl.FlightClient(uri)
    writer, reader = client.do_exchange(fl.FlightDescriptor.for_command(command))
    acked = [0]
    cond = threading.Condition()

    def read() -> None:
        for chunk in reader:
            got = chunk.data.column(1).to_pylist().count("MEMORY")
            with cond:
                acked[0] += got
                cond.notify_all()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    writer.begin(SCHEMA)
    samples = [(0, _rss_mib(pid))]
    step = max(1, n // 10)
    for i in range(n):
        with cond:
            cond.wait_for(lambda i=i: i - acked[0] < 20_000, 60)
        writer.write_batch(
            pa.record_batch(
                [pa.array([i], pa.int64()), pa.array([i % 97], pa.int64()), pa.array([0.0])],
                schema=SCHEMA,
            )
        )
        if (i + 1) % step == 0:
            with cond:
                cond.wait_for(lambda i=i: acked[0] >= i + 1, 60)
            samples.append((i + 1, _rss_mib(pid)))
    writer.done_writing()
    t.join(120)
    writer.close()
    client.close()
    return samples


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


# --- the scenario ------------------------------------------------------------------------------


async def _build(ctx: Context, blob: str, consensus: str) -> tuple[str, float]:
    """The DoGet shard; returns it and the in-process snapshot_and_fetch best seconds."""
    shard = str(persist.ShardId.new())
    rng = np.random.default_rng(7)
    per = ctx.scale.flight_rows // _PARTS
    async with await persist.connect(blob, consensus) as client:
        write, read = await client.open(shard, SCHEMA, "bench flight")
        for i in range(_PARTS):
            stamped = _rows(per, i, rng).append_column(
                "_time", pa.array(np.full(per, i, np.uint64))
            )
            await write.compare_and_append(stamped, i, i + 1)
        await client.maintain(shard)
        best = float("inf")
        for i in range(ctx.scale.flight_repeats + 1):
            t0 = time.perf_counter()
            got = await read.snapshot_and_fetch(_PARTS - 1)
            if i:
                best = min(best, time.perf_counter() - t0)
            if got.num_rows != per * _PARTS:
                raise RuntimeError(f"snapshot_and_fetch read {got.num_rows} rows")
            del got
        await write.expire()
        await read.expire()
    return shard, best


async def _puts(
    uri: str, blob: str, consensus: str, tables: list[pa.Table], block: int = 25
) -> tuple[list[float], list[float]]:
    """Lock-step DoPuts and in-process compare_and_appends of the same tables, in alternating
    blocks (the machine's noise falls on both alike): seconds of each."""
    flight_client = fl.FlightClient(uri)
    flight_shard = str(persist.ShardId.new())
    flight: list[float] = []
    inproc: list[float] = []
    async with await persist.connect(blob, consensus) as client:
        write = await client.open_writer(str(persist.ShardId.new()), SCHEMA, "bench flight put")
        for start in range(0, len(tables), block):
            for i, table in enumerate(tables[start : start + block], start):
                t0 = time.perf_counter()
                await write.compare_and_append(table, i, i + 1)
                inproc.append(time.perf_counter() - t0)
            flight += await asyncio.to_thread(
                _doputs, uri, flight_shard, tables[start : start + block], start, flight_client
            )
        await write.expire()
    flight_client.close()
    return flight, inproc


async def run(ctx: Context) -> dict[str, Any]:
    scale = ctx.scale
    n = scale.flight_rows - scale.flight_rows % _PARTS
    blob = f"file://{ctx.workdir / 'blob'}"
    consensus = ctx.postgres_uri
    wal = str(ctx.workdir / "wal")
    rng = np.random.default_rng(3)
    put_tables = [
        _rows(_PUT_ROWS, 0, rng).append_column("_time", pa.array(np.full(_PUT_ROWS, i, np.uint64)))
        for i in range(scale.flight_puts)
    ]
    async with Run(ctx, NAME, systems()) as run:
        run.log(f"building {n} rows")
        shard, inproc_s = await _build(ctx, blob, consensus)
        server = _PersistServer(blob, consensus, wal)
        with server as uri:
            run.log("persist DoGet")
            command = json.dumps({"shard": shard, "splits": _ENDPOINTS}).encode()
            persist_s, persist_rows = await asyncio.to_thread(
                _doget, uri, command, scale.flight_repeats
            )
            run.log("persist DoPut and in-process compare_and_append, alternating")
            flight_puts, inproc_puts = await _puts(uri, blob, consensus, put_tables)
            run.log("persist streaming writes")
            stream_shard = str(persist.ShardId.new())
            await asyncio.to_thread(_doputs, uri, stream_shard, [put_tables[0]])
            stream_cmd = json.dumps({"shard": stream_shard, "op": "streaming_write"}).encode()
            persist_rate = await asyncio.to_thread(
                _pipelined, uri, stream_cmd, scale.flight_stream_writes
            )
            named_cmd = json.dumps(
                {"shard": stream_shard, "op": "streaming_write", "writer_id": "bench"}
            ).encode()
            named_rate = await asyncio.to_thread(
                _pipelined, uri, named_cmd, scale.flight_stream_writes, True
            )
            paced = await asyncio.to_thread(_paced, uri, stream_shard, 1000.0, scale.flight_paced_s)
            run.log("two servers streaming into one shard")
            with _PersistServer(blob, consensus, wal + "-2") as uri2:
                both = await asyncio.gather(
                    asyncio.to_thread(_paced, uri, stream_shard, 500.0, scale.flight_paced_s),
                    asyncio.to_thread(_paced, uri2, stream_shard, 500.0, scale.flight_paced_s),
                )
            two = {k: both[0][k] + both[1][k] for k in ("memory", "committed")}
            run.log("MEMORY acks with no group commit in the window")
            idle_ms = str(4000 * scale.flight_paced_s)
            with _PersistServer(
                blob,
                consensus,
                wal + "-3",
                "--commit-interval-ms",
                idle_ms,
                "--commit-bytes",
                "1GiB",
            ) as uri3:
                idle_shard = str(persist.ShardId.new())
                await asyncio.to_thread(_doputs, uri3, idle_shard, [put_tables[0]])
                idle = await asyncio.to_thread(
                    _paced, uri3, idle_shard, 1000.0, scale.flight_paced_s
                )
            run.log("memory under a stream of writes")
            soak_shard = str(persist.ShardId.new())
            await asyncio.to_thread(_doputs, uri, soak_shard, [put_tables[0]])
            soak_cmd = json.dumps({"shard": soak_shard, "op": "streaming_write"}).encode()
            soak = await asyncio.to_thread(
                _soak, uri, soak_cmd, scale.flight_soak_writes, server.pid
            )
        with _BareServer(n) as bare_uri:
            run.log("bare DoGet and DoExchange echo")
            bare_s, bare_rows = await asyncio.to_thread(
                _doget, bare_uri, b"{}", scale.flight_repeats
            )
            bare_rate = await asyncio.to_thread(
                _pipelined, bare_uri, b"{}", scale.flight_stream_writes
            )
            bare_puts = await asyncio.to_thread(_doputs, bare_uri, "bare", put_tables)
            bare_paced = await asyncio.to_thread(
                _paced, bare_uri, "bare", 1000.0, scale.flight_paced_s
            )
    if persist_rows != n or bare_rows != n:
        raise RuntimeError(f"DoGet read {persist_rows} (persist) and {bare_rows} (bare) of {n}")

    def ms(x: float | None) -> float | None:
        return None if x is None else 1000 * x

    warm_writes, warm_rss = soak[2]  # after a fifth of the writes
    end_writes, end_rss = soak[-1]
    growth = (end_rss - warm_rss) * 1024 / max(1, (end_writes - warm_writes) / 1000)
    put_p50 = ms(_pct(flight_puts, 50))
    inproc_p50 = ms(_pct(inproc_puts, 50))
    mem_p99 = ms(_pct(paced["memory"], 99))
    idle_p99 = ms(_pct(idle["memory"], 99))
    echo_p99 = ms(_pct(bare_paced["memory"], 99))
    com_p99 = ms(_pct(paced["committed"], 99))
    tables = {
        "doget": {
            PERSIST: run.row(PERSIST, rows_per_s=n / persist_s, seconds=persist_s),
            BARE: run.row(BARE, rows_per_s=n / bare_s, seconds=bare_s),
            INPROC: run.row(INPROC, rows_per_s=n / inproc_s, seconds=inproc_s),
        },
        "doput": {
            PERSIST: run.row(PERSIST, p50_ms=put_p50, p99_ms=ms(_pct(flight_puts, 99))),
            INPROC: run.row(INPROC, p50_ms=inproc_p50, p99_ms=ms(_pct(inproc_puts, 99))),
            BARE: run.row(BARE, p50_ms=ms(_pct(bare_puts, 50)), p99_ms=ms(_pct(bare_puts, 99))),
        },
        "streaming": {
            PERSIST: run.row(
                PERSIST,
                pipelined_writes_per_s=persist_rate,
                pipelined_named_writes_per_s=named_rate,
                memory_p50_ms=ms(_pct(paced["memory"], 50)),
                memory_p99_ms=mem_p99,
                no_group_commit_memory_p50_ms=ms(_pct(idle["memory"], 50)),
                no_group_commit_memory_p99_ms=idle_p99,
                committed_p50_ms=ms(_pct(paced["committed"], 50)),
                committed_p99_ms=com_p99,
                paced_writes=len(paced["memory"]),
                two_servers_committed_p50_ms=ms(_pct(two["committed"], 50)),
                two_servers_committed_p99_ms=ms(_pct(two["committed"], 99)),
                two_servers_acked_committed=len(two["committed"]),
                soak_writes=end_writes,
                rss_after_warmup_mib=warm_rss,
                rss_at_end_mib=end_rss,
            ),
            BARE: run.row(
                BARE,
                pipelined_writes_per_s=bare_rate,
                memory_p50_ms=ms(_pct(bare_paced["memory"], 50)),
                memory_p99_ms=echo_p99,
            ),
        },
    }
    ratios = [
        entry(
            "DoGet of 4 endpoints vs bare Flight from memory",
            ratio(bare_s, persist_s),
            "rows/s(persist serve) / rows/s(bare)",
            at_least=0.5,
        ),
        entry(
            "DoGet of 4 endpoints vs snapshot_and_fetch in process",
            ratio(inproc_s, persist_s),
            "rows/s(persist serve) / rows/s(in process)",
        ),
        entry(
            "DoPut p50 minus in-process compare_and_append p50 (ms)",
            None if put_p50 is None or inproc_p50 is None else put_p50 - inproc_p50,
            "p50(DoPut) - p50(compare_and_append), 1,000-row tables",
            at_most=1.5,
        ),
        entry(
            "DoPut p50 minus the bare DoPut round trip p50 (ms)",
            None if put_p50 is None else put_p50 - 1000 * float(np.median(bare_puts)),
            "p50(DoPut) - p50(bare DoPut: read the stream, answer, store nothing)",
        ),
        entry(
            "streaming writes, pipelined 1-row, writes/s",
            persist_rate,
            "writes/s until the last MEMORY ack",
            at_least=10_000,
        ),
        entry(
            "streaming writes, pipelined 1-row named (writer_id, seq), writes/s",
            named_rate,
            "writes/s until the last MEMORY ack",
            at_least=10_000,
        ),
        entry(
            "streaming writes vs bare DoExchange echo, pipelined",
            ratio(persist_rate, bare_rate),
            "writes/s(persist) / writes/s(bare echo)",
            at_least=0.5,
        ),
        entry(
            "MEMORY ack p99 at 1,000 writes/s offered (ms)",
            mem_p99,
            "p99 of ack time - send time",
            at_most=2.0,
        ),
        entry(
            "MEMORY ack p99 at 1,000 writes/s, no group commit in the server's process (ms)",
            idle_p99,
            "p99 of ack time - send time; commit interval longer than the window",
        ),
        entry(
            "MEMORY ack p99 at 1,000 writes/s, bare DoExchange echo (ms)",
            echo_p99,
            "p99 of ack time - send time: the floor of any pyarrow.flight server here",
        ),
        entry(
            f"COMMITTED ack p99 at 1,000 writes/s offered (ms), commit interval {COMMIT_INTERVAL_MS} ms",
            com_p99,
            "p99 of ack time - send time",
            at_most=COMMIT_INTERVAL_MS + 50,
        ),
        entry(
            "server RSS growth after warm-up, KiB per 1,000 streamed writes",
            growth,
            f"(RSS at {end_writes:,} writes - RSS at {warm_writes:,}) / thousands of writes",
        ),
        entry(
            "COMMITTED ack p99, two servers streaming into one shard at 500 writes/s each (ms)",
            ms(_pct(two["committed"], 99)),
            "p99 of ack time - send time, over both servers' writes",
        ),
    ]
    return await run.result(
        params={
            "rows": n,
            "endpoints": _ENDPOINTS,
            "repeats": scale.flight_repeats,
            "puts": scale.flight_puts,
            "put_rows": _PUT_ROWS,
            "stream_writes": scale.flight_stream_writes,
            "paced_s": scale.flight_paced_s,
            "soak_writes": scale.flight_soak_writes,
            "soak_rss_mib": [[w, round(r, 1)] for w, r in soak],
            "cpus": os.cpu_count(),
        },
        tables=tables,
        ratios=ratios,
        notes=[
            "every server is its own process on 127.0.0.1; clients are stock pyarrow.flight in "
            "the bench process (4 threads for the 4 DoGets)",
            f"{BARE}: a FlightServerBase serving a pa.Table of the same row count and columns "
            "(4 slices), a DoPut that reads the stream and answers without storing it, and a "
            "DoExchange that answers each write with one ack row",
            "DoGet times are the best of the repeats after a warm-up read; DoPut and "
            "compare_and_append are lock-step (file blob, Postgres consensus), in alternating "
            "blocks of 25",
        ],
    )
