"""A backend that tries a call several times itself tells persist's retry loop so.

Otherwise the two multiply: each of persist's tries would make all of the backend's, and a
stalled store would hold a call for the product of both counts of timeouts.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["backoff_delays", "mark_tries_spent", "tries_spent"]

_E = TypeVar("_E", bound=BaseException)
_ATTR = "_persist_tries_spent"


def backoff_delays(initial_s: float, attempts: int, cap_s: float = 2.0) -> list[float]:
    """The sleeps between ``attempts`` tries: exponential from ``initial_s``, capped. The one
    rule for persist's retry loops (``retry_idempotent``, ``CasRetry``) and a backend's own
    tries."""
    return [min(cap_s, initial_s * (2**i)) for i in range(max(attempts - 1, 0))]


def mark_tries_spent(exc: _E) -> _E:
    """``exc``, marked as the failure of a backend's last try: persist raises it as is."""
    setattr(exc, _ATTR, True)
    return exc


def tries_spent(exc: BaseException) -> bool:
    """Whether the backend that raised ``exc`` has made every try it may already."""
    return getattr(exc, _ATTR, False) is True
