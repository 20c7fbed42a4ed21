"""client.purge: a retracted value is gone from storage, on every location."""

from __future__ import annotations

import random
import string

import pyarrow as pa

import persist

from .conftest import SCHEMA, Connect, contents, updates


def _table(keys: list[int], values: list[str], time: int, diff: int) -> pa.Table:
    t = updates(keys, time, diff)
    return t.set_column(1, "v", pa.array(values, pa.string()))


async def _stored(client: persist.PersistClient, shard: str) -> list[bytes]:
    """Every blob of the shard and every consensus entry of its state."""
    out = [await client.blob.get(k) or b"" for k in await client.blob.list_keys(f"{shard}/")]
    out += [e.data for e in await client.consensus.scan(shard, 0, 100_000)]
    return out


async def test_purge_removes_a_retracted_value_from_every_blob(connect: Connect) -> None:
    # Parts in blob (no inline parts) and inline ones both: the value must go from each.
    for inline in (0, 4096):
        client = await connect(inline_writes_max_bytes=inline, compaction_enabled=False)
        shard = persist.ShardId.new()
        write, read = await client.open(shard, SCHEMA)
        rng = random.Random(inline)
        secret = "".join(rng.choice(string.ascii_letters) for _ in range(64))
        others = [f"v{k}" for k in range(1, 50)]
        await write.compare_and_append(_table([0], [secret], 0, 1), 0, 1)
        await write.compare_and_append(_table(list(range(1, 50)), others, 1, 1), 1, 2)
        await write.compare_and_append(_table([0], [secret], 2, -1), 2, 3)
        await write.compare_and_append(_table([1], ["v1"], 3, -1), 3, 4)
        stored = await _stored(client, shard)
        assert any(secret.encode() in data for data in stored), "the check could not fail"
        await read.downgrade_since(3)
        report = await client.purge(shard)
        assert report["since"] == 3 and report["batches_rewritten"] >= 1
        assert report["rows_after"] < report["rows_before"]
        # The reader's last heartbeat named a state version from before the purge: what that
        # version reaches stays until the reader renews, then goes with the next maintenance.
        assert report["blobs_held"] > 0 and report["blobs_deleted"] >= 0
        await read.downgrade_since(3)
        await client.maintain(shard)
        assert (await client.inspect(shard))["retired"] == 0
        assert not any(secret.encode() in data for data in await _stored(client, shard))
        # The contents are untouched, as of the since and after it.
        expected = {(k, f"v{k}"): 1 for k in range(2, 50)}
        assert contents(await read.snapshot_and_fetch(3)) == expected
        await write.compare_and_append(_table([7], ["v7"], 4, 1), 4, 5)
        assert contents(await read.snapshot_and_fetch(4)) == {**expected, (7, "v7"): 2}


async def test_purge_leaves_what_the_since_has_not_passed(client: persist.PersistClient) -> None:
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    await write.compare_and_append(updates([1, 2], 0), 0, 1)
    await write.compare_and_append(updates([1], 1, -1), 1, 2)
    await read.downgrade_since(0)  # the retraction is above the since: history keeps both
    report = await client.purge(shard)
    assert report["rows_after"] == 3
    assert contents(await read.snapshot_and_fetch(0)) == {(1, "v1"): 1, (2, "v2"): 1}
    assert contents(await read.snapshot_and_fetch(1)) == {(2, "v2"): 1}
