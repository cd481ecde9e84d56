"""The recorder's codec (``exporters.recorder.codec`` and ``.decode``): every event kind round-trips, blocks written
before fields were added read them as their defaults, a group of the wrong width is damage, and the rids tuples'
cache keeps each tuple's own element types."""

from __future__ import annotations

import json

import numpy as np
import pytest

import exporters.recorder.codec as codec
import exporters.recorder.decode as decode
import exporters.recorder.format as fmt
from exporters.recorder import Recording, decode_event, encode_event
from instrumented_alloc import Violation
from instrumented_alloc import events as ev
from instrumented_alloc.replay import EventsLost
from tests.exporters.test_recorder import REPO, _block_body


def test_every_event_kind_round_trips():
    i8 = lambda *x: np.array(x, np.int64)  # noqa: E731
    v = Violation(
        "double_free", "m", pool="full", rid="a", step=3, op="free", ts=1.5, trace_id="ab", severity="critical"
    )
    samples = [
        ev.Alloc(
            seq=1, ts=0.5, step=2, op="alloc_extend", pool="full", n_slots=8, n_pages=2, rids=("a", 7), duration=1e-6
        ),
        ev.AllocFailed(seq=2, ts=0.5, step=2, op="alloc", pool="full", requested=9, available=4, rids=("a",)),
        ev.Free(seq=3, ts=0.5, step=2, op="free", pool="swa", n_pages=2, rids=("b",)),
        ev.SwaEvict(seq=4, ts=0.5, step=2, rid="a", old=0, new=8, n_pages=2),
        ev.LedgerWrite(seq=5, ts=0.5, step=2, rid=12, field="kv_committed_len", old=1, new=2),
        ev.RequestReleased(seq=6, ts=0.5, step=2, rid="a", pages_held=0, pages_peak=3),
        ev.ViolationEvent(seq=7, ts=0.5, step=3, violation=v),
        ev.PageUpdate(
            seq=8, ts=0.5, step=3, op="free", pool="full", pages=i8(*range(2000)), owners=np.full(2000, -6, np.int32)
        ),
        ev.PageUpdate(seq=9, ts=0.5, step=3, op="x", pool="full", pages=i8(), owners=np.zeros(0, np.int32)),
        ev.LedgerUpdate(
            seq=10,
            ts=0.5,
            step=3,
            op="alloc_decode",
            rids=("a", "b"),
            slots=i8(0, 1),
            allocated=i8(8, 2**40),
            committed=i8(5, 1),
            evicted=i8(0, 0),
        ),
        ev.StepBoundary(seq=11, ts=0.5, step=4, available={"full": 3, "swa": 5}),
        # The self-cost so far per part, and the iteration's.
        ev.StepBoundary(
            seq=12, ts=0.5, step=5, available={"full": 3}, overhead=(1.5e-6, 0.0, 2.5e-5, 1e-6), iteration_seconds=3e-6
        ),
        EventsLost(seq=20, ts=0.5, step=5, first_seq=13, last_seq=20, n_events=8),
        # Arrays that are not all 1-D integers (stored one by one), and integers that need 64 bits.
        ev.PageUpdate(
            seq=21, ts=0.25, step=4, op="y", pool="swa", pages=i8(*range(6)).reshape(2, 3), owners=np.array([1.5, -2.0])
        ),
        ev.PageUpdate(seq=22, ts=0.25, step=4, op="z", pool="swa", pages=i8(2**40), owners=np.array([5], np.uint8)),
    ]
    cache: dict = {}
    for e in samples:
        kind, _, payload = encode_event(e, cache)
        assert kind == type(e).__name__
        back = decode_event(kind, e.seq, e.step, e.ts, payload)
        assert type(back) is type(e)
        for f in e.__dataclass_fields__:
            a, b = getattr(e, f), getattr(back, f)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), (kind, f)
            else:
                assert a == b, (kind, f, a, b)
    assert (
        encode_event(samples[3])[1] == "a"
        and encode_event(samples[6])[1] == "a"
        and encode_event(samples[0])[1] is None
    )
    assert len(encode_event(samples[7])[2]) < 16000 // 4  # large arrays are stored compressed
    # Request ids other than str / int are stored as their repr.
    odd = ev.Free(seq=1, ts=0.0, step=0, op="free", pool="full", n_pages=1, rids=(("t", 1), None, 2.5))
    kind, _, payload = encode_event(odd)
    assert decode_event(kind, 1, 0, 0.0, payload).rids == ("('t', 1)", None, "2.5")
    # Timestamps are stored as float64 bits; a block with a timestamp that is not a float keeps them all in JSON.
    b = codec._BlockWriter(0, 1, None)
    for seq, ts in ((1, 0.1), (2, 7), (3, 1e300)):
        e = ev.Free(seq=seq, ts=ts, step=0, op="free", pool="full", n_pages=1, rids=("a",))
        b.add(type(e), e.__dict__)
    got = decode._decode_block(b.row()[-1], 1, 0, decode._CLASSES)
    assert [(e.seq, e.ts, type(e.ts)) for e in got] == [(1, 0.1, float), (2, 7, int), (3, 1e300, float)]
    # Float fields (durations) are stored as float64 bits too; one that holds an int stays in the JSON.
    b = codec._BlockWriter(0, 1, None)
    for seq, duration in ((1, 1.5e-5), (2, 0), (3, 2.0**-1074)):
        e = ev.Free(seq=seq, ts=0.5, step=0, op="free", pool="full", n_pages=1, rids=("a",), duration=duration)
        b.add(type(e), e.__dict__)
    got = decode._decode_block(b.row()[-1], 1, 0, decode._CLASSES)
    assert [(e.ts, e.duration, type(e.duration)) for e in got] == [
        (0.5, 1.5e-5, float),
        (0.5, 0, int),
        (0.5, 2.0**-1074, float),
    ]


