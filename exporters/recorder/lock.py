"""Ownership of a recording's path: one writer per file (``_claim_path``, an exclusive ``flock`` held until the
writer closes), and the removal of a file the writer made and could not finish.

Contract: called by ``FlightRecorder`` on the thread that constructs or closes it, never on the engine's hot path.
The ``flock`` is independent of SQLite's own ``fcntl`` locks: readers and the writer's connection never see it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import urllib.parse

from .format import _TABLES, RecorderError, RecordingError, RecordingVersionError
from .reader import Recording


def _file_id(path: str):
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def _remove_recording(path: str) -> None:
    """Remove the file at ``path`` and its WAL and shared-memory files, those that exist (best effort: a path we
    cannot remove from stays as it is)."""
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(OSError):
            os.remove(path + suffix)


def _claim_path(path: str, overwrite: bool) -> int:
    """The file at ``path``, made ours: returns an open descriptor holding an exclusive ``flock`` on it, which the
    writer keeps until ``close()``.

    Why a lock: two writers started at once on one path (two ranks given the same file name) must not both
    "create" it, and neither may delete the file the other is filling (an empty file looks like one a dead writer
    left). So the file is created with ``O_EXCL``; an existing one is locked (without waiting: held means another
    writer is creating or writing it right now, a clear error) before it is judged: empty, or a SQLite file with
    none of a recording's metadata (left by a writer that died before its first commit, or touched): filled in
    place; a recording: an error, or with ``overwrite`` removed and created anew; anything else: an error. The
    writer keeps the lock until ``close()``, so that an ``overwrite`` started meanwhile cannot delete the file it
    is filling. The lock is ``flock``, which is independent of SQLite's own ``fcntl`` locks, so readers and the
    writer's connection are not affected by it. ``path`` is the file itself (symlinks resolved by the caller)."""

    def fail(why: str) -> RecorderError:
        return RecorderError(f"cannot write flight recording {path!r}: {why}")

    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fresh = True
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # removed in between: try to create it again
            fresh = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise fail("another writer is creating or writing a recording there right now") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)  # replaced by another writer between our open and our lock: look again
                continue
            empty = fresh or os.fstat(fd).st_size == 0
            if not empty and not _is_recording(path):
                if not _is_abandoned(path):
                    raise fail("the file exists and is not a recording")
                os.ftruncate(fd, 0)  # a writer died while making it: ours to fill, as an empty file
                empty = True
            if empty:
                for suffix in ("-wal", "-shm"):  # a WAL left by an older file at this path would be replayed into ours
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path + suffix)
                return fd
            if not overwrite:
                raise fail("a recording exists there (pass overwrite=True)")
            _remove_recording(path)  # ours to replace: we hold its lock, so no other writer is filling it
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        os.close(fd)
    raise fail("the file kept changing while it was being created (several writers on one path?)")


def _is_abandoned(path: str) -> bool:
    """Whether ``path`` is a SQLite file a writer left before its first commit: nothing but (some of) a
    recording's tables, and no metadata. (A writer killed between switching the file to WAL and committing its
    metadata leaves one; it blocked the path for good, overwrite or not.)"""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro", uri=True)) as c:
            names = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not {n for n in names if not n.startswith("sqlite_")} <= _TABLES:
                return False
            return "meta" not in names or c.execute("SELECT 1 FROM meta LIMIT 1").fetchone() is None
    except sqlite3.Error:
        return False


def _is_recording(path: str) -> bool:
    """Whether ``path`` holds a flight recording (of any format version: ``overwrite=True`` may replace it)."""
    try:
        with contextlib.closing(Recording(path)):
            return True
    except RecordingVersionError:
        return True
    except RecordingError:
        return False
