"""Durability tiers, streamed writes, group commits and how a try of one ends: the plain data
the streaming-write ledger (``core.ledger``) works on and its caller reports back with."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Generic, TypeVar

__all__ = [
    "TIER_NAMES",
    "Ack",
    "Group",
    "Landed",
    "Moved",
    "Outcome",
    "Refused",
    "Retry",
    "Tier",
    "Write",
    "judge",
]

P = TypeVar("P")


class Tier(IntEnum):
    MEMORY = 0
    LOCAL_DISK = 1
    OBJECT_STORAGE = 2
    COMMITTED = 3


TIER_NAMES: tuple[str, ...] = tuple(t.name for t in Tier)
# An ack: (lsn, tier, microseconds since the epoch when the tier was reached).
Ack = tuple[int, int, int]


@dataclass(slots=True, eq=False)
class Write(Generic[P]):
    """One write a shard took and has not yet committed (or given up)."""

    lsn: int
    call: int | None  # None: recovered from a WAL (no call waits for it)
    writer_id: str
    seq: int  # -1: unnamed
    nbytes: int
    payload: P
    at_us: int  # when it was taken
    reached: Tier = Tier.MEMORY
    gone: bool = False  # committed or given up: no longer pending


@dataclass(slots=True, eq=False)
class Group(Generic[P]):
    """A commit to carry out: ``writes`` (in LSN order) from ``expected_upper`` to
    ``new_upper``, recording ``seqs`` ``(writer_id, seq, lsn)`` in the same transition."""

    id: int
    shard: str
    writes: list[Write[P]]
    expected_upper: int
    new_upper: int
    attempts: int = 0  # tries that failed (``Retry``)
    out: bool = True  # handed out by ``cut`` and not yet settled

    @property
    def seqs(self) -> list[tuple[str, int, int]]:
        return [(w.writer_id, w.seq, w.lsn) for w in self.writes if w.seq >= 0]


# --- what a caller reports of a commit -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Landed:
    """The group's commit is in the shard."""


@dataclass(frozen=True, slots=True)
class Retry:
    """Nothing is known to have landed (a blob or consensus outage, a lapsed writer): offer the
    same group again later."""

    reason: str


@dataclass(frozen=True, slots=True)
class Moved:
    """The shard's upper is ``upper`` (None: finished), past the group's ``expected_upper``, and
    every streamed LSN below ``stream_upper`` was committed (by a try of ours that did land)."""

    upper: int | None
    stream_upper: int


@dataclass(frozen=True, slots=True)
class Refused:
    """These writes (lsn -> why) can never be committed; the others can."""

    bad: dict[int, str]


Outcome = Landed | Retry | Moved | Refused


def judge(group: Group[Any], upper: int | None, stream_upper: int) -> Outcome:
    """What became of a commit whose try failed without saying (an indeterminate error, or an
    ``UpperMismatch`` that a try of ours that did land may have caused), from the shard's state
    read afterwards. A server is its shard's only streaming writer, so only its own commits move
    ``stream_upper``."""
    if stream_upper >= group.new_upper:
        return Landed()
    if upper == group.expected_upper and stream_upper <= group.expected_upper:
        return Retry("the commit did not land")
    return Moved(upper, stream_upper)
