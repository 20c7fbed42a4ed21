from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from persist.location import Consensus, open_consensus
from persist.location.testing import ConsensusConformance, ConsensusWriteLock


class TestSqliteConsensus(ConsensusConformance):
    pushes_changes = True

    @pytest.fixture
    def consensus_uri(self, tmp_path: Path) -> str:
        # A directory that does not exist yet: the first use creates it.
        return f"sqlite://{tmp_path}/db/consensus.db"

    @pytest.fixture
    async def consensus(self, consensus_uri: str) -> AsyncIterator[Consensus]:
        c = open_consensus(consensus_uri)
        yield c
        await c.close()

    @pytest.fixture
    def consensus_write_lock(self, consensus_uri: str) -> ConsensusWriteLock:
        path = consensus_uri.removeprefix("sqlite://")

        @asynccontextmanager
        async def hold(key: str) -> AsyncIterator[None]:
            # SQLite has one write lock per database, whatever the key.
            conn = sqlite3.connect(path, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield
                finally:
                    conn.execute("ROLLBACK")
            finally:
                conn.close()

        return hold
