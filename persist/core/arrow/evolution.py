"""A shard's schema versions: which changes an evolution may make, and how a part written in
one version is shown in another. Pure: no I/O.

Fields have identities. Each version (``SchemaVersion``) gives every column a field id; an
evolution keeps the id of a field it renames, widens, moves or makes nullable, gives an added
field a new one, and never gives a dropped field's id again. A part records the version it was
written in (``PartRef.schema_version``) and is read in its own version's schema, then shown in
the reader's (``View``) by field id, never by name: a field dropped and then added again under
the same name is another field, and the dropped one's values never come back.

A drop redacts: from the commit of a drop on, no reader (at any version) is shown the dropped
field's values; the ids still in the newest version are the *live* ones.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import msgspec
import pyarrow as pa

from persist.core.arrow.casts import lossless
from persist.core.arrow.keyrange import decode_keys, encode_keys
from persist.core.arrow.updates import DIFF, TIME, decode_part, full_schema, sort_consolidate
from persist.core.shard.types import SchemaVersion, State
from persist.errors import InvalidUsage

__all__ = [
    "Shapes",
    "View",
    "current_version",
    "current_view",
    "dropped",
    "matching_version",
    "plan_evolution",
    "schema_of",
    "shapes_for",
    "shown_schema",
    "versions",
]


@functools.lru_cache(maxsize=512)
def _decoded(data: bytes) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(data))


def schema_of(version: SchemaVersion) -> pa.Schema:
    """A version's data columns as a ``pyarrow.Schema``."""
    return _decoded(version.schema)


def versions(state: State) -> dict[int, SchemaVersion]:
    """Every version of ``state``'s schema by number. A shard never evolved records none: its
    schema is version 0, with field ids 0, 1, ... in column order."""
    if state.schemas:
        return dict(state.schemas)
    return {0: SchemaVersion(state.schema, tuple(range(len(_decoded(state.schema)))))}


def current_version(state: State) -> int:
    """The number of ``state``'s current (newest) schema version."""
    return max(state.schemas, default=0)


def shown_schema(state: State, version: int) -> pa.Schema:
    """The schema a reader at ``version`` is shown: the version's, but a field is NOT NULL only
    while the current version has it NOT NULL too. A later version that made it nullable, or
    dropped it (its values shown as null), lets nulls into that reader's rows."""
    all_versions = versions(state)
    current = all_versions[max(all_versions)]
    strict = {fid for fid, f in zip(current.ids, schema_of(current), strict=True) if not f.nullable}
    mine = all_versions[version]
    schema = schema_of(mine)
    fields = [
        f if f.nullable or fid in strict else f.with_nullable(True)
        for fid, f in zip(mine.ids, schema, strict=True)
    ]
    return pa.schema(fields, metadata=schema.metadata)


def matching_version(state: State, schema: pa.Schema) -> int | None:
    """The newest version whose schema ``schema`` is: the same names in the same order, each
    type equal (a caller maps lossless types first, as ``open`` does) and nullability equal.
    None: no version. The newest wins: a field dropped and added back under its name makes an
    older version look alike, and only the newest holds the live field."""
    for number, version in sorted(versions(state).items(), reverse=True):
        if _same_shape(schema_of(version), schema):
            return number
    return None


def _same_shape(a: pa.Schema, b: pa.Schema) -> bool:
    return len(a) == len(b) and all(
        x.name == y.name and x.type == y.type and x.nullable == y.nullable
        for x, y in zip(a, b, strict=True)
    )


