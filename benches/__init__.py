"""The persist benchmark suite (see ``benches/README.md``): ``python -m benches`` or
``await benches.run_all(...)`` runs the scenario modules (``SCENARIOS``: each has ``TITLE``,
``systems()`` and ``run(ctx)``, built on ``benches.harness``) and reports them
(``benches.reporting``)."""

from __future__ import annotations

import gc
import importlib
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benches.fixtures import RECOVERIES
from benches.harness import SCALES, Context
from benches.reporting.markdown import load_results, render_markdown, write_result

SCENARIOS = (
    "small_append",
    "bulk",
    "load",
    "open_shard",
    "compaction",
    "consensus",
    "scale",
    "listen",
    "evolution",
    "contention",
    "spark",
    "flight",
    "tpch",
)
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
DEFAULT_DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
DEFAULT_POSTGRES_URI = "postgresql://postgres@127.0.0.1:5432/test"
ENV_POSTGRES = "PERSIST_BENCH_POSTGRES_URI"
PROFILE_MODES = ("missed", "none")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_postgres_uri() -> str:
    return (
        os.environ.get(ENV_POSTGRES)
        or os.environ.get("PERSIST_TEST_POSTGRES_URI")
        or DEFAULT_POSTGRES_URI
    )


def titles() -> dict[str, str]:
    """Every scenario's section title on the docs page, in order."""
    return {name: importlib.import_module(f"benches.{name}").TITLE for name in SCENARIOS}


def _save(name: str, result: dict[str, Any], out: Path) -> None:
    """Draws the scenario's plots into ``out`` (``result["plots"]``, or a skip record saying why
    not), then writes its result file."""
    from benches.peers import unavailable_reason
    from benches.reporting import plots

    result["skipped"] = [s for s in result.get("skipped", []) if s["system"] != "plots"]
    plot = plots.PLOTTERS.get(name)
    reason = unavailable_reason("matplotlib") if plot else None
    if plot and not reason:
        try:
            result["plots"] = plot(result, out)
        except Exception as exc:  # a plot never loses the figures; the skip says why
            reason = f"plotting failed: {type(exc).__name__}: {exc}"
    if reason:
        result["skipped"].append({"system": "plots", "reason": reason})
    write_result(out, name, result)


def regenerate(
    out: Path | str = DEFAULT_OUT,
    docs: Path | str | None = DEFAULT_DOCS,
    redraw: bool = True,
    profile: str = "none",
    postgres_uri: str | None = None,
) -> Path | None:
    """Redraws the plots from ``<out>/*.json`` (rewriting them with the plot names; unless
    ``redraw`` is false), with ``profile="missed"`` profiles persist again for the missed
    targets they record, and, when ``docs`` is set, regenerates that page. Runs no scenario."""
    from benches.reporting.profiles import profile_missed
    from benches.reporting.report import write_docs

    out = Path(out)
    results = load_results(out, SCENARIOS)
    for name, result in results.items() if redraw else ():
        _save(name, result, out)
    if profile == "missed":
        with tempfile.TemporaryDirectory(prefix="persist-bench-profile-") as work:
            uri = postgres_uri or default_postgres_uri()
            profile_missed(results, out, uri, Path(work), _say)
    return write_docs(out, Path(docs), titles()) if docs is not None else None


async def _run_one(name: str, ctx: Context) -> dict[str, Any]:
    module = importlib.import_module(f"benches.{name}")
    # Everything alive now (modules, earlier results) is moved out of the collector's sight,
    # so the gc.collect() a scenario runs before each timed step stays cheap.
    gc.collect()
    gc.freeze()
    recovered = (RECOVERIES.count, len(RECOVERIES.events))
    t0 = time.perf_counter()
    result: dict[str, Any] = await module.run(ctx)
    result["elapsed_s"] = time.perf_counter() - t0
    if RECOVERIES.count > recovered[0]:
        n = RECOVERIES.count - recovered[0]
        result["recoveries"] = RECOVERIES.events[recovered[1] :]
        result.setdefault("notes", []).append(
            f"{n} operation(s) were retried after a lost database connection (the shared "
            "Postgres was restarted during the run); samples that timed an outage were "
            "dropped (dropped_samples) or measured again"
        )
        _say(f"[{name}] {n} operation(s) retried after a lost database connection")
    return result


async def run_all(
    scale: str = "quick",
    only: Sequence[str] | None = None,
    out: Path | str | None = DEFAULT_OUT,
    postgres_uri: str | None = None,
    workdir: Path | str | None = None,
    verbose: bool = True,
    profile: str = "missed",
    docs: Path | str | None = None,
) -> dict[str, dict[str, Any]]:
    """Runs the scenarios (all, or ``only``) at ``scale``; returns their results by name and,
    when ``out`` is set, writes ``<out>/<scenario>.json``, the scenario's PNG plots and
    ``<out>/summary-<scale>.md``; with ``profile="missed"``, profiles persist for every missed
    target (``<out>/profile-*.txt``); with ``docs``, regenerates that Markdown page from
    ``<out>``.

    Skipped systems (optional packages missing) are printed and recorded under ``skipped``.
    A scenario that fails raises after the others have run (its error is in the summary).
    """
    if profile not in PROFILE_MODES:
        raise ValueError(f"unknown profile mode {profile!r}; one of {PROFILE_MODES}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; one of {sorted(SCALES)}")
    names = list(only) if only else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; one of {list(SCENARIOS)}")
    out = Path(out) if out is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    base = Path(workdir) if workdir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="persist-bench-", dir=base))
    uri = postgres_uri or default_postgres_uri()
    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    try:
        for name in names:
            (root / name).mkdir()
            ctx = Context(SCALES[scale], uri, root / name, verbose=verbose)
            try:
                result = results[name] = await _run_one(name, ctx)
            except Exception:
                failures[name] = traceback.format_exc()
                ctx.log(f"{name} FAILED:\n{failures[name]}")
                continue
            finally:
                shutil.rmtree(root / name, ignore_errors=True)
            if out is not None:
                _save(name, result, out)
            for skip in result.get("skipped", []):
                _say(f"[{name}] SKIPPED {skip['system']}: {skip['reason']}")
            if verbose:
                print(render_markdown(result), flush=True)
        if out is not None and profile == "missed" and results:
            from benches.reporting.profiles import profile_missed

            log = (lambda msg: _say(f"[profile] {msg}")) if verbose else (lambda msg: None)
            profile_missed(results, out, uri, root, log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if out is not None and (results or failures):
        # Every scenario of this scale in <out>, so a partial re-run (--only) keeps the others.
        mds = [
            render_markdown(r)
            for n, r in load_results(out, SCENARIOS).items()
            if r.get("machine", {}).get("scale") == scale and n not in failures
        ]
        mds += [f"### {n}\n\nFAILED\n\n```text\n{tb}```\n" for n, tb in failures.items()]
        (out / f"summary-{scale}.md").write_text("\n".join(mds))
    if out is not None and docs is not None:
        from benches.reporting.report import write_docs

        written = write_docs(out, Path(docs), titles())
        if verbose and written:
            _say(f"wrote {written}")
    skipped = sorted(
        {f"{s['system']}: {s['reason']}" for r in results.values() for s in r.get("skipped", [])}
    )
    if skipped:
        _say("skipped (see each result's 'skipped'):\n  " + "\n  ".join(skipped))
    if failures:
        raise RuntimeError(
            f"scenario(s) failed: {sorted(failures)}\n" + "\n".join(failures.values())
        )
    return results
