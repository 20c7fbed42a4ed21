"""A Blob in a local directory: one file per key, written atomically and durably."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import tempfile
import time
from collections.abc import Callable

import pyarrow.fs as pafs

from persist.errors import ExternalError
from persist.location._keys import TEMP_PREFIX, prefix_can_match, validate_key
from persist.location._settle import run_in_thread
from persist.location.base import Blob

__all__ = ["FileBlob"]


class FileBlob(Blob):
    """A Blob rooted at a local directory; key ``a/b/c`` is the file ``root/a/b/c``.

    ``set`` writes a temp file in the target directory, fsyncs it, renames it over the key and
    fsyncs the directory, so a reader sees the old or the new value and a returned ``set``
    survives a crash. ``set_new`` (a part's first write) skips the temp file and the rename: it
    writes the key in place and fsyncs it and the directory. Because keys map to paths, a key
    cannot also be a directory of another key (``a`` and ``a/b``); such a ``set`` fails with
    ``ExternalError``, while reading, deleting or listing under a key finds nothing there. A root
    that is not a directory (a file, or a path through one) fails every call with
    ``ExternalError``: the store is broken, not empty. A process killed
    mid-``set`` leaves its temp file, which ``delete_partial_writes`` removes once it is old.
    ``delete`` does not sync the directory (the Blob contract does not ask deletes to be
    durable): a crash may bring a deleted key back. Persist deletes only blobs that no state
    references, and its orphan sweep removes any that return; a sync per delete would cost
    every merge a directory fsync per input, competing with the appends' own.

    Calls run in worker threads; a cancelled call returns its cancellation only once its thread
    is done (at worst the rest of one write and its fsyncs).
    """

    def __init__(self, root: str) -> None:
        # No I/O here: the root is created by the first set.
        self._root = os.path.abspath(root)

    @property
    def root(self) -> str:
        return self._root

    def _path(self, key: str) -> str:
        validate_key(key)
        return os.path.join(self._root, *key.split("/"))

    def arrow_location(self) -> tuple[pafs.FileSystem, Callable[[str], str]]:
        return pafs.LocalFileSystem(), self._path

    async def get(self, key: str) -> bytes | None:
        path = self._path(key)
        return await run_in_thread(lambda: _read(self._root, path))

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        path = self._path(key)
        return await run_in_thread(lambda: _read(self._root, path, start, end))

    async def set(self, key: str, value: bytes) -> None:
        path, data = self._path(key), bytes(value)
        await run_in_thread(lambda: _write(self._root, path, data))

    async def set_new(self, key: str, value: bytes) -> None:
        path, data = self._path(key), bytes(value)
        await run_in_thread(lambda: _write_in_place(self._root, path, data))

    async def delete(self, key: str) -> None:
        path = self._path(key)
        await run_in_thread(lambda: _delete(self._root, path))

    def uri(self, key: str) -> str:
        """``file:///abs/path`` of the file holding ``key`` (percent-encoded as RFC 8089 has
        it; Hadoop's ``Path`` wants the plain path, ``urllib.parse.unquote`` of the URI's)."""
        return pathlib.Path(self._path(key)).as_uri()

    async def list_keys(self, prefix: str) -> list[str]:
        if not prefix_can_match(prefix):
            return []
        return await run_in_thread(lambda: _list(self._root, prefix))

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        if not prefix_can_match(prefix):
            return {}
        return await run_in_thread(lambda: _sizes(self._root, prefix))

    async def delete_partial_writes(self, prefix: str, older_than_s: float) -> int:
        if not prefix_can_match(prefix):
            return 0
        return await run_in_thread(lambda: _delete_temp_files(self._root, prefix, older_than_s))


def _read(root: str, path: str, start: int = 0, end: int | None = None) -> bytes | None:
    try:
        with open(path, "rb") as f:
            if end is None:
                return f.read()
            return os.pread(f.fileno(), max(0, end - start), start)
    except (FileNotFoundError, IsADirectoryError):
        # A missing file (or root: nothing was written yet), or a path that is only a directory
        # of other keys: no value is stored at this key.
        return None
    except NotADirectoryError as exc:
        _check_root(root, f"reading {path}", exc, determinate=True)
        return None
    except OSError as exc:
        raise ExternalError(f"reading {path}: {exc}", determinate=True) from exc


def _check_root(root: str, doing: str, exc: OSError, *, determinate: bool) -> None:
    """Raises ``ExternalError`` for a path through a file (``exc``) unless the root is a directory.

    Below a directory root the file in the way is a key, and no key is stored under another:
    the caller's answer is "none there". A root that is a file, or lies under one (a volume
    swapped for a file, a mount gone wrong), is the store broken: read as "none there", every
    read would find nothing and every listing be empty while every write fails.
    """
    if not os.path.isdir(root):
        raise ExternalError(
            f"{doing}: {exc} (the blob's root {root} is not a directory)", determinate=determinate
        ) from exc


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(directory: str) -> list[str]:
    """Creates ``directory`` and its missing ancestors; returns the parents whose entries changed."""
    missing: list[str] = []
    d = directory
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    changed: list[str] = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            # A concurrent writer made it, or it is a file (then the next mkdir/open fails).
            if not os.path.isdir(d):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), d) from None
            continue
        changed.append(os.path.dirname(d))
    return changed


def _write(root: str, path: str, value: bytes) -> None:
    directory = os.path.dirname(path)
    try:
        changed_dirs = _make_dirs(directory)
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
    except OSError as exc:
        raise _cannot_prepare(root, path, exc) from exc
    try:
        try:
            _write_durably(fd, value)
        except OSError as exc:
            # Only the temp file was touched: the key still holds its previous value.
            raise ExternalError(f"writing {path}: {exc}", determinate=True) from exc
        try:
            os.replace(tmp, path)
        except OSError as exc:
            raise ExternalError(f"renaming into {path}: {exc}", determinate=False) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_dirs(path, changed_dirs)


def _write_in_place(root: str, path: str, value: bytes) -> None:
    # Straight to the key, truncating what a failed try left there: nothing reads the key yet.
    directory = os.path.dirname(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    try:
        changed_dirs = _make_dirs(directory)
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise _cannot_prepare(root, path, exc) from exc
    try:
        _write_durably(fd, value)
    except OSError as exc:
        raise ExternalError(f"writing {path}: {exc}", determinate=False) from exc
    _sync_dirs(path, changed_dirs)


def _cannot_prepare(root: str, path: str, exc: OSError) -> ExternalError:
    """The error of a write that failed before it touched the key."""
    doing = f"preparing to write {path}"
    if isinstance(exc, NotADirectoryError):
        _check_root(root, doing, exc, determinate=True)
        return ExternalError(f"{doing}: a key is in the way ({exc})", determinate=True)
    return ExternalError(f"{doing}: {exc}", determinate=True)


def _write_durably(fd: int, value: bytes) -> None:
    """Writes ``value`` to the new file ``fd``, fsyncs and closes it."""
    with os.fdopen(fd, "wb") as f:
        f.write(value)
        f.flush()
        os.fsync(f.fileno())


def _sync_dirs(path: str, changed_dirs: list[str]) -> None:
    try:
        # A new entry (and any new directories) are durable only once their directories are.
        _fsync_dir(os.path.dirname(path))
        for d in reversed(changed_dirs):
            _fsync_dir(d)
    except OSError as exc:
        raise ExternalError(f"syncing the directory of {path}: {exc}", determinate=False) from exc


def _delete(root: str, path: str) -> None:
    try:
        os.unlink(path)
    except (FileNotFoundError, IsADirectoryError):
        return
    except NotADirectoryError as exc:
        _check_root(root, f"deleting {path}", exc, determinate=True)
        return
    except OSError as exc:
        raise ExternalError(f"deleting {path}: {exc}", determinate=False) from exc


def _walk(root: str, prefix: str) -> list[tuple[os.DirEntry[str], str, bool]]:
    """Every file under the directories ``prefix`` can reach: ``(entry, key, matches)``.

    ``key`` is the key the file's path spells, and ``matches`` whether it starts with
    ``prefix``. Temp files are listed too (their "key" is no valid key), except those beside
    the last segment of a prefix that ends mid-name, which may be writing keys outside it.
    """
    *dirs, name_prefix = prefix.split("/")
    start = os.path.join(root, *dirs)
    key_base = "".join(d + "/" for d in dirs)
    files: list[tuple[os.DirEntry[str], str, bool]] = []
    # (directory, its key prefix, whether entry names must start with name_prefix)
    stack: list[tuple[str, str, bool]] = [(start, key_base, True)]
    try:
        while stack:
            directory, base, filtered = stack.pop()
            try:
                entries = list(os.scandir(directory))
            except FileNotFoundError:
                continue
            except NotADirectoryError as exc:
                _check_root(root, f"listing {start}", exc, determinate=True)
                continue
            for entry in entries:
                name = entry.name
                if name.startswith(TEMP_PREFIX):
                    if not filtered or not name_prefix:
                        files.append((entry, base + name, False))
                elif filtered and not name.startswith(name_prefix):
                    continue
                elif entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, base + name + "/", False))
                else:
                    files.append((entry, base + name, True))
    except OSError as exc:
        raise ExternalError(f"listing {start}: {exc}", determinate=True) from exc
    return files


def _list(root: str, prefix: str) -> list[str]:
    return sorted(key for _, key, matches in _walk(root, prefix) if matches)


def _sizes(root: str, prefix: str) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for entry, key, matches in _walk(root, prefix):
        if not matches:
            continue
        try:
            sizes[key] = entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue  # deleted meanwhile
        except OSError as exc:
            raise ExternalError(f"sizing {entry.path}: {exc}", determinate=True) from exc
    return dict(sorted(sizes.items()))


def _delete_temp_files(root: str, prefix: str, older_than_s: float) -> int:
    # mtimes are wall-clock times: the age is measured on the wall clock, whatever clock the
    # caller's config reads.
    cutoff = time.time() - older_than_s
    deleted = 0
    for entry, _, matches in _walk(root, prefix):
        if matches or entry.is_dir(follow_symlinks=False):
            continue
        try:
            # A live set wrote its temp file moments ago (its mtime is that write's).
            if entry.stat(follow_symlinks=False).st_mtime >= cutoff:
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue  # renamed into place or removed meanwhile
        except OSError as exc:
            raise ExternalError(f"deleting {entry.path}: {exc}", determinate=False) from exc
        deleted += 1
    return deleted
