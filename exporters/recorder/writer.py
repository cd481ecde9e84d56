"""The recording's writer: a synchronous exporter that owns the SQLite connection, run behind
``instrumented_alloc.sinks.NonBlockingSink`` (which owns the bounded queue and the worker thread).

Contracts:
- Thread: ``write``, ``idle`` and ``commit`` run on the queue's worker thread, one at a time; ``initial_snapshot``
  on the constructing thread before the worker starts, ``finish`` on the closing thread once it has exited.
  Nothing here runs on the engine thread; ``want_snapshot``, ``failed`` and ``lost`` are read from others.
- Items: what ``FlightRecorder`` queued, a flat ``[class, instance dict, ...]`` list (the usual batch) or a tuple
  ``(that list, snapshot or None, lost seq range or None, urgent)``. Events go into blocks (``codec``) in seq order,
  each batch with its snapshot in one transaction. A violation is committed at once; other events every
  ``flush_interval`` seconds (checked in ``idle`` and every ``_CLOCK_EVERY`` items) or every ``_COMMIT_ROWS``.
  Durability: ``synchronous=NORMAL``: a killed process loses nothing committed.
- Retention (after each commit): ``max_events`` / ``max_bytes`` (the main file's used pages, the WAL aside) delete
  the oldest blocks and the snapshots before the newest snapshot older than every kept event, so ``state_at``
  works for every kept step; the file shrinks by incremental vacuum. The violations table keeps the run's first
  ``FIRST_VIOLATIONS_KEPT`` and the newest within a share of the bound (half of ``max_events`` rows, a quarter of
  ``max_bytes``), counting the rest in meta ``violations_dropped``. A soft bound: ``want_snapshot`` asks the sink
  for a newer base once half the event budget (a quarter of the byte budget) was written since the last.
- Faults: any error (disk full, I/O error, the file deleted or replaced) stops writing for good: ``failed`` is
  set, ``on_fail`` is called (the sink then refuses every batch), one warning is logged, and the events queued or
  not yet committed are counted in ``lost`` (which the bus reads). Never raises to its caller.
- Metadata: ``start_file`` writes the schema and the run's meta; ``finish`` the end time and drop counts, then
  leaves WAL mode when no reader holds the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Mapping

from instrumented_alloc import events as ev
from instrumented_alloc.replay import EventsLost

from .codec import _BlockWriter, _deflater, _encode_ledger, _encode_owner
from .format import _BLOCK_EVENTS, _SCHEMA, FIRST_VIOLATIONS_KEPT, SINK_NAME, _dumps, _rid

logger = logging.getLogger("instrumented_alloc.recorder")

_COMMIT_ROWS = 5000  # events written since the last commit that force one
_INSERT_ROWS = 64  # encoded blocks the writer buffers before one executemany
_CLOCK_EVERY = 32  # queued items the writer takes from a backlog between two reads of the clock
# A violations row's size is estimated as its text plus this many bytes (rowid, integers, record header, cell).
_VIOLATION_ROW_OVERHEAD = 48


def _open_writer(path: str) -> sqlite3.Connection:
    """The writer's connection (a test seam: tests wrap it to inject faults)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5.0)
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # before the first table: lets retention shrink the file
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        conn.close()
        raise sqlite3.OperationalError(f"cannot switch to WAL mode (journal_mode is {mode})")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA journal_size_limit = 8388608")
    return conn


def start_file(conn: sqlite3.Connection, meta: Mapping) -> None:
    """Create the schema and commit the run's metadata (``meta``: key -> JSON-able value)."""
    conn.executescript(_SCHEMA)
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", [(k, _dumps(v).decode()) for k, v in meta.items()])
    conn.execute("COMMIT")


def file_id(path: str):
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


@dataclasses.dataclass
class Stop:
    end_time: float
    dropped: int
    # The refused events at the end, no batch accepted after them: (first seq, last seq, ts, step of the last).
    lost: tuple | None = None


class Tally:
    """A running total that one thread writes and others read (an int attribute: reads are atomic)."""

    __slots__ = ("n",)

    def __init__(self):
        self.n = 0


def item_events(item) -> int:
    """The events a queued item holds."""
    return len(item) >> 1 if type(item) is list else len(item[0]) >> 1


