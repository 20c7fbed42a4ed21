"""Merges in a worker process: background compaction off the writer's CPU and GIL.

A client whose blob another process can open too (a ``file://`` or ``s3://`` URI, or a plain
``FileBlob``) runs the merges of its background maintenance in one worker process of its own:
``compact.merge_batches`` there reads, decodes, merges, encodes and writes the output parts,
at a lower CPU priority, so that the client's writers keep their cores. The client keeps what
correctness rests on: it plans each merge from the state and commits it (``apply_merge``,
which refuses output whose inputs changed). The worker starts at the first merge and stops
with ``close``; one that dies or hangs fails the merges it held like any failed merge (they
are planned again later, in a new worker). What it wrote and never handed back is deleted by
the worker itself when the client stops waiting for it (a cancel), else swept later as
abandoned compaction output.

Why one worker per client and not a pool shared by a process's clients: the client already
bounds its merges (``compaction_concurrency``) and owns its blob location, and its ``close``
can then stop what it started; a process rarely holds more than one long-lived client (a
Flight server holds one; Spark's tasks open short-lived ones, where a worker starts only if a
merge falls due).

The worker is a fresh interpreter (``subprocess``: the ``spawn`` way), never a fork of a
process with an event loop and threads; ``multiprocessing``'s spawn and forkserver would run
the parent's ``__main__`` again in the child, which a script without a ``__main__`` guard (a
load script, a notebook's kernel) can't survive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import itertools
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import urlsplit

from persist.config import PersistConfig, wall_clock_ms
from persist.core.arrow.evolution import View
from persist.core.arrow.updates import DiffOverflow
from persist.core.shard.types import HollowBatch
from persist.errors import ExternalError
from persist.internal.batch import delete_parts
from persist.internal.compact import merge_batches
from persist.location import Blob, open_blob
from persist.location.file import FileBlob
from persist.metrics import on as metrics_on

__all__ = ["MergeWorker", "worker_for"]

log = logging.getLogger("persist")

# The worker's niceness: under contention it gets about a tenth of a core against a busy
# writer's thread, and all that is idle otherwise.
NICE = 10
# Starting takes an interpreter and the imports of pyarrow and persist: about a second, more on
# a loaded machine. Past this the worker is taken as unable to start.
START_TIMEOUT_S = 60.0
# How long a stopping worker has to cancel its merges (each deletes what it wrote) and exit.
STOP_GRACE_S = 5.0

# The worker's first lines: its priority, the parent's import path, then the worker proper.
_BOOT = (
    "import os, sys\n"
    # Before the imports: starting is most of a worker's CPU time in a short load.
    f"try:\n    os.nice({NICE})\nexcept OSError:\n    pass\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = conn.recv()\n"
    "from persist.internal.worker import serve\n"
    "serve(conn)\n"
)

# Where the worker opens the client's blob: ("file", root) or ("uri", uri).
Location = tuple[str, str]


def worker_for(blob: Blob, uri: str | None, cfg: PersistConfig) -> MergeWorker | None:
    """The merge worker of a new client (not started yet); None when its merges stay in its
    own process: the config says so, or the blob can't be opened again elsewhere (``mem://``,
    or a ``Blob`` object other than a plain ``FileBlob``: a wrapper may count or fault on
    purpose, which another process would not do)."""
    location = _location(blob, uri)
    if not cfg.maintenance_process or location is None or not sys.executable:
        return None
    return MergeWorker(location, cfg)


def _location(blob: Blob, uri: str | None) -> Location | None:
    if uri is not None:
        return ("uri", uri) if urlsplit(uri).scheme in ("file", "s3") else None
    if type(blob) is FileBlob:
        return ("file", blob.root)
    return None


class MergeWorker:
    """One client's merge worker: started at the first merge, again after one died; stopped
    by ``close``. Merges run in it concurrently (the client's gate bounds how many)."""

    def __init__(self, location: Location, cfg: PersistConfig) -> None:
        self._location = location
        # A merge reads no clock, and a test's clock need not pickle.
        self._cfg = replace(cfg, now_ms=wall_clock_ms)
        self._timeout_s = cfg.compaction_timeout_s
        self._ids = itertools.count()
        self._proc: _Process | None = None
        self._starting: asyncio.Task[_Process] | None = None
        self.closed = False
        # Set when a worker could not start: the client then merges in its own process.
        self.broken = False
        # Merges the worker handed back, and the pid of the process that made each (tests).
        self.merged_by: list[int] = []

    @property
    def usable(self) -> bool:
        return not self.closed and not self.broken

    @property
    def pid(self) -> int | None:
        """The live worker's process id (None: none is running)."""
        proc = self._proc
        return None if proc is None or proc.gone.done() else proc.pid

    async def merge(
        self,
        shard_id: str,
        view: View,
        group: Sequence[HollowBatch],
        since: int,
        started_ms: int,
    ) -> HollowBatch | None:
        """``compact.merge_batches`` of the client's blob, in the worker; ``ExternalError``
        when the worker can't start, dies, or takes longer than ``compaction_timeout_s`` (a
        commit after that would be refused anyway: the worker is then stopped)."""
        proc = await self._running()
        rid = next(self._ids)
        reply: cf.Future[tuple[HollowBatch | None, int]] = cf.Future()
        if not proc.enlist(rid, reply):
            raise ExternalError(f"the merge worker (pid {proc.pid}) exited", determinate=True)
        try:
            proc.post(("merge", rid, shard_id, view, tuple(group), since, started_ms))
        except BaseException:
            proc.pending.pop(rid, None)
            raise
        waiting = asyncio.wrap_future(reply)
        try:
            done, _ = await asyncio.wait([waiting], timeout=self._timeout_s)
        except asyncio.CancelledError:
            if reply.cancel():
                proc.pending.pop(rid, None)
                proc.post(("cancel", rid))  # the worker stops it and deletes what it wrote
            elif not reply.exception() and (output := reply.result()[0]) is not None:
                proc.post(("delete", output))  # handed back, but nobody will commit it now
            raise
        if not done:
            reply.cancel()
            proc.kill()
            raise ExternalError(
                f"the merge worker (pid {proc.pid}) did not finish a merge within "
                f"compaction_timeout_s ({self._timeout_s:g} s); it was stopped",
                determinate=True,
            )
        output, pid = waiting.result()
        self.merged_by.append(pid)
        if (counted := metrics_on()) is not None:
            # What the worker read (it counts into no registry of this process).
            read = [p for b in group for p in b.parts if not p.inline]
            counted.parts_read.inc(len(read))
            counted.bytes_read.inc(sum(p.size for p in read))
        return output

    async def _running(self) -> _Process:
        if self.closed:
            raise ExternalError("the client is closing: no merge starts", determinate=True)
        proc = self._proc
        if proc is not None and proc.ready.done() and not proc.ready.exception() and proc.alive:
            return proc
        starting = self._starting
        if starting is None or starting.done():
            starting = self._starting = asyncio.get_running_loop().create_task(
                self._start(), name="persist merge worker start"
            )
        # Shielded: a cancelled merge must not leave a process half started and unowned.
        return await asyncio.shield(starting)

    async def _start(self) -> _Process:
        proc = await asyncio.to_thread(_Process.start, self._location, self._cfg)
        self._proc = proc
        if self.closed:
            proc.kill()
        ready = asyncio.wrap_future(proc.ready)
        done, _ = await asyncio.wait([ready], timeout=START_TIMEOUT_S)
        if done and not ready.exception():
            log.info("persist: merge worker started (pid %d)", proc.pid)
            return proc
        proc.kill()
        if self.closed:
            raise ExternalError(
                "the client closed while its merge worker started", determinate=True
            )
        self.broken = True
        why = ready.exception() if done else f"no word within {START_TIMEOUT_S:g} s"
        log.warning(
            "persist: the merge worker could not start (%s): this client merges in its own "
            "process from now on",
            why,
        )
        raise ExternalError(f"the merge worker could not start: {why}", determinate=True)

    async def close(self) -> None:
        """Stops the worker: its merges are cancelled (each deletes what it wrote) and it exits,
        or is killed after ``STOP_GRACE_S``; the process is reaped before this returns."""
        self.closed = True
        starting = self._starting
        if starting is not None and not starting.done():
            # Its process, once made, is killed at once: the start ends soon after.
            await asyncio.wait([starting], timeout=STOP_GRACE_S)
            if starting.done() and not starting.cancelled():
                starting.exception()  # retrieved: a start cut short by close is no news
        proc = self._proc
        if proc is None:
            return
        gone = asyncio.wrap_future(proc.gone)
        proc.post(("stop",))
        done, _ = await asyncio.wait([gone], timeout=STOP_GRACE_S)
        if not done:
            proc.kill()
            await asyncio.wait([gone], timeout=STOP_GRACE_S)


class _Process:
    """One worker process and the two threads that talk to it: one sends what the client
    posts (the event loop never blocks on a worker that stopped reading), one reads replies
    and, at the worker's end, reaps it and fails what was still waiting."""

    def __init__(self, popen: subprocess.Popen[bytes], conn: Connection) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.conn = conn
        self.pending: dict[int, cf.Future[tuple[HollowBatch | None, int]]] = {}
        self._lock = threading.Lock()
        self._ended = False
        self.ready: cf.Future[int] = cf.Future()
        self.gone: cf.Future[int] = cf.Future()  # the exit code, once reaped
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send, name="persist-worker-send", daemon=True)
        self._reader = threading.Thread(target=self._read, name="persist-worker-read", daemon=True)

    @classmethod
    def start(cls, location: Location, cfg: PersistConfig) -> _Process:
        ours, theirs = socket.socketpair()
        try:
            popen = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        proc = cls(popen, Connection(ours.detach()))
        proc.post(list(sys.path))
        proc.post((location, cfg))
        proc._sender.start()
        proc._reader.start()
        return proc

    @property
    def alive(self) -> bool:
        return not self.gone.done()

    def enlist(self, rid: int, reply: cf.Future[tuple[HollowBatch | None, int]]) -> bool:
        """Waits ``reply`` for the worker's answer to request ``rid``; False if the worker has
        ended (then nothing would ever answer it)."""
        with self._lock:
            if self._ended:
                return False
            self.pending[rid] = reply
            return True

    def post(self, message: object) -> None:
        """Queues ``message`` for the worker (pickled here: one that can't be fails its caller)."""
        self._outbox.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.popen.kill()

    def _send(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:
                return  # the worker is gone: the reader finds out and fails what waits

    def _read(self) -> None:
        try:
            while True:
                self._on(self.conn.recv())
        except (EOFError, OSError):
            pass
        except BaseException:
            log.warning("persist: a merge worker's reply could not be read", exc_info=True)
            self.kill()
        finally:
            self._end()

    def _on(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            self.ready.set_result(message[1])
        elif kind == "done":
            _, rid, output, pid = message
            reply = self.pending.pop(rid, None)
            try:
                if reply is None:
                    raise cf.InvalidStateError
                reply.set_result((output, pid))
            except cf.InvalidStateError:
                if output is not None:  # no one waits for it: nothing will commit it
                    self.post(("delete", output))
        elif kind == "failed":
            _, rid, error = message
            reply = self.pending.pop(rid, None)
            if reply is not None:
                with contextlib.suppress(cf.InvalidStateError):
                    reply.set_exception(error)

    def _end(self) -> None:
        self._outbox.put(None)
        try:
            code = self.popen.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.popen.wait()
        self._sender.join()
        self.conn.close()
        error = ExternalError(
            f"the merge worker (pid {self.pid}) exited (code {code})", determinate=True
        )
        with contextlib.suppress(cf.InvalidStateError):
            self.ready.set_exception(error)
        with self._lock:
            self._ended = True
            waiting, self.pending = list(self.pending.values()), {}
        for reply in waiting:
            with contextlib.suppress(cf.InvalidStateError):
                reply.set_exception(error)
        self.gone.set_result(code)


# --- the worker's side ----------------------------------------------------------------------


def serve(conn: Connection) -> None:
    """The worker process: merges what its client asks for until told to stop, or until the
    client's end of the connection closes (the client exited or was killed)."""
    # Ctrl-C in a terminal reaches the whole process group: the client decides when it stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    location, cfg = conn.recv()
    loop = asyncio.new_event_loop()
    code = 0
    try:
        loop.run_until_complete(_Worker(conn, location, cfg).run())
    except BaseException:
        traceback.print_exc()
        code = 1
    # Not a normal exit: it would wait for threads that may be stuck in a blob call.
    os._exit(code)


class _Worker:
    def __init__(self, conn: Connection, location: Location, cfg: PersistConfig) -> None:
        self.conn = conn
        kind, where = location
        self.blob = FileBlob(where) if kind == "file" else open_blob(where)
        self.cfg = cfg
        self.merges: dict[int, asyncio.Task[None]] = {}
        self.cleanups: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[Any, ...] | None] = asyncio.Queue()

        def read() -> None:
            while True:
                try:
                    message: tuple[Any, ...] | None = self.conn.recv()
                except (EOFError, OSError):
                    message = None
                with contextlib.suppress(RuntimeError):  # the loop is already gone
                    loop.call_soon_threadsafe(inbox.put_nowait, message)
                if message is None or message[0] == "stop":
                    return

        threading.Thread(target=read, name="persist-worker-inbox", daemon=True).start()
        self._send(("ready", os.getpid()))
        try:
            while (message := await inbox.get()) is not None and message[0] != "stop":
                self._handle(message)
        finally:
            for task in self.merges.values():
                task.cancel()
            left = {*self.merges.values(), *self.cleanups}
            if left:
                await asyncio.wait(left, timeout=STOP_GRACE_S)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.blob.close(), STOP_GRACE_S)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "merge":
            rid = message[1]
            task = asyncio.get_running_loop().create_task(self._merge(*message[1:]))
            self.merges[rid] = task
            task.add_done_callback(lambda _: self.merges.pop(rid, None))
        elif kind == "cancel":
            running = self.merges.get(message[1])
            if running is not None:
                running.cancel()
        elif kind == "delete":
            cleanup = asyncio.get_running_loop().create_task(delete_parts(self.blob, [message[1]]))
            self.cleanups.add(cleanup)
            cleanup.add_done_callback(self.cleanups.discard)

    async def _merge(
        self,
        rid: int,
        shard_id: str,
        view: View,
        group: tuple[HollowBatch, ...],
        since: int,
        started_ms: int,
    ) -> None:
        try:
            output = await merge_batches(
                self.blob, self.cfg, shard_id, view, group, since, started_ms
            )
        except asyncio.CancelledError:
            raise  # merge_batches deleted what it wrote; the client waits for nothing
        except BaseException as exc:
            self._send(("failed", rid, _portable(exc)))
        else:
            self._send(("done", rid, output, os.getpid()))

    def _send(self, message: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):  # the client is gone: the inbox ends the loop
            self.conn.send(message)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` as the client should see it: a failure a merge may meet (``ExternalError``,
    ``DiffOverflow``) as itself, anything else (a bug) as a ``RuntimeError`` that carries the
    worker's traceback, to fail the client's background task as it would in its process."""
    if isinstance(exc, ExternalError | DiffOverflow):
        with contextlib.suppress(Exception):
            copy = pickle.loads(pickle.dumps(exc))
            if isinstance(copy, BaseException):
                return copy
        return ExternalError(f"{type(exc).__name__}: {exc}", determinate=True)
    text = "".join(traceback.format_exception(exc))
    return RuntimeError(f"a merge failed in the worker (pid {os.getpid()}):\n{text}")
