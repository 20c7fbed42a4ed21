"""Questions asked of a shard's state by reads: which parts hold what a read needs.

Pure functions of the state (no I/O), so that the read paths (snapshots, splits, listens, and
the front ends' reads) ask them one way and they are tested without an event loop.
"""

from __future__ import annotations

from persist.core.frontier import Frontier
from persist.core.state import PartRef, State

__all__ = ["inline_bytes", "parts_as_of", "parts_between"]


def inline_bytes(state: State) -> int:
    """How many bytes of part data the state holds inline."""
    return sum(len(p.inline) for b in state.batches.values() for p in b.parts)


def parts_as_of(state: State, as_of: int) -> list[PartRef]:
    """The parts that can hold updates at times ``<= as_of``: those of the batches whose lower
    is at or below it, less the parts whose updates all come later."""
    return [
        p
        for b in state.batches.values()
        if b.lower <= as_of
        for p in b.parts
        if p.min_time <= as_of
    ]


def parts_between(state: State, lower: int, upper: Frontier) -> list[PartRef]:
    """The parts that can hold updates at times in ``[lower, upper)`` (``upper`` None: no end):
    those of the batches that overlap it, less the parts whose times all lie outside it."""
    return [
        p
        for b in state.batches.values()
        if (b.upper is None or b.upper > lower) and (upper is None or b.lower < upper)
        for p in b.parts
        if p.max_time >= lower and (upper is None or p.min_time < upper)
    ]
