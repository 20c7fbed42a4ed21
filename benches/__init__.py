"""The persist benchmark suite.

Run it with ``python -m benches [--scale smoke|quick|full] [--only NAME ...] [--out DIR]``, or
from Python with ``await benches.run_all(...)`` / ``benches.main([...])``. Each scenario module
(``small_append``, ``bulk``, ``open_shard``, ``compaction``, ``consensus``, ``scale``) has ``systems()`` (what it
measures: persist, plain baselines, and peers: Delta Lake and Iceberg, see ``benches.peers``)
and ``run(ctx)`` returning a dict of figures; the runner prints each as Markdown and writes
``<out>/<scenario>.json`` and its PNG plots (``benches.plots``), profiles persist where it misses
a target (``benches.profiles``), and can regenerate ``docs/benchmarks.md``
(``benches.report``). Systems whose optional packages are missing are skipped, and every skip
is printed and recorded in the result (``skipped``).
"""

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

from benches._common import (
    DEFAULT_POSTGRES_URI,
    ENV_POSTGRES,
    RECOVERIES,
    SCALES,
    Context,
    render_markdown,
    write_result,
)

SCENARIOS = ("small_append", "bulk", "open_shard", "compaction", "consensus", "scale")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
DEFAULT_DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
PROFILE_MODES = ("missed", "none")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _plots(name: str, result: dict[str, Any], out: Path) -> None:
    """Draws the scenario's plots into ``out`` (``result["plots"]``), or records why not."""
    from benches import plots
    from benches.peers import unavailable_reason

    if name not in plots.PLOTTERS:
        return
    reason = unavailable_reason("matplotlib")
    if reason is None:
        try:
            result["plots"] = plots.PLOTTERS[name](result, out)
            return
        except Exception as exc:  # a plot never loses the figures; the skip says why
            reason = f"plotting failed: {type(exc).__name__}: {exc}"
    result.setdefault("skipped", []).append({"system": "plots", "reason": reason})


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
    from benches.report import load_results, write_docs

    out = Path(out)
    results = load_results(out, list(SCENARIOS))
    for name, result in results.items() if redraw else ():
        result["skipped"] = [s for s in result.get("skipped", []) if s["system"] != "plots"]
        _plots(name, result, out)
        write_result(out, name, result)
    if profile == "missed":
        from benches.profiles import profile_missed

        with tempfile.TemporaryDirectory(prefix="persist-bench-profile-") as work:
            for name in profile_missed(
                results, out, postgres_uri or default_postgres_uri(), Path(work), _say
            ):
                write_result(out, name, results[name])
    return write_docs(out, Path(docs), list(SCENARIOS)) if docs is not None else None


def default_postgres_uri() -> str:
    return (
        os.environ.get(ENV_POSTGRES)
        or os.environ.get("PERSIST_TEST_POSTGRES_URI")
        or DEFAULT_POSTGRES_URI
    )


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
    base = Path(workdir) if workdir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="persist-bench-", dir=base))
    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    markdown: list[str] = []
    try:
        for name in names:
            module = importlib.import_module(f"benches.{name}")
            scenario_dir = root / name
            scenario_dir.mkdir()
            ctx = Context(
                scale=SCALES[scale],
                postgres_uri=postgres_uri or default_postgres_uri(),
                workdir=scenario_dir,
                verbose=verbose,
            )
            # Everything alive now (modules, earlier results) is moved out of the collector's
            # sight, so the gc.collect() a scenario runs before each timed step stays cheap.
            gc.collect()
            gc.freeze()
            recovered = (RECOVERIES.count, len(RECOVERIES.events))
            t0 = time.perf_counter()
            try:
                result = await module.run(ctx)
            except Exception:
                failures[name] = traceback.format_exc()
                ctx.log(f"{name} FAILED:\n{failures[name]}")
                markdown.append(f"### {name}\n\nFAILED\n\n```\n{failures[name]}```\n")
                continue
            finally:
                shutil.rmtree(scenario_dir, ignore_errors=True)
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
            results[name] = result
            for skip in result.get("skipped", []):
                _say(f"[{name}] SKIPPED {skip['system']}: {skip['reason']}")
            if out is not None:
                Path(out).mkdir(parents=True, exist_ok=True)
                _plots(name, result, Path(out))
                for skip in result.get("skipped", []):
                    if skip["system"] == "plots":
                        _say(f"[{name}] SKIPPED plots: {skip['reason']}")
                write_result(Path(out), name, result)
            md = render_markdown(result)
            markdown.append(md)
            if verbose:
                print(md, flush=True)
        if out is not None and profile == "missed" and results:
            from benches.profiles import profile_missed

            profiled = profile_missed(
                results,
                Path(out),
                postgres_uri or default_postgres_uri(),
                root,
                lambda msg: _say(f"[profile] {msg}") if verbose else None,
            )
            for name in profiled:
                write_result(Path(out), name, results[name])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if out is not None and markdown:
        # Every scenario of this scale in <out>, so a partial re-run (--only) keeps the others.
        from benches.report import load_results

        kept = {
            n: r
            for n, r in load_results(Path(out), list(SCENARIOS)).items()
            if r.get("machine", {}).get("scale") == scale and n not in failures
        }
        mds = [render_markdown(r) for r in kept.values()]
        mds += [m for m in markdown if m.startswith("### ") and "\n\nFAILED\n" in m]
        (Path(out) / f"summary-{scale}.md").write_text("\n".join(mds))
    if out is not None and docs is not None:
        from benches.report import write_docs

        written = write_docs(Path(out), Path(docs), list(SCENARIOS))
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
