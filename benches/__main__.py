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
    PROFILE_MODES,
    SCENARIOS,
    default_postgres_uri,
    regenerate,
    run_all,
)
from benches._common import SCALES


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benches", description=__doc__)
    parser.add_argument("--scale", choices=sorted(SCALES), default="quick")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SCENARIOS,
        metavar="NAME",
        help=f"run only these scenarios (of {', '.join(SCENARIOS)})",
    )
    parser.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        help="directory for <scenario>.json and summary-<scale>.md",
    )
    parser.add_argument(
        "--postgres",
        default=None,
        help=f"Postgres URI (default: $PERSIST_BENCH_POSTGRES_URI or {default_postgres_uri()})",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="where data is written (default: the system temp dir); the disk under test",
    )
    parser.add_argument(
        "--profile",
        choices=PROFILE_MODES,
        default=None,
        help="profile persist where it misses a target (pyinstrument, and py-spy if installed); "
        "default: missed when running, none with --report-only",
    )
    parser.add_argument(
        "--docs",
        default=None,
        help=f"regenerate this Markdown page from --out (default: {DEFAULT_DOCS.name} after a "
        "full-scale run into the default --out)",
    )
    parser.add_argument("--no-docs", action="store_true", help="never write the docs page")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: redraw plots and regenerate the docs page from --out's JSON files",
    )
    parser.add_argument("-q", "--quiet", action="store_true")
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
