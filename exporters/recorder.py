"""The flight recorder: an ``InstrumentedAllocator``'s events, violations and periodic page snapshots in one
SQLite file (``FlightRecorder``), and its reader (``Recording``).

Contracts (writer, ``FlightRecorder(alloc, path, ...)``):
- Threads: the sink (``FlightRecorder.__call__``, bus name ``"recorder"``) runs on the engine thread, inside the
  allocator call that produced the batch. It never blocks and never raises: it puts the batch (each frozen event as
  its class and instance dict, whose arrays the wrapper copied for it, in one flat list) on a bounded queue
  (``_Queue``: a deque with a bound; ``queue.Queue``'s lock and condition cost more than the rest of the sink)
  without waiting, and returns False when the queue is full or the recorder stopped, so the bus counts the refused
  events in ``alloc.bus.dropped["recorder"]``.
  On a ``StepBoundary`` whose step is a multiple of ``snapshot_every`` (or when a snapshot is due: after lost events,
  or when retention wants a newer base) it also takes ``alloc.snapshot()`` (host copies of the owner arrays) and
  queues it with the boundary's seq (``snapshot(wait=False)``: deferred device checks still in flight are not
  waited for; their page changes come in later events). A background writer thread owns the SQLite connection
  and does all encoding (off the engine's call path) and I/O. Construct and ``close()`` on the engine thread (or
  while no allocator call is in flight); ``close()`` also runs at interpreter exit if it was not called.
- File (format version 4): SQLite in WAL mode (a ``Recording`` can follow it while it is written), tables
  ``meta``, ``blocks``, ``segments``, ``kindsets``, ``rids``, ``violations``, ``snapshots`` (see ``_SCHEMA``).
  Events are stored in blocks, one row each: consecutive events of one or more steps (at most ``_BLOCK_EVENTS``;
  a block is closed before every commit, and a snapshot's step boundary starts a new one), encoded together, kind
  by kind (``_BlockWriter``), with their seq and step range, event count and kinds. ``segments`` holds one row
  per step of a block (the block's events of that step, with at most one step boundary) with the columns the
  queries need (seq range, step, event count, kinds and count per kind, the boundary's seq and ``available``,
  the block), so that they never read a payload; ``rids`` holds (block, request id, step) for the events stored
  under one request id. A reader opens version 4 only: another version raises ``RecordingVersionError`` naming
  the file and both versions (``overwrite=True`` may still replace such a file). ``close()`` switches a finished
  file back to a single-file rollback journal when no reader holds it. Schema and initial snapshot (the state
  when recording started, so that replay always has a base) are committed before the constructor returns. An
  existing recording at ``path`` is replaced only with ``overwrite=True``; any other existing file is never
  replaced. Two writers on one path (started at once, or an ``overwrite=True`` while another writes): one
  records, the other gets ``RecorderError`` (the file is created with ``O_EXCL`` and ``flock``-ed until
  ``close()``; see ``_claim_path``). A file a writer left before its first commit (empty, or SQLite with none of
  a recording's metadata) is taken over. A symlink is recorded through (its target is the file).
- Ordering: events are written in ``seq`` order, each batch and its snapshot in one transaction. A violation is
  committed as soon as it is written; other events are committed every ``flush_interval`` seconds or every
  ``_COMMIT_ROWS`` rows, whichever comes first. Durability: ``synchronous=NORMAL``: a killed process loses nothing
  committed; a power loss may lose the last transactions, never the file's consistency.
- Dropped: when the queue is full the batch is refused (counted by the bus) and an ``EventsLost`` marker is written
  before the next accepted batch; replay cannot cross it, so the next step boundary takes a fresh snapshot.
  The wrapper's own ``Snapshot`` events are not stored (the recorder takes its own). Violations from before the
  recorder was attached are not in the file.
- Retention: ``max_events`` / ``max_bytes`` (``(page_count - freelist_count) * page_size`` of the main file, the
  WAL aside) delete the oldest events and the snapshots before the newest snapshot that is older than every kept
  event, so ``state_at`` works for every kept step; the file shrinks through incremental vacuum. The violations
  table keeps the run's first ``FIRST_VIOLATIONS_KEPT`` and, of the rest, the newest within a share of the bound
  (half of ``max_events`` rows, a quarter of ``max_bytes``); the others are deleted and counted in the meta key
  ``violations_dropped``. It is a soft bound: events after the newest usable snapshot are never deleted (the
  recorder asks for a snapshot when half the event budget, or a quarter of the byte budget, has been written since
  the last).
- Faults: an unwritable path (or an existing file that is not a recording we may replace) raises
  ``RecorderError`` naming the path at construction. Any error of the writer later (disk full, I/O error, the file
  deleted or replaced under it) stops recording: one warning on the ``instrumented_alloc.recorder`` logger, the
  sink refuses every later batch (``alloc.bus.dropped["recorder"]`` grows), events that were queued or not yet
  committed are counted in ``lost_events``, which the recorder registers with the bus (``add_loss_counter``), so
  ``bus.drop_counts()["recorder"]`` and ``kvalloc_events_dropped_total{sink="recorder"}`` count every event it
  was handed and did not store; the allocator never sees an exception. Readers keep what was committed. A
  recorder that fails while it is being built removes the file it started (no half-made file is left to block
  the path).

Contracts (reader, ``Recording(path)``): read-only (SQLite ``mode=ro``); every query runs in its own read
transaction, so a reader opened while the writer runs sees each new commit. A file that is not a recording (not
SQLite, empty, SQLite without our tables or format) raises ``RecordingError`` (a ``ValueError``) naming the file;
a missing file ``RecordingNotFoundError`` (also a ``FileNotFoundError``). A recording cut off mid-write (killed
writer) reads up to its last complete transaction. ``state_at`` follows ``instrumented_alloc.replay``'s contract.
A damaged recording raises ``RecordingError`` naming the file, never a bare exception and never another step's
state: at open, the meta values the readers use (types, the kinds every recording holds, the pools) and a few index
seeks (the first and last blocks indexed in ``segments``, kind codes within meta ``kinds``); a block that does not
decode (the block's seq named); a snapshot that does not decode or does not match the run's pools (one row per
pool, owner arrays of ``num_pages + 1`` entries); events indexed in ``segments`` whose block is not stored
(``events``, ``state_at``: the missing seq range named); a replay that does not end at the step's boundary. Not
detected: a block deleted together with its ``segments`` rows in the middle of the history, a payload altered into
another valid one (there is no checksum), emptied ``rids``.
Request ids round-trip when they are ``str`` or ``int``; other ids are stored as their ``repr``.
Fields added to an event class after files were written (at the class's end, with a default: ``StepBoundary``'s
``overhead`` and ``iteration_seconds``) read as their default from a block written without them; a block with
fewer fields than that, or more than the class has, is damaged.

Hashed request ids (``hash_request_ids=``: a ``instrumented_alloc.redact.RequestIdHasher``, a key, or True for a
random key): every request id is stored as its pseudonym (``h:`` + 16 hex digits), wherever it would be stored:
the events' ``rid``/``rids`` (and the ``rid`` column), the violations' ``rid`` column and the request id in their
messages (also inside the stored ``ViolationEvent``), the snapshots' ledger rows and slot owners. One function
(``RequestIdHasher.event_fields``, and ``.snapshots`` for snapshots) maps what the writer is handed before it is
encoded. The run metadata says so (``request_ids``: the hasher's ``scheme``, never its key; ``{"scheme": "raw"}``
otherwise). Readers need nothing: replay, ``state_at`` and the dashboard key requests by the id stored, and
``request_span`` takes the pseudonym.
"""

from __future__ import annotations

import array
import atexit
import bisect
import collections
import contextlib
import dataclasses
import fcntl
import itertools
import json
import logging
import operator
import os
import queue
import re
import sqlite3
import struct
import sys
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

import instrumented_alloc
from instrumented_alloc import events as ev
from instrumented_alloc import replay
from instrumented_alloc.invariants import Violation
from instrumented_alloc.redact import as_hasher
from instrumented_alloc.replay import EventsLost, ReplayState

logger = logging.getLogger("instrumented_alloc.recorder")

