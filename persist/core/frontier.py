"""Frontiers: times as ints, with None for the empty frontier (after every time), and the
checks of frontiers a caller hands in."""

from __future__ import annotations

from collections.abc import Iterable

from persist.errors import InvalidUsage

__all__ = [
    "Frontier",
    "check_below_upper",
    "check_bounds",
    "check_frontier",
    "check_since",
    "frontier_le",
    "frontier_max",
    "frontier_min",
    "newest_readable",
]

Frontier = int | None
"""A time frontier: an int, or None for the empty frontier (greater than every time)."""


def frontier_le(a: Frontier, b: Frontier) -> bool:
    """``a <= b``, where None (the empty frontier) is greater than every time."""
    if b is None:
        return True
    if a is None:
        return False
    return a <= b


def frontier_min(values: Iterable[Frontier]) -> Frontier:
    out: Frontier = None
    for v in values:
        if v is not None and (out is None or v < out):
            out = v
    return out


def frontier_max(a: Frontier, b: Frontier) -> Frontier:
    return a if frontier_le(b, a) else b


def newest_readable(upper: Frontier) -> int | None:
    """The newest time whose contents an ``upper`` makes final: ``upper - 1``. None when the
    upper names none: 0 (nothing is written yet) or None (sealed: every time is final, so none
    is the newest). Callers refuse or default each case in their own words."""
    if upper is None or upper == 0:
        return None
    return upper - 1


def check_since(as_of: int, since: Frontier) -> None:
    """``InvalidUsage`` naming both unless a read at ``as_of`` is at or above ``since``."""
    if not frontier_le(since, as_of):
        raise InvalidUsage(f"as_of {as_of} is below the shard's since {since}")


def check_below_upper(as_of: int, upper: Frontier) -> None:
    """``InvalidUsage`` naming both unless ``as_of`` is below ``upper`` (None, the empty
    frontier, is above every time)."""
    if upper is not None and as_of >= upper:
        raise InvalidUsage(f"as_of {as_of} is not below the shard's upper {upper}")


def check_frontier(name: str, value: object, *, allow_none: bool = True) -> int | None:
    """``value`` if it is a time (an int in ``[0, 2**64)``) or, with ``allow_none``, None;
    else ``InvalidUsage`` naming it ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 2**64:
        raise InvalidUsage(f"{name} must be a time (an int in [0, 2**64)), not {value!r}")
    return value


def check_bounds(
    lower: object, upper: object, names: tuple[str, str], *, lower_may_be_none: bool = False
) -> tuple[int | None, int | None]:
    """``(lower, upper)`` checked as frontiers with ``lower <= upper``; else ``InvalidUsage``
    naming both (by ``names``) and the rule."""
    lo = check_frontier(names[0], lower, allow_none=lower_may_be_none)
    hi = check_frontier(names[1], upper)
    if not frontier_le(lo, hi):
        raise InvalidUsage(
            f"{names[1]} {hi} is below {names[0]} {'None' if lo is None else lo}: "
            f"{names[1]} must be >= {names[0]} (None, the empty frontier, is above every time)"
        )
    return lo, hi
