"""Plain reads for scripts, notebooks and other engines: ``persist.read_table``, no asyncio.

The call runs on the process's persist loop thread (``bridge.LoopThread``), so it works the same
from a plain script, a thread, or a notebook whose own event loop is running (it blocks that
caller until the read is done, as any synchronous read does).
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator

import pyarrow as pa

from persist.bridge import LoopThread
from persist.client import PersistClient, connect
from persist.config import PersistConfig
from persist.core.arrow.updates import as_rows
from persist.errors import InvalidUsage
from persist.internal.fetch import Split
from persist.location import Blob, Consensus

__all__ = ["read_table", "split_rows"]


def read_table(
    shard: str,
    *,
    blob: str | Blob | None = None,
    consensus: str | Consensus | None = None,
    as_of: int | datetime.datetime | None = None,
    config: PersistConfig | None = None,
) -> pa.Table:
    """The contents of ``shard`` (an id or a name) as one ``pyarrow.Table`` of its data columns,
    each row repeated by its multiplicity. Synchronous: no event loop needed.

    ``as_of``: a time, an instant (a ``datetime``: the newest time readable then, within the
    shard's retention), or None for the newest readable time (upper - 1; a shard with nothing
    written reads empty; a sealed one needs ``as_of``). A time not yet readable raises
    ``InvalidUsage`` at once (it never waits); so does a row with a negative multiplicity.
    ``blob``/``consensus`` as ``persist.connect`` takes them (default: the environment, else
    ``./persist-data/``)."""
    if as_of is not None and (
        isinstance(as_of, bool) or not isinstance(as_of, int | datetime.datetime)
    ):
        raise InvalidUsage(f"as_of must be a time, a datetime or None, not {as_of!r}")
    return LoopThread.for_process().run(_read(shard, blob, consensus, as_of, config))


async def _read(
    shard: str,
    blob: str | Blob | None,
    consensus: str | Consensus | None,
    as_of: int | datetime.datetime | None,
    config: PersistConfig | None,
) -> pa.Table:
    async with await connect(blob, consensus, config=config) as client:
        return await contents(client, shard, as_of)


async def split_rows(
    client: PersistClient, split: Split, max_bytes: int = 64 << 20
) -> AsyncIterator[pa.Table]:
    """A snapshot split's contents, piece by piece (about ``max_bytes`` of parts each): the
    data columns, each row repeated by its multiplicity (``InvalidUsage`` for a negative one).
    Contents are a multiset of rows, so pieces without retractions are not merged."""
    async for batch in client.fetch_split_batches(split, max_bytes, consolidate=False):
        yield as_rows(pa.Table.from_batches([batch]))


async def contents(
    client: PersistClient, shard: str, as_of: int | datetime.datetime | None
) -> pa.Table:
    """The rows of ``shard`` as of ``as_of`` (see ``read_table``), through ``client``."""
    if isinstance(as_of, datetime.datetime):
        as_of = await client.as_of_at(shard, as_of)
    plan = await client.plan_snapshot(
        shard, as_of=as_of, wait=False, empty_if_unwritten=True, purpose="read_table"
    )
    if plan.reader is None:
        return plan.schema.empty_table()
    try:
        tables = [t for split in plan.splits async for t in split_rows(client, split)]
        if not tables:
            return plan.schema.empty_table()
        return pa.concat_tables(tables).cast(plan.schema)
    finally:
        await plan.reader.expire()