FORMAT = "instrumented-alloc-recording"
# 2: events stored in blocks (about one row per step); 3: a block's timestamps packed as float64; 4: a block spans
# several steps and is encoded kind by kind, column by column; one ``segments`` row per step of a block.
FORMAT_VERSION = 4
SINK_NAME = "recorder"

_COMMIT_ROWS = 5000  # events written since the last commit that force one
_COMPRESS_OVER = 4096  # block bodies larger than this many bytes are deflated
_PACK_COMPRESS_OVER = 512  # snapshot ledger documents larger than this many bytes are zlib-compressed
_BLOCK_EVENTS = 512  # events of one block at most (a block is also closed before every commit)
_READ_BLOCKS = 200  # blocks per read transaction of Recording.events
# Retention of the violations table (see FlightRecorder._trim_violations): the first violations of a run are never
# deleted, and a row's size is estimated as its text plus this many bytes (rowid, integers, record header, cell).
FIRST_VIOLATIONS_KEPT = 100
_VIOLATION_ROW_OVERHEAD = 48
_INSERT_ROWS = 64  # encoded blocks the writer buffers before one executemany
_POLL = 0.05  # seconds between the writer's looks at the queue when nothing woke it
_CLOCK_EVERY = 32  # queued batches the writer takes from a backlog between two reads of the clock

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE blocks (
    seq INTEGER PRIMARY KEY, last INTEGER NOT NULL, step INTEGER NOT NULL, last_step INTEGER NOT NULL,
    n INTEGER NOT NULL, kinds INTEGER NOT NULL, payload BLOB NOT NULL
);
CREATE TABLE segments (
    seq INTEGER PRIMARY KEY, last INTEGER NOT NULL, step INTEGER NOT NULL, n INTEGER NOT NULL,
    kinds INTEGER NOT NULL, counts TEXT NOT NULL, boundary INTEGER, available TEXT, block INTEGER NOT NULL
);
CREATE INDEX segments_step ON segments (step, block);
CREATE INDEX segments_boundary ON segments (step, boundary, available) WHERE boundary IS NOT NULL;
CREATE INDEX segments_kinds ON segments (kinds, step, counts);
CREATE TABLE kindsets (kinds INTEGER PRIMARY KEY);
CREATE TABLE rids (block INTEGER NOT NULL, rid NOT NULL, step INTEGER NOT NULL);
CREATE INDEX rids_rid ON rids (rid, step);
CREATE TABLE violations (
    seq INTEGER PRIMARY KEY, step INTEGER NOT NULL, ts REAL NOT NULL, invariant TEXT NOT NULL,
    severity TEXT NOT NULL, pool TEXT, rid, op TEXT NOT NULL, message TEXT NOT NULL, trace_id TEXT
);
CREATE INDEX violations_step ON violations (step);
CREATE TABLE snapshots (
    seq INTEGER NOT NULL, step INTEGER NOT NULL, pool TEXT NOT NULL, num_pages INTEGER NOT NULL,
    page_size INTEGER NOT NULL, owner BLOB NOT NULL, ledger BLOB NOT NULL, PRIMARY KEY (seq, pool)
);
CREATE INDEX snapshots_step ON snapshots (step);
"""
_TABLES = frozenset({"meta", "blocks", "segments", "kindsets", "rids", "violations", "snapshots"})
# The segments' indexes answer the readers' aggregates without reading the blocks' payloads: segments_step
# (step, block) the step ranges and the blocks holding a step range (events), segments_boundary the step boundaries
# (state_at, steps, step_series), segments_kinds with kindsets (every ``kinds`` bit set a segment has) event_counts
# by seeks, not scans. Blocks are found by seq (their primary key).
# Event kinds that change the replayed state (replay.py); blocks without any are skipped by state_at's query.
_STATE_KINDS = ("PageUpdate", "LedgerUpdate", "LedgerWrite", "RequestReleased", "StepBoundary", "EventsLost")
_RESERVED_META = frozenset(
    {
        "format",
        "format_version",
        "recorder_version",
        "pools",
        "page_size",
        "sliding_window",
        "mode",
        "allocator",
        "start_time",
        "end_time",
        "initial_step",
        "snapshot_every",
        "max_events",
        "max_bytes",
        "events_dropped",
        "events_lost",
        "violations_dropped",
        "failure",
        "request_ids",
        "kinds",
    }
)


class RecorderError(OSError):
    """The flight recorder cannot write its file (raised at construction only)."""


class RecordingError(ValueError):
    """The file is not a readable flight recording (the message names the file)."""


class RecordingNotFoundError(RecordingError, FileNotFoundError):
    """There is no file at the recording's path."""


class RecordingVersionError(RecordingError):
    """The file is a flight recording in a format version this reader does not read (the message names the file,
    its version and the reader's)."""


# -- codec ------------------------------------------------------------------------------------------------------
def _event_classes() -> dict[str, type]:
    out = {}
    for obj in vars(ev).values():
        if isinstance(obj, type) and issubclass(obj, ev.Event) and obj is not ev.Event:
            out[obj.__name__] = obj
    out[EventsLost.__name__] = EventsLost
    return out


_KINDS = _event_classes()
# A kind's code in the files this writer makes: its index in this list (stored in meta "kinds"; a reader uses the
# file's list, so kinds added later get new codes without a format change). Bit ``code`` of ``blocks.kinds``.
_KIND_NAMES = tuple(sorted(_KINDS))
_FIELDS: dict[type, tuple] = {}


def _classes_of(kind_names: Sequence[str]) -> list:
    """The event class of each kind code of a file (None for a kind this reader does not know)."""
    return [_KINDS.get(k) for k in kind_names]


_CLASSES = _classes_of(_KIND_NAMES)


def _fields_of(cls: type) -> tuple:
    """(name, is_tuple, is_float) of the payload fields of an event class (seq/ts/step are columns)."""
    f = _FIELDS.get(cls)
    if f is None:
        f = tuple(
            (x.name, x.type in ("tuple", tuple), x.type in ("float", float))
            for x in dataclasses.fields(cls)
            if x.name not in ("seq", "ts", "step")
        )
        _FIELDS[cls] = f
    return f


def _stored_fields_min(cls: type) -> int:
    """The fewest payload fields a stored group of ``cls`` may hold: up to its last field without a default. The
    fields after it were added later with a default (``StepBoundary``'s self-cost): a file written before reads
    them as that default."""
    n = _MIN_FIELDS.get(cls)
    if n is None:
        fs = [x for x in dataclasses.fields(cls) if x.name not in ("seq", "ts", "step")]
        missing = dataclasses.MISSING
        n = max((i + 1 for i, x in enumerate(fs) if x.default is missing and x.default_factory is missing), default=0)
        _MIN_FIELDS[cls] = n
    return n


_MIN_FIELDS: dict[type, int] = {}


def _rid(r):
    """A request id as stored: str and int as they are (an int beyond SQLite's 64 bits, e.g. ``uuid4().int``, as
    its decimal text), None as NULL, anything else as its repr."""
    if r is None or isinstance(r, str):
        return r
    if isinstance(r, int) and not isinstance(r, bool):
        return r if -(1 << 63) <= r < (1 << 63) else str(r)
    if isinstance(r, np.integer):
        return int(r)
    return repr(r)


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return repr(o)


def _dumps(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":"), default=_json_default).encode()


def _violation_doc(v: Violation) -> dict:
    d = dataclasses.asdict(v)
    d["rid"] = _rid(v.rid)
    return d


def _pack(doc) -> bytes:
    """A JSON document as a blob: b"Z" + zlib(json) or b"R" + json."""
    data = _dumps(doc)
    if len(data) > _PACK_COMPRESS_OVER:
        z = zlib.compress(data, 1)
        if len(z) < len(data):
            return b"Z" + z
    return b"R" + data


def _unpack(blob: bytes):
    tag, body = blob[:1], blob[1:]
    if tag == b"Z":
        body = zlib.decompress(body)
    elif tag != b"R":
        raise ValueError(f"unknown blob encoding {tag!r}")
    return json.loads(body)


def _tuplify(v):
    return tuple(_tuplify(x) for x in v) if isinstance(v, list) else v


