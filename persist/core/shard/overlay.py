"""A map field of the state seen through one transition's changes (``core.shard.transitions.Txn``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["Overlay"]

K = TypeVar("K")
V = TypeVar("V")


class Overlay(Generic[K, V]):
    """A map field seen through the changes made so far in one transition."""

    def __init__(self, base: dict[K, V]) -> None:
        self.base = base
        self.ops: dict[K, V | None] = {}

    def get(self, key: K) -> V | None:
        if key in self.ops:
            return self.ops[key]
        return self.base.get(key)

    def put(self, key: K, value: V | None) -> None:
        if value is None and key not in self.base:
            self.ops.pop(key, None)
        else:
            self.ops[key] = value

    def items(self) -> Iterator[tuple[K, V]]:
        for k, v in self.base.items():
            if k not in self.ops:
                yield k, v
        for k, ov in self.ops.items():
            if ov is not None:
                yield k, ov

    def diff(self) -> list[tuple[K, V | None]]:
        return list(self.ops.items())
