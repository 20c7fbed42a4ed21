from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import psycopg
import pytest

from persist.location import Consensus, open_consensus
from persist.location.postgres import PostgresConsensus
from persist.location.testing import ConsensusConformance, ConsensusWriteLock


class TestPostgresConsensus(ConsensusConformance):
    pushes_changes = True

    @pytest.fixture
    def consensus_uri(self, postgres_uri: str) -> str:
        return postgres_uri

    @pytest.fixture
    async def consensus(self, consensus_uri: str) -> AsyncIterator[Consensus]:
        # Tests share the database and table; each test works on its own random keys.
        c = open_consensus(consensus_uri)
        yield c
        await c.close()

    @pytest.fixture
    def consensus_write_lock(self, consensus_uri: str) -> ConsensusWriteLock:
        @asynccontextmanager
        async def hold(key: str) -> AsyncIterator[None]:
            # FOR UPDATE on the head row conflicts with the FOR KEY SHARE the CAS takes on it.
            conn = await psycopg.AsyncConnection.connect(consensus_uri)
            async with conn, conn.transaction():
                await conn.execute(
                    "SELECT 1 FROM consensus WHERE shard = %s ORDER BY seqno DESC LIMIT 1 FOR UPDATE",
                    (key,),
                )
                yield

        return hold


async def test_cas_is_not_fooled_by_a_concurrent_truncate(postgres_uri: str) -> None:
    """A regression test for a race the conformance suite can only hit by luck.

    Writer B's statement sees head 1 and is then held (by a trigger) before inserting seqno 2.
    Meanwhile A appends 2 and 3 and truncates below 3. Without the head-row lock in the CAS,
    B's insert of 2 no longer collides with anything and B "wins" with a stale expectation.
    """
    import asyncio
    import uuid

    import psycopg

    from persist.location.postgres import PostgresConsensus

    table = f"race_{uuid.uuid4().hex[:16]}"
    a = PostgresConsensus(postgres_uri, table=table)
    b = PostgresConsensus(postgres_uri, table=table)
    try:
        key = "k"
        assert await a.compare_and_set(key, None, b"1")
        async with await psycopg.AsyncConnection.connect(postgres_uri, autocommit=True) as conn:
            await conn.execute(
                f"CREATE FUNCTION {table}_slow() RETURNS trigger AS $$ BEGIN "
                "IF NEW.data = 'slow'::bytea THEN PERFORM pg_sleep(1); END IF; "
                "RETURN NEW; END $$ LANGUAGE plpgsql"
            )
            await conn.execute(
                f"CREATE TRIGGER slow BEFORE INSERT ON {table} "
                f"FOR EACH ROW EXECUTE FUNCTION {table}_slow()"
            )
        stale = asyncio.create_task(b.compare_and_set(key, 1, b"slow"))
        await asyncio.sleep(0.3)
        assert await a.compare_and_set(key, 1, b"2")
        assert await a.compare_and_set(key, 2, b"3")
        truncating = asyncio.create_task(a.truncate(key, 3))
        assert not await stale
        assert await truncating == 2
        assert [e.data for e in await a.scan(key, 0, 10)] == [b"3"]
    finally:
        await a.close()
        await b.close()
        async with await psycopg.AsyncConnection.connect(postgres_uri, autocommit=True) as conn:
            await conn.execute(f"DROP TABLE IF EXISTS {table}")
            await conn.execute(f"DROP FUNCTION IF EXISTS {table}_slow()")


async def test_a_foreign_notification_does_not_end_the_pushes(postgres_uri: str) -> None:
    table = f"t_notify_{uuid.uuid4().hex[:12]}"
    consensus = PostgresConsensus(postgres_uri, table=table)
    heard: asyncio.Queue[tuple[int | None, bytes | None]] = asyncio.Queue()
    try:
        stop = consensus.watch("k", lambda seqno, data: heard.put_nowait((seqno, data)))
        assert await heard.get() == (None, None)  # listening (nothing may have been missed)
        async with await psycopg.AsyncConnection.connect(postgres_uri, autocommit=True) as conn:
            for junk in ("not ours", "x:!!:k", "1:2"):
                await conn.execute(f"NOTIFY \"persist_{table}\", '{junk}'")
        for _ in range(3):
            assert await asyncio.wait_for(heard.get(), 10) == (None, None)
        assert await consensus.compare_and_set("k", None, b"d")
        assert await asyncio.wait_for(heard.get(), 10) == (1, b"d")
        stop()
    finally:
        await consensus.close()
        async with await psycopg.AsyncConnection.connect(postgres_uri, autocommit=True) as conn:
            await conn.execute(f'DROP TABLE IF EXISTS "{table}"')
