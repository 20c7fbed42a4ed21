"""The benchmark suite runs end to end at its smoke scale (tiny counts) and produces figures.

Only that figures exist and are positive numbers, and that the result files, plots and the docs
page get written, is checked here: timings are never asserted (the machine is shared and
noisy). Uses the real Postgres of the location tests and FAILS (never skips) when it is
unreachable.

The peers (Delta Lake, Iceberg) and matplotlib are an optional extra (``.[bench]``). Nothing
here skips when they are missing: each check asserts either the peer's figures (importable) or
the runner's skip record naming it and why (not importable), so CI with only ``.[test]``
exercises the skip path and a developer with the extra exercises the peers.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `benches` lives next to `persist`, outside the installed package
    sys.path.insert(0, str(ROOT))

from benches import SCENARIOS, bulk, contention, regenerate, run_all, small_append  # noqa: E402
from benches import scale as scale_scenario  # noqa: E402
from benches.harness import SCALES, SUBJECT, System, select_systems  # noqa: E402
from benches.peers import DELTA_NAME, ICEBERG_NAME, unavailable_reason  # noqa: E402
from benches.reporting.markdown import render_markdown  # noqa: E402

Results = tuple[dict[str, dict[str, Any]], Path, Path]


def _numbers(figures: dict[str, Any]) -> dict[str, float]:
    return {
        k: v for k, v in figures.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _check_positive(where: str, figures: dict[str, Any], required: list[str]) -> None:
    for key in required:
        assert key in figures, f"{where}: figure {key!r} missing from {sorted(figures)}"
    for key, value in _numbers(figures).items():
        assert math.isfinite(value), f"{where}: {key} = {value}"
        if key in required:
            assert value > 0, f"{where}: {key} = {value} is not positive"


def _peer_systems(result: dict[str, Any], module: Any) -> list[System]:
    return [s for s in module.systems() if s.requires]


def _check_peers(result: dict[str, Any], table: dict[str, Any], peers: list[System]) -> None:
    """Each peer system either has a row (its packages import) or a skip record saying why."""
    skipped = {s["system"]: s["reason"] for s in result["skipped"]}
    assert peers, "the scenario lists no peer systems"
    for peer in peers:
        reasons = [r for r in (unavailable_reason(p) for p in peer.requires) if r]
        if reasons:
            assert peer.name in skipped, f"{peer.name} is not importable but no skip was recorded"
            assert skipped[peer.name] == "; ".join(reasons)
            assert peer.name not in table
        else:
            assert peer.name not in skipped, f"{peer.name} skipped: {skipped[peer.name]}"
            assert peer.name in table, f"{peer.name} missing from {sorted(table)}"


@pytest.fixture(scope="module")
def smoke_results(postgres_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("bench-results")
    work = tmp_path_factory.mktemp("bench-work")
    docs = tmp_path_factory.mktemp("bench-docs") / "benchmarks.md"
    results = asyncio.run(
        run_all(
            scale="smoke",
            out=out,
            postgres_uri=postgres_uri,
            workdir=work,
            verbose=False,
            profile="none",
            docs=docs,
        )
    )
    return results, out, docs


def test_every_scenario_ran_and_wrote_its_file(smoke_results: Results) -> None:
    results, out, _ = smoke_results
    assert sorted(results) == sorted(SCENARIOS)
    for name in SCENARIOS:
        path = out / f"{name}.json"
        assert path.is_file(), f"{path} was not written"
        data = json.loads(path.read_text())
        assert data["scenario"] == name
        machine = data["machine"]
        assert machine["scale"] == "smoke"
        assert machine["cpu_count"] > 0
        for key in ("python", "pyarrow", "date", "disk", "packages"):
            assert machine[key]
        assert render_markdown(data).startswith(f"### {name}")
    summary = out / "summary-smoke.md"
    assert summary.is_file() and "| system |" in summary.read_text()


def test_plots_were_drawn_or_the_skip_recorded(smoke_results: Results) -> None:
    results, out, _ = smoke_results
    reason = unavailable_reason("matplotlib")
    for name in ("small_append", "bulk", "consensus", "scale", "contention"):
        result = results[name]
        skipped = {s["system"]: s["reason"] for s in result["skipped"]}
        if reason is None:
            assert "plots" not in skipped, skipped.get("plots")
            assert result["plots"], f"{name}: no plot drawn"
            for png in result["plots"]:
                data = (out / png).read_bytes()
                assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
        else:
            assert skipped["plots"] == reason


def test_comparisons_are_well_formed(smoke_results: Results) -> None:
    results = smoke_results[0]
    targets = set()
    for name, result in results.items():
        for c in result.get("comparisons", []):
            where = f"{name}: {c['figure']} ({c['subject']})"
            assert c["better"] in ("lower", "higher"), where
            assert c["value"] is not None and c["value"] > 0, where
            for key in ("vs_best_peer", "vs_limit"):
                assert c[key] is None or (math.isfinite(c[key]) and c[key] > 0), where
            if c["best_peer"] is not None:
                assert c["best_peer"] in c["peers"], where
            if c["target"]:
                targets.add(c["figure"])
                assert c["met"] in (True, False, None), where
    assert {"small append p50", "bulk write rows/s", "bulk snapshot read rows/s", "CAS ops/s"} <= (
        targets
    )


def test_small_append_figures(smoke_results: Results) -> None:
    result = smoke_results[0]["small_append"]
    systems = result["tables"][""]
    assert {
        "persist[file+postgres]",
        "persist[file+sqlite]",
        "parquet+fsync",
        "pg conditional insert",
    } <= set(systems)
    for name, figures in systems.items():
        _check_positive(name, figures, ["p50_ms", "p99_ms", "appends_per_s", "flatness"])
    limits = {r["name"]: r["value"] for r in result["ratios"]}
    assert limits["persist[file+postgres] vs limit"] > 0
    assert limits["persist[file+sqlite] vs limit"] > 0
    reads = result["tables"]["reads after the appends (warm page cache)"]
    for name in ("persist[file+postgres]", "persist[file+sqlite]", "parquet+fsync"):
        _check_positive(
            f"read {name}", reads[name], ["snapshot_rows_per_s", "time_travel_rows_per_s"]
        )
    _check_peers(result, systems, _peer_systems(result, small_append))
    for peer in (DELTA_NAME, ICEBERG_NAME):
        if peer in systems:
            _check_positive(peer, systems[peer], ["p50_ms", "appends_per_s"])
            _check_positive(f"read {peer}", reads[peer], ["snapshot_rows_per_s"])


def test_bulk_figures(smoke_results: Results) -> None:
    result = smoke_results[0]["bulk"]
    write, read = result["tables"]["write"], result["tables"]["read (warm page cache)"]
    old = next(v for k, v in result["tables"].items() if k.startswith("time-travel"))
    assert {"persist[file+sqlite]", "parquet", "parquet 10x files"} <= set(write)
    assert set(write) == set(read)
    for name, figures in write.items():
        _check_positive(f"write {name}", figures, ["write_s", "rows_per_s", "MB_per_s"])
    for name, figures in read.items():
        _check_positive(f"read {name}", figures, ["read_s", "rows_per_s", "MB_per_s"])
    for name, figures in old.items():
        _check_positive(f"time travel {name}", figures, ["rows", "rows_per_s"])
    assert "persist[file+sqlite] 10x appends" in old and "parquet 10x files" in old
    assert write["persist[file+sqlite]"]["parts"] >= 1
    targeted = [r for r in result["ratios"] if r["target"]]
    assert len(targeted) == 5 and all(r["value"] > 0 for r in targeted)
    size = next(r for r in targeted if "bytes on disk" in r["name"])
    assert size["target"] == "<= 1.1"
    _check_peers(result, write, _peer_systems(result, bulk))


def test_open_shard_figures(smoke_results: Results) -> None:
    result = smoke_results[0]["open_shard"]
    history = result["tables"]["history"]["persist[file+postgres]"]
    _check_positive("history", history, ["batches", "build_s", "rollup_bytes", "seqno"])
    assert history["batches"] == SCALES["smoke"].open_batches
    opens = result["tables"]["open from a fresh client"]
    _check_positive(
        "persist open",
        opens["persist[file+postgres]"],
        ["open_p50_ms", "inspect_p50_ms", "inspect_warm_p50_ms", "blob_gets", "diffs_read"],
    )
    _check_positive("floor", opens["raw read floor"], ["open_p50_ms", "diffs_read"])


def test_consensus_figures(smoke_results: Results) -> None:
    result = smoke_results[0]["consensus"]
    rows = result["tables"][""]
    assert {
        "persist PostgresConsensus",
        "persist SqliteConsensus",
        "pg conditional insert",
        "sqlite conditional insert",
    } <= set(rows)
    for name, figures in rows.items():
        _check_positive(name, figures, ["p50_ms", "p99_ms", "ops_per_s"])
        assert figures["ops"] == SCALES["smoke"].cas_ops
    assert len(result["samples_ms"]["persist PostgresConsensus"]) == SCALES["smoke"].cas_ops


def test_scale_figures(smoke_results: Results) -> None:
    result = smoke_results[0]["scale"]
    scale = SCALES["smoke"]
    curves, writers = result["curves"], result["writers"]
    for name in ("persist[file+postgres]", "persist[file+sqlite]"):
        assert curves[name][-1]["batches"] == scale.scale_batches
        for point in curves[name]:
            _check_positive(f"{name} growth", point, ["append_p50_ms", "open_ms"])
        assert [p["writers"] for p in writers[name]] == list(scale.scale_writers)
        for point in writers[name]:
            _check_positive(f"{name} writers", point, ["appends_per_s", "append_p50_ms"])
            assert point["complete"]
    growth = next(v for k, v in result["tables"].items() if k.startswith("growth"))
    _check_peers(result, growth, _peer_systems(result, scale_scenario))


def test_listen_figures(smoke_results: Results) -> None:
    result = smoke_results[0]["listen"]
    table = result["tables"][""]
    timed = ["write_to_listen_p50_ms", "append_p50_ms"]
    for name in ("persist file+postgres", "persist file+sqlite", "persist file+postgres, polled"):
        _check_positive(name, table[name], timed)
        # 0 when the local listener held the event before the append returned.
        assert table[name]["in_process_after_commit_p50_ms"] >= 0
        assert table[name]["appends"] == SCALES["smoke"].small_appends
    for name in ("persist file+postgres", "persist file+sqlite"):
        assert table[name]["idle_consensus_calls_per_s"] >= 0


def test_contention_figures(smoke_results: Results) -> None:
    result = smoke_results[0]["contention"]
    rows, writers = result["tables"][""], SCALES["smoke"].contention_writers
    for system in [s.name for s in contention.systems()]:
        assert [p["writers"] for p in result["points"][system]] == list(writers)
        for n in writers:
            row = rows[contention.row_name(system, n)]
            _check_positive(f"{system}, {n}", row, ["commits_per_s", "commits", "wall_s"])
            assert 0 <= row["min_commits_per_writer"] <= row["max_commits_per_writer"]
            if "recoveries" not in result:  # else a retried commit may have landed uncounted
                assert row["stored_commits"] == row["commits"]
    one = result["tables"]["handles of one client (one process), append_next on one shard"]
    for system in [s.name for s in contention.systems() if s.role == SUBJECT]:
        for n in sorted({1, *writers}):
            row = one[contention.row_name(system, n)]
            _check_positive(f"{system}, {n} of one client", row, ["appends_per_s", "appends"])
            assert row["min_appends_per_handle"] > 0  # no handle starved
            if "recoveries" not in result:
                assert row["stored_commits"] == row["appends"]  # each landed once
    assert result["ratios"] and all(r["target"] is None for r in result["ratios"])


def test_flight_figures(smoke_results: Results) -> None:
    from benches import flight

    result = smoke_results[0]["flight"]
    tables = result["tables"]
    for name in (flight.PERSIST, flight.BARE, flight.INPROC):
        _check_positive(f"doget {name}", tables["doget"][name], ["rows_per_s", "seconds"])
    for name in (flight.PERSIST, flight.INPROC):
        _check_positive(f"doput {name}", tables["doput"][name], ["p50_ms", "p99_ms"])
    _check_positive(
        "streaming",
        tables["streaming"][flight.PERSIST],
        ["pipelined_writes_per_s", "memory_p99_ms", "committed_p99_ms", "paced_writes"],
    )
    _check_positive("bare echo", tables["streaming"][flight.BARE], ["pipelined_writes_per_s"])
    assert {r["name"] for r in result["ratios"] if r["target"]} >= {
        "DoGet of 4 endpoints vs bare Flight from memory",
        "MEMORY ack p99 at 1,000 writes/s offered (ms)",
    }


def _result_of(
    name: str,
    request: pytest.FixtureRequest,
    postgres_uri: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """Scenario ``name``'s result: from the run of every scenario when this session runs it
    anyway, else from a run of that scenario alone (``-k <name>``)."""
    if any("smoke_results" in item.fixturenames for item in request.session.items):
        results: dict[str, dict[str, Any]] = request.getfixturevalue("smoke_results")[0]
        return results[name]
    out = tmp_path_factory.mktemp(f"bench-{name}-results")
    work = tmp_path_factory.mktemp(f"bench-{name}-work")
    only = asyncio.run(
        run_all(
            scale="smoke",
            only=[name],
            out=out,
            postgres_uri=postgres_uri,
            workdir=work,
            verbose=False,
            profile="none",
        )
    )
    assert (out / f"{name}.json").is_file()
    return only[name]


@pytest.fixture(scope="module")
def tpch_result(
    request: pytest.FixtureRequest, postgres_uri: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    return _result_of("tpch", request, postgres_uri, tmp_path_factory)


@pytest.fixture(scope="module")
def evolution_result(
    request: pytest.FixtureRequest, postgres_uri: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    return _result_of("evolution", request, postgres_uri, tmp_path_factory)


def test_evolution_figures(evolution_result: dict[str, Any]) -> None:
    from benches import evolution

    result = evolution_result
    table = result["tables"]["read (warm page cache)"]
    assert set(table) == {evolution.ONE, evolution.THREE}
    rows = evolution.COUNTS["smoke"][0]
    for name, figures in table.items():
        _check_positive(
            name,
            figures,
            [f"{kind}_{m}" for kind in evolution.READS for m in ("s", "rows_per_s", "cpu_s")]
            + ["rows", "repeats", "parts"],
        )
        assert figures["rows"] == rows
    # The subject really holds parts of three versions (compaction off), the baseline of one.
    assert table[evolution.THREE]["parts_by_version"].keys() == {"0", "1", "2"}
    assert table[evolution.THREE]["schema_version"] == 2
    assert table[evolution.ONE]["parts_by_version"].keys() == {"0"}
    ratios = {r["name"]: r for r in result["ratios"]}
    for kind in evolution.READS:
        r = ratios[f"{evolution.THREE} {kind} time vs {evolution.ONE}"]
        assert r["value"] > 0 and r["target"] == "<= 1.2" and r["own_target"]
        assert ratios[f"{evolution.THREE} {kind} CPU time vs {evolution.ONE}"]["value"] > 0


def test_tpch_figures(tpch_result: dict[str, Any]) -> None:
    from benches import tpch

    result = tpch_result
    skipped = {s["system"]: s["reason"] for s in result["skipped"]}
    # tpchgen-cli is in the test extra: without it the data, and so this check, would be missing.
    assert tpch.generator() is not None and not skipped, skipped
    every = [q.name for q in tpch.queries(SCALES["smoke"].tpch_scale_factor)]
    assert {"Q1", "Q3", "Q5", "Q6", "Q10", "Q12", "Q14", "Q19"} <= set(every)
    names = list(SCALES["smoke"].tpch_queries)
    assert set(names) <= set(every) and result["params"]["queries"] == names
    times = next(v for k, v in result["tables"].items() if k.startswith("query time"))
    persisted = [tpch.NATIVE, tpch.VERIFIED, tpch.BARE]
    for system in (tpch.PARQUET, *persisted):
        _check_positive(system, times[system], [f"{q}_s" for q in names] + ["geomean_s"])
    for q in names:
        assert result["checks"][q]["rows"] > 0, q
        for system in persisted:
            assert result["checks"][q][system] == "equal", (q, system)
    ratios = {r["name"]: r for r in result["ratios"]}
    native = ratios[f"persist native vs parquet, geometric mean over {len(names)} queries"]
    assert native["value"] > 0 and native["target"] == ">= 0.8"
    verified = ratios[f"persist verified vs parquet, geometric mean over {len(names)} queries"]
    assert verified["value"] > 0 and verified["target"] == ">= 0.5"
    ceiling = f"bare Python source vs parquet, geometric mean over {len(names)} queries"
    assert ratios[ceiling + " (the ceiling of any Python source)"]["value"] > 0
    assert ratios["persist verified vs the bare Python source, geometric mean"]["value"] > 0
    write = ratios['Spark write of lineitem, df.write.format("persist") vs df.write.parquet']
    assert write["value"] > 0 and write["target"] == ">= 0.9"
    writes = next(v for k, v in result["tables"].items() if k.startswith("lineitem written"))
    assert writes[tpch.VERIFIED]["parts"] >= 1 and writes[tpch.PARQUET]["files"] >= 1
    for q in ("Q1", "Q6"):  # the smoke scale runs both
        fresh = ratios[f"native read right after the Spark write vs parquet's files, {q}"]
        assert fresh["value"] > 0 and fresh["target"] == ">= 0.9"


def test_tpch_answer_check() -> None:
    """What makes a persist answer differ from the Parquet one (the scenario then fails)."""
    from decimal import Decimal

    from benches.tpch import Query, _mismatch

    want = (["k:bigint", "v:decimal(15,2)"], [(1, Decimal("1.10")), (2, Decimal("2.00"))])
    swapped = (want[0], want[1][::-1])
    assert _mismatch(Query("Q", "", ordered=False), want, swapped) is None
    assert _mismatch(Query("Q", "", ordered=True), want, swapped) is not None
    off = (want[0], [(1, Decimal("1.10")), (2, Decimal("2.01"))])
    assert _mismatch(Query("Q", "", ordered=True), want, off) is not None
    typed = (["k:int", "v:decimal(15,2)"], want[1])
    assert _mismatch(Query("Q", "", ordered=True), want, typed) is not None
    assert _mismatch(Query("Q", "", ordered=True), want, (want[0], want[1][:1])) is not None


def test_docs_page_was_generated(smoke_results: Results) -> None:
    results, out, docs = smoke_results
    text = docs.read_text()
    for heading in ("## Machine", "## Headline", "## Targets", "## Consensus"):
        assert heading in text
    assert "| figure | persist | value | best peer |" in text
    for result in results.values():
        for png in result.get("plots", []):
            assert f"{png}](" in text, f"{png} is not embedded"
    # regenerating from the JSON files alone gives the same page
    again = regenerate(out, docs.parent / "again.md", redraw=False)
    assert again is not None and again.read_text().count("|") == text.count("|")


def test_a_missing_peer_is_recorded_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The skip path, whatever is installed here: a peer whose package is missing is reported
    with the reason and never made."""
    import benches.peers

    def missing(name: str) -> str | None:
        return f"{name} is not importable (simulated)" if name != "matplotlib" else None

    monkeypatch.setattr(benches.peers, "unavailable_reason", missing)
    chosen, skipped = select_systems(small_append.systems())
    names = {s.name for s in chosen}
    assert {DELTA_NAME, ICEBERG_NAME}.isdisjoint(names)
    assert "persist[file+postgres]" in names
    assert {s["system"]: s["reason"] for s in skipped} == {
        DELTA_NAME: "deltalake is not importable (simulated)",
        ICEBERG_NAME: "pyiceberg is not importable (simulated)",
    }


def test_profile_of_a_missed_target(postgres_uri: str, tmp_path: Path) -> None:
    """The profiler behind missed targets runs (a tiny CAS workload) or says why it can't."""
    from benches.reporting.profiles import _profile_one, _py_spy, slug

    record = _profile_one("cas", {"n": 20}, tmp_path, postgres_uri, tmp_path)
    if unavailable_reason("pyinstrument") is None:
        profile = f"profile-{slug('cas', {'n': 20})}.txt"
        assert record["files"] == [profile], record
        assert "compare_and_set" in (tmp_path / profile).read_text()
    else:
        assert any(s.startswith("pyinstrument:") for s in record["skipped"])
    assert any(s.startswith("py-spy:") for s in record["skipped"])  # not asked for here
    assert _py_spy() is None or Path(_py_spy() or "").exists()
