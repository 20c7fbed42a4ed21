"""persist on a real Spark standalone cluster: a master and two workers on 127.0.0.1, started
from pyspark's own ``bin/spark-class``, each worker running its executor in a work directory of
its own. The drivers run in processes of their own (``cluster_driver.py``): a process holds one
SparkContext, and the other tests' is a local one.

Reads by both paths (the Python source, whose tasks run persist in the executors' Python, and
the native Parquet one) and a write are exact; a cluster whose executors' Python has no persist
is told so, naming ``PYSPARK_PYTHON`` / ``spark.pyspark.python``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import venv
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pyspark
import pytest

import persist

DRIVER = Path(__file__).with_name("cluster_driver.py")
SPARK_HOME = Path(pyspark.__file__).parent
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])
# How long the cluster may take to come up (JVM starts on a busy machine).
UP_S = 180.0


@dataclass
class Cluster:
    master: str
    work_dirs: list[Path]
    logs: list[Path]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spark_env() -> dict[str, str]:
    return os.environ | {"SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    port = _free_port()
    master = f"spark://127.0.0.1:{port}"
    started: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def start(name: str, *args: str) -> None:
        log = root / f"{name}.log"
        logs.append(log)
        with log.open("wb") as out:
            started.append(
                subprocess.Popen(
                    [spark_class, *args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=_spark_env(),
                    cwd=root,
                    start_new_session=True,  # its executors too are ended with its group
                )
            )

    try:
        start(
            "master",
            "org.apache.spark.deploy.master.Master",
            *("--host", "127.0.0.1", "--port", str(port), "--webui-port", str(_free_port())),
        )
        work_dirs = [root / "work-1", root / "work-2"]
        for i, work in enumerate(work_dirs, 1):
            work.mkdir()
            start(
                f"worker-{i}",
                "org.apache.spark.deploy.worker.Worker",
                master,
                *("--host", "127.0.0.1", "--cores", "1", "--memory", "1g"),
                *("--work-dir", str(work), "--webui-port", str(_free_port())),
            )
        deadline = time.monotonic() + UP_S
        while logs[0].read_text(errors="replace").count("Registering worker") < 2:
            dead = [p.args for p in started if p.poll() is not None]
            assert not dead, f"{dead} exited: see {root}"
            assert time.monotonic() < deadline, f"the cluster did not come up: see {root}"
            time.sleep(0.5)
        yield Cluster(master, work_dirs, logs)
    finally:
        for p in reversed(started):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in started:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _drive(
    cluster: Cluster, what: str, python: str, loc: Any, shard: str, new: str, out: Path
) -> None:
    env = _spark_env() | {"PYSPARK_PYTHON": python, "PYSPARK_DRIVER_PYTHON": sys.executable}
    args = [what, cluster.master, loc.blob, loc.consensus, shard, new, str(out)]
    done = subprocess.run(
        [sys.executable, str(DRIVER), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=out,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-5000:]


def _fill(loc: Any) -> str:
    """A shard whose contents have multiplicities 2 (rows appended twice) and retractions."""
    shard = str(persist.ShardId.new())

    def table(keys: range, time: int, diff: int) -> pa.Table:
        return pa.table(
            {
                "k": pa.array(keys, pa.int64()),
                "v": [str(k % 5) for k in keys],
                "_time": pa.array([time] * len(keys), pa.uint64()),
                "_diff": pa.array([diff] * len(keys), pa.int64()),
            }
        )

    async def go(client: persist.PersistClient) -> None:
        write = await client.open_writer(shard, SCHEMA, "cluster test")
        await write.compare_and_append(table(range(0, 20_000), 0, 1), 0, 1)
        more = pa.concat_tables([table(range(20_000, 30_000), 1, 1), table(range(0, 1000), 1, 1)])
        await write.compare_and_append(more, 1, 2)
        await write.compare_and_append(table(range(500, 1500), 2, -1), 2, 3)
        await write.expire()

    loc.run(go)
    return shard


def _expected() -> Counter[tuple[int, str]]:
    rows: Counter[tuple[int, str]] = Counter()
    for k in range(30_000):
        rows[(k, str(k % 5))] += 1
    for k in range(1000):
        rows[(k, str(k % 5))] += 1
    for k in range(500, 1500):
        rows[(k, str(k % 5))] -= 1
    return +rows  # drops rows whose multiplicity is 0


def _multiset(table: pa.Table) -> Counter[tuple[int, str]]:
    return Counter(zip(table.column("k").to_pylist(), table.column("v").to_pylist(), strict=True))


def _updates(table: pa.Table) -> dict[tuple[int, str], int]:
    assert set(table.column("_time").to_pylist()) == {2}  # as of upper - 1
    k, v, diff = (table.column(c).to_pylist() for c in ("k", "v", "_diff"))
    updates = {(a, b): d for a, b, d in zip(k, v, diff, strict=True)}
    assert len(updates) == table.num_rows  # consolidated: one update per row
    return updates


def test_reads_and_writes_are_exact_on_a_cluster(
    cluster: Cluster, loc: Any, tmp_path: Path
) -> None:
    shard, new = _fill(loc), str(persist.ShardId.new())
    _drive(cluster, "exact", sys.executable, loc, shard, new, tmp_path)
    expected = _expected()
    for path in ("source", "native"):
        contents = pq.read_table(tmp_path / f"{path}_contents.parquet")
        assert _multiset(contents) == expected, path
        assert _updates(pq.read_table(tmp_path / f"{path}_updates.parquet")) == dict(expected)
    written = persist.read_table(new, blob=loc.blob, consensus=loc.consensus)
    assert _multiset(written) == Counter((k, str(k % 7)) for k in range(30_000))
    # Each worker ran an executor, in its own work directory.
    for work in cluster.work_dirs:
        assert list(work.glob("app-*/*/stderr")), f"no executor ran in {work}"


def test_executors_without_persist_are_told_what_to_set(
    cluster: Cluster, loc: Any, tmp_path: Path
) -> None:
    bare = tmp_path / "bare-python"
    venv.create(bare, with_pip=False)  # the same Python, without persist or its dependencies
    python = str(bare / "bin" / "python")
    assert subprocess.run([python, "-c", "import persist"], cwd=bare).returncode != 0
    shard = _fill(loc)
    out = tmp_path / "out"
    out.mkdir()
    _drive(cluster, "unready", python, loc, shard, "-", out)
    error = (out / "error").read_text()
    assert "can't import persist" in error
    assert python in error
    assert "PYSPARK_PYTHON" in error and "spark.pyspark.python" in error
    # The native path runs no Python on the executors: it reads all the same.
    assert _multiset(pq.read_table(out / "native_contents.parquet")) == _expected()
