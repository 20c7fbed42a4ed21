"""Background merges run in the client's merge worker process (``internal/worker.py``).

What the worker owns: its process, the merges in flight in it, and the output parts it writes
before it hands them back (after that the client owns them: it commits them or deletes them).
Every actor and fault that can touch those, and where each is tried:

- the client's own appends while a merge runs (inputs folded or merged under it: the commit,
  ``apply_merge``, refuses the output and the client deletes it): appends keep coming while the
  worker merges in ``test_background_merges_are_made_by_the_worker`` and in the two-client test;
  ``apply_merge``'s refusals themselves: ``tests/core/test_state.py``;
- other writers and their clients' compactions on the same shard (another worker merging the
  same inputs): ``test_two_clients_merge_one_shard_in_their_workers``; a Flight server is a
  client opened with URIs, so its merges take this same path;
- a drop of the shard during a merge: ``test_a_drop_during_a_worker_merge_leaves_the_tombstone``;
- restarts: the client's process killed (its worker exits, no orphan process):
  ``test_a_worker_does_not_outlive_its_client``; a new client after a stopped worker merges in
  a new one: ``test_a_worker_stuck_past_the_timeout_is_stopped``;
- a killed worker (mid-merge, with output written): ``test_a_worker_killed_mid_merge_loses_nothing``
  (its output is swept as abandoned compaction output; a later merge succeeds in a new worker);
- a hung worker: the timeout (``test_a_worker_stuck_past_the_timeout_is_stopped``) and ``close``
  (``test_close_stops_a_worker_stuck_mid_merge``); a garbled reply takes the path of a death
  (the client kills the worker);
- damaged bytes in an input part: ``test_a_damaged_input_fails_the_merge_in_the_worker``;
- clocks: the worker reads none; the merge's start and its timeout are the client's clock, and
  a clock that can't cross processes (a closure) works (the first test); a late commit's
  refusal is ``tests/core/test_state.py``;
- blobs that can't cross processes (``mem://``, wrappers) and ``maintenance_process=False``
  merge in the client: ``test_merges_stay_in_process_where_the_blob_cannot_cross``.

Merges block deterministically on "plugs": part files swapped for FIFOs that the test holds
open, so a reader of one waits in its read until the test feeds it the part's bytes, and shows
in ``/proc`` as holding it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.config import wall_clock_ms
from persist.core.shard import garbage
from persist.internal import compact, maintenance, worker
from persist.location.file import FileBlob
from persist.location.mem import MemConsensus
from persist.testing.faults import Faults, FaultyBlob

from ..api.conftest import SCHEMA, contents, fast_config, updates

# Every merge rewrites (no folds), every part goes to blob (none inline).
# The worker is opt-in (``maintenance_process``): every client here asks for it.
MERGING: dict[str, Any] = {
    "compaction_min_parts": 1,
    "inline_writes_max_bytes": 0,
    "maintenance_process": True,
}
# Bounds the waits for what must happen; a test failing here found a hang.
PATIENCE_S = 120.0


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _exited(pid: int) -> bool:
    """The process is gone or a zombie (its parent died and nobody reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def _worker_children() -> list[int]:
    """This process's children that are merge workers."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _ppid(int(entry.name)) == os.getpid():
            with contextlib.suppress(OSError):
                if b"persist.internal.worker" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


async def _until(what: str, check: Any) -> Any:
    deadline = asyncio.get_running_loop().time() + PATIENCE_S
    while not (found := check()):
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)
    return found


async def _settle(client: persist.PersistClient, shard: str) -> None:
    await asyncio.wait_for(client._shards.maintenance[shard].settle(), PATIENCE_S)


def _state(client: persist.PersistClient, shard: str) -> Any:
    return client._shards.machines[shard].state


def _part_files(root: Path, state: Any, keep: Any = lambda key: True) -> list[Path]:
    return [
        root / p.key
        for b in state.batches.values()
        for p in b.parts
        if not p.inline and keep(p.key)
    ]


class Plugs:
    """Part files swapped for FIFOs the test holds open read-write."""

    def __init__(self, paths: Iterable[Path]) -> None:
        self.held: dict[Path, tuple[bytes, int]] = {}
        for path in paths:
            data = path.read_bytes()
            assert len(data) < 4096  # fed into an empty pipe at once, never blocking
            path.unlink()
            os.mkfifo(path)
            self.held[path] = (data, os.open(path, os.O_RDWR))
        assert self.held

    def holding(self, pid: int | None) -> bool:
        """Whether process ``pid`` has one of the plugs open (it is reading that part)."""
        if pid is None:
            return False
        plugged = {str(p) for p in self.held}
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").removesuffix(" (deleted)") in plugged:
                        return True
        return False

    def pull(self, *, refill: bool = True) -> None:
        """Puts the parts back (``refill``: as files; a drop deleted them) and feeds their
        bytes to whoever still reads a FIFO."""
        for path, (data, fd) in self.held.items():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            if refill:
                path.write_bytes(data)
            os.write(fd, data)
            os.close(fd)
        self.held.clear()


async def test_background_merges_are_made_by_the_worker(
    tmp_path: Path, postgres_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("a background merge ran in the client's process")

    async def refuse_merge(*args: object) -> None:
        refuse()

    # Neither the merge nor its encoding may run here: only in the worker's interpreter.
    monkeypatch.setattr(compact, "_encode_output", refuse)
    monkeypatch.setattr(maintenance, "merge_batches", refuse_merge)
    skew = 1234  # a clock that can't be pickled: the worker must not need it
    cfg = fast_config(**MERGING, now_ms=lambda: wall_clock_ms() + skew)
    shard = persist.ShardId.new()
    async with await persist.connect(
        (tmp_path / "blob").as_uri(), postgres_uri, config=cfg
    ) as client:
        write, read = await client.open(shard, SCHEMA)
        for t in range(16):
            await write.compare_and_append(updates([t, 100 + t], t), t, t + 1)
        await _settle(client, shard)
        merger = client._worker
        assert merger is not None and merger.pid is not None
        pid = merger.pid
        # Every merge handed back came from the worker, a child of this process.
        assert merger.merged_by and set(merger.merged_by) == {pid}
        assert pid != os.getpid() and _ppid(pid) == os.getpid()
        state = _state(client, shard)
        assert len(state.batches) < 16
        assert any(p.key.startswith(f"{shard}/c/") for b in state.batches.values() for p in b.parts)
        assert contents(await read.snapshot_and_fetch(15)) == {
            (k, f"v{k}"): 1 for t in range(16) for k in (t, 100 + t)
        }
    assert _exited(pid) and not _worker_children()


async def test_a_worker_killed_mid_merge_loses_nothing(tmp_path: Path, postgres_uri: str) -> None:
    root = tmp_path / "blob"
    shift = [0]
    # Every merge step cuts an output part: a merge writes parts before it reads its last input.
    cfg = fast_config(**MERGING, part_target_bytes=1, now_ms=lambda: wall_clock_ms() + shift[0])
    shard = persist.ShardId.new()
    async with await persist.connect(root.as_uri(), postgres_uri, config=cfg) as client:
        write = await client.open_writer(shard, SCHEMA)
        t = 0

        async def append() -> None:
            nonlocal t
            await write.compare_and_append(updates([t, 1000 - t], t), t, t + 1)
            t += 1

        for _ in range(8):
            await append()
        await _settle(client, shard)
        merger = client._worker
        assert merger is not None and merger.merged_by
        # The later parts of the merged runs: a merge reaches one only after writing output.
        later = _part_files(root, _state(client, shard), lambda k: "/c/" in k and k[-5:] != "00000")
        plugs = Plugs(later)
        settled: asyncio.Future[None] | None = None
        for _ in range(64):
            await append()
            settled = asyncio.ensure_future(_settle(client, shard))
            held = asyncio.ensure_future(_until("", lambda: plugs.holding(merger.pid)))
            await asyncio.wait([settled, held], return_when=asyncio.FIRST_COMPLETED)
            held.cancel()
            if not settled.done():
                break
        else:
            pytest.fail("no merge read a plugged part")
        stuck = merger.pid
        assert stuck is not None
        written = {k for k in await client.blob.list_keys(f"{shard}/c/")} - garbage.referenced_keys(
            _state(client, shard)
        )
        assert written, "the stuck merge wrote output before its plugged input"
        handed = len(merger.merged_by)
        os.kill(stuck, signal.SIGKILL)
        await _until("the killed worker is reaped", lambda: _exited(stuck) and merger.pid != stuck)
        plugs.pull()
        await asyncio.wait_for(settled, PATIENCE_S)
        assert stuck not in merger.merged_by[handed:]  # the stuck merge never came back

        # Nothing lost; later merges succeed, in a new worker.
        done = len(merger.merged_by)
        for _ in range(8):
            await append()
        await _settle(client, shard)
        assert merger.merged_by[done:] and stuck not in merger.merged_by[done:]
        read = await client.open_leased_reader(shard)
        expected = Counter({(k, f"v{k}"): 1 for i in range(t) for k in (i, 1000 - i)})
        assert Counter(contents(await read.snapshot_and_fetch(t - 1))) == expected
        await read.expire()
        # What the killed merge wrote is abandoned compaction output: swept once it is older
        # than twice compaction_timeout_s (by the client's clock).
        await write.expire()
        shift[0] = int(2 * cfg.compaction_timeout_s * 1000) + 60_000
        await client.maintain(shard)
        await client.maintain(shard)
        left = set(await client.blob.list_keys(f"{shard}/"))
        assert not written & left
        assert left == garbage.referenced_keys(_state(client, shard))


async def _plugged_merge(
    client: persist.PersistClient, root: Path, shard: str, start: int
) -> tuple[Plugs, int]:
    """Plugs every part file of the shard and appends once: the client's worker starts a merge
    and blocks in it. The plugs and the worker's pid."""
    plugs = Plugs(_part_files(root, _state(client, shard)))
    write = await client.open_writer(shard, SCHEMA)
    await write.compare_and_append(updates([start], start), start, start + 1)
    merger = client._worker
    assert merger is not None
    pid: int = await _until(
        "a merge reads a plugged part", lambda: plugs.holding(merger.pid) and merger.pid
    )
    return plugs, pid


async def _written_unmerged(uri: str, consensus: str, shard: str, n: int) -> None:
    """``n`` appends that no one merges yet (their own client does not compact)."""
    cfg = fast_config(**MERGING, compaction_enabled=False)
    async with await persist.connect(uri, consensus, config=cfg) as client:
        write = await client.open_writer(shard, SCHEMA)
        for t in range(n):
            await write.compare_and_append(updates([t], t), t, t + 1)


async def test_a_worker_stuck_past_the_timeout_is_stopped(
    tmp_path: Path, postgres_uri: str
) -> None:
    root, shard = tmp_path / "blob", persist.ShardId.new()
    await _written_unmerged(root.as_uri(), postgres_uri, shard, 6)
    cfg = fast_config(**MERGING, compaction_timeout_s=2.0)
    async with await persist.connect(root.as_uri(), postgres_uri, config=cfg) as client:
        await client._shards.loaded(shard)
        plugs, stuck = await _plugged_merge(client, root, shard, 6)
        # The client stops the worker itself once the merge outlives compaction_timeout_s.
        await _until("the stuck worker is stopped", lambda: _exited(stuck))
        plugs.pull()
        await _settle(client, shard)
        assert client._worker is not None and stuck not in client._worker.merged_by
    # A restarted client merges in a worker of its own.
    async with await persist.connect(
        root.as_uri(), postgres_uri, config=fast_config(**MERGING)
    ) as client:
        write = await client.open_writer(shard, SCHEMA)
        await write.compare_and_append(updates([7], 7), 7, 8)
        await _settle(client, shard)
        assert client._worker is not None and client._worker.merged_by
        read = await client.open_leased_reader(shard)
        assert contents(await read.snapshot_and_fetch(7)) == {(k, f"v{k}"): 1 for k in range(8)}


async def test_close_stops_a_worker_stuck_mid_merge(
    tmp_path: Path, postgres_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker, "STOP_GRACE_S", 0.5)
    root, shard = tmp_path / "blob", persist.ShardId.new()
    await _written_unmerged(root.as_uri(), postgres_uri, shard, 6)
    client = await persist.connect(root.as_uri(), postgres_uri, config=fast_config(**MERGING))
    try:
        await client._shards.loaded(shard)
        plugs, stuck = await _plugged_merge(client, root, shard, 6)
    finally:
        await asyncio.wait_for(client.close(), PATIENCE_S)
    assert _exited(stuck) and not _worker_children()
    plugs.pull()
    async with await persist.connect(root.as_uri(), postgres_uri, config=fast_config(maintenance_process=True)) as again:
        read = await again.open_leased_reader(shard)
        assert contents(await read.snapshot_and_fetch(6)) == {(k, f"v{k}"): 1 for k in range(7)}


async def test_a_drop_during_a_worker_merge_leaves_the_tombstone(
    tmp_path: Path, postgres_uri: str
) -> None:
    root, shard = tmp_path / "blob", persist.ShardId.new()
    await _written_unmerged(root.as_uri(), postgres_uri, shard, 6)
    async with await persist.connect(
        root.as_uri(), postgres_uri, config=fast_config(**MERGING)
    ) as client:
        await client._shards.loaded(shard)
        plugs, _ = await _plugged_merge(client, root, shard, 6)
        await client.drop_shard(shard, force=True)
        plugs.pull(refill=False)  # the merge goes on: its inputs are gone, or its commit refused
        await _settle(client, shard)
        tombstone = _state(client, shard).latest_rollup.key
        assert await client.blob.list_keys(f"{shard}/") == [tombstone]


async def test_a_damaged_input_fails_the_merge_in_the_worker(
    tmp_path: Path, postgres_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    root, shard = tmp_path / "blob", persist.ShardId.new()
    await _written_unmerged(root.as_uri(), postgres_uri, shard, 6)
    async with await persist.connect(
        root.as_uri(), postgres_uri, config=fast_config(**MERGING)
    ) as client:
        machine = await client._shards.loaded(shard)
        files = _part_files(root, machine.state)
        saved = {path: path.read_bytes() for path in files}
        for path, data in saved.items():
            path.write_bytes(data[:-8] + bytes(8))
        write = await client.open_writer(shard, SCHEMA)
        with caplog.at_level("INFO", logger="persist"):
            await write.compare_and_append(updates([6], 6), 6, 7)
            await _settle(client, shard)
        merger = client._worker
        assert merger is not None and merger.pid is not None and not merger.merged_by
        assert "failed its checksum" in caplog.text
        assert len(machine.state.batches) == 7
        for path, data in saved.items():
            path.write_bytes(data)
        await write.compare_and_append(updates([7], 7), 7, 8)
        await _settle(client, shard)
        assert merger.merged_by
        read = await client.open_leased_reader(shard)
        assert contents(await read.snapshot_and_fetch(7)) == {(k, f"v{k}"): 1 for k in range(8)}


async def test_two_clients_merge_one_shard_in_their_workers(
    tmp_path: Path, postgres_uri: str
) -> None:
    root, shard = tmp_path / "blob", persist.ShardId.new()
    cfg = fast_config(**MERGING)
    async with (
        await persist.connect(root.as_uri(), postgres_uri, config=cfg) as a,
        await persist.connect(root.as_uri(), postgres_uri, config=cfg) as b,
    ):
        writers = [await a.open_writer(shard, SCHEMA), await b.open_writer(shard, SCHEMA)]
        appended: Counter[tuple[int, str]] = Counter()
        for i in range(40):
            await writers[i % 2].append_next(updates([i], 0).drop_columns(["_time"]))
            appended[(i, f"v{i}")] += 1
        await asyncio.gather(_settle(a, shard), _settle(b, shard))
        merged = [
            *(a._worker.merged_by if a._worker else []),
            *(b._worker.merged_by if b._worker else []),
        ]
        assert merged
        await a.maintain(shard)
        read = await a.open_leased_reader(shard)
        upper = _state(a, shard).upper
        assert Counter(contents(await read.snapshot_and_fetch(upper - 1))) == appended
        await read.expire()
        await a.maintain(shard)
        left = set(await a.blob.list_keys(f"{shard}/"))
        assert left == garbage.referenced_keys(_state(a, shard))


_CLIENT = """
import asyncio, sys
import pyarrow as pa
import persist

async def main():
    cfg = persist.PersistConfig(
        compaction_min_parts=1, inline_writes_max_bytes=0, maintenance_process=True
    )
    client = await persist.connect(sys.argv[1], sys.argv[2], config=cfg)
    write = await client.open_writer(persist.ShardId.new(), pa.schema([("k", pa.int64())]))
    while client._worker.pid is None:
        await write.append_next(pa.table({"k": pa.array([1], pa.int64())}))
        await asyncio.sleep(0.05)
    print(client._worker.pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_worker_does_not_outlive_its_client(tmp_path: Path, postgres_uri: str) -> None:
    # No __main__ guard in the client's script: the worker must not run it again.
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(_CLIENT))
    proc = subprocess.Popen(
        [sys.executable, str(script), (tmp_path / "blob").as_uri(), postgres_uri],
        stdout=subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), PATIENCE_S)  # type: ignore[union-attr]
        pid = int(line)
        assert _ppid(pid) == proc.pid
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    await _until("the orphaned worker exits", lambda: _exited(pid))


async def test_merges_stay_in_process_where_the_blob_cannot_cross(
    tmp_path: Path, postgres_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = fast_config(**MERGING)
    async with await persist.connect("mem://worker-test", "mem://worker-test", config=cfg) as c:
        assert c._worker is None
        shard = persist.ShardId.new()
        write = await c.open_writer(shard, SCHEMA)
        for t in range(8):
            await write.compare_and_append(updates([t], t), t, t + 1)
        await _settle(c, shard)
        assert len(_state(c, shard).batches) < 8  # merged, here
    inner = FileBlob(str(tmp_path / "blob"))
    wrapped = persist.PersistClient(FaultyBlob(inner, Faults()), MemConsensus(), cfg)
    plain = persist.PersistClient(inner, MemConsensus(), cfg)
    turned_off = await persist.connect(
        (tmp_path / "blob").as_uri(), postgres_uri, config=fast_config(maintenance_process=False)
    )
    try:
        assert wrapped._worker is None and turned_off._worker is None
        assert plain._worker is not None  # a plain directory can be opened again
    finally:
        for client in (wrapped, plain, turned_off):
            await client.close()
    assert not _worker_children()

    # maintain() merges in the caller's process, worker or not.
    async def refuse(*args: object) -> None:
        raise AssertionError("maintain() merged in the worker")

    monkeypatch.setattr(worker.MergeWorker, "merge", refuse)
    uri = (tmp_path / "blob2").as_uri()
    shard = persist.ShardId.new()
    await _written_unmerged(uri, postgres_uri, shard, 4)
    async with await persist.connect(uri, postgres_uri, config=cfg) as client:
        assert client._worker is not None
        assert (await client.maintain(shard))["merges"]
