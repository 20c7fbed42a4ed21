"""The floor of any Python data source on this Spark: ``format("bare")``, a source that hands
Spark the rows of plain Parquet files as ready-made Arrow batches (reads) or writes the batches
Spark hands it to Parquet files (writes), with no persist at all.

Spark 4.3 gives a Python source no column pruning: every column of every row crosses from the
Python worker to the JVM as Arrow and is turned into rows there. What that costs any Python
source is what this one measures, so a persist figure can be set against it as well as against
Spark's own Parquet reader.

Options: ``path``, a Parquet file or a directory of them; for reads, the DataFrame's schema is
given with ``.schema(...)`` (else ``k bigint, g bigint, v double``, the spark bench's rows).
A read has two partitions, the row groups of the files dealt between them in turn.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["BARE_SCHEMA", "source"]

BARE_SCHEMA = "k bigint, g bigint, v double"


def _files(path: str) -> list[Path]:
    p = Path(path)
    return [p] if p.is_file() else sorted(p.glob("*.parquet"))


def source() -> type:
    """The ``bare`` data source class (made here: pyspark is imported only in Spark children)."""
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceArrowWriter,
        DataSourceReader,
        InputPartition,
        WriterCommitMessage,
    )
    from pyspark.sql.pandas.types import to_arrow_schema

    class BareReader(DataSourceReader):
        def __init__(self, path: str, schema: Any) -> None:
            self.path = path
            self.schema = schema

        def partitions(self) -> list[InputPartition]:
            groups = [
                (str(f), g)
                for f in _files(self.path)
                for g in range(pq.ParquetFile(f).metadata.num_row_groups)
            ]
            return [InputPartition(groups[i::2]) for i in range(2)]

        def read(self, partition: InputPartition) -> Any:
            # Spark takes batches only in its own Arrow types (tpchgen writes string_view).
            out = to_arrow_schema(self.schema, timezone="UTC")
            for path, group in partition.value:
                table = pq.ParquetFile(path).read_row_group(group)
                if not table.schema.equals(out):
                    table = table.cast(out)
                yield from table.to_batches()

    class BareWriter(DataSourceArrowWriter):
        def __init__(self, root: str) -> None:
            self.root = root

        def write(self, iterator: Any) -> WriterCommitMessage:
            batches = list(iterator)
            if batches:
                path = Path(self.root) / f"{uuid.uuid4().hex}.parquet"
                pq.write_table(pa.Table.from_batches(batches), path)
            return WriterCommitMessage()

    class BareSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "bare"

        def schema(self) -> str:
            return BARE_SCHEMA

        def reader(self, schema: Any) -> BareReader:
            return BareReader(self.options["path"], schema)

        def writer(self, schema: Any, overwrite: bool) -> BareWriter:
            Path(self.options["path"]).mkdir(parents=True, exist_ok=True)
            return BareWriter(self.options["path"])

    return BareSource
