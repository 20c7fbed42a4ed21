"""examples/spark_pipeline.py runs as the README shows and gives the right totals."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from tests.spark.conftest import Location

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spark_pipeline.py"


def test_the_example_pipeline(spark: Any, loc: Location) -> None:
    spec = importlib.util.spec_from_file_location("spark_pipeline", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    heard = example.pipeline(spark, loc.blob, loc.consensus)
    assert sorted((r["user"], r["total"], r["_time"], r["_diff"]) for r in heard) == [
        ("ada", 35, 1, 1),
        ("cy", 40, 1, 1),
    ]
