"""The options of the ``persist`` Spark source, checked once on the driver.

Every bad value is an ``InvalidUsage`` naming the option, raised before anything is read or
written: Spark shows it as ``persist.InvalidUsage: ...`` in the failed query's error.

The options are parsed where the ``DataSource`` is made: in a Python worker on the driver. The
locations are resolved there, once (``PERSIST_BLOB_URI`` / ``PERSIST_CONSENSUS_URI`` as the
driver sees them, else the embedded default made absolute on the driver), and travel with the
pickled reader or writer: a task never falls back to a location of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass

from persist.client import default_locations
from persist.core.catalog import check_name, is_name
from persist.errors import InvalidUsage
from persist.ids import ShardId
from persist.location import redact

__all__ = ["Options", "parse_options", "with_shard"]

_KNOWN = frozenset(
    {
        "shard",
        "name",
        "blob",
        "consensus",
        "mode",
        "as_of",
        "splits",
        "pushdown",
        "lease_duration_s",
        "time",
        "expected_upper",
        "new_upper",
        "time_offset",
        "part_target_bytes",
        # Spark lower-cases option names: this is maxRowsPerTrigger.
        "maxrowspertrigger",
        # mergeSchema
        "mergeschema",
    }
)
# Spark passes its own options along with ours.
_SPARKS = frozenset({"path", "paths", "checkpointlocation"})
_MODES = ("contents", "updates")
# PersistConfig's bound on its int settings.
_MAX_PART_TARGET = 2**40


@dataclass(frozen=True)
class Options:
    # The shard's id; empty while option ``name`` names no shard yet (``with_shard`` resolves
    # it on the driver: reads then fail, a batch write creates the shard under the name).
    shard: str
    blob: str
    consensus: str
    mode: str
    mode_given: bool
    as_of: int | None
    splits: int | None
    pushdown: bool
    lease_duration_s: float | None
    time: int | None
    expected_upper: int | None
    new_upper: int | None
    time_offset: int
    # Set when the DataFrame was loaded from a shard with nothing written (upper 0) and no
    # as_of: its snapshot is empty.
    empty: bool = False
    # What a write task's parts encode to, about (None: ``PersistConfig.part_target_bytes``).
    part_target_bytes: int | None = None
    # A streaming read's rows per micro-batch (option maxRowsPerTrigger; None: no limit).
    max_rows_per_trigger: int | None = None
    # The shard's name in the catalog (None: given by its id), from option ``name`` or from
    # option ``shard`` (``named_by`` says which: errors name the option the user gave).
    name: str | None = None
    named_by: str = "name"
    # Option ``as_of`` given as an instant (ISO 8601): ``with_shard`` resolves it to ``as_of``
    # (the newest time readable then), once, on the driver.
    as_of_at: datetime.datetime | None = None
    # A write's option mergeSchema: evolve the shard to the DataFrame's columns first.
    merge_schema: bool = False
    # The shard's schema version when the DataFrame was loaded (None: not loaded yet, or a
    # schema the user gave): its reads show every row in that version's schema.
    schema_version: int | None = None

    def __repr__(self) -> str:
        # Spark may show a reader's or writer's options (a failed task's): the locations'
        # secrets must not go with them.
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown.update(blob=redact(self.blob), consensus=redact(self.consensus))
        return f"Options({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def shard_id(self) -> str:
        """The shard's id; ``InvalidUsage`` if the name given names no shard."""
        if not self.shard:
            raise InvalidUsage(f"option {self.named_by}: no shard is named {self.name!r}")
        return self.shard


def _instant(options: Mapping[str, str]) -> datetime.datetime | None:
    """Option ``as_of`` when it is an instant (``2026-11-27T10:00:00Z``; naive means UTC)."""
    raw = options.get("as_of")
    if raw is None or raw.strip().lstrip("-").isdigit():
        return None
    try:
        when = datetime.datetime.fromisoformat(raw.strip())
    except ValueError:
        raise InvalidUsage(
            f"option as_of must be a time (an integer >= 0) or an instant "
            f"(ISO 8601, e.g. 2026-11-27T10:00:00Z), not {raw!r}"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.UTC)


def _time(options: Mapping[str, str], name: str) -> int | None:
    raw = options.get(name)
    if raw is None or (name == "as_of" and _instant(options) is not None):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InvalidUsage(f"option {name} must be a time (an integer >= 0), not {raw!r}") from None
    if not 0 <= value < 2**63:
        raise InvalidUsage(f"option {name} must be a time in [0, 2**63), not {raw!r}")
    return value


