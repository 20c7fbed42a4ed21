from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from persist.location import Blob, open_blob
from persist.location.mem import MemBlob
from persist.location.testing import BlobConformance


class TestMemBlob(BlobConformance):
    @pytest.fixture
    async def blob(self) -> AsyncIterator[Blob]:
        b = MemBlob()
        yield b
        await b.close()


class TestNamedMemBlob(BlobConformance):
    @pytest.fixture
    async def blob(self) -> AsyncIterator[Blob]:
        name = f"test-{uuid.uuid4().hex}"
        b = open_blob(f"mem://{name}")
        assert b is MemBlob.named(name)
        yield b
        await b.close()
