"""``python -m benches [--scale smoke|quick|full] [--only NAME ...] [--out DIR]``: runs the
scenarios for persist, its peers (Delta Lake, Iceberg; skipped with a printed reason when the
bench extra is missing) and the baselines; writes JSON, Markdown, PNG plots, profiles of missed
targets, and (full scale into the default results directory, or with ``--docs``)
docs/benchmarks.md. ``--report-only`` redraws the plots and the page from the JSON files."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from benches import (
    DEFAULT_DOCS,
    DEFAULT_OUT,
    ENV_POSTGRES,
    PROFILE_MODES,
    SCENARIOS,
    default_postgres_uri,
    regenerate,
    run_all,
)
from benches.harness import SCALES


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benches", description=__doc__)
    add = parser.add_argument
    add("--scale", choices=sorted(SCALES), default="quick")
    add(
        "--only",
        nargs="+",
        choices=SCENARIOS,
        metavar="NAME",
        help=f"run only these, of {', '.join(SCENARIOS)}",
    )
    add("--out", default=str(DEFAULT_OUT), help="for <scenario>.json and summary-<scale>.md")
    add("--postgres", help=f"default: ${ENV_POSTGRES} or {default_postgres_uri()}")
    add("--workdir", help="where data is written (the disk under test; default: the temp dir)")
    add(
        "--profile",
        choices=PROFILE_MODES,
        help="profile persist where it misses a target (pyinstrument, and py-spy if installed); "
        "default: missed when running, none with --report-only",
    )
    add(
        "--docs",
        help=f"regenerate this Markdown page from --out (default: {DEFAULT_DOCS.name} after a "
        "full-scale run into the default --out)",
    )
    add("--no-docs", action="store_true", help="never write the docs page")
    add(
        "--report-only",
        action="store_true",
        help="run nothing: redraw plots and regenerate the docs page from --out's JSON files",
    )
    add("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    docs = args.docs
    default_out = os.path.abspath(args.out) == os.path.abspath(DEFAULT_OUT)
    if docs is None and default_out and (args.report_only or args.scale == "full"):
        docs = str(DEFAULT_DOCS)
    if args.no_docs:
        docs = None
    if args.report_only:
        written = regenerate(
            args.out, docs, profile=args.profile or "none", postgres_uri=args.postgres
        )
        print(f"plots redrawn in {args.out}" + (f"; wrote {written}" if written else ""))
        return 0
    try:
        asyncio.run(
            run_all(
                scale=args.scale,
                only=args.only,
                out=args.out,
                postgres_uri=args.postgres,
                workdir=args.workdir,
                verbose=not args.quiet,
                profile=args.profile or "missed",
                docs=docs,
            )
        )
    except RuntimeError as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
