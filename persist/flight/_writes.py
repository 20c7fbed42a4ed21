"""Writes over Flight: DoPut's ``compare_and_append``, and the server's writers.

The server writes each shard through one writer of its own ("persist flight"), opened by the
first DoPut or streaming write into it and kept (heartbeated) until the drain; DoPuts and the
shard's streaming writes (``_stream``) share it. While a shard has streaming writes, a DoPut
into it commits them first and no LSN is handed out until its append is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pyarrow as pa

from persist.client import PersistClient
from persist.core.durability import TIER_NAMES
from persist.core.updates import DIFF, TIME
from persist.errors import InvalidUsage, LeaseExpired
from persist.flight._metrics import Metrics
from persist.flight._protocol import ExchangeCommand, PutCommand, check_levels, writer_id_of
from persist.flight._stream import CallInfo, Spawn, Streams
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
        commit_interval_ms: float,
        commit_bytes: int,
        max_buffer_bytes: int,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._writers: dict[str, WriteHandle] = {}
        self._writer_locks: dict[str, asyncio.Lock] = {}
        self.streams = Streams(
            client,
            metrics,
            self.writer,
            spawn,
            wal_dir,
            commit_interval_ms=commit_interval_ms,
            commit_bytes=commit_bytes,
            max_buffer_bytes=max_buffer_bytes,
        )

    async def writer(
        self, shard: str, schema: pa.Schema | None, lapsed: WriteHandle | None = None
    ) -> WriteHandle:
        """The server's writer of ``shard`` (a new shard is created with ``schema``); a new one
        in place of ``lapsed`` (whose lease ran out) if that is still the current one."""
        writer = self._writers.get(shard)
        if writer is not None and writer is not lapsed:
            return writer
        async with self._writer_locks.setdefault(shard, asyncio.Lock()):
            writer = self._writers.get(shard)
            if writer is None or writer is lapsed:
                writer = await self._client.open_writer(shard, schema, purpose="persist flight")
                self._writers[shard] = writer
        return writer

    # --- DoPut ---------------------------------------------------------------------------------

    async def put(self, command: PutCommand, table: pa.Table) -> int | None:
        """One ``compare_and_append`` of every row of a DoPut, under the server's writer of the
        shard (created with the stream's columns if the shard is new)."""
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
        streams = self.streams
        if not streams.streams(command.shard):
            return await self._put(command, table, data)
        async with streams.holding(command.shard):
            await streams.flush_and_commit(command.shard)
            upper = await self._put(command, table, data)
            streams.note_upper(command.shard, upper)
            return upper

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

    async def open_exchange(self, command: ExchangeCommand, schema: pa.Schema | None) -> CallInfo:
        """A DoExchange call's side of its shard's streaming writes. A shard that does not
        exist is created with ``schema`` (the stream's columns, less ``_diff``)."""
        writer_id = writer_id_of(command.writer_id)
        levels = check_levels(command.levels)
        return await self.streams.open_call(command.shard, writer_id, levels, schema)

    async def existing(self, shard: str) -> str | None:
        """The id of ``shard`` (an id or a name), if that shard exists."""
        if shard in self._writers:
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
        if shard in self._writers:
            return shard
        with contextlib.suppress(InvalidUsage):
            return await self._client.shard_id(shard)
        with contextlib.suppress(InvalidUsage):  # taken meanwhile: that shard it is
            return await self._client.create_shard(shard, schema)
        return await self._client.shard_id(shard)

    async def recover(self) -> None:
        """Commits, at their LSNs, the writes a crashed run logged but did not commit."""
        await self.streams.recover()

    # --- what the server asks ------------------------------------------------------------------

    def durability(self, shard: str, upper: int | None) -> dict[str, Any]:
        """Per tier, every LSN below it has reached the tier. Without streaming writes pending,
        every tier is the shard's upper."""
        marks = self.streams.marks(shard)
        if marks is None or upper is None:
            return dict.fromkeys(TIER_NAMES, upper)
        # COMMITTED is the upper itself (another process may have moved it on); a tier is never
        # behind the one after it.
        out: dict[str, Any] = {"COMMITTED": upper}
        floor = upper
        for tier in reversed(TIER_NAMES[:-1]):
            floor = max(marks[tier], floor)
            out[tier] = floor
        return {t: out[t] for t in TIER_NAMES}

    def lag(self) -> dict[str, tuple[int, float]]:
        return self.streams.lag()

    async def close(self, timeout_s: float = 30.0) -> None:
        """Commits what the streams took (for at most ``timeout_s``), then expires the
        writers (the drain)."""
        await self.streams.close(timeout_s)
        await asyncio.gather(*(w.expire() for w in self._writers.values()), return_exceptions=True)
        self._writers.clear()
