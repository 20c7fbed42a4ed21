"""The docs' Spark blocks (``<!-- docs-test: spark -->``: README.md's and docs/spark.md's) run,
in page order, in one namespace per page, with a real local Spark.

Their hidden preludes get ``spark`` and ``location``: a location every executor reaches (the
test's file blob and the Postgres consensus) that makes the shards the blocks name.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

import persist
from tests.docs_blocks import PAGES, SPARK, Session, blocks, kind
from tests.spark.conftest import Location

SPARK_PAGES = [p for p in PAGES if any(kind(b) == SPARK for b in blocks(p))]


class DocsLocation:
    def __init__(self, loc: Location) -> None:
        self.blob = loc.blob
        self.consensus = loc.consensus
        self._loc = loc

    def shard(self, columns: dict[str, list[Any]]) -> persist.ShardId:
        """A new shard holding ``columns``' rows, written at time 0 (its upper is 1)."""
        table = pa.table(columns)

        async def make(client: persist.PersistClient) -> persist.ShardId:
            shard = persist.ShardId.new()
            write = await client.open_writer(shard, table.schema, purpose="docs")
            await write.append_next(table)
            await write.expire()
            return shard

        shard: persist.ShardId = self._loc.run(make)
        return shard

    def contents(self, shard: str) -> list[dict[str, Any]]:
        table = persist.read_table(shard, blob=self.blob, consensus=self.consensus)
        return sorted(table.to_pylist(), key=lambda row: tuple(row.values()))


def test_the_spark_pages_are_found() -> None:
    assert SPARK_PAGES == ["README.md", "docs/spark.md"]


@pytest.mark.parametrize("page", SPARK_PAGES)
def test_every_spark_block_of_the_page_runs(spark: Any, loc: Location, page: str) -> None:
    where = DocsLocation(loc)
    session = Session(page, {"spark": spark, "location": where})
    try:
        ran = [b for b in blocks(page) if kind(b) == SPARK]
        for block in ran:
            session.run(block)
    finally:
        session.close()
    ns = session.namespace
    rows = [
        {"user": "ada", "amount": 3},
        {"user": "ada", "amount": 5},
        {"user": "bob", "amount": 4},
    ]
    if page == "README.md":
        # The job's write landed: the sums per user, in the shard the block names.
        totals = where.contents(ns["totals_id"])
        assert totals == [{"user": "ada", "sum(amount)": 8}, {"user": "bob", "sum(amount)": 4}]
        assert ns["changes"].isStreaming
        assert ns["fast"].count() == 3
    else:
        # The write appended what the read loaded; the native read saw the same snapshot.
        assert where.contents(ns["other_id"]) == rows
        printed = session.out.getvalue()
        assert "3 [Row(user='ada', sum(amount)=8), Row(user='bob', sum(amount)=4)]" in printed
        assert "\n2\n" in printed
        # mergeSchema added the column the DataFrame had and the shard lacked.
        assert "['user', 'amount', 'region']" in printed
