"""A location's credentials never show in anything persist says: CLI output and errors,
exceptions (with their causes), log lines, reprs, a server's logs, health and metrics."""

from __future__ import annotations

import asyncio
import logging
import socket
import traceback
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import persist
from persist import cli

from .flight.conftest import TOKEN, Server

SECRET = "Zq7hunter2Xv"


def _with_password(uri: str, password: str = SECRET) -> str:
    parts = urlsplit(uri)
    netloc = f"{parts.username}:{password}@{parts.hostname}:{parts.port}"
    return parts._replace(netloc=netloc).geturl()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _told(exc: BaseException) -> str:
    """Everything a traceback of ``exc`` would show: its message and every cause's."""
    return "".join(traceback.format_exception(exc))


def _mistyped(postgres_uri: str, tmp_path: Path) -> list[tuple[str, str]]:
    """(blob, consensus) pairs that fail, each with the secret somewhere in one of them."""
    blob = (tmp_path / "blob").as_uri()
    pg = _with_password(postgres_uri)
    refused = _with_password(f"postgresql://postgres@127.0.0.1:{_closed_port()}/test")
    return [
        (blob, pg.replace("postgresql:", "postgresq:")),  # an unknown scheme
        (blob, pg + "?sslmod=disable"),  # libpq refuses the parameter
        (blob, _with_password(postgres_uri, SECRET + "%zz")),  # libpq quotes the bad escape
        (blob, refused),
        (blob, f"{postgres_uri}?password={SECRET}&sslmode=bogus"),
        (blob, f"{postgres_uri}?sslpassword={SECRET}&port=notaport"),
        (f"file://u:{SECRET}@somehost/abs", pg),
        (f"s3://bucket/p?region=x&aws_secret_access_key={SECRET}", pg),
        # S3 takes no credentials in its URI: they would be ignored, and quoted in errors.
        (f"s3://AKIA:{SECRET}@bucket/p", pg),
        (f"s3://bucket/p?endpoint_url=http://u:{SECRET}@127.0.0.1:1", pg),
        (f"gs://u:{SECRET}@bucket/p", pg),
        (blob, f"sqlite:relative.db?token={SECRET}"),
    ]


def test_no_secret_in_cli_output_errors_or_logs(
    postgres_uri: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    for blob, consensus in _mistyped(postgres_uri, tmp_path):
        code = cli.main(["list", "--blob", blob, "--consensus", consensus])
        out, err = capsys.readouterr()
        assert code == 1 and err.startswith("persist: "), (blob, consensus, out, err)
        seen += [out, err]
    # A good location with a password (the test server trusts any) and one with a secret in
    # its query: the demo shows both locations, without their secrets.
    blob = (tmp_path / "demo-blob").as_uri()
    for consensus in (_with_password(postgres_uri), f"{postgres_uri}?password={SECRET}"):
        assert cli.main(["demo", "--blob", blob, "--consensus", consensus]) == 0
        out, err = capsys.readouterr()
        assert "  consensus: postgresql://postgres" in out and "***" in out, out
        seen += [out, err]
    seen.append(caplog.text)
    for said in seen:
        assert SECRET not in said, said


def test_no_secret_in_exceptions_reprs_or_logs(
    postgres_uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)

    async def use(blob: str, consensus: str) -> None:
        async with await persist.connect(blob, consensus) as client:
            await client.consensus.head("secrets-test")

    seen: list[str] = []
    for blob, consensus in _mistyped(postgres_uri, tmp_path):
        with pytest.raises(persist.PersistError) as info:
            asyncio.run(use(blob, consensus))
        seen.append(_told(info.value))

    async def reprs() -> list[str]:
        blob, consensus = (tmp_path / "blob").as_uri(), _with_password(postgres_uri)
        async with await persist.connect(blob, consensus) as client:
            await client.consensus.head("secrets-test")  # the password is used, not just carried
            shown = [repr(client), repr(client.blob), repr(client.consensus)]
            assert "PostgresConsensus('postgresql://postgres:***@" in shown[2], shown
            return shown

    seen += asyncio.run(reprs())
    from persist.spark._options import parse_options

    options = parse_options(
        {
            "name": "a.b",
            "blob": (tmp_path / "blob").as_uri(),
            "consensus": _with_password(postgres_uri),
        }
    )
    seen.append(repr(options))
    seen.append(caplog.text)
    for said in seen:
        assert SECRET not in said, said


@pytest.mark.parametrize("usable", [True, False], ids=["ok", "bad-password-escape"])
def test_no_secret_in_what_a_server_says(postgres_uri: str, tmp_path: Path, usable: bool) -> None:
    # A consensus it can't use still lets the server start: health then tells why, in
    # libpq's words, which quote a password it could not parse.
    password = SECRET if usable else SECRET + "%zz"
    metrics_port = _closed_port()
    server = Server(
        [
            "--blob",
            (tmp_path / "blob").as_uri(),
            "--consensus",
            _with_password(postgres_uri, password),
            "--port",
            "0",
            "--metrics-port",
            str(metrics_port),
            "--wal-dir",
            str(tmp_path / "wal"),
            "--token",
            TOKEN,
        ]
    )
    try:
        health = server.client().action("health")
        assert health["status"] == ("ok" if usable else "unavailable"), health
        if not usable:
            assert "percent-encoded" in health["consensus"], health
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert "persist_flight_open_calls" in metrics
    finally:
        code = server.terminate()
    stderr = server.wait_for_log("draining")
    stdout = "".join(server.lines.get() for _ in range(server.lines.qsize()))
    assert code == 0
    for said in (str(health), metrics, stdout, stderr):
        assert SECRET not in said, said
