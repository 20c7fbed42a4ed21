"""A stock Arrow Flight client of ``persist serve``: no persist package needed, only pyarrow.

    persist serve --blob file:///tmp/p/blob --consensus sqlite:////tmp/p/c.db --port 8815 --token t
    python examples/flight_client.py grpc://127.0.0.1:8815 --token t

It creates a shard with a DoPut (compare-and-append), updates it, reads the snapshot's endpoints
in parallel, and follows the shard with a listen while another write lands.
"""

from __future__ import annotations

import argparse
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.flight as fl


def command(obj: dict[str, object]) -> fl.FlightDescriptor:
    return fl.FlightDescriptor.for_command(json.dumps(obj).encode())


def put(
    client: fl.FlightClient,
    opts: fl.FlightCallOptions,
    shard: str,
    table: pa.Table,
    expected: int,
    new: int,
) -> int:
    """One compare_and_append; the server answers {"upper": new} or raises UpperMismatch."""
    writer, reader = client.do_put(
        command({"shard": shard, "expected_upper": expected, "new_upper": new}), table.schema, opts
    )
    writer.write_table(table)
    writer.done_writing()
    result = reader.read()
    writer.close()  # a refused append raises here (UpperMismatch, InvalidUsage)
    return int(json.loads(result.to_pybytes())["upper"])


def updates(users: list[str], balances: list[int], times: list[int], diffs: list[int]) -> pa.Table:
    return pa.table(
        {
            "user": pa.array(users, pa.string()),
            "balance": pa.array(balances, pa.int64()),
            "_time": pa.array(times, pa.uint64()),
            "_diff": pa.array(diffs, pa.int64()),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("uri")
    parser.add_argument("--token")
    args = parser.parse_args()
    client = fl.FlightClient(args.uri)
    headers = [(b"authorization", f"Bearer {args.token}".encode())] if args.token else []
    opts = fl.FlightCallOptions(headers=headers)
    shard = f"s{uuid.uuid4()}"

    put(client, opts, shard, updates(["ada", "bob"], [100, 50], [0, 0], [1, 1]), 0, 1)
    # An update is a retraction and an insertion.
    put(client, opts, shard, updates(["ada", "ada"], [100, 70], [1, 1], [-1, 1]), 1, 2)
    try:
        put(client, opts, shard, updates(["eve"], [1], [1], [1]), 1, 2)
    except fl.FlightServerError as exc:
        print("a stale writer was refused:", json.loads(exc.extra_info))

    info = client.get_flight_info(command({"shard": shard, "splits": 2}), opts)
    with ThreadPoolExecutor(4) as pool:
        parts = list(pool.map(lambda ep: client.do_get(ep.ticket, opts).read_all(), info.endpoints))
    contents = pa.concat_tables(parts).sort_by("user")
    print(f"contents as of upper - 1, from {len(info.endpoints)} endpoint(s):")
    for row in contents.to_pylist():
        print("  ", row)

    listen = client.get_flight_info(
        command({"shard": shard, "listen": True, "as_of": 1, "until": 3}), opts
    )
    stream = client.do_get(listen.endpoints[0].ticket, opts)
    later = threading.Timer(0.2, put, (client, opts, shard, updates(["cyd"], [30], [2], [1]), 2, 3))
    later.start()
    while True:
        try:
            chunk = stream.read_chunk()
        except StopIteration:
            break
        upper = json.loads(chunk.app_metadata.to_pybytes())["upper"]
        print(
            f"listen: {chunk.data.num_rows} update(s) below upper {upper}:", chunk.data.to_pylist()
        )
    later.join()
    frontiers = list(
        client.do_action(fl.Action("frontiers", json.dumps({"shard": shard}).encode()), opts)
    )
    print("frontiers:", json.loads(frontiers[0].body.to_pybytes()))


if __name__ == "__main__":
    main()
