"""PNG plots of the results (matplotlib, Agg backend), written next to the JSON files.

``write_plots(results, out_dir)`` draws whatever the results hold and returns the file names it
wrote; each scenario gets its own functions, and a scenario that did not run draws nothing.
matplotlib is part of the bench extra: without it no plot is drawn and the runner records the
skip (``benches.peers.unavailable_reason("matplotlib")``).

- ``small_append_latency.png``: the distribution of per-append latency (ECDF, log scale) and the
  latency along the run (rolling median: does it grow with the table?);
- ``small_append_reads.png``, ``bulk_throughput.png``: throughput bars (rows/s) of writes,
  snapshot reads and time-travel reads;
- ``consensus_latency.png``: compare-and-set latency distributions;
- ``scale_growth.png``: append latency and open time as the table grows;
- ``scale_writers.png``: aggregate appends/s with N concurrent writers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROLE_STYLE = {"subject": "-", "peer": "--", "baseline": ":"}
_PALETTE = {
    "persist": ["#1f4e9c", "#4a90d9", "#0b2a5c", "#7fb2e8"],
    "delta": ["#e07b00"],
    "iceberg": ["#2a9d3a"],
    "other": ["#555555", "#999999", "#b0413e", "#8e44ad", "#333333", "#c49a00"],
}


def _colors(names: list[str]) -> dict[str, str]:
    used: dict[str, int] = {}
    out: dict[str, str] = {}
    for name in names:
        low = name.lower()
        fam = next((f for f in ("persist", "delta", "iceberg") if f in low), "other")
        pal = _PALETTE[fam]
        out[name] = pal[used.get(fam, 0) % len(pal)]
        used[fam] = used.get(fam, 0) + 1
    return out


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _plain_log(axis: Any) -> None:
    """Log-scale ticks at 1, 2, 5 x 10^k labelled as plain numbers (not 10^k)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: _short(v)))
    axis.set_minor_formatter(NullFormatter())


def _plain(axis: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _pos: _short(v)))


def _title(result: dict[str, Any], what: str) -> str:
    m = result.get("machine", {})
    return f"{what}  ({m.get('scale', '?')} scale, {m.get('date', '')[:10]})"


def _roles(result: dict[str, Any]) -> dict[str, str]:
    roles: dict[str, str] = {}
    for table in result.get("tables", {}).values():
        for name, row in table.items():
            roles.setdefault(name, row.get("role", "baseline"))
    return roles


def _save(fig: Any, out_dir: Path, name: str) -> str:
    path = out_dir / name
    fig.savefig(path, bbox_inches="tight")
    _plt().close(fig)
    return name


def _ecdf(ax: Any, samples: dict[str, list[float]], roles: dict[str, str], unit: str) -> None:
    colors = _colors(list(samples))
    for name, xs in samples.items():
        if not xs:
            continue
        arr = np.sort(np.asarray(xs, dtype=float))
        y = np.arange(1, len(arr) + 1) / len(arr)
        p50 = float(np.percentile(arr, 50))
        p99 = float(np.percentile(arr, 99))
        ax.step(
            arr,
            y,
            where="post",
            color=colors[name],
            linestyle=ROLE_STYLE.get(roles.get(name, ""), "-"),
            label=f"{name}  p50 {p50:.3g} / p99 {p99:.3g} {unit}",
        )
    ax.set_xscale("log")
    _plain_log(ax.xaxis)
    ax.set_xlabel(f"latency ({unit}, log scale)")
    ax.set_ylabel("fraction of operations")
    ax.legend(fontsize=7, loc="lower right")


