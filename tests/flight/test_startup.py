"""``persist serve`` that can't start says why in one line and exits non-zero; an in-process
``FlightServer`` that can't start raises ``InvalidUsage`` and lets go of what it took."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import persist
from persist.flight import FlightServer


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another program listens on."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "persist.cli",
            "serve",
            "--blob",
            (tmp_path / "b").as_uri(),
            "--consensus",
            f"sqlite://{tmp_path / 'c.db'}",
            "--wal-dir",
            str(tmp_path / "wal"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_line_naming(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert "persist flight serving" not in done.stdout
    said = [line for line in done.stderr.splitlines() if line.startswith("persist: ")]
    assert len(said) == 1, done.stderr
    for word in words:
        assert word in said[0], done.stderr


def test_a_busy_port(tmp_path: Path, busy_port: int) -> None:
    done = _serve(tmp_path, "--port", str(busy_port))
    _one_line_naming(done, f"port {busy_port}", "in use")
    # gRPC never got to try it (and print its own lines about the failure).
    assert "add_port" not in done.stderr, done.stderr


def test_a_busy_metrics_port(tmp_path: Path, busy_port: int) -> None:
    done = _serve(tmp_path, "--port", "0", "--metrics-port", str(busy_port))
    _one_line_naming(done, f"metrics port {busy_port}", "in use")


@pytest.mark.parametrize("missing", ["cert", "key"])
def test_a_missing_tls_file(tmp_path: Path, missing: str) -> None:
    files = {"cert": tmp_path / "cert.pem", "key": tmp_path / "key.pem"}
    for kind, path in files.items():
        if kind != missing:
            path.write_text("not read: the other file is missing\n")
    done = _serve(
        tmp_path, "--port", "0", "--tls-cert", str(files["cert"]), "--tls-key", str(files["key"])
    )
    _one_line_naming(done, f"TLS {missing}", str(files[missing]), "No such file")


async def test_a_server_that_cannot_start_lets_go_of_what_it_took(
    tmp_path: Path, busy_port: int
) -> None:
    loc = ((tmp_path / "b").as_uri(), f"sqlite://{tmp_path / 'c.db'}")
    wal = tmp_path / "wal"
    failing = [
        FlightServer(*loc, port=busy_port, wal_dir=wal),
        FlightServer(*loc, port=0, metrics_port=busy_port, wal_dir=wal),
        FlightServer(*loc, tls_cert=tmp_path / "no.pem", tls_key=tmp_path / "no.key", wal_dir=wal),
    ]
    for server in failing:
        with pytest.raises(persist.InvalidUsage):
            await server.start()
    # Each released the WAL directory (a lock, one server's at a time) as it failed.
    async with FlightServer(*loc, port=0, metrics_port=0, wal_dir=wal) as server:
        assert server.uri.startswith("grpc://127.0.0.1:")
