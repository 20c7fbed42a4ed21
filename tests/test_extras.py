"""The base install is lean: backends and front ends are extras, and using one that is not
installed says which extra to install."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys

import pytest

from persist.errors import DISTRIBUTION


def test_the_base_install_needs_only_arrow_msgspec_and_numpy() -> None:
    requires = importlib.metadata.requires(DISTRIBUTION) or []
    base = {re.split(r"[\s\[<>=;]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r}
    assert base == {"pyarrow", "msgspec", "numpy"}
    extras = set(importlib.metadata.metadata(DISTRIBUTION).get_all("Provides-Extra") or [])
    assert {"postgres", "s3", "flight", "spark", "test", "bench"} <= extras


@pytest.mark.parametrize(
    ("missing", "code", "extra"),
    [
        ("boto3", "from persist.location import open_blob; open_blob('s3://b/p')", "s3"),
        (
            "psycopg_pool",
            "from persist.location import open_consensus; open_consensus('postgresql://h/db')",
            "postgres",
        ),
        ("prometheus_client", "import persist.flight", "flight"),
        ("pyspark", "import persist.spark", "spark"),
    ],
)
def test_a_missing_extra_is_named(missing: str, code: str, extra: str) -> None:
    # The module made unimportable, as where the extra was not installed.
    script = f"import sys; sys.modules[{missing!r}] = None\n{code}"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert f"pip install '{DISTRIBUTION}[{extra}]'" in done.stderr, done.stderr[-2000:]


def test_the_package_says_it_is_typed() -> None:
    import importlib.resources

    import persist

    assert (importlib.resources.files(persist) / "py.typed").is_file()
