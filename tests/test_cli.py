"""The command line: ``persist demo`` and ``persist inspect``."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import pytest

from persist import cli


def test_demo_then_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loc = ["--blob", (tmp_path / "blob").as_uri(), "--consensus", f"sqlite://{tmp_path / 'c.db'}"]
    assert cli.main(["demo", *loc]) == 0
    out = capsys.readouterr().out
    assert "UpperMismatch(expected=1, current=3)" in out
    assert "user=cyd, balance=30, _time=2, _diff=1" in out
    match = re.search(r"opened shard (s[0-9a-f-]{36})", out)
    assert match
    assert cli.main(["inspect", match.group(1), *loc]) == 0
    state = json.loads(capsys.readouterr().out)
    assert (state["upper"], state["since"], state["readers"], state["writers"]) == (3, 2, 0, 0)
    # Five updates went in; compaction may since have cancelled ada's old balance (at since 2).
    assert state["rows"] in (3, 5) and state["batches"] >= 1


def test_inspect_refuses_a_bad_shard_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loc = ["--blob", (tmp_path / "blob").as_uri(), "--consensus", f"sqlite://{tmp_path / 'c.db'}"]
    assert cli.main(["inspect", "../../etc", *loc]) == 1
    assert "InvalidUsage: not a shard id" in capsys.readouterr().err


def test_connect_defaults_follow_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from persist.client import default_locations

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PERSIST_BLOB_URI", raising=False)
    monkeypatch.delenv("PERSIST_CONSENSUS_URI", raising=False)
    assert default_locations() == (
        (tmp_path / "persist-data" / "blob").as_uri(),
        f"sqlite://{tmp_path / 'persist-data' / 'consensus.db'}",
    )
    monkeypatch.setenv("PERSIST_BLOB_URI", "mem://x")
    monkeypatch.setenv("PERSIST_CONSENSUS_URI", "mem://y")
    assert default_locations() == ("mem://x", "mem://y")


def _loc(tmp_path: Path) -> list[str]:
    return ["--blob", (tmp_path / "blob").as_uri(), "--consensus", f"sqlite://{tmp_path / 'c.db'}"]


async def _named_shard(tmp_path: Path, name: str) -> str:
    import pyarrow as pa

    import persist

    blob, consensus = _loc(tmp_path)[1], _loc(tmp_path)[3]
    async with await persist.connect(blob, consensus) as client:
        sid = await client.create_shard(name, pa.schema([("k", pa.int64())]))
        write = await client.open_writer(name, purpose="loader")
        rows = {"k": [1, 2, 3], "_time": [0, 0, 1], "_diff": [1, 2, 1]}
        await write.compare_and_append(pa.table(rows), 0, 2)
        await write.expire()
        return str(sid)


async def test_a_shards_life_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    import pyarrow.parquet as pq

    sid = await _named_shard(tmp_path, "sales.orders")
    loc = _loc(tmp_path)

    async def cli_run(*argv: str) -> tuple[int, str, str]:
        # main() runs an event loop of its own: in a thread, off this test's loop.
        code = await asyncio.to_thread(cli.main, [*argv, *loc])
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = await cli_run("list")
    assert code == 0
    assert out.splitlines()[0].split() == ["name", "shard_id", "since", "upper", "rows", "bytes"]
    assert out.splitlines()[1].split()[:4] == ["sales.orders", sid, "0", "2"]
    code, out, _ = await cli_run("list", "sales.", "--json")
    assert code == 0 and json.loads(out)[0]["shard_id"] == sid
    code, out, _ = await cli_run("inspect", "sales.orders")
    assert code == 0 and json.loads(out)["shard_id"] == sid
    code, out, _ = await cli_run("history", "sales.orders")
    assert code == 0
    assert [(h["upper"], h["rows_added"], h["purpose"]) for h in json.loads(out)] == [
        (0, 0, ""),
        (2, 3, "loader"),
    ]
    code, out, _ = await cli_run(
        "export", "sales.orders", "--as-of", "0", "--to", str(tmp_path / "x0")
    )
    assert code == 0 and json.loads(out)["rows"] == 3
    assert sorted(pq.read_table(tmp_path / "x0").column("k").to_pylist()) == [1, 2, 2]
    code, out, _ = await cli_run("export", "sales.orders", "--to", str(tmp_path / "x1"))
    assert code == 0 and json.loads(out)["as_of"] == 1
    assert sorted(pq.read_table(tmp_path / "x1").column("k").to_pylist()) == [1, 2, 2, 3]
    code, _, err = await cli_run("export", "sales.orders", "--to", str(tmp_path / "x1"))
    assert code == 1 and "not empty" in err
    # By wall clock: now is as of the upper - 1; an instant before the shard was made is not.
    now = datetime.datetime.now(datetime.UTC).isoformat()
    code, out, _ = await cli_run(
        "export", "sales.orders", "--as-of", now, "--to", str(tmp_path / "x2")
    )
    assert code == 0 and json.loads(out)["as_of"] == 1 and json.loads(out)["rows"] == 4
    code, _, err = await cli_run(
        "export", "sales.orders", "--as-of", "2000-01-01T00:00:00", "--to", str(tmp_path / "x3")
    )
    assert code == 1 and "retention" in err, err
    with pytest.raises(SystemExit):
        cli.main(["export", "sales.orders", "--as-of", "yesterday", "--to", str(tmp_path / "x4")])
    assert "ISO-8601" in capsys.readouterr().err
    code, out, _ = await cli_run("retention", "sales.orders")
    assert code == 0 and json.loads(out) == {"retention_s": 86400.0}
    code, out, _ = await cli_run("retention", "sales.orders", "90")
    assert code == 0 and json.loads(out) == {"retention_s": 90.0}
    code, out, _ = await cli_run("retention", "sales.orders", "none")
    assert code == 0 and json.loads(out) == {"retention_s": None}
    code, out, _ = await cli_run("du", "sales.orders")
    assert code == 0 and json.loads(out)["total_bytes"] > json.loads(out)["live_parts_bytes"]
    code, out, err = await cli_run("purge", "sales.orders")
    assert code == 0 and json.loads(out)["since"] == 0 and "purging" in err
    code, out, _ = await cli_run("rename", "sales.orders", "sales.old_orders")
    assert code == 0
    code, out, err = await cli_run("maintain", "sales.old_orders")
    assert code == 0 and isinstance(json.loads(out), dict) and "maintaining" in err
    assert "  round: " in err  # progress, round by round
    code, _, err = await cli_run("inspect", "sales.orders")
    assert code == 1 and "InvalidUsage: no shard is named 'sales.orders'" in err
    code, out, _ = await cli_run("drop", "sales.old_orders")
    assert code == 0 and sid in out
    code, out, _ = await cli_run("list")
    assert code == 0 and out.splitlines()[1:] == []
    code, out, _ = await cli_run("inspect", sid)
    assert code == 0 and json.loads(out)["finalized"] is True


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import persist

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"persist {persist.__version__}"


async def test_drop_refused_for_live_handles_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    import pyarrow as pa

    import persist

    blob, consensus = _loc(tmp_path)[1], _loc(tmp_path)[3]
    async with await persist.connect(blob, consensus) as client:
        await client.create_shard("sales.live", pa.schema([("k", pa.int64())]))
        write = await client.open_writer("sales.live", purpose="still writing")
        code = await asyncio.to_thread(cli.main, ["drop", "sales.live", *_loc(tmp_path)])
        err = capsys.readouterr().err
        assert code == 1 and "'still writing'" in err, err
        # The command line's own flag, not the Python keyword.
        assert "--force" in err and "force=True" not in err, err
        code = await asyncio.to_thread(cli.main, ["drop", "sales.live", "--force", *_loc(tmp_path)])
        out, err = capsys.readouterr()
        assert code == 0 and out.startswith("dropped sales.live"), err
        await write.expire()


def test_export_to_a_file_or_below_one_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    sid = asyncio.run(_named_shard(tmp_path, "sales.orders"))
    a_file = tmp_path / "orders.parquet"
    a_file.write_bytes(b"mine")
    for to in (a_file, a_file / "sub"):
        assert cli.main(["export", sid, "--to", str(to), *_loc(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("persist: InvalidUsage: "), err
        assert str(to) in err and "not a directory" in err, err
    assert a_file.read_bytes() == b"mine"


async def test_erase_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    import pyarrow as pa

    import persist

    blob, consensus = _loc(tmp_path)[1], _loc(tmp_path)[3]
    schema = pa.schema([("k", pa.int64()), ("email", pa.string()), ("day", pa.date32())])
    async with await persist.connect(blob, consensus) as client:
        await client.create_shard("crm.people", schema)
        write = await client.open_writer("crm.people")
        rows = {
            "k": [1, 2, 3, 4],
            "email": ["ada@example.com", "bob@example.com", "ada@example.com", "cy=d@x"],
            "day": pa.array([0, 1, 2, 3], pa.int32()).cast(pa.date32()),
            "_time": pa.array([0, 0, 1, 1], pa.uint64()),
        }
        await write.compare_and_append(pa.table(rows), 0, 2)
        await write.expire()

    async def cli_run(*argv: str) -> tuple[int, str, str]:
        code = await asyncio.to_thread(cli.main, [*argv, *_loc(tmp_path)])
        out = capsys.readouterr()
        return code, out.out, out.err

    # Values are text cast to the column's type by Arrow; a value may hold "=".
    code, out, err = await cli_run("erase", "crm.people", "--where", "email=cy=d@x")
    assert code == 0 and json.loads(out)["rows_erased"] == 1 and "erasing" in err
    assert "cy=d" not in err  # what is erased is not written to a log
    code, out, _ = await cli_run(
        "erase", "crm.people", "--where", "email=ada@example.com", "--where", "day=1970-01-03"
    )
    assert code == 0 and json.loads(out)["rows_erased"] == 1  # both must hold: k=3 only
    code, out, _ = await cli_run("erase", "crm.people", "--where", "k=1")
    assert code == 0 and json.loads(out)["rows_erased"] == 1
    left = await asyncio.to_thread(persist.read_table, "crm.people", blob=blob, consensus=consensus)
    assert left.column("k").to_pylist() == [2]
    for where, named in (("nope=zzq", "nope"), ("_time=zzq", "_time"), ("k=zzq", "k")):
        code, _, err = await cli_run("erase", "crm.people", "--where", where)
        assert code == 1 and named in err and err.startswith("persist: InvalidUsage"), err
        assert "zzq" not in err, err
    with pytest.raises(SystemExit):
        cli.main(["erase", "crm.people", *_loc(tmp_path)])  # no --where: refused
    with pytest.raises(SystemExit):
        cli.main(["erase", "crm.people", "--where", "email", *_loc(tmp_path)])
    assert "COLUMN=VALUE" in capsys.readouterr().err


async def test_schema_prints_every_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    import pyarrow as pa

    import persist

    blob, consensus = _loc(tmp_path)[1], _loc(tmp_path)[3]
    v0 = pa.schema([pa.field("k", pa.int64(), nullable=False), ("email", pa.string())])
    v1 = pa.schema([pa.field("k", pa.int64(), nullable=False), ("mail", pa.string())])
    v2 = pa.schema([("k", pa.int64()), ("mail", pa.string()), ("score", pa.float64())])
    async with await persist.connect(blob, consensus) as client:
        sid = await client.create_shard("crm.people", v0)
        write = await client.open_writer("crm.people", purpose="loader")
        await write.append_next(pa.table({"k": [1], "email": ["ada@example.com"]}))
        assert await client.evolve_schema("crm.people", v1, renames={"email": "mail"}) == 1
        assert await client.evolve_schema("crm.people", v2) == 2
        history = await client.history("crm.people")
        await write.expire()

    async def cli_run(*argv: str) -> tuple[int, str, str]:
        code = await asyncio.to_thread(cli.main, [*argv, *_loc(tmp_path)])
        out = capsys.readouterr()
        return code, out.out, out.err

    # The times: the creation's commit, then each evolution's, as history has them.
    made = [h["at"] for h in history if h["seqno"] == 1 or h["purpose"] == "evolve schema"]
    assert len(made) == 3
    code, out, _ = await cli_run("schema", "crm.people")
    assert code == 0
    assert out.splitlines() == [
        f"version 0  made {made[0].isoformat()}",
        "  k: int64 NOT NULL",
        "  email: string",
        f"version 1  made {made[1].isoformat()}",
        "  k: int64 NOT NULL",
        "  mail: string",
        f"version 2 (current)  made {made[2].isoformat()}",
        "  k: int64",
        "  mail: string",
        "  score: double",
    ]
    code, out, _ = await cli_run("schema", str(sid), "--json")
    assert code == 0
    shown = json.loads(out)
    assert [(v["version"], v["current"]) for v in shown] == [(0, False), (1, False), (2, True)]
    assert [v["at"] for v in shown] == [str(t) for t in made]
    assert shown[2]["fields"] == [
        {"name": "k", "type": "int64", "nullable": True},
        {"name": "mail", "type": "string", "nullable": True},
        {"name": "score", "type": "double", "nullable": True},
    ]
    code, out, _ = await cli_run("inspect", "crm.people")
    assert code == 0 and json.loads(out)["schema_version"] == 2
    code, _, err = await cli_run("schema", "crm.nobody")
    assert code == 1 and "InvalidUsage: no shard is named 'crm.nobody'" in err, err


def test_schema_times_are_left_out_when_history_is_unsure() -> None:
    # History keeps one entry per granule beyond its newest commits, and nothing beyond the
    # retention: when the evolutions can't be told apart one by one, no time is guessed.
    at = [
        datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(i) for i in range(4)
    ]

    def entry(
        seqno: int, when: datetime.datetime, purpose: str, commits: int = 1
    ) -> dict[str, object]:
        return {
            "seqno": seqno,
            "at": when,
            "upper": 0,
            "rows_added": 0,
            "rows_retracted": 0,
            "purpose": purpose,
            "commits": commits,
        }

    whole = [
        entry(1, at[0], ""),
        entry(2, at[1], "evolve schema"),
        entry(3, at[2], "evolve schema"),
    ]
    assert cli._schema_times(whole, 3) == {0: at[0], 1: at[1], 2: at[2]}
    # The creation gone from history, and two evolutions kept as one entry.
    merged = [entry(7, at[1], ""), entry(9, at[2], "evolve schema", commits=2)]
    assert cli._schema_times(merged, 3) == {}
    # A writer's commit is not an evolution, whatever its purpose says.
    wrote = {**entry(4, at[3], "evolve schema"), "rows_added": 5}
    assert cli._schema_times([*whole, wrote], 3) == {0: at[0], 1: at[1], 2: at[2]}
