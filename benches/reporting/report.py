"""``docs/benchmarks.md``, generated from the result files (never edited by hand).

``write_docs(results_dir, docs_path, titles)`` reads ``<results_dir>/<scenario>.json``
(whatever ran last, at whatever scale: each section says its scale and date), and writes the
page: the machine, what was skipped, one headline table of every persist figure against the best peer and
the limit, the targets (met or missed, by how much, why, and a profile of where the time goes),
then each scenario's tables and plots. Regenerate with ``python -m benches --report-only``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from benches.reporting.markdown import fmt, load_results, render_comparisons, render_markdown

# Why persist misses a target, where the reason is structural (it follows from how persist is
# built, whatever the run): (figure prefix, text in the persist system's name, explanation).
# The profile next to each miss shows where the time went in this run.
WHY: list[tuple[str, str, str]] = [
    (
        "small append p50",
        "",
        "a persist append is two durable steps back to back: the Parquet part is written and "
        "fsynced (file and directory, ~the parquet+fsync baseline), then one consensus commit "
        "(~the conditional insert); plus the state-diff encode and the part's sort/"
        "consolidate. Delta Lake and Iceberg do not fsync on a local disk, so their appends "
        "skip the most expensive step persist takes.",
    ),
    (
        "bulk write",
        "x appends",
        "each 1M-row append is one part (44 MB in memory, under part_target_bytes), so it is "
        "encoded by one thread, while background compaction merges the growing spine (decodes "
        "and re-encodes what was written so far) on the same two cores: in the py-spy profile "
        "the merge (merge_batches / _encode_output) takes a large share of the CPU during the "
        "appends, and maintain_s in the write table is the rest of that work. The plain files "
        "are written once and never rewritten.",
    ),
    (
        "bulk write",
        "",
        "persist sorts and consolidates each part by (data columns, _time) before encoding it, "
        "SHA-256s it, and stores two more columns (_time, _diff) than the plain Parquet write.",
    ),
    (
        "bulk snapshot read",
        "x appends",
        "after compaction the 10 appends are 2 parts, and a part is decoded with "
        "use_threads=False, so the read uses at most 2 threads where pyarrow.dataset decodes "
        "10 files' columns in parallel; every part is also SHA-256 checked and the parts are "
        "merged (consolidated) into one result.",
    ),
    (
        "bulk snapshot read",
        "",
        "every part is read into memory and its SHA-256 verified in Python before it is decoded "
        "(hashlib and the file read are a large share of the CPU in the py-spy profile), and "
        "the parts are merged (consolidated) into one result; pyarrow.dataset decodes straight "
        "from the files.",
    ),
    (
        "CAS ops/s",
        "",
        "persist's statement locks the head row (FOR KEY SHARE, needed against a concurrent "
        "truncate) and borrows a pooled connection for each call; the limit is one bare "
        "conditional INSERT on a dedicated connection. The breakdown rows of the consensus "
        "table show what each step adds.",
    ),
]


def why(figure: str, subject: str) -> str | None:
    return next((t for f, sub, t in WHY if figure.startswith(f) and sub in subject), None)


def _rel(from_dir: Path, target: Path) -> str:
    return os.path.relpath(target, from_dir).replace(os.sep, "/")


def _machine(results: dict[str, dict[str, Any]]) -> list[str]:
    m = max(results.values(), key=lambda r: r.get("machine", {}).get("date", ""))["machine"]
    disk, pk, git = m.get("disk", {}), m.get("packages", {}), m.get("persist_git", {})
    pg: dict[str, Any] = next(
        (r["machine"]["postgres"] for r in results.values() if r["machine"].get("postgres")), {}
    )
    rotational = {True: ", rotational", False: ", non-rotational"}.get(disk.get("rotational"), "")
    dirty = ", persist/ had local changes" if git.get("persist_dirty") else ""
    rows = {
        "CPU": f"{m.get('cpu_model', '?')}, {m.get('cpu_count')} cores "
        f"({m.get('cpu_affinity')} usable)",
        "memory": f"{m.get('memory_GB', '?')} GB",
        "disk (data written to)": f"{disk.get('device', '?')} ({disk.get('fstype', '?')}"
        f"{rotational}), mounted at {disk.get('mount', '?')}, {disk.get('size_GB', '?')} GB",
        "OS": m.get("platform", "?"),
        "load average at the end": ", ".join(f"{x:.2f}" for x in m.get("loadavg") or []),
        "Python / pyarrow / numpy": f"{m.get('python')} / {m.get('pyarrow')} / {m.get('numpy')}",
        "persist": f"{m.get('persist')} (commit {git.get('commit', '?')[:10]}{dirty})",
        "peers": f"deltalake {pk.get('deltalake', '-')}, pyiceberg {pk.get('pyiceberg', '-')} "
        f"(sqlalchemy {pk.get('sqlalchemy', '-')})",
        "Postgres": f"{pg.get('server_version', '?')} on 127.0.0.1, fsync={pg.get('fsync', '?')}, "
        f"synchronous_commit={pg.get('synchronous_commit', '?')}, "
        f"wal_sync_method={pg.get('wal_sync_method', '?')}",
        "psycopg / matplotlib / pyinstrument": f"{m.get('psycopg')} / "
        f"{pk.get('matplotlib', '-')} / {pk.get('pyinstrument', '-')}",
    }
    lines = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows.items()]
    lines += ["", "| scenario | scale | date (UTC) | took |", "|---|---|---|---:|"]
    for name, r in results.items():
        mm = r["machine"]
        lines.append(
            f"| {name} | {mm.get('scale')} | {mm.get('date')} | {fmt(r.get('elapsed_s'))} s |"
        )
    return lines


def _miss_text(c: dict[str, Any]) -> str:
    """How far a missed target (``"vs <best peer|limit> <op> <bound>"``, so a ratio was there to
    miss it) is: the factor persist must improve by."""
    target = c["target"]
    r = c["vs_best_peer"] if "best peer" in target else c["vs_limit"]
    bound = float(target.split()[-1])
    if "<=" in target:
        return (
            f"ratio {r:.3g} against a target of at most {bound:g}: persist would need to be "
            f"{r / bound:.2f}x faster ({100 * (1 - bound / r):.0f}% less time)"
        )
    return (
        f"ratio {r:.3g} against a target of at least {bound:g}: persist would need "
        f"{bound / r:.2f}x the throughput ({100 * (bound / r - 1):.0f}% more)"
    )


def _profile_excerpt(path: Path, max_lines: int = 45) -> list[str]:
    if not path.is_file():
        return []
    text = path.read_text().splitlines()
    # pyinstrument's header is decorative; start at the first line with a timing
    start = next((i for i, line in enumerate(text) if line.strip()[:1].isdigit()), 0)
    body = [line.rstrip() for line in text[start:] if line.strip()][:max_lines]
    return ["```text", *body, "```"]


def render_docs(
    results: dict[str, dict[str, Any]], results_dir: Path, docs_path: Path, titles: dict[str, str]
) -> str:
    docs_dir = docs_path.parent
    lines = [
        "# persist benchmarks",
        "",
        "<!-- Generated by benches/reporting/report.py from benches/results/*.json; do not edit "
        "by hand. Regenerate: .venv/bin/python -m benches --report-only -->",
        "",
        "persist against Delta Lake (`deltalake`) and Apache Iceberg (`pyiceberg`, SQL catalog "
        "on SQLite), and against the physical limits of this machine (plain Parquet files with "
        "fsync, a bare conditional INSERT), **measured in the same run**, interleaved, so the "
        "ratios hold on a noisy shared machine. Absolute numbers are context; the ratios are "
        "the result. Nothing here is asserted by tests.",
        "",
        "Run it: `.venv/bin/python -m benches --scale full` (peers need "
        "`pip install -e '.[bench]'`; without them they are skipped and the skip is recorded). "
        "See `benches/README.md` for what each scenario does.",
        "",
        "## Machine",
        "",
        *_machine(results),
        "",
    ]
    skipped = [(name, s) for name, r in results.items() for s in r.get("skipped", [])]
    if skipped:
        lines += ["## Skipped", ""]
        lines += [f"- {name}: **{s['system']}**: {s['reason']}" for name, s in skipped]
        lines.append("")

    comparisons = [c for r in results.values() for c in r.get("comparisons", [])]
    lines += [
        "## Headline: persist against the best peer and the limit",
        "",
        "Every figure, for every persist configuration: its value, the best peer's (the better "
        "of Delta Lake and Iceberg) and the limit's, and the ratios persist / peer and "
        "persist / limit. Notes on a row (e.g. a peer stopped early by its time budget) are "
        "in the scenario sections below.",
        "",
        *render_comparisons(comparisons),
    ]

    targeted = [c for c in comparisons if c.get("target")]
    lines += ["## Targets", ""]
    if targeted:
        lines += ["| figure | persist | target | ratio | met |", "|---|---|---|---:|---|"]
        for c in targeted:
            r = c["vs_best_peer"] if "best peer" in (c["target"] or "") else c["vs_limit"]
            lines.append(
                f"| {c['figure']} | {c['subject']} | {c['target']} | {fmt(r)} | {fmt(c['met'])} |"
            )
        lines.append("")
    others = [
        (name, r)
        for name, res in results.items()
        for r in res.get("ratios", [])
        if r.get("target") and (not res.get("comparisons") or r.get("own_target"))
    ]
    if others:
        lines += [
            "Targets of the other scenarios (their own ratios):",
            "",
            "| scenario | ratio | value | target | met |",
            "|---|---|---:|---|---|",
        ]
        for name, r in others:
            lines.append(
                f"| {name} | {r['name']} | {fmt(r['value'])} | {r['target']} | {fmt(r['met'])} |"
            )
        lines.append("")
    missed = [c for c in targeted if c.get("met") is False]
    profiles = {
        (p["figure"], p["subject"]): p for r in results.values() for p in r.get("profiles", [])
    }
    if missed:
        lines += ["### Missed targets: by how much, and why", ""]
        for c in missed:
            lines += [f"**{c['figure']}, {c['subject']}**: {_miss_text(c)}.", ""]
            reason = why(c["figure"], c["subject"])
            if reason:
                lines += [f"Why: {reason}", ""]
            prof = profiles.get((c["figure"], c["subject"]))
            if prof:
                lines += [f"Where the time goes ({prof.get('what') or prof['workload']}):", ""]
                for f in prof.get("files", []):
                    tool = "pyinstrument, event-loop thread, wall time"
                    tool = "py-spy, all threads, CPU" if f.endswith("-threads.txt") else tool
                    lines += [
                        f"- [{f}]({_rel(docs_dir, results_dir / f)}) ({tool}), top:",
                        "",
                        *_profile_excerpt(results_dir / f),
                        "",
                    ]
                for s in prof.get("skipped", []):
                    lines.append(f"- profile skipped: {s}")
                lines.append("")
    elif targeted:
        lines += ["Every target was met in this run.", ""]

    for name, r in results.items():
        lines += [f"## {titles.get(name, name)}", ""]
        for png in r.get("plots", []):
            lines += [f"![{png}]({_rel(docs_dir, results_dir / png)})", ""]
        md = render_markdown(r, comparisons=False)
        # demote the scenario's own heading under this section
        lines += ["#" + md if md.startswith("###") else md, ""]
    return "\n".join(lines).rstrip() + "\n"


def write_docs(results_dir: Path, docs_path: Path, titles: dict[str, str]) -> Path | None:
    """Writes the page from the results of the scenarios ``titles`` names (in its order)."""
    results = load_results(results_dir, list(titles))
    if not results:
        return None
    docs_path.parent.mkdir(parents=True, exist_ok=True)
    docs_path.write_text(render_docs(results, results_dir, docs_path, titles))
    return docs_path
