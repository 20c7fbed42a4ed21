"""What travels over the wire: JSON commands and action bodies, checked once into plain data,
and persist errors as Flight errors with a JSON payload (``docs/flight.md``)."""

from __future__ import annotations

import base64
import binascii
import datetime
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

from persist.core.catalog import check_name, is_name
from persist.core.stream.durability import Tier
from persist.core.stream.streams import check_writer_id
from persist.errors import (
    ExternalError,
    IntegrityError,
    InvalidUsage,
    LeaseExpired,
    PersistError,
    SchemaChanged,
    UpperMismatch,
)
from persist.ids import ShardId

__all__ = [
    "ACK_SCHEMA",
    "ACTIONS",
    "ExchangeCommand",
    "ListenCommand",
    "PutCommand",
    "SnapshotCommand",
    "TicketInvalid",
    "action_body",
    "check_levels",
    "error_payload",
    "exchange_command",
    "flight_error",
    "info_command",
    "path_name",
    "put_command",
    "write_seq",
    "writer_id_of",
]


class TicketInvalid(PersistError):
    """A ticket that this server did not sign, was altered, expired, or outlived its server."""


ACTIONS: tuple[tuple[str, str], ...] = (
    ("frontiers", 'body {"shard"}: the shard\'s {"since", "upper"} (null: the empty frontier)'),
    (
        "durability",
        'body {"shard"}: {"MEMORY", "LOCAL_DISK", "OBJECT_STORAGE", "COMMITTED"}: this '
        "server's LSN watermarks of the shard: every LSN of its log below each reached that tier",
    ),
    (
        "evolve_schema",
        'body {"shard", "schema": base64 Arrow IPC schema, "renames"?: {old: new}, '
        '"expected_version"?: int}: {"version"}: the shard\'s schema evolved to "schema"',
    ),
    (
        "quarantine",
        'body {"shard"?}: the streamed writes set aside, each {"shard", "lsn", "writer_id", '
        '"seq", "why", "at"}',
    ),
    ("health", 'body {}: {"status": "ok" | "unavailable", "version", "blob", "consensus"}'),
)


@dataclass(frozen=True, slots=True)
class SnapshotCommand:
    shard: str  # an id or a name
    as_of: int | None
    splits: int | None  # None: one per 128 MiB of parts (a path descriptor)
    # The contents (data columns, each row repeated by its multiplicity), not the updates.
    contents: bool = False
    # "as_of" given as an instant (ISO 8601 text): the newest time readable then.
    as_of_at: datetime.datetime | None = None


@dataclass(frozen=True, slots=True)
class ListenCommand:
    shard: str
    as_of: int
    until: int | None


@dataclass(frozen=True, slots=True)
class ExchangeCommand:
    shard: str
    writer_id: str | None
    levels: list[str] | None


@dataclass(frozen=True, slots=True)
class PutCommand:
    shard: str
    expected_upper: int | None
    new_upper: int | None


