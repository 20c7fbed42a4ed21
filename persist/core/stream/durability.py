"""Durability tiers, streamed writes, group commits and how a try of one ends: the plain data
the streaming-write ledger (``core.stream.ledger``) works on and its caller reports back with."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Generic, TypeVar

from persist.core.stream.streams import Recorded
from persist.errors import PersistError

__all__ = [
    "TIER_NAMES",
    "Ack",
    "Gone",
    "Group",
    "Landed",
    "Outcome",
    "Over",
    "Refuse",
    "Refused",
    "Retry",
    "Settled",
    "Taken",
    "Tier",
    "Wait",
    "Write",
    "sort_taken",
]

P = TypeVar("P")


class Tier(IntEnum):
    MEMORY = 0
    LOCAL_DISK = 1
    OBJECT_STORAGE = 2
    COMMITTED = 3


TIER_NAMES: tuple[str, ...] = tuple(t.name for t in Tier)
# An ack: (lsn, tier, microseconds since the epoch when the tier was reached, the shard time the
# write is visible at for a COMMITTED ack, else -1).
Ack = tuple[int, int, int, int]


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
    # Of its rows, once known (``core.arrow.fingerprint``; 0: not yet computed).
    fingerprint: int = 0
    # The shard time it already landed at under another LSN (another server committed a resend
    # of it first): its group commits without its rows.
    elsewhere: int | None = None


@dataclass(slots=True, eq=False)
class Group(Generic[P]):
    """A commit to carry out: ``writes`` (in LSN order), which resolves every LSN of this
    server below ``lsn_end`` once it lands."""

    id: int
    shard: str
    writes: list[Write[P]]
    attempts: int = 0  # tries that failed (``Retry``)
    out: bool = True  # handed out by ``cut`` and not yet settled
    # Tries of it that were written at a time the upper had passed when they got there.
    rewrites: int = 0

    @property
    def lsn_end(self) -> int:
        return self.writes[-1].lsn + 1

    @property
    def fresh(self) -> list[Write[P]]:
        """The writes whose rows the commit carries (not landed elsewhere)."""
        return [w for w in self.writes if w.elsewhere is None]


# --- what a caller reports of a commit -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Landed:
    """The group's commit is in the shard: the rows of its ``i``-th write that was not landed
    elsewhere at shard time ``at + i``."""

    at: int


@dataclass(frozen=True, slots=True)
class Retry:
    """Nothing is known to have landed (a blob or consensus outage, a lapsed writer): offer the
    same group again later."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refused:
    """These writes (lsn -> why) can never be committed; the others can."""

    bad: dict[int, str]


@dataclass(frozen=True, slots=True)
class Gone:
    """The shard is gone (dropped, finalized, sealed): none of its writes can ever commit."""

    why: str


Outcome = Landed | Retry | Refused | Gone


def sort_taken(
    fresh: list[Write[P]], taken: dict[tuple[str, int], Recorded]
) -> tuple[dict[int, int], dict[int, str]]:
    """Of a group's writes whose seqs a commit found recorded already (``SeqsTaken``): those
    that landed with the same rows (lsn -> time, for ``elsewhere``), and those whose seq a write
    with other rows took (lsn -> why: they can never be committed, ``Refused``). A record
    without a fingerprint (the previous release's) counts as the same rows."""
    same: dict[int, int] = {}
    differ: dict[int, str] = {}
    for w in fresh:
        found = taken.get((w.writer_id, w.seq))
        if found is None:
            continue
        if not w.fingerprint:
            raise ValueError(f"the write at LSN {w.lsn} was committed before it was fingerprinted")
        if found.fingerprint and found.fingerprint != w.fingerprint:
            differ[w.lsn] = (
                f"({w.writer_id!r}, seq {w.seq}) was committed with other rows, at time "
                f"{found.time}"
            )
        else:
            same[w.lsn] = found.time
    return same, differ


# --- what the ledger answers (``core.stream.ledger``) ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Taken:
    """The write has its LSN and its ``MEMORY`` ack is queued (``replay``: it was taken before,
    and this LSN answers for it)."""

    lsn: int
    replay: bool


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing was taken: try again once ``why`` is over (the LSN reservation ran out, the
    server is draining)."""

    why: str


@dataclass(frozen=True, slots=True)
class Over:
    """Nothing was taken: the call is over (it failed meanwhile)."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """Nothing was taken, and the call is over with ``error``: a replay whose rows differ."""

    error: PersistError


@dataclass(slots=True)
class Settled(Generic[P]):
    """What a ledger call changed that the caller acts on: calls with new acks or ended (wake
    them), writes given up (``quarantined``, with why: they can never commit), and whether
    bytes were freed (wake writers waiting for room)."""

    calls: set[int] = field(default_factory=set)
    quarantined: list[tuple[Write[P], str]] = field(default_factory=list)
    freed: int = 0
