"""``FlightRecorder(alloc, path, ...)``: the flight recorder's sink, what runs on the engine thread.

Contracts:
- Engine thread: ``__call__`` (bus name ``"recorder"``) runs inside the allocator call that produced the batch.
  It never blocks and never raises: it puts the batch (each event as its class and instance dict, one flat list)
  on the writer's ``NonBlockingSink`` queue without waiting, and returns False when the queue is full or the
  recorder stopped, so the bus counts the refused events in ``alloc.bus.dropped["recorder"]``. A violation wakes
  the writer at once (it commits it at once). After refused batches, an ``EventsLost`` marker is queued before the
  next accepted batch; replay cannot cross it, so the next step boundary takes a fresh snapshot.
- Snapshots: on a ``StepBoundary`` whose step is a multiple of ``snapshot_every`` (or when one is due: after lost
  events, or when retention wants a newer base) it takes ``alloc.snapshot(wait=False)`` (never a device sync here)
  and queues it with the boundary's seq. The wrapper's own ``Snapshot`` events are not stored.
- Construct and ``close()`` on the engine thread (or while no allocator call is in flight). The constructor claims
  the path (``lock``), commits the schema, metadata and an initial snapshot, or raises ``RecorderError`` and leaves
  no file behind. ``close()`` (also at interpreter exit) unsubscribes, lets the writer drain and finishes the file.
- Losses: events the writer took and never committed are ``lost_events``, registered with the bus
  (``add_loss_counter``): ``kvalloc_events_dropped_total{sink="recorder"}`` counts every event not stored.
- Hashed request ids (``hash_request_ids=``): every request id is stored as its pseudonym wherever it would be
  stored (``RequestIdHasher.event_fields`` and ``.snapshots``, applied by the writer before encoding); meta
  ``request_ids`` holds the hasher's scheme, never its key.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence

import instrumented_alloc
from instrumented_alloc import events as ev
from instrumented_alloc.redact import as_hasher
from instrumented_alloc.sinks import NonBlockingSink

from . import writer as _writer
from .format import _KIND_NAMES, _KINDS, _RESERVED_META, FORMAT, FORMAT_VERSION, SINK_NAME, RecorderError
from .lock import _claim_path, _remove_recording

logger = logging.getLogger("instrumented_alloc.recorder")

_POLL = 0.05  # seconds between the writer's looks at the queue when nothing woke it
# Kinds never recorded: the wrapper's own snapshots (the recorder takes its own), the step statistics (sums of
# the per-call events it records) and the recorder's gap marker.
_NOT_RECORDED = frozenset({"Snapshot", "StepStats", "EventsLost"})
_BOUNDARY, _VIOLATION_EVENT = ev.StepBoundary, ev.ViolationEvent


class FlightRecorder:
    """Record ``alloc``'s events into the SQLite file ``path`` (see the module contract).

    ``snapshot_every``: steps between periodic snapshots; ``max_events`` / ``max_bytes``: retention bounds (None:
    keep everything); ``queue_size``: batches the engine thread may run ahead of the writer; ``meta``: run
    metadata stored as given (e.g. ``preset``, ``version``, ``rank``); ``clock``: wall clock for start/end times;
    ``flush_interval``: seconds between commits of ordinary events; ``overwrite``: replace an existing recording
    at ``path`` (a file that is not a recording is never replaced); ``hash_request_ids``: store every request id
    as its keyed pseudonym (a ``RequestIdHasher``, shared with the OTel exporter so both agree; a key; True: a
    random key).
    """

    name = SINK_NAME
    # The wrapper builds no Snapshot events unless another sink reads them.
    event_types = frozenset(c for n, c in _KINDS.items() if n not in _NOT_RECORDED)

    def __init__(
        self,
        alloc,
        path,
        *,
        snapshot_every: int = 100,
        max_events: int | None = None,
        max_bytes: int | None = None,
        queue_size: int = 10000,
        meta: Mapping | None = None,
        clock: Callable[[], float] = time.time,
        flush_interval: float = 0.2,
        overwrite: bool = False,
        hash_request_ids=None,
    ):
        for label, value, low in (("snapshot_every", snapshot_every, 1), ("queue_size", queue_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{label}: expected an int >= {low}, got {value!r}")
        for label, value in (("max_events", max_events), ("max_bytes", max_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{label}: expected None or an int >= 1, got {value!r}")
        meta = dict(meta or {})
        clash = sorted(set(meta) & _RESERVED_META)
        if clash:
            raise ValueError(f"meta: keys {clash} are written by the recorder itself")
        self.path = os.fspath(path)
        self._alloc = alloc
        self._hasher = as_hasher(hash_request_ids)
        self._every = snapshot_every
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._clock = clock
        # Sink state (engine thread).
        self._stopped = False
        self._closed = False
        self._next_seq: int | None = None
        self._gap_from: int | None = None
        self._gap_end: tuple | None = None
        self._due = False
        self._since_snap_queued = 0  # events queued since the last snapshot was taken

        self._path_lock: int | None = None  # see lock._claim_path: held until close()
        ok = False
        try:
            conn = self._create(overwrite, meta)
            self._writer = w = _writer.Writer(
                conn,
                self.path,
                hasher=self._hasher,
                max_events=max_events,
                max_bytes=max_bytes,
                flush_interval=flush_interval,
                on_fail=self._stop,
            )
            # The writer is woken at half a queue, for a violation, flush() and close(), and else looks every
            # _POLL seconds: a wake-up per batch makes the two threads trade the GIL on every allocator call.
            self._queue = NonBlockingSink(
                w,
                queue_size=queue_size,
                name=SINK_NAME,
                wake_at=max(1, queue_size // 2),
                poll=_POLL,
                idle=w.idle,
                on_flush=w.commit,
                weight=_writer.item_events,
                start=False,
                thread_name=f"flight-recorder:{self.path}",
            )
            self._put = self._queue.put
            try:
                alloc.subscribe(self)
                try:
                    w.initial_snapshot(int(alloc.step_count), alloc.snapshot())
                except BaseException:
                    alloc.unsubscribe(self)
                    raise
            except BaseException as exc:
                conn.close()
                _remove_recording(self._real_path)  # ours since _create: a half-made file would block the path
                if isinstance(exc, (sqlite3.Error, OSError)):
                    raise RecorderError(f"cannot write flight recording {self.path!r}: {exc}") from exc
                raise
            ok = True
        finally:
            if not ok and self._path_lock is not None:
                os.close(self._path_lock)  # releases the flock
                self._path_lock = None
        lost = w.lost
        alloc.bus.add_loss_counter(SINK_NAME, lambda: lost.n)
        self._queue.start()
        atexit.register(self.close)  # an engine that exits without close() still finishes the file

    # -- construction ---------------------------------------------------------------------------------------------
    def _create(self, overwrite: bool, user_meta: dict) -> sqlite3.Connection:
        path = self.path
        if os.path.isdir(path):
            raise RecorderError(f"cannot write flight recording {path!r}: it is a directory")
        # Claimed, and removed on a failure, as the file itself: a symlink (even to a file not made yet) is
        # recorded through, as SQLite does.
        self._real_path = real = os.path.realpath(path)
        try:
            self._path_lock = _claim_path(real, overwrite)
        except OSError as exc:
            if isinstance(exc, RecorderError):
                raise
            raise RecorderError(f"cannot write flight recording {path!r}: {exc}") from exc
        alloc = self._alloc
        # From here on the file at ``path`` is ours (created, empty, or a recording we were allowed to replace, and
        # locked until close()): a failure removes what it left.
        try:
            conn = _writer._open_writer(path)  # looked up on the module: the tests' fault-injection seam
        except (sqlite3.Error, OSError) as exc:
            _remove_recording(real)
            raise RecorderError(f"cannot write flight recording {path!r}: {exc}") from exc
        try:
            snaps = alloc.snapshot()
            meta = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "recorder_version": instrumented_alloc.__version__,
                "pools": [{"name": n, "num_pages": s.num_pages, "page_size": s.page_size} for n, s in snaps.items()],
                "page_size": int(next(iter(snaps.values())).page_size),
                "sliding_window": alloc.sliding_window,
                "mode": getattr(alloc, "mode", None),
                "allocator": type(getattr(alloc, "inner", alloc)).__name__,
                "start_time": float(self._clock()),
                "initial_step": int(alloc.step_count),
                "snapshot_every": self._every,
                "max_events": self._max_events,
                "max_bytes": self._max_bytes,
                "request_ids": self._hasher.scheme if self._hasher is not None else {"scheme": "raw"},
                "kinds": list(_KIND_NAMES),
                **user_meta,
            }
            _writer.start_file(conn, meta)
        except BaseException as exc:
            conn.close()
            _remove_recording(real)
            if isinstance(exc, (sqlite3.Error, OSError)):
                raise RecorderError(f"cannot write flight recording {path!r}: {exc}") from exc
            raise
        return conn

    def _stop(self) -> None:
        """The writer failed (its thread): refuse every later batch."""
        self._stopped = True

    # -- the sink (engine thread) ---------------------------------------------------------------------------------
    def __call__(self, batch: Sequence[ev.Event]) -> bool:
        if self._stopped:
            return False
        boundary = None
        urgent = False
        # Queued as one flat list [class, instance dict, class, instance dict, ...]: the event objects themselves
        # die with the call, and the dicts (atomic values, arrays) are untracked by the garbage collector at its
        # first look. Queued event objects (or a (class, dict) tuple per event) would survive into the older
        # generations and make full collections (of every object of the process) more frequent. (Two lists built
        # by C-level maps, of the classes and of the dicts, cost a third more: batches hold two or three events.)
        items = []
        for e in batch:
            t = type(e)
            items += (t, e.__dict__)
            if t is _BOUNDARY:
                boundary = e
            elif t is _VIOLATION_EVENT:
                urgent = True
        # The usual batch (no step boundary, no violation, the seq right after the last queued one: no gap) is
        # queued as the bare list; anything else (or a full queue) takes _queue_batch.
        if boundary is None and not urgent and items and batch[0].seq == self._next_seq and self._put(items):
            self._since_snap_queued += len(batch)
            self._next_seq = batch[-1].seq + 1
            return True
        return self._queue_batch(batch, items, boundary, urgent)

    def _queue_batch(self, batch: Sequence[ev.Event], items: list, boundary, urgent: bool) -> bool:
        """The sink's general case (engine thread): gaps after refused batches, snapshots at step boundaries,
        violations (the writer is woken), a full queue (refused)."""
        if not batch:
            return True
        first = batch[0].seq
        gap_from = self._gap_from
        if gap_from is None and self._next_seq is not None and first > self._next_seq:
            gap_from = self._next_seq
        lost = (gap_from, first - 1) if gap_from is not None and gap_from < first else None
        snap = None
        self._since_snap_queued += len(batch)
        if boundary is not None:
            # Retention's request for a newer base is also decided here, from what was queued: the writer only
            # sees the events some time later (it polls).
            due = (
                self._due
                or lost is not None
                or self._writer.want_snapshot
                or boundary.step % self._every == 0
                or (self._max_events is not None and self._since_snap_queued >= max(1, self._max_events // 2))
            )
            if due:
                snap = self._take_snapshot(boundary)
                self._due = snap is None
                if snap is not None:
                    self._since_snap_queued = 0
        if not self._put((items, snap, lost, urgent), urgent):
            self._gap_from = gap_from if gap_from is not None else first
            last = batch[-1]
            self._gap_end = (last.seq, last.ts, last.step)  # the gap's end, if no batch is accepted after it
            self._due = True
            return False
        self._gap_from = None
        self._next_seq = batch[-1].seq + 1
        if snap is not None:
            self._writer.want_snapshot = False
        elif lost is not None:
            self._due = True
        return True

    def _take_snapshot(self, boundary: ev.StepBoundary):
        # wait=False: never wait for deferred device checks here (a sync on the engine thread). The state as of the
        # verified calls is exactly what the events published up to this boundary describe; what the pending
        # checks change later is published later, with later seqs.
        try:
            return (boundary.step, boundary.seq, self._alloc.snapshot(wait=False))
        except Exception:
            return None

    # -- public API -------------------------------------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        """Events the sink refused (the bus's count for this sink); see also ``lost_events``."""
        return int(self._alloc.bus.dropped.get(SINK_NAME, 0))

    @property
    def lost_events(self) -> int:
        """Events the sink accepted that were never committed (the writer failed with them queued or in its open
        transaction). ``kvalloc_events_dropped_total{sink="recorder"}`` (``bus.drop_counts()``) counts these and the
        refused ones (``bus.dropped``)."""
        return self._writer.lost.n

    @property
    def failed(self) -> BaseException | None:
        """The error that stopped the writer (None while it records)."""
        return self._writer.failed

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is committed. True on success, False after a failure or timeout.
        Blocks: for tests, tools and shutdown, never for the engine's hot path."""
        if self._closed or self.failed is not None:
            return False
        return self._queue.flush(timeout) and self.failed is None

    def close(self, timeout: float = 30.0) -> None:
        """Stop recording: unsubscribe, write what is queued, finish the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        with contextlib.suppress(ValueError):
            self._alloc.unsubscribe(self)
        self._stopped = True
        # Batches refused at the end, with none accepted after them, get their EventsLost marker now (it is
        # otherwise written before the next accepted batch): replay must not cross them either.
        gap = None if self._gap_from is None else (self._gap_from, *self._gap_end)  # both set at each refusal
        stop = _writer.Stop(end_time=float(self._clock()), dropped=self.dropped, lost=gap)
        if self._queue.close(timeout):
            self._writer.finish(stop)  # the worker has exited: the connection is this thread's now
        else:
            logger.warning("flight recorder %s: the writer did not finish within %ss", self.path, timeout)
        if self._path_lock is not None:
            os.close(self._path_lock)  # the path is free for another writer (see lock._claim_path)
            self._path_lock = None

    def __enter__(self) -> FlightRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "failed" if self.failed is not None else ("closed" if self._closed else "recording")
        return f"FlightRecorder({self.path!r}, {state})"
