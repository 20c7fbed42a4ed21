"""``WalDir``: the ``--wal-dir`` while a server runs on it (its lock, the server's id, the
clean-stop marker, the shard directories). What the directory holds is described in
``persist.flight._wal``'s docstring.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import zlib
from pathlib import Path

from persist.errors import ExternalError, InvalidUsage
from persist.flight._wal_format import fsync_dir, now_iso, write_durably
from persist.ids import ShardId

__all__ = ["WalDir"]

LOCK_FILE = "lock"
SERVER_ID_FILE = "server-id"
CLEAN_FILE = "clean-stop"
_SERVER_ID = re.compile(r"(srv-[0-9a-f]{16}) ([0-9a-f]{8})\n")


class WalDir:
    """``--wal-dir`` while a server runs on it: held with an exclusive lock, so two servers never
    log to (or recover) the same shard directories."""

    def __init__(self, path: Path, server_id: str, was_clean: bool, lock_fd: int) -> None:
        self.path = path
        self.server_id = server_id  # ``srv-`` + 16 hex: made once, the same across restarts
        self.was_clean = was_clean  # the previous run drained and stopped cleanly
        self._lock: int | None = lock_fd

    @classmethod
    def open(cls, path: Path | str) -> WalDir:
        """Takes the directory (made if missing): ``InvalidUsage`` if another server holds it."""
        path = Path(path)
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ExternalError(f"the WAL {path} failed: {exc}", determinate=True) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise InvalidUsage(
                    f"the WAL directory {path} is in use by another server{_holder(fd)}"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            server_id = _server_id(path)
            marker = path / CLEAN_FILE
            was_clean = marker.exists()
            if was_clean:
                # Gone for good before any write is taken: a crash from here on is not clean.
                marker.unlink()
                fsync_dir(path)
        except OSError as exc:
            os.close(fd)
            raise ExternalError(f"the WAL {path} failed: {exc}", determinate=True) from exc
        except BaseException:
            os.close(fd)
            raise
        return cls(path, server_id, was_clean, fd)

    def shards(self) -> list[Path]:
        """The shard directories (by shard id), not the files beside them."""
        return sorted(p for p in self.path.iterdir() if p.is_dir() and _is_shard(p.name))

    def close(self, clean: bool) -> None:
        """Lets the directory go; ``clean``: every write was drained, which the next run's
        recovery is told (``was_clean``)."""
        if self._lock is None:
            return
        try:
            if clean:
                note = {"server_id": self.server_id, "pid": os.getpid(), "at": now_iso()}
                write_durably(self.path / CLEAN_FILE, (json.dumps(note) + "\n").encode())
                fsync_dir(self.path)
        except OSError as exc:
            raise ExternalError(f"the WAL {self.path} failed: {exc}", determinate=True) from exc
        finally:
            fd, self._lock = self._lock, None
            os.close(fd)  # lets the lock go


def _server_id(directory: Path) -> str:
    path = directory / SERVER_ID_FILE
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        made = "srv-" + secrets.token_hex(8)
        write_durably(path, f"{made} {zlib.crc32(made.encode()):08x}\n".encode())
        fsync_dir(directory)
        return made
    m = _SERVER_ID.fullmatch(text)
    if m is None or int(m[2], 16) != zlib.crc32(m[1].encode()):
        # Not made anew: it names this server in shard states.
        raise ExternalError(
            f"{path} is damaged: restore it (this server's identity in shard states)",
            determinate=True,
        )
    return m[1]


def _holder(fd: int) -> str:
    try:
        pid = int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return ""
    return f" (pid {pid})"


def _is_shard(name: str) -> bool:
    try:
        ShardId(name)
    except InvalidUsage:
        return False
    return True
