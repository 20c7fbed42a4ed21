"""The conformance suite every Blob implementation must pass."""

from __future__ import annotations

import asyncio
import os
from typing import Any
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

import pytest
from hypothesis import given
from hypothesis import strategies as st

from persist.errors import InvalidUsage
from persist.location import Blob
from persist.location.testing._common import (
    CANCEL_AFTER_S,
    HYPOTHESIS,
    PartialWrite,
    assert_stays,
    namespace,
)

# --------------------------------------------------------------------------------------------
# Blob


INVALID_KEYS = [
    "",
    "/abs",
    "a/../b",
    "../x",
    "..",
    ".",
    "./a",
    "a/.",
    "a//b",
    "a/",
    "a\\b",
    "a\x00b",
    "a\nb",
    "caf\u00e9",
    ".tmp-x",
    "a/.tmp-y",
]

# All at depth two, so no key is a directory of another (FileBlob maps keys to paths), while
# still covering prefix cases like ``a/x`` vs ``a/xy`` and ``a/`` vs ``ab/``.
_MODEL_KEYS = ["a/x", "a/xy", "a/y", "ab/x", "b/x"]
_MODEL_PREFIXES = ["", "a", "a/", "a/x", "ab", "b/", "c", "a/xy"]

_blob_ops = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(_MODEL_KEYS), st.binary(max_size=32)),
    st.tuples(st.just("get"), st.sampled_from(_MODEL_KEYS)),
    st.tuples(st.just("delete"), st.sampled_from(_MODEL_KEYS)),
    st.tuples(st.just("list"), st.sampled_from(_MODEL_PREFIXES)),
)


