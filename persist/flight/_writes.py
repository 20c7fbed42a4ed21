"""Writes over Flight: DoPut's ``compare_and_append`` and the registry of streaming writes.

The server writes each shard through one writer of its own ("persist flight"), opened by the
first DoPut or streaming write into it and kept (heartbeated) until the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa

from persist.client import PersistClient
from persist.core.updates import DIFF, TIME
from persist.errors import InvalidUsage, LeaseExpired, PersistError
from persist.flight._metrics import TIERS, Metrics
from persist.flight._protocol import ExchangeCommand, PutCommand
from persist.flight._stream import (
    Call,
    Room,
    ShardStream,
    check_levels,
    recovered_writes,
    writer_id_of,
)
from persist.ids import ShardId
from persist.write import WriteHandle

__all__ = ["Writes"]

log = logging.getLogger("persist")


class Writes:
    """The server's writers and streams, on its event loop."""

    def __init__(
        self,
        client: PersistClient,
        metrics: Metrics,
        *,
        wal_dir: Path,
        commit_interval_ms: float,
        commit_bytes: int,
        max_buffer_bytes: int,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._wal_dir = wal_dir
        self._commit_interval_s = commit_interval_ms / 1000
        self._commit_bytes = commit_bytes
        self.room = Room(max_buffer_bytes)
        self._writers: dict[str, WriteHandle] = {}
        self._writer_locks: dict[str, asyncio.Lock] = {}
        self._streams: dict[str, ShardStream] = {}

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
        self._metrics.writes.labels("do_put").inc()
        self._metrics.write_bytes.labels("do_put").inc(table.nbytes)
        stream = self._streams.get(command.shard)
        if stream is None:
            return await self._put(command, table, data)
        # The server is the shard's only writer while it streams: pending streamed writes are
        # committed first, and no LSN is handed out until this append is done.
        async with stream.holding():
            await stream.flush_and_commit()
            upper = await self._put(command, table, data)
            stream.note_upper(upper)
            return upper

    async def _put(self, command: PutCommand, table: pa.Table, data: pa.Schema) -> int | None:
        for attempt in (1, 2):
            writer = await self._writer(command.shard, data)
            try:
                with self._metrics.commit():
                    await writer.compare_and_append(
                        table, command.expected_upper, command.new_upper
                    )
            except LeaseExpired:
                # The writer lapsed (the server stalled past its lease): nothing was written.
                self._writers.pop(command.shard, None)
                if attempt == 2:
                    raise
                continue
            break
        return command.new_upper

    async def _writer(self, shard: str, schema: pa.Schema | None) -> WriteHandle:
        writer = self._writers.get(shard)
        if writer is not None:
            return writer
        lock = self._writer_locks.setdefault(shard, asyncio.Lock())
        async with lock:
            writer = self._writers.get(shard)
            if writer is None:
                writer = await self._client.open_writer(shard, schema, purpose="persist flight")
                self._writers[shard] = writer
        return writer

    # --- streaming writes ----------------------------------------------------------------------

    async def open_exchange(self, command: ExchangeCommand) -> Call:
        """A DoExchange call's side of its shard's stream."""
        writer_id = writer_id_of(command.writer_id)
        levels = check_levels(command.levels)
        stream = await self._stream(command.shard)
        call = Call(stream, writer_id, levels)
        stream.open_call(call)
        return call

    async def _stream(self, shard: str) -> ShardStream:
        stream = self._streams.get(shard)
        if stream is not None and stream.failed is None:
            return stream
        lock = self._writer_locks.setdefault(shard, asyncio.Lock())
        async with lock:
            stream = self._streams.get(shard)
            if stream is None or stream.failed is not None:
                if stream is not None:
                    await stream.close()
                writer = self._writers.get(shard)
                if writer is None:
                    writer = await self._client.open_writer(shard, purpose="persist flight")
                    self._writers[shard] = writer
                await writer.fetch_recent_upper()
                stream = ShardStream(
                    shard,
                    self._client,
                    writer,
                    self._wal_dir,
                    commit_interval_s=self._commit_interval_s,
                    commit_bytes=self._commit_bytes,
                    room=self.room,
                    metrics=self._metrics,
                )
                self._streams[shard] = stream
        return stream

    async def recover(self) -> None:
        """Commits, at their LSNs, the writes a crashed run logged but did not commit."""
        wal_dir = self._wal_dir
        if not await asyncio.to_thread(wal_dir.is_dir):
            return
        dirs = await asyncio.to_thread(lambda: sorted(wal_dir.iterdir()))
        for directory in dirs:
            try:
                shard = str(ShardId(directory.name))
            except InvalidUsage:
                continue
            _, writes, paths = await asyncio.to_thread(recovered_writes, directory)
            if writes:
                await self._recommit(shard, writes)
            for path in paths:
                await asyncio.to_thread(path.unlink, missing_ok=True)

    async def _recommit(self, shard: str, writes: list[tuple[int, str, int, pa.Table]]) -> None:
        writer = await self._client.open_writer(shard, purpose="persist flight")
        self._writers[shard] = writer
        upper = await writer.fetch_recent_upper()
        done = writer.stream_upper
        todo = [w for w in writes if w[0] >= done]
        lost = [w for w in todo if upper is None or w[0] < upper]
        todo = [w for w in todo if upper is not None and w[0] >= upper]
        if lost:
            log.error(
                "persist flight: %d logged write(s) of %s can't be committed at their LSNs "
                "(LSN %d..%d): another writer moved the upper to %s past them",
                len(lost),
                shard,
                lost[0][0],
                lost[-1][0],
                upper,
            )
        if not todo or upper is None:
            return
        table = pa.concat_tables([w[3] for w in todo])
        times = [w[0] for w in todo for _ in range(w[3].num_rows)]
        table = table.append_column(
            pa.field(TIME, pa.uint64(), nullable=False), pa.array(times, pa.uint64())
        )
        new_upper = todo[-1][0] + 1
        batch = await writer.batch(table, upper, new_upper)
        seqs = [(w[1], w[2], w[0]) for w in todo if w[2] >= 0]
        await writer.append_streamed(batch, upper, new_upper, seqs)
        log.warning(
            "persist flight: recovered %d write(s) of %s from the WAL (LSN %d..%d)",
            len(todo),
            shard,
            todo[0][0],
            todo[-1][0],
        )

    # --- what the server asks ------------------------------------------------------------------

    def durability(self, shard: str, upper: int | None) -> dict[str, Any]:
        """Per tier, every LSN below it has reached the tier. Without streaming writes pending,
        every tier is the shard's upper."""
        stream = self._streams.get(shard)
        if stream is None or stream.failed is not None or upper is None:
            return dict.fromkeys(TIERS, upper)
        marks = stream.durability()
        # COMMITTED is the upper itself (another process may have moved it on); a tier is never
        # behind the one after it.
        out: dict[str, Any] = {"COMMITTED": upper}
        floor = upper
        for tier in reversed(TIERS[:-1]):
            floor = max(marks[tier], floor)
            out[tier] = floor
        return {t: out[t] for t in TIERS}

    def lag(self) -> dict[str, tuple[int, float]]:
        total: dict[str, tuple[int, float]] = {}
        for stream in list(self._streams.values()):
            for tier, (n, secs) in stream.lag().items():
                m, w = total.get(tier, (0, 0.0))
                total[tier] = (m + n, max(w, secs))
        return total

    async def close(self) -> None:
        """Commits what every stream took, then expires the writers (the drain)."""
        for stream in self._streams.values():
            # Whatever was taken is committed before the writer goes (else the next start
            # recovers it from the WAL).
            with contextlib.suppress(PersistError):
                await stream.flush_and_commit()
            await stream.close()
        await asyncio.gather(*(w.expire() for w in self._writers.values()), return_exceptions=True)
        self._writers.clear()