_C_ENCODER = (
    json.encoder.c_make_encoder(
        None, _json_default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )
    if json.encoder.c_make_encoder is not None
    else None
)
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_json_default)


def _json(doc) -> str:
    """Compact JSON (the C encoder built once: ``json.dumps`` builds one per call)."""
    if _C_ENCODER is None:
        return _ENCODER.encode(doc)
    return "".join(_C_ENCODER(doc, 0))


_I2_MIN, _I2_MAX = -(2**15), 2**15 - 1
_I4_MIN, _I4_MAX = -(2**31), 2**31 - 1
_LE = {"<i2": np.dtype("<i2"), "<i4": np.dtype("<i4"), "<i8": np.dtype("<i8")}


class _Plan:
    """How the writer stores one event class: ``row`` reads seq, step, the timestamp and each field (in dataclass
    order) from an instance dict, and each field's role (``roles``, in field order): ``_ARRAY``
    (annotated ``Any``: may hold arrays), ``_FLOAT`` (annotated ``float``), ``_RID``, ``_RIDS``, ``_VIOLATION``,
    ``_AVAILABLE`` (a step boundary's) or ``_PLAIN``."""

    __slots__ = ("boundary", "code", "roles", "row")

    def __init__(self, cls: type):
        self.code = _KIND_NAMES.index(cls.__name__)
        fields = [f for f in dataclasses.fields(cls) if f.name not in ("seq", "ts", "step")]
        # All the columns of one dict in one call: map(row, dicts) transposed by zip is a quarter cheaper than one
        # map per column (the timestamps too: one map of the dicts fewer per kind).
        self.row = operator.itemgetter("seq", "step", "ts", *[f.name for f in fields])
        self.boundary = cls is ev.StepBoundary
        roles = []
        for f in fields:
            if f.name == "rid":
                roles.append(_RID)
            elif f.name == "rids":
                roles.append(_RIDS)
            elif f.name == "violation":
                roles.append(_VIOLATION)
            elif f.name == "available" and self.boundary:
                roles.append(_AVAILABLE)
            elif f.type in ("Any", Any):
                roles.append(_ARRAY)
            elif f.type in ("float", float):
                roles.append(_FLOAT)
            else:
                roles.append(_PLAIN)
        self.roles = tuple(roles)


_PLAIN, _ARRAY, _FLOAT, _RID, _RIDS, _VIOLATION, _AVAILABLE = range(7)
_PLANS: dict[type, _Plan] = {}
_NONE_TYPE = type(None)
_RID_TYPES = frozenset({str, int, _NONE_TYPE})  # request ids stored as they are (bool is not among them)
_STR_TYPE = frozenset({str})
_INT_TYPE = frozenset({int})
# int and numpy's integer types (what the wrapper's counts are): int() of each is its value. bool is not among them.
_INTEGER_TYPES = frozenset({int, *(np.dtype(c).type for c in "bhilqBHILQ")})
_BOUNDARY, _VIOLATION_EVENT = ev.StepBoundary, ev.ViolationEvent
_SEQ_OF = operator.attrgetter("seq")


def _plan(cls: type) -> _Plan:
    p = _PLANS.get(cls)
    if p is None:
        p = _PLANS[cls] = _Plan(cls)
    return p


