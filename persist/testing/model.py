"""A reference model of one shard: the definite-TVC semantics of the contract, in plain Python.

A shard is a multiset of updates ``(row, time, diff)`` and an ``upper``: every update at a time
below ``upper`` is known and final. Its contents *as of* ``t`` are the updates with
``time <= t``, with equal rows' diffs summed and zero sums dropped. ``compare_and_append``
applies a write iff the upper is the expected one; ``append`` is its replicated form. The model
also keeps every acknowledged write, so a checker can say of each one whether it is present
once, missing or doubled (:meth:`ShardModel.audit`).

Rows are tuples of Python values in schema order (``table_updates`` turns Arrow into them).
As values of a row, NaN equals NaN (persist consolidates two NaN rows into one, as any set of
rows must): ``canonical_row`` replaces every float NaN with the ``NAN`` marker, which the
model's dicts then compare and hash like any value. ``-0.0 == 0.0`` as in Python and Arrow.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from persist.errors import InvalidUsage, UpperMismatch

__all__ = [
    "NAN",
    "Audit",
    "Row",
    "ShardModel",
    "Write",
    "canonical_row",
    "consolidate",
    "contents_of",
    "table_updates",
]

Row = tuple[object, ...]
Update = tuple[Row, int, int]
"""``(row, time, diff)``."""


class _NaN:
    """NaN as a value of a row: equal to itself (a singleton), hashable."""

    _instance: _NaN | None = None

    def __new__(cls) -> _NaN:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NAN"

    def __float__(self) -> float:
        return math.nan


NAN = _NaN()
"""What ``canonical_row`` puts in place of a float NaN."""


def canonical_row(row: Row) -> Row:
    """``row`` with every float NaN replaced by ``NAN`` (so equal rows compare equal)."""
    if any(isinstance(v, float) and math.isnan(v) for v in row):
        return tuple(NAN if isinstance(v, float) and math.isnan(v) else v for v in row)
    return row


def _le(a: int | None, b: int | None) -> bool:
    """``a <= b`` for frontiers, where None is above every time."""
    return b is None or (a is not None and a <= b)


def consolidate(updates: Iterable[Update]) -> dict[tuple[Row, int], int]:
    """``(row, time) -> summed diff``, without zeros."""
    out: dict[tuple[Row, int], int] = {}
    for row, time, diff in updates:
        key = (canonical_row(row), time)
        total = out.get(key, 0) + diff
        if total:
            out[key] = total
        else:
            out.pop(key, None)
    return out


def table_updates(table: pa.Table | pa.RecordBatch, columns: list[str]) -> list[Update]:
    """The updates of an Arrow table of ``columns`` + ``_time`` (+ ``_diff``, default 1)."""
    data = table.to_pydict()
    times = data["_time"]
    diffs = data.get("_diff") or [1] * len(times)
    cols = [data[c] for c in columns]
    return [
        (canonical_row(tuple(col[i] for col in cols)), int(times[i]), int(diffs[i]))
        for i in range(len(times))
    ]


def contents_of(table: pa.Table, columns: list[str], as_of: int | None = None) -> dict[Row, int]:
    """``row -> multiplicity`` of a consolidated read result.

    Raises ``AssertionError`` when the table is not consolidated (a row twice, a zero diff) or,
    given ``as_of``, when a ``_time`` is not ``as_of``.
    """
    out: dict[Row, int] = {}
    for row, time, diff in table_updates(table, columns):
        if as_of is not None and time != as_of:
            raise AssertionError(f"row {row!r} has _time {time}, not the as_of {as_of}")
        if diff == 0:
            raise AssertionError(f"row {row!r} has _diff 0 in a consolidated result")
        if row in out:
            raise AssertionError(f"row {row!r} appears twice in a consolidated result")
        out[row] = diff
    return out


@dataclass(frozen=True)
class Write:
    """An acknowledged write: the updates it applied, all at times in ``[lower, upper)``."""

    lower: int
    upper: int | None
    updates: Mapping[tuple[Row, int], int]
    label: str = ""


@dataclass
class Audit:
    """The verdict on every acknowledged write whose times are still distinguishable."""

    checked: int = 0
    present: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    merged: int = 0  # writes at or below since: checked as part of the contents only
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.wrong == 0


@dataclass
class ShardModel:
    """The state of one shard as the contract defines it."""

    upper: int | None = 0
    updates: dict[tuple[Row, int], int] = field(default_factory=dict)
    writes: list[Write] = field(default_factory=list)

    # --- writing -------------------------------------------------------------------------------

    def compare_and_append(
        self, updates: Iterable[Update], expected: int | None, new: int | None, label: str = ""
    ) -> None:
        """Applies ``updates`` and moves the upper from ``expected`` to ``new``, iff the upper is
        ``expected``; else ``UpperMismatch``. Times must lie in ``[expected, new)``."""
        batch = list(updates)
        self._check_range(batch, expected, new)
        if self.upper != expected:
            raise UpperMismatch(expected, self.upper)
        self._apply(batch, expected, new, label)

    def append(
        self, updates: Iterable[Update], lower: int, upper: int | None, label: str = ""
    ) -> int | None:
        """The replicated writer's append; returns the lower it applied from (None: nothing)."""
        batch = list(updates)
        self._check_range(batch, lower, upper)
        current = self.upper
        if _le(upper, current):
            return None
        assert current is not None
        if current < lower:
            raise UpperMismatch(lower, current)
        kept = [u for u in batch if u[1] >= current]
        self._apply(kept, current, upper, label)
        return current

    def _check_range(self, batch: list[Update], lower: int | None, upper: int | None) -> None:
        if not _le(lower, upper):
            raise InvalidUsage(f"upper {upper} is below lower {lower}")
        if lower is None and batch:
            raise InvalidUsage("nothing can be appended to a shard whose upper is None")
        for _, time, _ in batch:
            if lower is None or time < lower or (upper is not None and time >= upper):
                raise InvalidUsage(f"time {time} is outside [{lower}, {upper})")

    def _apply(self, batch: list[Update], lower: int | None, new: int | None, label: str) -> None:
        consolidated = consolidate(batch)
        for key, diff in consolidated.items():
            total = self.updates.get(key, 0) + diff
            if total:
                self.updates[key] = total
            else:
                self.updates.pop(key, None)
        if lower is not None and lower != new:
            self.writes.append(Write(lower, new, consolidated, label))
        self.upper = new

    # --- reading -------------------------------------------------------------------------------

    def readable(self, as_of: int) -> bool:
        """Whether contents as of ``as_of`` are final (``as_of < upper``)."""
        return self.upper is None or as_of < self.upper

    def contents_as_of(self, as_of: int) -> dict[Row, int]:
        """Every update at a time ``<= as_of``, consolidated: ``row -> multiplicity``."""
        out: dict[Row, int] = {}
        for (row, time), diff in self.updates.items():
            if time <= as_of:
                total = out.get(row, 0) + diff
                if total:
                    out[row] = total
                else:
                    out.pop(row, None)
        return out

    def updates_between(self, lower: int, upper: int | None) -> dict[tuple[Row, int], int]:
        """The updates with ``lower <= time < upper``, consolidated per (row, time)."""
        return {
            key: diff
            for key, diff in self.updates.items()
            if key[1] >= lower and (upper is None or key[1] < upper)
        }

    # --- checking ------------------------------------------------------------------------------

    def audit(self, actual: Mapping[tuple[Row, int], int], since: int) -> Audit:
        """Checks every acknowledged write against ``actual``: the updates read back with
        ``time > since`` (e.g. by listening from ``since``), per (row, time).

        Writes are disjoint in time, so each write with ``lower > since`` owns exactly the
        updates at its times: present when they match, lost when none are there, duplicated when
        every diff is doubled. Writes at or below ``since`` were consolidated as of ``since``
        and are only counted as ``merged`` (the caller compares the contents as of ``since``).
        """
        audit = Audit()
        by_time: dict[int, dict[Row, int]] = {}
        for (row, time), diff in actual.items():
            by_time.setdefault(time, {})[row] = diff
        for w in self.writes:
            if w.lower <= since:
                audit.merged += 1
                continue
            audit.checked += 1
            times = {t for _, t in w.updates}
            found = {(row, t): d for t in sorted(times) for row, d in by_time.get(t, {}).items()}
            # Updates at the write's times that the write did not make are someone else's bug;
            # restrict to the write's own interval to judge this write.
            expected = dict(w.updates)
            if found == expected:
                audit.present += 1
            elif expected and not any(k in found for k in expected):
                audit.lost += 1
                audit.problems.append(f"write {w.label or (w.lower, w.upper)} is lost")
            elif expected and found == {k: 2 * d for k, d in expected.items()}:
                audit.duplicated += 1
                audit.problems.append(f"write {w.label or (w.lower, w.upper)} applied twice")
            else:
                audit.wrong += 1
                audit.problems.append(
                    f"write {w.label or (w.lower, w.upper)}: expected {expected}, found {found}"
                )
        return audit
