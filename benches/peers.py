"""The peers persist is compared with: Delta Lake (``deltalake``, delta-rs) and Apache Iceberg
(``pyiceberg`` with its SQL catalog on SQLite), both on the local disk under test.

They are an optional extra (``pip install -e .[bench]``): a system that ``requires`` one that
``unavailable_reason`` says can't run is skipped, and the skip recorded, by
``harness.select_systems``, so the suite (and its smoke test) runs with or without the extra.

Each store here is synchronous (that is how both libraries are used), with the methods of
``benches.systems.ParquetFiles``; scenarios call them directly in lock-step loops
(``systems.Stored``), or in threads for the concurrent-writer runs. Both get the same rows
as persist, as the three data columns only (``key``, ``s``, ``value``): their own versions take
the place of persist's ``_time``, and they have no ``_diff``.

Each is used as its documentation shows (``DeltaStore``, ``IcebergStore``). Neither fsyncs its
data or log files on a local disk (persist and the ``parquet`` baselines do); the Iceberg
catalog's SQLite commit is durable (SQLite's default ``synchronous=FULL``).
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

import pyarrow as pa

from benches.fixtures import SCHEMA

DELTA = "deltalake"
ICEBERG = "pyiceberg"

# Display names of the peer systems (scenario tables use these, plus a suffix).
DELTA_NAME = "delta-lake"
ICEBERG_NAME = "iceberg[sql-sqlite]"

_INSTALL_HINT = "install the bench extra: pip install -e '.[bench]'"
# The modules each peer needs, importable.
_MODULES = {
    DELTA: ("deltalake",),
    ICEBERG: ("pyiceberg", "pyiceberg.catalog.sql", "sqlalchemy", "pyiceberg.io.pyarrow"),
    "matplotlib": ("matplotlib",),
    "pyinstrument": ("pyinstrument",),
}


@functools.cache
def unavailable_reason(name: str) -> str | None:
    """Why the optional package ``name`` can't be used here, or ``None`` when it can."""
    modules = _MODULES.get(name)
    if modules is None:
        return f"unknown optional package {name!r}"
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken install raising anything else
            return f"{module} is not importable ({type(exc).__name__}: {exc}); {_INSTALL_HINT}"
    return None


def data_columns(table: pa.Table) -> pa.Table:
    """``table`` without persist's ``_time`` / ``_diff`` columns: the rows as a peer stores them."""
    return table.select(SCHEMA.names)


# --- Delta Lake --------------------------------------------------------------------------------


class DeltaStore:
    """A Delta Lake table in the local directory ``path``: ``write_deltalake(path, table,
    mode="append")`` per append (the first makes version 0, append ``k`` version ``k``), read
    with ``DeltaTable(path[, version=k]).to_pyarrow_table()``. delta-rs writes a checkpoint every
    100 commits (its default ``checkpointInterval``)."""

    def __init__(self, path: Path) -> None:
        self.root = path
        self.path = str(path)

    def append(self, table: pa.Table) -> None:
        from deltalake import write_deltalake

        write_deltalake(self.path, data_columns(table), mode="append")

    def read(self, after_append: int | None = None) -> pa.Table:
        from deltalake import DeltaTable

        return DeltaTable(self.path, version=after_append).to_pyarrow_table()

    def open_fresh(self) -> int:
        """What a new process pays to open the table: load its log; the current version."""
        from deltalake import DeltaTable

        return int(DeltaTable(self.path).version())

    def files(self) -> int:
        from deltalake import DeltaTable

        return len(DeltaTable(self.path).file_uris())

    def close(self) -> None:
        return None


# --- Iceberg -----------------------------------------------------------------------------------


class IcebergStore:
    """An Iceberg table (one namespace) in a SQL catalog on SQLite (``root/catalog.db``), data
    under ``root/warehouse``: ``table.append(arrow_table)`` per append (a fast append: one data
    file, one manifest, a new manifest list and metadata file, then the catalog's pointer swap in
    SQLite), read with ``table.scan([snapshot_id=...]).to_arrow()``."""

    IDENT = ("bench", "t")

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.catalog = self._catalog()
        self.catalog.create_namespace(self.IDENT[0])
        self.table = self.catalog.create_table(self.IDENT, schema=SCHEMA)
        self.snapshot_ids: list[int] = []

    def _catalog(self) -> Any:
        from pyiceberg.catalog.sql import SqlCatalog

        return SqlCatalog(
            "bench",
            uri=f"sqlite:///{self.root / 'catalog.db'}",
            warehouse=(self.root / "warehouse").as_uri(),
        )

    def append(self, table: pa.Table) -> None:
        self.table.append(data_columns(table))
        snap = self.table.current_snapshot()
        assert snap is not None
        self.snapshot_ids.append(snap.snapshot_id)

    def read(self, after_append: int | None = None) -> pa.Table:
        snapshot = None if after_append is None else self.snapshot_ids[after_append]
        return self.table.scan(snapshot_id=snapshot).to_arrow()

    def open_fresh(self) -> int:
        """What a new process pays to open the table: a new catalog (engine) and
        ``load_table`` (reads the table's metadata file); the number of snapshots."""
        catalog = self._catalog()
        try:
            table = catalog.load_table(self.IDENT)
            return len(table.metadata.snapshots)
        finally:
            catalog.engine.dispose()

    def files(self) -> int:
        return sum(1 for _ in self.table.scan().plan_files())

    def close(self) -> None:
        self.catalog.engine.dispose()
