"""A Blob in an S3 bucket (or anything speaking the S3 API), via boto3 in worker threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import boto3
import pyarrow.fs as pafs
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from persist.errors import ExternalError
from persist.location._keys import prefix_can_match, validate_key
from persist.location._settle import run_in_thread
from persist.location._tries import backoff_delays, mark_tries_spent
from persist.location.base import Blob

__all__ = ["S3Blob"]

_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_BACKEND_ERRORS = (BotoCoreError, ClientError, OSError)
# Worth another try: the network (connecting, a timeout, a reply cut short) and the server
# saying it is busy or broken for now. Not a refusal (access denied, no such bucket).
_TRANSIENT_ERRORS = (BotoConnectionError, HTTPClientError, IncompleteReadError, OSError)
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError"}
)
_T = TypeVar("_T")

# A cancelled call waits for its thread, and botocore's call can't be interrupted, so these
# bound that wait (botocore's defaults are 60 s each). The read timeout is per socket
# operation (sending the body included), not per request. The URI may set each.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 20.0
MAX_ATTEMPTS = 3
# The waits between tries (``backoff_delays``): from BACKOFF_INITIAL_S, doubling, at most
# BACKOFF_CAP_S each.
BACKOFF_INITIAL_S = 0.2
BACKOFF_CAP_S = 2.0


def backoff_s(attempts: int) -> list[float]:
    """The waits between ``attempts`` tries of one call (one fewer than the tries)."""
    return backoff_delays(BACKOFF_INITIAL_S, attempts, BACKOFF_CAP_S)


class S3Blob(Blob):
    """A Blob storing key ``k`` as object ``prefix/k`` of ``bucket``.

    boto3 is blocking, so every call runs in a worker thread on one shared client (boto3
    clients are thread-safe; sessions are not, hence a private session).

    A cancelled call returns its cancellation only once its thread is done. A request that
    makes no progress fails after ``connect_timeout_s`` (5 s) connecting or ``read_timeout_s``
    (20 s) on one socket read or write. A call is tried ``max_attempts`` (3) times in all:
    this blob makes the tries (boto3 makes one per try, and persist's own retry loop adds
    none), again after a network failure or a busy or failing server (5xx, throttling), not
    after a refusal. Between tries it waits :func:`backoff_s`. So a stalled call ends within
    ``max_attempts x (connect_timeout_s + read_timeout_s) + sum(backoff_s(max_attempts))``
    of its start, a PUT within 1 s a try more (boto3 waits that long for the server's
    ``100 Continue`` before it sends the body): by default 3 x 25 s + 0.6 s, 3 x 26 s + 0.6 s
    for a PUT. (A PUT whose reply was lost may still be completed by the server later; S3
    gives a client no way to know.)
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self._bucket = bucket
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_attempts = max_attempts
        self._prefix = prefix.strip("/")
        self._endpoint_url = endpoint_url
        self._region = region or "us-east-1"
        self._client: Any = None
        self._client_lock = threading.Lock()

    def _object_key(self, key: str) -> str:
        validate_key(key)
        return f"{self._prefix}/{key}" if self._prefix else key

    def _get_client(self) -> Any:
        # Built lazily in a worker thread: creating a client reads botocore's data files.
        with self._client_lock:
            if self._client is None:
                session = boto3.session.Session()
                self._client = session.client(
                    "s3",
                    endpoint_url=self._endpoint_url,
                    region_name=self._region,
                    config=Config(
                        # The tries are this blob's (``_tried``): they cover reading a
                        # reply's body too, which boto3 never retries.
                        retries={"total_max_attempts": 1, "mode": "standard"},
                        max_pool_connections=32,
                        connect_timeout=self._connect_timeout_s,
                        read_timeout=self._read_timeout_s,
                    ),
                )
            return self._client

    async def _tried(self, call: Callable[[], _T]) -> _T:
        """``call()`` in a worker thread, tried up to ``max_attempts`` times in all; its
        failure is marked so that persist's retry loop does not try it again."""
        for delay in backoff_s(self._max_attempts):
            try:
                return await run_in_thread(call)
            except ExternalError as exc:
                if not _transient(exc.__cause__):
                    mark_tries_spent(exc)
                    raise
            await asyncio.sleep(delay)
        try:
            return await run_in_thread(call)
        except ExternalError as exc:
            mark_tries_spent(exc)
            raise

    async def get(self, key: str) -> bytes | None:
        object_key = self._object_key(key)
        return await self._tried(lambda: self._get(object_key))

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        object_key = self._object_key(key)
        if end <= start:
            return b"" if await self.get_range(key, 0, 1) is not None else None
        return await self._tried(lambda: self._get(object_key, f"bytes={start}-{end - 1}"))

    def _get(self, object_key: str, byte_range: str | None = None) -> bytes | None:
        extra = {} if byte_range is None else {"Range": byte_range}
        try:
            response = self._get_client().get_object(Bucket=self._bucket, Key=object_key, **extra)
            body: bytes = response["Body"].read()
        except ClientError as exc:
            if _error_code(exc) in _MISSING_CODES:
                return None
            if _error_code(exc) == "InvalidRange":  # wholly past the end of the object
                return b""
            raise ExternalError(
                f"s3 get s3://{self._bucket}/{object_key}: {exc}", determinate=True
            ) from exc
        except _BACKEND_ERRORS as exc:
            raise ExternalError(
                f"s3 get s3://{self._bucket}/{object_key}: {exc}", determinate=True
            ) from exc
        return body

    async def set(self, key: str, value: bytes) -> None:
        object_key, data = self._object_key(key), bytes(value)
        await self._tried(lambda: self._set(object_key, data))

    def _set(self, object_key: str, value: bytes) -> None:
        try:
            self._get_client().put_object(Bucket=self._bucket, Key=object_key, Body=value)
        except _BACKEND_ERRORS as exc:
            raise ExternalError(
                f"s3 put s3://{self._bucket}/{object_key}: {exc}", determinate=False
            ) from exc

    def arrow_location(self) -> tuple[pafs.FileSystem, Callable[[str], str]]:
        # Credentials come from the same places boto3 takes them (the AWS environment
        # variables, the shared config files, an instance role).
        options: dict[str, Any] = {
            "region": self._region,
            "connect_timeout": self._connect_timeout_s,
            "request_timeout": self._read_timeout_s,
            "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=self._max_attempts),
        }
        endpoint = self._endpoint_url
        if endpoint is None:
            # boto3 may have found one where pyarrow doesn't look (AWS_ENDPOINT_URL, a
            # profile's endpoint_url): both must reach the same store.
            resolved = self._get_client().meta.endpoint_url
            if not (urlsplit(resolved).hostname or "").endswith(".amazonaws.com"):
                endpoint = resolved
        if endpoint:
            parts = urlsplit(endpoint)
            options["endpoint_override"] = parts.netloc
            options["scheme"] = parts.scheme or "https"
        fs = pafs.S3FileSystem(**options)
        return fs, lambda key: f"{self._bucket}/{self._object_key(key)}"

    def uri(self, key: str) -> str:
        """``s3://bucket/prefix/key`` (percent-encoded; Hadoop's S3A connector names the same
        object ``s3a://...``). An engine needs its own credentials and, for a store other
        than AWS, this blob's endpoint: the URI does not carry them."""
        return f"s3://{self._bucket}/{quote(self._object_key(key), safe='/')}"

    async def delete(self, key: str) -> None:
        object_key = self._object_key(key)
        await self._tried(lambda: self._delete(object_key))

    def _delete(self, object_key: str) -> None:
        try:
            # S3 answers 204 for a missing key too, so this is idempotent.
            self._get_client().delete_object(Bucket=self._bucket, Key=object_key)
        except _BACKEND_ERRORS as exc:
            raise ExternalError(
                f"s3 delete s3://{self._bucket}/{object_key}: {exc}", determinate=False
            ) from exc

    async def list_keys(self, prefix: str) -> list[str]:
        if not prefix_can_match(prefix):
            return []
        return await self._tried(lambda: self._list(prefix))

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        if not prefix_can_match(prefix):
            return {}
        return await self._tried(lambda: self._sizes(prefix))

    def _sizes(self, prefix: str) -> dict[str, int]:
        base = f"{self._prefix}/" if self._prefix else ""
        sizes: dict[str, int] = {}
        try:
            paginator = self._get_client().get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self._bucket, Prefix=base + prefix):
                for obj in page.get("Contents", ()):
                    sizes[obj["Key"][len(base) :]] = int(obj["Size"])
        except _BACKEND_ERRORS as exc:
            raise ExternalError(
                f"s3 list s3://{self._bucket}/{base}{prefix}: {exc}", determinate=True
            ) from exc
        return dict(sorted(sizes.items()))

    def _list(self, prefix: str) -> list[str]:
        base = f"{self._prefix}/" if self._prefix else ""
        keys: list[str] = []
        try:
            paginator = self._get_client().get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self._bucket, Prefix=base + prefix):
                keys.extend(obj["Key"][len(base) :] for obj in page.get("Contents", ()))
        except _BACKEND_ERRORS as exc:
            raise ExternalError(
                f"s3 list s3://{self._bucket}/{base}{prefix}: {exc}", determinate=True
            ) from exc
        keys.sort()
        return keys

    async def close(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            await run_in_thread(client.close)


def _transient(exc: BaseException | None) -> bool:
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or status == 429 or _error_code(exc) in _TRANSIENT_CODES
    return isinstance(exc, _TRANSIENT_ERRORS)


def _error_code(exc: ClientError) -> str:
    code: object = exc.response.get("Error", {}).get("Code", "")
    return str(code)
