"""A canonical content fingerprint of each write in a table of rows.

A write is a multiset of rows. Its fingerprint is a 32-bit number, never ``0`` (``UNKNOWN``, for
a stored fingerprint nobody took), that a server keeps per named write so that a resend of the
same write with different rows is refused.

What it guarantees:

- **Canonical.** It depends only on the values and nulls of the rows and on the column names and
  types, never on how the Arrow data is laid out: slices (offsets, a values buffer bigger than
  the rows use), chunking, a validity buffer with no nulls in it vs none, and whatever bytes sit
  under a null slot all give the same fingerprint. (IPC bytes are not canonical:
  ``RecordBatch.serialize()`` of a sliced string column writes its whole values buffer.)
- **A multiset.** Each row hashes to a well-mixed 64 bits: the sum of its values' 64-bit hashes,
  each times an odd factor drawn from its column's position, name and type (so that swapping two
  columns' values changes it), mixed by splitmix64's finalizer. A write's 64-bit digest is the
  sum of its rows' hashes mod 2**64 (duplicates count) plus the schema's hash, mixed; the
  fingerprint folds that digest to 32 bits. Row order within a write does not matter; moving a
  row to the next write changes both. Changing one non-null value of up to 8 bytes to another
  always changes the digest (every step is invertible); any other change, almost always.
- **Bytes are content.** A value is its bytes: ``-0.0`` and ``0.0`` differ, as do NaNs with
  different payloads (one NaN's bytes always hash alike). A decimal is its stored integer, so
  ``1.0`` and ``1.00`` at scale 2 are the same value. A dictionary-encoded value is its decoded
  value (whatever the dictionary holds besides), a view its large variant's.
- **The schema is content** (field names and types; not nullability, not metadata): the same
  numbers as int32 and as int64 fingerprint differently. A caller fingerprints rows already
  shaped to the shard's schema. Types are named by pyarrow's ``str(type)``; a pyarrow release
  that renamed a type would change the fingerprints of that type's columns.
- **Fast.** ``write_fingerprints`` hashes all the writes of a group at once, with numpy over the
  Arrow buffers: per column O(rows + bytes), no Python loop per row or per write, for every
  fixed-width type, bool, strings and binaries (and their large and view variants), structs,
  lists (all kinds), maps, unions, dictionaries (each entry hashed once), run-end encoded and
  extension arrays (by their storage). A type this module does not know (none of pyarrow 26's)
  takes a slower path: each value is copied alone into compact arrays (``take``) and their IPC
  serialization hashed, tens of microseconds a value. That path sees through offsets, slices,
  chunks and validity buffers too, but not through what ``take`` copies as it is: the bytes
  under a null slot of a nested child, or a sparse union's unselected slots.

What it does not guarantee: 32 bits tell a mistaken resend from the original with a chance of
2**-32 of missing it; they do not stand up to an adversary, who can find a colliding write at
will (as for any fast non-cryptographic hash: strings and lists are hashed by a polynomial mod
2**64, which has known colliding inputs). Fingerprints compare across machines of the same byte
order only (Arrow buffers are native-endian). The definition is part of what is stored:
changing any of it (a constant, a step) makes every stored fingerprint mismatch, hence the
version in the BLAKE2b personalization of the schema's hash.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from persist.errors import InvalidUsage

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

UNKNOWN: Final = 0
"""The fingerprint stored where none was taken: ``fingerprint`` never returns it."""

_MASK = (1 << 64) - 1
# The polynomial's base: odd (so it has an inverse mod 2**64) and 5 mod 8 (so its powers have
# the longest cycle mod 2**64, 2**62).
_P = 0x9E3779B97F4A7C15
_P_INV = pow(_P, -1, 1 << 64)
_NULL: Final = np.uint64(0x5851F42D4C957F2D)  # any null, of any type
_ROW: Final = np.uint64(0xC2B2AE3D27D4EB4F)  # a row's sum starts here
_STRUCT: Final = np.uint64(0x165667B19E3779F9)  # a struct value's sum starts here
_VALUE: Final = np.uint64(0x85EBCA77C2B2AE63)  # added to a fixed-width value's first word
_LENGTH: Final = np.uint64(0x27D4EB2F165667C5)  # times a sequence's length
_M1: Final = np.uint64(0xBF58476D1CE4E5B9)
_M2: Final = np.uint64(0x94D049BB133111EB)
_FOLD: Final = np.uint64(0xFFFFFFFF)
# Strings and lists are hashed this many elements at a time (whole rows; a longer row alone),
# which bounds the cached table of powers (16 bytes an element).
_BLOCK = 1 << 18
# A table with a column of more chunks than this, averaging fewer rows than _SMALL, is
# concatenated first.
_CHUNKS = 4
_SMALL = 4096


def fingerprint(rows: pa.Table | pa.RecordBatch) -> int:
    """The fingerprint of one write: ``rows`` are all its rows."""
    return write_fingerprints(rows, [rows.num_rows])[0]


def write_fingerprints(rows: pa.Table | pa.RecordBatch, counts: Sequence[int]) -> list[int]:
    """The fingerprint of each write whose rows ``rows`` holds back to back: write ``i`` is the
    next ``counts[i]`` rows. Each is in ``1 .. 2**32 - 1``."""
    digests = _write_digests(rows, counts)
    folded = digests % _FOLD + np.uint64(1)
    out: list[int] = folded.tolist()
    return out


def write_digests(rows: pa.Table | pa.RecordBatch, counts: Sequence[int]) -> list[int]:
    """The 64-bit digest of each write (as ``write_fingerprints``), before ``fold``."""
    out: list[int] = _write_digests(rows, counts).tolist()
    return out


def fold(digest: int) -> int:
    """A write's 64-bit digest folded to its 32-bit fingerprint: never ``UNKNOWN``."""
    return digest % 0xFFFFFFFF + 1