def plan_evolution(
    state: State, schema: pa.Schema, renames: Mapping[str, str] | None
) -> SchemaVersion | None:
    """The version ``schema`` (checked by ``updates.check_schema``) would be, evolved from
    ``state``'s current one; None when it is the current schema (a no-op). ``InvalidUsage``
    naming the field and why for a change that is not an add (nullable), drop, rename,
    lossless widening, NOT NULL -> nullable or reorder (when ``schema`` is the current one, so
    are ``renames`` of names it no longer has: another caller made the same change). ``at_ms`` is left 0 for the commit."""
    all_versions = versions(state)
    current = all_versions[max(all_versions)]
    old = schema_of(current)
    renames = dict(renames or {})
    earlier = {n for v in all_versions.values() for n in schema_of(v).names} - set(old.names)
    if _same_shape(old, schema) and all(a in earlier or a == b for a, b in renames.items()):
        # Already the schema: another caller's evolution may have made it, renames and all
        # (a rename among the current names, such as a swap, is still a change).
        return None
    for src, dst in renames.items():
        if not isinstance(src, str) or not isinstance(dst, str):
            raise InvalidUsage(f"renames maps old names to new ones (str), not {src!r}: {dst!r}")
        if src not in old.names:
            raise InvalidUsage(f"renames: field {src!r} is not in the shard's current schema")
        if dst not in schema.names:
            raise InvalidUsage(f"renames: field {src!r} is renamed to {dst!r}, not in the schema")
    targets = list(renames.values())
    if len(set(targets)) != len(targets):
        raise InvalidUsage(f"renames gives two fields one name: {renames}")
    # Each new field's source: the field renamed to it, else the field of its name that is
    # not renamed away.
    source_of = {dst: src for src, dst in renames.items()}
    for name in old.names:
        if name not in renames and name in schema.names and name not in source_of:
            source_of[name] = name
    next_id = 1 + max((i for v in all_versions.values() for i in v.ids), default=-1)
    ids: list[int] = []
    for field in schema:
        origin = source_of.get(field.name)
        if origin is None:
            if not field.nullable:
                raise InvalidUsage(
                    f"field {field.name!r} is new and NOT NULL: rows already written have no "
                    "value for it (add it nullable)"
                )
            ids.append(next_id)
            next_id += 1
            continue
        _check_change(old.field(origin), field)
        ids.append(current.ids[old.get_field_index(origin)])
    return SchemaVersion(schema.serialize().to_pybytes(), tuple(ids))


def _check_change(before: pa.Field, after: pa.Field) -> None:
    name = after.name if before.name == after.name else f"{before.name}' (renamed '{after.name}"
    if before.type != after.type and not lossless(before.type, after.type):
        why = (
            "that narrows it: stored values may not fit"
            if lossless(after.type, before.type)
            else "that is not a lossless widening (persist widens integers, floats and decimals, "
            "timestamps to a finer unit, strings and binaries to their large kinds)"
        )
        raise InvalidUsage(f"field '{name}' can't change from {before.type} to {after.type}: {why}")
    if before.nullable and not after.nullable:
        raise InvalidUsage(
            f"field '{name}' can't become NOT NULL: rows already written may hold nulls"
        )


class Shapes(msgspec.Struct, frozen=True, array_like=True):
    """What a read needs to show parts of other schema versions in its reader's: the reader's
    version, every version its parts were written in (and the reader's), and the ids of the
    fields live when it was planned."""

    reader: int
    versions: dict[int, SchemaVersion]
    live: tuple[int, ...]


def shapes_for(state: State, reader: int, part_versions: Sequence[int]) -> Shapes | None:
    """The ``Shapes`` of a read at version ``reader`` of parts written in ``part_versions``;
    None when none is needed: every part is in the reader's version and none of its fields
    was dropped since (the read is then as it was before versions existed)."""
    all_versions = versions(state)
    live = all_versions[max(all_versions)].ids
    mine = all_versions[reader]
    if all(v == reader for v in part_versions) and set(mine.ids) <= set(live):
        return None
    wanted = {reader, *part_versions}
    return Shapes(reader, {v: all_versions[v] for v in sorted(wanted)}, tuple(live))


def dropped(state: State, version: int) -> list[str]:
    """The fields of ``version`` (by its names) dropped since: no reader is shown their values."""
    all_versions = versions(state)
    live = set(all_versions[max(all_versions)].ids)
    mine = all_versions[version]
    names = schema_of(mine).names
    return [name for name, fid in zip(names, mine.ids, strict=True) if fid not in live]


def current_view(state: State) -> View:
    """The view of a reader at ``state``'s current version of parts of any of its versions
    (what compaction and erasure read parts through)."""
    all_versions = versions(state)
    current = max(all_versions)
    return View(Shapes(current, all_versions, all_versions[current].ids))


