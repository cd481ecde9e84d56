"""Claims in a Prometheus multiprocess directory: which process writes which const-label set, and which serves.

Why: in multiprocess mode every process writes its series into its own ``{kind}_{pid}.db`` files and the
``MultiProcessCollector`` merges them by label set. Two live exporters that carry the same const labels are
therefore merged without any error (pages by state sum to twice the capacity; two exporters of one process
overwrite each other's counter entries), and two processes that each ``serve()`` the directory expose every rank
twice. A claim makes both mistakes a clear error at construction (or at ``serve()``), and lets a restarted rank
take over the label set of a predecessor that died without cleanup.

Contract: ``claim(directory, kind, labels, owner)`` returns a ``Claim`` or raises ``ClaimError`` (a
``ValueError``) naming the directory, the label set and the holder's pid; ``Claim.release()`` gives it up
(idempotent). A claim is an empty file (no data block needed on a full filesystem) that ``MultiProcessCollector``
never reads. Decisions are made under ``flock`` of the directory, so two processes starting at once cannot both
win. Never on the hot path: constructors, ``serve()`` and ``close()`` only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import time
import weakref
from collections.abc import Mapping

from prometheus_client.multiprocess import mark_process_dead

__all__ = ["LOCK_TIMEOUT", "Claim", "ClaimError", "claim"]

LOCK_TIMEOUT = 10.0  # seconds to wait for the directory's lock
_NAME = re.compile(r"^kvalloc_(labels|serve)_([0-9a-f]+|dir)_([0-9]+)_([0-9]+)\.claim$", re.ASCII)
# This process's claims: file name -> its owner (weakly). An owner collected without release() leaves a stale
# file that a later claim of this process takes over.
_MINE: dict[str, weakref.ref] = {}


class ClaimError(ValueError):
    """A label set (or the directory's one server) is held by a live exporter."""


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot) from /proc; None if it is not running or a zombie; 0
    where there is no /proc (then any running pid counts as the claimant)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return 0
        return 0
    except OSError:
        return 0
    # Fields after the command name (which may hold spaces and parentheses): state is the first, start time the
    # 20th (field 22 of proc(5)).
    rest = stat[stat.rindex(b")") + 2 :].split()
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


def _digest(labels: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(labels.items())).encode()).hexdigest()[:16]


class Claim:
    """One held claim (see the module contract)."""

    def __init__(self, directory: str, name: str, took_over: tuple[int, ...]):
        self.directory = directory
        self.name = name
        self.took_over = took_over
        self._pid = os.getpid()
        self._held = True

    def release(self, *, keep_file: bool = False) -> None:
        """Give the claim up. ``keep_file``: leave the file as the record that this process wrote the label set
        (its gauges stay in its files until it exits): a later claim of this process takes it over at once, one
        of another process once this one is dead (and marks it dead, which drops those gauges)."""
        if not self._held:
            return
        self._held = False
        if os.getpid() != self._pid:
            return  # a forked child's copy: the file is the parent's claim
        _MINE.pop(self.name, None)
        if not keep_file:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.directory, self.name))

    def __repr__(self) -> str:
        return f"Claim({self.name!r}, held={self._held})"


def _describe(kind: str, labels: Mapping[str, str] | None) -> str:
    if kind == "serve":
        return "serving this directory's metrics"
    return f"const_labels {dict(labels or {})}"


