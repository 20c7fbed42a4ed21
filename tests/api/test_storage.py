"""client.storage / inspect's storage / persist du: every byte a shard holds, on every location."""

from __future__ import annotations

import persist

from .conftest import SCHEMA, Connect, updates


async def test_storage_counts_every_byte_by_kind(connect: Connect) -> None:
    client = await connect(inline_writes_max_bytes=512, rollup_interval=4)
    shard = persist.ShardId.new()
    write, _read = await client.open(shard, SCHEMA)  # its reader holds what merges retire
    for t in range(12):
        keys = list(range(100 * t, 100 * t + (1 if t % 2 else 100)))  # inline and blob parts
        await write.compare_and_append(updates(keys, t), t, t + 1)
    await client.maintain(shard)  # merges retire parts the reader's seqno still holds
    storage = await client.storage(shard)
    # Independently: every blob's bytes by reading it, every consensus entry's bytes.
    blob_keys = await client.blob.list_keys(f"{shard}/")
    values = [await client.blob.get(k) or b"" for k in blob_keys]
    assert storage["blob_bytes"] == sum(len(v) for v in values)
    entries = await client.consensus.scan(shard, 0, 10_000)
    assert storage["consensus_entries"] == len(entries) > 0
    assert storage["consensus_bytes"] == sum(len(e.data) for e in entries)
    assert storage["total_bytes"] == storage["blob_bytes"] + storage["consensus_bytes"]
    kinds = ["live_parts_bytes", "rollup_bytes", "retired_bytes", "other_blob_bytes"]
    assert sum(storage[k] for k in kinds) == storage["blob_bytes"]
    assert all(storage[k] >= 0 for k in storage)
    state = client._shards.machines[shard].state
    parts = [p for b in state.batches.values() for p in b.parts]
    assert storage["live_parts_bytes"] == sum(p.size for p in parts if not p.inline) > 0
    assert storage["inline_bytes"] == sum(len(p.inline) for p in parts)
    assert storage["rollup_bytes"] > 0
    assert "storage" not in await client.inspect(shard)  # the state alone: no listing
    info = await client.inspect(shard, storage=True)
    assert info["storage"] == storage
    # inspect's "bytes" (the live parts) is less than what the shard holds.
    assert info["bytes"] < storage["total_bytes"]
    if info["retired"]:
        assert storage["retired_bytes"] > 0