class _BlockWriter:
    """The events of one block as they are added (writer thread: ``add``, or ``groups``/``n`` directly), then its
    row (``row()``) and its segments.

    A block holds consecutive events (of one or more steps; steps never decrease with seq) and at most
    ``_BLOCK_EVENTS`` events. ``add`` only files an event's instance dict under its class; ``row()`` encodes the
    block kind by kind, column by column (C-level maps, zips and numpy, not a Python loop per event).
    Its events are cut into segments: the consecutive events of one step in the block, with at most one
    ``StepBoundary`` (its seq and ``available``, as JSON); each segment is a row of the ``segments`` table
    (``segments``, filled by ``row()``), which the queries read instead of the payloads.
    Its payload: b"D" + raw deflate of the body (level 1, ending in a full flush) when that pays (bodies over
    ``_COMPRESS_OVER`` bytes), else b"B" + body;
    body = u32 header length + header JSON + the floats stored out of line (little-endian float64, ``f`` of them)
    + each event's seq and step offsets (little-endian, dtype ``x``) + the little-endian bytes of every array of
    the block, concatenated.
    Header: ``g``: one ``[code, n, ts, [entry per field]]`` per kind of the block (fields in dataclass order), its
    ``n`` events in seq order; ``ts``: 0 when its timestamps are floats stored out of line, else their JSON list;
    a field's entry: 0 when every value is out of line (a field annotated ``float``: its floats; else its arrays);
    a list: the values in JSON (a request id through ``_rid``, a violation as its dict); ``{"r": [...]}`` (a
    ``rids`` field): a tuple as its index in ``r``, an int as its repr, anything else as it is; ``{"m": [...],
    "v": [...]}``: 1 where the value is out of line, else 0 and the value in ``v``.
    The out-of-line floats, offsets and arrays are taken kind by kind in ``g``'s order: for each kind its
    timestamps (when 0), then its float fields' floats, field by field; its ``n`` seq offsets (seq - the block's
    first seq), then its ``n`` step offsets (step - the block's step); its array fields' arrays, field by field.
    ``f``: the count of out-of-line floats; ``x``: the dtype of the offsets;
    ``r``: the distinct ``rids`` tuples of the block, each once (by its JSON: each request id through ``_rid``);
    ``a``: ``[dtype, stored dtype, shape]`` per array, in order, or, when every array is 1-D and integer,
    ``[stored dtype, [dtype per array], [length per array]]``. Seq and step are the row's columns (a copy with
    both shifted reads as shifted). Integer arrays are stored together, as int16, int32 or int64: the narrowest
    that holds every value of the block. (Timestamps are binary because the shortest repr of a float, which JSON
    writes, costs more than the rest of an event's encoding; durations likewise.)"""

    __slots__ = ("chunks", "first", "n", "rid_cache", "rids", "segments", "skip", "step")

    def __init__(self, step: int, first: int, rid_cache: dict | None, skip: type | None = None):
        self.step = step  # the step and seq of the block's first event (row() sets them from its events)
        self.first = first
        self.chunks: list = []  # flat [class, instance dict, ...] lists (sequences), in seq order
        self.n = 0  # events in chunks (row() leaves out those of class ``skip``)
        self.skip = skip
        self.segments: list = []  # filled by row()
        self.rids: set = set()  # (request id, step) the block's events are stored under (the rids table): row()
        self.rid_cache = rid_cache

    def add(self, cls: type, d: Mapping) -> None:
        """Add one event given as its class and instance dict (in seq order)."""
        self.chunks.append((cls, d))
        self.n += 1

    def _groups(self) -> dict:
        """Event class -> its instance dicts in seq order, from ``chunks`` (C-level slices, chains and a numpy
        sort: no Python work per event), without the events of class ``skip``."""
        chunks = self.chunks
        flat = chunks[0] if len(chunks) == 1 else list(itertools.chain.from_iterable(chunks))
        classes, dicts = flat[0::2], flat[1::2]
        kinds = dict.fromkeys(classes)
        if len(kinds) == 1:
            groups = {classes[0]: dicts}
        else:
            local = {c: i for i, c in enumerate(kinds)}
            codes = np.fromiter(map(local.__getitem__, classes), np.intp, len(classes))
            ordered = operator.itemgetter(*np.argsort(codes, kind="stable").tolist())(dicts)
            ends = np.cumsum(np.bincount(codes, minlength=len(local))).tolist()
            groups = {c: ordered[a:b] for c, a, b in zip(kinds, [0, *ends[:-1]], ends)}
        if self.skip is not None:
            groups.pop(self.skip, None)
        self.n = sum(map(len, groups.values()))
        return groups

    def _rids_json(self, rids: tuple) -> str:
        """The JSON of a ``rids`` tuple as stored (``_rid`` of each). The writer caches it by value
        (``rid_cache``): a decode batch repeats the same requests step after step, in a tuple the scheduler may
        build anew each time. Equal tuples can differ in their elements' types (1, 1.0, True and numpy's 1 are
        equal and hash alike, and are stored differently), so a hit is taken as it is only for the very tuple
        cached, or when the cached one holds only ``str`` (nothing else compares equal to a str but a str: a
        subclass, stored as the str it is); otherwise the element types must match too."""
        cache = self.rid_cache
        types = None
        if cache is not None:
            try:
                hit = cache.get(rids)
            except TypeError:  # an unhashable request id: not cached
                hit = cache = None
            if hit is not None:
                if hit[0] is rids or hit[1] is None:
                    return hit[2]
                types = tuple(map(type, rids))
                if types == hit[1]:
                    return hit[2]
        if types is None:
            types = tuple(map(type, rids))
        kinds = set(types)
        out = _json(rids) if kinds <= _RID_TYPES else _json([_rid(r) for r in rids])
        if cache is not None:
            if len(cache) >= 4096:
                cache.clear()
            cache[rids] = (rids, None if kinds <= _STR_TYPE else types, out)
        return out

    def row(self, deflate=None) -> tuple:
        """(seq, last, step, last_step, n, kinds, payload) of the ``blocks`` table; ``segments`` then holds the
        block's rows of the ``segments`` table, (seq, last, step, n, kinds, counts, boundary, available, block),
        and ``rids`` its (request id, step) pairs. ``deflate``: the writer's raw deflate compressor
        (``_deflater()``), reused from block to block (a new one costs more than compressing a block): every block
        ends with a full flush, so each decompresses alone."""
        heads = []
        floats: list = []  # sequences of floats, concatenated
        arrays: list = []
        seqs, steps, codes = [], [], []
        rjson: list = []
        rindex: dict = {}  # id(rids tuple) -> its index in rjson (every tuple is held by the block's dicts)
        rpos: dict = {}  # a rids JSON -> its index in rjson: equal tuples are stored once
        pairs = self.rids
        available: dict = {}  # a boundary's seq -> its available, as JSON
        cached = self.rid_cache.get if self.rid_cache is not None else None
        for cls, ds in self._groups().items():
            p = _PLANS.get(cls) or _plan(cls)
            n = len(ds)
            cols = list(zip(*map(p.row, ds)))
            seq_col, step_col = cols[0], cols[1]
            seqs.append(np.array(seq_col, dtype=np.int64))
            steps.append(np.array(step_col, dtype=np.int64))
            codes.append(np.full(n, p.code, np.int64))
            ts = cols[2]
            if set(map(type, ts)) == {float}:
                floats.append(ts)
                ts = 0
            else:
                ts = list(ts)
            entries = []
            for role, col in zip(p.roles, cols[3:]):
                types = set(map(type, col))
                if role in (_ARRAY, _FLOAT):
                    kind = np.ndarray if role == _ARRAY else float
                    if types == {kind}:
                        (arrays if role == _ARRAY else floats).append(col)
                        entries.append(0)
                        continue
                    if role == _ARRAY:
                        out_of_line = [isinstance(v, np.ndarray) for v in col]
                    else:
                        out_of_line = [type(v) is float for v in col]
                    if any(out_of_line):
                        (arrays if role == _ARRAY else floats).append([v for v, m in zip(col, out_of_line) if m])
                        values = [None if m else v for v, m in zip(col, out_of_line)]
                        entries.append({"m": [int(m) for m in out_of_line], "v": values})
                        continue
                    entries.append(list(col))
                elif role == _RIDS:
                    if types == {tuple}:
                        ids = list(map(id, col))
                        single = {}  # id -> the request id of a one-request tuple
                        for k, t in dict(zip(ids, col)).items():
                            if k not in rindex:
                                # _rids_json's first case inline (the very tuple cached, or one of str only): a
                                # decode step's tuples are hits; anything else takes the call.
                                try:
                                    hit = cached(t) if cached is not None else None
                                except TypeError:  # an unhashable request id: _rids_json stores it uncached
                                    hit = None
                                if hit is not None and (hit[0] is t or hit[1] is None):
                                    js = hit[2]
                                else:
                                    js = self._rids_json(t)
                                at = rpos.get(js)
                                if at is None:
                                    at = rpos[js] = len(rjson)
                                    rjson.append(js)
                                rindex[k] = at
                            if len(t) == 1:
                                single[k] = _rid(t[0])
                        if single:
                            pairs.update((single[k], s) for k, s in zip(ids, step_col) if k in single)
                        entries.append({"r": list(map(rindex.__getitem__, ids))})
                    else:
                        values = []
                        for t, s in zip(col, step_col):
                            if type(t) is tuple:
                                if id(t) not in rindex:
                                    js = self._rids_json(t)
                                    at = rpos.get(js)
                                    if at is None:
                                        at = rpos[js] = len(rjson)
                                        rjson.append(js)
                                    rindex[id(t)] = at
                                if len(t) == 1:
                                    pairs.add((_rid(t[0]), s))
                                values.append(rindex[id(t)])
                            elif isinstance(t, int):
                                values.append(repr(t))  # an int here would read as an index into "r"
                            else:
                                values.append(t)
                        entries.append({"r": values})
                elif role == _RID:
                    if not types <= _RID_TYPES or int in types:  # int: one beyond 64 bits is stored as text
                        col = list(map(_rid, col))
                    if types != {_NONE_TYPE}:
                        pairs.update((r, s) for r, s in zip(col, step_col) if r is not None)
                    entries.append(list(col))
                elif role == _VIOLATION:
                    values = []
                    for v, s in zip(col, step_col):
                        if isinstance(v, Violation):
                            r = _rid(v.rid)
                            if r is not None:
                                pairs.add((r, s))
                            v = _violation_doc(v)
                        values.append(v)
                    entries.append(values)
                elif role == _AVAILABLE:
                    values = []
                    for av, q in zip(col, seq_col):
                        if type(av) is dict and not _INT_TYPE.issuperset(map(type, av.values())):
                            # numpy integers as ints once, here (as JSON would read them back), so that both
                            # encodings (in the payload and in the column) stay in the C encoder.
                            if _INTEGER_TYPES.issuperset(map(type, av.values())):
                                av = dict(zip(av, map(int, av.values())))
                            else:
                                av = {k: int(v) if isinstance(v, np.integer) else v for k, v in av.items()}
                        values.append(av)
                        available[q] = _json(av)
                    entries.append(values)
                else:
                    entries.append(list(col))
            heads.append([p.code, n, ts, entries])
        seq = np.concatenate(seqs)
        step = np.concatenate(steps)
        at = int(np.argmin(seq))
        first, bstep = int(seq[at]), int(step[at])
        self.first, self.step = first, bstep
        # Per kind: its n seq offsets, then its n step offsets.
        offs = np.concatenate([x for s, t in zip(seqs, steps) for x in (s - first, t - bstep)])
        lo, hi = int(_MIN(offs)), int(_MAX(offs))
        xstore = "<i4" if lo >= _I4_MIN and hi <= _I4_MAX else "<i8"
        iseg = offs.astype(xstore).tobytes()
        seg = b""
        ameta = "[]"
        if arrays:
            arrays = [a for col in arrays for a in col]
            # A step that frees many requests has hundreds of tiny arrays: the checks run per distinct dtype and
            # ndim, and the per-array work stays in C (map, set) rather than in Python loops.
            dtypes = list(map(_DTYPE_OF, arrays))
            dset = set(dtypes)
            if all(d.kind == "i" or (d.kind == "u" and d.itemsize < 8) for d in dset):
                flat_1d = set(map(_NDIM_OF, arrays)) == {1}
                if len(arrays) == 1:
                    flat = arrays[0].ravel()
                else:
                    flat = np.concatenate(arrays if flat_1d else [a.ravel() for a in arrays])
                # The ufuncs' own reduce: ndarray.min/max go through a Python wrapper that costs as much again.
                alo, ahi = (int(_MIN(flat)), int(_MAX(flat))) if flat.size else (0, 0)
                if alo >= _I2_MIN and ahi <= _I2_MAX:
                    store = "<i2"
                elif alo >= _I4_MIN and ahi <= _I4_MAX:
                    store = "<i4"
                else:
                    store = "<i8"
                seg = flat.astype(store).tobytes()
                if flat_1d:  # the JSON of [store, [dtype, ...], [length, ...]], written directly
                    names = ",".join(map({d: _dtype_json(d) for d in dset}.__getitem__, dtypes))
                    # The C encoder writes the lengths a quarter faster than a join of str()s.
                    ameta = f'["{store}",[{names}],{_json(list(map(len, arrays)))}]'
                else:
                    ameta = _json([[_dtype_str(d), store, a.shape] for d, a in zip(dtypes, arrays)])
            else:
                stores = [d.newbyteorder("<") for d in dtypes]
                seg = b"".join(np.ascontiguousarray(a, dtype=st).tobytes() for a, st in zip(arrays, stores))
                ameta = _json([[d.str, st.str, a.shape] for d, st, a in zip(dtypes, stores, arrays)])
        fseg = array.array("d")
        for f in floats:
            fseg.extend(f)
        if _BIG_ENDIAN:
            fseg.byteswap()
        head = f'{{"g":{_json(heads)},"f":{len(fseg)},"x":"{xstore}","r":[{",".join(rjson)}],"a":{ameta}}}'.encode()
        body = b"".join((struct.pack("<I", len(head)), head, fseg.tobytes(), iseg, seg))
        payload = b"B" + body
        if len(body) > _COMPRESS_OVER:
            d = deflate or _deflater()
            z = d.compress(body) + d.flush(zlib.Z_FULL_FLUSH)
            if len(z) < len(body):
                payload = b"D" + z
        self.segments, kinds = self._segments(seq, step, np.concatenate(codes), available)
        order_last = int(_MAX(seq))
        return (first, order_last, bstep, int(_MAX(step)), self.n, kinds, payload)

    def _segments(self, seq, step, codes, available: dict) -> tuple[list, int]:
        """The block's segments (see the class) and the OR of their kinds, from its events' seqs, steps and kind
        codes (in kind order): numpy finds the step changes; Python runs once per segment."""
        order = np.argsort(seq, kind="stable")
        seq, step, codes = seq[order], step[order], codes[order]
        starts = [0, *(np.flatnonzero(step[1:] != step[:-1]) + 1).tolist()]
        bseq = sorted(available)
        bpos = np.searchsorted(seq, np.array(bseq, dtype=np.int64)).tolist() if bseq else []
        if len(bpos) > 1:  # a second boundary in one segment starts a new one
            added = []
            prev = last_cut = -1
            for i in bpos:
                seg = max(starts[bisect.bisect_right(starts, i) - 1], last_cut)
                if seg == prev:
                    added.append(i)
                    last_cut = seg = i
                prev = seg
            if added:
                starts = sorted(set(starts).union(added))
        ends = [*starts[1:], len(seq)]
        bound: dict = {}  # segment index -> its boundary's seq
        for i, q in zip(bpos, bseq):
            bound[bisect.bisect_right(starts, i) - 1] = q
        seql, stepl = seq.tolist(), step.tolist()
        block = self.first
        kinds = 0
        out = []
        for j, (a, b) in enumerate(zip(starts, ends)):
            key = codes[a:b].tobytes()
            hit = _COUNTS.get(key)  # a decode step repeats the same kinds, step after step
            if hit is None:
                counts = collections.Counter(codes[a:b].tolist())
                k = 0
                for code in counts:
                    k |= 1 << code
                if len(_COUNTS) >= 1024:
                    _COUNTS.clear()
                hit = _COUNTS[key] = (k, _json(counts))
            kinds |= hit[0]
            q = bound.get(j)
            out.append(
                (seql[a], seql[b - 1], stepl[a], b - a, hit[0], hit[1], q, None if q is None else available[q], block)
            )
        return out, kinds


