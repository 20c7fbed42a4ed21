"""A long run of a keyed table with a retention and no reader: the since follows the window by
itself, and the shard's parts and bytes stay bounded by the window, not by its age."""

from __future__ import annotations

import math
from pathlib import Path

import persist
from persist.core.shard import garbage

from ..api.conftest import SCHEMA, fast_config, updates


async def test_a_shard_with_retention_and_no_reader_stays_bounded(tmp_path: Path) -> None:
    now = [1_800_000_000_000]
    n_appends, step_ms, window_s = 1_500, 1_000, 30.0
    cfg = fast_config(
        rollup_interval=32, retention_s=window_s, now_ms=lambda: now[0], lease_duration_s=1e6
    )
    blob, consensus = (tmp_path / "blob").as_uri(), f"sqlite://{tmp_path / 'c.db'}"
    async with await persist.connect(blob, consensus, config=cfg) as client:
        shard = persist.ShardId.new()
        write = await client.open_writer(shard, SCHEMA)
        peak_parts = peak_rows = 0
        for i in range(n_appends):
            now[0] += step_ms
            # Ten new rows, five of the previous append's retracted: a keyed table.
            new = list(range(10 * i, 10 * i + 10))
            gone = list(range(10 * (i - 1), 10 * (i - 1) + 5)) if i else []
            await write.compare_and_append(
                updates(new + gone, i, [1] * len(new) + [-1] * len(gone)), i, i + 1
            )
            if i % 100 == 99:
                await client.maintain(shard)
                info = await client.inspect(shard)
                peak_parts, peak_rows = max(peak_parts, info["parts"]), max(peak_rows, info["rows"])
        await client.maintain(shard)
        info = await client.inspect(shard)
        since, upper = info["since"], info["upper"]
        # The window (30 s + a minute of skew allowance) spans ~90 appends at 1 s apiece.
        window = int((window_s * 1000 + 60_000) / step_ms)
        assert upper - window - 2 <= since <= upper - window + 2, (since, upper)
        contents_rows = 10 * n_appends - 5 * (n_appends - 1)
        # Stored updates: about the contents once plus the window's updates (15 per append)
        # unconsolidated, and what compaction has yet to merge (it merges by size levels):
        # bounded by the window, not by the 15 * 1500 updates written.
        held = contents_rows + 15 * (window + 2)
        assert info["rows"] <= 1.5 * held, (info["rows"], held)
        assert peak_rows <= 1.5 * (held + 15 * 100), peak_rows
        assert info["rows"] < 0.5 * 15 * n_appends
        assert info["batches"] <= 2 * math.log2(15 * n_appends)
        assert peak_parts <= 64, peak_parts
        state = client._shards.machines[shard].state
        keys_now = set(await client.blob.list_keys(f"{shard}/"))
        assert keys_now == garbage.referenced_keys(state)  # nothing leaked
        assert len(state.history) <= 256 + 1024 + 3
        storage = await client.storage(shard)
        assert storage["retired_bytes"] == 0 and storage["other_blob_bytes"] == 0
        # Reading within the window works at every time in it; before it, it is refused.
        reader = await client.open_leased_reader(shard)
        for t in (since, upper - 1):
            assert (await reader.snapshot_and_fetch(t)).num_rows > 0
