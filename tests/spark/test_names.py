"""Shards by name through a real local Spark: option name= beside shard=, resolved once."""

from __future__ import annotations

import uuid
from typing import Any

import pyarrow as pa
import pytest

import persist
import persist.spark
from tests.spark.conftest import Location

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def _named(loc: Location, name: str, **more: object) -> dict[str, str]:
    options = loc.options("", **more)
    del options["shard"]
    return options | {"name": name}


def test_write_and_read_by_name(spark: Any, loc: Location) -> None:
    name = f"t{uuid.uuid4().hex[:12]}.sales.orders"
    df = spark.createDataFrame([(1, "a"), (2, "b")], "k long, v string")
    df.write.format("persist").options(**_named(loc, name)).mode("append").save()
    sid = loc.run(lambda c: c.shard_id(name))  # the write created the shard under the name
    more = spark.createDataFrame([(3, "c")], "k long, v string")
    more.write.format("persist").options(**_named(loc, name)).mode("append").save()
    assert loc.run(lambda c: c.shard_id(name)) == sid
    loaded = spark.read.format("persist").options(**_named(loc, name)).load()
    assert sorted(tuple(r) for r in loaded.collect()) == [(1, "a"), (2, "b"), (3, "c")]
    native = persist.spark.read(spark, **_named(loc, name))
    try:
        assert sorted(tuple(r) for r in native.collect()) == [(1, "a"), (2, "b"), (3, "c")]
    finally:
        persist.spark.release(native)
    # Resolved once: after a rename and a new shard under the old name, the DataFrame loaded
    # by name still reads its shard.
    loc.run(lambda c: c.rename_shard(name, name + "_old"))
    loc.run(lambda c: c.create_shard(name, SCHEMA))
    assert sorted(tuple(r) for r in loaded.collect()) == [(1, "a"), (2, "b"), (3, "c")]
    fresh = spark.read.format("persist").options(**_named(loc, name)).load()
    assert fresh.collect() == []


def test_option_shard_takes_a_name(spark: Any, loc: Location) -> None:
    # As every call that takes a shard id: option shard takes a name too.
    name = f"t{uuid.uuid4().hex[:12]}.sales.by_shard"
    df = spark.createDataFrame([(1, "a"), (2, "b")], "k long, v string")
    df.write.format("persist").options(**loc.options(name)).mode("append").save()
    sid = loc.run(lambda c: c.shard_id(name))  # created under the name
    loaded = spark.read.format("persist").options(**loc.options(name)).load()
    assert sorted(tuple(r) for r in loaded.collect()) == [(1, "a"), (2, "b")]
    native = persist.spark.read(spark, **loc.options(name))
    try:
        assert sorted(tuple(r) for r in native.collect()) == [(1, "a"), (2, "b")]
    finally:
        persist.spark.release(native)
    assert loc.run(lambda c: c.shard_id(name)) == sid
    missing = f"t{uuid.uuid4().hex[:12]}.missing"
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: option shard: no shard is named"):
        spark.read.format("persist").options(**loc.options(missing)).load().collect()
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: option shard: not a shard id or"):
        spark.read.format("persist").options(**loc.options("bad-name")).load().collect()


def test_bad_names_are_invalid_usage(spark: Any, loc: Location) -> None:
    missing = f"t{uuid.uuid4().hex[:12]}.missing"
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: option name: no shard is named"):
        spark.read.format("persist").options(**_named(loc, missing)).load().collect()
    with pytest.raises(persist.InvalidUsage, match="no shard is named"):
        persist.spark.read(spark, **_named(loc, missing))
    both = _named(loc, missing) | {"shard": str(persist.ShardId.new())}
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: give option shard or option name"):
        spark.read.format("persist").options(**both).load().collect()
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: option name: not a shard name"):
        spark.read.format("persist").options(**_named(loc, "bad-name")).load().collect()


def test_as_of_an_instant(spark: Any, loc: Location) -> None:
    name = f"t{uuid.uuid4().hex[:12]}.events"
    first = spark.createDataFrame([(1, "a")], "k long, v string")
    first.write.format("persist").options(**_named(loc, name)).mode("append").save()
    history = loc.run(lambda c: c.history(name))
    then = history[-1]["at"].isoformat()  # when the first write's upper was reached
    second = spark.createDataFrame([(2, "b")], "k long, v string")
    second.write.format("persist").options(**_named(loc, name)).mode("append").save()
    df = spark.read.format("persist").options(**_named(loc, name, as_of=then)).load()
    assert [tuple(r) for r in df.collect()] == [(1, "a")]
    native = persist.spark.read(spark, **_named(loc, name, as_of=then))
    try:
        assert [tuple(r) for r in native.collect()] == [(1, "a")]
    finally:
        persist.spark.release(native)
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: .*as_of must be a time"):
        spark.read.format("persist").options(**_named(loc, name, as_of="yesterday")).load()
