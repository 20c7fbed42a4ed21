"""The bad-input catalogue: every misuse the contract names, hostile shard ids, malformed
split and batch bytes, and damaged blobs and state entries.

Each gets a clear, typed error and leaves the shard unchanged and readable: nothing is written
to consensus or blob (the location's files and rows are compared byte for byte before and
after), and the contents read the same. It runs on a file blob + SQLite consensus, so damage is
done to the real files and rows on disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pyarrow as pa
import pytest

import persist
from persist.core.shard import codec
from persist.testing import contents_of

from .conftest import Figures

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def updates(keys: list[int], time: int | list[int], diff: int = 1) -> pa.Table:
    times = time if isinstance(time, list) else [time] * len(keys)
    return pa.table(
        {
            "k": pa.array(keys, pa.int64()),
            "v": pa.array([f"v{k}" for k in keys], pa.string()),
            "_time": pa.array(times, pa.uint64()),
            "_diff": pa.array([diff] * len(keys), pa.int64()),
        }
    )


def config(**overrides: object) -> persist.PersistConfig:
    # No maintenance in the background: a test compares the location's files before and after
    # a misuse, and only persist's reaction to the misuse may show there (none must).
    base: dict[str, object] = {
        "poll_interval_s": 0.01,
        "retry_initial_delay_s": 0.001,
        "compaction_enabled": False,
        # Reads come from storage, where the damage is, not from the writer's memory of it,
        # and parts are in blob, not inline in the state.
        "recent_parts_bytes": 0,
        "inline_writes_max_bytes": 0,
    }
    base.update(overrides)
    return persist.PersistConfig(**base)  # type: ignore[arg-type]


@dataclass
class Ctx:
    """A shard with data at times 0 and 1 (upper 2), and a reader at since 1."""

    root: Path
    client: persist.PersistClient
    shard: persist.ShardId
    w: persist.WriteHandle
    r: persist.ReadHandle
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def blob_uri(self) -> str:
        return (self.root / "blob").as_uri()

    @property
    def db(self) -> Path:
        return self.root / "consensus.db"

    @property
    def consensus_uri(self) -> str:
        return f"sqlite://{self.db}"

    async def connect(self, **overrides: object) -> persist.PersistClient:
        return await persist.connect(self.blob_uri, self.consensus_uri, config=config(**overrides))


async def make_ctx(root: Path, **overrides: object) -> Ctx:
    blob, consensus = (root / "blob").as_uri(), f"sqlite://{root / 'consensus.db'}"
    client = await persist.connect(blob, consensus, config=config(**overrides))
    shard = persist.ShardId.new()
    w, r = await client.open(shard, SCHEMA, "catalogue")
    await w.compare_and_append(updates([1, 2], [0, 1]), 0, 2)
    await r.downgrade_since(1)
    await client.maintain(shard)  # nothing left in the background to change the location
    return Ctx(root, client, shard, w, r)


def location_fingerprint(root: Path) -> dict[str, str]:
    """Every blob file and every consensus row, hashed: a change anywhere shows."""
    out: dict[str, str] = {}
    for path in sorted((root / "blob").rglob("*")):
        if path.is_file():
            out[f"blob:{path.relative_to(root)}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    with sqlite3.connect(root / "consensus.db") as conn:
        for shard, seqno, data in conn.execute("SELECT shard, seqno, data FROM consensus"):
            out[f"consensus:{shard}@{seqno}"] = hashlib.sha256(data).hexdigest()
    return out


async def readable_contents(ctx: Ctx) -> dict[tuple[object, ...], int]:
    """The contents as of 1, read by a fresh client (so from storage, not a cache)."""
    client = await ctx.connect()
    async with client:
        read = await client.open_leased_reader(ctx.shard, SCHEMA, "check")
        got = contents_of(await read.snapshot_and_fetch(1), SCHEMA.names, 1)
        await read.expire()
    return got


# --- misuse named by the contract -----------------------------------------------------------------

Misuse = Callable[[Ctx], Awaitable[object]]
Prepare = Callable[[Ctx], Awaitable[None]]


@dataclass(frozen=True)
class Case:
    misuse: Misuse
    error: type[Exception]
    match: str
    prepare: Prepare | None = None


def table(**cols: pa.Array) -> pa.Table:
    return pa.table(cols)


async def _expired_writer(ctx: Ctx) -> None:
    w2 = await ctx.client.open_writer(ctx.shard, SCHEMA, "to expire")
    await w2.expire()
    ctx.extra["w2"] = w2


async def _expired_reader(ctx: Ctx) -> None:
    r2 = await ctx.client.open_leased_reader(ctx.shard, SCHEMA, "to expire")
    await r2.expire()
    ctx.extra["r2"] = r2


async def _lease_ran_out(ctx: Ctx) -> None:
    """A reader and a writer of a client whose clock is ten minutes behind: their heartbeats
    are older than the 60 s lease, so the next commit by anyone expires them."""
    late = await ctx.connect(now_ms=lambda: time.time_ns() // 1_000_000 - 600_000)
    ctx.extra["late"] = late
    ctx.extra["r2"] = await late.open_leased_reader(ctx.shard, SCHEMA, "late")
    ctx.extra["w2"] = await late.open_writer(ctx.shard, SCHEMA, "late")
    await ctx.w.compare_and_append(updates([], 2), 2, 2)  # any commit expires them


async def _closed_client(ctx: Ctx) -> None:
    closed = await ctx.connect()
    await closed.close()
    ctx.extra["closed"] = closed


async def _other_shard_batch(ctx: Ctx) -> None:
    other = persist.ShardId.new()
    w2 = await ctx.client.open_writer(other, SCHEMA, "other")
    ctx.extra["batch"] = await w2.batch(updates([9], 2), 2, 3)


async def _finalized_shard(ctx: Ctx) -> None:
    other = persist.ShardId.new()
    w2, r2 = await ctx.client.open(other, SCHEMA, "finalize")
    await ctx.client.set_retention(other, None)  # else the retention holds the since
    await w2.compare_and_append(updates([], 0), 0, None)
    await r2.downgrade_since(None)
    await ctx.client.finalize(other)
    ctx.extra["finalized"] = other


async def _batch_2_4(ctx: Ctx) -> None:
    ctx.extra["made"] = await ctx.w.batch(updates([7], 2), 2, 4)


async def _batch_2_3(ctx: Ctx) -> None:
    ctx.extra["made"] = await ctx.w.batch(updates([7], 2), 2, 3)


async def _strict_shard(ctx: Ctx) -> None:
    strict = pa.schema([("k", pa.int64(), False)])
    ctx.extra["strict"] = await ctx.client.open_writer(persist.ShardId.new(), strict)


async def _appended_batch(ctx: Ctx) -> None:
    batch = await ctx.w.batch(updates([5], 2), 2, 3)
    await ctx.w.compare_and_append_batch([batch], 2, 3)
    ctx.extra["batch"] = batch


T0 = pa.array([2], pa.uint64())

CASES: dict[str, Case] = {
    # Updates and their times.
    "time below expected upper": Case(
        lambda c: c.w.compare_and_append(updates([1], 1), 2, 5), persist.InvalidUsage, "outside"
    ),
    "time at new upper": Case(
        lambda c: c.w.compare_and_append(updates([1], 5), 2, 5), persist.InvalidUsage, "outside"
    ),
    "new upper below expected": Case(
        lambda c: c.w.compare_and_append(updates([], 2), 2, 1), persist.InvalidUsage, "below"
    ),
    "data after the empty upper": Case(
        lambda c: c.w.compare_and_append(updates([1], 2), None, None),
        persist.InvalidUsage,
        "upper is None",
    ),
    "negative time": Case(
        lambda c: c.w.compare_and_append(
            table(k=pa.array([1]), v=pa.array(["a"]), _time=pa.array([-1])), 2, 5
        ),
        persist.InvalidUsage,
        "negative",
    ),
    "float time": Case(
        lambda c: c.w.compare_and_append(
            table(k=pa.array([1]), v=pa.array(["a"]), _time=pa.array([2.0])), 2, 5
        ),
        persist.InvalidUsage,
        "unsigned integer",
    ),
    "null time": Case(
        lambda c: c.w.compare_and_append(
            table(k=pa.array([1]), v=pa.array(["a"]), _time=pa.array([None], pa.uint64())), 2, 5
        ),
        persist.InvalidUsage,
        "nulls",
    ),
    "float diff": Case(
        lambda c: c.w.compare_and_append(
            table(k=pa.array([1]), v=pa.array(["a"]), _time=T0, _diff=pa.array([1.0])), 2, 5
        ),
        persist.InvalidUsage,
        "_diff",
    ),
    "null diff": Case(
        lambda c: c.w.compare_and_append(
            table(k=pa.array([1]), v=pa.array(["a"]), _time=T0, _diff=pa.array([None], pa.int64())),
            2,
            5,
        ),
        persist.InvalidUsage,
        "nulls",
    ),
    "diff beyond int64": Case(
        lambda c: c.w.compare_and_append(
            table(
                k=pa.array([1]), v=pa.array(["a"]), _time=T0, _diff=pa.array([2**63], pa.uint64())
            ),
            2,
            5,
        ),
        persist.InvalidUsage,
        "int64",
    ),
    "reserved column in updates": Case(
        lambda c: c.w.compare_and_append(updates([1], 2).append_column("_x", pa.array([1])), 2, 5),
        persist.InvalidUsage,
        "reserved",
    ),
    "missing column": Case(
        lambda c: c.w.compare_and_append(table(k=pa.array([1]), _time=T0), 2, 5),
        persist.InvalidUsage,
        "lack",
    ),
    "extra column": Case(
        lambda c: c.w.compare_and_append(updates([1], 2).append_column("z", pa.array([1])), 2, 5),
        persist.InvalidUsage,
        "schema lacks",
    ),
    "column of another type": Case(
        lambda c: c.w.compare_and_append(
            table(k=pa.array([1], pa.uint64()), v=pa.array(["a"]), _time=T0), 2, 5
        ),
        persist.InvalidUsage,
        "type uint64",
    ),
    "null in a non-nullable column": Case(
        lambda c: c.extra["strict"].compare_and_append(  # type: ignore[attr-defined]
            table(k=pa.array([None], pa.int64()), _time=pa.array([0], pa.uint64())), 0, 1
        ),
        persist.InvalidUsage,
        "not nullable",
        _strict_shard,
    ),
    "not a table": Case(
        lambda c: c.w.compare_and_append([(1, "a", 2, 1)], 2, 5),  # type: ignore[arg-type]
        persist.InvalidUsage,
        "pyarrow",
    ),
    # Frontiers.
    "negative expected upper": Case(
        lambda c: c.w.compare_and_append(updates([], 0), -1, 5), persist.InvalidUsage, "time"
    ),
    "string upper": Case(
        lambda c: c.w.compare_and_append(updates([], 2), 2, "5"),  # type: ignore[arg-type]
        persist.InvalidUsage,
        "time",
    ),
    "bool upper": Case(
        lambda c: c.w.compare_and_append(updates([], 2), 2, True), persist.InvalidUsage, "time"
    ),
    "upper of 2**64": Case(
        lambda c: c.w.compare_and_append(updates([], 2), 2, 2**64), persist.InvalidUsage, "time"
    ),
    "append upper below lower": Case(
        lambda c: c.w.append(updates([], 2), 2, 1), persist.InvalidUsage, "below"
    ),
    "append lower None": Case(
        lambda c: c.w.append(updates([], 2), None, 3),  # type: ignore[arg-type]
        persist.InvalidUsage,
        "lower",
    ),
    "batch upper below lower": Case(
        lambda c: c.w.batch(updates([], 2), 3, 1), persist.InvalidUsage, "below"
    ),
    "batch time outside": Case(
        lambda c: c.w.batch(updates([1], 9), 2, 3), persist.InvalidUsage, "outside"
    ),
    # Batches.
    "batch of another shard": Case(
        lambda c: c.w.compare_and_append_batch([c.extra["batch"]], 2, 3),  # type: ignore[list-item]
        persist.InvalidUsage,
        "belongs to shard",
        _other_shard_batch,
    ),
    "batch outside the commit's range": Case(
        lambda c: c.w.compare_and_append_batch([c.extra["made"]], 2, 3),  # type: ignore[list-item]
        persist.InvalidUsage,
        "not within",
        _batch_2_4,
    ),
    "same batch twice": Case(
        lambda c: c.w.compare_and_append_batch(
            [c.extra["made"], c.extra["made"]],  # type: ignore[list-item]
            2,
            3,
        ),
        persist.InvalidUsage,
        "twice",
        _batch_2_3,
    ),
    "batch appended again": Case(
        lambda c: c.w.compare_and_append_batch([c.extra["batch"]], 3, 4),  # type: ignore[list-item]
        persist.InvalidUsage,
        "not within|already",
        _appended_batch,
    ),
    "delete an appended batch": Case(
        lambda c: c.client.delete_batch(c.extra["batch"]),  # type: ignore[arg-type]
        persist.InvalidUsage,
        "was appended",
        _appended_batch,
    ),
    "not a batch": Case(
        lambda c: c.w.compare_and_append_batch(["nope"], 2, 3),  # type: ignore[list-item]
        persist.InvalidUsage,
        "Batch",
    ),
    "delete a non-batch": Case(
        lambda c: c.client.delete_batch(b"nope"),  # type: ignore[arg-type]
        persist.InvalidUsage,
        "Batch",
    ),
    # Reading.
    "snapshot below since": Case(lambda c: c.r.snapshot(0), persist.InvalidUsage, "below"),
    "snapshot_and_fetch below since": Case(
        lambda c: c.r.snapshot_and_fetch(0), persist.InvalidUsage, "below"
    ),
    "listen below since": Case(lambda c: c.r.listen(0).__anext__(), persist.InvalidUsage, "below"),
    "snapshot as_of None": Case(
        lambda c: c.r.snapshot(None),  # type: ignore[arg-type]
        persist.InvalidUsage,
        "time",
    ),
    "zero splits": Case(
        lambda c: c.r.snapshot(1, num_splits=0), persist.InvalidUsage, "num_splits"
    ),
    "bool splits": Case(
        lambda c: c.r.snapshot(1, num_splits=True), persist.InvalidUsage, "num_splits"
    ),
    "since backwards": Case(lambda c: c.r.downgrade_since(0), persist.InvalidUsage, "backwards"),
    "since not a time": Case(
        lambda c: c.r.downgrade_since("3"),  # type: ignore[arg-type]
        persist.InvalidUsage,
        "time",
    ),
    "fetch a non-split": Case(
        lambda c: c.client.fetch_split(b"nope"),  # type: ignore[arg-type]
        persist.InvalidUsage,
        "Split",
    ),
    # Schemas.
    "reopen with another schema": Case(
        lambda c: c.client.open_writer(c.shard, pa.schema([("k", pa.int64())])),
        persist.InvalidUsage,
        "schema",
    ),
    # (Nullability alone is no mismatch: the data's nulls are checked when written.)
    "reopen with a lossy type change": Case(
        lambda c: c.client.open_leased_reader(
            c.shard, pa.schema([("k", pa.string()), ("v", pa.string())])
        ),
        persist.InvalidUsage,
        "schema",
    ),
    "schema with a reserved name": Case(
        lambda c: c.client.open_writer(persist.ShardId.new(), pa.schema([("_x", pa.int64())])),
        persist.InvalidUsage,
        "reserved",
    ),
    "empty schema": Case(
        lambda c: c.client.open_writer(persist.ShardId.new(), pa.schema([])),
        persist.InvalidUsage,
        "at least one column",
    ),
    "nested schema": Case(
        lambda c: c.client.open_writer(
            persist.ShardId.new(), pa.schema([("l", pa.list_(pa.int64()))])
        ),
        persist.InvalidUsage,
        "can't sort",
    ),
    "not a schema": Case(
        lambda c: c.client.open_writer(persist.ShardId.new(), "k int"),  # type: ignore[arg-type]
        persist.InvalidUsage,
        "pyarrow.Schema",
    ),
    # Handles, leases, clients.
    "writer used after expire": Case(
        lambda c: c.extra["w2"].compare_and_append(updates([1], 2), 2, 3),  # type: ignore[attr-defined]
        persist.LeaseExpired,
        "expired",
        _expired_writer,
    ),
    "reader used after expire": Case(
        lambda c: c.extra["r2"].snapshot(1),  # type: ignore[attr-defined]
        persist.LeaseExpired,
        "expired",
        _expired_reader,
    ),
    "writer whose lease ran out": Case(
        lambda c: c.extra["w2"].compare_and_append(updates([1], 2), 2, 3),  # type: ignore[attr-defined]
        persist.LeaseExpired,
        "not registered|expired",
        _lease_ran_out,
    ),
    "reader whose lease ran out": Case(
        lambda c: c.extra["r2"].downgrade_since(1),  # type: ignore[attr-defined]
        persist.LeaseExpired,
        "not registered|expired",
        _lease_ran_out,
    ),
    "closed client": Case(
        lambda c: c.extra["closed"].open_writer(c.shard, SCHEMA),  # type: ignore[attr-defined]
        persist.InvalidUsage,
        "closed",
        _closed_client,
    ),
    # Shards.
    "finalize a live shard": Case(
        lambda c: c.client.finalize(c.shard), persist.InvalidUsage, "since and upper"
    ),
    "open a finalized shard": Case(
        lambda c: c.client.open_writer(c.extra["finalized"], SCHEMA),  # type: ignore[arg-type]
        persist.InvalidUsage,
        "finalized",
        _finalized_shard,
    ),
    "inspect an unknown shard": Case(
        lambda c: c.client.inspect(persist.ShardId.new()), persist.InvalidUsage, "does not exist"
    ),
    "maintain an unknown shard": Case(
        lambda c: c.client.maintain(persist.ShardId.new()), persist.InvalidUsage, "does not exist"
    ),
    "finalize an unknown shard": Case(
        lambda c: c.client.finalize(persist.ShardId.new()), persist.InvalidUsage, "does not exist"
    ),
    # Locations.
    "unknown blob scheme": Case(
        lambda c: persist.connect("ftp://x/y", c.consensus_uri), persist.InvalidUsage, "scheme"
    ),
    "file blob with a host": Case(
        lambda c: persist.connect("file://host/x", c.consensus_uri),
        persist.InvalidUsage,
        "file:///",
    ),
    "s3 blob without a bucket": Case(
        lambda c: persist.connect("s3:///prefix", c.consensus_uri), persist.InvalidUsage, "bucket"
    ),
    "relative sqlite path": Case(
        lambda c: persist.connect(c.blob_uri, "sqlite://relative.db"),
        persist.InvalidUsage,
        "absolute",
    ),
    "unknown consensus scheme": Case(
        lambda c: persist.connect(c.blob_uri, "mysql://x/y"), persist.InvalidUsage, "scheme"
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
async def test_misuse_is_refused_and_changes_nothing(
    name: str, tmp_path: Path, figures: Figures
) -> None:
    case = CASES[name]
    ctx = await make_ctx(tmp_path)
    try:
        if case.prepare is not None:
            await case.prepare(ctx)
        contents = await readable_contents(ctx)
        before = location_fingerprint(tmp_path)
        with pytest.raises(case.error, match=case.match) as info:
            await case.misuse(ctx)
        assert str(info.value), "an error must say what was wrong"
        assert location_fingerprint(tmp_path) == before, "the misuse changed the location"
        assert await readable_contents(ctx) == contents
        # The shard still takes writes and reads from its own handles.
        upper = await ctx.w.fetch_recent_upper()
        assert isinstance(upper, int)
        await ctx.w.compare_and_append(updates([100], upper), upper, upper + 1)
        got = contents_of(await ctx.r.snapshot_and_fetch(upper), SCHEMA.names, upper)
        assert got[(100, "v100")] == 1
    finally:
        late = ctx.extra.get("late")
        if isinstance(late, persist.PersistClient):
            await late.close()
        await ctx.client.close()
    figures.bad_inputs_refused += 1


# --- hostile shard ids -------------------------------------------------------------------------------

HOSTILE_SHARD_IDS: list[object] = [
    "",
    ".",
    "..",
    "../etc/passwd",
    "s../../x",
    "/abs/path",
    "s00000000-0000-0000-0000-000000000001/../../x",
    "s00000000-0000-0000-0000-00000000000/",
    "S00000000-0000-0000-0000-000000000001",
    "s00000000-0000-0000-0000-000000000001\n",
    " s00000000-0000-0000-0000-000000000001",
    "s00000000-0000-0000-0000-000000000001\x00",
    "s" + "0" * 100_000,
    "x" * 1_000_000,
    "sé",
    "s\u0660\u0661",  # Arabic-Indic digits
    "\uff5300000000-0000-0000-0000-000000000001",  # a full-width s
    "s\ud800",  # a lone surrogate
    "s00000000-0000-0000-0000-000000000001%2F..",
    42,
    None,
    b"s00000000-0000-0000-0000-000000000001",
    ["s00000000-0000-0000-0000-000000000001"],
]

ENTRY_POINTS: dict[str, Callable[[persist.PersistClient, object], Awaitable[object]]] = {
    "open_writer": lambda c, s: c.open_writer(s, SCHEMA),  # type: ignore[arg-type]
    "open_leased_reader": lambda c, s: c.open_leased_reader(s, SCHEMA),  # type: ignore[arg-type]
    "open": lambda c, s: c.open(s, SCHEMA),  # type: ignore[arg-type]
    "inspect": lambda c, s: c.inspect(s),  # type: ignore[arg-type]
    "maintain": lambda c, s: c.maintain(s),  # type: ignore[arg-type]
    "finalize": lambda c, s: c.finalize(s),  # type: ignore[arg-type]
}


@pytest.mark.parametrize(
    "shard_id", HOSTILE_SHARD_IDS, ids=lambda s: repr(s)[:40] + ("..." if len(repr(s)) > 40 else "")
)
async def test_hostile_shard_ids_are_refused(
    shard_id: object, tmp_path: Path, figures: Figures
) -> None:
    ctx = await make_ctx(tmp_path)
    try:
        before = location_fingerprint(tmp_path)
        with pytest.raises(persist.InvalidUsage, match="shard id"):
            persist.ShardId(shard_id)
        for name, call in ENTRY_POINTS.items():
            with pytest.raises(persist.InvalidUsage, match="shard id"):
                await call(ctx.client, shard_id)
            figures.bad_inputs_refused += 1
            assert location_fingerprint(tmp_path) == before, f"{name} changed the location"
        assert await readable_contents(ctx) == {(2, "v2"): 1, (1, "v1"): 1}
    finally:
        await ctx.client.close()


# --- malformed split and batch bytes ---------------------------------------------------------------


def _mutations(data: bytes) -> list[tuple[str, object]]:
    """Truncations at every length, one bit flipped at every byte, and a few oddities."""
    out: list[tuple[str, object]] = [(f"truncated to {n}", data[:n]) for n in range(len(data))]
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 1 << (i % 8)
        out.append((f"bit {i % 8} of byte {i} flipped", bytes(flipped)))
    out += [
        ("a byte appended", data + b"\x00"),
        ("twice over", data + data),
        ("garbage", b"garbage"),
        ("empty", b""),
        ("text", data.decode("latin-1")),
        ("None", None),
        ("an int", 42),
    ]
    return out


async def test_malformed_split_and_batch_bytes_are_refused(
    tmp_path: Path, figures: Figures
) -> None:
    ctx = await make_ctx(tmp_path)
    try:
        (split,) = await ctx.r.snapshot(1)
        batch = await ctx.w.batch(updates([3], 2), 2, 3)
        good = {persist.Split: split.to_bytes(), persist.Batch: batch.to_bytes()}
        # Valid bytes, and their bytearray / memoryview forms, are accepted.
        for cls, data in good.items():
            for form in (data, bytearray(data), memoryview(data)):
                assert cls.from_bytes(form) == cls.from_bytes(data)  # type: ignore[attr-defined]
        # Each kind's bytes are refused as the other kind.
        with pytest.raises(persist.InvalidUsage, match="batch"):
            persist.Batch.from_bytes(good[persist.Split])
        with pytest.raises(persist.InvalidUsage, match="split"):
            persist.Split.from_bytes(good[persist.Batch])
        # Checksummed frames of the right kind whose payload is not a split / batch.
        for payload in ({"x": 1}, [1, 2, 3], "text", None):
            with pytest.raises(persist.InvalidUsage, match="split"):
                persist.Split.from_bytes(codec.encode_frame(codec.KIND_SPLIT, payload))
            with pytest.raises(persist.InvalidUsage, match="batch"):
                persist.Batch.from_bytes(codec.encode_frame(codec.KIND_BATCH, payload))
        before = location_fingerprint(tmp_path)
        refused = 0
        for cls, data in good.items():
            for what, bad in _mutations(data):
                with pytest.raises(persist.InvalidUsage, match=r"split|batch|Split|Batch") as info:
                    cls.from_bytes(bad)  # type: ignore[attr-defined]
                assert str(info.value), what
                refused += 1
        assert location_fingerprint(tmp_path) == before
        # A forged split (valid frame) naming keys outside the location is refused on fetch.
        part = split.parts[0]
        forged = msgspec.structs.replace(
            split, parts=(msgspec.structs.replace(part, key="../../../etc/passwd"),)
        )
        with pytest.raises(persist.InvalidUsage):
            await ctx.client.fetch_split(persist.Split.from_bytes(forged.to_bytes()))
        # A forged split whose schema bytes are not a schema is refused as it is decoded.
        with pytest.raises(persist.InvalidUsage, match="schema"):
            persist.Split.from_bytes(
                msgspec.structs.replace(split, schema=b"not a schema").to_bytes()
            )
        # A forged batch naming a part of the shard it did not write (here: one of the shard's
        # own appended parts, which GC would delete with the batch) is refused on append.
        stolen = msgspec.structs.replace(
            batch.hollow, parts=(msgspec.structs.replace(batch.hollow.parts[0], key=part.key),)
        )
        forged_batch = msgspec.structs.replace(batch, hollow=stolen)
        with pytest.raises(persist.InvalidUsage, match="did not write"):
            await ctx.w.compare_and_append_batch(
                [persist.Batch.from_bytes(forged_batch.to_bytes())], 2, 3
            )
        assert location_fingerprint(tmp_path) == before
        # The real ones still work.
        got = contents_of(await ctx.client.fetch_split(split), SCHEMA.names, 1)
        assert got == {(1, "v1"): 1, (2, "v2"): 1}
        await ctx.client.delete_batch(batch)
        figures.bad_inputs_refused += refused + 3
        assert refused > 500
    finally:
        await ctx.client.close()


# --- damaged blobs and state entries ----------------------------------------------------------------

Damage = Callable[[bytes], bytes]
DAMAGE: dict[str, Damage] = {
    "truncated to half": lambda b: b[: len(b) // 2],
    "emptied": lambda b: b"",
    "one bit flipped in the middle": lambda b: (
        b[: len(b) // 2] + bytes([b[len(b) // 2] ^ 0x10]) + b[len(b) // 2 + 1 :]
    ),
    "last byte flipped": lambda b: b[:-1] + bytes([b[-1] ^ 0x01]),
    "header byte flipped": lambda b: bytes([b[0] ^ 0x01]) + b[1:],
    "a byte appended": lambda b: b + b"\x00",
}


def _blob_files(root: Path, shard: str, kind: str) -> list[Path]:
    base = root / "blob" / shard
    if kind == "rollup":
        return sorted((base / "rollup").iterdir())
    return sorted(p for p in base.rglob("*") if p.is_file() and "rollup" not in p.parts)


def _consensus_rows(db: Path, shard: str) -> list[tuple[int, bytes]]:
    with sqlite3.connect(db) as conn:
        return list(
            conn.execute(
                "SELECT seqno, data FROM consensus WHERE shard = ? ORDER BY seqno", (shard,)
            )
        )


def _set_row(db: Path, shard: str, seqno: int, data: bytes) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE consensus SET data = ? WHERE shard = ? AND seqno = ?", (data, shard, seqno)
        )


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("target", ["part", "rollup", "head diff", "older diff"])
async def test_damaged_storage_is_an_integrity_error(
    target: str, damage: str, tmp_path: Path, figures: Figures
) -> None:
    ctx = await make_ctx(tmp_path)
    # More state versions, so there is a diff between the rollup and the head.
    await ctx.w.compare_and_append(updates([3], 2), 2, 3)
    await ctx.r.downgrade_since(1)
    contents = await readable_contents(ctx)
    restore: list[Callable[[], None]] = []
    try:
        hurt = DAMAGE[damage]
        if target in ("part", "rollup"):
            files = _blob_files(tmp_path, ctx.shard, target)
            assert files, target
            for path in files:
                original = path.read_bytes()
                path.write_bytes(hurt(original))
                restore.append(lambda p=path, o=original: p.write_bytes(o))  # type: ignore[misc]
        else:
            rows = _consensus_rows(ctx.db, ctx.shard)
            assert len(rows) >= 3
            seqno, original = rows[-1] if target == "head diff" else rows[-2]
            _set_row(ctx.db, ctx.shard, seqno, hurt(original))
            restore.append(lambda: _set_row(ctx.db, ctx.shard, seqno, original))
        damaged = location_fingerprint(tmp_path)
        fresh = await ctx.connect()
        try:
            with pytest.raises(persist.IntegrityError) as info:
                if target == "part":
                    await ctx.r.snapshot_and_fetch(1)
                else:
                    await fresh.open_leased_reader(ctx.shard, SCHEMA)
            assert info.value.determinate and str(info.value)
            if target == "part":
                (split,) = await ctx.r.snapshot(1)
                with pytest.raises(persist.IntegrityError):
                    await fresh.fetch_split(split)
        finally:
            await fresh.close()
        assert location_fingerprint(tmp_path) == damaged, "persist wrote while data was damaged"
        for undo in restore:
            undo()
        # Repaired, the shard reads as before and takes writes.
        assert await readable_contents(ctx) == contents
        upper = await ctx.w.fetch_recent_upper()
        assert upper == 3
        await ctx.w.compare_and_append(updates([4], 3), 3, 4)
        figures.bad_inputs_refused += 1
    finally:
        await ctx.client.close()


async def test_a_diff_of_another_shard_is_an_integrity_error(
    tmp_path: Path, figures: Figures
) -> None:
    """Well-formed metadata in the wrong place (another shard's head diff, another shard's
    rollup) is refused too: checksums alone would not catch it."""
    ctx = await make_ctx(tmp_path)
    try:
        other = persist.ShardId.new()
        w2, _ = await ctx.client.open(other, SCHEMA)
        await w2.compare_and_append(updates([8], 0), 0, 1)
        mine = _consensus_rows(ctx.db, ctx.shard)[-1]
        theirs = _consensus_rows(ctx.db, other)[-1]
        contents = await readable_contents(ctx)
        _set_row(ctx.db, ctx.shard, mine[0], theirs[1])
        fresh = await ctx.connect()
        try:
            with pytest.raises(persist.IntegrityError):
                await fresh.open_leased_reader(ctx.shard, SCHEMA)
        finally:
            await fresh.close()
        _set_row(ctx.db, ctx.shard, mine[0], mine[1])
        (rollup,) = _blob_files(tmp_path, ctx.shard, "rollup")
        (their_rollup,) = _blob_files(tmp_path, other, "rollup")
        original = rollup.read_bytes()
        rollup.write_bytes(their_rollup.read_bytes())
        fresh = await ctx.connect()
        try:
            with pytest.raises(persist.IntegrityError, match="holds"):
                await fresh.open_leased_reader(ctx.shard, SCHEMA)
        finally:
            await fresh.close()
        rollup.write_bytes(original)
        assert await readable_contents(ctx) == contents
        figures.bad_inputs_refused += 2
    finally:
        await ctx.client.close()


async def test_a_missing_part_is_an_integrity_error(tmp_path: Path, figures: Figures) -> None:
    """A part gone from blob while the state still names it (lost, or deleted by hand) is
    reported, never read as an empty part; maintenance around it ends and changes nothing."""
    ctx = await make_ctx(tmp_path)
    try:
        await ctx.w.compare_and_append(updates([3], 2), 2, 3)  # something for a listen at 1
        (split,) = await ctx.r.snapshot(1)
        files = _blob_files(tmp_path, ctx.shard, "part")
        assert files
        saved = {path: path.read_bytes() for path in files}
        for path in files:
            path.unlink()
        with pytest.raises(persist.IntegrityError, match="missing"):
            await ctx.r.snapshot_and_fetch(1)
        with pytest.raises(persist.IntegrityError, match="missing"):
            await ctx.r.listen(1).__anext__()
        # Through a split, the reader may simply have let go of it: a usage error says so.
        with pytest.raises(persist.InvalidUsage, match="gone"):
            await ctx.client.fetch_split(split)
        for path, data in saved.items():
            path.write_bytes(data)
        assert await readable_contents(ctx) == {(1, "v1"): 1, (2, "v2"): 1}
        figures.bad_inputs_refused += 3
    finally:
        await ctx.client.close()


async def test_maintenance_with_a_corrupt_part_ends_and_keeps_the_data(
    tmp_path: Path, figures: Figures
) -> None:
    """A merge whose input does not decode is abandoned (not retried forever) and the shard
    keeps its batches; once repaired, maintenance merges them."""
    ctx = await make_ctx(tmp_path, compaction_min_parts=1)  # even two parts are rewritten
    try:
        for t in range(2, 6):
            await ctx.w.compare_and_append(updates([10 + t], t), t, t + 1)
        before = await ctx.client.inspect(ctx.shard)
        assert before["batches"] > 1
        files = _blob_files(tmp_path, ctx.shard, "part")
        saved = {path: path.read_bytes() for path in files}
        for path in files:
            path.write_bytes(DAMAGE["one bit flipped in the middle"](saved[path]))
        done = await asyncio.wait_for(ctx.client.maintain(ctx.shard), 60)
        assert done["merges"] == 0
        after = await ctx.client.inspect(ctx.shard)
        assert (after["batches"], after["upper"]) == (before["batches"], before["upper"])
        with pytest.raises(persist.IntegrityError):
            await ctx.r.snapshot_and_fetch(5)
        for path, data in saved.items():
            path.write_bytes(data)
        done = await asyncio.wait_for(ctx.client.maintain(ctx.shard), 60)
        assert done["merges"] >= 1
        assert (await ctx.client.inspect(ctx.shard))["batches"] < before["batches"]
        got = contents_of(await ctx.r.snapshot_and_fetch(5), SCHEMA.names, 5)
        assert got == {
            (1, "v1"): 1,
            (2, "v2"): 1,
            **{(10 + t, f"v{10 + t}"): 1 for t in range(2, 6)},
        }
        figures.bad_inputs_refused += 1
    finally:
        await ctx.client.close()
