"""client.erase: a predicate's rows gone from every time, every batch, rollup and inline part,
proved on raw storage (the blob's files or objects, the consensus rows) on every location."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import string
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import persist

from .conftest import SCHEMA, Connect, contents, updates


def _table(keys: list[int], values: list[str], time: int, diff: int = 1) -> pa.Table:
    t = updates(keys, time, diff)
    return t.set_column(1, "v", pa.array(values, pa.string()))


def _secret(seed: int) -> str:
    # Seeded, and unique to this run: the consensus table is shared by every location of a
    # database, and a failed run's rows must not hold the next run's value.
    rng = random.Random(f"{seed}-{random.SystemRandom().random()}")
    return "".join(rng.choice(string.ascii_letters) for _ in range(48))


async def _raw_blob(location: tuple[str, str], client: persist.PersistClient) -> dict[str, bytes]:
    """Every blob of the location as stored: the file blob's files (temp files too), the S3
    bucket's objects under the prefix; the memory blob has no raw form but its values."""
    uri = urlsplit(location[0])
    if uri.scheme == "file":
        root = Path(uri.path)
        for _ in range(100):
            try:
                return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}
            except FileNotFoundError:
                # A write in flight (a background rollup) renamed or removed its temporary
                # file between the listing and the read: look at everything again.
                await asyncio.sleep(0.01)
        raise AssertionError(f"files under {root} kept vanishing while they were read")
    if uri.scheme == "s3":
        import boto3

        endpoint = parse_qs(uri.query)["endpoint_url"][0]
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        out = {}
        pages = s3.get_paginator("list_objects_v2").paginate(
            Bucket=uri.netloc, Prefix=uri.path.strip("/") + "/"
        )
        for page in pages:
            for obj in page.get("Contents", []):
                body = s3.get_object(Bucket=uri.netloc, Key=obj["Key"])["Body"].read()
                out[obj["Key"]] = body
        return out
    return {k: await client.blob.get(k) or b"" for k in await client.blob.list_keys("")}


def _raw_consensus(location: tuple[str, str], secret: bytes) -> list[str]:
    """The consensus rows (of any shard, the catalog's too) holding ``secret``, read with the
    database's own driver; the memory consensus has no rows to read."""
    uri = location[1]
    if uri.startswith("sqlite://"):
        conn = sqlite3.connect(uri.removeprefix("sqlite://"))
        try:
            rows = conn.execute(
                "SELECT shard, seqno FROM consensus WHERE instr(data, ?) > 0", (secret,)
            ).fetchall()
        finally:
            conn.close()
        return [f"sqlite row {s}@{n}" for s, n in rows]
    if uri.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(uri) as conn:
            rows = conn.execute(
                "SELECT shard, seqno FROM consensus WHERE position(%s::bytea IN data) > 0",
                (secret,),
            ).fetchall()
        return [f"postgres row {s}@{n}" for s, n in rows]
    return []


async def _holding(
    location: tuple[str, str], client: persist.PersistClient, shard: str, secret: str
) -> list[str]:
    """Where raw storage holds ``secret``: blobs by key or path, consensus rows."""
    needle = secret.encode()
    found = [k for k, data in (await _raw_blob(location, client)).items() if needle in data]
    found += _raw_consensus(location, needle)
    if location[1].startswith("mem://"):
        entries = await client.consensus.scan(shard, 0, 1 << 30)
        found += [f"mem entry {e.seqno}" for e in entries if needle in e.data]
    return found


async def test_erase_leaves_no_trace_in_raw_storage(
    connect: Connect, location: tuple[str, str]
) -> None:
    # Parts in blob and inline parts both; compacted batches (under c/), batches as written
    # (under w/) and rollups (every few commits) all hold the value before the erase.
    for inline in (0, 4096):
        client = await connect(
            inline_writes_max_bytes=inline,
            compaction_enabled=False,
            compaction_min_parts=1,
            rollup_interval=3,
        )
        shard = persist.ShardId.new()
        write, read = await client.open(shard, SCHEMA, "query")
        secret = _secret(inline)
        others = list(range(1, 40))
        await write.compare_and_append(_table([0, *others], [secret, *map(str, others)], 0), 0, 1)
        await write.compare_and_append(_table([50, 51], ["a", "b"], 1), 1, 2)
        await write.compare_and_append(_table([0], [secret], 2, -1), 2, 3)
        await write.compare_and_append(_table([0, 1000], [secret, secret], 3), 3, 4)
        await client.maintain(shard)  # merges what is there: the value is in compacted parts
        assert any("/c/" in k for k in await client.blob.list_keys(f"{shard}/"))
        await write.compare_and_append(_table([2000, 7], [secret, "7"], 4, [1, -1]), 4, 5)
        await write.compare_and_append(_table([52], ["c"], 5), 5, 6)
        await read.downgrade_since(1)
        # The check can fail, on every kind of place the value is in.
        held = await _holding(location, client, shard, secret)
        if inline:
            assert any("/rollup/" in h for h in held), held
            assert any(h.split()[0] in ("sqlite", "postgres", "mem") for h in held), held
        else:
            assert any("/c/" in h for h in held) and any("/w/" in h for h in held), held

        matching = pc.field("v") == secret
        expected = {}
        probe = await client.open_leased_reader(shard, SCHEMA, "probe")
        for t in range(1, 6):
            fetched = await probe.snapshot_and_fetch(t)
            expected[t] = {r: n for r, n in contents(fetched).items() if r[1] != secret}
        assert contents(await probe.snapshot_and_fetch(5)) != expected[5]  # rows to erase
        await probe.expire()
        before = await client.inspect(shard)

        report = await client.erase(shard, matching)
        assert report["seqno"] > before["seqno"] and report["since"] == 1
        assert report["batches_rewritten"] >= 2 and report["parts_rewritten"] >= 2
        # Every stored update of the rows: inserts, the retraction, the re-inserts.
        assert report["rows_erased"] == 5
        assert report["rows_after"] == report["rows_before"] - 5
        # The reader's last heartbeat named a state version from before the erase: what that
        # version reaches stays until it renews, and the report names it.
        assert report["blobs_held"] > 0
        assert report["held_by"] == {read.reader_id: "query"}
        for t in range(1, 6):
            assert contents(await read.snapshot_and_fetch(t)) == expected[t]

        await read.downgrade_since(1)  # renews its hold
        await client.maintain(shard)
        assert await _holding(location, client, shard, secret) == []
        for t in range(1, 6):
            assert contents(await read.snapshot_and_fetch(t)) == expected[t]
        # Writes go on as before.
        await write.compare_and_append(_table([80], ["80"], 6), 6, 7)
        assert contents(await read.snapshot_and_fetch(6)) == {**expected[5], (80, "80"): 1}
        await client.close()


