"""The encoder of the recording's ``blocks`` payloads and snapshot blobs (layout: ``_BlockWriter``); ``decode``
is its inverse.

Contract: encoding (``_BlockWriter.row``) runs on the writer's worker thread only, never on the engine thread; its
caches (``rid_cache``, ``_COUNTS``, ``_PLANS``) hold values that depend only on their keys. Encoding is generic over
the event dataclasses' fields (a field added with a default at a class's end needs no codec change; a block
written before such a field was added decodes it as its default).
"""

from __future__ import annotations

import array
import bisect
import collections
import dataclasses
import itertools
import operator
import struct
import sys
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from instrumented_alloc import events as ev
from instrumented_alloc.invariants import Violation

from .format import (
    _COMPRESS_OVER,
    _KIND_NAMES,
    _json,
    _pack,
    _rid,
    _violation_doc,
)

_I2_MIN, _I2_MAX = -(2**15), 2**15 - 1
_I4_MIN, _I4_MAX = -(2**31), 2**31 - 1


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


def encode_event(e: ev.Event, cache: dict | None = None) -> tuple[str, object, bytes]:
    """(kind, rid, payload) of one event stored alone: its kind name, the request id it is stored under (the
    ``rids`` table: its ``rid``, its violation's, or the one request of a single-request call; else None) and a
    block payload of that one event (see ``_BlockWriter``). The writer stores blocks of many events the same way."""
    b = _BlockWriter(e.step, e.seq, cache)
    b.add(type(e), e.__dict__)
    payload = b.row()[-1]
    rid = next(iter(b.rids))[0] if b.rids else None
    return type(e).__name__, rid, payload


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
