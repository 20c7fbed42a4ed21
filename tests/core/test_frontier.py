"""Frontiers, without an event loop."""

from __future__ import annotations

import pytest

from persist.core.frontier import newest_readable


@pytest.mark.parametrize(("upper", "newest"), [(1, 0), (2, 1), (7, 6), (2**64 - 1, 2**64 - 2)])
def test_the_newest_readable_time_is_the_one_below_the_upper(upper: int, newest: int) -> None:
    assert newest_readable(upper) == newest


def test_an_upper_of_zero_or_none_names_no_newest_time() -> None:
    # 0: nothing is written yet. None (sealed): every time is final, so none is the newest.
    # Each read door refuses or defaults these in its own words.
    assert newest_readable(0) is None
    assert newest_readable(None) is None