# Written by the FlightRecorder as it was before a step boundary carried the self-cost
# (``StepBoundary.overhead``, ``iteration_seconds``): a paged allocator (16 pages of 4 tokens, snapshots every 5 steps,
# meta engine "e0") serving requests r0, r1, r2 of 8 tokens (2 pages each), one admitted at each of steps 0-2, r0
# freed and released at step 6, 12 steps. (Then ``PRAGMA page_size=1024; VACUUM``: the same rows in a smaller file.)
PRE_SELFCOST = REPO / "tests" / "data" / "pre-selfcost.sqlite"


def test_a_recording_made_before_the_self_cost_fields_reads_them_as_their_defaults():
    # The reader used to refuse every block of such a file ("a StepBoundary group has 1 fields"): state_at and
    # events failed on all of it.
    with Recording(PRE_SELFCOST) as r:
        assert r.steps() == (0, 12) and r.meta["engine"] == "e0"
        boundaries = list(r.events(kinds=["StepBoundary"]))
        assert [b.step for b in boundaries] == list(range(1, 13))
        assert {(b.overhead, b.iteration_seconds) for b in boundaries} == {((), 0.0)}
        assert [b.available["full"] for b in boundaries] == [14, 12, 10, 10, 10, 10, 12, 12, 12, 12, 12, 12]
        for step in (3, 6, 7, 12):
            state = r.state_at(step)
            assert sorted(state.ledger) == (["r0", "r1", "r2"] if step < 7 else ["r1", "r2"]), step
            assert (state.owners["full"] >= 0).sum() == 2 * len(state.ledger), step
        step6 = [(type(e).__name__, getattr(e, "rids", None) or getattr(e, "rid", None)) for e in r.events(6, 7)]
        assert step6 == [("StepBoundary", None), ("Free", ("r0",)), ("LedgerUpdate", ("r0",)), ("PageUpdate", None),
                         ("RequestReleased", "r0")]  # fmt: skip


def test_a_group_with_fewer_fields_than_the_required_or_more_than_the_class_is_damaged():
    import struct

    e = ev.Alloc(seq=1, ts=0.5, step=0, op="alloc", pool="full", n_slots=8, n_pages=2, rids=("a",), duration=1e-6)
    kind, _, payload = encode_event(e)
    body = _block_body(payload)
    (n,) = struct.unpack_from("<I", body, 0)
    doc = json.loads(body[4 : 4 + n])
    [(code, count, ts, entries)] = doc["g"]
    assert len(entries) == 6 and fmt._stored_fields_min(ev.Alloc) == 4  # op, pool, n_slots, n_pages
    for bad in (entries[:3], [*entries, [0]]):
        head = json.dumps({**doc, "g": [[code, count, ts, bad]]}, separators=(",", ":")).encode()
        blob = b"B" + struct.pack("<I", len(head)) + head + body[4 + n :]
        with pytest.raises(ValueError, match=f"^a Alloc group has {len(bad)} fields$"):
            decode_event(kind, 1, 0, 0.5, blob)


def test_a_block_tells_apart_rids_tuples_at_a_reused_address():
    # A block keeps the rids tuples it indexed by identity alive: a later tuple cannot take a freed one's address.
    b = codec._BlockWriter(0, 1, None)
    ids = []
    for seq, rid in ((1, "x"), (2, "y"), (3, "z")):
        e = ev.Free(seq=seq, ts=0.0, step=0, op="free", pool="full", n_pages=1, rids=("".join(["r", rid]),))
        ids.append(id(e.rids))
        b.add(type(e), e.__dict__)
        del e
    got = decode._decode_block(b.row()[-1], 1, 0, decode._CLASSES)
    assert [(e.seq, e.rids) for e in got] == [(1, ("rx",)), (2, ("ry",)), (3, ("rz",))]
    assert len(set(ids)) == 3


def test_rids_tuples_equal_by_value_keep_their_own_types_across_blocks():
    # The writer caches a rids tuple's JSON by value, across blocks: equal tuples of other element types (1, 1.0,
    # True and numpy's 1 are equal and hash alike) are stored as their own; unhashable ids are stored as their repr.
    cache: dict = {}
    tuples = [("a", "b"), ("a", "b"), (1, "b"), (1.0, "b"), (True, "b"), (np.int64(1), "b"), ([1], "b"), ("a", "b")]
    want = [("a", "b"), ("a", "b"), (1, "b"), ("1.0", "b"), ("True", "b"), (1, "b"), ("[1]", "b"), ("a", "b")]
    for _ in range(2):  # the second block reads the cache the first one filled
        b = codec._BlockWriter(0, 1, cache)
        for seq, rids in enumerate(tuples, 1):
            e = ev.Free(seq=seq, ts=0.0, step=0, op="free", pool="full", n_pages=1, rids=tuple(rids))
            b.add(type(e), e.__dict__)
        payload = b.row()[-1]
        got = decode._decode_block(payload, 1, 0, decode._CLASSES)
        assert [e.rids for e in got] == want
        assert [type(e.rids[0]) for e in got] == [type(w[0]) for w in want]
        head = json.loads(payload[5 : 5 + int.from_bytes(payload[1:5], "little")])
        assert len(head["r"]) == 5  # each distinct JSON stored once: ("a", "b") thrice, (1, "b") twice