def plot_small_append(result: dict[str, Any], out_dir: Path) -> list[str]:
    samples: dict[str, list[float]] = result.get("samples_ms", {})
    if not samples:
        return []
    plt = _plt()
    roles = _roles(result)
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    _ecdf(a, samples, roles, "ms")
    a.set_title("latency distribution (ECDF)")
    colors = _colors(list(samples))
    for name, xs in samples.items():
        if not xs:
            continue
        arr = np.asarray(xs, dtype=float)
        w = max(1, min(25, len(arr) // 10))
        med = np.array([np.median(arr[max(0, i - w + 1) : i + 1]) for i in range(len(arr))])
        b.plot(
            np.arange(1, len(arr) + 1),
            med,
            color=colors[name],
            linestyle=ROLE_STYLE.get(roles.get(name, ""), "-"),
            label=name,
        )
    b.set_yscale("log")
    _plain_log(b.yaxis)
    b.set_xlabel("append number (table grows by one version each)")
    b.set_ylabel(f"latency (ms, rolling median of {25})")
    b.set_title("latency along the run (colours as on the left)")
    params = result.get("params", {})
    fig.suptitle(
        _title(
            result,
            f"small appends: {params.get('appends', '?')} x {params.get('rows_per_append', '?')} rows",
        )
    )
    names = [_save(fig, out_dir, "small_append_latency.png")]

    reads = result.get("tables", {}).get("reads after the appends (warm page cache)", {})
    if reads:
        names.append(
            _bars(
                out_dir,
                "small_append_reads.png",
                _title(result, "reads after the small appends (rows/s, warm page cache)"),
                [
                    (
                        "snapshot (latest version)",
                        {k: v["snapshot_rows_per_s"] for k, v in reads.items()},
                    ),
                    (
                        f"time travel (after append {params.get('time_travel_after_append', '?')})",
                        {k: v["time_travel_rows_per_s"] for k, v in reads.items()},
                    ),
                ],
                roles,
                "rows/s",
            )
        )
    return names


def _bars(
    out_dir: Path,
    filename: str,
    title: str,
    panels: list[tuple[str, dict[str, float]]],
    roles: dict[str, str],
    unit: str,
) -> str:
    plt = _plt()
    panels = [(t, v) for t, v in panels if v]
    names: list[str] = []
    for _, vals in panels:
        names += [n for n in vals if n not in names]
    colors = _colors(names)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5.2 * len(panels), 0.45 * len(names) + 1.8), squeeze=False
    )
    for ax, (panel_title, vals) in zip(axes[0], panels, strict=True):
        order = [n for n in names if n in vals]
        y = np.arange(len(order))
        xs = [vals[n] for n in order]
        bars = ax.barh(
            y,
            xs,
            color=[colors[n] for n in order],
            hatch=None,
            edgecolor=["black" if roles.get(n) == "baseline" else "none" for n in order],
            alpha=0.9,
        )
        for bar, n in zip(bars, order, strict=True):
            if roles.get(n) == "baseline":
                bar.set_hatch("//")
                bar.set_facecolor("#dddddd")
        ax.set_yticks(y, order, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(panel_title)
        ax.set_xlabel(unit)
        top = max(xs) if xs else 1
        for yi, x in zip(y, xs, strict=True):
            ax.text(x + top * 0.01, yi, _short(x), va="center", fontsize=7)
        ax.set_xlim(0, top * 1.22)
        _plain(ax.xaxis)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, out_dir, filename)


def _short(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def plot_bulk(result: dict[str, Any], out_dir: Path) -> list[str]:
    tables = result.get("tables", {})
    write = tables.get("write", {})
    read = tables.get("read (warm page cache)", {})
    old = next((v for k, v in tables.items() if k.startswith("time-travel")), {})
    if not write:
        return []
    params = result.get("params", {})
    return [
        _bars(
            out_dir,
            "bulk_throughput.png",
            _title(
                result,
                f"bulk: {params.get('rows', 0):,} rows "
                f"({params.get('input_MB', 0):.0f} MB in memory), rows/s",
            ),
            [
                ("write", {k: v["rows_per_s"] for k, v in write.items()}),
                ("snapshot read (warm cache)", {k: v["rows_per_s"] for k, v in read.items()}),
                (
                    f"time-travel read ({params.get('time_travel_rows', 0):,} rows)",
                    {k: v["rows_per_s"] for k, v in old.items()},
                ),
            ],
            _roles(result),
            "rows/s",
        )
    ]


def plot_consensus(result: dict[str, Any], out_dir: Path) -> list[str]:
    samples: dict[str, list[float]] = result.get("samples_ms", {})
    if not samples:
        return []
    plt = _plt()
    roles = _roles(result)
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1.5, 1]})
    _ecdf(a, samples, roles, "ms")
    a.set_title("compare-and-set latency (ECDF)")
    rows = result.get("tables", {}).get("", {})
    order = list(rows)
    colors = _colors(order)
    y = np.arange(len(order))
    xs = [rows[n]["ops_per_s"] for n in order]
    b.barh(y, xs, color=[colors[n] if roles.get(n) != "baseline" else "#cccccc" for n in order])
    b.set_yticks(y, order, fontsize=8)
    b.invert_yaxis()
    for yi, x in zip(y, xs, strict=True):
        b.text(x, yi, " " + _short(x), va="center", fontsize=7)
    b.set_xlim(0, max(xs) * 1.2 if xs else 1)
    b.set_xlabel("ops/s (sequential, one key)")
    _plain(b.xaxis)
    b.set_title("throughput")
    fig.suptitle(_title(result, f"consensus: {result.get('params', {}).get('ops', '?')} CAS each"))
    fig.tight_layout()
    return [_save(fig, out_dir, "consensus_latency.png")]


