"""A wrong location fails at once with its cause: Postgres refused or a wrong database, a
missing bucket, an unknown URI query parameter. (How long each takes is a figure in the
notes, not asserted: the machines are shared.)"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pyarrow as pa
import pytest

import persist

SCHEMA = pa.schema([("k", pa.int64())])


async def _open(blob: str, consensus: str) -> None:
    async with await persist.connect(blob, consensus) as client:
        await client.open_writer(persist.ShardId.new(), SCHEMA)


@pytest.mark.parametrize(
    ("uri", "cause"),
    [
        ("postgresql://postgres@127.0.0.1:1/test", "Connection refused"),
        ("postgresql://postgres@127.0.0.1:5432/no_such_database", 'database "no_such_database"'),
    ],
)
async def test_a_wrong_postgres_fails_with_its_cause(
    uri: str, cause: str, postgres_uri: str
) -> None:
    with pytest.raises(persist.ExternalError, match=cause) as info:
        await _open(f"mem://{uuid.uuid4().hex}", uri)
    assert info.value.determinate  # nothing happened: safe to retry once it is fixed


async def test_a_missing_bucket_fails_naming_it(s3_endpoint: str) -> None:
    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    blob = f"s3://{bucket}/p?endpoint_url={s3_endpoint}&region=us-east-1"
    with pytest.raises(persist.ExternalError, match=f"NoSuchBucket|{bucket}"):
        await _open(blob, f"mem://{uuid.uuid4().hex}")


@pytest.mark.parametrize(
    ("blob", "consensus", "name"),
    [
        ("s3://b/p?endpoint=http://127.0.0.1:9", "mem://x", "endpoint"),
        ("s3://b/p?endpoint_url=http://127.0.0.1:9&regoin=eu", "mem://x", "regoin"),
        ("file:///tmp/x?mode=ro", "mem://x", "mode"),
        ("mem://x", "sqlite:///tmp/c.db?timeout=5", "timeout"),
        ("mem://x?shared=1", "mem://x", "shared"),
    ],
)
async def test_an_unknown_uri_parameter_is_refused(blob: str, consensus: str, name: str) -> None:
    with pytest.raises(persist.InvalidUsage, match=f"unknown URI query parameter.*'{name}'"):
        await _open(blob, consensus)


def test_s3_timeouts_are_uri_settings() -> None:
    from persist.location import open_blob
    from persist.location.s3 import S3Blob

    blob = open_blob(
        "s3://b/p?endpoint_url=http://127.0.0.1:9&connect_timeout=1.5&read_timeout=7&max_attempts=2"
    )
    assert isinstance(blob, S3Blob)
    config = blob._get_client().meta.config
    assert (config.connect_timeout, config.read_timeout) == (1.5, 7.0)
    # The blob makes the tries: boto3 one per try (it would retry each of them otherwise).
    assert (blob._max_attempts, config.retries["total_max_attempts"]) == (2, 1)
    default = open_blob("s3://b/p")
    assert isinstance(default, S3Blob)
    config = default._get_client().meta.config
    assert (config.connect_timeout, config.read_timeout) == (5.0, 20.0)
    assert (default._max_attempts, config.retries["total_max_attempts"]) == (3, 1)
    for bad in ("connect_timeout=0", "read_timeout=-1", "max_attempts=1.5", "max_attempts=x"):
        with pytest.raises(persist.InvalidUsage, match=bad.split("=")[0]):
            open_blob(f"s3://b/p?{bad}")


async def test_an_s3_endpoint_that_refuses_fails_with_its_cause() -> None:
    blob = "s3://b/p?endpoint_url=http://127.0.0.1:1&connect_timeout=1&max_attempts=1"
    with pytest.raises(persist.ExternalError, match=r"127\.0\.0\.1:1\b"):
        await _open(blob, f"mem://{uuid.uuid4().hex}")


def test_dataset_reads_reach_the_store_boto3_reaches(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow's S3 filesystem ignores AWS_ENDPOINT_URL; boto3 takes it. Both must go to one
    store, with the URI's timeouts."""
    from persist.location import open_blob

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9123")
    where = open_blob("s3://b/p?read_timeout=9").arrow_location()
    assert where is not None
    options = where[0].__reduce__()[1][0]
    assert (options["endpoint_override"], options["scheme"]) == ("127.0.0.1:9123", "http")
    assert (options["connect_timeout"], options["request_timeout"]) == (5.0, 9.0)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    where = open_blob("s3://b/p").arrow_location()  # AWS itself: pyarrow's own default
    assert where is not None and not where[0].__reduce__()[1][0]["endpoint_override"]


