"""What an install gives: the wheel carries ``persist`` and the top-level ``pyspark_persist``
module pyspark's lookup finds (``format("persist")`` with no ``register()`` call)."""

from __future__ import annotations

import importlib.metadata
import pkgutil
import re
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
    (wheel,) = tmp_path.glob("persist_shards-*.whl")
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


def test_every_install_line_names_the_distribution_persist_is_published_as() -> None:
    """``pip install persist`` installs an unrelated project: every install line a user can
    read (README, docs, messages in the code) names ours, with or without an extra."""
    from persist.errors import DISTRIBUTION

    # The editable install the suite runs from was installed under that name.
    assert importlib.metadata.distribution(DISTRIBUTION).read_text("direct_url.json") is not None
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("persist/**/*.py")]
    wrong = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            # "pip install" followed by a distribution name (not a path such as -e . or a file)
            for m in re.finditer(r"pip install\s+'?([A-Za-z][\w.-]*)", line):
                if m.group(1) not in (DISTRIBUTION, "py-spy"):
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not wrong, "\n".join(wrong)
