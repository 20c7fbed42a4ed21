"""The catalog: names of shards, as plain data and pure transitions.

A name is dotted words (``sales.orders``): each word a letter or ``_`` then letters, digits
and ``_``, at most 255 characters in all. No name can be read as a shard id (a shard id holds
``-``), so every call that takes a shard id can take a name in its place.

The catalog is one value in consensus (``persist.internal.catalog`` reads and compare-and-sets
it), so its changes are linearized like a shard's state.
"""

from __future__ import annotations

import re

import msgspec

from persist.errors import InvalidUsage

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_NAME_LEN = 255


class Entry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A named shard: its id, and when the name was given (ms since the epoch)."""

    shard_id: str
    named_ms: int


class Catalog(msgspec.Struct, frozen=True, gc=False):
    names: dict[str, Entry] = {}


def is_name(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_NAME_LEN and bool(_NAME.fullmatch(value))


def check_name(value: object) -> str:
    """``value`` if it is a valid name, else ``InvalidUsage`` saying what a name is."""
    if not is_name(value):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise InvalidUsage(
            f"not a shard name: {shown} (a name is dotted words, e.g. 'sales.orders': each word "
            f"a letter or '_' then letters, digits or '_'; at most {MAX_NAME_LEN} characters)"
        )
    assert isinstance(value, str)
    return value


def lookup(catalog: Catalog, name: str) -> str:
    """The id of the shard named ``name`` (``InvalidUsage`` if no shard has that name)."""
    entry = catalog.names.get(name)
    if entry is None:
        raise InvalidUsage(f"no shard is named {name!r}")
    return entry.shard_id


def name_of(catalog: Catalog, shard_id: str) -> str | None:
    for name, entry in catalog.names.items():
        if entry.shard_id == shard_id:
            return name
    return None


def add(catalog: Catalog, name: str, shard_id: str, now_ms: int) -> Catalog | None:
    """The catalog with ``name`` given to ``shard_id``; None if it already is (a retry).

    ``InvalidUsage`` if the name is another shard's, or the shard already has a name."""
    entry = catalog.names.get(name)
    if entry is not None:
        if entry.shard_id == shard_id:
            return None
        raise InvalidUsage(f"the name {name!r} is taken (by shard {entry.shard_id})")
    other = name_of(catalog, shard_id)
    if other is not None:
        raise InvalidUsage(f"shard {shard_id} is already named {other!r}")
    return Catalog({**catalog.names, name: Entry(str(shard_id), now_ms)})


def rename(catalog: Catalog, old: str, new: str, shard_id: str) -> Catalog | None:
    """The catalog with shard ``shard_id`` (named ``old`` when the call began) named ``new``;
    None if it already is (a retry, or ``old == new``)."""
    current = catalog.names.get(new)
    if current is not None and current.shard_id == shard_id:
        return None
    if current is not None:
        raise InvalidUsage(f"the name {new!r} is taken (by shard {current.shard_id})")
    entry = catalog.names.get(old)
    if entry is None or entry.shard_id != shard_id:
        raise InvalidUsage(f"no shard is named {old!r}")
    names = {k: v for k, v in catalog.names.items() if k != old}
    names[new] = entry
    return Catalog(names)


def remove(catalog: Catalog, shard_id: str) -> Catalog | None:
    """The catalog without the name of ``shard_id``; None if it has none."""
    name = name_of(catalog, shard_id)
    if name is None:
        return None
    return Catalog({k: v for k, v in catalog.names.items() if k != name})
