"""Profiles of persist where it misses a target: where the time goes.

For every headline comparison with a target that was missed (``met`` is ``False``), the runner
profiles the matching persist operation in a fresh subprocess (``python -m
benches.reporting.profiles``), set up as in the scenario, with up to two tools:

- pyinstrument (async mode, the event loop's thread, wall time: awaits on threads, fsync and the
  database show up as ``[await]``): ``profile-<slug>.txt``;
- py-spy (when its binary is installed; every thread, CPU samples, only the profiled section:
  it attaches to the subprocess at the start of the section and stops at its end):
  ``profile-<slug>-threads.txt``, a summary of the raw stacks (inclusive and self share of the
  hottest functions, samples per thread).

Each run is bounded (``PROFILE_TIMEOUT_S``). The workloads (``workload_for``: small appends,
a bulk write or read, compare-and-sets) run on the scenarios' own adapters and say what they
profiled, which the docs page shows.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

PROFILE_TIMEOUT_S = 240.0
ROOT = Path(__file__).resolve().parents[2]

# --- which operation explains which figure -----------------------------------------------------


def workload_for(comparison: dict[str, Any], scale: Any) -> tuple[str, dict[str, Any]] | None:
    """The persist operation to profile for a missed comparison, or ``None``."""
    figure: str = comparison["figure"]
    subject: str = comparison["subject"]
    kind = "postgres" if "postgres" in subject.lower() else "sqlite"
    if figure.startswith("small append"):
        n = min(300, scale.small_appends)
        return "small_append", {"kind": kind, "n": n, "rows": scale.small_rows}
    if figure.startswith(("bulk write", "bulk snapshot read")):
        batches = scale.bulk_batches if "x appends" in subject else 1
        name = "bulk_write" if figure.startswith("bulk write") else "bulk_read"
        return name, {"batches": batches, "rows": scale.bulk_rows}
    if figure.startswith("CAS") and kind == "postgres":
        return "cas", {"n": min(3000, scale.cas_ops)}
    return None


def slug(workload: str, args: dict[str, Any]) -> str:
    h = hashlib.sha1(json.dumps(args, sort_keys=True).encode()).hexdigest()[:6]
    return f"{workload}-{h}"


# --- the workloads (run inside the subprocess) -------------------------------------------------

Marker = Callable[[], Awaitable[None]]


async def _run_workload(
    name: str, args: dict[str, Any], work: Path, uri: str, begin: Marker, end: Marker
) -> str:
    """Runs workload ``name`` on the scenario's own adapters, set up as in the scenario, between
    ``begin()`` and ``end()``; what was profiled."""
    from benches.consensus import PersistCas
    from benches.fixtures import make_updates, slices
    from benches.harness import SCALES, Context
    from benches.systems import PersistTable

    ctx = Context(SCALES["smoke"], uri, work)
    if name == "cas":
        cas = PersistCas(ctx, "postgres")
        try:
            for i in range(21):  # untimed, as the scenario's warm-up
                await cas.cas(i)
            await begin()
            for i in range(21, 21 + args["n"]):
                await cas.cas(i)
            await end()
        finally:
            await cas.close()
        return f"{args['n']} PostgresConsensus.compare_and_set on one key"
    if name not in ("small_append", "bulk_write", "bulk_read"):
        raise ValueError(f"unknown workload {name!r}")
    kind = args.get("kind", "sqlite")
    store = await PersistTable.open(ctx, "profile", kind, reader=True)
    try:
        if name == "small_append":
            n, rows = args["n"], args["rows"]
            tables = [make_updates(rows, key_start=i * rows, time=i, seed=7) for i in range(n)]
            await store.append(0, tables[0])
            await begin()
            for i in range(1, n):
                await store.append(i, tables[i])
            await end()
            return f"{n - 1} compare_and_append of {rows} rows, file blob + {kind} consensus"
        pieces = slices(make_updates(args["rows"], time=0, seed=11), args["batches"])
        if name == "bulk_write":
            await begin()
        for j, piece in enumerate(pieces):
            await store.append(j, piece)
        if name == "bulk_write":
            await end()
            return (
                f"{args['rows']:,} rows in {args['batches']} compare_and_append (background "
                "compaction runs meanwhile, as in the scenario)"
            )
        del pieces
        # As the scenario: maintenance finished, then one untimed read (warm page cache).
        await store.maintain()
        await store.read(None)
        await begin()
        got = await store.read(None)
        await end()
        assert got is not None
        return f"snapshot_and_fetch of {got.num_rows:,} rows written in {args['batches']} appends"
    finally:
        await store.close()


def _subprocess_main(spec_json: str) -> int:
    """Runs one profile (``spec``: workload, args, out, postgres, workdir, tool, py_spy) and
    prints what was profiled and its wall time as JSON."""
    spec = json.loads(spec_json)
    out, tool = Path(spec["out"]), spec["tool"]
    raw = out.with_name(f".{out.stem}.raw")  # py-spy's stacks, summarised into ``out``
    state: dict[str, Any] = {}

    async def begin() -> None:
        state["t0"] = time.perf_counter()
        if tool == "pyinstrument":
            from pyinstrument import Profiler

            state["profiler"] = Profiler(interval=0.0005, async_mode="enabled")
            state["profiler"].start()
        else:
            spy = f"{spec['py_spy']} record --format raw --rate 250 --threads --nonblocking --pid"
            state["spy"] = subprocess.Popen(
                [*spy.split(), str(os.getpid()), "-o", str(raw)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            await asyncio.sleep(0.5)  # let it attach

    async def end() -> None:
        state["wall_s"] = time.perf_counter() - state["t0"]
        if tool == "pyinstrument":
            state["profiler"].stop()
            options = {"filter_threshold": 0.01}
            out.write_text(
                state["profiler"].output_text(unicode=False, color=False, processor_options=options)
            )
        else:
            spy = state["spy"]
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()

    with tempfile.TemporaryDirectory(
        prefix="persist-profile-", dir=spec["workdir"], ignore_cleanup_errors=True
    ) as work:
        what = asyncio.run(
            _run_workload(spec["workload"], spec["args"], Path(work), spec["postgres"], begin, end)
        )
    if tool == "py-spy":
        out.write_text(summarize_raw(raw.read_text()))
        raw.unlink()
    print(json.dumps({"what": what, "wall_s": state.get("wall_s")}))
    return 0


# --- summarising py-spy's raw stacks -----------------------------------------------------------


def summarize_raw(raw: str, top: int = 25) -> str:
    """Inclusive and self shares of the hottest functions in py-spy's raw (collapsed) stacks,
    and samples per thread."""
    inclusive: collections.Counter[str] = collections.Counter()
    self_: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = stack.split(";")
        if frames and frames[0].startswith("thread ("):
            threads[frames[0]] += count
            frames = frames[1:]
        frames = [_short_frame(f) for f in frames]
        frames = [f for f in frames if not any(g in f for g in _GENERIC)]
        total += count
        for f in set(frames):
            inclusive[f] += count
        if frames:
            self_[frames[-1]] += count
    if not total:
        return "no samples\n"
    lines = [f"{total} samples (CPU, all threads; 250 Hz)"]
    for title, counter, most in (
        ("threads (share of samples):", threads, 10),
        ("inclusive (the function or anything it called was on CPU):", inclusive, top),
        ("self (the function itself was on CPU):", self_, top),
    ):
        lines += ["", title] + [
            f"  {100 * c / total:5.1f}%  {f}" for f, c in counter.most_common(most)
        ]
    return "\n".join(lines) + "\n"


# Frames every thread or the event loop has, and the bench's own (the adapters around persist):
# they say nothing about where the time goes.
_GENERIC = (
    "(threading.py)",
    "(concurrent/futures/thread.py)",
    "(runpy)",
    "(<frozen runpy>)",
    "(asyncio/runners.py)",
    "(asyncio/base_events.py)",
    "(asyncio/events.py)",
    "(benches/",
)


def _short_frame(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)" relative to site-packages / the repo
    name, _, loc = frame.partition(" (")
    loc = loc.rstrip(")")
    path = loc.rsplit(":", 1)[0]
    m = re.search(r"site-packages/(.*)$", path) or re.search(r"lib/python3\.\d+/(.*)$", path)
    if m:
        path = m.group(1)
    elif path.startswith(str(ROOT) + "/"):
        path = path[len(str(ROOT)) + 1 :]
    return f"{name} ({path})"


# --- the runner's side -------------------------------------------------------------------------


def _py_spy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    if local.exists():
        return str(local)
    return shutil.which("py-spy")


def profile_missed(
    results: dict[str, dict[str, Any]],
    out_dir: Path,
    postgres_uri: str,
    workdir: Path,
    log: Callable[[str], None],
) -> None:
    """Profiles the persist operation behind every missed target (at the scale each result
    ran at), and stores the profile records in each result under ``profiles`` (rewriting its
    file in ``out_dir``)."""
    from benches.harness import SCALES
    from benches.reporting.markdown import write_result

    done: dict[str, dict[str, Any]] = {}
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    spy = _py_spy()
    for scenario, result in results.items():
        result.pop("profiles", None)
        scale = SCALES[result.get("machine", {}).get("scale", "quick")]
        for c in result.get("comparisons", []):
            wl = workload_for(c, scale) if c.get("met") is False else None
            if wl is None:
                continue
            key = slug(*wl)
            if key not in done:
                done[key] = _profile_one(*wl, out_dir, postgres_uri, workdir, spy, log)
            record = {"figure": c["figure"], "subject": c["subject"], **done[key]}
            by_scenario.setdefault(scenario, []).append(record)
    for scenario, records in by_scenario.items():
        results[scenario]["profiles"] = records
        write_result(out_dir, scenario, results[scenario])
    # Profiles of earlier runs that no result refers to any more (the results of scenarios
    # this run left alone still refer to theirs).
    kept = {f for r in done.values() for f in r["files"]}
    for path in out_dir.glob("*.json"):
        if path.stem not in results:
            earlier = json.loads(path.read_text())
            kept |= {f for p in earlier.get("profiles", []) for f in p.get("files", [])}
    for stale in out_dir.glob("profile-*.txt"):
        if stale.name not in kept:
            stale.unlink(missing_ok=True)


def _profile_one(
    name: str,
    args: dict[str, Any],
    out_dir: Path,
    uri: str,
    workdir: Path,
    spy: str | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Profiles workload ``name`` with each tool there is into ``<out_dir>/profile-<slug>*.txt``;
    its record: the files written, the tools skipped and why, what was profiled."""
    from benches.peers import unavailable_reason

    record: dict[str, Any] = {"workload": name, "args": args, "files": [], "skipped": []}
    missing = {
        "pyinstrument": unavailable_reason("pyinstrument"),
        "py-spy": None if spy else "no py-spy binary (pip install py-spy)",
    }
    record["skipped"] += [f"{tool}: {why}" for tool, why in missing.items() if why]
    for tool in (tool for tool, why in missing.items() if not why):
        target = out_dir / f"profile-{slug(name, args)}{'-threads' if tool == 'py-spy' else ''}.txt"
        spec: dict[str, Any] = {"workload": name, "args": args, "out": str(target)}
        spec |= {"postgres": uri, "workdir": str(workdir), "tool": tool, "py_spy": spy}
        log(f"profiling {name} {args} with {tool}")
        cmd = [sys.executable, "-m", "benches.reporting.profiles", json.dumps(spec)]
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True, timeout=PROFILE_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            record["skipped"].append(f"{tool}: timed out after {PROFILE_TIMEOUT_S:g} s")
            continue
        if proc.returncode != 0:
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            record["skipped"].append(f"{tool}: failed ({' | '.join(tail)})")
            continue
        meta = json.loads(proc.stdout.strip().splitlines()[-1])
        record["files"].append(target.name)
        record["what"] = meta["what"]
        record.setdefault("wall_s", meta["wall_s"])
    return record


if __name__ == "__main__":
    sys.exit(_subprocess_main(sys.argv[1]))
