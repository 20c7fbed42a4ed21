"""The schema every bench scenario writes (its own module, so that peers and the shared
harness both use it without importing each other)."""

from __future__ import annotations

import pyarrow as pa

# The data columns every scenario writes: an int64 key, a 16-char string, an int64 value.
SCHEMA = pa.schema([("key", pa.int64()), ("s", pa.string()), ("value", pa.int64())])
