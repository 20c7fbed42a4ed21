"""persist.enable_metrics: the library's own Prometheus metrics, off until asked for."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

import persist
from persist import metrics

from .conftest import SCHEMA, Connect, updates


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported:\n{text}")


async def test_metrics_count_what_the_library_does(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics, "current", None)  # this test's own registry
    registry = persist.enable_metrics()
    assert persist.enable_metrics() is registry  # once per process
    # Without the cache of parts it wrote, the client reads every part it reads from blob
    # (with it, its merges and reads of those parts read none).
    client = await connect(inline_writes_max_bytes=0, compaction_min_parts=1, recent_parts_bytes=0)
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    for t in range(4):
        await write.compare_and_append(updates(list(range(100 * t, 100 * t + 50)), t), t, t + 1)
    await read.snapshot_and_fetch(3)
    await client.maintain(shard)
    async for event in read.listen(0):
        if event.upper is not None and event.upper >= 4:
            break
    text = generate_latest(registry).decode()
    assert _value(text, "persist_commits_total") >= 6
    assert _value(text, "persist_commit_seconds_count") == _value(text, "persist_commits_total")
    assert _value(text, "persist_parts_written_total") >= 4
    assert _value(text, "persist_part_bytes_written_total") > 0
    assert _value(text, "persist_parts_read_total") >= 4
    assert _value(text, "persist_merges_total") >= 1
    assert _value(text, "persist_merged_bytes_total") > 0
    assert _value(text, "persist_listen_events_total") >= 1


def test_metrics_are_off_until_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "current", None)
    assert metrics.current is None
    with pytest.raises(persist.InvalidUsage, match="CollectorRegistry"):
        persist.enable_metrics(registry="nope")