_DTYPE_STR: dict = {}
_DTYPE_JSON: dict = {}
_DTYPE_OF = operator.attrgetter("dtype")
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce
_NDIM_OF = operator.attrgetter("ndim")
# (kinds, counts JSON) of a segment by the bytes of its events' kind codes (int64, in seq order); any thread: the values
# only depend on the key.
_COUNTS: dict = {}
_BIG_ENDIAN = sys.byteorder == "big"


def _dtype_str(d: np.dtype) -> str:
    s = _DTYPE_STR.get(d)
    if s is None:
        s = _DTYPE_STR[d] = d.str
    return s


def _dtype_json(d: np.dtype) -> str:
    s = _DTYPE_JSON.get(d)
    if s is None:
        s = _DTYPE_JSON[d] = _json(d.str)
    return s


def _deflater():
    """A raw deflate compressor (level 1) for block payloads."""
    return zlib.compressobj(1, zlib.DEFLATED, -15)


def _decode_block(
    payload: bytes,
    first: int,
    step: int,
    classes: Sequence,
    wanted: Container | None = None,
    lo: int | None = None,
    hi: int | None = None,
    last: int | None = None,
) -> list[ev.Event]:
    """The events of one block row (inverse of ``_BlockWriter``; ``first`` and ``step``: its seq and step columns),
    in seq order; ``classes``: the event class of each kind code (``_classes_of`` the file's meta ``kinds``).
    Only those of a class in ``wanted`` (None: every class), with ``lo <= step < hi`` and ``seq <= last`` (None:
    unbounded) are built: the others' arrays are never copied out of the payload."""
    tag = payload[:1]
    if tag == b"D":
        body = zlib.decompressobj(-15).decompress(payload[1:])
    elif tag == b"B":
        body = payload[1:]
    else:
        raise ValueError(f"unknown block encoding {tag!r}")
    (n,) = struct.unpack_from("<I", body, 0)
    doc = json.loads(body[4 : 4 + n])
    groups = doc["g"]
    pos = 4 + n
    nfl = doc["f"]
    floats = np.frombuffer(body, dtype="<f8", count=nfl, offset=pos).tolist()
    pos += 8 * nfl
    total = 0
    for g in groups:
        total += g[1]
    xst = _LE.get(doc["x"]) or np.dtype(doc["x"])
    offs = np.frombuffer(body, dtype=xst, count=2 * total, offset=pos).tolist()
    pos += 2 * total * xst.itemsize
    arrays = _Arrays(body, pos, doc["a"])
    rlists = [tuple(_tuplify(r) for r in rs) for rs in doc["r"]]
    out = _decode_groups(groups, offs, floats, arrays, rlists, first, step, classes, wanted, lo, hi, last)
    out.sort(key=_SEQ_OF)
    return out


class _Arrays:
    """The arrays of a block body, each copied out (to its own dtype, native byte order) only when asked for."""

    __slots__ = ("body", "flat", "meta", "offsets")

    def __init__(self, body: bytes, pos: int, ameta):
        self.body = body
        self.flat = None
        if ameta and isinstance(ameta[0], str):  # the 1-D integer form: one run of the stored dtype
            store, dtypes, lens = ameta
            if len(dtypes) != len(lens):
                raise ValueError("block array dtypes and lengths differ in number")
            st = _LE.get(store) or np.dtype(store)
            ends = np.cumsum(np.asarray(lens, dtype=np.int64)).tolist() if lens else []
            count = ends[-1] if ends else 0
            self.flat = np.frombuffer(body, dtype=st, count=count, offset=pos)
            self.offsets = [0, *ends]
            self.meta = dtypes
            pos += count * st.itemsize
        else:
            self.meta = []
            self.offsets = []
            for dtype, store, shape in ameta:
                st = _LE.get(store) or np.dtype(store)
                count = 1
                for k in shape:
                    count *= k
                self.meta.append((dtype, st, count, tuple(shape)))
                self.offsets.append(pos)
                pos += count * st.itemsize
        if pos != len(body):
            raise ValueError(f"block arrays end at byte {pos}, the block has {len(body)}")

    def __len__(self) -> int:
        return len(self.meta)

    def __getitem__(self, i: int) -> np.ndarray:
        if self.flat is not None:
            a = self.flat[self.offsets[i] : self.offsets[i + 1]]
            return a.astype(np.dtype(self.meta[i]).newbyteorder("="))
        dtype, st, count, shape = self.meta[i]
        a = np.frombuffer(self.body, dtype=st, count=count, offset=self.offsets[i]).reshape(shape)
        return a.astype(np.dtype(dtype).newbyteorder("="))


