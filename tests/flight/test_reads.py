"""GetFlightInfo + DoGet on a real ``persist serve``: endpoints are exact key-range splits."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as fl
import pytest

from tests.flight.conftest import (
    SCHEMA,
    StartServer,
    consolidated,
    new_shard,
    payload,
    updates,
)


def _write_with_retractions(client: Any, shard: str) -> tuple[dict[tuple[Any, ...], int], int]:
    """Four inserting puts, then retractions of rows of every earlier put in puts of their own:
    a row's insert and its retraction sit in different parts. Returns (contents, last time)."""
    rng = random.Random(11)
    keys = list(range(8000))
    rng.shuffle(keys)
    model: dict[int, int] = {}
    t = 0
    for chunk in range(4):
        ins = keys[chunk * 2000 : (chunk + 1) * 2000]
        client.put(shard, updates([(k, f"v{k}", t, 2) for k in ins]), t, t + 1)
        for k in ins:
            model[k] = 2
        t += 1
    for chunk in range(3):
        out = [k for i, k in enumerate(keys) if i % 3 == chunk][:1500]
        client.put(shard, updates([(k, f"v{k}", t, -1) for k in out]), t, t + 1)
        for k in out:
            model[k] -= 1
        t += 1
    gone = keys[:700]
    client.put(shard, updates([(k, f"v{k}", t, -model[k]) for k in gone]), t, t + 1)
    for k in gone:
        del model[k]
    return {(k, f"v{k}"): d for k, d in model.items() if d}, t


def test_four_endpoints_are_each_exact_and_together_the_contents(
    start_server: StartServer, location: tuple[str, str]
) -> None:
    # Readers alone hold history: the grants' readers move the since, as checked below.
    server = start_server(location, "--retention-s", "none")
    client = server.client()
    shard = new_shard()
    expected, as_of = _write_with_retractions(client, shard)

    info = client.info({"shard": shard, "splits": 4})
    assert info.schema == pa.schema(
        [
            *SCHEMA,
            pa.field("_time", pa.uint64(), nullable=False),
            pa.field("_diff", pa.int64(), nullable=False),
        ]
    )
    assert len(info.endpoints) == 4
    union: dict[tuple[Any, ...], int] = {}
    for ep in info.endpoints:
        assert ep.locations == []  # this server
        assert ep.expiration_time is not None
        table = client.get(ep.ticket)
        assert table.schema == info.schema
        assert pc.all(pc.equal(table["_time"], as_of)).as_py() is not False
        got = {(k, v): d for (k, v, _t), d in consolidated(table).items()}
        assert all(d > 0 for d in got.values()), "an endpoint alone must be exact"
        assert not union.keys() & got.keys(), "a row came from two endpoints"
        union.update(got)
    assert union == expected

    # The default is one endpoint, as_of upper - 1; an older as_of travels back in time.
    whole = client.read({"shard": shard})
    assert {(k, v): d for (k, v, _t), d in consolidated(whole).items()} == expected
    # Nothing holds times before the latest as_of any more: the since passed them.
    with pytest.raises(fl.FlightServerError) as e:
        client.info({"shard": shard, "as_of": 0})
    assert payload(e.value)["error"] == "InvalidUsage"
    assert "since" in payload(e.value)["message"]


