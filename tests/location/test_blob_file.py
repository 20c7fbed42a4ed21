from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pyarrow as pa
import pytest

import persist
from persist.core.shard import garbage
from persist.errors import ExternalError
from persist.location import Blob, open_blob
from persist.location._keys import TEMP_PREFIX
from persist.location.file import FileBlob
from persist.location.testing import BlobConformance, PartialWrite

from ..api.conftest import SCHEMA, fast_config


def _leave_temp_file(root: str, key: str, age_s: float) -> Callable[[], bool]:
    """What a writer killed mid-``set(key)`` leaves: a temp file beside the key, ``age_s`` old."""
    directory = os.path.dirname(os.path.join(root, *key.split("/")))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
    os.write(fd, b"half a value")
    os.close(fd)
    touched = time.time() - age_s
    os.utime(tmp, (touched, touched))
    return lambda: os.path.exists(tmp)


class TestFileBlob(BlobConformance):
    @pytest.fixture
    async def blob(self, tmp_path: Path) -> AsyncIterator[Blob]:
        # A root that does not exist yet: the first set creates it.
        b = open_blob(f"file://{tmp_path}/blob/root")
        yield b
        await b.close()

    @pytest.fixture
    def leave_partial_write(self) -> PartialWrite:
        def leave(blob: Blob, key: str, age_s: float) -> Callable[[], bool]:
            assert isinstance(blob, FileBlob)
            return _leave_temp_file(blob.root, key, age_s)

        return leave


@pytest.mark.parametrize("broken", ["root is a file", "root under a file"])
async def test_a_root_that_is_not_a_directory_fails_every_call(tmp_path: Path, broken: str) -> None:
    # Read as "no such key" (a path through a file), it made a broken store look empty: reads
    # and listings saw nothing wrong while every write failed.
    root = tmp_path / "blob"
    blob = FileBlob(str(root))
    await blob.set("a/b", b"v")
    shutil.rmtree(root)
    root.write_bytes(b"")
    if broken == "root under a file":
        blob = FileBlob(str(root / "blob"))
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "get": lambda: blob.get("a/b"),
        "get top": lambda: blob.get("missing"),
        "get_range": lambda: blob.get_range("a/b", 0, 1),
        "set": lambda: blob.set("a/c", b"w"),
        "set top": lambda: blob.set("c", b"w"),
        "set_new": lambda: blob.set_new("a/d", b"w"),
        "delete": lambda: blob.delete("a/b"),
        "list_keys": lambda: blob.list_keys(""),
        "list_keys under": lambda: blob.list_keys("a/"),
        "list_sizes": lambda: blob.list_sizes(""),
        "delete_partial_writes": lambda: blob.delete_partial_writes("", 0.0),
    }
    for name, call in calls.items():
        with pytest.raises(ExternalError, match="is not a directory") as e:
            await call()
        assert e.value.determinate, name
    assert root.read_bytes() == b""


async def test_a_root_not_created_yet_is_empty(tmp_path: Path) -> None:
    blob = FileBlob(str(tmp_path / "blob"))
    assert await blob.get("a/b") is None
    await blob.delete("a/b")
    assert await blob.list_keys("") == []
    assert await blob.list_sizes("a/") == {}
    assert not (tmp_path / "blob").exists()
    await blob.set("a/b", b"v")
    assert await blob.list_keys("") == ["a/b"]


async def test_maintain_sweeps_temp_files_of_a_killed_writer(tmp_path: Path) -> None:
    root = tmp_path / "blob"
    shard = persist.ShardId.new()
    cfg = fast_config(compaction_timeout_s=60.0)
    async with await persist.connect(
        root.as_uri(), f"sqlite://{tmp_path / 'c.db'}", config=cfg
    ) as client:
        write, read = await client.open(shard, SCHEMA)
        await write.compare_and_append(
            pa.table({"k": [1], "v": ["a"], "_time": pa.array([0], pa.uint64())}), 0, 1
        )
        await client.maintain(shard)
        keys = set(await client.blob.list_keys(f"{shard}/"))
        # Older than twice the compaction timeout: no live set can still be writing them.
        stale = [
            _leave_temp_file(str(root), f"{shard}/{k}", 121.0)
            for k in ("w/dead-writer/b-00000", "c/0000000000000-b-00000", "rollup/x", "x")
        ]
        recent = _leave_temp_file(str(root), f"{shard}/w/live-writer/b-00000", 100.0)
        other_shard = _leave_temp_file(str(root), "other-shard/w/x/b-00000", 3600.0)

        done = await client.maintain(shard)

        assert done["orphans_deleted"] >= len(stale)
        assert not any(exists() for exists in stale)
        assert recent(), "a set may still be writing it"
        assert other_shard(), "another shard's"
        assert set(await client.blob.list_keys(f"{shard}/")) == keys
        assert keys == garbage.referenced_keys(client._shards.machines[shard].state)
        assert (await read.snapshot_and_fetch(0)).num_rows == 1
