"""Schema evolution over Flight: the ``evolve_schema`` action, reads in the current schema
(GetSchema, GetFlightInfo, DoGet, contents), DoPut and DoExchange taking an earlier version's
columns, and a WAL of writes of earlier versions recovered after the schema evolved."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl
import pytest

import persist
from persist.flight import StreamingWriter
from tests.flight.conftest import (
    TOKEN,
    Client,
    StartServer,
    cmd,
    consolidated,
    new_shard,
    payload,
    updates,
)

V0 = pa.schema([("k", pa.int64()), ("v", pa.string())])
# Version 1: ``v`` renamed ``name``, ``w`` added (nullable).
V1 = pa.schema([("k", pa.int64()), ("name", pa.string()), ("w", pa.int32())])
FULL = [
    pa.field("_time", pa.uint64(), nullable=False),
    pa.field("_diff", pa.int64(), nullable=False),
]


def _sqlite(tmp_path: Path) -> tuple[str, str]:
    return (tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}"


def _b64(schema: pa.Schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def _evolve(client: Client, shard: str, schema: pa.Schema, **more: Any) -> Any:
    return client.action("evolve_schema", {"shard": shard, "schema": _b64(schema), **more})


def _refused(client: Client, shard: str, schema: pa.Schema, **more: Any) -> dict[str, Any]:
    with pytest.raises(fl.FlightServerError) as e:
        _evolve(client, shard, schema, **more)
    return payload(e.value)


def _v1_rows(rows: list[tuple[int, str, int | None, int, int]]) -> pa.Table:
    """(k, name, w, time, diff) rows as a DoPut table of version 1's columns."""
    return pa.table(
        {
            "k": pa.array([r[0] for r in rows], pa.int64()),
            "name": pa.array([r[1] for r in rows], pa.string()),
            "w": pa.array([r[2] for r in rows], pa.int32()),
            "_time": pa.array([r[3] for r in rows], pa.uint64()),
            "_diff": pa.array([r[4] for r in rows], pa.int64()),
        }
    )


def _contents(client: Client, shard: str) -> list[dict[str, Any]]:
    rows = client.read({"shard": shard, "contents": True}).to_pylist()
    return sorted(rows, key=lambda r: r["k"])


def test_the_action_evolves_and_refusals_come_back_told_apart(
    start_server: StartServer, tmp_path: Path
) -> None:
    client = start_server(_sqlite(tmp_path)).client()
    shard = new_shard()
    client.put(shard, updates([(1, "a", 0, 1)]), 0, 1)
    assert _evolve(client, shard, V1, renames={"v": "name"}) == {"version": 1}
    # Evolving to the current schema changes nothing: its version is answered.
    assert _evolve(client, shard, V1) == {"version": 1}
    # A lost race: SchemaChanged, with both versions for the client to read.
    lost = _refused(client, shard, V1.append(pa.field("x", pa.string())), expected_version=0)
    assert (lost["error"], lost["expected"], lost["current"]) == ("SchemaChanged", 0, 1)
    # A change evolution can't make: InvalidUsage naming the field; nothing changed.
    narrowed = pa.schema([("k", pa.int32()), ("name", pa.string()), ("w", pa.int32())])
    bad = _refused(client, shard, narrowed)
    assert bad["error"] == "InvalidUsage" and "'k'" in bad["message"]
    not_null = V1.append(pa.field("z", pa.int64(), nullable=False))
    bad = _refused(client, shard, not_null)
    assert bad["error"] == "InvalidUsage" and "'z'" in bad["message"]
    assert _refused(client, shard, V1, renames={"gone": "name"})["error"] == "InvalidUsage"
    with pytest.raises(fl.FlightServerError) as e:
        client.action("evolve_schema", {"shard": shard, "schema": "not base64 IPC!"})
    assert payload(e.value)["error"] == "InvalidUsage"
    # The expected version holds: the evolution lands.
    v2 = V1.append(pa.field("x", pa.string()))
    assert _evolve(client, shard, v2, expected_version=1) == {"version": 2}
    # GetSchema gives the current schema, with and without _time/_diff.
    schema = client.flight.get_schema(cmd({"shard": shard}), client.options).schema
    assert schema == pa.schema([*v2, *FULL])
    contents = client.flight.get_schema(cmd({"shard": shard, "contents": True}), client.options)
    assert contents.schema == v2