def plot_scale(result: dict[str, Any], out_dir: Path) -> list[str]:
    names: list[str] = []
    plt = _plt()
    roles = _roles(result)
    curves: dict[str, list[dict[str, Any]]] = result.get("curves", {})
    if curves:
        colors = _colors(list(curves))
        fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6))
        for name, pts in curves.items():
            if not pts:
                continue
            x = [p["batches"] for p in pts]
            style = ROLE_STYLE.get(roles.get(name, ""), "-")
            a.plot(
                x,
                [p["append_p50_ms"] for p in pts],
                marker="o",
                ms=3,
                linestyle=style,
                color=colors[name],
                label=name,
            )
            target = result.get("params", {}).get("batches")
            if target and x[-1] < target:  # stopped by its time budget
                a.annotate(
                    "stopped (time budget)",
                    (x[-1], pts[-1]["append_p50_ms"]),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                    color=colors[name],
                )
            opens = [(p["batches"], p["open_ms"]) for p in pts if p.get("open_ms") is not None]
            if opens:
                b.plot(
                    *zip(*opens, strict=True),
                    marker="o",
                    ms=3,
                    linestyle=style,
                    color=colors[name],
                    label=name,
                )
        for ax, what in ((a, "one-row append p50 (ms)"), (b, "open from a fresh client (ms)")):
            ax.set_yscale("log")
            _plain_log(ax.yaxis)
            ax.set_xscale("log")
            _plain_log(ax.xaxis)
            ax.set_xlabel("batches (versions) in the table, log scale")
            ax.set_ylabel(what + ", log scale")
            ax.legend(fontsize=7)
        a.set_title("append latency as the table grows")
        b.set_title("open time as the table grows")
        fig.suptitle(
            _title(
                result, f"scale: growth to {result.get('params', {}).get('batches', '?'):,} batches"
            )
        )
        fig.tight_layout()
        names.append(_save(fig, out_dir, "scale_growth.png"))
    writers: dict[str, list[dict[str, Any]]] = result.get("writers", {})
    if writers:
        colors = _colors(list(writers))
        fig, ax = plt.subplots(figsize=(7, 4.4))
        for name, pts in writers.items():
            pts = [p for p in pts if p.get("appends_per_s")]
            if not pts:
                continue
            ax.plot(
                [p["writers"] for p in pts],
                [p["appends_per_s"] for p in pts],
                marker="o",
                linestyle=ROLE_STYLE.get(roles.get(name, ""), "-"),
                color=colors[name],
                label=name,
            )
        ns = sorted({p["writers"] for pts in writers.values() for p in pts})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_yscale("log")
        _plain_log(ax.yaxis)
        ax.set_xlabel("concurrent writers (one shard / table each)")
        ax.set_ylabel("aggregate appends/s, log scale")
        params = result.get("params", {})
        ax.set_title(
            _title(
                result,
                f"concurrent writers: {params.get('rows_per_writer_append', '?')}-row appends",
            ),
            fontsize=9,
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        names.append(_save(fig, out_dir, "scale_writers.png"))
    return names


PLOTTERS: dict[str, Callable[[dict[str, Any], Path], list[str]]] = {
    "small_append": plot_small_append,
    "bulk": plot_bulk,
    "consensus": plot_consensus,
    "scale": plot_scale,
}


def write_plots(results: dict[str, dict[str, Any]], out_dir: Path) -> dict[str, list[str]]:
    """Draws every plot the results allow into ``out_dir``; the file names, by scenario."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[str]] = {}
    for name, result in results.items():
        plotter = PLOTTERS.get(name)
        if plotter is not None:
            written[name] = plotter(result, out_dir)
    return written
