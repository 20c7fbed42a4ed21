"""The command line: ``persist demo`` and ``persist inspect``."""

from __future__ import annotations

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
