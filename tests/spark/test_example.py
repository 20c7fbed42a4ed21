"""examples/spark_pipeline.py runs as the README shows and gives the right totals."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.spark.conftest import Location

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spark_pipeline.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spark_pipeline", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_the_example_pipeline(spark: Any, loc: Location) -> None:
    heard = _example().pipeline(spark, loc.blob, loc.consensus)
    assert sorted((r["user"], r["total"], r["_time"], r["_diff"]) for r in heard) == [
        ("ada", 35, 1, 1),
        ("cy", 40, 1, 1),
    ]


def test_the_listen_reader_outlives_a_job_longer_than_its_lease(
    spark: Any, loc: Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example's reader is held while the Spark job runs, however long: a job that lasts
    three of its leases (the Spark write's commit then expires any reader whose lease ran out)
    leaves it registered, and the listen hears the totals."""
    lease_s = 1.0
    example = _example()
    job = example.spark_job

    def slow_job(*args: Any) -> None:
        # Three leases go by with the driver inside the job before Spark writes.
        started = time.monotonic()
        while time.monotonic() - started < 3 * lease_s:
            threading.Event().wait(0.1)
        job(*args)

    monkeypatch.setattr(example, "spark_job", slow_job)
    heard = example.pipeline(spark, loc.blob, loc.consensus, lease_duration_s=lease_s)
    assert sorted((r["user"], r["total"], r["_time"], r["_diff"]) for r in heard) == [
        ("ada", 35, 1, 1),
        ("cy", 40, 1, 1),
    ]
