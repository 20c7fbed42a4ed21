"""What a shard's state records of streaming writes (``core.stream.streams`` reads and writes them;
``core.shard.types`` holds them)."""

from __future__ import annotations

import msgspec

__all__ = ["SeqBlock", "SeqRuns", "StreamServer"]


class SeqRuns(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The previous release's record of one streaming writer's seqs in one block of seqs: runs
    ``(first seq, first lsn, count)`` along which seq and LSN both step by one, where an LSN
    was the shard time the write landed at. Read, never written (``core.stream.streams``)."""

    runs: tuple[tuple[int, int, int], ...]


class StreamServer(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What a shard records of one streaming server (``core.stream.streams``): every LSN of that
    server's log of the shard below ``lsn_upper`` is resolved (committed, or given up), its
    latest group landed at shard time ``at``, and ``num`` names it in ``SeqBlock`` runs."""

    num: int
    lsn_upper: int
    at: int


class SeqBlock(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Where one streaming writer's named writes of one block of seqs landed (``core.stream.streams``):
    runs ``(first seq, count, server num, first lsn, time)`` along which seq and LSN both step
    by one at one time, and each seq's content fingerprint (4 bytes little-endian at
    ``seq % SEQ_BLOCK``; 0: unknown)."""

    runs: tuple[tuple[int, int, int, int, int], ...]
    fingerprints: bytes = b""
