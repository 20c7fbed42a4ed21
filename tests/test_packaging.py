"""What an install gives: the wheel carries ``persist`` and the top-level ``pyspark_persist``
module pyspark's lookup finds (``format("persist")`` with no ``register()`` call)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_ships_the_source_pyspark_looks_up(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("persist-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    assert {"pyspark_persist.py", "persist/__init__.py", "persist/spark/__init__.py"} <= names
    assert "persist/py.typed" in names  # type checkers read persist's annotations
    assert not any(n.startswith(("tests/", "benches/")) for n in names)
    # pyspark's lookup, over the installed files alone.
    found = {m.name for m in pkgutil.iter_modules([str(tmp_path / "site")])}
    assert "pyspark_persist" in found


def test_the_editable_install_is_seen_by_pyspark_lookup_from_anywhere(tmp_path: Path) -> None:
    probe = "import pkgutil; print('pyspark_persist' in {m.name for m in pkgutil.iter_modules()})"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True"
