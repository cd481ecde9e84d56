"""The flight recording's file format: schema, version, errors, event kinds, and the checks a reader applies to
the run metadata. Pure definitions (no I/O): the writer, the codec and the reader all import them.

File (format version 4): SQLite in WAL mode while it is written (a ``Recording`` can follow it), tables ``meta``,
``blocks``, ``segments``, ``kindsets``, ``rids``, ``violations``, ``snapshots`` (see ``_SCHEMA``).
- ``blocks``: consecutive events of one or more steps (at most ``_BLOCK_EVENTS``), encoded together kind by kind
  (``codec``), with their seq and step range, event count and kinds bit set.
- ``segments``: one row per step of a block (at most one step boundary each) with what the queries need (seq
  range, step, count per kind, the boundary's seq and ``available``, the block): queries never decode payloads.
- ``kindsets``: every ``kinds`` bit set a segment has; ``rids``: (block, request id, step) of the events stored
  under one request id; ``violations``: one row per violation; ``snapshots``: one row per pool of each snapshot.
- ``meta``: JSON values; ``kinds`` lists the kind names whose index is their code in this file, so kinds added
  later get new codes without a format change.
A reader opens version 4 only; another version raises ``RecordingVersionError``. Fields added to an event class
after files were written (at the class's end, with a default) read as their default from older blocks.
Request ids round-trip when they are ``str`` or ``int`` (``_rid``); other ids are stored as their ``repr``.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from instrumented_alloc import events as ev
from instrumented_alloc.invariants import Violation
from instrumented_alloc.replay import EventsLost

FORMAT = "instrumented-alloc-recording"
# 2: events stored in blocks (about one row per step); 3: a block's timestamps packed as float64; 4: a block spans
# several steps and is encoded kind by kind, column by column; one ``segments`` row per step of a block.
FORMAT_VERSION = 4
SINK_NAME = "recorder"

_COMPRESS_OVER = 4096  # block bodies larger than this many bytes are deflated
_PACK_COMPRESS_OVER = 512  # snapshot ledger documents larger than this many bytes are zlib-compressed
_BLOCK_EVENTS = 512  # events of one block at most (a block is also closed before every commit)
# Retention of the violations table (writer.Writer._trim_violations): the first violations of a run are never
# deleted.
FIRST_VIOLATIONS_KEPT = 100

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


# -- event kinds and values as stored ---------------------------------------------------------------------------
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


# -- metadata checks: a reader refuses values the writer never writes ------------------------------------------
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
