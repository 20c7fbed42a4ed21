"""Exporting a shard's contents as plain Parquet files that any engine reads (``persist export``)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from persist.client import PersistClient
from persist.errors import InvalidUsage
from persist.plain import split_rows
from persist.plan import SnapshotPlan

# One file per this many bytes of the snapshot's parts (encoded), so that engines read the
# export in parallel and no file is huge.
FILE_PART_BYTES = 128 << 20


async def export_contents(
    client: PersistClient,
    shard: str,
    directory: Path,
    as_of: int | datetime.datetime | None = None,
) -> dict[str, Any]:
    """Writes the contents of ``shard`` as of ``as_of`` (a time, or a ``datetime``: the newest
    time readable then, as ``client.as_of_at`` finds it; default: the newest readable time)
    into the empty or new directory ``directory``: ``part-NNNNN.parquet`` files of the data
    columns, each row repeated by its multiplicity (a negative one raises ``InvalidUsage``).
    A file appears under its name only once it is whole; an export that fails removes what it
    wrote and the directories it made (never one that was there before). Returns what was
    written. A ``directory`` that is not, or cannot be, a new or empty directory is refused
    with ``InvalidUsage`` naming it, before anything is read."""
    directory = Path(directory)
    _check_directory(directory)
    # Looked up once: the check below and the plan read the same shard under a rename.
    sid = await client.shard_id(shard)
    at = await client.as_of_at(sid, as_of) if isinstance(as_of, datetime.datetime) else as_of
    if at is None:
        # Planning refuses a sealed shard too, but this names the command's flag.
        _, upper = await client.frontiers(sid)
        if upper is None:
            raise InvalidUsage(f"shard {sid} is sealed: give the time (--as-of)")
    if isinstance(at, int) and not isinstance(at, bool) and at < 0:
        # A time before the first: nothing was there. No plan: it takes times only.
        plan = SnapshotPlan(sid, await client.shard_schema(sid), at, None, ())
    else:
        plan = await client.plan_snapshot(
            sid,
            as_of=at,
            split_bytes=FILE_PART_BYTES,
            empty_if_unwritten=True,
            # An export reads history; it does not let the shard forget it.
            move_since=False,
            purpose="persist export",
        )
    try:
        made = _make_directory(directory)
        rows = 0
        files: list[str] = []
        try:
            for i, split in enumerate(plan.splits or [None]):
                path = directory / f"part-{i:05d}.parquet"
                files.append(path.name)
                rows += await _write_file(client, plan.schema, split, path)
            size = sum((directory / f).stat().st_size for f in files)
        except BaseException:
            # Synchronous, so that a second cancellation can't cut the clean-up short: it is
            # a few unlinks.
            _undo(directory, files, made)
            raise
        return {
            "shard_id": plan.shard_id,
            # Nothing written (an empty plan has no as_of): the time before the first.
            "as_of": -1 if plan.as_of is None else plan.as_of,
            "files": files,
            "rows": rows,
            "bytes": size,
        }
    finally:
        if plan.reader is not None:
            await plan.reader.expire()


def _check_directory(directory: Path) -> None:
    """``InvalidUsage`` naming ``directory`` unless it is an empty directory or can be made."""
    nearest = next(p for p in (directory, *directory.parents) if p.exists() or p.is_symlink())
    if nearest == directory and not directory.is_dir():
        raise InvalidUsage(f"{directory} is not a directory: export into a new or empty directory")
    if not nearest.is_dir():
        raise InvalidUsage(f"cannot make {directory}: {nearest} is not a directory")
    try:
        if nearest == directory and any(directory.iterdir()):
            raise InvalidUsage(f"{directory} is not empty: export into a new or empty directory")
    except OSError as exc:
        raise InvalidUsage(f"cannot export into {directory}: {exc.strerror}") from None


def _make_directory(directory: Path) -> list[Path]:
    """Makes ``directory`` and its missing parents; the ones it made, deepest first."""
    missing: list[Path] = []
    for path in (directory, *directory.parents):
        if path.exists():
            break
        missing.append(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidUsage(f"cannot make {directory}: {exc.strerror}") from None
    return missing


def _undo(directory: Path, files: list[str], made: list[Path]) -> None:
    """Removes the export's files (whole or in the making) and the directories it made."""
    for name in files:
        for path in (directory / name, directory / f".{name}.tmp"):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
    for path in made:
        # rmdir, not a tree removal: whatever someone else put there meanwhile stays.
        with contextlib.suppress(OSError):
            path.rmdir()


async def _write_file(client: PersistClient, schema: pa.Schema, split: Any, path: Path) -> int:
    tmp = path.with_name(f".{path.name}.tmp")
    writer = await asyncio.to_thread(pq.ParquetWriter, tmp, schema)
    rows = 0
    try:
        if split is not None:
            async for table in split_rows(client, split):
                rows += table.num_rows
                await asyncio.to_thread(writer.write_table, table)
    finally:
        await asyncio.to_thread(writer.close)
    await asyncio.to_thread(os.replace, tmp, path)
    return rows
