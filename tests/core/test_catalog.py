"""core.catalog against a plain dict model: every sequence of changes, each retried."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from persist.core import catalog as cat
from persist.errors import InvalidUsage
from persist.ids import ShardId

NAMES = ["a", "a.b", "b", "x_1.y"]
IDS = [str(ShardId.new()) for _ in range(3)]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(NAMES), st.sampled_from(IDS)),
        st.tuples(st.just("rename"), st.sampled_from(NAMES), st.sampled_from(NAMES)),
        st.tuples(st.just("remove"), st.sampled_from(IDS), st.none()),
    ),
    max_size=30,
)


@given(ops)
def test_changes_match_the_model_and_a_retry_is_a_no_op(changes: list[tuple]) -> None:
    catalog, model = cat.Catalog(), {}  # model: name -> id
    for now, (op, a, b) in enumerate(changes):
        if op == "add":
            ok = (a not in model and b not in model.values()) or model.get(a) == b
            call = lambda c, a=a, b=b, now=now: cat.add(c, a, b, now)  # noqa: E731
        elif op == "rename":
            sid = model.get(a)
            ok = sid is not None and (b not in model or model[b] == sid)
            call = lambda c, a=a, b=b, sid=sid: cat.rename(c, a, b, sid or "")  # noqa: E731
        else:
            ok = True
            call = lambda c, a=a: cat.remove(c, a)  # noqa: E731
        if not ok:
            with pytest.raises(InvalidUsage):
                call(catalog)
            continue
        new = call(catalog)
        if op == "add" and a not in model:
            model[a] = b
        elif op == "rename" and a != b and model.get(b) != model[a]:
            model[b] = model.pop(a)
        elif op == "remove":
            model = {n: i for n, i in model.items() if i != a}
        catalog = catalog if new is None else new
        assert {n: e.shard_id for n, e in catalog.names.items()} == model
        assert call(catalog) is None  # the same change again finds itself done
        ids = [e.shard_id for e in catalog.names.values()]
        assert len(ids) == len(set(ids))  # a shard has at most one name
        for name, sid in model.items():
            assert cat.lookup(catalog, name) == sid and cat.name_of(catalog, sid) == name


@pytest.mark.parametrize("name", ["a", "A_b.c9", "_x._y", "a" * 255])
def test_good_names(name: str) -> None:
    assert cat.check_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "a..b", ".a", "a.", "9a", "a-b", "a b", "ä", "a" * 256, str(ShardId.new())]
)
def test_bad_names_and_no_shard_id_is_a_name(name: str) -> None:
    assert not cat.is_name(name)
    with pytest.raises(InvalidUsage, match="not a shard name"):
        cat.check_name(name)
