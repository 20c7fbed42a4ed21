"""The machine a result was measured on: CPU, memory, the disk under test, versions, the
Postgres settings that decide what a commit costs, and the persist commit."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("deltalake", "pyiceberg", "sqlalchemy", "matplotlib", "pyinstrument", "msgspec")


async def machine_info(scale: str, postgres_uri: str, workdir: Path) -> dict[str, Any]:
    import numpy as np
    import pyarrow as pa

    import persist

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 0
    return {
        "persist_git": _git_state(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "scale": scale,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "psycopg": _version("psycopg"),
        "persist": getattr(persist, "__version__", "?"),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name", ":") or platform.processor() or "?",
        "memory_GB": _memory_gb(),
        "disk": disk_info(workdir),
        "packages": {name: _version(name) for name in OPTIONAL},
        "postgres": await pg_settings(postgres_uri),
        "pid": os.getpid(),
    }


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def _proc_field(path: str, name: str, sep: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.lower().startswith(name.lower()):
                return line.split(sep, 1)[1].strip()
    except OSError:
        pass
    return None


def _memory_gb() -> float | None:
    total = _proc_field("/proc/meminfo", "MemTotal", ":")
    return round(int(total.split()[0]) / 1024 / 1024, 1) if total else None


def disk_info(path: Path) -> dict[str, Any]:
    """The filesystem the benchmark data is written to: mount point, device, type, size."""
    out: dict[str, Any] = {"path": str(path)}
    try:
        st = os.statvfs(path)
        out["size_GB"] = round(st.f_blocks * st.f_frsize / 1e9, 1)
        out["free_GB"] = round(st.f_bavail * st.f_frsize / 1e9, 1)
        real = os.path.realpath(path)
        best = ("", "?", "?")
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, dev, fstype)
        out.update(mount=best[0], device=best[1], fstype=best[2])
        rot = Path(f"/sys/block/{os.path.basename(best[1])}/queue/rotational")
        if rot.exists():
            out["rotational"] = rot.read_text().strip() == "1"
    except OSError:
        pass
    return out


async def pg_settings(uri: str) -> dict[str, str]:
    """The server settings that decide what a commit costs."""
    import psycopg

    out: dict[str, str] = {}
    try:
        async with await psycopg.AsyncConnection.connect(uri, connect_timeout=5) as conn:
            for name in ("server_version", "fsync", "synchronous_commit", "wal_sync_method"):
                row = await (await conn.execute(f"SHOW {name}")).fetchone()
                out[name] = str(row[0]) if row else "?"
    except Exception as exc:  # reported, not fatal: the scenarios fail loudly on their own
        out["error"] = str(exc)
    return out


def _git_state() -> dict[str, Any]:
    """The commit of the persist checkout measured, and whether ``persist/`` had local edits."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return done.stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "persist_dirty": bool(git("status", "--porcelain", "--", "persist")),
        }
    except (OSError, subprocess.SubprocessError):
        return {}
