"""What a writer and a reader share: a lease on the shard, renewed in the background."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from persist.core.shard.clock import Now
from persist.core.shard.transitions import Outcome
from persist.core.shard.types import State
from persist.errors import ExternalError, InvalidUsage, LeaseExpired
from persist.internal.tasks import being_cancelled

if TYPE_CHECKING:
    from persist.internal.machine import Machine

__all__ = ["LeasedHandle"]


class LeasedHandle:
    """A handle leased on one shard: ``_kind`` names it in errors; subclasses say how it
    heartbeats (``_heartbeat``) and how it is expired (``_expiry``)."""

    _kind = "handle"

    def __init__(self, machine: Machine, handle_id: str, lease_ms: int | None = None) -> None:
        self._machine = machine
        self._id = handle_id
        # A quarter of the lease at most, so that a few lost heartbeats don't expire it.
        interval = machine.cfg.heartbeat_interval_s
        self._heartbeat_s = interval if lease_ms is None else min(interval, lease_ms / 4000)
        # Why the handle can't be used any more (it expired, or was expired), else None.
        self._expired: str | None = None
        self._heartbeat_task = machine.tasks.spawn(self._heartbeat_loop(), f"heartbeat {handle_id}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._id} of {self.shard_id}>"

    @property
    def shard_id(self) -> str:
        return self._machine.shard_id

    async def expire(self) -> None:
        """Gives up this handle's lease (a reader releases its hold on since). The handle can't
        be used afterwards."""
        if self._expired is not None:
            return
        self._expired = "it was expired"
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        await self._machine.apply(self._expiry)
        self._machine.registered.discard(self._id)

    def detach(self) -> None:
        """Hands this handle's registration to another process, which resumes it by id
        (``resume_writer`` / ``resume_reader``): the client's ``close`` then stops heartbeating
        it without expiring it, so it stays registered until its lease runs out unless someone
        heartbeats or expires it, and ``drop_shard`` counts it as another's (it needs
        ``force``). The handle stays usable until the client closes. Idempotent."""
        self._machine.registered.discard(self._id)

    async def heartbeat(self) -> None:
        """Renews this handle's lease now (the background heartbeat does it every so often);
        ``LeaseExpired`` if it had run out."""
        self._check_live()
        try:
            await self._heartbeat()
        except LeaseExpired as exc:
            self._expired = str(exc)
            raise

    def _check_live(self) -> None:
        if self._expired is not None:
            raise LeaseExpired(f"{self._kind} {self._id} can't be used: {self._expired}")
        if self._machine.tasks.closed:
            raise InvalidUsage("the persist client was closed")

    def _expiry(self, state: State, now: Now) -> Outcome[None]:
        raise NotImplementedError

    async def _heartbeat(self) -> None:
        raise NotImplementedError

    async def _heartbeat_loop(self) -> None:
        while self._expired is None:
            await asyncio.sleep(self._heartbeat_s)
            try:
                await self._heartbeat()
            except LeaseExpired as exc:
                self._expired = str(exc)
            except ExternalError as exc:
                if being_cancelled():
                    raise asyncio.CancelledError() from exc
                continue  # try again next interval; the lease has slack for this
