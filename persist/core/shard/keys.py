"""The blob key layout. Every key of a shard starts with ``{shard_id}/``.

- ``{shard_id}/rollup/{seqno:020}-{rollup_id}``: a full state rollup (zero-padded so keys sort
  by seqno).
- ``{shard_id}/c/{started_ms:013}-{batch_id}-{part:05}``: a part of a compaction's output. The
  start time in the key lets garbage collection tell an abandoned compaction (older than twice
  the compaction timeout, after which its result can't be committed) from one in flight.
- ``{shard_id}/w/{writer_id}/{batch_id}-{part:05}``: a part of a batch, under the prefix of the
  writer that wrote it (flat under it: a directory per batch would cost a file blob two more
  directory fsyncs per write), so that the parts of a writer that died before committing can be found
  by listing ``{shard_id}/w/{writer_id}/`` once that writer is expired.

The consensus key of a shard is its id.
"""

from __future__ import annotations


def rollup_key(shard_id: str, seqno: int, rollup_id: str) -> str:
    return f"{shard_id}/rollup/{seqno:020d}-{rollup_id}"


def rollup_prefix(shard_id: str) -> str:
    return f"{shard_id}/rollup/"


def writer_prefix(shard_id: str, writer_id: str) -> str:
    return f"{shard_id}/w/{writer_id}/"


def part_key(shard_id: str, writer_id: str, batch_id: str, index: int) -> str:
    return f"{batch_prefix(shard_id, writer_id, batch_id)}{index:05d}"


def batch_prefix(shard_id: str, writer_id: str, batch_id: str) -> str:
    """The prefix of every part key of one batch."""
    return f"{shard_id}/w/{writer_id}/{batch_id}-"


def shard_prefix(shard_id: str) -> str:
    return f"{shard_id}/"


def compaction_part_key(shard_id: str, started_ms: int, batch_id: str, index: int) -> str:
    return f"{shard_id}/c/{started_ms:013d}-{batch_id}-{index:05d}"


def compaction_prefix(shard_id: str) -> str:
    return f"{shard_id}/c/"


def compaction_started_ms(key: str) -> int | None:
    """The start time encoded in a compaction part key (None if it is not one)."""
    name = key.rsplit("/", 1)[-1]
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else None


def rollup_seqno(key: str) -> int | None:
    """The seqno encoded in a rollup key (None if it is not one)."""
    head = key.rsplit("/", 1)[-1].split("-", 1)[0]
    return int(head) if head.isdigit() else None
