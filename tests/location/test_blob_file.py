from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from persist.location import Blob, open_blob
from persist.location.testing import BlobConformance


class TestFileBlob(BlobConformance):
    @pytest.fixture
    async def blob(self, tmp_path: Path) -> AsyncIterator[Blob]:
        # A root that does not exist yet: the first set creates it.
        b = open_blob(f"file://{tmp_path}/blob/root")
        yield b
        await b.close()