def test_a_ticket_holds_its_as_of_while_the_shard_moves_on(
    start_server: StartServer, tmp_path: Any
) -> None:
    loc = ((tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}")
    client = start_server(loc).client()
    shard = new_shard()
    client.put(shard, updates([(1, "a", 0, 1), (2, "b", 0, 1)]), 0, 1)
    old = client.info({"shard": shard, "as_of": 0})
    client.put(shard, updates([(1, "a", 1, -1), (3, "c", 2, 1)]), 1, 3)
    assert consolidated(client.read({"shard": shard})) == {(2, "b", 2): 1, (3, "c", 2): 1}
    # The old ticket's reader held as_of 0: the old contents, twice (a ticket is reusable).
    for _ in range(2):
        assert consolidated(client.get(old.endpoints[0].ticket)) == {(1, "a", 0): 1, (2, "b", 0): 1}
    assert client.action("frontiers", {"shard": shard})["since"] == 0


def test_snapshot_edge_cases(start_server: StartServer, tmp_path: Any) -> None:
    loc = ((tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}")
    server = start_server(loc)
    client = server.client()
    shard = new_shard()
    with pytest.raises(fl.FlightServerError) as e:
        client.info({"shard": shard})
    assert payload(e.value)["error"] == "InvalidUsage"  # unknown shard

    # A shard with nothing written has no default as_of.
    client.put(shard, updates([]), 0, 0)
    with pytest.raises(fl.FlightServerError) as e:
        client.info({"shard": shard})
    assert "upper is 0" in payload(e.value)["message"]

    # Retractions that cancel everything: no endpoint means empty contents.
    client.put(shard, updates([(1, "a", 0, 1), (1, "a", 0, -1)]), 0, 2)
    info = client.info({"shard": shard, "splits": 3})
    assert info.endpoints == []

    # as_of >= upper waits, bounded by the call's deadline.
    started = time.monotonic()
    with pytest.raises(fl.FlightTimedOutError):
        client.info({"shard": shard, "as_of": 5}, timeout=0.5)
    assert time.monotonic() - started < 10

    # ...and is answered once the upper passes it.
    box: dict[str, Any] = {}
    waiter = threading.Thread(
        target=lambda: box.update(info=client.info({"shard": shard, "as_of": 3}))
    )
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()
    client.put(shard, updates([(2, "b", 3, 1)]), 2, 4)
    waiter.join(30)
    rows = [client.get(ep.ticket) for ep in box["info"].endpoints]
    assert consolidated(pa.concat_tables(rows)) == {(2, "b", 3): 1}

    # Bad commands are InvalidUsage with the reason.
    for bad in (
        {"shard": "not-a-shard"},
        {"shard": shard, "splits": 0},
        {"shard": shard, "as_of": -1},
        {"shard": shard, "as_of": True},
        {"shard": shard, "bogus": 1},
        {"shard": shard, "listen": True},  # a listen needs as_of
    ):
        with pytest.raises(fl.FlightServerError) as e:
            client.info(bad)
        assert payload(e.value)["error"] == "InvalidUsage", bad
    with pytest.raises(fl.FlightServerError) as e:
        client.flight.get_flight_info(fl.FlightDescriptor.for_command(b"{not json"), client.options)
    assert payload(e.value)["error"] == "InvalidUsage"
    with pytest.raises(fl.FlightServerError) as e:
        client.flight.get_flight_info(fl.FlightDescriptor.for_path("x"), client.options)
    assert payload(e.value)["error"] == "InvalidUsage"
    # as_of below the since.
    client.action("frontiers", {"shard": shard})
    schema = client.flight.get_schema(
        fl.FlightDescriptor.for_command(json.dumps({"shard": shard}).encode()), client.options
    ).schema
    assert schema.names == ["k", "v", "_time", "_diff"]


def test_doget_streams_in_messages_not_one_table(start_server: StartServer, tmp_path: Any) -> None:
    loc = ((tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}")
    client = start_server(loc).client()
    shard = new_shard()
    n = 400_000
    big = pa.table(
        {
            "k": pa.array(range(n), pa.int64()),
            "v": pa.array(["x" * 40] * n),
            "_time": pa.array([0] * n, pa.uint64()),
        }
    )
    client.put(shard, big, 0, 1)
    info = client.info({"shard": shard})
    reader = client.flight.do_get(info.endpoints[0].ticket, client.options)
    chunks = 0
    rows = 0
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            break
        chunks += 1
        rows += chunk.data.num_rows
        assert chunk.data.nbytes <= 16 << 20
    assert rows == n
    assert chunks > 1
