"""Identifiers: shard ids (public) and the ids of writers, readers, batches and rollups."""

from __future__ import annotations

import re
import uuid

from persist.errors import InvalidUsage

__all__ = ["ShardId", "new_id"]

_UUID = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_SHARD_ID = re.compile(f"s{_UUID}")


class ShardId(str):
    """The id of a shard: ``s`` followed by a lowercase UUID.

    ``ShardId(text)`` validates ``text`` and raises ``InvalidUsage`` when it is not a shard id,
    so a value of this type is always safe to use in blob keys and consensus keys.
    """

    __slots__ = ()

    def __new__(cls, value: object) -> ShardId:
        if isinstance(value, ShardId):
            return value
        if not isinstance(value, str) or _SHARD_ID.fullmatch(value) is None:
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise InvalidUsage(f"not a shard id: {shown} (expected 's' followed by a UUID)")
        return super().__new__(cls, value)

    @classmethod
    def new(cls) -> ShardId:
        """A fresh, random shard id."""
        return cls(f"s{uuid.uuid4()}")

    def __repr__(self) -> str:
        return f"ShardId({str(self)!r})"


def new_id(kind: str) -> str:
    """A fresh id for a writer (``w``), reader (``r``), batch (``b``) or rollup (``v``)."""
    return f"{kind}{uuid.uuid4()}"