def test_reads_show_every_row_in_the_current_schema(
    start_server: StartServer, tmp_path: Path
) -> None:
    client = start_server(_sqlite(tmp_path)).client()
    shard = new_shard()
    client.put(shard, updates([(1, "a", 0, 1), (2, "b", 0, 1)]), 0, 1)
    before = client.info({"shard": shard})
    assert before.schema == pa.schema([*V0, *FULL])
    assert _evolve(client, shard, V1, renames={"v": "name"}) == {"version": 1}
    # A read planned before the evolution streams the schema its GetFlightInfo handed out.
    old = pa.concat_tables([client.get(ep.ticket) for ep in before.endpoints])
    assert old.schema == before.schema
    assert consolidated(old) == {(1, "a", 0): 1, (2, "b", 0): 1}
    # Planned after it: the new schema, the old rows in it (renamed, the added field null).
    info = client.info({"shard": shard})
    assert info.schema == pa.schema([*V1, *FULL])
    updated = pa.concat_tables([client.get(ep.ticket) for ep in info.endpoints])
    assert updated.schema == info.schema
    assert consolidated(updated) == {(1, "a", None, 0): 1, (2, "b", None, 0): 1}
    assert _contents(client, shard) == [
        {"k": 1, "name": "a", "w": None},
        {"k": 2, "name": "b", "w": None},
    ]
    # Rows written in the new schema after it: an insert, and the retraction of an old row
    # (null in the added field), which cancels the old row exactly.
    client.put(shard, _v1_rows([(3, "c", 30, 1, 1), (1, "a", None, 1, -1)]), 1, 2)
    assert _contents(client, shard) == [
        {"k": 2, "name": "b", "w": None},
        {"k": 3, "name": "c", "w": 30},
    ]
    # A listen from before the evolution shows every update in the current schema too.
    listen = client.info({"shard": shard, "listen": True, "as_of": 0, "until": 2})
    assert listen.schema == pa.schema([*V1, *FULL])
    events = client.get(listen.endpoints[0].ticket)
    assert consolidated(events) == {(1, "a", None, 1): -1, (3, "c", 30, 1): 1}


def test_doput_takes_an_earlier_versions_columns(start_server: StartServer, tmp_path: Path) -> None:
    client = start_server(_sqlite(tmp_path)).client()
    shard = new_shard()
    client.put(shard, updates([(1, "a", 0, 1)]), 0, 1)
    assert _evolve(client, shard, V1, renames={"v": "name"}) == {"version": 1}
    # Version 0's columns after the evolution: taken, and shown in version 1's.
    assert client.put(shard, updates([(2, "b", 1, 1)]), 1, 2) == {"upper": 2}
    # Version 1's columns, then version 0's again: the server writes through both versions.
    assert client.put(shard, _v1_rows([(3, "c", 7, 2, 1)]), 2, 3) == {"upper": 3}
    # A retraction at version 0 of a row written at version 1 with a null ``w`` cancels it.
    client.put(shard, _v1_rows([(4, "d", None, 3, 1)]), 3, 4)
    assert client.put(shard, updates([(4, "d", 4, -1)]), 4, 5) == {"upper": 5}
    assert _contents(client, shard) == [
        {"k": 1, "name": "a", "w": None},
        {"k": 2, "name": "b", "w": None},
        {"k": 3, "name": "c", "w": 7},
    ]
    # Columns of no version are refused, naming the column.
    with pytest.raises(fl.FlightServerError) as e:
        client.put(shard, updates([(5, "e", 5, 1)]).append_column("q", pa.array([1])), 5, 6)
    assert payload(e.value)["error"] == "InvalidUsage" and "q" in payload(e.value)["message"]


def _v0_batch(*ks: int) -> pa.RecordBatch:
    return pa.record_batch([pa.array(list(ks), pa.int64()), pa.array([f"v{k}" for k in ks])], V0)


def _v1_batch(*ks: int) -> pa.RecordBatch:
    return pa.record_batch(
        [
            pa.array(list(ks), pa.int64()),
            pa.array([f"n{k}" for k in ks]),
            pa.array([k * 10 for k in ks], pa.int32()),
        ],
        V1,
    )


