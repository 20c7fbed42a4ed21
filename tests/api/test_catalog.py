"""Names of shards (the catalog in consensus), by public names only, on every location."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import uuid

import pyarrow as pa
import pytest

import persist
from persist.location import open_consensus
from persist.testing.faults import Faults, FaultyConsensus

from .conftest import SCHEMA, Connect, contents, fast_config, updates


@pytest.fixture
def ns() -> str:
    """A name prefix of this test's own: a Postgres consensus (one catalog) serves every test."""
    return f"t{uuid.uuid4().hex[:12]}"


async def test_a_named_shard_is_used_by_its_name_everywhere(
    client: persist.PersistClient, ns: str
) -> None:
    sid = await client.create_shard(f"{ns}.sales.orders", SCHEMA)
    assert isinstance(sid, persist.ShardId)
    assert await client.shard_id(f"{ns}.sales.orders") == sid
    write, read = await client.open(f"{ns}.sales.orders")  # no schema: the shard exists
    await write.compare_and_append(updates([1, 2], 0), 0, 1)
    assert contents(await read.snapshot_and_fetch(0)) == {(1, "v1"): 1, (2, "v2"): 1}
    assert await client.frontiers(f"{ns}.sales.orders") == (0, 1)
    assert (await client.shard_schema(f"{ns}.sales.orders")).equals(SCHEMA)
    assert (await client.inspect(f"{ns}.sales.orders"))["shard_id"] == sid
    by_id = await client.open_leased_reader(sid)
    assert contents(await by_id.snapshot_and_fetch(0)) == {(1, "v1"): 1, (2, "v2"): 1}
    with pytest.raises(persist.InvalidUsage, match="schema"):
        await client.open_writer(f"{ns}.sales.orders", pa.schema([("x", pa.int8())]))


async def test_list_shards_by_prefix_with_frontiers_and_bytes(
    client: persist.PersistClient, ns: str
) -> None:
    before = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=5)
    orders = await client.create_shard(f"{ns}.sales.orders", SCHEMA)
    await client.create_shard(f"{ns}.sales.items", SCHEMA)
    await client.create_shard(f"{ns}.hr.people", SCHEMA)
    unnamed = persist.ShardId.new()
    await client.open_writer(unnamed, SCHEMA)
    write = await client.open_writer(f"{ns}.sales.orders")
    await write.compare_and_append(updates([1, 2, 3], 0), 0, 1)
    listed = await client.list_shards(ns)
    expected = [f"{ns}.hr.people", f"{ns}.sales.items", f"{ns}.sales.orders"]
    assert [e["name"] for e in listed] == expected
    assert unnamed not in [e["shard_id"] for e in listed]
    sales = await client.list_shards(f"{ns}.sales.")
    assert [e["name"] for e in sales] == [f"{ns}.sales.items", f"{ns}.sales.orders"]
    entry = sales[1]
    assert entry["shard_id"] == orders
    assert (entry["since"], entry["upper"], entry["rows"]) == (0, 1, 3)
    assert entry["bytes"] == (await client.inspect(orders))["bytes"] > 0
    assert entry["named_at"] >= before and entry["named_at"].tzinfo is not None
    assert "k: int64" in entry["schema"]
    assert await client.list_shards(f"{ns}.nothing") == []


async def test_a_taken_name_is_refused(client: persist.PersistClient, ns: str) -> None:
    sid = await client.create_shard(f"{ns}.a.b", SCHEMA)
    with pytest.raises(persist.InvalidUsage, match="taken"):
        await client.create_shard(f"{ns}.a.b", SCHEMA)
    assert await client.shard_id(f"{ns}.a.b") == sid
    other = await client.create_shard(f"{ns}.a.c", SCHEMA)
    with pytest.raises(persist.InvalidUsage, match="taken"):
        await client.rename_shard(f"{ns}.a.c", f"{ns}.a.b")
    assert await client.shard_id(f"{ns}.a.c") == other


async def test_of_racing_creators_of_one_name_exactly_one_wins(connect: Connect, ns: str) -> None:
    clients = [await connect() for _ in range(4)]
    names = [
        f"{ns}.race.x",
        f"{ns}.race.x",
        f"{ns}.race.y",
        f"{ns}.race.x",
        f"{ns}.race.y",
        f"{ns}.race.z",
    ]

    async def create(i: int, name: str) -> persist.ShardId | Exception:
        try:
            return await clients[i % len(clients)].create_shard(name, SCHEMA)
        except persist.InvalidUsage as exc:
            return exc

    got = await asyncio.gather(*(create(i, n) for i, n in enumerate(names)))
    winners = {n: g for n, g in zip(names, got, strict=True) if isinstance(g, persist.ShardId)}
    losers = [g for g in got if not isinstance(g, persist.ShardId)]
    assert sorted(winners) == [f"{ns}.race.x", f"{ns}.race.y", f"{ns}.race.z"]
    assert len(losers) == len(names) - 3
    assert all("taken" in str(e) for e in losers)
    listed = await clients[0].list_shards(f"{ns}.race.")
    assert {e["name"]: e["shard_id"] for e in listed} == winners


