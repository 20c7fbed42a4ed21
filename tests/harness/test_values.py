"""Value fuzzing at the API boundary: every argument of every public call drawn from hostile
strategies (``persist.testing.hostile``).

Each call either accepts its arguments, and then its data reads back exactly (checked against
``ShardModel``, NaN equal to NaN), or refuses them with ``InvalidUsage`` (``UpperMismatch``
where the model agrees the upper did not match). Any other exception fails, in particular a
raw ``TypeError`` / ``UnicodeEncodeError`` / ``OverflowError``, and so does a call that hangs.
After each example a fresh client must open the shard and read it: no value may brick it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import persist
from persist.core.arrow.casts import storable
from persist.location import open_blob, open_consensus
from persist.testing import ShardModel, contents_of, machine_config, scaled, table_updates
from persist.testing import hostile as hs
from persist.testing import strategies as pst
from persist.testing.model import Row

from .conftest import Figures, LocationUris

T = TypeVar("T")

EXAMPLES = {"mem": 60, "file+sqlite": 20}
CALLS_PER_EXAMPLE = 8
CALL_TIMEOUT_S = 60.0
ALL_CALLS = [
    "compare_and_append",
    "compare_and_append",
    "append",
    "batch",
    "commit_batch",
    "delete_batch",
    "downgrade_since",
    "snapshot",
    "snapshot_and_fetch",
    "listen",
    "handles",
    "admin",
    "connect",
    "configs",
    "new_schema",
]
# PERSIST_FUZZ_CALLS=snapshot,listen draws only those calls (to chase one failure).
CALLS = [
    c for c in ALL_CALLS if c in os.environ.get("PERSIST_FUZZ_CALLS", c)
]  # a generous bound on any one call: more than this is a hang

SETTINGS = settings(
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


class Refused(Exception):
    """The call refused its arguments with ``InvalidUsage``."""


@dataclass
class Tally:
    tried: int = 0
    refused: int = 0
    accepted: dict[str, int] = field(default_factory=dict)


def _int_frontier(value: object) -> int | None:
    """The frontier ``value`` means, as the model takes it."""
    if value is None:
        return None
    assert isinstance(value, int), f"accepted {value!r} as a frontier"
    return int(value)


def _valid_time(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


# Sample arrays of the types ``hostile.schemas_to_round_trip`` draws.
def _sample(t: pa.DataType) -> pa.Array:
    if pa.types.is_dictionary(t):
        return pa.array(["a", "b", "a"]).dictionary_encode().cast(t)
    if pa.types.is_list(t):
        return pa.array([[1], [2, 3], []], t)
    if pa.types.is_struct(t):
        return pa.array([{"a": 1}, {"a": 2}, {"a": 3}], t)
    if pa.types.is_null(t):
        return pa.array([None, None, None], t)
    if pa.types.is_float16(t):
        import numpy as np

        return pa.array(np.array([0.5, -0.0, 2.0], dtype=np.float16), t)
    if pa.types.is_large_binary(t):
        return pa.array([b"", b"\x00", b"z"], t)
    if pa.types.is_decimal(t):
        import decimal

        return pa.array([decimal.Decimal(x) for x in ("1", "-2", "10" * 18)], t)
    if pa.types.is_time(t):
        return pa.array([0, 1, 86_399], pa.int32() if t.bit_width == 32 else pa.int64()).cast(t)
    if pa.types.is_date64(t):
        return pa.array([0, 86_400_000, -86_400_000], pa.int64()).cast(t)
    return pa.array([0, 1_600_000_000, 86_399], pa.int64()).cast(t)


class Fuzz:
    """One example: a shard, a client, a writer and two readers, and hostile calls on them."""

    def __init__(self, data: st.DataObject, uris: tuple[str, str], schema: pa.Schema) -> None:
        self.data = data
        self.uris = uris
        self.schema = schema
        self.names = schema.names
        self.shard = persist.ShardId.new()
        self.model = ShardModel()
        self.tally = Tally()
        self.config = machine_config()
        self.client: persist.PersistClient
        self.write: persist.WriteHandle
        self.read: persist.ReadHandle  # the one whose since the fuzz moves
        self.verify: persist.ReadHandle  # at since 0, for checking

    def draw(self, strategy: st.SearchStrategy[T], label: str) -> T:
        return self.data.draw(strategy, label=label)

    def client_for(self, config: persist.PersistConfig | None = None) -> persist.PersistClient:
        blob, consensus = open_blob(self.uris[0]), open_consensus(self.uris[1])
        return persist.PersistClient(blob, consensus, config or self.config)

    async def call(
        self, what: str, make: Callable[[], Awaitable[T]], *, mismatch: bool = False
    ) -> T:
        """Runs one call; ``Refused`` on ``InvalidUsage`` (or ``UpperMismatch`` if the model
        says the upper did not match: ``mismatch``); any other exception fails the test."""
        self.tally.tried += 1
        try:
            result = await asyncio.wait_for(make(), CALL_TIMEOUT_S)
        except persist.InvalidUsage as exc:
            self.tally.refused += 1
            raise Refused(what) from exc
        except persist.UpperMismatch as exc:
            if mismatch:
                self.tally.refused += 1
                raise Refused(what) from exc
            raise AssertionError(f"{what}: UpperMismatch where the model matches: {exc}") from exc
        except Exception as exc:
            raise AssertionError(f"{what} raised {type(exc).__name__}: {exc!r}"[:2000]) from exc
        self.tally.accepted[what] = self.tally.accepted.get(what, 0) + 1
        return result

    # --- checks --------------------------------------------------------------------------------

    def as_of_now(self) -> int | None:
        upper = self.model.upper
        if upper is None:
            return max([t for (_, t) in self.model.updates] + [0])
        return upper - 1 if upper > 0 else None

    async def check(self) -> None:
        """The verify reader sees exactly the model's contents, in the shard's own types."""
        as_of = self.as_of_now()
        if as_of is None:
            return
        table = await self.verify.snapshot_and_fetch(as_of)
        assert table.schema.remove_metadata().field(0).type == self.schema.field(0).type
        assert contents_of(table, self.names, as_of) == self.model.contents_as_of(as_of)

    async def check_opens(self) -> None:
        """A fresh client opens the shard and reads the model's contents."""
        async with self.client_for() as fresh:
            reader = await fresh.open_leased_reader(self.shard, self.schema, "check")
            as_of = self.as_of_now()
            if as_of is not None and reader.since is not None and reader.since <= as_of:
                got = contents_of(await reader.snapshot_and_fetch(as_of), self.names, as_of)
                assert got == self.model.contents_as_of(as_of)
            await reader.expire()

    # --- the calls -----------------------------------------------------------------------------

    def updates_of(self, table: object) -> list[tuple[Row, int, int]]:
        """The updates an accepted ``table`` stands for (every column must be there)."""
        assert isinstance(table, pa.Table | pa.RecordBatch), f"accepted {type(table)} as updates"
        missing = [n for n in [*self.names, "_time"] if n not in table.schema.names]
        assert not missing, f"accepted updates without the columns {missing}"
        return table_updates(table, self.names)

    async def writes(self, api: str) -> None:
        e = self.model.upper
        base = 0 if e is None else e
        table, kind = self.draw(hs.update_tables(self.schema, base, base + 2), "updates")
        lower = self.draw(hs.frontiers(st.sampled_from([base, base, base + 1])), "lower")
        upper = self.draw(hs.frontiers(st.sampled_from([base + 2, base + 2, base, None])), "upper")
        w = self.write
        what = f"{api}({kind}, {lower!r:.40}, {upper!r:.40})"
        if api == "batch":
            try:
                batch = await self.call(what, lambda: w.batch(table, lower, upper))  # type: ignore[arg-type]
            except Refused:
                return
            self.batch_lower_upper = (lower, upper, table)
            self.batches.append(batch)
            return
        call = w.compare_and_append if api == "compare_and_append" else w.append
        try:
            await self.call(
                what,
                lambda: call(table, lower, upper),  # type: ignore[arg-type]
                mismatch=self.model.upper != lower,
            )
        except Refused:
            return
        ups = self.updates_of(table)
        lo, hi = _int_frontier(lower), _int_frontier(upper)
        if lo is None:
            # Only the no-op heartbeat of a finished shard: nothing, from None to None.
            assert api == "compare_and_append", f"{what} accepted a None lower"
            assert self.model.upper is None and hi is None and not ups, what
            return
        try:
            if api == "compare_and_append":
                self.model.compare_and_append(ups, lo, hi)
            else:
                self.model.append(ups, lo, hi)
        except (persist.InvalidUsage, persist.UpperMismatch) as exc:
            raise AssertionError(
                f"{what} was accepted, but the contract refuses it: {exc}"
            ) from exc

    async def commit_batch(self) -> None:
        if not self.batches:
            await self.writes("batch")
            return
        batch = self.batches.pop()
        lower, upper, table = self.batch_lower_upper
        payload = self.draw(
            st.one_of(
                st.just([batch]), st.just(batch), hs.forged(batch.to_bytes()).map(lambda b: [b])
            ),
            "batches",
        )
        expected = self.draw(hs.frontiers(st.just(lower)), "expected")  # type: ignore[arg-type]
        new = self.draw(hs.frontiers(st.just(upper)), "new")  # type: ignore[arg-type]
        w = self.write
        try:
            await self.call(
                "compare_and_append_batch",
                lambda: w.compare_and_append_batch(payload, expected, new),  # type: ignore[arg-type]
                mismatch=self.model.upper != expected,
            )
        except Refused:
            with contextlib.suppress(Refused):
                await self.call("delete_batch", lambda: self.client.delete_batch(batch))
            return
        assert payload == [batch], f"compare_and_append_batch accepted {payload!r:.200}"
        lo, hi = _int_frontier(expected), _int_frontier(new)
        assert lo is not None
        self.model.compare_and_append(self.updates_of(table), lo, hi)

    async def delete_junk_batch(self) -> None:
        forged = self.draw(hs.forged(b"\x00" * 8), "batch bytes")
        with contextlib.suppress(Refused):
            batch = await self.call("Batch.from_bytes", self._from_bytes(persist.Batch, forged))
            await self.call("delete_batch", lambda: self.client.delete_batch(batch))
            raise AssertionError(f"forged batch bytes {forged!r:.100} were accepted")
        with contextlib.suppress(Refused):
            await self.call("delete_batch", lambda: self.client.delete_batch(forged))  # type: ignore[arg-type]
            raise AssertionError(f"delete_batch accepted {forged!r:.100}")

    @staticmethod
    def _from_bytes(cls: Any, data: object) -> Callable[[], Awaitable[Any]]:
        return Fuzz._sync(cls.from_bytes, data)

    @staticmethod
    def _sync(fn: Callable[..., Any], *args: object) -> Callable[[], Awaitable[Any]]:
        async def go() -> Any:
            return fn(*args)

        return go

    async def downgrade(self) -> None:
        since = self.read.since
        new = self.draw(
            hs.frontiers(st.sampled_from([since, since if since is None else since + 1])),
            "new_since",
        )
        with contextlib.suppress(Refused):
            await self.call(f"downgrade_since({new!r:.40})", lambda: self.read.downgrade_since(new))  # type: ignore[arg-type]
            assert self.read.since == new, (self.read.since, new)

    async def reads(self, api: str) -> None:
        as_of_now = self.as_of_now()
        valid = st.just(0) if as_of_now is None else st.integers(0, as_of_now)
        as_of = self.draw(hs.frontiers(valid), "as_of")
        if _valid_time(as_of) and not self.model.readable(as_of):  # type: ignore[arg-type]
            return  # it would wait (legally) for the upper to pass as_of
        r = self.read
        what = f"{api}({as_of!r:.40})"
        try:
            if api == "snapshot_and_fetch":
                table = await self.call(what, lambda: r.snapshot_and_fetch(as_of))  # type: ignore[arg-type]
            elif api == "snapshot":
                n = self.draw(st.one_of(st.integers(1, 3), hs.junk()), "num_splits")
                splits = await self.call(what, lambda: r.snapshot(as_of, n))  # type: ignore[arg-type]
                tables = []
                for s in splits:
                    again = persist.Split.from_bytes(s.to_bytes())
                    tables.append(
                        await self.call(
                            "fetch_split", lambda again=again: self.client.fetch_split(again)
                        )
                    )
                forged = self.draw(hs.forged(splits[0].to_bytes()), "split bytes")
                with contextlib.suppress(Refused):
                    bad = await self.call(
                        "Split.from_bytes", self._from_bytes(persist.Split, forged)
                    )
                    if bad != splits[0]:
                        await self.call("fetch_split", lambda: self.client.fetch_split(bad))
                table = pa.concat_tables(tables)
            else:
                table = await self.call(what, lambda: self._first_listen(as_of))
                if table is None:
                    return
        except Refused:
            return
        assert _valid_time(as_of), f"{what} accepted"
        assert isinstance(as_of, int)
        if api == "listen":
            got = {(row, t): d for row, t, d in table_updates(table, self.names)}
            assert all(t > as_of for (_, t) in got), got
            return
        merged: dict[Row, int] = {}
        for row, _, d in table_updates(table, self.names):
            merged[row] = merged.get(row, 0) + d
        assert {k: v for k, v in merged.items() if v} == self.model.contents_as_of(as_of)

    async def _first_listen(self, as_of: object) -> pa.Table | None:
        if _valid_time(as_of) and not self.model.readable(as_of + 1):  # type: ignore[operator]
            return None
        events = self.read.listen(as_of)  # type: ignore[arg-type]
        try:
            async for event in events:
                return event.updates
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        return None

    async def handles(self) -> None:
        shard = self.draw(hs.shard_ids(self.shard), "shard_id")
        purpose = self.draw(hs.purposes(), "purpose")
        schema = self.draw(st.one_of(st.just(self.schema), pst.schemas(), hs.junk()), "schema")
        api = self.draw(st.sampled_from(["open_writer", "open_leased_reader", "open"]), "api")
        fn = getattr(self.client, api)
        with contextlib.suppress(Refused):
            got = await self.call(
                f"{api}(purpose={purpose!r:.40})", lambda: fn(shard, schema, purpose)
            )
            # None asks for the shard's own schema (valid for an existing shard).
            assert schema is None or schema == self.schema or shard != self.shard, (
                f"{api} accepted another schema"
            )
            for h in got if isinstance(got, tuple) else (got,):
                if shard == self.shard:
                    assert h.schema == self.schema, f"{api} gave a handle of another schema"
                await self.call("expire", h.expire)

    async def admin(self) -> None:
        shard = self.draw(hs.shard_ids(self.shard), "shard_id")
        api = self.draw(st.sampled_from(["maintain", "inspect", "finalize", "ShardId"]), "api")
        with contextlib.suppress(Refused):
            if api == "ShardId":
                got = await self.call("ShardId", self._sync(persist.ShardId, shard))
                assert got == shard
                return
            fn = getattr(self.client, api)
            await self.call(f"{api}({shard!r:.40})", lambda: fn(shard))
            assert api != "finalize" or shard != self.shard, "finalize accepted a live shard"

    async def connect(self) -> None:
        bad = self.draw(
            st.one_of(
                st.sampled_from(["", "nope://x", "file://relative/dir", "mem://\ud800", "s3://"]),
                st.sampled_from([123, b"mem://x", 1.5, ["mem://x"], True]),
            ),
            "uri",
        )
        which = self.draw(st.booleans(), "blob or consensus")
        kwargs = (
            {"blob": bad, "consensus": "mem://x"}
            if which
            else {"blob": "mem://x", "consensus": bad}
        )
        with contextlib.suppress(Refused):
            client = await self.call("connect", lambda: persist.connect(**kwargs))  # type: ignore[arg-type]
            await client.close()

    async def configs(self) -> None:
        overrides = self.draw(hs.config_overrides(), "config")
        base: dict[str, object] = {"poll_interval_s": 0.01, "retry_initial_delay_s": 0.001}
        base.update(overrides)

        async def make() -> persist.PersistConfig:
            return persist.PersistConfig(**base)  # type: ignore[arg-type]

        with contextlib.suppress(Refused):
            cfg = await self.call(f"PersistConfig({overrides!r:.60})", make)
            async with self.client_for(cfg) as other:
                w = await self.call(
                    "open_writer (config)", lambda: other.open_writer(self.shard, self.schema)
                )
                upper = self.model.upper
                if upper is not None:
                    empty = pa.table(
                        {
                            n: pa.array([], t)
                            for n, t in zip(self.names, self.schema.types, strict=True)
                        }
                        | {"_time": pa.array([], pa.uint64())}
                    )
                    await self.call(
                        "heartbeat (config)", lambda: w.compare_and_append(empty, upper, upper)
                    )
                await self.call("expire (config)", w.expire)

    async def new_schema(self) -> None:
        """A fresh shard of a type beyond the usual ones: refused, or its values read back in
        their own type."""
        schema = self.draw(hs.schemas_to_round_trip(), "schema")
        shard = persist.ShardId.new()
        t = schema.field(0).type
        with contextlib.suppress(Refused):
            w, r = await self.call(f"open({t})", lambda: self.client.open(shard, schema))
            column = _sample(t)
            updates = pa.table({"v": column, "_time": pa.array([0] * len(column), pa.uint64())})
            await self.call(f"compare_and_append({t})", lambda: w.compare_and_append(updates, 0, 1))
            got = await self.call(f"snapshot_and_fetch({t})", lambda: r.snapshot_and_fetch(0))
            # Views and dictionaries are stored as their values (core.arrow.casts); the rest as is.
            stored = storable(t)
            assert got.schema.field("v").type == stored, (
                f"{t} read back as {got.schema.field('v').type}"
            )
            # Scalars' reprs, not to_pylist(): nanosecond times don't convert to datetime.
            want = sorted(map(repr, column.cast(stored)))
            back = [
                repr(v)
                for v, d in zip(got.column("v"), got.column("_diff").to_pylist(), strict=True)
                for _ in range(d)
            ]
            assert sorted(back) == want, f"{t}: wrote {want}, read {sorted(back)}"
        async with self.client_for() as fresh:
            with contextlib.suppress(persist.InvalidUsage):
                await fresh.inspect(shard)

    # --- the example ---------------------------------------------------------------------------

    async def run(self, n: int) -> None:
        self.batches: list[persist.Batch] = []
        self.batch_lower_upper: tuple[object, object, object] = (0, 0, None)
        async with self.client_for() as client:
            self.client = client
            self.write, self.verify = await client.open(self.shard, self.schema, purpose="fuzz")
            self.read = await client.open_leased_reader(self.shard, self.schema, "fuzz")
            for i in range(n):
                api = self.draw(st.sampled_from(CALLS), f"call {i}")
                if api in ("compare_and_append", "append", "batch"):
                    await self.writes(api)
                elif api == "commit_batch":
                    await self.commit_batch()
                elif api == "delete_batch":
                    await self.delete_junk_batch()
                elif api == "downgrade_since":
                    await self.downgrade()
                elif api in ("snapshot", "snapshot_and_fetch", "listen"):
                    await self.reads(api)
                else:
                    await getattr(self, api)()
                await self.check()


@pytest.mark.parametrize("kind", list(EXAMPLES))
def test_hostile_values_are_accepted_exactly_or_refused(
    kind: str, location_uris: LocationUris, figures: Figures
) -> None:
    tally = Tally()
    bricked = 0

    @given(data=st.data())
    @settings(SETTINGS, max_examples=scaled(EXAMPLES[kind]))
    def example(data: st.DataObject) -> None:
        nonlocal bricked
        schema = data.draw(pst.schemas(max_columns=2), label="schema")
        fuzz = Fuzz(data, location_uris(kind), schema)
        try:
            asyncio.run(fuzz.run(CALLS_PER_EXAMPLE))
        finally:
            tally.tried += fuzz.tally.tried
            tally.refused += fuzz.tally.refused
            # Whatever went wrong above, everyone must still be able to open the shard.
            try:
                asyncio.run(fuzz.check_opens())
            except Exception:
                bricked += 1
                raise

    try:
        example()
    finally:
        figures.values_tried += tally.tried
        figures.values_refused += tally.refused
        figures.bricked_shards += bricked
        figures.note(
            f"hostile values on {kind}", tried=tally.tried, refused=tally.refused, bricked=bricked
        )
    assert bricked == 0
    assert tally.tried > tally.refused > 0
