"""examples/flight_client.py, a client with no persist import, against a real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.flight.conftest import TOKEN, StartServer

EXAMPLE = Path(__file__).parents[2] / "examples" / "flight_client.py"


def test_the_flight_example_runs(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(((tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}"))
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), server.uri, "--token", TOKEN],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "a stale writer was refused: {'error': 'UpperMismatch'" in out
    assert "{'user': 'ada', 'balance': 70, '_time': 1, '_diff': 1}" in out
    assert "{'user': 'bob', 'balance': 50, '_time': 1, '_diff': 1}" in out
    assert (
        "listen: 1 update(s) below upper 3: [{'user': 'cyd', 'balance': 30, '_time': 2, '_diff': 1}]"
        in out
    )
    # The listen's reader moved on, but the shard's retention (a day) keeps its history.
    assert "frontiers: {'since': 0, 'upper': 3}" in out
