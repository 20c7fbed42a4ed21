"""The wire conventions on their own: error mapping, command checks, ticket signatures; and
``FlightServer`` in process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as fl
import pytest
from hypothesis import given
from hypothesis import strategies as st

import persist
from persist.flight import FlightServer, TicketInvalid
from persist.flight._protocol import error_payload, flight_error, info_command, put_command
from persist.flight._tickets import TicketBody, TicketSigner


@pytest.mark.parametrize(
    ("exc", "cls", "expected"),
    [
        (
            persist.UpperMismatch(3, 5),
            fl.FlightServerError,
            {"error": "UpperMismatch", "expected": 3, "current": 5},
        ),
        (persist.UpperMismatch(3, None), fl.FlightServerError, {"expected": 3, "current": None}),
        (persist.InvalidUsage("bad"), fl.FlightServerError, {"error": "InvalidUsage"}),
        (persist.LeaseExpired("gone"), fl.FlightServerError, {"error": "LeaseExpired"}),
        (
            persist.ExternalError("down", determinate=True),
            fl.FlightUnavailableError,
            {"error": "ExternalError", "determinate": True},
        ),
        (
            persist.ExternalError("maybe", determinate=False),
            fl.FlightServerError,
            {"error": "ExternalError", "determinate": False},
        ),
        (
            persist.IntegrityError("rot"),
            fl.FlightInternalError,
            {"error": "IntegrityError", "determinate": True},
        ),
        (TicketInvalid("forged"), fl.FlightUnauthorizedError, {"error": "TicketInvalid"}),
        (RuntimeError("bug"), fl.FlightInternalError, {"error": "InternalError"}),
    ],
)
def test_errors_map_as_the_spec_table_says(
    exc: Exception, cls: type[fl.FlightError], expected: dict[str, object]
) -> None:
    got_cls, body = error_payload(exc)
    assert got_cls is cls
    assert body["message"] == str(exc)
    assert expected.items() <= body.items()
    error = flight_error(exc)
    assert type(error) is cls
    assert json.loads(error.extra_info) == body
    assert str(error) == "persist: " + json.dumps(body)


def test_commands_are_checked() -> None:
    shard = str(persist.ShardId.new())

    def desc(obj: object) -> fl.FlightDescriptor:
        return fl.FlightDescriptor.for_command(json.dumps(obj).encode())

    snap = info_command(desc({"shard": shard}))
    assert (snap.shard, snap.as_of, snap.splits) == (shard, None, 1)
    listen = info_command(desc({"shard": shard, "listen": True, "as_of": 3, "until": None}))
    assert (listen.as_of, listen.until) == (3, None)
    put = put_command(desc({"shard": shard, "expected_upper": 0, "new_upper": None}))
    assert (put.expected_upper, put.new_upper) == (0, None)
    for bad in (
        [],
        {"shard": 1},
        {"shard": shard, "splits": 1025},
        {"shard": shard, "as_of": 2**64},
        {"shard": shard, "as_of": 1.5},
        {"shard": shard, "listen": "yes", "as_of": 1},
        {"shard": shard, "listen": True, "as_of": 1, "splits": 2},
    ):
        with pytest.raises(persist.InvalidUsage):
            info_command(desc(bad))
    for bad_put in ({"shard": shard, "new_upper": 1}, {"shard": shard, "expected_upper": None}):
        with pytest.raises(persist.InvalidUsage):
            put_command(desc(bad_put))


bodies = st.builds(
    TicketBody,
    grant=st.text(max_size=40),
    index=st.integers(0, 2**31),
    expires_ms=st.integers(1, 2**62),
)


@given(body=bodies, position=st.integers(0, 10_000), flip=st.integers(1, 255))
def test_a_ticket_verifies_only_unaltered(body: TicketBody, position: int, flip: int) -> None:
    signer = TicketSigner(b"k" * 32)
    ticket = signer.sign(body)
    assert signer.verify(ticket, 0) == body
    altered = bytearray(ticket)
    altered[position % len(ticket)] ^= flip
    with pytest.raises(TicketInvalid):
        signer.verify(bytes(altered), 0)
    with pytest.raises(TicketInvalid):
        TicketSigner(b"j" * 32).verify(ticket, 0)  # another server's key
    with pytest.raises(TicketInvalid, match="expired"):
        signer.verify(ticket, body.expires_ms)


async def test_flight_server_in_process(tmp_path: Path) -> None:
    blob, consensus = (tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}"
    async with FlightServer(blob, consensus, port=0, token=None) as server:
        assert server.uri == f"grpc://127.0.0.1:{server.port}"
        shard = str(persist.ShardId.new())

        def talk() -> pa.Table:
            client = fl.FlightClient(server.uri)
            table = pa.table(
                {"k": pa.array([1, 2], pa.int64()), "_time": pa.array([0, 0], pa.uint64())}
            )
            cmd = {"shard": shard, "expected_upper": 0, "new_upper": 1}
            writer, reader = client.do_put(
                fl.FlightDescriptor.for_command(json.dumps(cmd).encode()), table.schema
            )
            writer.write_table(table)
            writer.done_writing()
            reader.read()
            writer.close()
            info = client.get_flight_info(
                fl.FlightDescriptor.for_command(json.dumps({"shard": shard}).encode())
            )
            return client.do_get(info.endpoints[0].ticket).read_all()

        # pyarrow's client blocks: off the loop the server's calls hop onto.
        table = await asyncio.to_thread(talk)
        assert sorted(table["k"].to_pylist()) == [1, 2]
        # The server's own client sees what the Flight call wrote.
        assert await server.client.frontiers(shard) == (0, 1)
    with pytest.raises(persist.InvalidUsage):
        FlightServer(blob, consensus, port=70000)
    with pytest.raises(persist.InvalidUsage):
        FlightServer(blob, consensus, tls_cert="x")


@pytest.mark.parametrize(
    "metadata",
    [
        b'{"seq": 0}',
        b'{"seq": 7}',
        b'{"seq": 123456789012345678}',
        b'{"seq": 9223372036854775807}',
        b'{"seq": 9223372036854775808}',
        b'{"seq": 07}',
        b'{"seq": -1}',
        b'{"seq": true}',
        b'{"seq": 1.0}',
        b'{"seq":3}',
        b'{"seq": null}',
        b'{"seq": 1, "x": 2}',
    ],
)
def test_a_writes_seq_reads_the_same_on_the_fast_path_and_the_json_one(metadata: bytes) -> None:
    """``write_seq`` reads the Python client's ``{"seq": n}`` without the JSON parser: it must
    answer (or refuse) exactly as the parser's path does."""
    from persist.flight._protocol import write_seq

    def via_json() -> int:
        # The same bytes with a space the fast path does not take: the JSON path.
        return write_seq(metadata.replace(b"{", b"{ ", 1), "w")

    try:
        expected: object = via_json()
    except persist.InvalidUsage as exc:
        expected = type(exc)
    try:
        got: object = write_seq(metadata, "w")
    except persist.InvalidUsage as exc:
        got = type(exc)
    assert got == expected