class _BlackHole:
    """A TCP listener on 127.0.0.1 that accepts every connection, reads what is sent and never
    answers: an S3 endpoint that stalls."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._peers: list[int] = []
        self._conns: list[socket.socket] = []
        self._requests = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._peers.append(peer[1])
                self._conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        seen = b""
        counted = False
        while True:
            try:
                chunk = conn.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            seen = (seen + chunk)[-4:] if counted else seen + chunk
            if not counted and b"\r\n\r\n" in seen:
                counted = True
                with self._lock:
                    self._requests += 1

    def connections(self) -> int:
        """Connections made so far: connects a sentinel and counts those accepted before it
        (the listener accepts in arrival order)."""
        with socket.create_connection(("127.0.0.1", self.port)) as sentinel:
            mine = sentinel.getsockname()[1]
            deadline = time.monotonic() + 30
            while True:
                with self._lock:
                    if mine in self._peers:
                        return self._peers.index(mine)
                assert time.monotonic() < deadline, "the listener never accepted the sentinel"
                time.sleep(0.01)

    def requests(self, at_least: int) -> int:
        """Requests whose headers arrived, once there are ``at_least`` (or after 30 s)."""
        deadline = time.monotonic() + 30
        while True:
            with self._lock:
                if self._requests >= at_least or time.monotonic() > deadline:
                    return self._requests
            time.sleep(0.01)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                conn.close()


@pytest.fixture
def black_hole(monkeypatch: pytest.MonkeyPatch) -> Iterator[_BlackHole]:
    # Dummy credentials, so that boto3 and pyarrow get as far as the network.
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    hole = _BlackHole()
    yield hole
    hole.close()


def _stalled_uri(hole: _BlackHole, attempts: int) -> str:
    return (
        f"s3://b/p?endpoint_url=http://127.0.0.1:{hole.port}&connect_timeout=1&read_timeout=1"
        f"&max_attempts={attempts}"
    )


def _documented_bound_s(attempts: int, connect_s: float, read_s: float, *, write: bool) -> float:
    """docs/api.md (S3 credentials): a stalled S3 call ends within max_attempts x
    (connect_timeout + read_timeout, + 1 s for a write), plus the waits between tries (0.2 s
    doubling, at most 2 s each)."""
    waits = [min(2.0, 0.2 * 2**i) for i in range(attempts - 1)]
    return attempts * (connect_s + read_s + (1.0 if write else 0.0)) + sum(waits)


@pytest.mark.parametrize("attempts", [1, 2])
async def test_a_stalled_s3_endpoint_gets_max_attempts_tries_in_all(
    black_hole: _BlackHole, attempts: int
) -> None:
    """Opening a writer writes the shard's first rollup: with a stalled endpoint it fails after
    ``max_attempts`` requests in all (persist's own retries don't multiply boto3's), within
    the documented bound."""
    from persist.location.s3 import S3Blob

    uri = _stalled_uri(black_hole, attempts)
    async with await persist.connect(uri, f"mem://{uuid.uuid4().hex}") as client:
        assert isinstance(client.blob, S3Blob)
        # boto3's client is built once per blob (reading botocore's data files): not a try.
        await asyncio.to_thread(client.blob._get_client)
        started = time.monotonic()
        with pytest.raises(persist.ExternalError):
            await client.open_writer(persist.ShardId.new(), SCHEMA)
        took = time.monotonic() - started
    assert black_hole.connections() == attempts
    assert black_hole.requests(attempts) == attempts
    assert took < _documented_bound_s(attempts, 1.0, 1.0, write=True)


async def test_a_stalled_s3_read_gets_max_attempts_tries_in_all(black_hole: _BlackHole) -> None:
    """Opening a shard that exists reads its rollup (through persist's retry loop)."""
    from persist.location.s3 import S3Blob

    consensus = f"mem://{uuid.uuid4().hex}"
    shard = persist.ShardId.new()
    async with await persist.connect(f"mem://{uuid.uuid4().hex}", consensus) as client:
        await client.open_writer(shard, SCHEMA)
    async with await persist.connect(_stalled_uri(black_hole, 2), consensus) as client:
        assert isinstance(client.blob, S3Blob)
        await asyncio.to_thread(client.blob._get_client)
        started = time.monotonic()
        with pytest.raises(persist.ExternalError) as info:
            await client.open_writer(shard, SCHEMA)
        took = time.monotonic() - started
    assert info.value.determinate
    assert black_hole.connections() == 2
    assert black_hole.requests(2) == 2
    assert took < _documented_bound_s(2, 1.0, 1.0, write=False)


@pytest.mark.parametrize("attempts", [1, 3])
def test_dataset_reads_of_a_stalled_s3_get_max_attempts_tries(
    black_hole: _BlackHole, attempts: int
) -> None:
    """pyarrow's S3 filesystem (``read.dataset``) gets the same number of tries."""
    from persist.location import open_blob

    where = open_blob(_stalled_uri(black_hole, attempts)).arrow_location()
    assert where is not None
    fs, path = where
    with pytest.raises(OSError):
        fs.open_input_file(path("k"))
    assert black_hole.connections() == attempts
