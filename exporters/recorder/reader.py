"""The flight recording's reader, ``Recording(path)``: read-only, for the dashboard, the CLI and replay. It never
imports the writer.

Contracts: read-only (SQLite ``mode=ro``); every query runs in its own read transaction, so a reader opened while
the writer runs sees each new commit. Safe to share between threads (one connection under a lock). A file that is
not a recording (not SQLite, empty, without our tables or format) raises ``RecordingError`` (a ``ValueError``)
naming the file; a missing file ``RecordingNotFoundError`` (also a ``FileNotFoundError``). A recording cut off
mid-write (killed writer) reads up to its last complete transaction. ``state_at`` follows
``instrumented_alloc.replay``'s contract.
Damage raises ``RecordingError`` naming the file, never a bare exception and never another step's state: at open,
the meta values the readers use and a few index seeks (the first and last blocks indexed in ``segments``, kind
codes within meta ``kinds``); a block that does not decode (its seq named); a snapshot that does not decode or
does not match the run's pools; events indexed in ``segments`` whose block is not stored; a replay that does not
end at the step's boundary. Not detected: a block deleted together with its ``segments`` rows in the middle of the
history, a payload altered into another valid one (there is no checksum), emptied ``rids``.
Queries answer from the index tables (``segments``, ``kindsets``, ``rids``, ``violations``) and decode payloads
only for ``events`` and ``state_at``. Hashed request ids need nothing here: ``request_span`` takes the pseudonym.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence

from instrumented_alloc import events as ev
from instrumented_alloc import replay
from instrumented_alloc.invariants import Violation
from instrumented_alloc.replay import ReplayState

from .decode import _decode_block, _decode_owner
from .format import (
    _STATE_KINDS,
    _TABLES,
    FORMAT,
    FORMAT_VERSION,
    RecordingError,
    RecordingNotFoundError,
    RecordingVersionError,
    _classes_of,
    _is_int,
    _is_stored_rid,
    _meta_problem,
    _rid,
    _short,
    _unpack,
    _violation_row_ok,
)

_READ_BLOCKS = 200  # blocks per read transaction of Recording.events


class Recording:
    """A flight recording, read-only (see the module contract). Safe to share between threads."""

    def __init__(self, path):
        self.path = os.fspath(path)
        p = self.path
        if not os.path.exists(p):
            raise RecordingNotFoundError(f"{p}: no such file (expected a flight recording)")
        if os.path.isdir(p):
            raise RecordingError(f"{p} is a directory, not a flight recording")
        uri = "file:" + urllib.parse.quote(os.path.abspath(p)) + "?mode=ro"
        self._lock = threading.RLock()
        try:
            self._conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise RecordingError(f"{p} cannot be opened as a flight recording: {exc}") from exc
        try:
            tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "meta" not in tables:
                raise RecordingError(f"{p} is not a flight recording (no table meta)")
            meta = self._read_meta()
            if meta.get("format") != FORMAT:
                raise RecordingError(f"{p} is not a flight recording (format {meta.get('format')!r})")
            version = meta.get("format_version")
            if not _is_int(version):
                raise RecordingError(f"{p} is not a flight recording (format_version {version!r} is not an integer)")
            if version != FORMAT_VERSION:
                raise RecordingVersionError(
                    f"{p}: recording format version {meta.get('format_version')} is "
                    f"{'newer' if version > FORMAT_VERSION else 'older'} than this reader's ({FORMAT_VERSION}); "
                    "read it with the instrumented-alloc release that wrote it "
                    f"(recorder_version {meta.get('recorder_version')!r})"
                )
            missing = sorted(_TABLES - tables)
            if missing:
                raise RecordingError(f"{p} is not a flight recording (no table {', '.join(missing)})")
            problem = _meta_problem(meta)
            if problem is not None:
                raise RecordingError(f"{p}: unusable flight recording: {problem}")
            kinds = meta["kinds"]
            self._classes = _classes_of(kinds)
            self._codes = {k: i for i, k in enumerate(kinds)}
            self._state_mask = self._mask(_STATE_KINDS)
            self._state_classes = frozenset(c for c in self._classes if c is not None and c.__name__ in _STATE_KINDS)
            self._pool_names = tuple(p["name"] for p in meta["pools"])
            with self._read() as conn:
                problem = self._index_problem(conn, len(kinds))
            if problem is not None:
                raise RecordingError(f"{p}: unusable flight recording: {problem}")
        except RecordingError:
            self._conn.close()
            raise
        except (sqlite3.DatabaseError, ValueError, TypeError, KeyError) as exc:
            self._conn.close()
            raise RecordingError(f"{p} is not a flight recording ({exc})") from exc

    # -- plumbing ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _read(self):
        """One read transaction: a consistent view of the last commit."""
        with self._lock:
            conn = self._conn
            try:
                conn.execute("BEGIN")
                try:
                    yield conn
                finally:
                    conn.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                raise RecordingError(f"{self.path}: cannot read the recording ({exc})") from exc

    @contextlib.contextmanager
    def _parsing(self, what: str):
        """Values read from the file turned into Python ones: a value a corrupt file holds (text where a number
        belongs, a malformed JSON document) raises ``RecordingError`` naming the file, not a bare ValueError."""
        try:
            yield
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RecordingError(f"{self.path}: {what} cannot be read ({type(exc).__name__}: {exc})") from exc

    @staticmethod
    def _index_problem(conn, n_kinds: int) -> str | None:
        """What the index tables say that cannot be (None: nothing), by a few index seeks: a kind code beyond the
        meta ``kinds``, a first or last block without its segments (an emptied or cut ``segments``), the newest
        segment's block missing. Holes in the middle are found where a query crosses them (``_missing_blocks``)."""
        top = conn.execute("SELECT max(kinds) FROM kindsets").fetchone()[0]
        if top is not None and (not _is_int(top) or top < 0 or top >> n_kinds):
            return f"its blocks use event kind codes that meta kinds ({n_kinds} kinds) does not name"
        for end in ("min", "max"):
            b = conn.execute(f"SELECT {end}(seq) FROM blocks").fetchone()[0]
            s = conn.execute(
                f"SELECT block FROM segments ORDER BY seq {'DESC' if end == 'max' else ''} LIMIT 1"
            ).fetchone()
            if (b is None) != (s is None) or (b is not None and s[0] != b and end == "max"):
                return (
                    f"its segments table does not index its blocks (the {'last' if end == 'max' else 'first'} "
                    f"block has seq {b}, the {'last' if end == 'max' else 'first'} segment's block is "
                    f"{None if s is None else s[0]})"
                )
            if b is not None and conn.execute(
                "SELECT 1 FROM segments WHERE seq = ? AND block = ?", (b, b)
            ).fetchone() is None:
                return f"its segments table does not index the block at seq {b}"
            k = conn.execute(
                f"SELECT kinds FROM segments ORDER BY seq {'DESC' if end == 'max' else ''} LIMIT 1"
            ).fetchone()
            if k is not None and conn.execute("SELECT 1 FROM kindsets WHERE kinds = ?", k).fetchone() is None:
                which = "last" if end == "max" else "first"
                return f"its kindsets table lacks the kinds {k[0]!r} of its {which} segment"
        return None

    def _read_meta(self) -> dict:
        out = {}
        for k, v in self._conn.execute("SELECT key, value FROM meta"):
            try:
                out[k] = json.loads(v)
            except ValueError:
                out[k] = v
        return out

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @staticmethod
    def _kindsets(conn, mask: int) -> list[int]:
        """The ``kinds`` bit sets of the file that have a bit of ``mask`` (for ``kinds IN (...)``: index seeks)."""
        return [k for (k,) in conn.execute("SELECT kinds FROM kindsets") if k & mask]

    def _mask(self, kinds: Iterable) -> int:
        """The ``blocks.kinds`` bits of these kinds (classes or names; kinds the file does not know have none)."""
        mask = 0
        for k in kinds:
            code = self._codes.get(k if isinstance(k, str) else k.__name__)
            if code is not None:
                mask |= 1 << code
        return mask

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recording({self.path!r})"

    # -- queries ------------------------------------------------------------------------------------------------
    @property
    def meta(self) -> dict:
        """Run metadata: pools (name, num_pages, page_size), page_size, sliding_window, start_time, initial_step,
        the caller's ``meta=`` (preset, version, rank, ...) and, once closed, end_time / events_dropped."""
        with self._read():
            meta = self._read_meta()
        problem = _meta_problem(meta)
        if problem is not None:
            raise RecordingError(f"{self.path}: unusable flight recording: {problem}")
        return meta

    def steps(self) -> tuple[int, int]:
        """(first, last): the range of steps ``state_at`` can answer (first: the oldest kept snapshot)."""
        with self._read() as conn:
            first, last = self._steps(conn)
        if first is None:
            raise RecordingError(f"{self.path}: the recording has no snapshot")
        return first, last

    def _steps(self, conn) -> tuple:
        """(first, last) of ``steps()``; (None, None) without a snapshot. One answer for ``steps`` and the
        messages of ``state_at``."""
        first = conn.execute("SELECT min(step) FROM snapshots").fetchone()[0]
        last = conn.execute("SELECT max(step) FROM segments WHERE boundary IS NOT NULL").fetchone()[0]
        top = conn.execute("SELECT max(step) FROM snapshots").fetchone()[0]
        if first is None:
            return None, None
        with self._parsing("the step range"):
            return int(first), int(max(x for x in (last, top) if x is not None))

    def snapshot_steps(self) -> list[int]:
        """The steps of the stored snapshots (the bases replay starts from)."""
        with self._read() as conn, self._parsing("the snapshots' steps"):
            return [int(r[0]) for r in conn.execute("SELECT step FROM snapshots GROUP BY seq ORDER BY seq")]

    def violations(
        self, start: int | None = None, stop: int | None = None, *, newest: int | None = None
    ) -> list[Violation]:
        """Every recorded violation with ``start <= step < stop`` (None: unbounded), in order; ``newest``: only the
        newest that many of them (still in order)."""
        if newest is not None and (isinstance(newest, bool) or not isinstance(newest, int) or newest < 0):
            raise ValueError(f"newest: expected an int >= 0, got {newest!r}")
        sql = "SELECT invariant, message, pool, rid, step, op, ts, trace_id, severity FROM violations"
        where, args = _step_range(start, stop)
        with self._read() as conn:
            if newest is None:
                rows = conn.execute(f"{sql}{where} ORDER BY seq", args).fetchall()
            else:
                rows = conn.execute(f"{sql}{where} ORDER BY seq DESC LIMIT ?", [*args, newest]).fetchall()[::-1]
        bad = next((r for r in rows if not _violation_row_ok(r)), None)
        if bad is not None:
            raise RecordingError(f"{self.path}: a violation row holds values the recorder never writes: {_short(bad)}")
        return [
            Violation(invariant=i, message=m, pool=p, rid=r, step=s, op=o, ts=t, trace_id=tr, severity=sv)
            for i, m, p, r, s, o, t, tr, sv in rows
        ]

    def events(
        self, start: int | None = None, stop: int | None = None, *, kinds: Iterable | None = None
    ) -> Iterator[ev.Event]:
        """Decoded events with ``start <= step < stop`` (None: unbounded), in seq order; ``kinds``: event classes
        or their names. Read in chunks of blocks (each its own read transaction), so a long iteration follows the
        writer. If retention deletes events of the range that the iteration has not reached yet (a long read of a
        bounded recording being written), it raises ``replay.IncompleteHistory`` at that point, naming the first
        missing seq: it never skips them silently."""
        start = None if start is None else int(start)
        stop = None if stop is None else int(stop)
        wanted = None
        mask = 0
        if kinds is not None:
            kinds = list(kinds)
            mask = self._mask(kinds)
            if not mask:
                return
            wanted = {self._classes[c] for c in range(len(self._classes)) if mask >> c & 1}
        # The blocks from the one holding the first event of the range (segments_step) up to the one holding its
        # last (found again for each chunk: a long iteration follows the writer); steps never decrease with seq.
        where, args = [], []
        if start is not None:
            where.append(
                "seq >= coalesce((SELECT block FROM segments WHERE step >= ? ORDER BY step, block LIMIT 1), 1 << 62)"
            )
            args.append(start)
        if stop is not None:
            where.append(
                "seq <= coalesce("
                "(SELECT block FROM segments WHERE step < ? ORDER BY step DESC, block DESC LIMIT 1), -(1 << 62))"
            )
            args.append(stop)
        if mask:
            where.append(f"kinds & {mask} != 0")
        where.append("seq > ?")
        # One block more than a chunk: the next chunk must begin with it, or retention deleted it in between.
        sql = f"SELECT seq, step, payload FROM blocks WHERE {' AND '.join(where)} ORDER BY seq LIMIT {_READ_BLOCKS + 1}"
        # The segments of the same range: a block they index that is not stored was deleted (damage), not skipped.
        swhere, sargs = "", []
        if start is not None:
            swhere += " AND s.step >= ?"
            sargs.append(start)
        if stop is not None:
            swhere += " AND s.step < ?"
            sargs.append(stop)
        if mask:
            swhere += f" AND s.kinds & {mask} != 0"
        after = -(2**62)
        expect = None
        while True:
            with self._read() as conn:
                rows = conn.execute(sql, [*args, after]).fetchall()
                # Up to the next chunk's first block (or the end): holes between the blocks read and after them.
                upto = rows[_READ_BLOCKS][0] - 1 if len(rows) > _READ_BLOCKS else 2**62
                if expect is None or (rows and rows[0][0] == expect):
                    self._missing_block(conn, after, upto, swhere, sargs)
            if expect is not None and (not rows or rows[0][0] != expect):
                raise replay.IncompleteHistory(
                    f"{self.path}: retention deleted the events from seq {expect} on while they were being read "
                    f"(the iteration had reached seq {after}); read again from a step still kept (steps())"
                )
            if not rows:
                return
            expect = rows[_READ_BLOCKS][0] if len(rows) > _READ_BLOCKS else None
            for seq, step, payload in rows[:_READ_BLOCKS]:
                yield from self._decode(seq, step, payload, wanted, start, stop)
            if expect is None:
                return
            after = rows[_READ_BLOCKS - 1][0]

    def _decode(self, seq, step, payload, wanted=None, lo=None, hi=None, last=None) -> list[ev.Event]:
        # Whatever a damaged payload makes the decoder raise (numpy's dtype parser raises SyntaxError, a huge
        # length OverflowError or MemoryError, a deep JSON document RecursionError): one block, one try.
        try:
            return _decode_block(payload, seq, step, self._classes, wanted, lo, hi, last)
        except Exception as exc:
            raise RecordingError(
                f"{self.path}: the events of the block at seq {seq} cannot be decoded ({type(exc).__name__}: {exc})"
            ) from exc

    def _missing_block(self, conn, after: int, upto: int, where: str = "", args: Sequence = ()) -> None:
        """Raise ``RecordingError`` when a segment with ``after < seq <= upto`` (and ``where``) indexes a block that
        is not stored: its events were deleted (not by retention, which deletes a block with its segments)."""
        row = conn.execute(
            f"SELECT s.block FROM segments s WHERE s.seq > ? AND s.seq <= ?{where} "
            "AND NOT EXISTS (SELECT 1 FROM blocks b WHERE b.seq = s.block) ORDER BY s.seq LIMIT 1",
            (after, upto, *args),
        ).fetchone()
        if row is not None:
            last = conn.execute("SELECT max(last) FROM segments WHERE block = ?", (row[0],)).fetchone()[0]
            raise RecordingError(
                f"{self.path}: the events of seq {row[0]}..{last} are missing (their block is indexed in segments "
                "but not stored): the recording is damaged"
            )

    def state_at(self, step: int) -> ReplayState:
        """Pages and ledger at step ``step``: the nearest snapshot at or before it plus the events up to that
        step's boundary (``instrumented_alloc.replay``). ValueError when the step is not in the recording (or
        retention removed it); ``replay.IncompleteHistory`` when events between the base and the step were lost,
        the step's own boundary among them; ``RecordingError`` naming the file when what the replay needs is
        damaged (a snapshot that does not decode or does not match the run's pools, events indexed but not stored,
        a replay that does not end at the step's boundary): never the state of another step."""
        step = int(step)
        with self._read() as conn:
            end = conn.execute(
                "SELECT max(boundary) FROM segments WHERE step = ? AND boundary IS NOT NULL", (step,)
            ).fetchone()[0]
            if end is None:
                row = conn.execute("SELECT max(seq) FROM snapshots WHERE step = ?", (step,)).fetchone()
            else:
                row = conn.execute(
                    "SELECT max(seq) FROM snapshots WHERE seq <= ? AND step <= ?", (end, step)
                ).fetchone()
            base_seq = row[0]
            if base_seq is None:
                first, last = self._steps(conn)
                if first is not None and first <= step <= last:
                    # Inside the range, yet no boundary: the batch that carried it was refused (the queue was full).
                    raise replay.IncompleteHistory(
                        f"{self.path}: step {step}: its step boundary was lost with the events around it (the "
                        f"recorder's queue was full), so its state cannot be rebuilt (steps {first}..{last})"
                    )
                raise ValueError(
                    f"{self.path}: step {step} is not in the recording"
                    + (" (it has no snapshot)" if first is None else f" (steps {first}..{last})")
                )
            snap_rows = conn.execute(
                "SELECT step, pool, num_pages, owner, ledger FROM snapshots WHERE seq = ? ORDER BY rowid", (base_seq,)
            ).fetchall()
            rows = []
            if end is not None:
                with self._parsing("the step boundaries"):
                    end = int(end)
                # From the block holding the first event after the base (blocks do not overlap) to the one
                # holding the boundary; blocks with no state-changing event are skipped. Every block the segments
                # index in that range must be there.
                lo = conn.execute("SELECT max(seq) FROM blocks WHERE seq <= ?", (base_seq + 1,)).fetchone()[0]
                self._missing_block(conn, base_seq, end)
                rows = conn.execute(
                    "SELECT seq, step, payload FROM blocks WHERE seq >= ? AND seq <= ? AND kinds & ? != 0 "
                    "ORDER BY seq",
                    (base_seq + 1 if lo is None else lo, end, self._state_mask),
                ).fetchall()
        state = self._base(base_seq, snap_rows, self._pool_names)
        events = (e for s, st, p in rows for e in self._decode(s, st, p, self._state_classes, last=end))
        try:
            state = replay.apply(state, events, inplace=True)
        except replay.IncompleteHistory as exc:
            raise replay.IncompleteHistory(f"{self.path}: step {step}: {exc}") from exc
        except RecordingError:
            raise
        except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
            # Events that do not fit the state (a pool the base lacks, pages outside a pool): damaged history.
            raise RecordingError(f"{self.path}: step {step} cannot be replayed from the snapshot at seq "
                                 f"{base_seq}: {exc}") from exc
        if end is not None and (state.seq != end or state.step != step):
            raise RecordingError(
                f"{self.path}: step {step}: the replay from the snapshot at seq {base_seq} ended at seq {state.seq} "
                f"(step {state.step}), not at the step's boundary (seq {end}): the events of seq "
                f"{state.seq + 1}..{end} are missing or damaged"
            )
        if end is None and state.step != step:
            raise RecordingError(f"{self.path}: the snapshot at seq {base_seq} of step {step} says step {state.step}")
        return state

    def _base(self, seq: int, rows, pools: Iterable[str]) -> ReplayState:
        """The state a snapshot's rows hold, checked against the run's pools (meta ``pools``: names; each owner
        array as long as its row's ``num_pages`` says) and the shape the writer gives its ledger document."""
        try:
            names = sorted(pools)
            got = sorted(r[1] for r in rows)
            if got != names:
                raise ValueError(f"it holds pools {got}, the run has {names}")
            owners = {}
            for _, pool, num_pages, owner, _ in rows:
                if not isinstance(owner, bytes):
                    raise ValueError(f"the owner array of pool {pool!r} is not a blob")
                a = _decode_owner(owner)
                if not _is_int(num_pages) or a.size != num_pages + 1:
                    raise ValueError(f"pool {pool!r} has {a.size} owner entries for {num_pages!r} pages")
                owners[pool] = a
            ledger_blob = rows[0][4]
            if not isinstance(ledger_blob, bytes):
                raise ValueError("the ledger is not a blob")
            doc = _unpack(ledger_blob)
            if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or not isinstance(
                doc.get("slot_rids"), list
            ):
                raise ValueError("the ledger document is not {rows, slot_rids}")
            ledger, slot_rids, rid_slots = {}, {}, {}
            for r in doc["rows"]:
                if not (isinstance(r, list) and len(r) == 5 and _is_stored_rid(r[0]) and all(map(_is_int, r[1:]))):
                    raise ValueError(f"a ledger row is not [request id, slot, allocated, committed, evicted]: "
                                     f"{_short(r)}")
                rid, slot, a, c, x = r
                ledger[rid] = replay.LedgerRow(a, c, x)
                rid_slots[rid] = slot  # the live requests' own slots
            for r in doc["slot_rids"]:
                if not (isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and _is_stored_rid(r[1])):
                    raise ValueError(f"a slot owner is not [slot, request id]: {_short(r)}")
                slot_rids[r[0]] = r[1]
            for rid, slot, _, _, _ in doc["rows"]:  # the ledger's own slots name their requests
                slot_rids[slot] = rid
            step = rows[0][0]
            if not _is_int(step) or any(r[0] != step for r in rows):
                raise ValueError(f"its rows' steps differ or are not integers ({_short([r[0] for r in rows])})")
        except Exception as exc:  # whatever the stored bytes make the decoders raise (RecursionError included)
            raise RecordingError(
                f"{self.path}: the snapshot at seq {seq} cannot be used ({type(exc).__name__}: {exc})"
            ) from exc
        return ReplayState(
            step=step, seq=int(seq), owners=owners, ledger=ledger, slot_rids=slot_rids, rid_slots=rid_slots
        )

    # -- aggregates and ranges (for front ends such as the dashboard: SQL does the counting, nothing here loads
    # the whole recording) ------------------------------------------------------------------------------------
    def event_count(self) -> int:
        """Number of stored events (retention and lost events excluded)."""
        with self._read() as conn, self._parsing("the event count"):
            return int(conn.execute("SELECT coalesce(sum(n), 0) FROM blocks").fetchone()[0])

    def violation_counts(self, start: int | None = None, stop: int | None = None) -> dict[str, int]:
        """Invariant id -> number of violations with ``start <= step < stop``, most frequent first."""
        where, args = _step_range(start, stop)
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT invariant, count(*) AS n FROM violations{where} GROUP BY invariant ORDER BY n DESC, invariant",
                args,
            ).fetchall()
        return {i: int(n) for i, n in rows}

    def step_series(self, start: int | None = None, stop: int | None = None, *, max_points: int = 2000) -> list:
        """``(step, available)`` of the step boundaries with ``start <= step < stop`` (``available``: pool ->
        free + staged pages, as ``StepBoundary`` carries it), at most ``max_points``: when there are more
        boundaries, every k-th step counted from the first (k the smallest stride that fits)."""
        where, args = _step_range(start, stop)
        where += (" AND " if where else " WHERE ") + "boundary IS NOT NULL"
        max_points = max(1, int(max_points))
        with self._read() as conn:
            lo, hi, n = conn.execute(f"SELECT min(step), max(step), count(*) FROM segments{where}", args).fetchone()
            if not n:
                return []
            with self._parsing("the step boundaries"):
                lo, hi = int(lo), int(hi)
            stride = max(1, -(-(hi - lo + 1) // max_points))
            rows = conn.execute(
                f"SELECT step, available FROM segments{where} AND (step - ?) % ? = 0 ORDER BY step, boundary",
                [*args, lo, stride],
            ).fetchall()
        out = {}
        with self._parsing("the step boundaries"):
            for step, available in rows:
                out[int(step)] = json.loads(available)  # the last boundary wins
            return sorted(out.items())

    def event_counts(
        self, kinds: Iterable, start: int | None = None, stop: int | None = None, *, bucket: int = 1
    ) -> dict[str, list[tuple[int, int]]]:
        """Kind name -> ``[(first step of the bucket, events), ...]`` for events with ``start <= step < stop``,
        counted per bucket of ``bucket`` steps (buckets aligned to multiples of ``bucket``; empty ones omitted)."""
        names = [k if isinstance(k, str) else k.__name__ for k in kinds]
        bucket = max(1, int(bucket))
        out: dict[str, list] = {n: [] for n in names}
        codes = {str(self._codes[n]): n for n in names if n in self._codes}
        if not codes:
            return out
        where, args = _step_range(start, stop)
        with self._read() as conn:
            sets = self._kindsets(conn, self._mask(names))
            if not sets:
                return out
            where += (" AND " if where else " WHERE ") + f"kinds IN ({','.join(map(str, sets))})"
            sql = f"SELECT (step / ?) * ? AS b, counts FROM segments{where}"
            rows = conn.execute(sql, [bucket, bucket, *args]).fetchall()
        per: dict[str, dict] = {n: {} for n in names}
        with self._parsing("the event counts"):
            for b, counts in rows:
                for code, n in json.loads(counts).items():
                    name = codes.get(code)
                    if name is not None:
                        d = per[name]
                        d[b] = d.get(b, 0) + n
            for name, d in per.items():
                out[name] = sorted((int(b), int(n)) for b, n in d.items())
        return out

    def request_span(self, rid) -> tuple[int, int] | None:
        """(first, last) step of the events and violations stored under request id ``rid`` (events of one
        request: ledger writes, SWA evictions, release, violations, and calls for that request alone; a batch
        call for several requests is stored without a request id). None when there is none."""
        rid = _rid(rid)
        with self._read() as conn:
            a = conn.execute("SELECT min(step), max(step) FROM rids WHERE rid = ?", (rid,)).fetchone()
            b = conn.execute("SELECT min(step), max(step) FROM violations WHERE rid = ?", (rid,)).fetchone()
        lows = [x for x in (a[0], b[0]) if x is not None]
        highs = [x for x in (a[1], b[1]) if x is not None]
        with self._parsing(f"the steps of request {rid!r}"):
            return (int(min(lows)), int(max(highs))) if lows else None


def _step_range(start, stop) -> tuple[str, list]:
    conds, args = [], []
    if start is not None:
        conds.append("step >= ?")
        args.append(int(start))
    if stop is not None:
        conds.append("step < ?")
        args.append(int(stop))
    return (" WHERE " + " AND ".join(conds) if conds else ""), args