# --- the writes ---------------------------------------------------------------------------------


def _write_digests(rows: pa.Table | pa.RecordBatch, counts: Sequence[int]) -> U64:
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_batches([rows])
    sizes = np.asarray(counts, dtype=np.int64).reshape(-1)
    if (sizes < 0).any() or int(sizes.sum()) != table.num_rows:
        raise InvalidUsage(
            f"write counts must be non-negative and add up to the {table.num_rows} rows given"
        )
    if any(_fragmented(column) for column in table.columns):
        # (Arrow's own concatenation, once: unless too big for one array's offsets.)
        with contextlib.suppress(pa.ArrowException):
            table = table.combine_chunks()
    whole, factors = _schema_hashes(table.schema)
    # A row is the sum of its columns' hashes each times its column's odd factor, mixed: so a
    # change to one value always changes it before the mix (an odd factor is invertible).
    row = np.full(table.num_rows, _ROW, dtype=np.uint64)
    for factor, column in zip(factors, table.columns, strict=True):
        row += _column_hashes(column) * factor
    row = _mix(row)
    # A write's digest is its rows' sum: a prefix sum wraps mod 2**64 as the sums do.
    prefix = np.zeros(table.num_rows + 1, dtype=np.uint64)
    np.cumsum(row, out=prefix[1:])
    ends = np.cumsum(sizes)
    sums: U64 = prefix[ends] - prefix[ends - sizes]
    return _mix(sums + whole)


def _schema_hashes(schema: pa.Schema) -> tuple[np.uint64, list[np.uint64]]:
    """The schema's hash, and each column's factor: odd, from its position, name and type."""
    fields = [_named(str(f.name)) + _named(str(f.type)) for f in schema]
    factors = [_digest(i.to_bytes(4, "little") + text) | 1 for i, text in enumerate(fields)]
    return _digest(b"".join(fields)), factors


