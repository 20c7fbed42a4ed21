"""Fixtures of the proof-under-faults harness: locations of every kind, and the figures.

Every test here adds what it did to the session's ``figures`` (operations run with faults on,
faults injected, processes, crashes survived, acknowledged writes lost or duplicated); they are
printed at the end of the run, and written as JSON to ``$PERSIST_TEST_FIGURES`` when it is set.
Counts scale with ``PERSIST_TEST_SCALE`` (see ``persist.testing.scale``).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio

from persist.testing import FaultCounts, LocationFactory, MachineStats, scale, uri_location
from persist.testing.lag import LoopLag

LOCATIONS = ["mem", "file+sqlite", "file+postgres", "s3+postgres"]
S3_BUCKET = "persist-harness"


@dataclass
class Figures:
    """What the harness did and found, summed over the session."""

    operations_with_faults: int = 0
    faults_injected_before: int = 0
    faults_injected_after: int = 0
    acknowledged_writes: int = 0
    acknowledged_lost: int = 0
    acknowledged_duplicated: int = 0
    indeterminate_resolved: int = 0
    processes: int = 0
    crashes_survived: int = 0
    postgres_restarts_survived: int = 0
    bad_inputs_refused: int = 0
    operations: int = 0
    cancellations: int = 0
    stalls: int = 0
    values_tried: int = 0
    values_refused: int = 0
    bricked_shards: int = 0
    worst_loop_stall_ms: float = 0.0
    by_test: dict[str, dict[str, int]] = field(default_factory=dict)

    def add_faults(self, counts: FaultCounts) -> None:
        self.faults_injected_before += counts.failed_before
        self.faults_injected_after += counts.failed_after

    def add_lag(self, worst_ms: float) -> None:
        self.worst_loop_stall_ms = max(self.worst_loop_stall_ms, worst_ms)

    def add_machine(self, name: str, stats: MachineStats) -> None:
        self.operations += stats.steps
        self.cancellations += stats.cancellations
        self.stalls += stats.stalls
        self.add_lag(stats.worst_loop_stall_ms)
        self.operations_with_faults += stats.steps_with_faults
        self.add_faults(stats.faults)
        self.acknowledged_writes += stats.acknowledged
        self.acknowledged_lost += stats.lost
        self.acknowledged_duplicated += stats.duplicated
        self.indeterminate_resolved += (
            stats.resolved_landed + stats.resolved_not_landed + stats.resolved_by_retry
        )
        self.note(
            name,
            examples=stats.examples,
            steps=stats.steps,
            steps_with_faults=stats.steps_with_faults,
            acknowledged=stats.acknowledged,
            indeterminate=stats.indeterminate_errors,
            faults=stats.faults.injected,
            lost=stats.lost,
            duplicated=stats.duplicated,
            cancellations=stats.cancellations,
            stalls=stats.stalls,
            expired_by_stall=stats.expired_by_stall,
            instants_read=stats.instants_checked,
        )

    def note(self, name: str, **counts: int) -> None:
        mine = self.by_test.setdefault(name, {})
        for key, value in counts.items():
            mine[key] = mine.get(key, 0) + value


_FIGURES = Figures()


@pytest.fixture(scope="session")
def figures() -> Figures:
    return _FIGURES


@pytest_asyncio.fixture
async def loop_lag(figures: Figures) -> AsyncIterator[LoopLag]:
    """A ticker on the test's event loop; its worst lateness goes into the figures."""
    async with LoopLag() as lag:
        yield lag
    figures.add_lag(lag.worst_ms)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    f = _FIGURES
    if not f.by_test:
        return
    tr = terminalreporter
    tr.section(f"persist harness figures (PERSIST_TEST_SCALE={scale():g})")
    tr.write_line(f"operations (state machine steps):   {f.operations}")
    tr.write_line(f"operations run with faults on:      {f.operations_with_faults}")
    tr.write_line(
        f"faults injected:                    {f.faults_injected_before + f.faults_injected_after}"
        f" ({f.faults_injected_before} before the call, {f.faults_injected_after} after it"
        " took effect)"
    )
    tr.write_line(f"acknowledged writes checked:        {f.acknowledged_writes}")
    tr.write_line(f"indeterminate outcomes resolved:    {f.indeterminate_resolved}")
    tr.write_line(f"processes:                          {f.processes}")
    tr.write_line(f"crashes (SIGKILL) survived:         {f.crashes_survived}")
    tr.write_line(f"PostgreSQL restarts survived:       {f.postgres_restarts_survived}")
    tr.write_line(f"bad inputs refused:                 {f.bad_inputs_refused}")
    tr.write_line(f"calls cancelled:                    {f.cancellations}")
    tr.write_line(f"stalls past a lease:                {f.stalls}")
    tr.write_line(
        f"hostile values tried:               {f.values_tried} ({f.values_refused} refused)"
    )
    tr.write_line(f"bricked shards:                     {f.bricked_shards}")
    tr.write_line(f"worst event-loop stall:             {f.worst_loop_stall_ms:.1f} ms")
    tr.write_line(
        f"acknowledged writes lost:           {f.acknowledged_lost}   "
        f"duplicated: {f.acknowledged_duplicated}"
    )
    for name, counts in sorted(f.by_test.items()):
        tr.write_line(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    out = os.environ.get("PERSIST_TEST_FIGURES")
    if out:
        Path(out).write_text(json.dumps(asdict(f), indent=2, sort_keys=True))


@pytest.fixture(scope="session")
def s3_harness_bucket(s3_endpoint: str) -> str:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=S3_BUCKET)
    return S3_BUCKET


LocationUris = Callable[[str], tuple[str, str]]


@pytest.fixture
def location_uris(request: pytest.FixtureRequest, tmp_path: Path) -> LocationUris:
    """``kind -> (blob URI, consensus URI)`` of a fresh location of that kind."""

    def make(kind: str) -> tuple[str, str]:
        unique = uuid.uuid4().hex
        if kind == "mem":
            return f"mem://{unique}", f"mem://{unique}"
        root = tmp_path / unique
        root.mkdir()
        file_blob = (root / "blob").as_uri()
        if kind == "file+sqlite":
            return file_blob, f"sqlite://{root / 'consensus.db'}"
        postgres: str = request.getfixturevalue("postgres_uri")
        if kind == "file+postgres":
            return file_blob, postgres
        if kind == "s3+postgres":
            endpoint = request.getfixturevalue("s3_endpoint")
            bucket = request.getfixturevalue("s3_harness_bucket")
            s3 = f"s3://{bucket}/{unique}?endpoint_url={endpoint}&region=us-east-1"
            return s3, postgres
        raise ValueError(kind)

    return make


@pytest.fixture
def location_factory(location_uris: LocationUris) -> Callable[[str], LocationFactory]:
    """``kind -> LocationFactory`` over a fresh location of that kind."""

    def make(kind: str) -> LocationFactory:
        return uri_location(*location_uris(kind))

    return make