def test_doexchange_takes_an_earlier_versions_columns(
    start_server: StartServer, write_location: tuple[str, str]
) -> None:
    # Groups are cut every 200 ms: writes of both versions go out in one group.
    server = start_server(write_location, "--commit-interval-ms", "200")
    client = server.client()
    shard = new_shard()
    client.put(shard, updates([(0, "v0", 0, 1)]), 0, 1)
    # A call opened before the evolution, writing version 0's columns.
    old = StreamingWriter(server.uri, shard, token=TOKEN, writer_id="old")
    old.write_durable(_v0_batch(1), "COMMITTED", seq=1)
    assert _evolve(client, shard, V1, renames={"v": "name"}) == {"version": 1}
    # It goes on writing after it; a new call with version 0's columns, and one with
    # version 1's, write beside it.
    late = StreamingWriter(server.uri, shard, token=TOKEN, writer_id="late")
    new = StreamingWriter(server.uri, shard, token=TOKEN, writer_id="new")
    sent: list[tuple[StreamingWriter, int, int]] = []  # writer, LSN, k
    for k in range(2, 8):
        sent.append((old, old.write(_v0_batch(k), seq=k), k))
        sent.append((late, late.write(_v0_batch(100 + k), seq=k), 100 + k))
        sent.append((new, new.write(_v1_batch(200 + k), seq=k), 200 + k))
    for writer, lsn, _ in sent:
        writer.wait_durable(lsn, "COMMITTED", timeout=60)
    # A resend of a version 0 write (same seq, same rows) is the same write: taken once.
    old.write_durable(_v0_batch(2), "COMMITTED", seq=2)
    for w in (old, late, new):
        w.close()
    expected = [{"k": 0, "name": "v0", "w": None}, {"k": 1, "name": "v1", "w": None}]
    expected += [{"k": k, "name": f"v{k}", "w": None} for k in range(2, 8)]
    expected += [{"k": 100 + k, "name": f"v{100 + k}", "w": None} for k in range(2, 8)]
    expected += [{"k": 200 + k, "name": f"n{200 + k}", "w": (200 + k) * 10} for k in range(2, 8)]
    assert _contents(client, shard) == sorted(expected, key=lambda r: r["k"])
    # Each write is at the time its COMMITTED ack named.
    upper = client.action("frontiers", {"shard": shard})["upper"]
    listen = client.info({"shard": shard, "listen": True, "as_of": 0, "until": upper})
    at = {r["k"]: r["_time"] for r in client.get(listen.endpoints[0].ticket).to_pylist()}
    assert {k: at[k] for _, _, k in sent} == {k: w.committed_at(lsn) for w, lsn, k in sent}


async def _evolve_directly(loc: tuple[str, str], shard: str, *schemas: pa.Schema) -> list[int]:
    """Evolves the shard in process, with no server running (its WAL is the server's)."""
    async with await persist.connect(*loc) as c:
        return [await c.evolve_schema(shard, s) for s in schemas]


def test_a_wal_of_earlier_versions_recovers_after_an_evolution(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Writes logged at two versions, the server killed before they commit, then the schema
    dropped ``v`` and added it back (a new field of the old name): the restart commits each
    logged write at its own version, so the old ``v``'s values stay dropped."""
    loc = _sqlite(tmp_path)
    args = ("--commit-interval-ms", "60000")  # nothing commits before the kill
    server = start_server(loc, *args)
    client = server.client()
    shard = new_shard()
    client.put(shard, updates([(0, "v0", 0, 1)]), 0, 1)
    old = StreamingWriter(server.uri, shard, token=TOKEN, levels=["LOCAL_DISK"])
    sent = [(old, old.write(_v0_batch(k))) for k in (1, 2)]
    added = V0.append(pa.field("w", pa.int32()))
    assert _evolve(client, shard, added) == {"version": 1}
    new = StreamingWriter(server.uri, shard, token=TOKEN, levels=["LOCAL_DISK"])
    later = pa.record_batch(
        [pa.array([3], pa.int64()), pa.array(["v3"]), pa.array([30], pa.int32())], added
    )
    sent += [(new, new.write(later)), (old, old.write(_v0_batch(4)))]
    for w, lsn in sent:
        w.wait_durable(lsn, "LOCAL_DISK", timeout=30)
    server.proc.kill()  # SIGKILL: the writes are only in the WAL
    server.proc.wait()
    dropped = pa.schema([("k", pa.int64()), ("w", pa.int32())])
    again = pa.schema([("k", pa.int64()), ("w", pa.int32()), ("v", pa.string())])
    assert asyncio.run(_evolve_directly(loc, shard, dropped, again)) == [2, 3]
    server = start_server(loc, *args)  # recovers the WAL before taking calls
    client = server.client()
    log = server.wait_for_log("recovered 4 logged write(s)")
    assert "damaged" not in log
    # Every logged write committed once, in the current schema: the ``v`` of each (the
    # dropped field's values) stays gone, ``w`` kept where it was written.
    assert _contents(client, shard) == [
        {"k": 0, "w": None, "v": None},
        {"k": 1, "w": None, "v": None},
        {"k": 2, "w": None, "v": None},
        {"k": 3, "w": 30, "v": None},
        {"k": 4, "w": None, "v": None},
    ]
    assert client.action("quarantine", {"shard": shard}) == []
    # The re-added ``v`` takes new values; version 0's columns are still taken, their ``v``
    # the dropped field (its values never shown).
    upper = client.action("frontiers", {"shard": shard})["upper"]
    current = pa.table(
        {
            "k": pa.array([5], pa.int64()),
            "w": pa.array([None], pa.int32()),
            "v": ["v5"],
            "_time": pa.array([upper], pa.uint64()),
        }
    )
    client.put(shard, current, upper, upper + 1)
    client.put(shard, updates([(6, "v6", upper + 1, 1)]), upper + 1, upper + 2)
    assert _contents(client, shard)[-2:] == [
        {"k": 5, "w": None, "v": "v5"},
        {"k": 6, "w": None, "v": None},
    ]
