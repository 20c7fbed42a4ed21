"""Parts of a writer that died before committing are collected once its lease expires."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path

import pyarrow as pa

import persist
from persist.core.shard import garbage

from ..api.conftest import SCHEMA, fast_config

LEASE_S = 1.0


def _doomed_writer(blob: str, consensus: str, shard: str, pipe: Connection) -> None:
    async def main() -> None:
        cfg = persist.PersistConfig(lease_duration_s=LEASE_S, heartbeat_interval_s=3600)
        client = await persist.connect(blob, consensus, config=cfg)
        write = await client.open_writer(shard, SCHEMA)
        data = pa.table(
            {
                "k": pa.array(range(1000), pa.int64()),
                "v": pa.array([f"v{i}" for i in range(1000)]),
                "_time": pa.array([0] * 1000, pa.uint64()),
            }
        )
        batch = await write.batch(data, 0, 1)  # parts written, never committed
        pipe.send((write.writer_id, [p.key for p in batch.hollow.parts]))
        await asyncio.sleep(3600)

    asyncio.run(main())


async def test_sigkilled_writer_parts_are_collected_after_its_lease(tmp_path: Path) -> None:
    blob, consensus = (tmp_path / "blob").as_uri(), f"sqlite://{tmp_path / 'c.db'}"
    shard = persist.ShardId.new()
    async with await persist.connect(blob, consensus, config=fast_config()) as client:
        write, read = await client.open(shard, SCHEMA)
        ctx = multiprocessing.get_context("spawn")
        parent_end, child_end = ctx.Pipe()
        child = ctx.Process(target=_doomed_writer, args=(blob, consensus, str(shard), child_end))
        child.start()
        try:
            assert parent_end.poll(60), "the writer process did not get to write its batch"
            writer_id, keys = parent_end.recv()
        finally:
            os.kill(child.pid or 0, signal.SIGKILL)
            child.join(10)
        assert child.exitcode == -signal.SIGKILL
        assert keys and set(keys) <= set(await client.blob.list_keys(f"{shard}/w/{writer_id}/"))

        # This client sees the writer, then watches its heartbeat stay still past its lease:
        # the only live handles are this client's own, so nothing else shows the clocks agree.
        await write.fetch_recent_upper()
        assert writer_id in client._shards.machines[shard].state.writers
        await asyncio.sleep(LEASE_S * 1.5)
        # Any commit expires the dead writer...
        await write.compare_and_append(
            pa.table({"k": [1], "v": ["a"], "_time": pa.array([0], pa.uint64())}), 0, 1
        )
        state = client._shards.machines[shard].state
        assert writer_id not in state.writers and writer_id in state.expired_writers
        # ...and garbage collection (in the background after that commit, or in maintain)
        # sweeps what it left behind.
        await client.maintain(shard)
        state = client._shards.machines[shard].state
        assert not state.expired_writers
        assert await client.blob.list_keys(f"{shard}/w/{writer_id}/") == []
        assert set(await client.blob.list_keys(f"{shard}/")) == garbage.referenced_keys(state)
        assert (await read.snapshot_and_fetch(0)).num_rows == 1
