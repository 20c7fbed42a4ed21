"""persist export (persist.export): a shard's contents as plain Parquet, on every location."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import persist
from persist import export

from .conftest import SCHEMA, updates


async def test_export_writes_the_contents_as_plain_parquet(
    client: persist.PersistClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    await write.compare_and_append(updates(list(range(2000)), 0), 0, 1)
    await write.compare_and_append(updates([5, 6, 7], 1, [-1, 2, 1]), 1, 3)
    size = (await client.inspect(shard))["bytes"]
    monkeypatch.setattr(export, "FILE_PART_BYTES", size // 3)  # three or four files
    got = await export.export_contents(client, shard, tmp_path / "now")
    assert got["as_of"] == 2 and got["rows"] == 2000 - 1 + 2 + 1 and len(got["files"]) in (3, 4)
    table = pq.read_table(tmp_path / "now")
    assert table.schema.names == ["k", "v"] and table.num_rows == got["rows"]
    keys = sorted(table.column("k").to_pylist())
    assert keys == sorted([k for k in range(2000) if k != 5] + [6, 6, 7])
    assert not [p for p in (tmp_path / "now").iterdir() if p.name.startswith(".")]
    before = await export.export_contents(client, shard, tmp_path / "then", as_of=0)
    assert before["rows"] == 2000 and pq.read_table(tmp_path / "then").num_rows == 2000
    with pytest.raises(persist.InvalidUsage, match="not empty"):
        await export.export_contents(client, shard, tmp_path / "now")
    info = await client.inspect(shard)
    assert info["readers"] == 0  # the export's reader is gone


async def test_export_of_an_empty_shard_and_of_a_negative_multiplicity(
    client: persist.PersistClient, tmp_path: Path
) -> None:
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    got = await export.export_contents(client, shard, tmp_path / "empty")
    assert (got["rows"], got["files"], got["as_of"]) == (0, ["part-00000.parquet"], -1)
    assert pq.read_table(tmp_path / "empty").schema.names == ["k", "v"]
    await write.compare_and_append(updates([2], 0), 0, 1)
    # A time before the first holds nothing, as the empty shard did.
    before = await export.export_contents(client, shard, tmp_path / "before", as_of=-1)
    assert (before["rows"], before["as_of"]) == (0, -1)
    assert pq.read_table(tmp_path / "before").schema.names == ["k", "v"]
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    await write.compare_and_append(updates([1], 0, -1), 0, 1)
    with pytest.raises(persist.InvalidUsage, match="negative multiplicity"):
        await export.export_contents(client, shard, tmp_path / "negative")


async def test_a_failed_export_leaves_nothing_of_its_own_behind(
    client: persist.PersistClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    await write.compare_and_append(updates(list(range(1000)), 0), 0, 1)
    await write.compare_and_append(updates([1000], 1, -1), 1, 2)
    monkeypatch.setattr(export, "FILE_PART_BYTES", (await client.inspect(shard))["bytes"] // 3)
    out = tmp_path / "exports"
    out.mkdir()
    # The directories it made go (all of them), one that was there stays, empty again.
    with pytest.raises(persist.InvalidUsage, match="negative multiplicity"):
        await export.export_contents(client, shard, out / "new" / "deeper")
    assert list(out.iterdir()) == []
    (out / "mine").mkdir()
    with pytest.raises(persist.InvalidUsage, match="negative multiplicity"):
        await export.export_contents(client, shard, out / "mine")
    assert list(out.iterdir()) == [out / "mine"] and list((out / "mine").iterdir()) == []


async def test_export_to_a_path_that_is_no_directory_is_refused_before_anything_is_read(
    client: persist.PersistClient, tmp_path: Path
) -> None:
    shard = persist.ShardId.new()
    await client.open_writer(shard, SCHEMA)
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"mine")
    with pytest.raises(persist.InvalidUsage, match=f"^{re.escape(str(a_file))} is not a directory"):
        await export.export_contents(client, shard, a_file)
    below = f"cannot make {re.escape(str(a_file / 'below'))}: {re.escape(str(a_file))} is not"
    with pytest.raises(persist.InvalidUsage, match=below):
        await export.export_contents(client, shard, a_file / "below")
    assert a_file.read_bytes() == b"mine"
    assert (await client.inspect(shard))["readers"] == 0
