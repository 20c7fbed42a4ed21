"""Row predicates callers hand in (``delete_where``): what they may name.

A predicate selects rows of a shard's contents, and those contents are read consolidated as
of one time: there every ``_time`` is that time and every ``_diff`` a summed multiplicity, so
a predicate on either matches by the read, not by when or how often a row was written
(``_time >= 5`` matches every row). A predicate may therefore name the data columns and
nothing else. Messages never quote the predicate: its values may be the very data an erase is
removing. Pure: no I/O.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.core.arrow.updates import DIFF, TIME
from persist.errors import InvalidUsage

__all__ = ["check_predicate", "matching_rows"]

# Arrow's text when a field reference resolves to nothing: the reference, then " in " and the
# whole schema (left out of our message: it may be long, and the caller knows it).
_NO_MATCH = re.compile(r"No match for (FieldRef\.\S.*?) in ", re.DOTALL)

_RESERVED = {
    TIME: "the time every row of the contents read has (the read's as_of), not when it was written",
    DIFF: "the row's multiplicity in the contents read, summed over its writes",
}


def check_predicate(predicate: object, schema: pa.Schema) -> pc.Expression:
    """``predicate`` if it is a ``pyarrow.compute.Expression`` that names only columns of
    ``schema`` (the shard's data columns, by name, nested path or position) and evaluates to
    a boolean over them; else ``InvalidUsage`` naming the first column it can't name (``_time``
    and ``_diff`` with why) or what else is wrong. A predicate taken here filters the shard's
    updates (the data columns, then ``_time`` and ``_diff``) as it filters the data columns
    alone."""
    if not isinstance(predicate, pc.Expression):
        raise InvalidUsage(
            f"predicate must be a pyarrow.compute.Expression, not {type(predicate).__name__}"
        )
    try:
        # Filtering no rows binds the expression to the schema: it resolves every field
        # reference and types every call, which is all this asks.
        schema.empty_table().filter(predicate)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        text = str(exc)
        missing = _NO_MATCH.match(text)
        if missing is None:
            raise InvalidUsage(f"the predicate can't select rows of the shard: {text}") from None
        ref = missing.group(1)
        for column, what in _RESERVED.items():
            if ref == f"FieldRef.Name({column})":
                raise InvalidUsage(
                    f"the predicate names {column!r}, which is not a data column: "
                    f"it is {what}; a predicate may name the data columns "
                    f"({', '.join(schema.names)}) only"
                ) from None
        raise InvalidUsage(
            f"the predicate names a column the shard's data lacks ({ref}); its "
            f"data columns are {', '.join(schema.names)}"
        ) from None
    return predicate


def matching_rows(table: pa.Table, predicate: pc.Expression) -> pa.Array:
    """The indexes of the rows of ``table`` that ``predicate`` matches (null: no match), in
    order. ``InvalidUsage`` if the predicate can't be evaluated on these rows."""
    rows = pa.array(np.arange(table.num_rows, dtype=np.int64))
    try:
        hit = table.append_column("__row", rows).filter(predicate)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise InvalidUsage(f"the predicate can't filter the shard's rows: {exc}") from None
    return hit.column("__row").combine_chunks()