# A snapshot is cut into at most this many endpoints: each holds a reader's split, and a client
# asking for more gains nothing on any machine we know of.
MAX_SPLITS = 1024


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data) if data.strip() else {}
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidUsage(f"the {what} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidUsage(f"the {what} must be a JSON object, not {type(value).__name__}")
    return value


def _only(obj: dict[str, Any], allowed: set[str], what: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise InvalidUsage(f"unknown key(s) {unknown} in the {what}; it takes {sorted(allowed)}")


def _shard(obj: dict[str, Any], what: str) -> str:
    shard = obj.get("shard")
    if not isinstance(shard, str):
        raise InvalidUsage(f'the {what} needs "shard": a shard id or name string')
    if is_name(shard):
        return shard
    return str(ShardId(shard))  # InvalidUsage when it is not a shard id


def path_name(descriptor: fl.FlightDescriptor) -> str:
    """The shard name a path descriptor holds: ``["sales.orders"]`` or ``["sales", "orders"]``."""
    try:
        words = [p.decode() if isinstance(p, bytes) else str(p) for p in descriptor.path]
    except UnicodeDecodeError:
        raise InvalidUsage("a path descriptor's segments must be UTF-8") from None
    return check_name(".".join(words))


def _time(obj: dict[str, Any], key: str, *, nullable: bool, required: bool) -> int | None:
    if key not in obj:
        if required:
            raise InvalidUsage(f'"{key}" is required')
        return None
    value = obj[key]
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        kind = "a time (an int in [0, 2^64))" + (" or null" if nullable else "")
        raise InvalidUsage(f'"{key}" must be {kind}, not {value!r}')
    return value


def _instant(obj: dict[str, Any]) -> datetime.datetime | None:
    """``"as_of"`` when it is an instant: ISO 8601 text (naive means UTC)."""
    raw = obj.get("as_of")
    if not isinstance(raw, str):
        return None
    try:
        when = datetime.datetime.fromisoformat(raw)
    except ValueError:
        raise InvalidUsage(
            f'"as_of" must be a time (an int) or an instant (ISO 8601 text), not {raw!r}'
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.UTC)


def _descriptor_json(descriptor: fl.FlightDescriptor) -> dict[str, Any]:
    if descriptor.descriptor_type != fl.DescriptorType.CMD:
        raise InvalidUsage(
            "this call takes a command descriptor (FlightDescriptor.for_command); a path "
            "descriptor (a shard's name) only reads: GetFlightInfo, GetSchema"
        )
    return _json_object(descriptor.command, "command")


def info_command(descriptor: fl.FlightDescriptor) -> SnapshotCommand | ListenCommand:
    """The read a ``GetFlightInfo`` descriptor asks for: a path descriptor reads the named
    shard's contents as of its newest time."""
    if descriptor.descriptor_type == fl.DescriptorType.PATH:
        return SnapshotCommand(path_name(descriptor), None, None, contents=True)
    obj = _descriptor_json(descriptor)
    listen = obj.get("listen", False)
    if not isinstance(listen, bool):
        raise InvalidUsage(f'"listen" must be true or false, not {listen!r}')
    if listen:
        _only(obj, {"shard", "listen", "as_of", "until"}, "listen command")
        as_of = _time(obj, "as_of", nullable=False, required=True)
        assert as_of is not None
        return ListenCommand(
            _shard(obj, "command"), as_of, _time(obj, "until", nullable=True, required=False)
        )
    _only(obj, {"shard", "listen", "as_of", "splits", "contents"}, "snapshot command")
    splits = obj.get("splits", 1)
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
        raise InvalidUsage(f'"splits" must be an int in [1, {MAX_SPLITS}], not {splits!r}')
    contents = obj.get("contents", False)
    if not isinstance(contents, bool):
        raise InvalidUsage(f'"contents" must be true or false, not {contents!r}')
    at = _instant(obj)
    return SnapshotCommand(
        _shard(obj, "command"),
        None if at else _time(obj, "as_of", nullable=False, required=False),
        splits,
        contents,
        at,
    )


def put_command(descriptor: fl.FlightDescriptor) -> PutCommand:
    """The ``compare_and_append`` a ``DoPut`` descriptor asks for."""
    obj = _descriptor_json(descriptor)
    _only(obj, {"shard", "expected_upper", "new_upper"}, "DoPut command")
    return PutCommand(
        _shard(obj, "DoPut command"),
        _time(obj, "expected_upper", nullable=True, required=True),
        _time(obj, "new_upper", nullable=True, required=True),
    )


def exchange_command(descriptor: fl.FlightDescriptor) -> ExchangeCommand:
    """The streaming write a ``DoExchange`` descriptor asks for."""
    obj = _descriptor_json(descriptor)
    _only(obj, {"shard", "op", "writer_id", "levels"}, "DoExchange command")
    if obj.get("op") != "streaming_write":
        raise InvalidUsage('a DoExchange command needs "op": "streaming_write"')
    writer_id = obj.get("writer_id")
    if writer_id is not None and not isinstance(writer_id, str):
        raise InvalidUsage(f'"writer_id" must be a string, not {writer_id!r}')
    levels = obj.get("levels")
    if levels is not None and not isinstance(levels, list):
        raise InvalidUsage(f'"levels" must be a list of tier names, not {levels!r}')
    return ExchangeCommand(_shard(obj, "DoExchange command"), writer_id, levels)


def action_body(action: str, body: bytes) -> dict[str, Any]:
    """The checked JSON body of a known action (``InvalidUsage`` for an unknown one)."""
    known = {name for name, _ in ACTIONS}
    if action not in known:
        raise InvalidUsage(f"unknown action {action!r}; ListActions lists {sorted(known)}")
    obj = _json_object(body, f"{action} action's body")
    if action == "health":
        _only(obj, set(), "health action's body")
    elif action == "evolve_schema":
        _only(obj, {"shard", "schema", "renames", "expected_version"}, "evolve_schema's body")
        obj["shard"] = _shard(obj, "evolve_schema action's body")
        obj["schema"] = _ipc_schema(obj.get("schema"))
        obj["renames"] = _renames(obj.get("renames"))
        expected = obj.get("expected_version")
        if expected is not None and (
            isinstance(expected, bool) or not isinstance(expected, int) or expected < 0
        ):
            raise InvalidUsage(
                f'"expected_version" must be a version (an int >= 0), not {expected!r}'
            )
    elif action == "quarantine" and "shard" not in obj:
        _only(obj, set(), "quarantine action's body")
    else:
        _only(obj, {"shard"}, f"{action} action's body")
        obj["shard"] = _shard(obj, f"{action} action's body")
    return obj


def _ipc_schema(value: object) -> pa.Schema:
    """evolve_schema's ``"schema"``: an Arrow IPC schema message, base64 (standard alphabet)."""
    if not isinstance(value, str):
        raise InvalidUsage('evolve_schema needs "schema": an Arrow IPC schema, base64 encoded')
    try:
        data = base64.b64decode(value, validate=True)
        return pa.ipc.read_schema(pa.py_buffer(data))
    except (binascii.Error, ValueError, pa.ArrowException) as exc:
        raise InvalidUsage(f'"schema" is not a base64 Arrow IPC schema: {exc}') from None


def _renames(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidUsage(f'"renames" must be an object of old names to new ones, not {value!r}')
    return value


# --- errors ------------------------------------------------------------------------------------


def error_payload(exc: BaseException) -> tuple[type[fl.FlightError], dict[str, Any]]:
    """The Flight error class and JSON payload of an error, as the spec's table maps them."""
    payload: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc)}
    cls: type[fl.FlightError] = fl.FlightServerError
    if isinstance(exc, TicketInvalid):
        payload["error"] = "TicketInvalid"
        cls = fl.FlightUnauthorizedError
    elif isinstance(exc, UpperMismatch):
        payload.update(error="UpperMismatch", expected=exc.expected, current=exc.current)
    elif isinstance(exc, SchemaChanged):
        payload.update(error="SchemaChanged", expected=exc.expected, current=exc.current)
    elif isinstance(exc, LeaseExpired):
        payload["error"] = "LeaseExpired"
    elif isinstance(exc, InvalidUsage):
        payload["error"] = "InvalidUsage"
    elif isinstance(exc, IntegrityError):
        payload.update(error="IntegrityError", determinate=exc.determinate)
        cls = fl.FlightInternalError
    elif isinstance(exc, ExternalError):
        payload.update(error="ExternalError", determinate=exc.determinate)
        if exc.determinate:
            cls = fl.FlightUnavailableError
    else:
        # Not persist's own: a bug or an unforeseen failure, never silently a data error.
        payload["error"] = "InternalError"
        cls = fl.FlightInternalError
    return cls, payload


def flight_error(exc: BaseException) -> fl.FlightError:
    """``exc`` as the Flight error a stock client sees: the JSON payload in ``extra_info`` and,
    for clients that can't read it, in the message after ``persist: ``."""
    cls, payload = error_payload(exc)
    text = json.dumps(payload, default=str)
    return cls(f"persist: {text}", extra_info=text.encode())


# --- streaming writes ------------------------------------------------------------------------------

ACK_SCHEMA = pa.schema(
    [
        pa.field("lsn", pa.uint64(), nullable=False),
        pa.field("durability_level", pa.utf8(), nullable=False),
        pa.field("is_durability_update", pa.bool_(), nullable=False),
        # The RFC's Timestamp(Microsecond): no time-zone field; the values are UTC.
        pa.field("timestamp", pa.timestamp("us"), nullable=False),
    ]
)


def write_seq(metadata: bytes | None, writer_id: str | None) -> int:
    """The seq a streamed write's ``app_metadata`` names (-1: none)."""
    if not metadata:
        return -1
    if metadata.startswith(b'{"seq": ') and metadata.endswith(b"}"):
        # What the Python client sends: read without the JSON parser (a write's hot path).
        digits = metadata[8:-1]
        if digits.isdigit() and len(digits) < 19 and (digits == b"0" or digits[0] != 48):
            if writer_id is None:
                raise InvalidUsage('a write with a "seq" needs the call\'s "writer_id"')
            return int(digits)
    try:
        value = json.loads(metadata)
    except (UnicodeDecodeError, ValueError):
        raise InvalidUsage(f"a write's app_metadata is not JSON: {metadata[:100]!r}") from None
    if not isinstance(value, dict) or set(value) - {"seq"}:
        raise InvalidUsage('a write\'s app_metadata must be {"seq": n}')
    seq = value.get("seq")
    if seq is None:
        return -1
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 1 << 63:
        raise InvalidUsage(f"seq must be an int in [0, 2^63), not {seq!r}")
    if writer_id is None:
        raise InvalidUsage('a write with a "seq" needs the call\'s "writer_id"')
    return seq


def check_levels(levels: object) -> frozenset[Tier]:
    """The tiers a DoExchange's ``levels`` asks for (``MEMORY`` always)."""
    names = [t.name for t in Tier]
    if levels is None:
        return frozenset(Tier)
    if not isinstance(levels, list) or not all(isinstance(x, str) for x in levels):
        raise InvalidUsage(f'"levels" must be a list of tier names {names}, not {levels!r}')
    unknown = [x for x in levels if x not in names]
    if unknown:
        raise InvalidUsage(f"unknown durability level(s) {unknown}; they are {names}")
    return frozenset(Tier[x] for x in levels) | {Tier.MEMORY}


def writer_id_of(value: object) -> str | None:
    if value is None:
        return None
    problem = check_writer_id(value)
    if problem is not None or not isinstance(value, str):
        raise InvalidUsage(problem or "a writer_id must be a string")
    return value
