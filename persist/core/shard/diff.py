"""The change one transition makes to a shard's state, and the one way a new state is made.

A diff holds only what changed, so what goes to consensus is proportional to the change, not to
the state. ``apply_diff(state, diff)`` makes every new state, for the writer that commits a diff
and for every reader that later replays it.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from persist.core.shard.history import Mark
from persist.core.shard.streamed import SeqBlock, SeqRuns, StreamServer
from persist.core.shard.types import (
    HollowBatch,
    ReaderState,
    RollupRef,
    SchemaVersion,
    State,
    WriterState,
)

K = TypeVar("K")
V = TypeVar("V")


class StateDiff(msgspec.Struct, frozen=True, gc=False):
    """The change from the state at ``seqno_from`` to the state at ``seqno_to``.

    Scalar fields hold ``[]`` when unchanged and ``[new value]`` when changed; map fields hold
    ``(key, new value)`` pairs, with None for a removed key.
    """

    shard_id: str
    seqno_from: int
    seqno_to: int
    latest_rollup: RollupRef
    schema: list[bytes] = []
    since: list[int | None] = []
    upper: list[int | None] = []
    writers: list[tuple[str, WriterState | None]] = []
    readers: list[tuple[str, ReaderState | None]] = []
    batches: list[tuple[str, HollowBatch | None]] = []
    rollups: list[tuple[int, RollupRef | None]] = []
    finalized: list[bool] = []
    retired: list[tuple[str, int | None]] = []
    expired_writers: list[tuple[str, int | None]] = []
    stream_upper: list[int] = []
    stream_seqs: list[tuple[str, SeqRuns | None]] = []
    retention_ms: list[int | None] = []
    history: list[tuple[int, Mark | None]] = []
    stream_servers: list[tuple[str, StreamServer | None]] = []
    stream_named: list[tuple[str, SeqBlock | None]] = []
    schemas: list[tuple[int, SchemaVersion | None]] = []


# Every State field except the diff's own bookkeeping is carried by StateDiff; tests hold this.
DIFFED_FIELDS = frozenset(
    {
        "schema",
        "since",
        "upper",
        "writers",
        "readers",
        "batches",
        "rollups",
        "finalized",
        "retired",
        "expired_writers",
        "stream_upper",
        "stream_seqs",
        "retention_ms",
        "history",
        "stream_servers",
        "stream_named",
        "schemas",
    }
)


def _apply_map(base: dict[K, V], ops: list[tuple[K, V | None]]) -> dict[K, V]:
    if not ops:
        return base
    out = dict(base)
    for key, value in ops:
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def apply_diff(state: State, diff: StateDiff) -> State:
    """The state after ``diff``. Raises ``ValueError`` if the diff does not follow ``state``."""
    return apply_diffs(state, [diff])


def apply_diffs(state: State, diffs: list[StateDiff]) -> State:
    """The state after ``diffs``, in order, copying each changed map once for the whole run.

    Raises ``ValueError`` if a diff does not follow the state before it.
    """
    seqno = state.seqno
    for diff in diffs:
        if diff.seqno_from != seqno or diff.shard_id != state.shard_id:
            raise ValueError(
                f"diff {diff.shard_id}@{diff.seqno_from}->{diff.seqno_to} does not apply to "
                f"{state.shard_id}@{seqno}"
            )
        seqno = diff.seqno_to
    if not diffs:
        return state
    scalars: dict[str, object] = {}
    for diff in diffs:
        for name in ("schema", "since", "upper", "finalized", "stream_upper", "retention_ms"):
            change = getattr(diff, name)
            if change:
                scalars[name] = change[-1]
    return msgspec.structs.replace(
        state,
        seqno=seqno,
        writers=_apply_map(state.writers, [op for d in diffs for op in d.writers]),
        readers=_apply_map(state.readers, [op for d in diffs for op in d.readers]),
        batches=_apply_map(state.batches, [op for d in diffs for op in d.batches]),
        rollups=_apply_map(state.rollups, [op for d in diffs for op in d.rollups]),
        retired=_apply_map(state.retired, [op for d in diffs for op in d.retired]),
        expired_writers=_apply_map(
            state.expired_writers, [op for d in diffs for op in d.expired_writers]
        ),
        stream_seqs=_apply_map(state.stream_seqs, [op for d in diffs for op in d.stream_seqs]),
        history=_apply_map(state.history, [op for d in diffs for op in d.history]),
        stream_servers=_apply_map(
            state.stream_servers, [op for d in diffs for op in d.stream_servers]
        ),
        stream_named=_apply_map(state.stream_named, [op for d in diffs for op in d.stream_named]),
        schemas=_apply_map(state.schemas, [op for d in diffs for op in d.schemas]),
        **scalars,
    )
