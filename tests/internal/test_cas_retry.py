"""The catalog's compare-and-set loop and a shard's commit loop follow one retry rule
(``retry.CasRetry``): the same script of consensus failures gets the same tries, the same
outcome and the same error from both.

What the scripted world holds, of all that can touch a compare-and-set loop: another writer
that commits just ahead of a try (a lost race); consensus failing determinately before a try
runs, indeterminately before it is sent, and indeterminately after it landed. Left out, and
proved elsewhere: a client that restarts mid-loop, damaged bytes in the value read back, and
clocks (``tests/harness``' state machines and ``tests/api/test_faults.py``); this file asserts
only that both loops decide alike, not what a real backend does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import pyarrow as pa
import pytest

import persist
from persist.core import catalog as cat
from persist.errors import ExternalError
from persist.internal.catalog import CATALOG_KEY, change_catalog, read_catalog
from persist.internal.retry import CasRetry
from persist.location import Consensus, Pushed, VersionedData
from persist.location.mem import MemBlob, MemConsensus

SCHEMA = pa.schema([("k", pa.int64())])

# What one scripted compare-and-set does: fail determinately before it runs ("before"),
# indeterminately before it runs ("unsent") or after it landed ("after"), or lose to a change
# another writer commits just ahead of it ("race").
Step = Literal["before", "unsent", "after", "race"]


class Scripted(Consensus):
    """Consensus whose compare-and-sets of the armed key follow ``script``, then run as is."""

    def __init__(self) -> None:
        self.inner = MemConsensus()
        self.key: str | None = None
        self.script: list[Step] = []
        self.tries = 0
        # Commits another writer's change to the armed key (for "race").
        self.rival: Callable[[], Awaitable[None]] | None = None

    def arm(self, key: str, script: list[Step]) -> None:
        self.key, self.script, self.tries = key, list(script), 0

    async def head(self, key: str) -> VersionedData | None:
        return await self.inner.head(key)

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        if key != self.key:
            return await self.inner.compare_and_set(key, expected_seqno, data)
        self.tries += 1
        step = self.script.pop(0) if self.script else None
        if step == "before":
            raise ExternalError("refused before running", determinate=True)
        if step == "unsent":
            raise ExternalError("timed out before running", determinate=False)
        if step == "race":
            assert self.rival is not None
            await self.rival()
        landed = await self.inner.compare_and_set(key, expected_seqno, data)
        if step == "after" and landed:
            raise ExternalError("reply lost after landing", determinate=False)
        return landed

    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return await self.inner.scan(key, from_seqno, limit)

    async def truncate(self, key: str, seqno: int) -> int:
        return await self.inner.truncate(key, seqno)

    def watch(self, key: str, on_change: Pushed) -> Callable[[], None] | None:
        return None


@dataclass
class Run:
    """What one loop did under a script: its compare-and-set tries, what it asked the rule,
    how it ended, and how many times its change is in consensus."""

    tries: int = 0
    asked: list[str] = field(default_factory=list)
    error: ExternalError | None = None
    applied: int = 0


def config(attempts: int) -> persist.PersistConfig:
    return persist.PersistConfig(
        retry_attempts=attempts,
        retry_initial_delay_s=0.001,
        compaction_enabled=False,
        retention_s=None,
    )


@asynccontextmanager
async def spying(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[str]]:
    """The calls any loop makes of ``CasRetry`` meanwhile: proof that it follows that rule."""
    asked: list[str] = []
    failed, lost = CasRetry.failed, CasRetry.lost_race

    def spy_failed(self: CasRetry, exc: ExternalError) -> float | None:
        asked.append("determinate" if exc.determinate else "indeterminate")
        return failed(self, exc)

    def spy_lost(self: CasRetry) -> None:
        asked.append("lost")
        lost(self)

    with monkeypatch.context() as patch:
        patch.setattr(CasRetry, "failed", spy_failed)
        patch.setattr(CasRetry, "lost_race", spy_lost)
        yield asked


async def run_catalog(script: list[Step], attempts: int, monkeypatch: pytest.MonkeyPatch) -> Run:
    consensus, cfg, run = Scripted(), config(attempts), Run()

    async def rival() -> None:
        name = f"rival{consensus.tries}"
        await change_catalog(
            consensus.inner, cfg, lambda c, now: cat.add(c, name, f"r-{name}", now)
        )

    consensus.rival = rival
    consensus.arm(CATALOG_KEY, script)
    async with spying(monkeypatch) as asked:
        try:
            await change_catalog(consensus, cfg, lambda c, now: cat.add(c, "a.b", "s-1", now))
        except ExternalError as exc:
            run.error = exc
    run.tries, run.asked = consensus.tries, asked
    _, catalog = await read_catalog(consensus.inner, cfg)
    run.applied = sum(e.shard_id == "s-1" for e in catalog.names.values())
    return run


async def run_shard(script: list[Step], attempts: int, monkeypatch: pytest.MonkeyPatch) -> Run:
    consensus, blob, cfg, run = Scripted(), MemBlob(), config(attempts), Run()
    shard = persist.ShardId.new()
    async with persist.PersistClient(blob, consensus, cfg) as client:
        write = await client.open_writer(shard, SCHEMA)
        async with persist.PersistClient(blob, consensus.inner, cfg) as other:

            async def rival() -> None:
                # Another process registers a writer: a commit of its own to the shard.
                await other.open_writer(shard, SCHEMA)

            consensus.rival = rival
            consensus.arm(str(shard), script)
            data = pa.table({"k": [1], "_time": pa.array([0], pa.uint64()), "_diff": [1]})
            async with spying(monkeypatch) as asked:
                try:
                    await write.compare_and_append(data, 0, 1)
                except ExternalError as exc:
                    run.error = exc
            run.tries, run.asked = consensus.tries, asked
            consensus.arm("", [])
            run.applied = (await other.inspect(shard))["batches"]
    return run


LOOPS = {"catalog": run_catalog, "shard": run_shard}


@pytest.mark.parametrize("loop", sorted(LOOPS))
async def test_a_failure_of_either_kind_is_retried_and_the_change_lands_once(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = await LOOPS[loop](["before", "after"], 5, monkeypatch)
    assert run.error is None
    # The second try landed though it failed; the re-read found it, so there is no third.
    assert (run.tries, run.asked, run.applied) == (2, ["determinate", "indeterminate"], 1)


@pytest.mark.parametrize("loop", sorted(LOOPS))
async def test_an_uncertain_try_makes_the_final_failure_indeterminate(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = await LOOPS[loop](["before", "unsent", "before"], 3, monkeypatch)
    assert run.error is not None and run.error.determinate is False
    assert (run.tries, run.asked, run.applied) == (
        3,
        ["determinate", "indeterminate", "determinate"],
        0,
    )


@pytest.mark.parametrize("loop", sorted(LOOPS))
async def test_certain_failures_give_up_after_the_tries_as_certain(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = await LOOPS[loop](["before"] * 3, 3, monkeypatch)
    assert run.error is not None and run.error.determinate is True
    assert (run.tries, run.applied) == (3, 0)


@pytest.mark.parametrize("loop", sorted(LOOPS))
async def test_lost_races_spend_no_tries(loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # One try in all, yet three races lost to another writer: each is re-read and retried.
    run = await LOOPS[loop](["race", "race", "race"], 1, monkeypatch)
    assert run.error is None
    assert (run.tries, run.asked, run.applied) == (4, ["lost"] * 3, 1)


def test_the_rule_backs_off_alike_after_either_kind_of_failure() -> None:
    certain, uncertain = CasRetry(4, 0.5), CasRetry(4, 0.5)
    for rule, determinate in ((certain, True), (uncertain, False)):
        rule.lost_race()  # no sleep, no try spent
        delays = [rule.failed(ExternalError("x", determinate=determinate)) for _ in range(4)]
        assert delays == [0.5, 1.0, 2.0, None]
    assert (certain.uncertain, uncertain.uncertain) == (False, True)
    with pytest.raises(ExternalError) as info, uncertain.settling():
        raise ExternalError("a later, certain failure", determinate=True)
    assert info.value.determinate is False
