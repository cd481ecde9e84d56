"""The decoder of the recording's ``blocks`` payloads and owner blobs: the inverse of ``codec`` (whose
``_BlockWriter`` documents the layout). Pure functions, safe on any reader thread; the reader's half of the codec,
so that reading never loads the encoder.
"""

from __future__ import annotations

import json
import operator
import struct
import zlib
from collections.abc import Container, Sequence

import numpy as np

from instrumented_alloc import events as ev
from instrumented_alloc.invariants import Violation

from .format import _CLASSES, _KINDS, _fields_of, _stored_fields_min, _tuplify

_LE = {"<i2": np.dtype("<i2"), "<i4": np.dtype("<i4"), "<i8": np.dtype("<i8")}
_SEQ_OF = operator.attrgetter("seq")


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


def decode_event(kind: str, seq: int, step: int, ts: float, payload: bytes) -> ev.Event:
    """The event ``encode_event`` stored (its kind is checked against the payload's)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    (e,) = _decode_block(payload, seq, step, _CLASSES)
    if type(e).__name__ != kind:
        raise ValueError(f"payload holds {type(e).__name__}, not {kind}")
    return e


def _decode_owner(blob: bytes) -> np.ndarray:
    if blob[:1] != b"Z":
        raise ValueError("unknown owner encoding")
    return np.frombuffer(zlib.decompress(blob[1:]), dtype="<i4").astype(np.int32)