async def test_erase_refuses_predicates_beyond_the_data_columns(
    client: persist.PersistClient,
) -> None:
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    await write.compare_and_append(updates([1, 2], 0), 0, 1)
    seqno = (await client.inspect(shard))["seqno"]
    # A predicate on _time or _diff would take some of a row's updates and leave the others:
    # the row would show a multiplicity nobody wrote.
    for bad, name in (
        (pc.field("_time") < 1, "_time"),
        (pc.field("_diff") == 1, "_diff"),
        ((pc.field("k") == 1) | (pc.field("nope") == 2), "nope"),
    ):
        with pytest.raises(persist.InvalidUsage, match=name):
            await client.erase(shard, bad)
    with pytest.raises(persist.InvalidUsage, match="bool"):
        await client.erase(shard, pc.field("k") + 1)
    with pytest.raises(persist.InvalidUsage, match="Expression"):
        await client.erase(shard, "k = 1")  # type: ignore[arg-type]
    assert (await client.inspect(shard))["seqno"] == seqno


async def test_erase_with_nothing_to_erase(client: persist.PersistClient) -> None:
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    await write.compare_and_append(updates([1, 2], 0), 0, 1)
    report = await client.erase(shard, pc.field("k") == 99)
    assert report["seqno"] is None and report["rows_erased"] == 0
    assert report["batches_rewritten"] == 0 and report["rows_after"] == 2
    assert contents(await read.snapshot_and_fetch(0)) == {(1, "v1"): 1, (2, "v2"): 1}
    # A null is no match: the row stays.
    await write.compare_and_append(
        pa.table(
            {
                "k": pa.array([None], pa.int64()),
                "v": ["null key"],
                "_time": pa.array([1], pa.uint64()),
            }
        ),
        1,
        2,
    )
    report = await client.erase(shard, pc.field("k") > 1)
    assert report["rows_erased"] == 1
    assert contents(await read.snapshot_and_fetch(1)) == {(1, "v1"): 1, (None, "null key"): 1}


@pytest.mark.parametrize("inline", [0, 4096])
async def test_erase_loses_no_concurrent_write(connect: Connect, inline: int) -> None:
    # Another client appends (and its background compaction merges) while the erase reads and
    # rewrites: the erase commits only against parts it read (or, inline, rewrites itself), so
    # every row that does not match survives and no matching row written before it is left.
    writer_client = await connect(compaction_min_parts=2, inline_writes_max_bytes=inline)
    client = await connect(compaction_min_parts=2, inline_writes_max_bytes=inline)
    shard = persist.ShardId.new()
    write, read = await writer_client.open(shard, SCHEMA)
    secret = _secret(7)
    for t in range(6):
        await write.compare_and_append(_table([t, 100 + t], [str(t), secret], t), t, t + 1)

    async def keep_writing() -> None:
        for t in range(6, 40):
            await write.compare_and_append(_table([t], [str(t)], t), t, t + 1)
            await asyncio.sleep(0)  # on a memory location no await suspends: let the erase run

    writing = asyncio.create_task(keep_writing())
    while True:
        try:
            report = await client.erase(shard, pc.field("v") == secret)
            break
        except persist.ExternalError as exc:
            # A writer committing parts in blob back to back can outpace every round of an
            # erase: it gives up having changed nothing, and is tried again.
            assert exc.determinate and "kept changing" in str(exc)
    await writing
    assert report["rows_erased"] == 6
    # The reader's client last read the state at its writer's last commit, which may be before
    # the erase's: until it reads the state again (a commit, a heartbeat) its snapshots are
    # what it held. The report names it.
    assert read.reader_id in report["held_by"]
    await write.fetch_recent_upper()
    assert contents(await read.snapshot_and_fetch(39)) == {(t, str(t)): 1 for t in range(40)}
