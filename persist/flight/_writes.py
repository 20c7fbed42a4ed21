"""Writes over Flight: DoPut's ``compare_and_append``, and the server's writers.

The server writes each shard through writers of its own ("persist flight"), one per version of
the shard's schema it writes, each opened by the first DoPut or streaming write that needs it
and kept (heartbeated) until the drain; DoPuts and the shard's streaming writes (``_stream``)
share them. A DoPut is written by the writer of the version whose columns its stream has (the
newest such, as ``open_writer`` chooses); streamed writes of every version go through one
writer, at the newest version any of them has (``_commits``). The server's commits into one
shard (a DoPut, a streamed group) take turns: they never race each other, while any other
writer may write the shard at any time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from persist.client import PersistClient
from persist.core.arrow.updates import DIFF, TIME
from persist.core.stream.durability import TIER_NAMES
from persist.errors import InvalidUsage, LeaseExpired, PersistError
from persist.flight._metrics import Metrics
from persist.flight._protocol import ExchangeCommand, PutCommand, check_levels, writer_id_of
from persist.flight._stream import CallInfo, Spawn, Streams, version_for
from persist.flight._wal import Wal
from persist.write import WriteHandle

__all__ = ["Writes"]


class Writes:
    """The server's writers and streaming writes, on its event loop."""

    def __init__(
        self,
        client: PersistClient,
        metrics: Metrics,
        spawn: Spawn,
        *,
        wal_dir: Path,
        server: str,
        commit_interval_ms: float,
        commit_bytes: int,
        max_buffer_bytes: int,
    ) -> None:
        self._client = client
        self._metrics = metrics
        # Per shard, the server's writers by schema version.
        self._writers: dict[str, dict[int, WriteHandle]] = {}
        self._writer_locks: dict[str, asyncio.Lock] = {}
        self._turns: dict[str, asyncio.Lock] = {}
        self._wal_dir = wal_dir
        self.streams = Streams(
            client,
            metrics,
            self.writer,
            self.turn,
            spawn,
            wal_dir,
            server,
            commit_interval_ms=commit_interval_ms,
            commit_bytes=commit_bytes,
            max_buffer_bytes=max_buffer_bytes,
        )

    async def writer(
        self, shard: str, schema: pa.Schema | None, lapsed: WriteHandle | None = None
    ) -> WriteHandle:
        """The server's writer of ``shard`` at the version of its schema whose columns
        ``schema`` are (None: the current version; a shard that does not exist is created with
        ``schema``); a new one in place of ``lapsed`` (whose lease ran out, at its version) if
        that is still the one kept."""
        if lapsed is not None:
            version: int | None = lapsed.schema_version
            wanted = lapsed.schema
        else:
            version, wanted = await self.version(shard, schema), schema
        kept = self._writers.get(shard, {})
        writer = kept.get(version) if version is not None else None
        if writer is not None and writer is not lapsed:
            return writer
        async with self._writer_locks.setdefault(shard, asyncio.Lock()):
            kept = self._writers.get(shard, {})
            writer = kept.get(version) if version is not None else None
            if writer is not None and writer is not lapsed:
                return writer
            writer = await self._client.open_writer(shard, wanted, purpose="persist flight")
            kept = self._writers.setdefault(shard, {})
            if lapsed is not None and kept.get(lapsed.schema_version) is lapsed:
                del kept[lapsed.schema_version]
            other = kept.get(writer.schema_version)
            if other is not None and other is not lapsed:
                # The version was learned only now (the shard was new, or evolved meanwhile):
                # one writer per version is kept.
                with contextlib.suppress(PersistError):
                    await writer.expire()
                return other
            kept[writer.schema_version] = writer
        return writer

    async def version(self, shard: str, schema: pa.Schema | None) -> int | None:
        """The version of ``shard``'s schema data of ``schema`` is written in (None: the
        current one), as its latest state says: the newest version whose schema it is, else
        the newest that takes its columns (``version_for``). None when the shard does not
        exist, or no version takes them (opening a writer then says why)."""
        try:
            known = await self._client.schemas(shard)
        except InvalidUsage:
            return None  # no such shard (yet): opening a writer creates it, or says why not
        if schema is None:
            return known[-1][0]
        return version_for(known, schema)

    @contextlib.asynccontextmanager
    async def turn(self, shard: str) -> AsyncIterator[None]:
        """The server's turn to commit into ``shard``: its DoPuts and streamed groups never
        race each other (a group that lost to the server's own DoPut would write its part
        again for nothing)."""
        async with self._turns.setdefault(shard, asyncio.Lock()):
            yield

    # --- DoPut ---------------------------------------------------------------------------------

    async def put(self, command: PutCommand, table: pa.Table) -> int | None:
        """One ``compare_and_append`` of every row of a DoPut, under the server's writer of the
        shard at the version of its schema whose columns the stream has, the current one or an
        earlier one (a new shard is created with the stream's columns)."""
        names = table.schema.names
        if TIME not in names:
            raise InvalidUsage(
                f"a DoPut stream needs the shard's columns, {TIME!r} (uint64) and optionally "
                f"{DIFF!r} (int64); it has {names}"
            )
        data = pa.schema([f for f in table.schema if f.name not in (TIME, DIFF)])
        # Everything the server keeps per shard is keyed by id: a name is resolved once.
        command = dataclasses.replace(command, shard=await self.resolve(command.shard, data))
        shard = self._metrics.shard(command.shard)
        self._metrics.writes.labels("do_put", shard).inc()
        self._metrics.write_bytes.labels("do_put", shard).inc(table.nbytes)
        async with self.turn(command.shard):
            return await self._put(command, table, data)

    async def _put(self, command: PutCommand, table: pa.Table, data: pa.Schema) -> int | None:
        lapsed: WriteHandle | None = None
        for attempt in (1, 2):
            writer = await self.writer(command.shard, data, lapsed)
            try:
                with self._metrics.commit(command.shard):
                    await writer.compare_and_append(
                        table, command.expected_upper, command.new_upper
                    )
            except LeaseExpired:
                # The writer lapsed (the server stalled past its lease): nothing was written.
                lapsed = writer
                if attempt == 2:
                    raise
                continue
            break
        return command.new_upper

    # --- streaming writes ----------------------------------------------------------------------

    async def open_exchange(
        self, command: ExchangeCommand, schema: pa.Schema | None, stream: pa.Schema | None
    ) -> CallInfo:
        """A DoExchange call's side of its shard's streaming writes, taking writes of the
        stream's schema (``stream``; None: the stream ended before it came). A shard that
        does not exist is created with ``schema`` (the stream's columns, less ``_diff``)."""
        writer_id = writer_id_of(command.writer_id)
        levels = check_levels(command.levels)
        return await self.streams.open_call(command.shard, writer_id, levels, schema, stream)

    async def existing(self, shard: str) -> str | None:
        """The id of ``shard`` (an id or a name), if that shard exists."""
        if self._writers.get(shard):
            return shard  # the server writes it already: no need to ask consensus
        try:
            sid = await self._client.shard_id(shard)
            await self._client.frontiers(sid)
        except InvalidUsage:
            return None
        return sid

    async def resolve(self, shard: str, schema: pa.Schema) -> str:
        """The id of ``shard`` (an id or a name); a new name is given to a new shard with
        ``schema`` (of racing creators, all get the one that won)."""
        if self._writers.get(shard):
            return shard
        with contextlib.suppress(InvalidUsage):
            return await self._client.shard_id(shard)
        with contextlib.suppress(InvalidUsage):  # taken meanwhile: that shard it is
            return await self._client.create_shard(shard, schema)
        return await self._client.shard_id(shard)

    async def recover(self, clean: bool) -> None:
        """Commits the writes an earlier run logged but did not commit (``Streams.recover``)."""
        await self.streams.recover(clean)

    # --- what the server asks ------------------------------------------------------------------

    async def durability(self, shard: str) -> dict[str, int]:
        """Per tier, this server's LSN watermark of ``shard``: every LSN of its log below it
        reached the tier. Without streams of the shard open, every tier is what the shard's
        state records as resolved for this server; a write set aside in ``quarantine/`` is
        never counted (no mark but ``MEMORY`` passes it)."""
        marks = self.streams.marks(shard)
        if marks is None:
            info = await self._client.inspect(shard)
            mark = info["streams"].get(self.streams.server, {}).get("resolved_lsn", 0)
            notes = await asyncio.to_thread(Wal.list_quarantine, self._wal_dir / shard)
            stop = min((n["lsn"] for n in notes if n["lsn"] is not None), default=mark)
            marks = {t: (mark if t == "MEMORY" else min(mark, stop)) for t in TIER_NAMES}
        # A tier is never ahead of the one before it.
        out: dict[str, int] = {}
        ceiling = marks["MEMORY"]
        for tier in TIER_NAMES:
            ceiling = min(ceiling, marks[tier])
            out[tier] = ceiling
        return out

    async def quarantine(self, shard: str | None) -> list[dict[str, Any]]:
        """What is set aside under ``<wal-dir>/<shard>/quarantine/`` (every shard's, without
        ``shard``): ``{"shard", "lsn", "writer_id", "seq", "why", "at"}`` each."""
        root = self._wal_dir

        def listed() -> list[dict[str, Any]]:
            dirs = [root / shard] if shard is not None else sorted(root.glob("*/"))
            return [
                {"shard": d.name, **note}
                for d in dirs
                if d.is_dir()
                for note in Wal.list_quarantine(d)
            ]

        return await asyncio.to_thread(listed)

    def lag(self) -> dict[str, tuple[int, float]]:
        return self.streams.lag()

    async def close(self, timeout_s: float = 30.0) -> None:
        """Commits what the streams took (for at most ``timeout_s``), then expires the
        writers (the drain)."""
        await self.streams.close(timeout_s)
        writers = [w for kept in self._writers.values() for w in kept.values()]
        await asyncio.gather(*(w.expire() for w in writers), return_exceptions=True)
        self._writers.clear()
