"""benchmarks/recorder_floor.py: the step journal (the lower-bound experiment) captures exactly what a step changed,
so its figure measures the work a step-granular recorder cannot avoid; and the module runs end to end."""

from __future__ import annotations

import sqlite3
import zlib

import numpy as np
import torch

from benchmarks import recorder_floor
from benchmarks.bench_exporters import _wrapped

I64 = torch.int64


def _extend(alloc, rids, lens):
    bs = len(rids)
    zero = torch.zeros(bs, dtype=I64)
    seq = torch.tensor(lens, dtype=I64)
    with alloc.batch(rids):
        return alloc.alloc_extend(zero, zero, seq, seq.clone(), torch.full((bs,), -1, dtype=I64), int(seq.sum()))


def test_the_journal_captures_what_each_step_changed():
    alloc = _wrapped(pages=64)
    journal = recorder_floor._StepJournal(alloc, None)
    out = _extend(alloc, ["a", "b"], [20, 5])  # page size 16: "a" takes 2 pages, "b" 1
    alloc.step()
    step, _, _, (pages, owners), (slots, allocated, committed, evicted) = journal._queue[-1]
    assert step == 1
    want = np.unique(out.numpy() // 16)
    assert pages.tolist() == want.tolist()
    slot_a, slot_b = (alloc.ledger.slot_of(r, create=False) for r in ("a", "b"))
    assert sorted(set(owners.tolist())) == sorted({slot_a, slot_b})
    assert dict(zip(slots.tolist(), zip(allocated.tolist(), committed.tolist(), evicted.tolist()))) == {
        slot_a: (32, 20, 0),
        slot_b: (16, 5, 0),
    }
    alloc.step()  # nothing changed: an empty record
    _, _, _, (pages, _), (slots, *_) = journal._queue[-1]
    assert pages.size == 0 and slots.size == 0
    alloc.free(out[20:])  # "b"'s page
    alloc.step()
    _, _, _, (pages, owners), (slots, allocated, _, _) = journal._queue[-1]
    assert pages.tolist() == [int(out[20]) // 16] and owners.tolist() == [alloc._w_st.full.shadow.owner[pages[0]]]
    assert owners[0] < 0  # free again
    assert slots.tolist() == [slot_b] and allocated.tolist() == [0]


def test_the_writer_stores_every_step(tmp_path):
    alloc = _wrapped(pages=64)
    path = tmp_path / "journal.sqlite"
    journal = recorder_floor._StepJournal(alloc, path)
    for _ in range(300):
        alloc.step()
    journal.close()
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT step, n, payload FROM steps ORDER BY step").fetchall()
    assert sum(n for _, n, _ in rows) == 300
    first = np.frombuffer(zlib.decompress(rows[0][2])[:16], np.int64)
    assert rows[0][0] == 1 and first[0] == 1  # the first row starts at step 1


def test_the_module_runs():
    out = recorder_floor.main(["--iterations", "1", "--repeats", "1"])
    rows = [line.split(" / ")[0] for line in out.splitlines()[2:]]
    assert rows == [
        "engine loop, null sink, the recorder's kinds",
        "engine loop, null sink, step boundaries only",
        "engine loop, step journal, capture only",
        "engine loop, step journal, capture + writer",
        "engine loop, FlightRecorder",
    ]
    assert all(float(line.split()[-4]) > 0 for line in out.splitlines()[2:])
