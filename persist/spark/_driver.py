"""What ``persist.spark`` does in the driver's own Python process, around Spark's calls.

- ``check_workers``: a Python source runs in Spark's Python workers, which Spark starts with
  ``PYSPARK_PYTHON`` (default: whatever ``python3`` is on each machine's path), not with the
  driver's interpreter. One without persist fails far from the cause (``DATA_SOURCE_NOT_FOUND``,
  or a ``ModuleNotFoundError`` in a task), so ``register`` asks the workers first.
- ``explain_save_modes``: Spark refuses its default save mode (``ErrorIfExists``) and ``Ignore``
  for every Python source before persist is asked, recommending ``Overwrite``, which persist
  refuses in turn; the refusal then says what persist takes. And Spark looks a Python source up
  in the calling thread's active session when it saves: a thread that has none (one of
  ``asyncio.to_thread``'s, say) finds no Python source at all (``DATA_SOURCE_NOT_FOUND``), so
  a save on such a thread makes the writer's session its active one first, as pyspark's own
  ``createDataFrame`` does.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pyspark import SparkContext
from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession
from pyspark.sql.readwriter import DataFrameWriter

from persist.errors import InvalidUsage

__all__ = ["check_workers", "explain_save_modes"]

_log = logging.getLogger("persist.spark")

# How long the workers' check waits for the cluster to run it (a cluster with no free
# executor runs nothing): past that, the check is skipped with a warning, never a hang.
CHECK_TIMEOUT_S = 120.0
_checked: weakref.WeakSet[SparkContext] = weakref.WeakSet()
_checked_lock = threading.Lock()

Probe = tuple[str, str, str]  # (host, the worker's Python, why persist does not import or "")


def _probe() -> Callable[[Iterable[Any]], Iterator[Probe]]:
    # Nested, so that cloudpickle sends the function by value: a worker without persist can
    # still unpickle and run it, and say what it lacks.
    def probe(_: Iterable[Any]) -> Iterator[Probe]:
        import importlib
        import importlib.util
        import socket
        import sys

        try:
            importlib.import_module("persist.spark")
            # How format("persist") finds the source: the module need only be there (all it
            # does is take the source from persist.spark, just imported).
            entry = "pyspark_persist"
            problem = "" if importlib.util.find_spec(entry) else f"No module named {entry!r}"
        except Exception as exc:  # whatever stops the import is the answer
            problem = f"{type(exc).__name__}: {exc}"
        yield socket.gethostname(), sys.executable, problem

    return probe


def _remedy(python: str) -> str:
    return (
        f"Spark starts its Python workers with {python!r} (PYSPARK_PYTHON, else python3 on "
        "each machine's path). Set PYSPARK_PYTHON before the session starts (spark-submit: "
        "--conf spark.pyspark.python=...) to a Python that has persist installed, at that path "
        "on every worker (docs/spark.md, 'On a cluster')"
    )


def _cause(exc: BaseException) -> str:
    """The line of a failed job's error that says why (py4j's first line only names the call:
    "An error occurred while calling ...")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    why = [line for line in lines if "Error" in line or "Exception" in line]
    named = [line for line in why if not line.startswith("An error occurred")]
    return (named or lines or [type(exc).__name__])[0].lstrip(": ")[:300]


def check_workers(spark: SparkSession, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Runs a small job on the session's executors (once per SparkContext); raises
    ``InvalidUsage`` naming ``PYSPARK_PYTHON`` / ``spark.pyspark.python`` when a worker's
    Python can't import persist. A session with no SparkContext (Spark Connect) is not checked,
    nor one whose cluster runs nothing within ``timeout_s`` (a warning is logged)."""
    try:
        sc = spark.sparkContext
    except Exception:  # Spark Connect: its server's workers are not this process's to ask
        return
    with _checked_lock:
        if sc in _checked:
            return
    python = str(sc.pythonExec)
    slots = max(int(sc.defaultParallelism), 1)
    group = f"persist-worker-check-{uuid.uuid4().hex}"
    outcome: list[list[Probe] | BaseException] = []

    def run() -> None:
        sc.setJobGroup(group, "persist: can Spark's Python workers import persist?")
        try:
            rdd = sc.parallelize(range(slots), slots)
            outcome.append(rdd.mapPartitions(_probe()).collect())
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)

    worker = threading.Thread(target=run, name="persist-worker-check", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        sc.cancelJobGroup(group)
        _log.warning(
            "persist.spark: could not check that Spark's Python workers import persist: the "
            "check ran nothing within %.0f s",
            timeout_s,
        )
        return
    result = outcome[0]
    if isinstance(result, BaseException):
        raise InvalidUsage(
            f"Spark's Python workers could not run persist's check ({_cause(result)}). "
            f"{_remedy(python)}"
        ) from result
    failed = sorted({p for p in result if p[2]})
    if failed:
        host, exe, problem = failed[0]
        raise InvalidUsage(
            f"Spark's Python workers can't import persist: on {host}, {exe} says {problem}. "
            f"{_remedy(python)}"
        )
    with _checked_lock:
        _checked.add(sc)


_EXPLAINED = "_persist_explains_save_modes"


def explain_save_modes() -> None:
    """Makes ``DataFrameWriter.save`` raise ``InvalidUsage`` saying ``.mode("append")`` where
    Spark refuses a save mode for the persist source (idempotent; other sources and errors are
    untouched)."""
    save = DataFrameWriter.save
    if getattr(save, _EXPLAINED, False):
        return

    @functools.wraps(save)
    def checked(self: DataFrameWriter, *args: Any, **kwargs: Any) -> None:
        _activate(self._spark)
        try:
            save(self, *args, **kwargs)
        except AnalysisException as exc:
            params = exc.getMessageParameters() or {}
            if (
                exc.getCondition() != "UNSUPPORTED_DATA_SOURCE_SAVE_MODE"
                or params.get("source", "").strip('"') != "persist"
            ):
                raise
            mode = params.get("createMode", "").strip('"') or "this"
            raise InvalidUsage(
                f'persist only appends: write with .mode("append") (Spark\'s save mode is {mode}; '
                "without .mode(...) it is ErrorIfExists)"
            ) from exc

    setattr(checked, _EXPLAINED, True)
    DataFrameWriter.save = checked  # type: ignore[method-assign]


def _activate(spark: SparkSession) -> None:
    """Makes ``spark`` this thread's active session in the JVM if the thread has none."""
    try:
        sessions = SparkSession._get_j_spark_session_class(spark._jvm)
        if sessions.getActiveSession().isEmpty():
            sessions.setActiveSession(spark._jsparkSession)
    except Exception:  # Spark Connect (no JVM here) or another layout: Spark as it is
        return