def _decode_groups(groups, offs, floats, arrays, rlists, first, step, classes, wanted, lo, hi, last) -> list:
    make = ev.make
    out = []
    at = 0  # next seq/step offset
    fat = 0  # next out-of-line float
    aat = 0  # next array
    for code, k, ts, entries in groups:
        cls = classes[code]
        if cls is None:
            raise ValueError(f"unknown event kind code {code}")
        fields = _fields_of(cls)
        if len(entries) != len(fields):
            # A block written before fields were added to the class (at its end, with a default): those read as
            # their default (``make`` fills them in).
            if not _stored_fields_min(cls) <= len(entries) < len(fields):
                raise ValueError(f"a {cls.__name__} group has {len(entries)} fields")
            fields = fields[: len(entries)]
        dseq, dstep = offs[at : at + k], offs[at + k : at + 2 * k]
        at += 2 * k
        if len(dstep) != k:
            raise ValueError("a block has fewer seq/step offsets than events")
        # Where each field's values come from: (kind, start): "f"/"a" k out-of-line values from start; "m" the
        # mixed entry's out-of-line values from start; else JSON. Advances the float and array positions.
        if ts == 0:
            ts_at = fat
            fat += k
        elif len(ts) != k:
            raise ValueError(f"{k} {cls.__name__} events have {len(ts)} timestamps")
        plan = []
        for (_name, _is_tuple, is_float), ent in zip(fields, entries):
            if type(ent) is int:
                if ent != 0:
                    raise ValueError(f"bad field entry {ent!r}")
                plan.append(("o", fat if is_float else aat))
                if is_float:
                    fat += k
                else:
                    aat += k
            elif type(ent) is dict and "m" in ent:
                plan.append(("m", fat if is_float else aat))
                m = sum(ent["m"])
                if is_float:
                    fat += m
                else:
                    aat += m
            else:
                plan.append(("j", 0))
        if wanted is not None and cls not in wanted:
            continue
        sel = keep = range(k)
        if lo is not None or hi is not None or last is not None:
            a = -(2**62) if lo is None else lo - step
            b = 2**62 if hi is None else hi - step
            c = 2**62 if last is None else last - first
            sel = [i for i in sel if a <= dstep[i] < b and dseq[i] <= c]
            if not sel:
                continue
            keep = set(sel)
        cols = []
        for (name, is_tuple, is_float), ent, (how, start) in zip(fields, entries, plan):
            if how == "o":
                if is_float:
                    col = floats[start : start + k]
                else:
                    col = [arrays[start + i] if i in keep else None for i in range(k)]
            elif how == "m":
                col = []
                j = start
                for i, (m, v) in enumerate(zip(ent["m"], ent["v"], strict=True)):
                    if m:
                        col.append(floats[j] if is_float else (arrays[j] if i in keep else None))
                        j += 1
                    else:
                        col.append(_tuplify(v) if is_tuple and isinstance(v, list) else v)
            elif type(ent) is dict and "r" in ent:
                col = [rlists[x] if type(x) is int else (_tuplify(x) if isinstance(x, list) else x) for x in ent["r"]]
            else:
                col = ent
                if is_tuple or name in ("rid", "rids"):
                    col = [_tuplify(v) if isinstance(v, list) else v for v in col]
                elif name == "violation":
                    col = [Violation(**v) if isinstance(v, dict) else v for v in col]
            if len(col) != k:
                raise ValueError(f"{k} {cls.__name__} events have {len(col)} values of {name}")
            cols.append(col)
        tcol = floats[ts_at : ts_at + k] if ts == 0 else ts
        if len(tcol) != k:
            raise ValueError(f"a block has fewer floats than its {cls.__name__} events take")
        names = [f[0] for f in fields]
        for i in sel:
            out.append(make(cls, first + dseq[i], tcol[i], step + dstep[i], {n: c[i] for n, c in zip(names, cols)}))
    if fat != len(floats) or aat != len(arrays) or at != len(offs):
        raise ValueError("a block's fields do not take exactly the floats, arrays and offsets it holds")
    return out


def encode_event(e: ev.Event, cache: dict | None = None) -> tuple[str, object, bytes]:
    """(kind, rid, payload) of one event stored alone: its kind name, the request id it is stored under (the
    ``rids`` table: its ``rid``, its violation's, or the one request of a single-request call; else None) and a
    block payload of that one event (see ``_BlockWriter``). The writer stores blocks of many events the same way."""
    b = _BlockWriter(e.step, e.seq, cache)
    b.add(type(e), e.__dict__)
    payload = b.row()[-1]
    rid = next(iter(b.rids))[0] if b.rids else None
    return type(e).__name__, rid, payload


def decode_event(kind: str, seq: int, step: int, ts: float, payload: bytes) -> ev.Event:
    """The event ``encode_event`` stored (its kind is checked against the payload's)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    (e,) = _decode_block(payload, seq, step, _CLASSES)
    if type(e).__name__ != kind:
        raise ValueError(f"payload holds {type(e).__name__}, not {kind}")
    return e


def _encode_ledger(snaps: Mapping) -> bytes:
    first = next(iter(snaps.values()))
    led = first.ledger
    rows = [
        [_rid(r), int(s), int(a), int(c), int(x)]
        for r, s, a, c, x in zip(led.rids, led.slots, led.allocated, led.committed, led.evicted)
    ]
    slot_rids: dict = {}
    for snap in snaps.values():
        slot_rids.update(snap.slot_rids)
    return _pack({"rows": rows, "slot_rids": [[int(s), _rid(r)] for s, r in slot_rids.items()]})


def _encode_owner(owner: np.ndarray) -> bytes:
    return b"Z" + zlib.compress(np.ascontiguousarray(owner, dtype="<i4").tobytes(), 1)


def _decode_owner(blob: bytes) -> np.ndarray:
    if blob[:1] != b"Z":
        raise ValueError("unknown owner encoding")
    return np.frombuffer(zlib.decompress(blob[1:]), dtype="<i4").astype(np.int32)


# -- writer -----------------------------------------------------------------------------------------------------
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


@dataclasses.dataclass
class _Flush:
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    ok: bool = False


@dataclasses.dataclass
class _Stop:
    end_time: float
    dropped: int
    # The refused events at the end, no batch accepted after them: (first seq, last seq, ts, step of the last).
    lost: tuple | None = None


_TICK = object()


class _Queue:
    """The sink's bounded queue: a deque (append and popleft are atomic) with a bound on its length, checked by
    the producer. The engine thread is the only producer of batches; ``flush()``/``close()`` add their markers
    from any thread, so the bound is soft by at most those markers. ``maxsize`` may be changed at any time."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._items: collections.deque = collections.deque()

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item) -> None:
        if len(self._items) >= self.maxsize:
            raise queue.Full
        self._items.append(item)

    def put(self, item, timeout: float) -> None:
        """Wait (polling) up to ``timeout`` seconds for room. Never called on the engine's hot path."""
        deadline = time.monotonic() + timeout
        while len(self._items) >= self.maxsize:
            if time.monotonic() >= deadline:
                raise queue.Full
            time.sleep(0.001)
        self._items.append(item)

    def get_nowait(self):
        try:
            return self._items.popleft()
        except IndexError:
            raise queue.Empty from None


def _file_id(path: str):
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def _remove_recording(path: str) -> None:
    """Remove the file at ``path`` and its WAL and shared-memory files, those that exist (best effort: a path we
    cannot remove from stays as it is)."""
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(OSError):
            os.remove(path + suffix)


class _Tally:
    """A running total that one thread writes and others read (an int attribute: reads are atomic)."""

    __slots__ = ("n",)

    def __init__(self):
        self.n = 0


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


_TABLES = frozenset(re.findall(r"CREATE TABLE (\w+)", _SCHEMA))


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


