from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from persist.location import Consensus, open_consensus
from persist.location.testing import ConsensusConformance


class TestSqliteConsensus(ConsensusConformance):
    @pytest.fixture
    def consensus_uri(self, tmp_path: Path) -> str:
        # A directory that does not exist yet: the first use creates it.
        return f"sqlite://{tmp_path}/db/consensus.db"

    @pytest.fixture
    async def consensus(self, consensus_uri: str) -> AsyncIterator[Consensus]:
        c = open_consensus(consensus_uri)
        yield c
        await c.close()
