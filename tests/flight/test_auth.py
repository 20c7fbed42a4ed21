"""A call refused for its token says whether none was given or the one given was not accepted,
is logged (without the token) and counted by reason."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pyarrow.flight as fl
import pytest

from tests.flight.conftest import TOKEN, StartServer

# Shares the server token's first characters: no part of a refused token may be echoed.
WRONG = TOKEN[:6] + "-Zq9-not-the-token"


def _health(client: fl.FlightClient, token: str | None, header: str | None = None) -> str:
    """The message of the Unauthenticated error a health action gets."""
    value = header if header is not None else f"Bearer {token}" if token is not None else None
    headers = [] if value is None else [(b"authorization", value.encode())]
    with pytest.raises(fl.FlightUnauthenticatedError) as info:
        list(client.do_action(fl.Action("health", b"{}"), fl.FlightCallOptions(headers=headers)))
    return str(info.value)


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_a_missing_token_and_a_wrong_one_are_told_apart_logged_and_counted(
    start_server: StartServer, tmp_path: Path
) -> None:
    loc = ((tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}")
    server = start_server(loc, "--metrics-port", "0")
    metrics_url = server.lines.get(timeout=30).split()[-1]
    flight = fl.FlightClient(server.uri)

    missing = [
        _health(flight, None),
        _health(flight, ""),
        _health(flight, None, header="Basic dXNlcjpwdw=="),
    ]
    wrong = [_health(flight, WRONG), _health(flight, TOKEN + "x"), _health(flight, TOKEN[:-1])]
    for message in missing:
        assert "no token given" in message and "not accepted" not in message, message
    for message in wrong:
        assert "token not accepted" in message and "no token given" not in message, message
    assert not any(WRONG in m or "Zq9" in m for m in wrong)

    log = server.wait_for_log("no token given", "token not accepted")
    refusals = [line for line in log.splitlines() if "Unauthenticated" in line]
    assert len(refusals) == len(missing) + len(wrong), log
    assert sum("token not accepted" in line for line in refusals) == len(wrong), refusals
    # Neither the token given nor any part of it (nor the server's) is logged.
    for secret in (WRONG, "Zq9", TOKEN, TOKEN[:-1], "dXNlcjpwdw"):
        assert secret not in log, secret

    values = _scrape(metrics_url)
    assert values['persist_flight_auth_failures_total{reason="missing"}'] == len(missing)
    assert values['persist_flight_auth_failures_total{reason="rejected"}'] == len(wrong)

    # The right token goes through, and is not counted.
    ok = list(
        flight.do_action(
            fl.Action("health", b"{}"),
            fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())]),
        )
    )
    assert len(ok) == 1
    values = _scrape(metrics_url)
    assert values['persist_flight_auth_failures_total{reason="rejected"}'] == len(wrong)
