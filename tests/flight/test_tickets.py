"""Tickets: only this server's own, unaltered, unexpired tickets are honoured."""

from __future__ import annotations

import os
import time
from typing import Any

import pyarrow.flight as fl
import pytest

from tests.flight.conftest import StartServer, consolidated, new_shard, payload, updates


def _refused(client: Any, ticket: bytes) -> dict[str, Any]:
    with pytest.raises(fl.FlightUnauthorizedError) as e:
        client.get(fl.Ticket(ticket))
    p = payload(e.value)
    assert p["error"] == "TicketInvalid"
    return p


def test_every_altered_byte_forged_and_foreign_tickets_are_refused(
    start_server: StartServer, tmp_path: Any
) -> None:
    loc = ((tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}")
    server = start_server(loc)
    client = server.client()
    shard = new_shard()
    client.put(shard, updates([(1, "a", 0, 1)]), 0, 1)
    ticket = client.info({"shard": shard}).endpoints[0].ticket.ticket
    for i in range(len(ticket)):
        for flip in (0x01, 0x80):
            altered = bytearray(ticket)
            altered[i] ^= flip
            _refused(client, bytes(altered))
    _refused(client, ticket[:-1])
    _refused(client, ticket + b"\x00")
    _refused(client, b"")
    _refused(client, os.urandom(len(ticket)))
    _refused(client, ticket[:3] + os.urandom(len(ticket) - 3))
    # The genuine one still works after all that.
    assert consolidated(client.get(fl.Ticket(ticket))) == {(1, "a", 0): 1}

    # Another server on the same location signs with its own key.
    other = start_server(loc).client()
    _refused(other, ticket)

    # After a restart, the tickets of the earlier run are refused cleanly.
    assert server.terminate() == 0
    again = start_server(loc).client()
    p = _refused(again, ticket)
    assert "another server or an earlier run" in p["message"]
    assert consolidated(again.read({"shard": shard})) == {(1, "a", 0): 1}


def test_expired_tickets_are_refused_and_their_reader_released(
    start_server: StartServer, tmp_path: Any
) -> None:
    loc = ((tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}")
    client = start_server(loc, "--ticket-ttl-s", "1").client()
    shard = new_shard()
    client.put(shard, updates([(1, "a", 0, 1)]), 0, 1)
    info = client.info({"shard": shard})
    endpoint = info.endpoints[0]
    expires = endpoint.expiration_time.as_py().timestamp()
    assert 0 < expires - time.time() <= 1.5
    assert _readers(loc, shard) == 1  # the ticket's reader holds as_of
    time.sleep(max(0.0, expires - time.time()) + 0.3)
    p = _refused(client, endpoint.ticket.ticket)
    assert "expired" in p["message"]
    deadline = time.monotonic() + 20
    while _readers(loc, shard) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _readers(loc, shard) == 0, "the expired ticket's reader was not released"


def _readers(loc: tuple[str, str], shard: str) -> int:
    import asyncio

    import persist

    async def go() -> int:
        async with await persist.connect(*loc) as c:
            return int((await c.inspect(shard))["readers"])

    return asyncio.run(go())
