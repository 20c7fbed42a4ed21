"""What the committer's clock may conclude about leases, despite clock skew between clients.

Pure like the rest of ``core``: the time comes in as an argument (a test enforces this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from persist.core.shard.types import ReaderState, State, WriterState

__all__ = ["Clock", "Now", "held_back", "stale"]


@dataclass(frozen=True, slots=True)
class Clock:
    """The committer's time, with what lets it judge other clients' leases despite clock skew.

    Leases are measured by the committer's clock, so a committer whose clock runs ahead would
    expire every other process's live handles. When a handle's lease looks expired but the
    committer's clock is more than that lease ahead of the newest heartbeat of every handle
    not its own (``own``), it can't tell a skewed clock from handles that are really gone: it
    then expires that handle only if it watched its heartbeat stay unchanged for longer than
    its lease by its own clock (``watched``: an interval, in which skew cancels out). Its own
    handles, and everyone's while the clocks agree, go by their heartbeat times alone. A plain
    int ``now`` (``guarded`` False) trusts the times.
    """

    now_ms: int
    own: frozenset[str] = frozenset()
    watched: frozenset[str] = frozenset()
    guarded: bool = False

    @staticmethod
    def of(now: Now) -> Clock:
        return now if isinstance(now, Clock) else Clock(now)


Now = int | Clock
"""What transitions take as the time: milliseconds, or a ``Clock`` that also guards leases."""


def stale(h: WriterState | ReaderState, now_ms: int) -> bool:
    return h.last_heartbeat_ms + h.lease_duration_ms < now_ms


def held_back(state: State, clock: Clock) -> list[str]:
    """The handles whose lease looks expired on ``clock`` but that it must not expire, as its
    time may run ahead (see ``Clock``)."""
    if not clock.guarded:
        return []
    handles: list[tuple[str, WriterState | ReaderState]] = [
        *state.writers.items(),
        *state.readers.items(),
    ]
    suspects = [
        (hid, h)
        for hid, h in handles
        if stale(h, clock.now_ms) and hid not in clock.own and hid not in clock.watched
    ]
    if not suspects:  # the common case: one pass, nothing to compare against
        return []
    newest = max(h.last_heartbeat_ms for hid, h in handles if hid not in clock.own)
    return sorted(hid for hid, h in suspects if clock.now_ms > newest + h.lease_duration_ms)
