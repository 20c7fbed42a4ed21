"""Shards by name over a real ``persist serve``: path descriptors read contents, ListFlights
lists the catalog, and every command takes a name where it takes a shard id."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl
import pytest

from tests.flight.conftest import StartServer, cmd, payload, updates

ROWS = pa.schema([("k", pa.int64()), ("v", pa.string())])


def _read(client: Any, descriptor: fl.FlightDescriptor) -> tuple[fl.FlightInfo, Counter[Any]]:
    info = client.flight.get_flight_info(descriptor, client.options)
    tables = [client.get(ep.ticket) for ep in info.endpoints]
    table = pa.concat_tables(tables) if tables else info.schema.empty_table()
    assert table.schema == ROWS == info.schema  # data columns only: what any client wants
    return info, Counter((r["k"], r["v"]) for r in table.to_pylist())


def test_a_named_shard_over_flight(start_server: StartServer, location: tuple[str, str]) -> None:
    client = start_server(location).client()
    ns = f"t{uuid.uuid4().hex[:12]}"
    name = f"{ns}.sales.orders"
    # A put to a new name creates the shard under it, with the stream's columns.
    client.put(name, updates([(k, f"v{k}", 0, 1) for k in range(5)]), 0, 1)
    assert client.action("frontiers", {"shard": name}) == {"since": 0, "upper": 1}
    info, rows = _read(client, fl.FlightDescriptor.for_path(name))
    assert rows == Counter({(k, f"v{k}"): 1 for k in range(5)})
    assert info.total_records == 5  # every update +1: counted from the parts alone
    # The name split into path segments names the same shard.
    _, same = _read(client, fl.FlightDescriptor.for_path(ns, "sales", "orders"))
    assert same == rows
    # A retraction and a second copy: rows repeated by multiplicity, the count unknown.
    client.put(name, updates([(1, "v1", 1, -1), (2, "v2", 1, 1), (9, "v9", 1, 1)]), 1, 2)
    info, rows = _read(client, fl.FlightDescriptor.for_path(name))
    assert rows == Counter({(0, "v0"): 1, (2, "v2"): 2, (3, "v3"): 1, (4, "v4"): 1, (9, "v9"): 1})
    assert info.total_records == -1
    # The contents command takes a name and as_of; the updates command a name too.
    _, then = _read(client, cmd({"shard": name, "contents": True, "as_of": 0, "splits": 3}))
    assert then == Counter({(k, f"v{k}"): 1 for k in range(5)})
    updates_info = client.info({"shard": name})
    assert updates_info.schema.names == ["k", "v", "_time", "_diff"]
    schema = client.flight.get_schema(fl.FlightDescriptor.for_path(name), client.options).schema
    assert schema == ROWS

    other = f"{ns}.hr.people"
    client.put(other, updates([(7, "v7", 0, 1)]), 0, 1)
    listed = list(client.flight.list_flights(ns.encode(), client.options))
    assert [f.descriptor.path for f in listed] == [[other.encode()], [name.encode()]]
    assert all(f.schema == ROWS and f.total_bytes > 0 and not f.endpoints for f in listed)
    sales = list(client.flight.list_flights(f"{ns}.sales".encode(), client.options))
    assert [f.descriptor for f in sales] == [fl.FlightDescriptor.for_path(name)]


def test_unknown_and_bad_names(start_server: StartServer, location: tuple[str, str]) -> None:
    client = start_server(location).client()
    missing = f"t{uuid.uuid4().hex[:12]}.missing"
    for descriptor in (fl.FlightDescriptor.for_path(missing), cmd({"shard": missing})):
        with pytest.raises(fl.FlightServerError) as info:
            client.flight.get_flight_info(descriptor, client.options)
        assert payload(info.value)["error"] == "InvalidUsage"
        assert "no shard is named" in payload(info.value)["message"]
    for bad in (fl.FlightDescriptor.for_path("a-b"), fl.FlightDescriptor.for_path("a", "")):
        with pytest.raises(fl.FlightServerError) as info:
            client.flight.get_flight_info(bad, client.options)
        assert "not a shard name" in payload(info.value)["message"]
    with pytest.raises(fl.FlightServerError) as info:
        client.action("frontiers", {"shard": missing})
    assert "no shard is named" in payload(info.value)["message"]
    # A put takes a command: a path descriptor only reads.
    writer, reader = client.flight.do_put(
        fl.FlightDescriptor.for_path(missing), updates([]).schema, client.options
    )
    with pytest.raises(fl.FlightServerError) as info:
        writer.done_writing()
        reader.read()
        writer.close()
    assert "command descriptor" in payload(info.value)["message"]


def test_a_streaming_write_to_a_new_name_creates_the_named_shard(
    start_server: StartServer, write_location: tuple[str, str]
) -> None:
    client = start_server(write_location).client()
    name = f"t{uuid.uuid4().hex[:12]}.events"
    command = {"shard": name, "op": "streaming_write", "levels": ["COMMITTED"]}
    writer, reader = client.flight.do_exchange(cmd(command), client.options)
    writer.begin(ROWS)
    for k in range(3):
        writer.write_batch(pa.record_batch([pa.array([k]), pa.array([f"v{k}"])], schema=ROWS))
    writer.done_writing()
    acks = [row for chunk in reader for row in chunk.data.to_pylist()]
    writer.close()
    assert [a["lsn"] for a in acks if a["durability_level"] == "COMMITTED"] == [0, 1, 2]
    _, rows = _read(client, fl.FlightDescriptor.for_path(name))
    assert rows == Counter({(k, f"v{k}"): 1 for k in range(3)})
    # By id or by name, one shard: the durability marks agree.
    shard = next(iter(client.flight.list_flights(name.encode(), client.options)))
    assert shard.descriptor.path == [name.encode()]
    assert client.action("durability", {"shard": name})["COMMITTED"] == 3


def test_as_of_an_instant_over_flight(start_server: StartServer, tmp_path: Any) -> None:
    import persist

    location = ((tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}")
    client = start_server(location).client()
    name = f"t{uuid.uuid4().hex[:12]}.ledger"
    client.put(name, updates([(1, "v1", 0, 1)]), 0, 1)

    async def first_commit_at() -> str:
        async with await persist.connect(*location) as c:
            return str((await c.history(name))[-1]["at"].isoformat())

    import asyncio

    then = asyncio.run(first_commit_at())
    time.sleep(0.01)  # the next commit is stamped a later millisecond
    client.put(name, updates([(2, "v2", 1, 1)]), 1, 2)
    _, rows = _read(client, cmd({"shard": name, "contents": True, "as_of": then}))
    assert rows == Counter({(1, "v1"): 1})
    with pytest.raises(fl.FlightServerError) as info:
        client.flight.get_flight_info(cmd({"shard": name, "as_of": "soon"}), client.options)
    assert "ISO 8601" in payload(info.value)["message"]
