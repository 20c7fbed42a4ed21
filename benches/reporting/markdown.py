"""Results as files and as Markdown: ``<out>/<scenario>.json``, and each scenario's tables of
systems x figures, its ratios and its headline comparisons."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_result(out_dir: Path, name: str, result: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2, sort_keys=False, default=str)
    (out_dir / f"{name}.json").write_text(text + "\n")


def load_results(results_dir: Path, scenarios: Sequence[str]) -> dict[str, dict[str, Any]]:
    paths = {name: results_dir / f"{name}.json" for name in scenarios}
    return {name: json.loads(p.read_text()) for name, p in paths.items() if p.is_file()}


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        a = abs(v)
        if v != v:  # NaN
            return "nan"
        if a >= 1000:
            return f"{v:,.0f}"
        return f"{v:.1f}" if a >= 100 else f"{v:.2f}" if a >= 1 else f"{v:.3g}"
    return str(v)


def _met(met: bool | None) -> str:
    return "" if met is None else fmt(met)


def render_markdown(result: dict[str, Any], comparisons: bool = True) -> str:
    """One scenario's result as Markdown: a table of systems x figures, then the ratios."""
    lines = [f"### {result['scenario']} ({result['machine']['scale']} scale)", ""]
    for title, systems in result.get("tables", {}).items():
        if title:
            lines += [f"**{title}**", ""]
        metrics = list(dict.fromkeys(k for fig in systems.values() for k in fig if k != "role"))
        lines.append("| system | role | " + " | ".join(metrics) + " |")
        lines.append("|---|---|" + "---:|" * len(metrics))
        for sys_name, figures in systems.items():
            cells = [fmt(figures.get(m)) for m in metrics]
            lines.append(f"| {sys_name} | {figures.get('role', '')} | " + " | ".join(cells) + " |")
        lines.append("")
    if result.get("ratios"):
        lines += ["| ratio | value | target | met | formula |", "|---|---:|---|---|---|"]
        lines += [
            f"| {r['name']} | {fmt(r['value'])} | {r['target'] or ''} | {_met(r['met'])} | "
            f"{r['formula']} |"
            for r in result["ratios"]
        ]
        lines.append("")
    if comparisons and result.get("comparisons"):
        lines += render_comparisons(result["comparisons"])
    lines += [f"- {note}" for note in result.get("notes", [])]
    lines += [f"- SKIPPED {s['system']}: {s['reason']}" for s in result.get("skipped", [])]
    if result.get("notes") or result.get("skipped"):
        lines.append("")
    return "\n".join(lines)


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def render_comparisons(comparisons: Sequence[dict[str, Any]]) -> list[str]:
    """The headline table: each persist figure against the best peer and the limit.
    Ratios are persist / other; the arrow says which way is better."""
    lines = [
        "| figure | persist | value | best peer | peer value | persist / peer | limit | "
        "limit value | persist / limit | target | met |",
        "|---|---|---:|---|---:|---:|---|---:|---:|---|---|",
    ]
    for c in comparisons:
        arrow = "↓" if c["better"] == "lower" else "↑"
        unit = f" ({c['unit']})" if c.get("unit") else ""
        lines.append(
            f"| {c['figure']}{unit} {arrow} | {c['subject']} | {fmt(c['value'])} | "
            f"{c['best_peer'] or '-'} | {fmt(c['best_peer_value'])} | "
            f"{_ratio(c['vs_best_peer'])} | {c['limit'] or '-'} | {fmt(c['limit_value'])} | "
            f"{_ratio(c['vs_limit'])} | {c['target'] or ''} | {_met(c['met'])} |"
        )
    lines += [
        "",
        "(↓ lower is better: a ratio < 1 means persist is faster; ↑ higher is better: a "
        "ratio > 1 means persist is faster)",
        "",
    ]
    notes = list(dict.fromkeys(f"{c['figure']}: {c['note']}" for c in comparisons if c.get("note")))
    return lines + [f"- {n}" for n in notes] + ([""] if notes else [])
