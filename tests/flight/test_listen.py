"""Listens over DoGet: ``{"upper": U}`` on every message, progress-only messages, ``until``, and
a listen's reader that follows what it delivered."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pyarrow.flight as fl
import pytest

from tests.flight.conftest import StartServer, consolidated, new_shard, payload, updates


def _messages(reader: fl.FlightStreamReader) -> list[tuple[Any, int | None]]:
    out = []
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            return out
        out.append((chunk.data, json.loads(chunk.app_metadata.to_pybytes())["upper"]))


def test_listen_order_progress_and_until(
    start_server: StartServer, write_location: tuple[str, str]
) -> None:
    server = start_server(write_location)
    client = server.client()
    shard = new_shard()
    client.put(shard, updates([(0, "before", 0, 1)]), 0, 1)
    info = client.info({"shard": shard, "listen": True, "as_of": 0, "until": 9})
    assert len(info.endpoints) == 1
    reader = client.flight.do_get(info.endpoints[0].ticket, client.options)
    got: list[tuple[Any, int | None]] = []
    done = threading.Event()

    def read() -> None:
        got.extend(_messages(reader))
        done.set()

    threading.Thread(target=read, daemon=True).start()
    client.put(shard, updates([(1, "a", 1, 1), (2, "b", 2, 1)]), 1, 3)
    client.put(shard, updates([]), 3, 5)  # progress only
    client.put(shard, updates([(1, "a", 5, -1), (3, "c", 6, 1)]), 5, 7)
    client.put(shard, updates([(4, "d", 8, 1)]), 7, 10)  # reaches until: the stream ends
    assert done.wait(30), "the listen did not end at until"

    uppers = [u for _, u in got]
    assert uppers == sorted(set(uppers)), "uppers strictly increase"
    assert uppers[-1] == 10
    seen: list[tuple[int, str, int, int]] = []
    previous = 1  # the listen starts after as_of 0
    for batch, upper in got:
        rows = batch.to_pylist()
        for r in rows:
            # Its rows are below its upper, and nothing below the previous upper comes late.
            assert previous <= r["_time"] < upper
            seen.append((r["k"], r["v"], r["_time"], r["_diff"]))
        previous = upper
    assert sorted(seen) == sorted(
        [(1, "a", 1, 1), (2, "b", 2, 1), (1, "a", 5, -1), (3, "c", 6, 1), (4, "d", 8, 1)]
    )
    # The progress-only put shows as a message without rows (or is folded into a later upper).
    assert any(batch.num_rows == 0 for batch, _ in got) or 5 not in uppers


def test_listen_follows_with_its_since_and_stops_on_cancel(
    start_server: StartServer, tmp_path: Any
) -> None:
    loc = ((tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}")
    # Readers alone hold history (no retention): the listen's reader is what moves the since.
    server = start_server(loc, "--ticket-ttl-s", "1", "--retention-s", "none")
    client = server.client()
    shard = new_shard()
    client.put(shard, updates([(0, "x", 0, 1)]), 0, 1)
    info = client.info({"shard": shard, "listen": True, "as_of": 0})
    reader = client.flight.do_get(info.endpoints[0].ticket, client.options)
    t = 1
    deadline = time.monotonic() + 30
    # Once the ticket expired (its reader held as_of), only the listen's own reader holds the
    # since, and it moves up behind what was delivered: compaction is not pinned at as_of.
    while time.monotonic() < deadline:
        client.put(shard, updates([(t, "y", t, 1)]), t, t + 1)
        chunk = reader.read_chunk()
        assert json.loads(chunk.app_metadata.to_pybytes())["upper"] == t + 1
        t += 1
        since = client.action("frontiers", {"shard": shard})["since"]
        if since is not None and since > 2:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the listen's reader never moved the since")
    reader.cancel()
    # Expired: the ticket can't start another listen.
    with pytest.raises(fl.FlightUnauthorizedError) as e:
        client.get(info.endpoints[0].ticket)
    assert payload(e.value)["error"] == "TicketInvalid"
    # The server lets go of the cancelled listen's reader: only holds of live calls remain.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = _inspect(loc, shard)
        if state["readers"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"readers still registered: {state['readers']}")
    assert (t - 1, "y", t - 1) in consolidated(client.read({"shard": shard}))


def _inspect(loc: tuple[str, str], shard: str) -> dict[str, Any]:
    import asyncio

    import persist

    async def go() -> dict[str, Any]:
        async with await persist.connect(*loc) as c:
            return await c.inspect(shard)

    return asyncio.run(go())