async def test_rename_moves_the_name_and_keeps_open_handles(
    client: persist.PersistClient, ns: str
) -> None:
    sid = await client.create_shard(f"{ns}.old.name", SCHEMA)
    write = await client.open_writer(f"{ns}.old.name")
    await client.rename_shard(f"{ns}.old.name", f"{ns}.new.name")
    with pytest.raises(persist.InvalidUsage, match=f"no shard is named '{ns}.old.name'"):
        await client.shard_id(f"{ns}.old.name")
    assert await client.shard_id(f"{ns}.new.name") == sid
    await write.compare_and_append(updates([1], 0), 0, 1)  # the handle holds the id
    assert (await client.frontiers(f"{ns}.new.name"))[1] == 1
    await client.rename_shard(f"{ns}.new.name", f"{ns}.new.name")  # already so: nothing to do
    await client.rename_shard(sid, f"{ns}.by.id")  # the old name given as the id
    assert await client.shard_id(f"{ns}.by.id") == sid
    unnamed = persist.ShardId.new()
    await client.open_writer(unnamed, SCHEMA)
    await client.rename_shard(unnamed, f"{ns}.first.name")  # an unnamed shard gets a name
    assert await client.shard_id(f"{ns}.first.name") == unnamed
    with pytest.raises(persist.InvalidUsage, match="does not exist"):
        await client.rename_shard(persist.ShardId.new(), f"{ns}.ghost")
    with pytest.raises(persist.InvalidUsage, match="no shard is named"):
        await client.rename_shard(f"{ns}.missing", f"{ns}.other")


async def test_drop_shard_refuses_live_handles_then_drops_in_one_call(
    client: persist.PersistClient, ns: str
) -> None:
    sid = await client.create_shard(f"{ns}.to.drop", SCHEMA)
    write, read = await client.open(f"{ns}.to.drop", purpose="loader")
    # Handed to other processes: the dropping client's own handles would need no force.
    write.detach()
    read.detach()
    await write.compare_and_append(updates([1, 2], 0), 0, 1)
    with pytest.raises(persist.InvalidUsage, match=r"live handles.*loader"):
        await client.drop_shard(f"{ns}.to.drop")
    assert contents(await read.snapshot_and_fetch(0)) == {(1, "v1"): 1, (2, "v2"): 1}
    await client.drop_shard(f"{ns}.to.drop", force=True)
    with pytest.raises(persist.LeaseExpired):
        await write.compare_and_append(updates([3], 1), 1, 2)
    with pytest.raises(persist.InvalidUsage, match="no shard is named"):
        await client.shard_id(f"{ns}.to.drop")
    info = await client.inspect(sid)
    assert info["finalized"] and info["batches"] == 0 and info["upper"] is None
    assert len(await client.blob.list_keys(f"{sid}/")) == 1  # the tombstone rollup
    with pytest.raises(persist.InvalidUsage, match="finalized"):
        await client.open_writer(sid, SCHEMA)
    await client.drop_shard(sid)  # done already: nothing to do
    again = await client.create_shard(f"{ns}.to.drop", SCHEMA)  # the name is free
    assert again != sid


async def test_drop_shard_with_no_handles_and_unnamed(
    client: persist.PersistClient, ns: str
) -> None:
    sid = persist.ShardId.new()
    write = await client.open_writer(sid, SCHEMA)
    await write.compare_and_append(updates([1], 0), 0, 1)
    await write.expire()
    await client.drop_shard(sid)
    assert (await client.inspect(sid))["finalized"]


@pytest.mark.parametrize(
    "bad",
    ["", "a..b", ".a", "a.", "1abc", "a-b", "a b", "a/b", "é", "x" * 256, 7, None, b"a.b"],
)
async def test_bad_names_are_refused(client: persist.PersistClient, bad: object) -> None:
    with pytest.raises(persist.InvalidUsage, match="name"):
        await client.create_shard(bad, SCHEMA)  # type: ignore[arg-type]
    with pytest.raises(persist.InvalidUsage):
        await client.shard_id(bad)  # type: ignore[arg-type]
    with pytest.raises(persist.InvalidUsage):
        await client.open_writer(bad, SCHEMA)  # type: ignore[arg-type]


