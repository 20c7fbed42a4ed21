"""Arrow types of a shard to Spark's and back.

Spark has no unsigned integers: they widen to the next signed type (``uint64`` to ``bigint``,
which holds values below 2**63; a larger one fails the read rather than wrap). Everything else is
pyspark's own mapping.
"""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
from pyspark.sql.types import LongType, StructField, StructType

from persist.core.arrow.updates import DIFF, TIME
from persist.errors import InvalidUsage

__all__ = ["arrow_for_spark", "shard_schema_of", "spark_schema"]

_WIDER = {
    pa.uint8(): pa.int16(),
    pa.uint16(): pa.int32(),
    pa.uint32(): pa.int64(),
    pa.uint64(): pa.int64(),
}


def spark_schema(schema: pa.Schema, *, updates: bool) -> StructType:
    """The Spark schema of a shard's rows (with ``_time``, ``_diff`` for ``updates``)."""
    fields = []
    for f in schema:
        try:
            dtype = from_arrow_type(_WIDER.get(f.type, f.type))
        except Exception as exc:
            raise InvalidUsage(
                f"column {f.name!r} has type {f.type}, which Spark can't hold"
            ) from exc
        fields.append(StructField(f.name, dtype, f.nullable))
    if updates:
        fields += [StructField(TIME, LongType(), False), StructField(DIFF, LongType(), False)]
    return StructType(fields)


def arrow_for_spark(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark expects batches of ``schema`` in."""
    return to_arrow_schema(schema, timezone="UTC", prefers_large_types=False)


def shard_schema_of(schema: StructType) -> pa.Schema:
    """The shard schema a DataFrame of ``schema`` creates (its ``_time``/``_diff`` left out)."""
    arrow = arrow_for_spark(schema)
    return pa.schema([f for f in arrow if f.name not in (TIME, DIFF)])
