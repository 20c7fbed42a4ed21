"""The judge of a write's outcome (``persist.testing.judge``), on its own: what each thing a
caller can be told means for whether the write landed, and which reads settle it."""

from __future__ import annotations

import pytest

from persist.errors import ExternalError, LeaseExpired, UpperMismatch
from persist.testing import MachineStats
from persist.testing.judge import TOLD_OK, Asked, Interrupted, Judge, Outcome, Retry, Told

DETERMINATE = Told.of(ExternalError("failed before it ran", determinate=True))
INDETERMINATE = Told.of(ExternalError("reply lost", determinate=False))
CANCELLED = Told.of(Interrupted("cancelled"))


class Shard:
    """A shard whose upper the judge reads, counting the reads."""

    def __init__(self, upper: int | None) -> None:
        self.upper = upper
        self.reads = 0

    def read_upper(self, client: int) -> int | None:
        self.reads += 1
        return self.upper


def judge(upper: int | None) -> tuple[Judge, Shard, MachineStats]:
    shard, stats = Shard(upper), MachineStats()
    return Judge(stats, shard.read_upper, attempts=3), shard, stats


def test_told_of_classifies_errors() -> None:
    assert Told.of(UpperMismatch(1, 2)).outcome is Outcome.MISMATCH
    assert Told.of(UpperMismatch(1, 2)).current == 2
    assert DETERMINATE.outcome is Outcome.DETERMINATE
    assert INDETERMINATE.outcome is Outcome.INDETERMINATE and not INDETERMINATE.interrupted
    assert CANCELLED.outcome is Outcome.INDETERMINATE and CANCELLED.interrupted
    assert DETERMINATE.in_doubt().outcome is Outcome.INDETERMINATE
    assert TOLD_OK.in_doubt() is TOLD_OK
    with pytest.raises(LeaseExpired):
        Told.of(LeaseExpired("not one of the four"))


def test_a_write_at_the_upper() -> None:
    j, shard, _ = judge(3)
    asked = Asked(0, 3, 4)
    assert j.write(TOLD_OK, asked) and shard.reads == 0
    with pytest.raises(AssertionError, match="refused at the right upper"):
        j.write(Told.of(UpperMismatch(3, 3)), asked)
    # A determinate failure is checked by a read: the upper did not move.
    assert not j.write(DETERMINATE, asked) and shard.reads == 1
    shard.upper = 4
    with pytest.raises(AssertionError, match="failed determinately"):
        j.write(DETERMINATE, asked)


def test_a_write_in_doubt_is_settled_by_a_read() -> None:
    j, shard, stats = judge(4)
    assert j.write(INDETERMINATE, Asked(0, 3, 4))
    shard.upper = 3
    assert not j.write(CANCELLED, Asked(0, 3, 4))
    assert (stats.resolved_landed, stats.resolved_not_landed) == (1, 1)
    shard.upper = 7
    with pytest.raises(AssertionError, match="the upper is 7"):
        j.write(INDETERMINATE, Asked(0, 3, 4))


def test_a_write_that_had_to_be_refused() -> None:
    j, shard, stats = judge(3)
    asked = Asked(0, 3, 5, refused=True)
    with pytest.raises(AssertionError, match="had to be refused"):
        j.write(TOLD_OK, asked)
    assert not j.write(Told.of(UpperMismatch(4, 3)), asked)
    with pytest.raises(AssertionError):
        j.write(Told.of(UpperMismatch(4, 2)), asked)  # the refusal named the wrong upper
    assert not j.write(DETERMINATE, asked) and shard.reads == 0
    assert not j.write(INDETERMINATE, asked) and stats.resolved_not_landed == 1
    shard.upper = 5
    with pytest.raises(AssertionError):
        j.write(INDETERMINATE, asked)  # it landed after all


def retry(*answers: Told | None, idempotent: bool = False) -> Retry:
    queue = list(answers)
    return Retry(lambda: queue.pop(0), idempotent=idempotent)


def test_a_compare_and_append_in_doubt_is_settled_by_retrying_it() -> None:
    j, shard, stats = judge(3)
    asked = Asked(0, 3, 4)
    # The retry applies it: the first try had not landed.
    assert j.write(INDETERMINATE, asked, retry(DETERMINATE, TOLD_OK))
    assert stats.resolved_not_landed == 1
    # The retry is refused at the new upper: the first try had landed.
    assert j.write(INDETERMINATE, asked, retry(Told.of(UpperMismatch(3, 4))))
    assert stats.resolved_landed == 1
    with pytest.raises(AssertionError):
        j.write(INDETERMINATE, asked, retry(Told.of(UpperMismatch(3, 5))))
    # The writer can't try again (it expired after a stall): a read settles it.
    assert not j.write(INDETERMINATE, asked, retry(None))
    assert shard.reads == 1 and stats.resolved_not_landed == 2


def test_an_append_in_doubt_is_settled_by_retrying_it() -> None:
    j, shard, stats = judge(3)
    asked = Asked(0, 3, 4)
    assert j.write(INDETERMINATE, asked, retry(INDETERMINATE, TOLD_OK, idempotent=True))
    assert stats.resolved_by_retry == 1 and shard.reads == 0
    with pytest.raises(AssertionError):
        j.write(INDETERMINATE, asked, retry(Told.of(UpperMismatch(3, 4)), idempotent=True))
    # Every retry in doubt too: a read settles it once they run out.
    shard.upper = 4
    assert j.write(INDETERMINATE, asked, retry(*[INDETERMINATE] * 3, idempotent=True))
    assert shard.reads == 1 and stats.resolved_landed == 1


def test_racers_are_judged_by_the_upper_read_after_the_race() -> None:
    j, _, stats = judge(5)
    j.raced(TOLD_OK, won=True, upper=5, what="racer 0")
    j.raced(Told.of(UpperMismatch(3, 5)), won=False, upper=5, what="racer 1")
    j.raced(DETERMINATE, won=False, upper=5, what="racer 1")
    j.raced(INDETERMINATE, won=True, upper=5, what="racer 0")
    j.raced(CANCELLED, won=False, upper=5, what="racer 1")
    assert (stats.resolved_landed, stats.resolved_not_landed) == (1, 1)
    with pytest.raises(AssertionError, match="was told it won"):
        j.raced(TOLD_OK, won=False, upper=5, what="racer 1")
    with pytest.raises(AssertionError):
        j.raced(Told.of(UpperMismatch(3, 4)), won=False, upper=5, what="racer 1")
    with pytest.raises(AssertionError, match="failed determinately"):
        j.raced(DETERMINATE, won=True, upper=5, what="racer 0")


def test_errors_are_counted_but_interruptions_are_not() -> None:
    j, _, stats = judge(0)
    for told in (DETERMINATE, INDETERMINATE, CANCELLED, Told.of(UpperMismatch(0, 1)), TOLD_OK):
        j.note(told)
    assert (stats.determinate_errors, stats.indeterminate_errors, stats.refused) == (1, 1, 1)