class View:
    """Parts of any version shown in a reader's: by field id, dropped fields null, added ones
    null, types cast to the reader's, and a part whose projection breaks its sort order sorted
    again (and consolidated per row and time)."""

    def __init__(self, shapes: Shapes, schema: pa.Schema | None = None) -> None:
        self._shapes = shapes
        reader = shapes.versions[shapes.reader]
        # The reader's own schema (``shown_schema``: nullability relaxed where later versions
        # let nulls in) when given, else its version's.
        self.schema = schema if schema is not None else schema_of(reader)
        live = frozenset(shapes.live)
        # A field dropped since has no identity for this reader: nothing maps to it.
        self._ids = tuple(i if i in live else -1 for i in reader.ids)
        self._plans: dict[int, tuple[list[int | None], bool]] = {}

    @property
    def reader(self) -> int:
        return self._shapes.reader

    def direct(self, version: int) -> bool:
        """Whether a part of ``version`` is read as it is stored."""
        return version == self._shapes.reader and -1 not in self._ids

    def stored_schema(self, version: int) -> pa.Schema:
        """The full schema (data columns, ``_time``, ``_diff``) a part of ``version`` decodes in."""
        return full_schema(schema_of(self._version(version)))

    def _version(self, version: int) -> SchemaVersion:
        found = self._shapes.versions.get(version)
        if found is None:
            raise InvalidUsage(f"a part of schema version {version} is not among the read's")
        return found

    def _plan(self, version: int) -> tuple[list[int | None], bool]:
        """For each reader column, the part's column it shows (None: null); and whether the
        projection keeps the part's sort order (it uses every part column, in order)."""
        plan = self._plans.get(version)
        if plan is None:
            ids = self._version(version).ids
            at = {fid: i for i, fid in enumerate(ids)}
            columns = [at.get(fid) for fid in self._ids]
            used = [c for c in columns if c is not None]
            plan = self._plans[version] = (columns, used == list(range(len(ids))))
        return plan

    def key_index(self, index: bytes, version: int) -> bytes:
        """A part's key index (``PartRef.key_index``, in ``version``'s columns) in the reader's
        columns, when showing the part keeps its rows in order and distinct (an aligned
        showing, and no field of the reader's dropped since); else empty: a part without an
        index, read whole by every range that may hold its keys."""
        if not index or not self.keeps_distinct(version):
            return b""
        keys = decode_keys(index, schema_of(self._version(version)))
        columns, _ = self._plan(version)
        arrays = [
            pa.nulls(keys.num_rows, f.type) if at is None else keys.column(at).cast(f.type)
            for f, at in zip(self.schema, columns, strict=True)
        ]
        return encode_keys(pa.Table.from_arrays(arrays, schema=self.schema))

    def keeps_distinct(self, version: int) -> bool:
        """Whether a part of ``version``, shown in the reader's schema, keeps its order and
        its rows distinct (the showing is one to one): what lets its key index and the proof
        that rows are distinct (``core.read.scan.distinct_rows``) carry over."""
        return self.direct(version) or (-1 not in self._ids and self.aligned(version))

    def aligned(self, version: int) -> bool:
        """Whether a part of ``version``, shown in the reader's schema, is still sorted."""
        return self._plan(version)[1]

    def decoded(self, data: bytes, checksum: str, key: str, version: int) -> pa.Table:
        """A part's bytes (of ``version``; checksum verified, as ``decode_part``) in the
        reader's full schema: as stored for a ``direct`` version, else decoded in its own
        version's columns and shown (``show``)."""
        if self.direct(version):
            return decode_part(data, checksum, key, schema=full_schema(self.schema))
        stored = decode_part(data, checksum, key, schema=self.stored_schema(version))
        return self.show(stored, version)

    def show(self, table: pa.Table, version: int) -> pa.Table:
        """``table`` (a part of ``version``, in its full schema) in the reader's full schema,
        sorted by (data columns, time) and consolidated per row and time."""
        shown = self.project(table, version)
        if self.aligned(version):
            return shown
        return sort_consolidate(shown, [*self.schema.names, TIME])

    def project(self, table: pa.Table, version: int) -> pa.Table:
        """``table`` (updates of ``version``, in its full schema) in the reader's full schema,
        row for row (in the same order, unconsolidated)."""
        columns, _ = self._plan(version)
        stored = schema_of(self._version(version))
        arrays: list[pa.ChunkedArray | pa.Array] = []
        for field, at in zip(self.schema, columns, strict=True):
            if at is None:
                arrays.append(pa.nulls(table.num_rows, field.type))
                continue
            column = table.column(at)
            if column.type != field.type:
                try:
                    column = column.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise InvalidUsage(
                        f"field {field.name!r}: rows written at schema version {version} hold "
                        f"{stored.field(at).type} values that don't fit this reader's "
                        f"{field.type} (version {self.reader}); read at a newer version: {exc}"
                    ) from None
            arrays.append(column)
        arrays += [table.column(TIME), table.column(DIFF)]
        return pa.Table.from_arrays(arrays, schema=full_schema(self.schema))
