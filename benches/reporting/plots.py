"""PNG plots of the results (matplotlib, Agg backend), written next to the JSON files.

``PLOTTERS[scenario](result, out_dir)`` draws that scenario's figures and returns the file
names. matplotlib is part of the bench extra: without it no plot is drawn and the runner records
the skip (``benches.peers.unavailable_reason("matplotlib")``).

- ``small_append_latency.png``: the distribution of per-append latency (ECDF, log scale) and the
  latency along the run (rolling median: does it grow with the table?);
- ``small_append_reads.png``, ``bulk_throughput.png``: throughput bars (rows/s) of writes,
  snapshot reads and time-travel reads;
- ``consensus_latency.png``: compare-and-set latency distributions and throughput;
- ``scale_growth.png``: append latency and open time as the table grows;
- ``scale_writers.png``: aggregate appends/s with N concurrent writers (in one process, and in N
  processes);
- ``contention_commits.png``: commits/s and refusals/s of N writer processes on one shard (and
  of bare conditional INSERTs racing on one key).
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
Series = dict[str, tuple[list[float], list[float]]]


class Figure:
    """One PNG of ``panels`` side by side; systems keep their colour (by family: persist
    blues, Delta orange, Iceberg green) and line style (by role) across its panels."""

    def __init__(self, result: dict[str, Any], panels: int, size: tuple[float, float]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.rcParams.update(
            {"figure.dpi": 110, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3}
        )
        self.plt, self.result = plt, result
        self.fig, axes = plt.subplots(1, panels, figsize=size, squeeze=False)
        self.axes: list[Any] = list(axes[0])
        self.roles: dict[str, str] = {}
        for table in result.get("tables", {}).values():
            for name, row in table.items():
                self.roles.setdefault(name, row.get("role", "baseline"))
        self.used: dict[str, int] = {}
        self.colors: dict[str, str] = {}

    def color(self, name: str) -> str:
        if name not in self.colors:
            fam = next((f for f in ("persist", "delta", "iceberg") if f in name.lower()), "other")
            pal = _PALETTE[fam]
            self.colors[name] = pal[self.used.get(fam, 0) % len(pal)]
            self.used[fam] = self.used.get(fam, 0) + 1
        return self.colors[name]

    def style(self, name: str) -> str:
        return ROLE_STYLE.get(self.roles.get(name, ""), "-")

    def save(self, out_dir: Path, filename: str, what: str) -> str:
        m = self.result.get("machine", {})
        self.fig.suptitle(f"{what}  ({m.get('scale', '?')} scale, {m.get('date', '')[:10]})")
        self.fig.tight_layout()
        self.fig.savefig(out_dir / filename, bbox_inches="tight")
        self.plt.close(self.fig)
        return filename

    def ecdf(self, ax: Any, samples: dict[str, list[float]], unit: str, title: str) -> None:
        for name, xs in samples.items():
            if xs:
                arr = np.sort(np.asarray(xs, dtype=float))
                p50, p99 = np.percentile(arr, 50), np.percentile(arr, 99)
                ax.step(
                    arr,
                    np.arange(1, len(arr) + 1) / len(arr),
                    where="post",
                    color=self.color(name),
                    linestyle=self.style(name),
                    label=f"{name}  p50 {p50:.3g} / p99 {p99:.3g} {unit}",
                )
        _axes(ax, title, f"latency ({unit}, log scale)", "fraction of operations", logx=True)
        ax.legend(fontsize=7, loc="lower right")

    def lines(
        self, ax: Any, series: Series, labels: tuple[str, str, str], marker: str | None = "o"
    ) -> None:
        """One line a system; ``labels``: title, x and y label. Log axes and a legend unless
        ``marker`` is ``None`` (a line along the run, next to a panel with the legend)."""
        for name, (x, y) in series.items():
            if x:
                style = {"linestyle": self.style(name), "color": self.color(name), "label": name}
                ax.plot(x, y, marker=marker, ms=3, **style)
        _axes(ax, *labels, logx=marker is not None, logy=True)
        if marker is not None:
            ax.legend(fontsize=7)

    def bars(self, ax: Any, values: dict[str, float], title: str, unit: str) -> None:
        """Horizontal bars; baselines hatched grey."""
        order = list(values)
        y = np.arange(len(order))
        xs = [values[n] for n in order]
        for bar, name in zip(ax.barh(y, xs, edgecolor="black", alpha=0.9), order, strict=True):
            base = self.roles.get(name) == "baseline"
            bar.set_facecolor("#dddddd" if base else self.color(name))
            bar.set_hatch("//" if base else None)
        ax.set_yticks(y, order, fontsize=8)
        ax.invert_yaxis()
        top = max(xs) if xs else 1
        for yi, x in zip(y, xs, strict=True):
            ax.text(x + top * 0.01, yi, _short(x), va="center", fontsize=7)
        ax.set_xlim(0, top * 1.22)
        _axes(ax, title, unit, "")


def _short(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def _axes(
    ax: Any, title: str, xlabel: str, ylabel: str, logx: bool = False, logy: bool = False
) -> None:
    """Titles, labels, and plain-number ticks (1, 2, 5 x 10^k on log axes, not 10^k)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    for axis, log in ((ax.xaxis, logx), (ax.yaxis, logy)):
        if log:
            ax.set_xscale("log") if axis is ax.xaxis else ax.set_yscale("log")
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_minor_formatter(NullFormatter())
        if log or axis is ax.xaxis:
            axis.set_major_formatter(FuncFormatter(lambda v, _pos: _short(v)))