class BlobConformance:
    """Tests for a :class:`Blob`; subclasses provide an async fixture ``blob``."""

    # Explicit, so the suite also runs under pytest-asyncio's strict mode.
    pytestmark = pytest.mark.asyncio

    @pytest.fixture
    def leave_partial_write(self) -> PartialWrite | None:
        """Leaves a killed ``set``'s leftovers, if this backend leaves any (default: it doesn't)."""
        return None

    async def test_get_missing(self, blob: Blob) -> None:
        assert await blob.get(namespace() + "missing") is None

    @pytest.mark.parametrize("size", [0, 1, 5 * 1024 * 1024], ids=["empty", "1B", "5MB"])
    async def test_roundtrip(self, blob: Blob, size: int) -> None:
        key = namespace() + "value"
        value = os.urandom(size)
        await blob.set(key, value)
        got = await blob.get(key)
        assert type(got) is bytes
        assert got == value

    async def test_get_range(self, blob: Blob) -> None:
        key = namespace() + "value"
        value = os.urandom(100_000)
        await blob.set(key, value)
        for start, end in [
            (0, 10),
            (5, 99_999),
            (99_990, 100_000),
            (99_990, 200_000),
            (0, 100_000),
        ]:
            got = await blob.get_range(key, start, end)
            assert type(got) is bytes
            assert got == value[start:end]
        assert await blob.get_range(key, 100_000, 100_010) == b""
        assert await blob.get_range(key, 7, 7) == b""
        assert await blob.get_range(namespace() + "missing", 0, 10) is None

    async def test_overwrite(self, blob: Blob) -> None:
        key = namespace() + "value"
        await blob.set(key, b"first")
        await blob.set(key, b"second")
        assert await blob.get(key) == b"second"

    async def test_overwrite_is_atomic(self, blob: Blob) -> None:
        key = namespace() + "value"
        # Different lengths and contents, so a torn or partial read cannot equal any of them.
        values = [bytes([65 + i]) * (150_000 + 70_000 * i) for i in range(3)]
        await blob.set(key, values[0])
        writing = True
        reads = 0

        async def reader() -> None:
            nonlocal reads
            while writing:
                got = await blob.get(key)
                assert got in values, f"read a value of {None if got is None else len(got)} bytes"
                reads += 1
                await asyncio.sleep(0)

        async def writer() -> None:
            nonlocal writing
            try:
                for i in range(1, 31):
                    await blob.set(key, values[i % 3])
                    await asyncio.sleep(0)
            finally:
                writing = False

        await asyncio.gather(writer(), *(reader() for _ in range(4)))
        assert reads > 0
        assert await blob.get(key) == values[30 % 3]

    @pytest.mark.parametrize("size", [0, 1, 5 * 1024 * 1024], ids=["empty", "1B", "5MB"])
    async def test_set_new_roundtrip_and_retry(self, blob: Blob, size: int) -> None:
        ns = namespace()
        value = os.urandom(size)
        await blob.set_new(ns + "a/part", value)
        got = await blob.get(ns + "a/part")
        assert type(got) is bytes and got == value
        # A retry of the same write stores the value again (over whatever a failed try left).
        await blob.set_new(ns + "a/part", value)
        assert await blob.get(ns + "a/part") == value
        assert await blob.list_keys(ns) == [ns + "a/part"]
        with pytest.raises(InvalidUsage):
            await blob.set_new(ns + "a//b", value)

    async def test_delete_is_idempotent(self, blob: Blob) -> None:
        ns = namespace()
        await blob.delete(ns + "never-written")
        await blob.set(ns + "k", b"v")
        await blob.set(ns + "other", b"w")
        await blob.delete(ns + "k")
        assert await blob.get(ns + "k") is None
        await blob.delete(ns + "k")
        assert await blob.get(ns + "other") == b"w"
        assert await blob.list_keys(ns) == [ns + "other"]

    async def test_list_keys_prefix(self, blob: Blob) -> None:
        ns = namespace()
        names = ["a/b/c", "a/bc", "a/c", "ab", "b/x", "b/y/z/w"]
        for name in reversed(names):
            await blob.set(ns + name, name.encode())

        async def listed(prefix: str) -> list[str]:
            keys = await blob.list_keys(ns + prefix)
            assert keys == sorted(keys)
            return [k.removeprefix(ns) for k in keys]

        assert await listed("") == names
        # A prefix is a string prefix, not a path: "a/b" matches "a/b/c" and "a/bc".
        assert await listed("a/b") == ["a/b/c", "a/bc"]
        assert await listed("a/b/") == ["a/b/c"]
        assert await listed("a/") == ["a/b/c", "a/bc", "a/c"]
        assert await listed("a") == ["a/b/c", "a/bc", "a/c", "ab"]
        assert await listed("ab") == ["ab"]
        assert await listed("b/y/z/w") == ["b/y/z/w"]
        assert await listed("b/y/z/w/") == []
        assert await listed("zz") == []
        everything = await blob.list_keys("")
        assert everything == sorted(everything)
        assert {ns + n for n in names} <= set(everything)

    async def test_nothing_is_stored_under_a_key(self, blob: Blob) -> None:
        # A file blob meets the key as a file in the path: that is "no value", not a failure.
        ns = namespace()
        await blob.set(ns + "k", b"v")
        assert await blob.get(ns + "k/x") is None
        assert await blob.get_range(ns + "k/x", 0, 1) is None
        await blob.delete(ns + "k/x")
        assert await blob.list_keys(ns + "k/") == []
        assert await blob.list_sizes(ns + "k/") == {}
        assert await blob.delete_partial_writes(ns + "k/", 0.0) == 0
        assert await blob.list_keys(ns) == [ns + "k"]
        assert await blob.get(ns + "k") == b"v"

    async def test_list_sizes_agrees_with_list_keys_and_get(self, blob: Blob) -> None:
        ns = namespace()
        values = {"a/b": b"x" * 3, "a/c": b"", "ab": b"y" * 1000, "b/z": b"w"}
        for name, value in values.items():
            await blob.set(ns + name, value)
        await blob.set_new(ns + "a/new", b"n" * 17)
        values["a/new"] = b"n" * 17
        for prefix in ["", "a", "a/", "ab", "zz"]:
            sizes = await blob.list_sizes(ns + prefix)
            assert list(sizes) == await blob.list_keys(ns + prefix)
            assert sizes == {
                ns + k: len(v) for k, v in sorted(values.items()) if k.startswith(prefix)
            }
        await blob.delete(ns + "ab")
        assert ns + "ab" not in await blob.list_sizes(ns)
        assert await blob.list_sizes("../") == {}

    async def test_list_keys_impossible_prefix(self, blob: Blob) -> None:
        ns = namespace()
        await blob.set(ns + "a", b"v")
        for prefix in ["/", "../", "/" + ns, ns + "/", ns + "./", ns + "../", "\\", ".tmp-"]:
            assert await blob.list_keys(prefix) == [], prefix

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    async def test_invalid_key_rejected(self, blob: Blob, key: str) -> None:
        before = await blob.list_keys("")
        with pytest.raises(InvalidUsage):
            await blob.set(key, b"nope")
        with pytest.raises(InvalidUsage):
            await blob.get(key)
        with pytest.raises(InvalidUsage):
            await blob.delete(key)
        assert await blob.list_keys("") == before

    async def test_uri_names_where_a_value_is(self, blob: Blob) -> None:
        # A key with characters a URI must escape; persist's own keys have none.
        ns = namespace()
        keys = [ns + "a/part-00001", ns + "b/with space%and#hash?"]
        for key in keys:
            await blob.set(key, key.encode())
        uris = [blob.uri(key) for key in keys]
        if uris[0] is None:
            assert uris == [None, None], "a blob names all its keys or none"
        else:
            for key, uri in zip(keys, uris, strict=True):
                assert isinstance(uri, str)
                parts = urlsplit(uri)
                assert parts.scheme and not parts.query and not parts.fragment, uri
                assert unquote(parts.path).endswith("/" + key), uri
                if parts.scheme == "file":
                    # Another program opening the URI reads the value.
                    with open(url2pathname(parts.path), "rb") as f:
                        assert f.read() == await blob.get(key)
            assert blob.uri(ns + "never-written") is not None, "naming does not look"
        for key in INVALID_KEYS:
            with pytest.raises(InvalidUsage):
                blob.uri(key)

    async def test_cancelled_set_is_settled(self, blob: Blob) -> None:
        # When a cancelled set returns, it has landed or never will: the key's presence is what
        # a read right after the cancellation says, for good.
        ns = namespace()
        value = os.urandom(4 * 1024 * 1024)
        present_at_cancel: dict[str, bool] = {}
        for i, timeout in enumerate(CANCEL_AFTER_S):
            key = f"{ns}k{i}"
            try:
                await asyncio.wait_for(blob.set(key, value), timeout)
            except TimeoutError:
                present_at_cancel[key] = key in await blob.list_keys(key)
        assert present_at_cancel, "no set was cancelled"

        async def present() -> dict[str, bool]:
            listed = set(await blob.list_keys(ns))
            return {k: k in listed for k in present_at_cancel}

        await assert_stays(present, present_at_cancel, for_s=0.5)
        for key, there in present_at_cancel.items():
            if there:
                assert await blob.get(key) == value

    async def test_delete_partial_writes(
        self, blob: Blob, leave_partial_write: PartialWrite | None
    ) -> None:
        ns, other = namespace(), namespace()
        keys = [ns + "a/x", ns + "a/b/y", ns + "z", other + "k"]
        for key in keys:
            await blob.set(key, key.encode())
        if leave_partial_write is None:
            assert await blob.delete_partial_writes(ns, 0.0) == 0
        else:
            hour = 3600.0
            old_in_a = leave_partial_write(blob, ns + "a/x2", hour)
            old_in_ab = [leave_partial_write(blob, ns + k, hour) for k in ("a/b/y2", "a/b/c/d/e")]
            old_top = leave_partial_write(blob, ns + "top", hour)
            fresh = leave_partial_write(blob, ns + "a/b/fresh", 0.0)
            elsewhere = leave_partial_write(blob, other + "old", hour)
            # A prefix ending mid-segment: a leftover in ns/a/ may belong to a key outside it.
            assert await blob.delete_partial_writes(ns + "a/b", 600.0) == len(old_in_ab)
            assert not any(exists() for exists in old_in_ab)
            assert old_in_a() and old_top() and fresh()
            assert await blob.delete_partial_writes(ns, 600.0) == 2
            assert not old_in_a() and not old_top()
            assert fresh(), "a leftover younger than the age may be a live set's"
            assert elsewhere(), "outside the prefix"
            assert await blob.delete_partial_writes(ns, 600.0) == 0
        for key in keys:
            assert await blob.get(key) == key.encode()
        assert await blob.list_keys(ns) == sorted(k for k in keys if k.startswith(ns))
        assert await blob.delete_partial_writes("/impossible", 0.0) == 0

    @HYPOTHESIS
    @given(ops=st.lists(_blob_ops, max_size=25))
    async def test_matches_dict_model(self, blob: Blob, ops: list[tuple[Any, ...]]) -> None:
        ns = namespace()
        model: dict[str, bytes] = {}
        for op in ops:
            if op[0] == "set":
                await blob.set(ns + op[1], op[2])
                model[op[1]] = op[2]
            elif op[0] == "get":
                assert await blob.get(ns + op[1]) == model.get(op[1]), op
            elif op[0] == "delete":
                await blob.delete(ns + op[1])
                model.pop(op[1], None)
            else:
                got = await blob.list_keys(ns + op[1])
                assert got == sorted(ns + k for k in model if k.startswith(op[1])), op
