"""Blob key validation, shared by every Blob implementation."""

from __future__ import annotations

import re

from persist.errors import InvalidUsage

__all__ = ["TEMP_PREFIX", "prefix_can_match", "validate_key"]

# FileBlob names its in-flight temp files with this; no valid key segment may start with it, so
# a temp file can neither be listed nor collide with a key.
TEMP_PREFIX = ".tmp-"


_PRINTABLE_ASCII = re.compile("[ -~]*")


def _printable_ascii(s: str) -> bool:
    return _PRINTABLE_ASCII.fullmatch(s) is not None


def _bad_segment(segment: str) -> bool:
    return segment in ("", ".", "..") or segment.startswith(TEMP_PREFIX)


def validate_key(key: str) -> None:
    """Raises ``InvalidUsage`` unless ``key`` is a relative ``/``-separated printable-ASCII path.

    Rejected: the empty key, absolute keys, empty / ``.`` / ``..`` segments, backslashes, NUL and
    other control or non-ASCII characters, and segments starting with ``.tmp-``.
    """
    if not isinstance(key, str):
        raise InvalidUsage(f"a blob key is a str, not {type(key).__name__}")
    if not key:
        raise InvalidUsage("a blob key must not be empty")
    if not _printable_ascii(key):
        raise InvalidUsage(f"a blob key is printable ASCII only: {key!r}")
    if "\\" in key:
        raise InvalidUsage(f"a blob key must not contain a backslash: {key!r}")
    if key.startswith("/"):
        raise InvalidUsage(f"a blob key must be relative: {key!r}")
    if any(_bad_segment(s) for s in key.split("/")):
        raise InvalidUsage(
            f"a blob key's segments must be non-empty, not '.' or '..', "
            f"and not start with {TEMP_PREFIX!r}: {key!r}"
        )


def prefix_can_match(prefix: str) -> bool:
    """Whether some valid key starts with ``prefix`` (an impossible prefix just lists nothing).

    Every segment but the last must be a whole valid segment; the last may be any partial one.
    """
    if not isinstance(prefix, str):
        raise InvalidUsage(f"a blob key prefix is a str, not {type(prefix).__name__}")
    if not prefix:
        return True
    if not _printable_ascii(prefix) or "\\" in prefix or prefix.startswith("/"):
        return False
    *dirs, last = prefix.split("/")
    return not any(_bad_segment(s) for s in dirs) and not last.startswith(TEMP_PREFIX)
