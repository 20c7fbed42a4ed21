"""Damaged parts: one flipped bit inside a data page, of the kind a reader that does not verify
page checksums answers as wrong rows instead of an error."""

from __future__ import annotations

import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# A column of random values: snappy can't compress them, so its page holds them as literals and
# a flipped bit there changes a value rather than breaking decompression.
RANDOM = "x"


def random_values(n: int, seed: int = 7) -> pa.Array:
    return pa.array(np.random.default_rng(seed).integers(0, 2**62, n), pa.int64())


def flip_in_data_page(data: bytes, column: str = RANDOM) -> bytes:
    """``data`` (a part's Parquet bytes) with one bit flipped in the middle of ``column``'s
    values in its first row group; asserts that a reader that does not verify page checksums
    reads the damaged part without error and with a value changed."""
    meta = pq.read_metadata(pa.BufferReader(data))
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    chunk = meta.row_group(0).column(names.index(column))
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    # Half-way through the column chunk: past the page header, inside the page's values.
    at = start + chunk.total_compressed_size // 2
    damaged = bytearray(data)
    damaged[at] ^= 0x04
    before = pq.read_table(pa.BufferReader(data), columns=[column])
    after = pq.read_table(pa.BufferReader(bytes(damaged)), columns=[column])
    assert after.num_rows == before.num_rows and not after.equals(before)
    return bytes(damaged)


def damage_file(uri: str) -> None:
    """Flips a bit in a data page of the part at ``uri`` (``file://``), in place."""
    path = Path(urllib.request.url2pathname(urllib.parse.urlparse(uri).path))
    path.write_bytes(flip_in_data_page(path.read_bytes()))
