"""persist: durable, definite time-varying collections of Arrow data.

A shard is a collection of updates ``(row, time, diff)`` kept in a blob store, with every change
to its metadata linearized through compare-and-set consensus. See ``docs/design.md``.

    import persist
    async with await persist.connect() as client:
        write, read = await client.open(persist.ShardId.new(), schema)
        await write.compare_and_append(updates, 0, 1)
        table = await read.snapshot_and_fetch(0)
"""

from __future__ import annotations

import msgspec as _msgspec

from persist.client import PersistClient, connect
from persist.config import PersistConfig
from persist.errors import (
    ExternalError,
    IntegrityError,
    InvalidUsage,
    LeaseExpired,
    PersistError,
    SchemaChanged,
    UpperMismatch,
)
from persist.ids import ShardId
from persist.internal.batch import Batch
from persist.internal.fetch import Split
from persist.metrics import enable_metrics
from persist.plain import read_table
from persist.read import ListenEvent, ReadHandle
from persist.write import WriteHandle

__all__ = [
    "Batch",
    "ExternalError",
    "IntegrityError",
    "InvalidUsage",
    "LeaseExpired",
    "ListenEvent",
    "PersistClient",
    "PersistConfig",
    "PersistError",
    "ReadHandle",
    "SchemaChanged",
    "ShardId",
    "Split",
    "UpperMismatch",
    "WriteHandle",
    "connect",
    "enable_metrics",
    "read_table",
]

# Public names read as persist.X in reprs and tracebacks. msgspec Structs keep their module:
# msgspec resolves their annotations through it.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) and not issubclass(_obj, _msgspec.Struct):
        _obj.__module__ = "persist"
del _name, _obj, _msgspec

__version__ = "0.1.0"
