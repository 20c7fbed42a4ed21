"""The errors persist raises.

Every error persist raises is a :class:`PersistError`::

    PersistError
    ├── InvalidUsage          the caller asked for something impossible; nothing changed
    │   ├── LeaseExpired      the handle's lease ran out; open a new handle
    │   └── WrongBlobLocation the shard's data lives in another blob location than the client's
    ├── UpperMismatch         the expected upper did not hold; nothing was written
    └── ExternalError         blob or consensus failed (.determinate says if it may have happened)
        └── IntegrityError    stored data failed its checksum or could not be decoded

Backend errors are translated into :class:`ExternalError` once, at the location boundary, with
the original exception chained as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "ExternalError",
    "IntegrityError",
    "InvalidUsage",
    "LeaseExpired",
    "PersistError",
    "SchemaChanged",
    "UpperMismatch",
    "WrongBlobLocation",
]


class PersistError(Exception):
    """Base class of every error persist raises."""


class InvalidUsage(PersistError):
    """The caller asked for something impossible. Nothing was changed."""


class LeaseExpired(InvalidUsage):
    """The handle's lease expired (it stopped heart-beating); its holds were released.

    Open a new handle: the expired handle's id is never reused.
    """


class WrongBlobLocation(InvalidUsage):
    """The shard's state is in this client's consensus, but its data is in another blob
    location: it was created through a client connected to the same consensus and a
    different blob location. Connect with that blob location to use it."""


class SchemaChanged(PersistError):
    """``evolve_schema``'s ``expected_version`` was not the shard's schema version; nothing
    changed. ``expected`` is what the caller expected, ``current`` the version found."""

    def __init__(self, expected: int, current: int) -> None:
        super().__init__(
            f"expected schema version {expected!r} but the shard's schema is at version {current!r}"
        )
        self.expected = expected
        self.current = current

    def __reduce__(self) -> tuple[type[SchemaChanged], tuple[int, int]]:
        return (type(self), (self.expected, self.current))


class UpperMismatch(PersistError):
    """The shard upper was not the expected one; nothing was written.

    ``expected`` is what the caller expected, ``current`` the upper that was found.
    """

    def __init__(self, expected: int | None, current: int | None) -> None:
        super().__init__(f"expected upper {expected!r} but the shard upper is {current!r}")
        self.expected = expected
        self.current = current

    def __reduce__(self) -> tuple[type[UpperMismatch], tuple[int | None, int | None]]:
        return (type(self), (self.expected, self.current))


class ExternalError(PersistError):
    """Blob or consensus failed.

    ``determinate`` is True when the operation certainly did not happen (safe to retry as is)
    and False when it may have happened.
    """

    def __init__(self, message: str, *, determinate: bool) -> None:
        super().__init__(message)
        self.determinate = determinate

    def __reduce__(
        self,
    ) -> tuple[object, tuple[type[ExternalError], str, bool]]:
        # Errors cross process boundaries (multi-process writers, Spark executors).
        return (_rebuild_external, (type(self), str(self), self.determinate))


class IntegrityError(ExternalError):
    """Stored data failed its checksum or could not be decoded. Never returned as data."""

    def __init__(self, message: str, *, determinate: bool = True) -> None:
        super().__init__(message, determinate=determinate)


def _rebuild_external(cls: type[ExternalError], message: str, determinate: bool) -> ExternalError:
    return cls(message, determinate=determinate)


# The name persist is published under. The import name is ``persist``, but that distribution name
# belongs to an unrelated project on PyPI, so every install line must name this one.
DISTRIBUTION = "persist-shards"


def install_hint(extra: str) -> str:
    """The ``pip install`` line that adds persist's ``extra``."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"
