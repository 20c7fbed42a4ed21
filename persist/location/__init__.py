"""Where persist keeps things: a Blob store for data and a Consensus log for metadata.

These two interfaces are the only way persist touches the outside world. Every implementation
translates its backend's failures into :class:`persist.ExternalError` at this boundary (with
``determinate`` telling whether the operation may have happened) and is run through the same
conformance suite (:mod:`persist.location.testing`).

- ``Blob``: a durable ``str -> bytes`` map. Keys are written once and never modified, so it
  need not be linearizable; ``set`` is atomic (a ``get`` sees the old value or the new one).
- ``Consensus``: per key, a linearizable log of ``(seqno, data)`` entries appended by
  compare-and-set on the latest seqno.

Both settle a cancelled call before its cancellation returns: once the ``CancelledError`` is
raised to the caller, the call's effect has happened or never will, so reading the location
then tells its outcome (persist settles indeterminate outcomes that way). A backend whose calls
run in threads must wait for the thread (``persist.location._settle``), not just abandon it.
"""

from __future__ import annotations

import importlib
from urllib.parse import parse_qs, urlsplit

from persist.errors import InvalidUsage, install_hint
from persist.location._redact import redact
from persist.location._tries import backoff_delays, tries_spent
from persist.location.base import Blob, Consensus, Pushed, VersionedData

__all__ = [
    "Blob",
    "Consensus",
    "Pushed",
    "VersionedData",
    "backoff_delays",
    "open_blob",
    "open_consensus",
    "redact",
    "tries_spent",
]


def _query(uri: str, allowed: frozenset[str] = frozenset()) -> dict[str, str]:
    """The URI's query parameters; ``InvalidUsage`` naming any but ``allowed`` (a typo such as
    ``?endpoint=`` must not silently go to another store)."""
    query = {k: v[-1] for k, v in parse_qs(urlsplit(uri).query, keep_blank_values=True).items()}
    unknown = sorted(set(query) - allowed)
    if unknown:
        takes = f"it takes {sorted(allowed)}" if allowed else "it takes none"
        raise InvalidUsage(f"unknown URI query parameter(s) {unknown} in {redact(uri)!r}: {takes}")
    return query


_S3_PARAMS = frozenset(
    {"endpoint_url", "region", "connect_timeout", "read_timeout", "max_attempts"}
)


def _positive(
    query: dict[str, str], name: str, kind: type[int] | type[float], default: float
) -> float:
    """A positive number from the query, ``default`` when absent; else ``InvalidUsage``."""
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if not value > 0:
        what = "a positive integer" if kind is int else "a positive number of seconds"
        raise InvalidUsage(f"URI parameter {name}={raw!r} must be {what}")
    return value


def _needs(extra: str, module: str, what: str) -> None:
    """``InvalidUsage`` naming the extra to install when ``module`` is missing."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise InvalidUsage(
            f"{what} need(s) persist's {extra!r} extra ({module} is not installed): "
            + install_hint(extra)
        ) from None


def _check_uri(what: str, uri: object) -> str:
    if not isinstance(uri, str):
        raise InvalidUsage(f"a {what} location is a URI string, not {type(uri).__name__}")
    return uri


def open_blob(uri: str) -> Blob:
    """A Blob for ``file:///abs/dir``, ``s3://bucket/prefix?endpoint_url=..&region=..`` or ``mem://name``."""
    parts = urlsplit(_check_uri("blob", uri))
    if parts.scheme == "file":
        from persist.location.file import FileBlob

        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise InvalidUsage(f"a file blob URI is file:///absolute/dir, not {redact(uri)!r}")
        _query(uri)
        return FileBlob(parts.path)
    if parts.scheme == "s3":
        _needs("s3", "boto3", "s3:// blobs")
        from persist.location import s3

        if not parts.netloc:
            raise InvalidUsage(f"an S3 blob URI is s3://bucket/prefix, not {redact(uri)!r}")
        q = _query(uri, _S3_PARAMS)
        # boto3 signs with the AWS chain's credentials: any in the URI would go unused, and
        # be quoted by botocore's errors (a bucket name, an endpoint).
        if "@" in parts.netloc or "@" in urlsplit(q.get("endpoint_url", "")).netloc:
            raise InvalidUsage(
                f"an S3 blob URI carries no credentials (S3 takes them from the AWS chain: "
                f"AWS_ACCESS_KEY_ID, profiles, roles), not {redact(uri)!r}"
            )
        return s3.S3Blob(
            bucket=parts.netloc,
            prefix=parts.path.strip("/"),
            endpoint_url=q.get("endpoint_url"),
            region=q.get("region"),
            connect_timeout_s=_positive(q, "connect_timeout", float, s3.CONNECT_TIMEOUT_S),
            read_timeout_s=_positive(q, "read_timeout", float, s3.READ_TIMEOUT_S),
            max_attempts=int(_positive(q, "max_attempts", int, s3.MAX_ATTEMPTS)),
        )
    if parts.scheme == "mem":
        from persist.location.mem import MemBlob

        _query(uri)
        return MemBlob.named(parts.netloc + parts.path)
    raise InvalidUsage(f"unknown blob URI scheme in {redact(uri)!r} (use file://, s3:// or mem://)")


def open_consensus(uri: str) -> Consensus:
    """A Consensus for ``postgresql://...``, ``sqlite:///abs/path.db`` or ``mem://name``."""
    parts = urlsplit(_check_uri("consensus", uri))
    if parts.scheme in ("postgres", "postgresql"):
        _needs("postgres", "psycopg_pool", "a PostgreSQL consensus")
        from persist.location.postgres import PostgresConsensus

        return PostgresConsensus(uri)
    if parts.scheme == "sqlite":
        from persist.location.sqlite import SqliteConsensus

        if not parts.path.startswith("/"):
            raise InvalidUsage(
                f"a SQLite consensus URI is sqlite:///absolute/path.db, not {redact(uri)!r}"
            )
        _query(uri)
        return SqliteConsensus(parts.path)
    if parts.scheme == "mem":
        from persist.location.mem import MemConsensus

        _query(uri)
        return MemConsensus.named(parts.netloc + parts.path)
    raise InvalidUsage(
        f"unknown consensus URI scheme in {redact(uri)!r} (use postgresql://, sqlite:/// or mem://)"
    )