class Writer:
    """Write queued items into the recording at ``path`` over ``conn`` (see the module contract)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: str,
        *,
        hasher=None,
        max_events: int | None = None,
        max_bytes: int | None = None,
        flush_interval: float = 0.2,
        on_fail: Callable[[], None] = lambda: None,
    ):
        self.conn = conn
        self.path = path
        self._file = None  # the file's identity once the initial snapshot is committed (see _after_commit)
        self._hasher = hasher
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._flush_interval = float(flush_interval)
        self._on_fail = on_fail
        self.failed: BaseException | None = None
        # Events accepted and then never committed (the writer failed): read by scrapes through the bus, so kept in
        # an object of its own that the bus holds.
        self.lost = Tally()
        self.want_snapshot = False  # set here, cleared by the sink (engine thread) once it queued a snapshot
        self._in_txn = False
        self._last_commit = time.monotonic()
        self._uncommitted = 0
        self._unclocked = 0  # items written since the clock was last read
        self._n_events = 0
        self._violations_dropped = 0  # deleted by retention (see _trim_violations)
        self._n_violations = 0  # rows written to the violations table (an upper bound on what it holds)
        self._since_snap_events = 0
        self._since_snap_bytes = 0
        self._rids_cache: dict = {}
        self._block: _BlockWriter | None = None  # the block being filled
        self._deflate = _deflater()
        self._rows: list = []  # encoded blocks not yet inserted
        self._seg_rows: list = []  # their segments
        self._rid_rows: list = []
        self._vrows: list = []
        self._kindsets: set = set()  # the kinds bit sets already in table kindsets
        self._new_kindsets: list = []

    def initial_snapshot(self, step: int, snaps: Mapping) -> None:
        """Commit the state when recording started (replay always has a base). Constructing thread, before the
        worker starts; raises."""
        self.conn.execute("BEGIN")
        self._write_snapshot(step, 0, snaps)
        self.conn.execute("COMMIT")
        self._file = file_id(self.path)

    # -- the queue's callbacks (worker thread) ------------------------------------------------------------------
    def __call__(self, item) -> bool:
        return self.write(item)  # looked up on the instance, so that a test can hold the writer inside it

    def write(self, item) -> bool:
        """Write one queued item; commit when due. Always True: failures are counted in ``lost``."""
        plain = type(item) is list  # the usual batch, queued as it is
        if self.failed is not None:
            self.lost.n += len(item) >> 1 if plain else len(item[0]) >> 1
            return True
        try:
            if not self._in_txn:
                self.conn.execute("BEGIN")
                self._in_txn = True
            if plain:
                self._uncommitted += len(item) >> 1
                urgent = self._write(item, None, None, False)
            else:
                self._uncommitted += len(item[0]) >> 1
                urgent = self._write(*item)
            due = urgent or self._uncommitted >= _COMMIT_ROWS
            self._unclocked += 1
            if not due and self._unclocked >= _CLOCK_EVERY:
                self._unclocked = 0
                due = time.monotonic() - self._last_commit >= self._flush_interval
            if due:
                self._commit()
            elif len(self._rows) >= _INSERT_ROWS:
                self._insert_rows(close=False)
        except Exception as exc:
            self._failure(exc)
        return True

    def idle(self) -> float | None:
        """The queue ran empty: commit when ``flush_interval`` has passed; the seconds until then (None: nothing
        to commit)."""
        if not self._in_txn or self.failed is not None:
            return None
        self._unclocked = 0
        left = self._last_commit + self._flush_interval - time.monotonic()
        if left > 0:
            return left
        try:
            self._commit()
        except Exception as exc:
            self._failure(exc)
        return None

    def commit(self) -> bool:
        """Commit what was written (``flush``); False after a failure."""
        if self.failed is None and self._in_txn:
            try:
                self._commit()
            except Exception as exc:
                self._failure(exc)
        return self.failed is None

    def finish(self, stop: Stop) -> None:
        """Commit, write the end of the run (``stop``), leave WAL mode, close the connection. The closing thread,
        once the worker exited."""
        try:
            if self.failed is None:
                if self._in_txn:
                    self._commit()
                self._finish(stop)
        except Exception as exc:
            self._failure(exc)
        finally:
            with contextlib.suppress(Exception):
                self.conn.close()

    # -- commits ------------------------------------------------------------------------------------------------
    def _commit(self) -> None:
        self._insert_rows()
        self.conn.execute("COMMIT")
        self._in_txn, self._uncommitted, self._last_commit, self._unclocked = False, 0, time.monotonic(), 0
        self._after_commit()

    def _failure(self, exc: BaseException) -> None:
        self.lost.n += self._uncommitted
        self._block, self._rows, self._seg_rows, self._rid_rows, self._vrows = None, [], [], [], []
        self._kindsets, self._new_kindsets = set(), []
        self._deflate = _deflater()
        self._fail(exc)
        with contextlib.suppress(Exception):
            self.conn.rollback()
        self._in_txn, self._uncommitted = False, 0

    def _fail(self, exc: BaseException) -> None:
        if self.failed is not None:
            return
        self.failed = exc
        self._on_fail()
        logger.warning(
            "flight recorder %s stopped recording: %s: %s; later events are dropped "
            "(counted, with the events it had taken and not committed, in alloc.bus.drop_counts()[%r]: "
            "kvalloc_events_dropped_total); what was committed stays readable",
            self.path,
            type(exc).__name__,
            exc,
            SINK_NAME,
            exc_info=not isinstance(exc, (sqlite3.Error, OSError)),
        )

    def _after_commit(self) -> None:
        """The file is still ours (an unlinked or replaced file takes writes without an error), then retention."""
        try:
            moved = file_id(self.path) != self._file
        except FileNotFoundError:
            moved = True
        if moved:
            raise OSError(f"the recording file {self.path!r} was deleted or replaced while recording")
        self._retain()

    def _write(self, batch, snap, lost, urgent) -> bool:
        """Add a queued batch (flat [class, instance dict, ...]) to the open block; True when it held a violation
        (to be committed at once)."""
        blk = self._block
        k = len(batch) >> 1
        if (
            not urgent
            and snap is None
            and lost is None
            and blk is not None
            and blk.n + k <= _BLOCK_EVENTS
            and self._hasher is None
        ):
            # The usual batch: filed as it is, encoded with the block (no Python work per event here).
            blk.chunks.append(batch)
            blk.n += k
            self._since_snap_events += k
            if (self._max_events and self._since_snap_events >= max(1, self._max_events // 2)) or (
                self._max_bytes and self._since_snap_bytes >= self._max_bytes // 4
            ):
                self.want_snapshot = True
            return False
        vrows = []
        n = 0
        if lost is not None:
            lo, hi = lost
            head = batch[1]
            marker = EventsLost(
                seq=hi, ts=head["ts"], step=head["step"], first_seq=lo, last_seq=hi, n_events=hi - lo + 1
            )
            blk = self._block_for(blk, EventsLost, head["step"], hi)
            blk.add(EventsLost, marker.__dict__)
            n += 1
        snapshot, violation, boundary = ev.Snapshot, ev.ViolationEvent, ev.StepBoundary
        # A snapshot's step boundary starts a new block: retention deletes whole blocks, those before a snapshot.
        cut_at = snap[1] if snap is not None else None
        it = iter(batch)
        redact = self._hasher.event_fields if self._hasher is not None else None
        for cls, d in zip(it, it):
            if cls is snapshot:
                continue
            if redact is not None:
                d = redact(d)  # every request id as its pseudonym, before anything is encoded
            if blk is None or blk.n >= _BLOCK_EVENTS or (cls is boundary and d["seq"] == cut_at):
                blk = self._block_for(blk, cls, d["step"], d["seq"], cut=cls is boundary and d["seq"] == cut_at)
            blk.add(cls, d)
            n += 1
            if cls is violation:
                v = d["violation"]
                vrows.append(
                    (d["seq"], v.step, v.ts, v.invariant, v.severity, v.pool, _rid(v.rid), v.op, v.message, v.trace_id)
                )
        # Inserted by _insert_rows, many blocks in one executemany (before every commit, or _INSERT_ROWS blocks).
        self._vrows.extend(vrows)
        self._since_snap_events += n
        if snap is not None:
            self._write_snapshot(*snap)
        elif (self._max_events and self._since_snap_events >= max(1, self._max_events // 2)) or (
            self._max_bytes and self._since_snap_bytes >= self._max_bytes // 4
        ):
            self.want_snapshot = True
        return bool(vrows)

    def _block_for(self, blk: _BlockWriter | None, cls: type, step: int, seq: int, cut: bool = False) -> _BlockWriter:
        """A block that takes an event of ``cls`` at ``step``: ``blk`` when it can, else a new one (``blk`` is
        closed when it holds ``_BLOCK_EVENTS`` events, or with ``cut``)."""
        if blk is not None and blk.n:
            if blk.n < _BLOCK_EVENTS and not cut:
                return blk
            self._close_block(blk)
        # The wrapper's own Snapshot events are not stored (a batch filed as it is may hold some).
        blk = self._block = _BlockWriter(step, seq, self._rids_cache, ev.Snapshot)
        return blk

    def _close_block(self, blk: _BlockWriter) -> None:
        row = blk.row(self._deflate)
        self._rows.append(row)
        self._n_events += row[4]
        segments = blk.segments
        self._seg_rows += segments
        for seg in segments:
            if seg[4] not in self._kindsets:
                self._kindsets.add(seg[4])
                self._new_kindsets.append((seg[4],))
        self._since_snap_bytes += len(row[-1])
        if blk.rids:
            first = blk.first
            self._rid_rows.extend((first, r, step) for r, step in blk.rids)
        self._block = None

    def _insert_rows(self, close: bool = True) -> None:
        """Insert the encoded blocks (and, with ``close``, the block being filled: before every commit)."""
        if close and self._block is not None and self._block.n:
            self._close_block(self._block)
        rows, seg_rows, rid_rows, vrows = self._rows, self._seg_rows, self._rid_rows, self._vrows
        self._rows, self._seg_rows, self._rid_rows, self._vrows = [], [], [], []
        if rows:
            self.conn.executemany("INSERT OR IGNORE INTO blocks VALUES (?,?,?,?,?,?,?)", rows)
        if seg_rows:
            self.conn.executemany("INSERT OR IGNORE INTO segments VALUES (?,?,?,?,?,?,?,?,?)", seg_rows)
        if rid_rows:
            self.conn.executemany("INSERT INTO rids VALUES (?,?,?)", rid_rows)
        if self._new_kindsets:
            self.conn.executemany("INSERT OR IGNORE INTO kindsets VALUES (?)", self._new_kindsets)
            self._new_kindsets = []
        if vrows:
            self.conn.executemany("INSERT OR IGNORE INTO violations VALUES (?,?,?,?,?,?,?,?,?,?)", vrows)
            self._n_violations += len(vrows)

    def _write_snapshot(self, step: int, seq: int, snaps: Mapping) -> None:
        if self._hasher is not None:
            snaps = self._hasher.snapshots(snaps)
        ledger = _encode_ledger(snaps)
        self.conn.executemany(
            "INSERT OR REPLACE INTO snapshots VALUES (?,?,?,?,?,?,?)",
            [
                (seq, step, name, int(s.num_pages), int(s.page_size), _encode_owner(s.owner), ledger)
                for name, s in snaps.items()
            ],
        )
        self._since_snap_events = 0
        self._since_snap_bytes = 0

    def _retain(self) -> None:
        conn = self.conn
        deleted = False
        if self._max_events and self._n_events > self._max_events:
            # The block holding the oldest event to keep (the (excess+1)-th), found from the oldest block on.
            excess = self._n_events - self._max_events
            keep = None
            seen = 0
            cur = conn.execute("SELECT seq, n FROM blocks ORDER BY seq")
            try:
                while keep is None:
                    chunk = cur.fetchmany(256)
                    if not chunk:
                        break
                    for seq, n in chunk:
                        seen += n
                        if seen > excess:
                            keep = seq
                            break
            finally:
                cur.close()
            if keep is not None:
                deleted |= self._drop_before_snapshot_at_or_before(keep)
        if self._max_events:
            deleted |= self._trim_violations(rows=self._max_events // 2)
        if self._max_bytes:
            if self._used_bytes() > self._max_bytes:
                deleted |= self._trim_violations(size=self._max_bytes // 4)
            for _ in range(64):
                if self._used_bytes() <= self._max_bytes:
                    break
                seqs = [r[0] for r in conn.execute("SELECT DISTINCT seq FROM snapshots ORDER BY seq LIMIT 2")]
                if len(seqs) < 2 or not self._drop_before(seqs[1]):
                    break
                deleted = True
        if deleted:
            conn.executescript("PRAGMA incremental_vacuum;")

    def _used_bytes(self) -> int:
        conn = self.conn
        pages = conn.execute("PRAGMA page_count").fetchone()[0] - conn.execute("PRAGMA freelist_count").fetchone()[0]
        return pages * conn.execute("PRAGMA page_size").fetchone()[0]

    def _trim_violations(self, *, rows: int | None = None, size: int | None = None) -> bool:
        """Keep the violations table within its share of the retention bound: at most ``rows`` rows, or about
        ``size`` bytes (the rows' text plus a per-row overhead, an estimate). The first ``FIRST_VIOLATIONS_KEPT`` of the
        run are always kept (where an incident began); beyond the share, the oldest of the rest are deleted and
        counted in the meta key ``violations_dropped``. Without a share, a run that violates at every step (a
        corrupted pool) outgrew any byte bound while retention deleted the whole replayable history trying."""
        conn = self.conn
        if rows is not None:
            if self._n_violations - self._violations_dropped <= max(rows, FIRST_VIOLATIONS_KEPT):
                return False  # the usual case, without a count of the table
            n = conn.execute("SELECT count(*) FROM violations").fetchone()[0]
            excess = n - max(rows, FIRST_VIOLATIONS_KEPT)
        else:
            n, total = conn.execute(
                "SELECT count(*), coalesce(sum(length(message) + length(invariant) + length(op) + length(severity)"
                " + coalesce(length(pool), 0) + coalesce(length(rid), 0) + coalesce(length(trace_id), 0)), 0)"
                " FROM violations"
            ).fetchone()
            total += n * _VIOLATION_ROW_OVERHEAD
            if total <= size or n <= FIRST_VIOLATIONS_KEPT:
                return False
            excess = min(n - FIRST_VIOLATIONS_KEPT, -(-(total - size) * n // total))  # rows of the average size
        if excess <= 0:
            return False
        conn.execute("BEGIN")
        try:
            gone = conn.execute(
                "DELETE FROM violations WHERE seq IN (SELECT seq FROM violations ORDER BY seq LIMIT ? OFFSET ?)",
                (excess, FIRST_VIOLATIONS_KEPT),
            ).rowcount
            self._violations_dropped += gone
            conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('violations_dropped', ?)",
                (_dumps(self._violations_dropped).decode(),),
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return gone > 0

    def _drop_before_snapshot_at_or_before(self, seq: int) -> bool:
        row = self.conn.execute("SELECT max(seq) FROM snapshots WHERE seq <= ?", (seq,)).fetchone()
        return row[0] is not None and self._drop_before(row[0])

    def _drop_before(self, seq: int) -> bool:
        """Delete the snapshots older than the snapshot at ``seq`` (kept, with its own boundary) and the blocks
        whose events are all older, with their ``rids`` rows."""
        conn = self.conn
        conn.execute("BEGIN")
        try:
            n = conn.execute(
                "SELECT coalesce(sum(n), 0) FROM blocks WHERE seq < ?1 AND last < ?1", (seq,)
            ).fetchone()[0]
            b = conn.execute("DELETE FROM blocks WHERE seq < ?1 AND last < ?1", (seq,)).rowcount
            # The segments of the deleted blocks: those before the first kept block (a block's segments lie between
            # its first seq and its last).
            conn.execute("DELETE FROM segments WHERE seq < coalesce((SELECT min(seq) FROM blocks), ?1)", (seq,))
            # rids rows are inserted in block order: those of deleted blocks are the rowids before the first row
            # of a kept block (found by a scan in rowid order that stops there).
            conn.execute(
                "DELETE FROM rids WHERE rowid < coalesce("
                "(SELECT rowid FROM rids WHERE block >= coalesce((SELECT min(seq) FROM blocks), ?1) "
                "ORDER BY rowid LIMIT 1), (SELECT max(rowid) + 1 FROM rids))",
                (seq,),
            )
            m = conn.execute("DELETE FROM snapshots WHERE seq < ?", (seq,)).rowcount
            conn.execute("COMMIT")
        except BaseException:
            conn.rollback()
            raise
        self._n_events -= max(0, n)
        return b > 0 or m > 0

    def _finish(self, stop: Stop) -> None:
        conn = self.conn
        conn.execute("BEGIN")
        if stop.lost is not None:
            lo, hi, ts, step = stop.lost
            marker = EventsLost(seq=hi, ts=ts, step=step, first_seq=lo, last_seq=hi, n_events=hi - lo + 1)
            self._block_for(self._block, EventsLost, step, hi).add(EventsLost, marker.__dict__)
            self._insert_rows()
        conn.executemany(
            "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
            [
                ("end_time", _dumps(stop.end_time).decode()),
                ("events_dropped", _dumps(stop.dropped).decode()),
                ("events_lost", _dumps(self.lost.n).decode()),
            ],
        )
        conn.execute("COMMIT")
        conn.execute("PRAGMA busy_timeout = 0")  # never wait on a reader here
        # A finished file is one file: leaving WAL mode checkpoints the WAL and deletes it (one pass over the WAL,
        # not a checkpoint and then a second one). It fails (or leaves the mode as it is) while a reader holds the
        # file: then the WAL is checkpointed and truncated as far as the readers allow.
        mode = None
        with contextlib.suppress(sqlite3.Error):
            mode = conn.execute("PRAGMA journal_mode = DELETE").fetchone()[0]
        if str(mode).lower() != "delete":
            with contextlib.suppress(sqlite3.Error):
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
