"""The judge of a write's outcome: what its caller was told, checked against the shard.

A call under test ends in one of four ways (``Outcome``): it succeeded; it was refused with
``UpperMismatch``; it failed determinately, so nothing happened; or it failed indeterminately
(an indeterminate ``ExternalError``, a cancellation, ``LeaseExpired`` after a stall), so it may
have happened or not. ``Told.of(error)`` says which.

``Judge.write(told, asked, retry)`` takes what a write's caller was told and what the write
asked for (``Asked``: the upper before it, the upper it sets, whether it had to be refused),
checks the two agree with the shard, settles a write in doubt (by the same call made again when
``retry`` is given, else by a read of the upper), and says whether the write landed; the rule
then applies a landed write to the model. ``Judge.raced`` judges each of several writes that
raced for one upper, once a read of the upper has named the winner.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from persist.errors import ExternalError, UpperMismatch
from persist.testing.stats import MachineStats

__all__ = ["TOLD_OK", "Asked", "Interrupted", "Judge", "Outcome", "Retry", "Told"]


class Interrupted(Exception):
    """A call under test ended without an answer: cancelled, or its handle expired after a
    stall (and was dropped)."""


class Outcome(enum.Enum):
    """How a call ended, as its caller was told."""

    OK = "ok"
    MISMATCH = "mismatch"
    DETERMINATE = "determinate"
    INDETERMINATE = "indeterminate"


@dataclass(frozen=True)
class Told:
    """How a call under test ended, as its caller was told, and the error that told it."""

    outcome: Outcome
    error: BaseException | None = None

    @classmethod
    def of(cls, error: BaseException) -> Told:
        """What ``error`` tells the caller; any error that tells none of it is raised again."""
        if isinstance(error, UpperMismatch):
            return cls(Outcome.MISMATCH, error)
        if isinstance(error, ExternalError):
            return cls(Outcome.DETERMINATE if error.determinate else Outcome.INDETERMINATE, error)
        if isinstance(error, Interrupted):
            # The call may have taken effect before it was cut off: a retry or a read tells.
            return cls(Outcome.INDETERMINATE, error)
        raise error

    @property
    def interrupted(self) -> bool:
        return isinstance(self.error, Interrupted)

    @property
    def current(self) -> int | None:
        """The upper that a refusal (``UpperMismatch``) reported."""
        assert isinstance(self.error, UpperMismatch), self.error
        return self.error.current

    def in_doubt(self) -> Told:
        """The same, with a determinate failure taken as one in doubt (settled like one)."""
        if self.outcome is Outcome.DETERMINATE:
            return Told(Outcome.INDETERMINATE, self.error)
        return self


TOLD_OK = Told(Outcome.OK)


@dataclass(frozen=True)
class Asked:
    """What a write asked of the shard, as the model knows it."""

    client: int  # the writer's client: it reads the upper to settle a write in doubt
    before: int  # the shard's upper before the write (the model's)
    new: int | None  # the upper the write sets if it lands
    refused: bool = False  # it must not land: a wrong expected upper, or a gap before it
    what: str = "a write"  # names it in failures


@dataclass(frozen=True)
class Retry:
    """Settling a write in doubt by making the same call again.

    ``again`` makes it and says what it was told; None when it can't be made any more (its
    writer expired after a stall). ``idempotent``: the call succeeds again whether or not its
    first try landed (``append``); else a landed first try refuses it with ``UpperMismatch``
    at the new upper (``compare_and_append``).
    """

    again: Callable[[], Told | None]
    idempotent: bool = False


class Judge:
    """Says whether a write under test landed, checking what its caller was told.

    ``read_upper(client)`` reads the shard's upper through a client; ``attempts`` bounds the
    retries of a write in doubt. Errors and resolutions are counted in ``stats``.
    """

    def __init__(
        self, stats: MachineStats, read_upper: Callable[[int], int | None], attempts: int
    ) -> None:
        self.stats = stats
        self.read_upper = read_upper
        self.attempts = attempts

    def note(self, told: Told) -> None:
        """Counts an error a caller was told (an interruption is counted where it happens)."""
        if told.interrupted:
            return
        if told.outcome is Outcome.DETERMINATE:
            self.stats.determinate_errors += 1
        elif told.outcome is Outcome.INDETERMINATE:
            self.stats.indeterminate_errors += 1
        elif told.outcome is Outcome.MISMATCH:
            self.stats.refused += 1

    def write(self, told: Told, asked: Asked, retry: Retry | None = None) -> bool:
        """Whether the write ``asked`` landed, given that its caller was ``told``.

        Nothing else writes during a rule, so the model's upper is the shard's: a write at it
        can't be refused, and one that failed determinately left it where it was.
        """
        if asked.refused:
            return self._refused(told, asked)
        if told.outcome is Outcome.OK:
            return True
        if told.outcome is Outcome.MISMATCH:
            raise AssertionError(
                f"{asked.what} was refused at the right upper {asked.before}: {told.error}"
            )
        if told.outcome is Outcome.DETERMINATE:
            actual = self.read_upper(asked.client)
            assert actual == asked.before, (
                f"{asked.what} failed determinately, but the upper is {actual}, not {asked.before}"
            )
            return False
        if retry is not None:
            return self._retry(asked, retry)
        return self._resolve(asked, asked.new)

    def raced(self, told: Told, *, won: bool, upper: int | None, what: str) -> None:
        """Checks what one of several writes racing for one upper was told, once a read of the
        upper (``upper``) has said whether it ``won``."""
        if told.outcome is Outcome.OK:
            assert won, f"{what} was told it won, but the upper is {upper}"
        elif told.outcome is Outcome.MISMATCH:
            assert not won, f"{what} won, but was told it was refused: {told.error}"
            assert told.current == upper, (told.current, upper)
        elif told.outcome is Outcome.DETERMINATE:
            assert not won, f"{what} failed determinately but its write landed"
        else:
            self._count(won)

    def _refused(self, told: Told, asked: Asked) -> bool:
        """A write that had to be refused (or fail before it could tell): it never lands."""
        assert told.outcome is not Outcome.OK, (
            f"{asked.what} succeeded, but it had to be refused at upper {asked.before}"
        )
        if told.outcome is Outcome.MISMATCH:
            assert told.current == asked.before, (told.current, asked.before)
        elif told.outcome is Outcome.INDETERMINATE:
            self._resolve(asked, asked.before)
        return False

    def _retry(self, asked: Asked, retry: Retry) -> bool:
        """Settles a write in doubt by making it again: it must then apply, or find itself
        already applied; a read settles it when the writer can't try again."""
        for _ in range(self.attempts):
            told = retry.again()
            if told is None:
                break
            if told.outcome is Outcome.OK:
                if retry.idempotent:
                    self.stats.resolved_by_retry += 1
                else:
                    # Had the first try landed, this one would have been refused.
                    self.stats.resolved_not_landed += 1
                return True
            if told.outcome is Outcome.MISMATCH:
                assert not retry.idempotent, told.error
                # The first try had landed: the retry must not apply it again.
                assert told.current == asked.new, (told.current, asked.new)
                self.stats.resolved_landed += 1
                return True
        return self._resolve(asked, asked.new)

    def _resolve(self, asked: Asked, new: int | None) -> bool:
        """Whether a write in doubt moved the upper from ``asked.before`` to ``new``, by a read
        (``new`` is ``asked.before`` for a write that could not land)."""
        actual = self.read_upper(asked.client)
        assert actual in (asked.before, new), (
            f"after {asked.what} {asked.before}->{new} the upper is {actual}"
        )
        landed = actual == new and asked.before != new
        self._count(landed)
        return landed

    def _count(self, landed: bool) -> None:
        if landed:
            self.stats.resolved_landed += 1
        else:
            self.stats.resolved_not_landed += 1