class FlightRecorder:
    """Record ``alloc``'s events into the SQLite file ``path`` (see the module contract).

    ``snapshot_every``: steps between periodic snapshots; ``max_events`` / ``max_bytes``: retention bounds (None:
    keep everything); ``queue_size``: batches the engine thread may run ahead of the writer; ``meta``: run
    metadata stored as given (e.g. ``preset``, ``version``, ``rank``); ``clock``: wall clock for start/end times;
    ``flush_interval``: seconds between commits of ordinary events; ``overwrite``: replace an existing recording
    at ``path`` (a file that is not a recording is never replaced); ``hash_request_ids``: store every request id
    as its keyed pseudonym (a ``RequestIdHasher``, shared with the OTel exporter so both agree; a key; True: a
    random key; see the module contract).
    """

    name = SINK_NAME
    # Every kind but the wrapper's own Snapshot events (the recorder takes its own): the wrapper then builds no
    # Snapshot events unless another sink reads them.
    event_types = frozenset(c for c in _KINDS.values() if c is not ev.Snapshot and c is not EventsLost)

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
        self._flush_interval = float(flush_interval)
        self._queue = _Queue(queue_size)
        # The writer sleeps on this event, not in queue.get: an ordinary batch does not wake it (a wake-up per
        # batch makes the two threads trade the GIL on every allocator call). It wakes every _POLL seconds, or at
        # once for a violation, a half-full queue, flush() and close().
        self._wake = threading.Event()
        self._wake_at = max(1, queue_size // 2)
        # Sink state (engine thread).
        self._stopped = False
        self._closed = False
        self._next_seq: int | None = None
        self._gap_from: int | None = None
        self._gap_end: tuple | None = None
        self._due = False
        self._since_snap_queued = 0  # events queued since the last snapshot was taken
        # Writer state (writer thread); plain attributes read by others are GIL-atomic.
        self.failed: BaseException | None = None
        # Events accepted and then never committed (the writer failed): a running total, written by the writer only
        # and read by scrapes through the bus (add_loss_counter below), so kept in an object of its own: the bus
        # holds that, not the recorder.
        self._lost = _Tally()
        self._want_snapshot = False
        self._n_events = 0
        self._violations_dropped = 0  # deleted by retention (see _trim_violations)
        self._n_violations = 0  # rows written to the violations table (an upper bound on what it holds)
        self._since_snap_events = 0
        self._since_snap_bytes = 0
        self._rids_cache: dict = {}
        self._block: _BlockWriter | None = None  # the block being filled (writer thread)
        self._deflate = _deflater()
        self._rows: list = []  # encoded blocks not yet inserted (writer thread)
        self._seg_rows: list = []  # their segments
        self._rid_rows: list = []
        self._vrows: list = []
        self._kindsets: set = set()  # the kinds bit sets already in table kindsets
        self._new_kindsets: list = []

        self._path_lock: int | None = None  # see _claim_path: held until close()
        ok = False
        try:
            self._conn = self._create(overwrite, meta)
            try:
                alloc.subscribe(self)
                try:
                    snaps = alloc.snapshot()
                    self._conn.execute("BEGIN")
                    self._write_snapshot(int(alloc.step_count), 0, snaps)
                    self._conn.execute("COMMIT")
                    self._file = _file_id(self.path)
                except BaseException:
                    alloc.unsubscribe(self)
                    raise
            except BaseException as exc:
                self._conn.close()
                _remove_recording(self._real_path)  # ours since _create: a half-made file would block the path
                if isinstance(exc, (sqlite3.Error, OSError)):
                    raise RecorderError(f"cannot write flight recording {self.path!r}: {exc}") from exc
                raise
            ok = True
        finally:
            if not ok and self._path_lock is not None:
                os.close(self._path_lock)  # releases the flock
                self._path_lock = None
        lost = self._lost
        alloc.bus.add_loss_counter(SINK_NAME, lambda: lost.n)
        self._thread = threading.Thread(target=self._writer, name=f"flight-recorder:{self.path}", daemon=True)
        self._thread.start()
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
            conn = _open_writer(path)
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
            conn.executescript(_SCHEMA)
            conn.execute("BEGIN")
            conn.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)", [(k, _dumps(v).decode()) for k, v in meta.items()]
            )
            conn.execute("COMMIT")
        except BaseException as exc:
            conn.close()
            _remove_recording(real)
            if isinstance(exc, (sqlite3.Error, OSError)):
                raise RecorderError(f"cannot write flight recording {path!r}: {exc}") from exc
            raise
        return conn

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
        # queued as the bare list while the queue has room; anything else takes _queue_batch.
        if boundary is None and not urgent and items and batch[0].seq == self._next_seq:
            q = self._queue
            pending = q._items  # _Queue.put_nowait, inline (one call per allocator call)
            if len(pending) < q.maxsize:
                pending.append(items)
                self._since_snap_queued += len(batch)
                self._next_seq = batch[-1].seq + 1
                if len(pending) >= self._wake_at:
                    self._wake.set()
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
                or self._want_snapshot
                or boundary.step % self._every == 0
                or (self._max_events is not None and self._since_snap_queued >= max(1, self._max_events // 2))
            )
            if due:
                snap = self._take_snapshot(boundary)
                self._due = snap is None
                if snap is not None:
                    self._since_snap_queued = 0
        q = self._queue
        pending = q._items  # _Queue.put_nowait, inline (one call per allocator call)
        if len(pending) >= q.maxsize:
            self._wake.set()
            self._gap_from = gap_from if gap_from is not None else first
            last = batch[-1]
            self._gap_end = (last.seq, last.ts, last.step)  # the gap's end, if no batch is accepted after it
            self._due = True
            return False
        pending.append((items, snap, lost, urgent))
        if urgent or len(pending) >= self._wake_at:
            self._wake.set()
        self._gap_from = None
        self._next_seq = batch[-1].seq + 1
        if snap is not None:
            self._want_snapshot = False
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
        return self._lost.n

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is committed. True on success, False after a failure or timeout.
        Blocks: for tests, tools and shutdown, never for the engine's hot path."""
        if self._closed or self.failed is not None:
            return False
        marker = _Flush()
        try:
            self._queue.put(marker, timeout=timeout)
            self._wake.set()
        except queue.Full:
            return False
        return marker.done.wait(timeout) and marker.ok

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
        try:
            self._queue.put(_Stop(end_time=float(self._clock()), dropped=self.dropped, lost=gap), timeout=timeout)
            self._wake.set()
        except queue.Full:
            logger.warning("flight recorder %s: the writer did not take the stop request", self.path)
        self._thread.join(timeout)
        if self._path_lock is not None:
            os.close(self._path_lock)  # the path is free for another writer (see _claim_path)
            self._path_lock = None

    def __enter__(self) -> FlightRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "failed" if self.failed is not None else ("closed" if self._closed else "recording")
        return f"FlightRecorder({self.path!r}, {state})"

    # -- the writer thread --------------------------------------------------------------------------------------
    def _writer(self) -> None:
        conn = self._conn
        q = self._queue
        pending = q._items
        in_txn = False
        last_commit = time.monotonic()
        uncommitted = 0
        unclocked = 0  # batches written since the clock was last read
        while True:
            if pending:  # a backlog (the writer wakes every _POLL seconds): taken without a call or a clock read
                item = pending.popleft()  # the only consumer: a non-empty deque stays non-empty until here
            else:
                timeout = max(0.0, last_commit + self._flush_interval - time.monotonic()) if in_txn else None
                item = self._next(q, timeout)
            if self.failed is not None:
                if isinstance(item, _Stop):
                    break
                if isinstance(item, _Flush):
                    item.done.set()
                elif type(item) is list:
                    self._lost.n += len(item) >> 1
                elif isinstance(item, tuple):
                    self._lost.n += len(item[0]) // 2
                continue
            try:
                plain = type(item) is list  # a batch queued as it is (see __call__)
                if plain or isinstance(item, tuple):
                    if not in_txn:
                        conn.execute("BEGIN")
                        in_txn = True
                    if plain:
                        uncommitted += len(item) >> 1
                        urgent = self._write(item, None, None, False)
                    else:
                        uncommitted += len(item[0]) // 2
                        urgent = self._write(*item)
                    due = urgent or uncommitted >= _COMMIT_ROWS
                    # The clock is read when the backlog is drained, or every _CLOCK_EVERY batches within one.
                    unclocked += 1
                    if not due and (unclocked >= _CLOCK_EVERY or not pending):
                        unclocked = 0
                        due = time.monotonic() - last_commit >= self._flush_interval
                    if due:
                        self._insert_rows()
                        conn.execute("COMMIT")
                        in_txn, uncommitted, last_commit, unclocked = False, 0, time.monotonic(), 0
                        self._after_commit()
                    elif len(self._rows) >= _INSERT_ROWS:
                        self._insert_rows(close=False)
                elif item is _TICK or isinstance(item, (_Flush, _Stop)):
                    if in_txn:
                        self._insert_rows()
                        conn.execute("COMMIT")
                        in_txn, uncommitted, last_commit = False, 0, time.monotonic()
                        self._after_commit()
                    if isinstance(item, _Flush):
                        item.ok = True
                        item.done.set()
                    elif isinstance(item, _Stop):
                        self._finish(item)
                        break
            except Exception as exc:
                self._lost.n += uncommitted
                self._block, self._rows, self._seg_rows, self._rid_rows, self._vrows = None, [], [], [], []
                self._kindsets, self._new_kindsets = set(), []
                self._deflate = _deflater()
                self._fail(exc)
                with contextlib.suppress(Exception):
                    conn.rollback()
                in_txn, uncommitted = False, 0
                if isinstance(item, _Flush):
                    item.done.set()
                elif isinstance(item, _Stop):
                    break
        with contextlib.suppress(Exception):
            conn.close()

    def _next(self, q: _Queue, timeout: float | None):
        """The next queued item, or _TICK once ``timeout`` seconds passed (None: no deadline). Between polls the
        writer sleeps on ``_wake`` (see the constructor)."""
        try:
            return q.get_nowait()
        except queue.Empty:
            pass
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _POLL if deadline is None else min(_POLL, max(0.0, deadline - time.monotonic()))
            self._wake.wait(wait)
            self._wake.clear()
            try:
                return q.get_nowait()
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return _TICK

    def _fail(self, exc: BaseException) -> None:
        if self.failed is not None:
            return
        self.failed = exc
        self._stopped = True
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
            moved = _file_id(self.path) != self._file
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
                self._want_snapshot = True
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
            self._want_snapshot = True
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
            self._conn.executemany("INSERT OR IGNORE INTO blocks VALUES (?,?,?,?,?,?,?)", rows)
        if seg_rows:
            self._conn.executemany("INSERT OR IGNORE INTO segments VALUES (?,?,?,?,?,?,?,?,?)", seg_rows)
        if rid_rows:
            self._conn.executemany("INSERT INTO rids VALUES (?,?,?)", rid_rows)
        if self._new_kindsets:
            self._conn.executemany("INSERT OR IGNORE INTO kindsets VALUES (?)", self._new_kindsets)
            self._new_kindsets = []
        if vrows:
            self._conn.executemany("INSERT OR IGNORE INTO violations VALUES (?,?,?,?,?,?,?,?,?,?)", vrows)
            self._n_violations += len(vrows)

    def _write_snapshot(self, step: int, seq: int, snaps: Mapping) -> None:
        if self._hasher is not None:
            snaps = self._hasher.snapshots(snaps)
        ledger = _encode_ledger(snaps)
        self._conn.executemany(
            "INSERT OR REPLACE INTO snapshots VALUES (?,?,?,?,?,?,?)",
            [
                (seq, step, name, int(s.num_pages), int(s.page_size), _encode_owner(s.owner), ledger)
                for name, s in snaps.items()
            ],
        )
        self._since_snap_events = 0
        self._since_snap_bytes = 0

    def _retain(self) -> None:
        conn = self._conn
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
        conn = self._conn
        pages = conn.execute("PRAGMA page_count").fetchone()[0] - conn.execute("PRAGMA freelist_count").fetchone()[0]
        return pages * conn.execute("PRAGMA page_size").fetchone()[0]

    def _trim_violations(self, *, rows: int | None = None, size: int | None = None) -> bool:
        """Keep the violations table within its share of the retention bound: at most ``rows`` rows, or about
        ``size`` bytes (the rows' text plus a per-row overhead, an estimate). The first ``FIRST_VIOLATIONS_KEPT`` of the
        run are always kept (where an incident began); beyond the share, the oldest of the rest are deleted and
        counted in the meta key ``violations_dropped``. Without a share, a run that violates at every step (a
        corrupted pool) outgrew any byte bound while retention deleted the whole replayable history trying."""
        conn = self._conn
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
        row = self._conn.execute("SELECT max(seq) FROM snapshots WHERE seq <= ?", (seq,)).fetchone()
        return row[0] is not None and self._drop_before(row[0])

    def _drop_before(self, seq: int) -> bool:
        """Delete the snapshots older than the snapshot at ``seq`` (kept, with its own boundary) and the blocks
        whose events are all older, with their ``rids`` rows."""
        conn = self._conn
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

    def _finish(self, stop: _Stop) -> None:
        conn = self._conn
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
                ("events_lost", _dumps(self._lost.n).decode()),
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


# -- reader -------------------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _meta_problem(meta: Mapping) -> str | None:
    """What is wrong with the run metadata the readers use (None: nothing): the keys the writer always writes are
    there, and every value a reader uses has the type the writer writes (a damaged value is refused at open, not a
    bare TypeError at a later use). Kind names the reader does not know are allowed (a newer writer's kinds)."""
    for key in ("pools", "page_size", "kinds"):
        if key not in meta:
            return f"no {key} in its meta table"
    kinds = meta["kinds"]
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        return f"meta kinds is not a list of event kind names: {_short(kinds)}"
    if len(set(kinds)) != len(kinds):
        return "meta kinds names a kind twice"
    absent = [k for k in _STATE_KINDS if k not in kinds]
    if absent:
        return f"meta kinds lacks {', '.join(absent)} (every recording's kinds hold them)"
    pools = meta["pools"]
    if not isinstance(pools, list) or not pools:
        return f"meta pools is not a list of pools: {_short(pools)}"
    names = set()
    for p in pools:
        if not (
            isinstance(p, dict)
            and isinstance(p.get("name"), str)
            and _is_int(p.get("num_pages"))
            and p["num_pages"] >= 0
            and _is_int(p.get("page_size"))
            and p["page_size"] >= 1
        ):
            return f"meta pools holds a pool that is not {{name, num_pages, page_size}}: {_short(p)}"
        if p["name"] in names:
            return f"meta pools names pool {p['name']!r} twice"
        names.add(p["name"])
    checks = (
        ("page_size", lambda v: _is_int(v) and v >= 1, "an int >= 1"),
        ("sliding_window", lambda v: v is None or (_is_int(v) and v >= 1), "null or an int >= 1"),
        ("initial_step", lambda v: _is_int(v) and v >= 0, "an int >= 0"),
        ("snapshot_every", lambda v: _is_int(v) and v >= 1, "an int >= 1"),
        ("max_events", lambda v: v is None or (_is_int(v) and v >= 1), "null or an int >= 1"),
        ("max_bytes", lambda v: v is None or (_is_int(v) and v >= 1), "null or an int >= 1"),
        ("events_dropped", lambda v: _is_int(v) and v >= 0, "an int >= 0"),
        ("events_lost", lambda v: _is_int(v) and v >= 0, "an int >= 0"),
        ("violations_dropped", lambda v: _is_int(v) and v >= 0, "an int >= 0"),
        ("start_time", _is_number, "a number"),
        ("end_time", _is_number, "a number"),
        ("mode", lambda v: v is None or isinstance(v, str), "null or a string"),
        ("request_ids", lambda v: isinstance(v, dict), "an object"),
    )
    for key, ok, what in checks:
        if key in meta and not ok(meta[key]):
            return f"meta {key} is not {what}: {_short(meta[key])}"
    return None


def _is_stored_rid(r) -> bool:
    """A request id as the writer stores it (``_rid``): str, int or None."""
    return r is None or isinstance(r, str) or _is_int(r)


def _violation_row_ok(row) -> bool:
    """A violations row (invariant, message, pool, rid, step, op, ts, trace_id, severity) as the writer writes it."""
    i, m, p, r, s, o, t, tr, sv = row
    return (
        type(i) is str
        and type(m) is str
        and type(o) is str
        and type(sv) is str
        and _is_int(s)
        and _is_number(t)
        and (p is None or type(p) is str)
        and (tr is None or type(tr) is str)
        and _is_stored_rid(r)
    )


def _short(v, n: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


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
