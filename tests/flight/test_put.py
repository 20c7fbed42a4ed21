"""DoPut = compare_and_append, with the spec's payloads."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.flight as fl
import pytest

from tests.flight.conftest import StartServer, consolidated, new_shard, payload, updates


def test_put_success_mismatch_and_schema_payloads(
    start_server: StartServer, write_location: tuple[str, str]
) -> None:
    client = start_server(write_location).client()
    shard = new_shard()

    # A new shard is created with the stream's columns; success is {"upper": new_upper}.
    assert client.put(shard, updates([(1, "a", 0, 1)]), 0, 2) == {"upper": 2}
    no_diff = pa.table(
        {"k": pa.array([2], pa.int64()), "v": ["b"], "_time": pa.array([2], pa.uint64())}
    )
    assert client.put(shard, no_diff, 2, 3) == {"upper": 3}
    # Several batches are one atomic compare_and_append.
    writer, reader = client.flight.do_put(
        fl.FlightDescriptor.for_command(
            b'{"shard": "%s", "expected_upper": 3, "new_upper": 5}' % shard.encode()
        ),
        updates([]).schema,
        client.options,
    )
    for rows in ([(3, "c", 3, 1)], [(1, "a", 4, -1)], []):
        writer.write_table(updates(rows))
    writer.done_writing()
    assert reader.read().to_pybytes() == b'{"upper": 5}'
    writer.close()
    assert consolidated(client.read({"shard": shard})) == {(2, "b", 4): 1, (3, "c", 4): 1}

    # A stale expected upper: UpperMismatch with both uppers, nothing written.
    with pytest.raises(fl.FlightServerError) as e:
        client.put(shard, updates([(9, "z", 3, 1)]), 3, 6)
    assert payload(e.value) == {
        "error": "UpperMismatch",
        "message": "expected upper 3 but the shard upper is 5",
        "expected": 3,
        "current": 5,
    }

    # Schema and times: InvalidUsage, nothing written.
    bad: list[tuple[pa.Table, int, int]] = [
        (
            pa.table(
                {
                    "k": pa.array([1.5], pa.float64()),
                    "v": ["a"],
                    "_time": pa.array([5], pa.uint64()),
                }
            ),
            5,
            6,
        ),
        (pa.table({"k": pa.array([1], pa.int64()), "v": ["a"]}), 5, 6),  # no _time
        (
            pa.table(
                {
                    "k": pa.array([1], pa.int64()),
                    "v": ["a"],
                    "extra": [1.0],
                    "_time": pa.array([5], pa.uint64()),
                }
            ),
            5,
            6,
        ),
        (updates([(1, "a", 9, 1)]), 5, 6),  # a time outside [expected, new)
    ]
    for table, expected, new in bad:
        with pytest.raises(fl.FlightServerError) as e:
            client.put(shard, table, expected, new)
        assert payload(e.value)["error"] == "InvalidUsage", table.schema
    assert client.action("frontiers", {"shard": shard})["upper"] == 5
    for command in (
        b"{}",
        b'{"shard": "%s", "expected_upper": 5}' % shard.encode(),
        b'{"shard": "%s", "expected_upper": "5", "new_upper": 6}' % shard.encode(),
    ):
        writer, reader = client.flight.do_put(
            fl.FlightDescriptor.for_command(command), updates([]).schema, client.options
        )
        with pytest.raises(fl.FlightServerError) as e:
            writer.done_writing()
            reader.read()
            writer.close()
        assert payload(e.value)["error"] == "InvalidUsage"

    # The empty frontier finishes the shard: a listen's last upper is null.
    assert client.put(shard, updates([]), 5, None) == {"upper": None}
    assert client.action("frontiers", {"shard": shard})["upper"] is None


def test_puts_from_many_clients_interleave_exactly(
    start_server: StartServer, tmp_path: Any
) -> None:
    import threading

    loc = ((tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}")
    server = start_server(loc)
    shard = new_shard()
    server.client().put(shard, updates([]), 0, 0)
    wins: list[int] = []

    def race(i: int) -> None:
        client = server.client()
        upper = 0
        while upper < 40:
            try:
                client.put(shard, updates([(i, f"w{i}", upper, 1)]), upper, upper + 1)
                wins.append(upper)
            except fl.FlightServerError as exc:
                p = payload(exc)
                assert p["error"] == "UpperMismatch"
                upper = p["current"]
                continue
            upper += 1

    threads = [threading.Thread(target=race, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(wins) == list(range(40)), "each upper was won exactly once"
    contents = consolidated(server.client().read({"shard": shard}))
    assert sum(contents.values()) == 40
