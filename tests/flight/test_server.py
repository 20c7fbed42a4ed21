"""The server as a service: auth on every call, TLS, metrics, errors, and a drain on SIGTERM."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest

import persist
import persist.flight._server as flight_server
from persist.flight import FlightServer
from tests.flight.conftest import TOKEN, StartServer, cmd, new_shard, payload, updates


def _sqlite(tmp_path: Path) -> tuple[str, str]:
    return (tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}"


def _every_rpc(client: Any, shard: str, ticket: fl.Ticket) -> dict[str, Any]:
    """Each RPC the server offers (and the ones it does not), as calls to try."""
    f, o = client.flight, client.options
    table = updates([(5, "e", 1, 1)])

    def put() -> None:
        writer, reader = f.do_put(
            cmd({"shard": shard, "expected_upper": 1, "new_upper": 2}), table.schema, o
        )
        writer.write_table(table)
        writer.done_writing()
        reader.read()
        writer.close()

    def exchange() -> None:
        writer, _reader = f.do_exchange(cmd({"shard": shard, "op": "streaming_write"}), o)
        writer.close()

    return {
        "GetFlightInfo": lambda: f.get_flight_info(cmd({"shard": shard}), o),
        "GetSchema": lambda: f.get_schema(cmd({"shard": shard}), o),
        "DoGet": lambda: f.do_get(ticket, o).read_all(),
        "DoPut": put,
        "ListActions": lambda: list(f.list_actions(o)),
        "health": lambda: list(f.do_action(fl.Action("health", b"{}"), o)),
        "frontiers": lambda: list(
            f.do_action(fl.Action("frontiers", json.dumps({"shard": shard}).encode()), o)
        ),
        "durability": lambda: list(
            f.do_action(fl.Action("durability", json.dumps({"shard": shard}).encode()), o)
        ),
        "quarantine": lambda: list(f.do_action(fl.Action("quarantine", b"{}"), o)),
        "evolve_schema": lambda: list(
            f.do_action(fl.Action("evolve_schema", json.dumps({"shard": shard}).encode()), o)
        ),
        "ListFlights": lambda: list(f.list_flights(b"", o)),
        "DoExchange": exchange,
    }


@pytest.mark.parametrize("via", ["flag", "env"])
def test_every_call_needs_the_bearer_token(
    start_server: StartServer, tmp_path: Path, via: str
) -> None:
    loc = _sqlite(tmp_path)
    if via == "flag":
        server = start_server(loc)
    else:
        server = start_server(loc, token=None, env={"PERSIST_FLIGHT_TOKEN": TOKEN})
    good = server.client()
    shard = new_shard()
    good.put(shard, updates([(1, "a", 0, 1)]), 0, 1)
    ticket = good.info({"shard": shard}).endpoints[0].ticket
    for who in (
        server.client(token=None),
        server.client(token="wrong"),
        server.client(token=TOKEN + "x"),
    ):
        for name, call in _every_rpc(who, shard, ticket).items():
            # pyarrow's client raises GetSchema's error as a plain OSError.
            with pytest.raises((fl.FlightUnauthenticatedError, OSError)) as e:
                call()
            assert "Unauthenticated" in str(e.value), name
    # Nothing of that changed the shard; the right token works for all of them.
    assert good.action("frontiers", {"shard": shard})["upper"] == 1
    calls = _every_rpc(good, shard, ticket)
    for name in (
        "GetFlightInfo",
        "GetSchema",
        "DoGet",
        "DoPut",
        "ListActions",
        "health",
        "frontiers",
        "durability",
        "quarantine",
    ):
        calls[name]()
    assert good.action("health") == {
        "status": "ok",
        "version": "0.1.0",
        "blob": "ok",
        "consensus": "ok",
    }
    # This server's LSN watermarks of its log of the shard: it streamed nothing into it.
    assert good.action("durability", {"shard": shard}) == {
        "MEMORY": 0,
        "LOCAL_DISK": 0,
        "OBJECT_STORAGE": 0,
        "COMMITTED": 0,
    }
    assert good.action("quarantine", {"shard": shard}) == []
    assert [a.type for a in good.flight.list_actions(good.options)] == [
        "frontiers",
        "durability",
        "evolve_schema",
        "quarantine",
        "health",
    ]
    with pytest.raises(fl.FlightServerError) as e:
        good.action("nope")
    assert payload(e.value)["error"] == "InvalidUsage"


def _self_signed(tmp_path: Path) -> tuple[Path, Path, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(pem)
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path, pem


def test_tls_with_a_self_signed_certificate(start_server: StartServer, tmp_path: Path) -> None:
    cert, key, pem = _self_signed(tmp_path)
    server = start_server(_sqlite(tmp_path), "--tls-cert", str(cert), "--tls-key", str(key))
    assert server.uri.startswith("grpc+tls://127.0.0.1:")
    client = server.client(tls_root_certs=pem)
    shard = new_shard()
    assert client.put(shard, updates([(1, "a", 0, 1)]), 0, 1) == {"upper": 1}
    assert client.read({"shard": shard}).num_rows == 1
    # A client that does not trust the certificate, or speaks plaintext, gets nowhere.
    untrusting = server.client()
    with pytest.raises(fl.FlightUnavailableError):
        untrusting.action("health")
    plain = fl.FlightClient(server.uri.replace("grpc+tls", "grpc"))
    with pytest.raises(fl.FlightUnavailableError):
        list(plain.do_action(fl.Action("health", b"{}"), client.options_with(5)))


def test_metrics_at_the_metrics_port(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(_sqlite(tmp_path), "--metrics-port", "0")
    metrics_line = server.lines.get(timeout=30)
    assert metrics_line.startswith("persist flight metrics at http://127.0.0.1:")
    url = metrics_line.split()[-1]
    client = server.client()
    shard = new_shard()
    client.put(shard, updates([(i, "x", 0, 1) for i in range(100)]), 0, 1)
    with pytest.raises(fl.FlightServerError):
        client.put(shard, updates([(1, "x", 0, 1)]), 0, 1)
    assert client.read({"shard": shard}).num_rows == 100
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values = _samples(text)
    on = f'shard="{shard}"'  # writes, commits, reads and tickets are labelled by shard
    assert values[f'persist_flight_writes_received_total{{method="do_put",{on}}}'] == 2
    assert values[f'persist_flight_commits_total{{outcome="ok",{on}}}'] == 1
    assert values[f'persist_flight_commits_total{{outcome="mismatch",{on}}}'] == 1
    assert values["persist_flight_commit_seconds_count"] == 1
    assert values[f"persist_flight_doget_rows_total{{{on}}}"] == 100
    assert values[f"persist_flight_doget_bytes_total{{{on}}}"] > 0
    assert values[f'persist_flight_write_bytes_received_total{{method="do_put",{on}}}'] > 0
    assert values[f"persist_flight_tickets_issued_total{{{on}}}"] == 1
    assert values['persist_flight_durability_lag_lsns{tier="COMMITTED"}'] == 0
    assert values["persist_flight_backpressure_waits_total"] == 0
    # DoPut acknowledges by its reply: no durability ack was sent, at any tier.
    assert not [k for k in values if k.startswith("persist_flight_acks_sent_total")], values
    for tier in ("MEMORY", "LOCAL_DISK", "OBJECT_STORAGE", "COMMITTED"):
        assert f'persist_flight_durability_lag_seconds{{tier="{tier}"}}' in values
    # The open calls of this scrape's moment: none but what other tests run (none here).
    assert values.get('persist_flight_open_calls{rpc="do_get"}', 0) == 0
    # Per call: durations by method, errors by method and persist error.
    assert values['persist_flight_rpc_seconds_count{rpc="do_put"}'] == 2
    assert values['persist_flight_rpc_seconds_count{rpc="do_get"}'] == 1
    assert values['persist_flight_rpc_errors_total{error="UpperMismatch",rpc="do_put"}'] == 1
    # And the access log, on stderr at INFO: every call, with its outcome.
    server.wait_for_log("do_put ok", "do_put UpperMismatch", "do_get ok")


def test_shard_labels_are_bounded() -> None:
    from persist.flight._metrics import MAX_SHARD_LABELS, OTHER_SHARDS, Metrics

    metrics = Metrics(lambda: {})
    labels = [metrics.shard(f"s{i}") for i in range(MAX_SHARD_LABELS + 5)]
    assert labels[:MAX_SHARD_LABELS] == [f"s{i}" for i in range(MAX_SHARD_LABELS)]
    assert labels[MAX_SHARD_LABELS:] == [OTHER_SHARDS] * 5
    assert metrics.shard("s7") == "s7"  # a labelled shard keeps its label


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_sigterm_drains_ends_listens_and_exits_zero(
    start_server: StartServer, tmp_path: Path
) -> None:
    loc = _sqlite(tmp_path)
    server = start_server(loc)
    client = server.client()
    shard = new_shard()
    client.put(shard, updates([(1, "a", 0, 1)]), 0, 1)
    info = client.info({"shard": shard, "listen": True, "as_of": 0})
    reader = client.flight.do_get(info.endpoints[0].ticket, client.options)
    ended: list[BaseException | None] = []

    def follow() -> None:
        try:
            while True:
                reader.read_chunk()
        except StopIteration:
            ended.append(None)
        except fl.FlightError as exc:
            ended.append(exc)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    time.sleep(0.3)
    started = time.monotonic()
    assert server.terminate(timeout=60) == 0
    assert time.monotonic() - started < 30
    follower.join(10)
    assert ended, "the listen did not end when the server drained"
    if ended[0] is not None:
        assert isinstance(ended[0], fl.FlightUnavailableError)
    # Every reader the server held was released on the way out.
    assert asyncio.run(_readers(loc, shard)) == 0


async def _big_shard(loc: tuple[str, str]) -> str:
    """A shard whose snapshot is far larger than gRPC's flow-control windows and the sockets'
    buffers (about 230 MB of Arrow, a few MB of Parquet): a DoGet client that stops reading
    leaves the server's gRPC thread waiting in a write that no cancel of persist's reaches."""
    n = 2_000_000
    big = pa.table(
        {
            "k": pa.array(np.arange(n, dtype=np.int64)),
            "v": pa.array(["x" * 100] * n, pa.string()),
            "_time": pa.array(np.zeros(n, dtype=np.uint64)),
        }
    )
    async with await persist.connect(*loc) as c:
        shard = persist.ShardId.new()
        w, r = await c.open(shard, pa.schema([("k", pa.int64()), ("v", pa.string())]))
        await w.compare_and_append(big, 0, 1)
        await w.expire()
        await r.expire()
        return str(shard)


async def _readers(loc: tuple[str, str], shard: str) -> int:
    async with await persist.connect(*loc) as c:
        return int((await c.inspect(shard))["readers"])


def _read_one_then_stop(client: fl.FlightClient, shard: str, **options: Any) -> Any:
    """Starts a DoGet of the whole shard and reads its first batch only; the open stream."""
    opts = fl.FlightCallOptions(**options)
    info = client.get_flight_info(cmd({"shard": shard}), opts)
    assert info.total_bytes > 0
    reader = client.do_get(info.endpoints[0].ticket, opts)
    assert reader.read_chunk().data.num_rows > 0
    return reader


def test_sigterm_exits_within_the_grace_while_a_doget_client_stops_reading(
    start_server: StartServer, tmp_path: Path
) -> None:
    loc = _sqlite(tmp_path)
    shard = asyncio.run(_big_shard(loc))
    grace_s = 2.0
    server = start_server(loc, "--drain-grace-s", str(grace_s))
    client = server.client()
    reader = _read_one_then_stop(client.flight, shard, headers=client.options.headers)
    time.sleep(0.5)  # the server fills the windows and blocks; the client holds on, unread
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        status = server.proc.wait(timeout=grace_s + 10)
    finally:
        elapsed = time.monotonic() - started
    assert status == 0, "".join(server.stderr)
    assert elapsed < grace_s + 10
    # The stream was ended on the server's side, not left open.
    with pytest.raises(fl.FlightError):
        while True:
            reader.read_chunk()
    assert asyncio.run(_readers(loc, shard)) == 0


@pytest.mark.parametrize("severed", [True, False], ids=["severed", "left-behind"])
async def test_stop_returns_within_the_grace_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, severed: bool
) -> None:
    loc = _sqlite(tmp_path)
    shard = await _big_shard(loc)
    if not severed:
        # As where the connections can't be listed: the last resort, a thread left behind.
        monkeypatch.setattr(flight_server, "_sever_connections", lambda port: 0)
    for bad in (-1, "30", True):
        with pytest.raises(persist.InvalidUsage, match="drain_grace_s"):
            FlightServer(*loc, drain_grace_s=bad)  # type: ignore[arg-type]
    grace_s = 1.0
    server = FlightServer(*loc, port=0, token=None, wal_dir=tmp_path / "wal", drain_grace_s=grace_s)
    await server.start()
    client = fl.FlightClient(server.uri)
    # pyarrow's client blocks: off the loop the server's calls hop onto.
    reader = await asyncio.to_thread(_read_one_then_stop, client, shard)
    await asyncio.sleep(0.5)
    started = time.monotonic()
    stopping = asyncio.ensure_future(server.stop())
    await asyncio.wait({stopping}, timeout=grace_s + 10)
    elapsed = time.monotonic() - started
    if not stopping.done():
        await asyncio.to_thread(reader.cancel)  # lets the server finish, then fails the test
        await stopping
    assert elapsed < grace_s + 6, f"stop() took {elapsed:.1f} s"
    stopping.result()
    assert server.left_behind is not severed
    assert await _readers(loc, shard) == 0
    # The client goes away: a thread left behind ends now (before this test's loop closes).
    await asyncio.to_thread(reader.cancel)
    client.close()
    for thread in threading.enumerate():
        if thread.name == "persist-flight-shutdown":
            await asyncio.to_thread(thread.join, 10)
            assert not thread.is_alive()


def test_corrupt_data_is_an_integrity_error(start_server: StartServer, tmp_path: Path) -> None:
    loc = _sqlite(tmp_path)
    server = start_server(loc)
    client = server.client()
    shard = new_shard()
    n = 50_000
    client.put(
        shard,
        pa.table(
            {
                "k": pa.array(range(n), pa.int64()),
                "v": pa.array([f"value {i}" for i in range(n)]),
                "_time": pa.array([0] * n, pa.uint64()),
            }
        ),
        0,
        1,
    )
    assert server.terminate() == 0  # no cached copy of the part survives
    parts = [p for p in (tmp_path / "b").rglob("*") if p.is_file() and p.stat().st_size > 10_000]
    assert parts
    for part in parts:
        data = bytearray(part.read_bytes())
        for i in range(100, len(data) - 1000, 997):
            data[i] ^= 0xFF
        part.write_bytes(bytes(data))
    client = start_server(loc).client()
    info = client.info({"shard": shard})
    with pytest.raises(fl.FlightInternalError) as e:
        client.get(info.endpoints[0].ticket)
    p = payload(e.value)
    assert p["error"] == "IntegrityError"
    assert p["determinate"] is True


def test_a_failing_blob_is_an_external_error(start_server: StartServer, tmp_path: Path) -> None:
    # The blob's root is a regular file: every write of a part fails in the file system.
    (tmp_path / "not-a-dir").write_bytes(b"")
    loc = ((tmp_path / "not-a-dir").as_uri(), f"sqlite://{tmp_path / 'c.db'}")
    client = start_server(loc).client()
    shard = new_shard()
    big = pa.table(
        {
            "k": pa.array(range(10_000), pa.int64()),
            "v": pa.array(["x" * 20] * 10_000),
            "_time": pa.array([0] * 10_000, pa.uint64()),
        }
    )
    with pytest.raises(fl.FlightError) as e:
        client.put(shard, big, 0, 1)
    p = payload(e.value)
    assert p["error"] == "ExternalError"
    expected = fl.FlightUnavailableError if p["determinate"] else fl.FlightServerError
    assert type(e.value) is expected
    # Nothing came of it: creating the shard already failed (its first rollup is a blob).
    with pytest.raises(fl.FlightServerError) as e:
        client.action("frontiers", {"shard": shard})
    assert "does not exist" in payload(e.value)["message"]


async def test_health_reads_both_stores_and_says_which_one_fails(tmp_path: Path) -> None:
    from persist.flight import FlightServer
    from persist.location import open_blob, open_consensus
    from persist.testing.faults import Faults, FaultyConsensus

    faults = Faults()
    consensus = FaultyConsensus(open_consensus(f"sqlite://{tmp_path / 'c.db'}"), faults)
    blob = open_blob((tmp_path / "b").as_uri())
    server = FlightServer(blob, consensus, port=0, token=None, wal_dir=tmp_path / "wal")
    await server.start()
    try:
        client = fl.FlightClient(server.uri)

        def health() -> dict[str, object]:
            [result] = list(client.do_action(fl.Action("health", b"{}")))
            return dict(json.loads(result.body.to_pybytes()))

        assert (await asyncio.to_thread(health))["status"] == "ok"
        faults.fail_before = 1.0  # consensus down: every call fails before it runs
        got = await asyncio.to_thread(health)
        assert got["status"] == "unavailable" and got["blob"] == "ok"
        assert "ExternalError" in str(got["consensus"])
        faults.fail_before = 0.0
        assert (await asyncio.to_thread(health))["status"] == "ok"
    finally:
        await server.stop()