async def test_names_survive_indeterminate_catalog_writes(
    location: tuple[str, str], ns: str
) -> None:
    # Every catalog compare-and-set fails half the time, after it took effect or before: each
    # call either succeeds or raises ExternalError, and what landed is exactly what succeeded.
    blob, consensus_uri = location
    inner = open_consensus(consensus_uri)
    faults = Faults(seed=3, fail_before=0.25, fail_after=0.25, ops={"consensus.compare_and_set"})
    config = fast_config(retry_attempts=8)
    async with await persist.connect(blob, FaultyConsensus(inner, faults), config=config) as c:
        created: dict[str, persist.ShardId] = {}
        for i in range(12):
            name = f"{ns}.f.s{i}"
            with contextlib.suppress(persist.ExternalError):
                created[name] = await c.create_shard(name, SCHEMA)
        assert created, "no create got through: the faults are too dense to test anything"
        with faults.suspended():
            listed = {e["name"]: e["shard_id"] for e in await c.list_shards(f"{ns}.f.")}
            for name, sid in created.items():
                assert listed[name] == sid
            # A name that landed though its call failed leads to a shard that exists.
            for name in set(listed) - set(created):
                assert (await c.inspect(listed[name]))["seqno"] >= 1
    assert faults.counts.failed_after > 0 and faults.counts.failed_before > 0


async def test_a_shard_that_cant_be_read_is_listed_with_its_error(
    connect: Connect, ns: str
) -> None:
    client = await connect(retry_attempts=2)
    sid = await client.create_shard(f"{ns}.broken", SCHEMA)
    await client.create_shard(f"{ns}.fine", SCHEMA)
    for key in await client.blob.list_keys(f"{sid}/"):
        await client.blob.delete(key)  # its rollup: the state can't be read any more
    listed = await (await connect(retry_attempts=2)).list_shards(ns)
    assert [e["name"] for e in listed] == [f"{ns}.broken", f"{ns}.fine"]
    assert "rollup" in listed[0]["error"] and "upper" not in listed[0]
    assert listed[1]["upper"] == 0 and "error" not in listed[1]


async def test_opening_a_new_name_with_a_schema_creates_the_named_shard(
    connect: Connect, ns: str
) -> None:
    clients = [await connect() for _ in range(3)]
    name = f"{ns}.fresh"
    writers = await asyncio.gather(*(c.open_writer(name, SCHEMA) for c in clients))
    sid = await clients[0].shard_id(name)
    assert {w.shard_id for w in writers} == {sid}  # racing openers meet on one shard
    with pytest.raises(persist.InvalidUsage, match="no shard is named"):
        await clients[0].open_leased_reader(f"{ns}.other")  # no schema: it must exist


def _other_blob(blob: str) -> str:
    """Another blob location of the same kind as ``blob``."""
    if blob.startswith("mem://"):
        return f"mem://{uuid.uuid4().hex}"
    if blob.startswith("file://"):
        return blob + "-other"
    bucket_prefix, query = blob.split("?", 1)
    return f"{bucket_prefix}-other?{query}"


async def test_a_shard_of_another_blob_location_is_named_as_such(
    connect: Connect, location: tuple[str, str], ns: str
) -> None:
    # Two clients share the consensus but not the blob location: each finds the other's
    # shards in the catalog, and their state names rollups its own blob never held.
    here = await connect(retry_attempts=2)
    blob, consensus = location
    there = await persist.connect(
        _other_blob(blob), consensus, config=fast_config(retry_attempts=2)
    )
    async with there:
        theirs = await there.create_shard(f"{ns}.theirs", SCHEMA)
        w = await there.open_writer(theirs)
        await w.compare_and_append(updates([1], 0), 0, 1)
        await there.maintain(theirs)
        ours = await here.create_shard(f"{ns}.ours", SCHEMA)
        for call in (
            lambda: here.open_writer(theirs),
            lambda: here.inspect(f"{ns}.theirs"),
            lambda: asyncio.to_thread(persist.read_table, theirs, blob=blob, consensus=consensus),
        ):
            with pytest.raises(persist.InvalidUsage, match="another blob location"):
                await call()
        listed = {e["name"]: e for e in await here.list_shards(ns)}
        assert listed[f"{ns}.theirs"]["other_blob_location"] is True
        assert "another blob location" in listed[f"{ns}.theirs"]["error"]
        assert listed[f"{ns}.ours"]["shard_id"] == ours and listed[f"{ns}.ours"]["upper"] == 0
        assert "other_blob_location" not in listed[f"{ns}.ours"]
        assert (await there.list_shards(ns))[0]["other_blob_location"] is True  # ours, there
        assert (await there.inspect(theirs))["upper"] == 1  # its own location reads it


async def test_a_rollup_lost_from_its_own_blob_location_is_an_integrity_error(
    connect: Connect,
) -> None:
    client = await connect(retry_attempts=2, inline_writes_max_bytes=0)
    sid = await client.create_shard(f"t{uuid.uuid4().hex[:12]}.lost", SCHEMA)
    w = await client.open_writer(sid)
    await w.compare_and_append(updates([1], 0), 0, 1)  # a part in blob: the shard's is there
    for key in await client.blob.list_keys(f"{sid}/rollup/"):
        await client.blob.delete(key)
    with pytest.raises(persist.IntegrityError, match="rollup") as info:
        await (await connect(retry_attempts=2)).inspect(sid)
    assert "another blob location" not in str(info.value)
