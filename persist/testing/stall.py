"""A clock that tests can move on, to make a process stall past its lease without waiting.

Leases are measured with the config's ``now_ms``. Clients built with
``PersistConfig(now_ms=clock)`` share ``clock``: wall time plus an offset that ``advance``
moves on, as time passing while a process is paused would. Heartbeats run on the event loop's
real timer, so none fires for the skipped time: which handles heartbeat meanwhile is up to the
test (see ``ShardMachine.stall``).
"""

from __future__ import annotations

from persist.config import wall_clock_ms

__all__ = ["ManualClock"]


class ManualClock:
    """``now_ms`` for a ``PersistConfig``: the wall clock, ``offset_ms`` ahead of it."""

    def __init__(self, offset_ms: int = 0) -> None:
        self.offset_ms = offset_ms

    def __call__(self) -> int:
        return wall_clock_ms() + self.offset_ms

    def advance(self, ms: int) -> None:
        if ms < 0:
            raise ValueError("a clock never moves back")
        self.offset_ms += ms

    def __repr__(self) -> str:
        return f"ManualClock(offset_ms={self.offset_ms})"
