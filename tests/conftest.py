from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

# --- location services (persist.location tests) -------------------------------------------
# Backing services are real (a Postgres server, a moto S3 server process). When one is missing
# the tests FAIL rather than skip: CI must not go green without exercising them.

DEFAULT_POSTGRES_URI = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def postgres_uri() -> str:
    """The Postgres database for consensus tests (``PERSIST_TEST_POSTGRES_URI``)."""
    import psycopg

    uri = os.environ.get("PERSIST_TEST_POSTGRES_URI", DEFAULT_POSTGRES_URI)
    try:
        with psycopg.connect(uri, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        pytest.fail(
            f"Postgres is unreachable at {uri!r} ({exc}). Start it or point "
            "PERSIST_TEST_POSTGRES_URI at one; these tests never skip.",
            pytrace=False,
        )
    return uri


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


_AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Keep a developer's ~/.aws config out of the tests.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a real moto S3 server in a subprocess, with dummy AWS credentials in the env."""
    saved = {k: os.environ.get(k) for k in _AWS_TEST_ENV}
    os.environ.update(_AWS_TEST_ENV)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    output = log.read().decode(errors="replace")[-2000:]
                    pytest.fail(f"the moto S3 server did not come up at {url}:\n{output}")
                try:
                    with urllib.request.urlopen(url + "/moto-api/", timeout=1):
                        break
                except (urllib.error.URLError, OSError):
                    time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# --- end of location services ---------------------------------------------------------------
