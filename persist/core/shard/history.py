"""When each upper was reached: the record behind retention, wall-clock time travel and
``history``. Pure: the time comes in as an argument.

Every commit that moves the upper adds a ``Mark`` (keyed by its seqno in the state's
``history`` map, so a commit's diff adds one entry and drops a few). A mark holds the upper
reached, when (``at_ms``), and what the commit wrote. The record stays bounded whatever the
commit rate: the newest ``FINE`` marks are kept one per commit; older ones are folded, one
per ``granule(retention)`` of wall-clock time (the newest commit of each granule keeps its
upper and time, and counts the others); marks older than the retention window go, all but the
newest of them (the *anchor*: the upper at the window's start).

**Retention.** With a retention of R ms, contents as of any time made readable within the last R
stay readable: the shard's since may not pass ``bound`` = the anchor's upper - 1 (the newest
time readable when the window began). Without readers the since follows that bound by itself.

**Clock skew.** Marks are stamped by the committer's clock, never below the newest stamp
(stamps never go backwards, so the marks in seqno order are in time order: what lets a
commit find its place by bisection), and the window is cut at the committer's ``now - R - SKEW_MS``.
A clock that runs ahead only stamps later (history kept longer); retention holds at least R
as long as no committer's clock runs more than ``SKEW_MS`` behind, or ahead when it cuts.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import msgspec

from persist.core.frontier import newest_readable
from persist.errors import InvalidUsage

__all__ = [
    "FINE",
    "SKEW_MS",
    "Mark",
    "as_of_at",
    "bound",
    "granule",
    "record",
    "within",
]

# The newest marks kept one per commit (exact wall-clock time travel and history there).
FINE = 256
# Older marks: at most one per granule, about this many over the window.
COARSE = 1024
# The clock skew retention allows for (see the module's docstring).
SKEW_MS = 60_000
# Without a retention (readers alone), the coarse marks of at most this long ago are kept.
_UNRETAINED_MS = 7 * 24 * 3600 * 1000


class Mark(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The upper a commit reached, when, and what it wrote (of ``commits`` folded commits)."""

    at_ms: int
    upper: int | None
    added: int
    retracted: int
    purpose: str
    commits: int = 1


def granule(retention_ms: int | None) -> int:
    """The wall-clock span of one folded mark."""
    span = _UNRETAINED_MS if retention_ms is None else retention_ms
    return max(1000, span // COARSE)


def _cutoff(retention_ms: int | None, now_ms: int) -> int:
    span = _UNRETAINED_MS if retention_ms is None else retention_ms
    return now_ms - span - SKEW_MS


def stamp(history: Mapping[int, Mark], now_ms: int) -> int:
    """The time a commit now is stamped with: never below the newest stamp."""
    newest = history[max(history)].at_ms if history else 0
    return max(now_ms, newest)


def record(
    history: Mapping[int, Mark], seqno: int, mark: Mark, retention_ms: int | None, now_ms: int
) -> dict[int, Mark | None]:
    """The changes to ``history`` (seqno -> mark, None: removed) that add ``mark`` at
    ``seqno`` and keep the record bounded."""
    changes: dict[int, Mark | None] = {seqno: mark}
    seqnos = sorted(history)
    # The mark that leaves the fine zone with this one folds into its older neighbour's
    # granule: the older goes, the newer counts it.
    if len(seqnos) >= FINE:
        leaving = seqnos[-FINE]
        older = seqnos[:-FINE]
        if older:
            prev_seqno = older[-1]
            prev, cur = history[prev_seqno], history[leaving]
            g = granule(retention_ms)
            if prev.at_ms // g == cur.at_ms // g:
                changes[prev_seqno] = None
                changes[leaving] = msgspec.structs.replace(
                    cur,
                    added=cur.added + prev.added,
                    retracted=cur.retracted + prev.retracted,
                    commits=cur.commits + prev.commits,
                )
    # Marks older than the window go, but the newest of them: the anchor. They are a prefix.
    old = seqnos[: _at_or_before(history, seqnos, _cutoff(retention_ms, now_ms))]
    live = [s for s in old if changes.get(s, history[s]) is not None]
    for s in live[:-1]:
        changes[s] = None
    return changes


def _at_or_before(history: Mapping[int, Mark], seqnos: list[int], ms: int) -> int:
    """How many of the marks (``seqnos``, ascending) were stamped at or before ``ms``."""
    return bisect.bisect_right(seqnos, ms, key=lambda s: history[s].at_ms)


def _newest_at(history: Mapping[int, Mark], ms: int) -> Mark | None:
    """The newest mark stamped at or before ``ms``: the upper as it stood then."""
    seqnos = sorted(history)
    i = _at_or_before(history, seqnos, ms)
    return history[seqnos[i - 1]] if i else None


def bound(
    history: Mapping[int, Mark], retention_ms: int, now_ms: int, since: int | None
) -> int | None:
    """The highest since the retention allows now: the anchor's upper - 1 (None: the empty
    frontier, the shard was sealed then). With no anchor yet (the window reaches back past
    every mark), the since stays where it is."""
    anchor = _newest_at(history, _cutoff(retention_ms, now_ms))
    if anchor is None:
        return since
    if anchor.upper is None:
        return None
    newest = newest_readable(anchor.upper)
    return 0 if newest is None else newest


def as_of_at(
    history: Mapping[int, Mark],
    retention_ms: int | None,
    now_ms: int,
    since: int | None,
    when_ms: int,
) -> int:
    """The newest time readable at the instant ``when_ms``, from the marks: exact for the
    newest ``FINE`` commits, to a granule before. ``InvalidUsage`` outside what the record and
    the since allow."""
    if when_ms > now_ms:
        raise InvalidUsage("that instant is in the future (by this client's clock)")
    if retention_ms is not None and when_ms < now_ms - retention_ms:
        raise InvalidUsage(
            f"that instant is outside the shard's retention ({retention_ms / 1000:g} s)"
        )
    found = _newest_at(history, when_ms)
    if found is None:
        raise InvalidUsage("the shard's history does not reach back to that instant")
    as_of = newest_readable(found.upper)
    if as_of is None:
        if found.upper is None:
            raise InvalidUsage("the shard was sealed at that instant: give as_of as a time")
        raise InvalidUsage("nothing had been written to the shard at that instant")
    if since is None or as_of < since:
        raise InvalidUsage(
            f"the contents at that instant (as of {as_of}) are no longer readable: the shard's "
            f"since is {since}"
        )
    return as_of


def within(
    history: Mapping[int, Mark], retention_ms: int | None, now_ms: int
) -> list[tuple[int, Mark]]:
    """The marks of commits within the retention window, oldest first."""
    start = now_ms - (_UNRETAINED_MS if retention_ms is None else retention_ms)
    return [(s, history[s]) for s in sorted(history) if history[s].at_ms >= start]
