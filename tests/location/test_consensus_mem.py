from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from persist.location import Consensus, open_consensus
from persist.location.mem import MemConsensus
from persist.location.testing import ConsensusConformance, ConsensusFactory


class TestMemConsensus(ConsensusConformance):
    pushes_changes = True

    @pytest.fixture
    def name(self) -> str:
        return f"test-{uuid.uuid4().hex}"

    @pytest.fixture
    async def consensus(self, name: str) -> AsyncIterator[Consensus]:
        c = open_consensus(f"mem://{name}")
        assert c is MemConsensus.named(name)
        yield c
        await c.close()

    @pytest.fixture
    async def consensus_factory(self, name: str) -> ConsensusFactory:
        # In memory, "another handle on the same location" is the same named instance.
        return lambda: MemConsensus.named(name)