def parse_options(options: Mapping[str, str]) -> Options:
    """The checked options (Spark hands them over as strings, keys lower-cased)."""
    opts = {str(k).lower(): str(v) for k, v in options.items()}
    unknown = sorted(set(opts) - _KNOWN - _SPARKS)
    if unknown:
        raise InvalidUsage(f"unknown option(s) {unknown}; persist's are {sorted(_KNOWN)}")
    raw_shard, name = opts.get("shard"), opts.get("name")
    if raw_shard and name:
        raise InvalidUsage("give option shard or option name, not both")
    if not raw_shard and not name:
        raise InvalidUsage(
            "option shard (a persist ShardId, e.g. s0123...) or option name (a shard's name, "
            "e.g. sales.orders) is required"
        )
    shard = ""
    named_by = "name"
    if raw_shard and is_name(raw_shard):
        # As every call that takes a shard id: a name is looked up in the catalog.
        name, named_by = raw_shard, "shard"
    elif raw_shard:
        try:
            shard = str(ShardId(raw_shard))
        except InvalidUsage:
            shown = repr(raw_shard) if len(raw_shard) <= 80 else repr(raw_shard[:77] + "...")
            raise InvalidUsage(
                f"option shard: not a shard id or name: {shown} (an id is 's' followed by a "
                "UUID; a name is dotted words, e.g. 'sales.orders')"
            ) from None
    else:
        try:
            check_name(name)
        except InvalidUsage as exc:
            raise InvalidUsage(f"option name: {exc}") from None
    mode = opts.get("mode", "contents").lower()
    if mode not in _MODES:
        raise InvalidUsage(f"option mode must be one of {list(_MODES)}, not {opts['mode']!r}")
    splits: int | None = None
    if "splits" in opts:
        try:
            splits = int(opts["splits"])
        except ValueError:
            splits = 0
        if not 1 <= splits <= 100_000:
            raise InvalidUsage(
                f"option splits must be an integer in [1, 100000], not {opts['splits']!r}"
            )
    pushdown = opts.get("pushdown", "false").lower()
    if pushdown not in ("true", "false"):
        raise InvalidUsage(f"option pushdown must be true or false, not {opts['pushdown']!r}")
    lease: float | None = None
    if "lease_duration_s" in opts:
        try:
            lease = float(opts["lease_duration_s"])
        except ValueError:
            lease = math.nan
        if not math.isfinite(lease) or lease <= 0:
            raise InvalidUsage(
                f"option lease_duration_s must be a positive number of seconds, "
                f"not {opts['lease_duration_s']!r}"
            )
    blob, consensus = _locations(opts)
    part_target: int | None = None
    if "part_target_bytes" in opts:
        try:
            part_target = int(opts["part_target_bytes"])
        except ValueError:
            part_target = 0
        if not 1 <= part_target <= _MAX_PART_TARGET:
            raise InvalidUsage(
                f"option part_target_bytes must be an integer in [1, {_MAX_PART_TARGET}], "
                f"not {opts['part_target_bytes']!r}"
            )
    merge = opts.get("mergeschema", "false").lower()
    if merge not in ("true", "false"):
        raise InvalidUsage(f"option mergeSchema must be true or false, not {opts['mergeschema']!r}")
    max_rows: int | None = None
    if "maxrowspertrigger" in opts:
        try:
            max_rows = int(opts["maxrowspertrigger"])
        except ValueError:
            max_rows = 0
        if not 1 <= max_rows < 2**63:
            raise InvalidUsage(
                "option maxRowsPerTrigger must be a positive integer, "
                f"not {opts['maxrowspertrigger']!r}"
            )
    return Options(
        shard=shard,
        blob=blob,
        consensus=consensus,
        mode=mode,
        mode_given="mode" in opts,
        as_of=_time(opts, "as_of"),
        splits=splits,
        pushdown=pushdown == "true",
        lease_duration_s=lease,
        time=_time(opts, "time"),
        expected_upper=_time(opts, "expected_upper"),
        new_upper=_time(opts, "new_upper"),
        time_offset=_time(opts, "time_offset") or 0,
        part_target_bytes=part_target,
        max_rows_per_trigger=max_rows,
        name=name or None,
        named_by=named_by,
        as_of_at=_instant(opts),
        merge_schema=merge == "true",
    )


async def with_shard(o: Options) -> Options:
    """``o`` with the id of the shard option ``name`` names now, and ``as_of`` for an instant,
    looked up once on the driver (a rename during the job changes nothing). The shard stays
    unresolved when no shard has the name (a read then says so; a batch write creates it)."""
    if (o.shard or o.name is None) and o.as_of_at is None:
        return o
    import persist

    async with await persist.connect(o.blob, o.consensus) as client:
        if not o.shard:
            with contextlib.suppress(InvalidUsage):  # no such name (yet)
                o = dataclasses.replace(o, shard=str(await client.shard_id(o.name or "")))
        if o.as_of_at is not None:
            as_of = await client.as_of_at(o.shard_id(), o.as_of_at)
            o = dataclasses.replace(o, as_of=as_of)
    return o


def _locations(opts: Mapping[str, str]) -> tuple[str, str]:
    default_blob, default_consensus = default_locations()
    blob = opts.get("blob") or default_blob
    consensus = opts.get("consensus") or default_consensus
    for name, uri in (("blob", blob), ("consensus", consensus)):
        # Each Spark worker is its own process: a memory location would be a different, empty
        # one in every task.
        if uri.lower().startswith("mem:"):
            raise InvalidUsage(
                f"option {name}: {redact(uri)!r} lives in one process's memory, which Spark's "
                "workers can't share; use a file://, s3://, sqlite:/// or postgresql:// location"
            )
    return blob, consensus