def claim(directory: str, kind: str, labels: Mapping[str, str] | None, owner) -> Claim:
    """Hold ``kind`` (``"labels"`` for the label set ``labels``, or ``"serve"``: at most one serving process per
    directory) in ``directory`` for ``owner`` (an object of this process, kept by weak reference).

    - The claim is the file ``kvalloc_{kind}_{digest}_{pid}_{start}.claim`` (``digest`` of the label set, or
      ``dir`` for ``serve``; ``start``: the process's start time from ``/proc``, so a recycled pid is not taken
      for its dead predecessor; 0 where there is no ``/proc``). Entries that are not claim files are left alone.
    - Held by a live process (another one, or this one through an owner still alive): ``ClaimError``. Held by a
      dead process (not running, or a zombie): taken over; for ``labels``,
      ``prometheus_client.multiprocess.mark_process_dead(pid)`` is called first, as a supervisor would, so that
      its ``live*`` gauges leave the aggregate (its counters stay). A pid that now names another process (another
      start time) is taken over without marking anything dead: that pid's files are the new process's. The
      taken-over pids are in ``Claim.took_over``.
    - A closed exporter releases its label claim with ``keep_file=True``: its gauges stay in the directory until
      its process exits, so another process may take the label set over only then.
    - The directory's lock is waited for at most ``LOCK_TIMEOUT`` seconds, then ``OSError`` (``ETIMEDOUT``); a
      file system error is an ``OSError`` starting "multiprocess metrics: cannot claim". Assumes the processes
      that share the directory share a PID namespace (a claim by a process this one cannot see is taken for dead).
    - In a child forked after the claim, ``Claim.release`` does nothing: the claim stays the parent's.
    """
    if kind not in ("labels", "serve"):
        raise ValueError(f"kind: expected 'labels' or 'serve', got {kind!r}")
    digest = _digest(labels or {}) if kind == "labels" else "dir"
    me = os.getpid()
    mine = f"kvalloc_{kind}_{digest}_{me}_{_start_time(me) or 0}.claim"
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        raise OSError(exc.errno, f"multiprocess metrics: cannot claim {kind} in {directory}: {exc.strerror}") from exc
    try:
        _lock(fd, directory)
        try:
            return _decide(directory, kind, labels, owner, digest, me, mine)
        except OSError as exc:  # the file system's (ClaimError is a ValueError)
            raise OSError(
                exc.errno, f"multiprocess metrics: cannot claim {kind} in {directory}: {exc.strerror or exc}"
            ) from exc
    finally:
        os.close(fd)  # releases the flock


def _lock(fd: int, directory: str) -> None:
    """The directory's exclusive ``flock``, waited for at most ``LOCK_TIMEOUT`` seconds."""
    deadline = time.monotonic() + LOCK_TIMEOUT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OSError(
                    errno.ETIMEDOUT,
                    f"multiprocess metrics: cannot claim in {directory}: its lock (flock) has been held for "
                    f"{LOCK_TIMEOUT:g} s by another process (stopped? check with lsof or fuser)",
                ) from None
            time.sleep(0.01)


def _decide(directory: str, kind: str, labels, owner, digest: str, me: int, mine: str) -> Claim:
    """``claim``'s decision, under the directory's lock."""
    took_over = []
    for name in sorted(os.listdir(directory)):
        m = _NAME.match(name)
        if m is None or m.group(1) != kind or m.group(2) != digest:
            continue
        try:
            if not stat.S_ISREG(os.lstat(os.path.join(directory, name)).st_mode):
                continue  # not a claim file, whatever its name
        except FileNotFoundError:
            continue
        pid, start = int(m.group(3)), int(m.group(4))
        if pid == me:
            ref = _MINE.get(name)
            holder = ref() if ref is not None else None
            if holder is not None and name == mine:
                raise ClaimError(
                    f"multiprocess metrics in {directory}: {_describe(kind, labels)} already used by another "
                    f"exporter of this process (pid {pid}); every allocator needs its own const_labels "
                    "(engine, tp_rank, dp_rank, ...)"
                    if kind == "labels"
                    else f"multiprocess metrics in {directory}: already served by another exporter of this "
                    f"process (pid {pid}); serve one endpoint per directory"
                )
        else:
            now = _start_time(pid)
            if now is not None and (now == 0 or now == start):
                raise ClaimError(
                    f"multiprocess metrics in {directory}: {_describe(kind, labels)} already used by live "
                    f"process {pid} (its gauges stay in the directory until it exits, even after its exporter "
                    "closed); every process (rank) needs its own const_labels (engine, tp_rank, dp_rank, ...)"
                    if kind == "labels"
                    else f"multiprocess metrics in {directory}: already served by live process {pid}; every "
                    "process's metrics are served from one endpoint per directory (serve() from one rank, or "
                    "from the parent with a MultiProcessCollector)"
                )
            if kind == "labels" and now is None:
                # Its live gauges would be summed into ours. Only a pid that runs no process: a recycled one's
                # files are the new process's now.
                mark_process_dead(pid, directory)
            took_over.append(pid)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, name))
    os.close(os.open(os.path.join(directory, mine), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    _MINE[mine] = weakref.ref(owner)
    return Claim(directory, mine, tuple(took_over))