def _named(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(4, "little") + data


def _digest(data: bytes | memoryview) -> np.uint64:
    h = hashlib.blake2b(data, digest_size=8, person=b"persist-fp-v1")
    return np.uint64(int.from_bytes(h.digest(), "little"))


def _factor(k: int) -> np.uint64:
    """The odd factor of a struct's ``k``-th field."""
    return np.uint64(((k + 1) * _P) & _MASK | 1)


def _mix(x: U64) -> U64:
    """splitmix64's finalizer, elementwise (a bijection of 64 bits), in place: ``x`` must be an
    array of the caller's own."""
    t = x >> np.uint64(30)
    x ^= t
    x *= _M1
    np.right_shift(x, np.uint64(27), out=t)
    x ^= t
    x *= _M2
    np.right_shift(x, np.uint64(31), out=t)
    x ^= t
    return x


# --- a column's values --------------------------------------------------------------------------


def _fragmented(column: pa.ChunkedArray) -> bool:
    """Whether ``column`` is in so many small chunks that a Python dispatch per chunk would
    cost more than copying them into one."""
    return bool(column.num_chunks > _CHUNKS and len(column) < _SMALL * column.num_chunks)


def _column_hashes(column: pa.ChunkedArray) -> U64:
    chunks = column.chunks
    if not chunks:
        return np.zeros(0, dtype=np.uint64)
    return np.concatenate([_hashes(c) for c in chunks])


def _hashes(arr: pa.Array) -> U64:
    """A well-mixed 64-bit hash of each value of ``arr``, canonical; any null is ``_NULL``."""
    n = len(arr)
    t = arr.type
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    if isinstance(t, pa.BaseExtensionType):
        return _hashes(arr.storage)
    if pa.types.is_null(t):
        return np.full(n, _NULL, dtype=np.uint64)
    if pa.types.is_dictionary(t):
        return _dictionary(arr)
    if pa.types.is_run_end_encoded(t):
        return _hashes(pc.run_end_decode(arr))
    if pa.types.is_string_view(t) or pa.types.is_binary_view(t):
        wide = pa.large_string() if pa.types.is_string_view(t) else pa.large_binary()
        return _hashes(arr.cast(wide))
    if pa.types.is_boolean(t):
        table = _mix(np.array([0, 1], dtype=np.uint64) + _VALUE)  # false, true
        out = table[_bits(arr.buffers()[1], arr.offset, n)]
    elif pa.types.is_struct(t):
        out = np.full(n, _STRUCT, dtype=np.uint64)
        for k in range(t.num_fields):
            out += _hashes(arr.field(k)) * _factor(k)
        out = _mix(out)
    elif (offsets_type := _offsets_type(t)) is not None:
        out = _variable(arr, offsets_type)
    elif pa.types.is_fixed_size_list(t):
        size = t.list_size
        child = _hashes(arr.values.slice(arr.offset * size, n * size))
        out = _sequences(child, np.arange(n + 1, dtype=np.int64) * size)
    elif pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        out = _list_view(arr)
    elif pa.types.is_union(t):
        return _union(arr)  # no validity of its own: a null is its child's
    elif (width := _fixed_width(t)) is not None:
        out = _fixed(arr.buffers()[1], arr.offset, n, width)
    else:
        return _fallback(arr)
    return _nulls(arr, out)


def _nulls(arr: pa.Array, out: U64) -> U64:
    """``out`` with ``_NULL`` where ``arr`` is null, whatever was computed there."""
    valid = _valid(arr)
    return out if valid is None else np.where(valid, out, _NULL)


def _valid(arr: pa.Array) -> npt.NDArray[np.bool_] | None:
    """Where ``arr`` is valid, or None if it has no null."""
    if arr.null_count == 0:
        return None
    bitmap = arr.buffers()[0]
    if bitmap is None:
        return np.zeros(len(arr), dtype=np.bool_)
    return _bits(bitmap, arr.offset, len(arr)).astype(np.bool_)


def _bits(buf: pa.Buffer, offset: int, n: int) -> npt.NDArray[np.uint8]:
    """Bits ``offset .. offset + n`` of a bitmap, as 0 and 1."""
    first, last = offset // 8, (offset + n + 7) // 8
    packed = np.frombuffer(buf, dtype=np.uint8, count=last - first, offset=first)
    shift = offset - 8 * first
    return np.unpackbits(packed, bitorder="little")[shift : shift + n]


def _fixed_width(t: pa.DataType) -> int | None:
    """The byte width of a fixed-width type's values, or None."""
    try:
        bits = int(t.bit_width)
    except ValueError:
        return None
    return bits // 8 if bits % 8 == 0 and bits > 0 else None


def _fixed(buf: pa.Buffer, offset: int, n: int, width: int) -> U64:
    """The values ``offset .. offset + n`` of a buffer of ``width``-byte values: each as whole
    little-endian 64-bit words (zero-padded), chained."""
    if width in (1, 2, 4, 8):
        values = np.frombuffer(buf, dtype=f"<u{width}", count=n, offset=offset * width)
        own = values.astype(np.uint64)
        own += _VALUE
        return _mix(own)
    if width % 8 == 0:
        raw = np.frombuffer(buf, dtype="<u8", count=n * width // 8, offset=offset * width)
        words = raw.reshape(n, width // 8)
    else:
        data = np.frombuffer(buf, dtype=np.uint8, count=n * width, offset=offset * width)
        padded = np.zeros((n, -(-width // 8) * 8), dtype=np.uint8)
        padded[:, :width] = data.reshape(n, width)
        words = padded.view("<u8")
    out = _mix(words[:, 0].astype(np.uint64) + _VALUE)
    for j in range(1, words.shape[1]):
        out ^= words[:, j]
        out = _mix(out)
    return out


def _dictionary(arr: pa.Array) -> U64:
    """Each value as its decoded value hashes: each dictionary entry the values use (from the
    first to the last of them: a slice of a big array need not hash its whole dictionary) is
    hashed once."""
    indices = arr.indices
    valid = _valid(indices)
    width = indices.type.bit_width // 8
    kind = "i" if pa.types.is_signed_integer(indices.type) else "u"
    positions = np.frombuffer(
        indices.buffers()[1],
        dtype=f"<{kind}{width}",
        count=len(indices),
        offset=indices.offset * width,
    ).astype(np.int64)
    used = positions if valid is None else positions[valid]  # a null's index may be anything
    if len(used) == 0:
        return np.full(len(arr), _NULL, dtype=np.uint64)
    lo, hi = int(used.min()), int(used.max()) + 1
    entries = _hashes(arr.dictionary.slice(lo, hi - lo))
    if valid is None:
        out: U64 = entries[positions - lo]
        return out
    return np.where(valid, entries[np.where(valid, positions - lo, 0)], _NULL)


def _union(arr: pa.Array) -> U64:
    """Each value as its type code and its child's value (a sparse union's other children's
    slots are not read)."""
    n = len(arr)
    t = arr.type
    bufs = arr.buffers()
    codes = np.frombuffer(bufs[1], dtype=np.int8, count=n, offset=arr.offset)
    dense = t.mode == "dense"
    if dense:
        offsets = np.frombuffer(bufs[2], dtype="<i4", count=n, offset=arr.offset * 4)
    out = np.zeros(n, dtype=np.uint64)
    for k, code in enumerate(t.type_codes):
        chosen = np.flatnonzero(codes == code)
        if len(chosen) == 0:
            continue
        child = arr.field(k)  # a sparse union's is sliced to the union's rows, a dense's is whole
        rows = offsets[chosen].astype(np.int64) if dense else chosen
        lo, hi = int(rows.min()), int(rows.max()) + 1
        values = _hashes(child.slice(lo, hi - lo))[rows - lo]
        out[chosen] = values * _factor(int(code) + 128)
    return _mix(out)


# --- sequences: strings, binaries, lists --------------------------------------------------------


def _offsets_type(t: pa.DataType) -> str | None:
    """The offsets' numpy type of a type whose values are offset ranges, or None."""
    if _is_bytes(t) or pa.types.is_list(t) or pa.types.is_map(t):
        return "<i8" if pa.types.is_large_string(t) or pa.types.is_large_binary(t) else "<i4"
    if pa.types.is_large_list(t):
        return "<i8"
    return None


def _is_bytes(t: pa.DataType) -> bool:
    """Whether ``t``'s values are ranges of a byte buffer."""
    return bool(
        pa.types.is_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_string(t)
        or pa.types.is_large_binary(t)
    )


def _variable(arr: pa.Array, offsets_type: str) -> U64:
    """Strings and binaries (their bytes) and lists and maps (their elements' hashes)."""
    n = len(arr)
    width = np.dtype(offsets_type).itemsize
    bounds = np.frombuffer(
        arr.buffers()[1], dtype=offsets_type, count=n + 1, offset=arr.offset * width
    ).astype(np.int64)
    lo, hi = int(bounds[0]), int(bounds[-1])
    elements: npt.NDArray[Any]
    if _is_bytes(arr.type):
        elements = _bytes(arr.buffers()[2], lo, hi)
    else:
        elements = _hashes(arr.values.slice(lo, hi - lo))
    return _sequences(elements, bounds - lo)


def _bytes(buf: pa.Buffer | None, lo: int, hi: int) -> npt.NDArray[np.uint8]:
    if hi == lo or buf is None:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(buf, dtype=np.uint8, count=hi - lo, offset=lo)


def _list_view(arr: pa.Array) -> U64:
    """A list view's values: its ranges of the child may overlap and come in any order."""
    n = len(arr)
    dtype = "<i8" if pa.types.is_large_list_view(arr.type) else "<i4"
    width = np.dtype(dtype).itemsize
    bufs = arr.buffers()
    starts = np.frombuffer(bufs[1], dtype=dtype, count=n, offset=arr.offset * width)
    sizes = np.frombuffer(bufs[2], dtype=dtype, count=n, offset=arr.offset * width)
    starts, sizes = starts.astype(np.int64), sizes.astype(np.int64)
    valid = _valid(arr)
    if valid is not None:  # a null's range may be anything: read none of it
        sizes = np.where(valid, sizes, 0)
    used = sizes > 0
    if not used.any():
        return _sequences(np.zeros(0, dtype=np.uint64), np.zeros(n + 1, dtype=np.int64))
    lo = int(starts[used].min())
    hi = int((starts + sizes)[used].max())
    child = _hashes(arr.values.slice(lo, hi - lo))
    firsts = np.where(used, starts - lo, 0)
    return _polynomial(child, firsts, firsts + sizes, sizes)


def _sequences(elements: npt.NDArray[Any], bounds: I64) -> U64:
    """The hash of each sequence ``elements[bounds[i] : bounds[i + 1]]`` (``bounds`` ascending
    from 0), a block of rows at a time."""
    n = len(bounds) - 1
    out = np.empty(n, dtype=np.uint64)
    i = 0
    while i < n:
        start = int(bounds[i])
        j = int(np.searchsorted(bounds, start + _BLOCK, side="right")) - 1
        j = min(max(j, i + 1), n)
        block = elements[start : int(bounds[j])]
        firsts, lasts = bounds[i:j] - start, bounds[i + 1 : j + 1] - start
        out[i:j] = _polynomial(block, firsts, lasts, lasts - firsts)
        i = j
    return out


def _polynomial(elements: npt.NDArray[Any], firsts: I64, lasts: I64, lengths: I64) -> U64:
    """For each row, the sum of ``elements[firsts + k] * P**k`` mod 2**64 over its ``lengths``
    elements, mixed with that length: a prefix sum of ``elements[k] * P**k`` minus another,
    times ``P**-first``."""
    m = len(elements)
    powers, inverses = _powers(m)
    prefix = np.zeros(m + 1, dtype=np.uint64)
    np.multiply(elements, powers[:m], out=prefix[1:])
    np.cumsum(prefix[1:], out=prefix[1:])
    sums = (prefix[lasts] - prefix[firsts]) * inverses[firsts]
    sums ^= lengths.astype(np.uint64) * _LENGTH
    return _mix(sums)


_POWERS: tuple[U64, U64] = (np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64))


def _powers(m: int) -> tuple[U64, U64]:
    """``P**k`` and ``P**-k`` for ``k`` in ``0 .. m`` at least (those of a block are kept)."""
    global _POWERS
    cached = _POWERS
    if len(cached[0]) > m:
        return cached
    size = max(m + 1, min(2 * len(cached[0]), _BLOCK + 1))
    made = (_geometric(_P, size), _geometric(_P_INV, size))
    if size <= _BLOCK + 1:
        _POWERS = made
    return made


def _geometric(base: int, size: int) -> U64:
    """``base**k`` mod 2**64 for ``k`` in ``0 .. size - 1``."""
    factors = np.full(size, base, dtype=np.uint64)
    factors[0] = 1
    out: U64 = np.cumprod(factors, dtype=np.uint64)
    return out


# --- the slow path ------------------------------------------------------------------------------


def _fallback(arr: pa.Array) -> U64:
    """Each value copied alone into compact arrays (``take``), its IPC serialization hashed.
    (The IPC writer leaves out a validity buffer with no null in it.)"""
    out = np.empty(len(arr), dtype=np.uint64)
    for i in range(len(arr)):
        one = arr.take(pa.array([i], type=pa.int64()))
        batch = pa.RecordBatch.from_arrays([one], names=["v"])
        out[i] = _digest(batch.serialize())
    return _nulls(arr, _mix(out))