def _throughput(
    result: dict[str, Any], out_dir: Path, filename: str, what: str, panels: dict[str, Any]
) -> str:
    panels = {title: values for title, values in panels.items() if values}
    rows = len({n for values in panels.values() for n in values})
    fig = Figure(result, len(panels), (5.2 * len(panels), 0.45 * rows + 1.8))
    for ax, (title, values) in zip(fig.axes, panels.items(), strict=True):
        fig.bars(ax, values, title, "rows/s")
    return fig.save(out_dir, filename, what)


def _xy(points: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """A line of ``Figure.lines``: the points that have a ``y``."""
    points = [q for q in points if q.get(y)]
    return [q[x] for q in points], [q[y] for q in points]


def plot_small_append(result: dict[str, Any], out_dir: Path) -> list[str]:
    samples: dict[str, list[float]] = result.get("samples_ms", {})
    if not samples:
        return []
    params = result.get("params", {})
    fig = Figure(result, 2, (13, 4.8))
    fig.ecdf(fig.axes[0], samples, "ms", "latency distribution (ECDF)")
    rolling: Series = {}
    for name, xs in samples.items():
        w = max(1, min(25, len(xs) // 10))
        med = [float(np.median(xs[max(0, i - w + 1) : i + 1])) for i in range(len(xs))]
        rolling[name] = (list(range(1, len(xs) + 1)), med)
    labels = (
        "latency along the run (colours as on the left)",
        "append number (table grows by one version each)",
        "latency (ms, rolling median of 25)",
    )
    fig.lines(fig.axes[1], rolling, labels, marker=None)
    appends = f"{params.get('appends', '?')} x {params.get('rows_per_append', '?')} rows"
    names = [fig.save(out_dir, "small_append_latency.png", f"small appends: {appends}")]
    reads = result.get("tables", {}).get("reads after the appends (warm page cache)", {})
    if reads:
        after = params.get("time_travel_after_append", "?")
        panels = {
            "snapshot (latest version)": {k: v["snapshot_rows_per_s"] for k, v in reads.items()},
            f"time travel (after append {after})": {
                k: v["time_travel_rows_per_s"] for k, v in reads.items()
            },
        }
        what = "reads after the small appends (rows/s, warm page cache)"
        names.append(_throughput(result, out_dir, "small_append_reads.png", what, panels))
    return names


def plot_bulk(result: dict[str, Any], out_dir: Path) -> list[str]:
    tables = result.get("tables", {})
    if not tables.get("write"):
        return []
    p = result.get("params", {})
    old: dict[str, Any] = next((v for k, v in tables.items() if k.startswith("time-travel")), {})
    panels = {
        "write": tables["write"],
        "snapshot read (warm cache)": tables.get("read (warm page cache)", {}),
        f"time-travel read ({p.get('time_travel_rows', 0):,} rows)": old,
    }
    rates = {title: {k: v["rows_per_s"] for k, v in t.items()} for title, t in panels.items()}
    what = f"bulk: {p.get('rows', 0):,} rows ({p.get('input_MB', 0):.0f} MB in memory), rows/s"
    return [_throughput(result, out_dir, "bulk_throughput.png", what, rates)]


def plot_consensus(result: dict[str, Any], out_dir: Path) -> list[str]:
    samples: dict[str, list[float]] = result.get("samples_ms", {})
    if not samples:
        return []
    fig = Figure(result, 2, (13, 4.6))
    fig.ecdf(fig.axes[0], samples, "ms", "compare-and-set latency (ECDF)")
    rates = {n: r["ops_per_s"] for n, r in result.get("tables", {}).get("", {}).items()}
    fig.bars(fig.axes[1], rates, "throughput", "ops/s (sequential, one key)")
    ops = result.get("params", {}).get("ops", "?")
    return [fig.save(out_dir, "consensus_latency.png", f"consensus: {ops} CAS each")]


def plot_scale(result: dict[str, Any], out_dir: Path) -> list[str]:
    names: list[str] = []
    p = result.get("params", {})
    curves: dict[str, list[dict[str, Any]]] = result.get("curves", {})
    if curves:
        fig = Figure(result, 2, (13, 4.6))
        x_label = "batches (versions) in the table, log scale"
        for ax, key, title, what in (
            (fig.axes[0], "append_p50_ms", "append latency", "one-row append p50 (ms)"),
            (fig.axes[1], "open_ms", "open time", "open from a fresh client (ms)"),
        ):
            series = {name: _xy(pts, "batches", key) for name, pts in curves.items()}
            fig.lines(ax, series, (f"{title} as the table grows", x_label, f"{what}, log scale"))
        style = {"textcoords": "offset points", "xytext": (4, 4), "fontsize": 7}
        for name, pts in curves.items():
            if pts and p.get("batches") and pts[-1]["batches"] < p["batches"]:
                end = (pts[-1]["batches"], pts[-1]["append_p50_ms"])
                fig.axes[0].annotate("stopped (time budget)", end, color=fig.color(name), **style)
        what = f"scale: growth to {p.get('batches', '?'):,} batches"
        names.append(fig.save(out_dir, "scale_growth.png", what))
    writers: dict[str, list[dict[str, Any]]] = result.get("writers", {})
    if writers:
        fig = Figure(result, 1, (7, 4.4))
        ax = fig.axes[0]
        series = {name: _xy(pts, "writers", "appends_per_s") for name, pts in writers.items()}
        procs: Series = {}
        for name, pts in result.get("writer_processes", {}).items():
            fig.roles[f"{name}, N processes"] = fig.roles.get(name, "baseline")
            procs[f"{name}, N processes"] = _xy(pts, "writers", "appends_per_s")
        labels = (
            "",
            "concurrent writers (one shard / table each)",
            "aggregate appends/s, log scale",
        )
        fig.lines(ax, series, labels)
        fig.lines(ax, procs, labels, marker="s")  # the process mode: square markers
        ns = sorted({q["writers"] for pts in writers.values() for q in pts})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        rows = p.get("rows_per_writer_append", "?")
        names.append(
            fig.save(out_dir, "scale_writers.png", f"concurrent writers: {rows}-row appends")
        )
    return names


def plot_contention(result: dict[str, Any], out_dir: Path) -> list[str]:
    points: dict[str, list[dict[str, Any]]] = result.get("points", {})
    if not points:
        return []
    fig = Figure(result, 2, (13, 4.4))
    # The table's rows are per system and N: the roles (line styles) come from the points.
    fig.roles |= {name: pts[0].get("role", "baseline") for name, pts in points.items() if pts}
    ns = sorted({q["writers"] for pts in points.values() for q in pts})
    for ax, key, what in (
        (fig.axes[0], "commits_per_s", "commits/s"),
        (fig.axes[1], "refusals_per_s", "refusals (lost races)/s"),
    ):
        series = {name: _xy(pts, "writers", key) for name, pts in points.items()}
        fig.lines(ax, series, (what, "writer processes on one shard / key", f"{what}, log scale"))
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
    window = result.get("params", {}).get("window_s", "?")
    what = f"contention: N writers on one shard, {window} s each"
    return [fig.save(out_dir, "contention_commits.png", what)]


PLOTTERS: dict[str, Callable[[dict[str, Any], Path], list[str]]] = {
    "small_append": plot_small_append,
    "bulk": plot_bulk,
    "consensus": plot_consensus,
    "scale": plot_scale,
    "contention": plot_contention,
}
