"""The flight recorder (``exporters.recorder``): replay equals the live state, violations, a live reader, a killed
writer, files that are not recordings, write faults, retention, the bounded queue, hashed request ids, damaged
recordings. The codec's own round trips are in ``test_recorder_codec.py``.

The random engine is ``tests.test_wrapper_properties.Engine`` (wrapped allocator + bare twin; ``both`` asserts
bit-identical results), driven by ``drive`` below from hypothesis draws or a seeded ``random.Random``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import exporters.recorder.decode as decode
import exporters.recorder.format as fmt
import exporters.recorder.reader as reader_mod
import exporters.recorder.writer as writer_mod
from exporters.recorder import (
    FORMAT_VERSION,
    FlightRecorder,
    RecorderError,
    Recording,
    RecordingError,
    RecordingNotFoundError,
    RecordingVersionError,
)
from instrumented_alloc import Violation, replay
from instrumented_alloc import events as ev
from instrumented_alloc.replay import IncompleteHistory
from tests.engine_model import Req, t
from tests.test_wrapper_properties import Engine

REPO = Path(__file__).resolve().parents[2]
LOGGER = "instrumented_alloc.recorder"


# -- driving a random engine -------------------------------------------------------------------------------
class DrawPick:
    def __init__(self, data):
        self.data = data

    def choice(self, items):
        return self.data.draw(st.sampled_from(items))

    def int(self, lo, hi):
        return self.data.draw(st.integers(lo, hi))

    def subset(self, items, lo, hi):
        return self.data.draw(st.lists(st.sampled_from(items), min_size=lo, max_size=hi, unique_by=lambda r: r.rid))


class RandomPick:
    def __init__(self, seed):
        self.rng = random.Random(seed)

    def choice(self, items):
        return self.rng.choice(list(items))

    def int(self, lo, hi):
        return self.rng.randint(lo, hi)

    def subset(self, items, lo, hi):
        return self.rng.sample(list(items), self.rng.randint(lo, min(hi, len(items))))


def drive(e: Engine, pick, n_ops: int, on_step=None, *, clear: bool = False) -> None:
    """Random engine-like operations (extends, decodes, SWA evictions, rollbacks, frees, releases, free groups,
    merges, preallocs, steps, and with ``clear`` the allocator's clear()); ``on_step(e)`` runs right after each
    ``alloc.step()``."""
    ps = e.ps
    for _ in range(n_ops):
        live = list(e.reqs.values())
        ops = ["extend_new", "step", "step"]
        if live:
            ops += ["extend_more", "decode", "decode", "finish", "rollback"]
        if e.kind == "swa" and live:
            ops += ["evict"]
        if ps > 1 and e.kind in ("swa", "paged", "hisparse"):
            ops += ["prealloc"]
        if e.inner.need_sort and e.kind in ("token", "paged"):
            ops += ["merge"]
        if len(live) >= 2:
            ops += ["group"]
        if live and clear:
            ops += ["clear"]
        op = pick.choice(ops)
        if op == "extend_new":
            k = pick.int(1, 3)
            e.extend([Req(e.new_rid()) for _ in range(k)], [pick.int(1, 3 * ps + 3) for _ in range(k)])
        elif op == "extend_more":
            reqs = pick.subset(live, 1, 3)
            e.extend(reqs, [pick.int(1, 2 * ps + 1) for _ in reqs])
        elif op == "decode":
            reqs = [r for r in live if r.row]
            if reqs:
                e.decode(pick.subset(reqs, 1, len(reqs)))
        elif op == "finish":
            r = pick.choice(live)
            e.finish(r, pick.choice([True, False]))
            e.w.release_request(r.rid)
        elif op == "group":
            rs = pick.subset(live, 2, 3)
            e.both("free_group_begin")
            for r in rs:
                e.finish(r, pick.choice([True, False]))
            e.both("free_group_end")
            for r in rs:
                e.w.release_request(r.rid)
        elif op == "rollback":
            r = pick.choice(live)
            if r.row:
                e.rollback(r, pick.int(1, 2))
        elif op == "evict":
            e.evict(pick.choice(live))
        elif op == "prealloc":
            e.prealloc(pick.int(1, 4 * ps + 3))
        elif op == "merge":
            e.both("merge_and_sort_free")
        elif op == "clear":
            e.both("clear")  # every page free again; the live requests' ledger rows are reset
            for r in live:
                e.w.release_request(r.rid)
            e.reqs.clear()
        else:
            e.w.step()
            if on_step is not None:
                on_step(e)


def ledger_rows(snaps) -> dict:
    led = next(iter(snaps.values())).ledger
    return {r: (int(a), int(c), int(x)) for r, a, c, x in zip(led.rids, led.allocated, led.committed, led.evicted)}


def assert_state_equals(state, snaps, step) -> None:
    assert state.step == step
    assert sorted(state.owners) == sorted(snaps)
    for pool, snap in snaps.items():
        assert state.owners[pool].dtype == np.int32
        bad = np.flatnonzero(state.owners[pool] != snap.owner)
        assert bad.size == 0, f"step {step} pool {pool}: pages {bad[:8].tolist()} differ"
    assert {r: tuple(v) for r, v in state.ledger.items()} == ledger_rows(snaps), f"step {step}: ledger"
    owner_rids: dict = {}
    for pool in snaps:
        owner_rids.update(state.rids_in(pool))
    assert owner_rids == next(iter(snaps.values())).slot_rids, f"step {step}: page owners' request ids"


def warnings_of(caplog) -> list:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# -- (a) replay equals the live snapshots -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["paged-4", "swa-4", "swa-1", "token-1", "hisparse-4"])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_state_at_equals_live_snapshots(name, data):
    need_sort = data.draw(st.booleans(), label="need_sort")
    verify = data.draw(st.sampled_from(["immediate", "deferred"]), label="verify")
    e = Engine(name, need_sort, verify)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rec.db")
        rec = FlightRecorder(e.w, path, snapshot_every=7, flush_interval=0.05)
        expected = {0: e.w.snapshot()}

        def on_step(e):
            if data.draw(st.booleans(), label="check this step"):
                expected[e.w.step_count] = e.w.snapshot()

        try:
            drive(e, DrawPick(data), data.draw(st.integers(5, 60), label="ops"), on_step, clear=True)
            e.w.step()
            expected[e.w.step_count] = e.w.snapshot()
        finally:
            rec.close()  # also when hypothesis stops an example half-way
        assert e.w.bus.dropped["recorder"] == 0 and rec.failed is None
        assert os.listdir(d) == ["rec.db"]  # a finished recording is one file (no -wal / -shm left)
        with Recording(path) as r:
            assert r.steps() == (0, e.w.step_count)
            assert r.snapshot_steps() == [0, *range(7, e.w.step_count + 1, 7)]
            for step, snaps in expected.items():
                assert_state_equals(r.state_at(step), snaps, step)
            assert r.violations() == list(e.w.violations) == []


def test_attached_mid_run_and_event_ranges(tmp_path):
    e = Engine("swa-4", True, "deferred")
    pick = RandomPick(4)
    drive(e, pick, 40)
    start = e.w.step_count
    snaps = {start: e.w.snapshot()}
    path = tmp_path / "mid.db"
    with FlightRecorder(e.w, path, snapshot_every=4):
        drive(e, pick, 60, lambda e: snaps.__setitem__(e.w.step_count, e.w.snapshot()))
        e.w.step()
        snaps[e.w.step_count] = e.w.snapshot()
    with Recording(path) as r:
        assert r.meta["initial_step"] == start and r.steps() == (start, e.w.step_count)
        for step, s in snaps.items():
            assert_state_equals(r.state_at(step), s, step)
        everything = list(r.events())
        seqs = [x.seq for x in everything]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        mid = (start + e.w.step_count) // 2
        lo, hi = list(r.events(stop=mid)), list(r.events(start=mid))
        assert [x.seq for x in lo + hi] == seqs
        assert all(x.step < mid for x in lo) and all(x.step >= mid for x in hi)
        boundaries = list(r.events(kinds=[ev.StepBoundary]))
        assert [b.step for b in boundaries] == list(range(start + 1, e.w.step_count + 1))


def test_blocks_of_many_steps_read_back_every_event_and_range(tmp_path):
    # A block spans many steps and takes a usual batch as it is (the wrapper's own Snapshot events in it, built
    # for another sink, are not stored); events(start, stop, kinds) cuts blocks at step edges.
    e = Engine("swa-4", True, "immediate")
    object.__setattr__(e.w, "_w_snapshot_every", 3)
    seen: list = []

    class Everything:
        name = "everything"

        def __call__(self, batch):
            seen.extend(batch)

    e.w.subscribe(Everything())
    path = tmp_path / "many.db"
    snaps: dict = {}
    with FlightRecorder(e.w, path, snapshot_every=5, flush_interval=60.0):
        drive(e, RandomPick(7), 150, lambda e: snaps.__setitem__(e.w.step_count, e.w.snapshot()))
    assert any(type(x) is ev.Snapshot for x in seen)
    stored = [x for x in seen if type(x) is not ev.Snapshot]
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as c:
        assert c.execute("SELECT max(last_step - step) FROM blocks").fetchone()[0] > 1
    with Recording(path) as r:
        assert [(type(x), x.seq, x.step, x.ts) for x in r.events()] == [(type(x), x.seq, x.step, x.ts) for x in stored]
        last = e.w.step_count
        for a, b in ((3, 9), (10, 11), (0, last + 1), (last, last + 5), (last + 1, last + 9)):
            for kinds in (None, (ev.PageUpdate, ev.StepBoundary)):
                want = [x.seq for x in stored if a <= x.step < b and (kinds is None or type(x) in kinds)]
                assert [x.seq for x in r.events(a, b, kinds=kinds)] == want, (a, b, kinds)
        for step, s in snaps.items():
            assert_state_equals(r.state_at(step), s, step)


class _CopyInFlight:
    """Stands for a CUDA event of a device->host copy that has not landed yet (what verify="deferred" waits on)."""

    def __init__(self):
        self.done = False
        self.synchronized = False

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized = True
        self.done = True


def test_snapshot_never_waits_for_device_checks(tmp_path):
    e = Engine("paged-4", False, "deferred")
    path = tmp_path / "pending.db"
    rec = FlightRecorder(e.w, path, snapshot_every=2)
    drive(e, RandomPick(9), 10)
    copy = _CopyInFlight()
    e.w._w_pending.append((lambda: None, [], copy, "test"))  # a deferred check whose device copy is in flight
    e.w.step()
    if e.w.step_count % 2:
        e.w.step()
    at = e.w.step_count  # a snapshot step, reached while the copy is in flight
    live = e.w.snapshot(wait=False)
    assert not copy.synchronized and not copy.done  # the recorder did not make the engine thread wait
    copy.done = True
    e.w.step()
    after = e.w.snapshot()
    rec.close()
    with Recording(path) as r:
        assert at in r.snapshot_steps()
        assert_state_equals(r.state_at(at), live, at)
        assert_state_equals(r.state_at(at + 1), after, at + 1)


def test_calls_on_a_pools_own_allocator_replay_page_by_page(tmp_path):
    """SGLang's caches call the pools' own allocators (the wrapper's checked views): what those calls change is
    recorded, and replays to the live state at every step, the violation included."""
    import torch

    from instrumented_alloc import InstrumentedAllocator
    from instrumented_alloc.allocators import SWATokenToKVPoolAllocator

    i64 = torch.int64
    w = InstrumentedAllocator(SWATokenToKVPoolAllocator(64, 64, 4, torch.float16, "cpu"), sliding_window=8)
    path = tmp_path / "views.db"
    rec = FlightRecorder(w, path, snapshot_every=1000)  # one snapshot at the start: the rest is replay
    z = torch.zeros(1, dtype=i64)

    def extend(n):
        s = torch.tensor([n], dtype=i64)
        return w.alloc_extend(z, z.clone(), s, s.clone(), torch.tensor([-1], dtype=i64), n)

    live = {}

    def boundary():
        w.step()
        live[w.step_count] = w.snapshot()

    with w.batch(["a"]):
        a = extend(16)
    boundary()
    cached = extend(32)  # the cache's pages
    boundary()
    w.full_attn_allocator.free_segment(cached, start_pos=0)  # the unified radix cache's eviction
    w.free_swa_segment(cached, start_pos=0)
    boundary()
    loaded = w.swa_attn_allocator.alloc(8)
    boundary()
    w.swa_attn_allocator.free(loaded)
    w.free(a)
    w.release_request("a")
    boundary()
    w.full_attn_allocator.free(a)  # a double free, through the full pool's own allocator
    boundary()
    rec.close()
    with Recording(path) as r:
        for step, snaps in live.items():
            assert_state_equals(r.state_at(step), snaps, step)
        assert [(v.invariant, v.op, v.pool) for v in r.violations()] == [
            ("double_free", "full_attn_allocator.free", "full")
        ]


def bounded_recording(path, **limits):
    """A recorder with ``limits`` on a small paged allocator, and ``steps(n, flush_each=False)``: n steps of one
    request allocated, freed and released, then a flush (after each step with ``flush_each``: a block per step)."""
    import torch

    from instrumented_alloc import InstrumentedAllocator
    from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator

    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"))
    rec = FlightRecorder(w, path, **limits)

    def steps(n, flush_each=False):
        for _ in range(n):
            with w.batch(["r"]):
                out = w.alloc(4)
            w.free(out)
            w.release_request("r")
            w.step()
            if flush_each:
                assert rec.flush(5.0)
        assert rec.flush(5.0)

    return rec, steps


def test_events_read_while_retention_deletes_ahead_raise_instead_of_skipping(tmp_path, monkeypatch):
    """A long ``events()`` iteration of a bounded recording being written: when retention deletes blocks the
    iteration has not reached, it raises ``IncompleteHistory`` naming the first missing seq (it used to skip them,
    or stop early, silently). An iteration that retention does not overtake reads everything."""
    monkeypatch.setattr(reader_mod, "_READ_BLOCKS", 3)  # chunks of 3 blocks: a long read in a few steps
    path = tmp_path / "bounded.db"
    rec, steps = bounded_recording(path, max_events=60, snapshot_every=5)

    steps(12, flush_each=True)  # a block per step
    with Recording(path) as r:
        first, last = r.steps()
        whole = list(r.events(first, last + 1))  # nothing overtakes it: every kept event, in order
        assert [e.seq for e in whole] == list(range(whole[0].seq, whole[-1].seq + 1))
        it = r.events(first)
        head = [next(it)]
        steps(30, flush_each=True)  # retention deletes far past the blocks the iteration has not read
        with pytest.raises(replay.IncompleteHistory, match=r"retention deleted the events from seq \d+ on"):
            head.extend(it)
        assert head[-1].step <= last  # what it gave before is what was there
    rec.close()


# -- (b) violations --------------------------------------------------------------------------------------------
def test_violations_round_trip_and_are_committed_at_once(tmp_path):
    e = Engine("paged-4", False, "immediate")
    path = tmp_path / "rec.db"
    rec = FlightRecorder(e.w, path, snapshot_every=5, flush_interval=3600.0, meta={"preset": "dense", "rank": 3})
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    e.w.trace_id_for = {"b": trace}.get  # what OtelExporter sets: the violation carries its request's trace id
    a, b = Req("a"), Req("b")
    e.extend([a, b], [6, 9])
    e.w.step()
    e.w.step()
    page = b.row[0] // e.ps
    e.both("free_page_ids", t([page, page]))  # the same page twice in one call: a double free, owner known
    step = e.w.step_count
    live = list(e.w.violations)
    assert [(v.invariant, v.rid, v.step, v.trace_id) for v in live] == [("double_free", "b", step, trace)]
    with Recording(path) as r:
        # Ordinary events wait for the (hour-long) commit interval; the violation's transaction is committed now.
        wait_for(lambda: r.violations() != [], 5.0, "the violation to be committed")
        assert r.violations() == live
        got = r.violations()[0]
        assert (got.invariant, got.rid, got.step, got.op, got.pool, got.trace_id) == (
            "double_free",
            "b",
            step,
            "free_page_ids",
            "full",
            trace,
        )
        assert r.violations(start=step + 1) == [] and r.violations(stop=step) == []
        kinds = [type(x).__name__ for x in r.events(kinds=["ViolationEvent"])]
        assert kinds == ["ViolationEvent"]
        rec.close()
        meta = r.meta
    assert meta["preset"] == "dense" and meta["rank"] == 3 and meta["page_size"] == 4
    assert meta["pools"] == [{"name": "full", "num_pages": e.inner.num_pages, "page_size": 4}]
    assert meta["end_time"] >= meta["start_time"] and meta["events_dropped"] == 0


# -- (c) a reader follows a live writer ---------------------------------------------------------------------------
def test_reader_follows_a_live_writer(tmp_path):
    e = Engine("swa-4", False, "immediate")
    path = tmp_path / "live.db"
    rec = FlightRecorder(e.w, path, snapshot_every=4, flush_interval=0.02)
    r = Recording(path)  # opened before the first event
    assert r.steps() == (0, 0)
    pick = RandomPick(1)
    snaps: dict = {}

    def on_step(e):
        snaps[e.w.step_count] = e.w.snapshot()

    for _ in range(3):
        snaps.clear()
        drive(e, pick, 40, on_step)
        e.w.step()
        snaps[e.w.step_count] = e.w.snapshot()
        last = e.w.step_count
        wait_for(lambda last=last: r.steps()[1] >= last, 10.0, f"step {last} to be committed")
        for step, s in snaps.items():
            assert_state_equals(r.state_at(step), s, step)
    rec.close()
    assert r.steps()[1] == e.w.step_count and "end_time" in r.meta
    r.close()


# -- (d) a killed writer -----------------------------------------------------------------------------------------
CHILD = """
import json, sys, time
from exporters.recorder import FlightRecorder
from tests.exporters.test_recorder import RandomPick, drive, ledger_rows
from tests.test_wrapper_properties import Engine

path = sys.argv[1]
e = Engine("swa-4", False, "immediate")
rec = FlightRecorder(e.w, path, snapshot_every=5, flush_interval=0.005)
pick = RandomPick(7)
drive(e, pick, 60)
e.w.step()
snaps = e.w.snapshot()
assert rec.flush()
expected = {"step": e.w.step_count, "owners": {p: s.owner.tolist() for p, s in snaps.items()},
            "ledger": [[r, *v] for r, v in ledger_rows(snaps).items()]}
with open(path + ".expected.json", "w") as f:
    json.dump(expected, f)
print("ready", flush=True)
while True:
    drive(e, pick, 20)
    time.sleep(0.001)
"""


def test_killed_writer_leaves_a_readable_recording(tmp_path):
    path = str(tmp_path / "killed.db")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, path], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)  # never hang on a stuck child
        line = child.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            child.kill()
            pytest.fail(f"the recording child never got ready: {child.stderr.read().decode()[-3000:]}")
        time.sleep(0.3)  # it keeps writing: the kill lands mid-run
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    assert os.path.exists(path + "-wal")  # cut off in WAL mode, never closed
    with open(path + ".expected.json") as f:
        expected = json.load(f)
    with Recording(path) as r:
        assert "end_time" not in r.meta
        first, last = r.steps()
        assert first == 0 and last > expected["step"]
        s = r.state_at(expected["step"])
        for pool, owner in expected["owners"].items():
            assert s.owners[pool].tolist() == owner
        assert {k: tuple(v) for k, v in s.ledger.items()} == {r_[0]: tuple(r_[1:]) for r_ in expected["ledger"]}
        end = r.state_at(last)  # the last complete transaction replays
        assert end.step == last and r.violations() == []
        assert sum(1 for _ in r.events()) > 0


# -- (e) files that are not recordings ----------------------------------------------------------------------------
def test_not_a_recording_is_a_clear_error(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(np.random.default_rng(0).bytes(8192))
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE things (x)")
    fake = tmp_path / "fake.db"
    with sqlite3.connect(fake) as c:
        for name in ("meta (key, value)", "events (x)", "violations (x)", "snapshots (x)"):
            c.execute(f"CREATE TABLE {name}")
        c.execute("INSERT INTO meta VALUES ('format', '\"something-else\"')")
    for p in (junk, empty, other, fake, tmp_path):
        with pytest.raises(RecordingError) as info:
            Recording(p)
        assert str(p) in str(info.value)
        assert isinstance(info.value, ValueError)
    missing = tmp_path / "missing.db"
    with pytest.raises(RecordingNotFoundError) as info:
        Recording(missing)
    assert str(missing) in str(info.value) and isinstance(info.value, FileNotFoundError)
    assert not missing.exists()  # the reader never creates a file
    assert empty.stat().st_size == 0


def test_other_format_versions_are_a_clear_error(tmp_path):
    # A version-1 recording (one row per event), a version-2 one (timestamps in the blocks' JSON) or one from a
    # newer writer: the error names the file and both versions; a writer may still replace such a file with
    # overwrite=True.
    e = Engine("paged-4", False, "immediate")
    for version, word in ((1, "older"), (2, "older"), (3, "older"), (FORMAT_VERSION + 1, "newer")):
        path = tmp_path / f"v{version}.db"
        FlightRecorder(e.w, path).close()
        with sqlite3.connect(path) as c:
            c.execute("UPDATE meta SET value = ? WHERE key = 'format_version'", (str(version),))
        with pytest.raises(RecordingVersionError) as info:
            Recording(path)
        assert str(info.value).startswith(
            f"{path}: recording format version {version} is {word} than this reader's ({FORMAT_VERSION})"
        )
        assert isinstance(info.value, RecordingError)
        with pytest.raises(RecorderError, match="a recording exists there"):
            FlightRecorder(e.w, path)
        FlightRecorder(e.w, path, overwrite=True).close()
        with Recording(path) as r:
            assert r.meta["format_version"] == FORMAT_VERSION == 4


def test_missing_step_is_a_clear_error(tmp_path):
    e = Engine("paged-4", False, "immediate")
    with FlightRecorder(e.w, tmp_path / "r.db", snapshot_every=2) as rec:
        for _ in range(3):
            e.w.step()
    assert rec.failed is None
    with (
        Recording(tmp_path / "r.db") as r,
        pytest.raises(ValueError, match=r"step 9 is not in the recording \(steps 0..3\)"),
    ):
        r.state_at(9)


# -- (f) write faults ----------------------------------------------------------------------------------------
def test_unwritable_path_fails_at_construction(tmp_path):
    e = Engine("paged-4", False, "immediate")
    sinks_before = e.w.bus.sinks
    for bad in (tmp_path / "no-such-dir" / "r.db", tmp_path):
        with pytest.raises(RecorderError) as info:
            FlightRecorder(e.w, bad)
        assert str(bad) in str(info.value)
    foreign = tmp_path / "notes.txt"
    foreign.write_text("precious")
    with pytest.raises(RecorderError, match="not a recording"):
        FlightRecorder(e.w, foreign)
    assert foreign.read_text() == "precious"
    assert e.w.bus.sinks == sinks_before  # nothing stays subscribed after a failed construction
    FlightRecorder(e.w, tmp_path / "r.db").close()
    with pytest.raises(RecorderError, match="overwrite=True"):
        FlightRecorder(e.w, tmp_path / "r.db")
    FlightRecorder(e.w, tmp_path / "r.db", overwrite=True).close()
    with pytest.raises(ValueError, match="snapshot_every"):
        FlightRecorder(e.w, tmp_path / "x.db", snapshot_every=0)
    with pytest.raises(ValueError, match="written by the recorder"):
        FlightRecorder(e.w, tmp_path / "x.db", meta={"pools": 1})


@pytest.mark.parametrize("stage", ["schema", "first snapshot"])
def test_a_failed_construction_leaves_no_file_behind(tmp_path, monkeypatch, stage):
    # A disk that fills while the recorder is being built: the error names the path, and the file it started is
    # removed, so the next attempt at that path (make demo reuses one) works, with or without overwrite=True.
    e = Engine("paged-4", False, "immediate")
    path = tmp_path / "r.db"
    real_open = writer_mod._open_writer
    if stage == "schema":

        def full_disk(p):
            conn = real_open(p)
            conn.execute("PRAGMA max_page_count = 1")  # "database or disk is full" at the first table
            return conn

        monkeypatch.setattr(writer_mod, "_open_writer", full_disk)
    else:

        def full_disk(self, step, seq, snaps):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(writer_mod.Writer, "_write_snapshot", full_disk)
    sinks_before = e.w.bus.sinks
    with pytest.raises(RecorderError, match="database or disk is full") as info:
        FlightRecorder(e.w, path)
    assert str(path) in str(info.value)
    assert sorted(os.listdir(tmp_path)) == []  # neither the file nor its -wal / -shm
    assert e.w.bus.sinks == sinks_before  # nothing stays subscribed
    monkeypatch.undo()
    for overwrite in (False, True):
        FlightRecorder(e.w, path, overwrite=overwrite).close()
    with Recording(path) as r:
        assert r.steps() == (0, 0)


def test_a_path_another_writer_is_creating_is_refused_and_kept(tmp_path):
    # Another writer has just created the file and is filling it (it holds the path's creation lock, as
    # FlightRecorder does until its first commit): the file is still empty, which used to read as "left by a dead
    # writer" and was removed, unlinking the other writer's file under it.
    import fcntl

    e = Engine("paged-4", False, "immediate")
    path = tmp_path / "r.db"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        ino = os.fstat(fd).st_ino
        sinks_before = e.w.bus.sinks
        for overwrite in (False, True):
            with pytest.raises(RecorderError) as info:
                FlightRecorder(e.w, path, overwrite=overwrite)
            assert str(info.value) == (
                f"cannot write flight recording {str(path)!r}: another writer is creating or writing a recording "
                "there right now"
            )
        assert os.stat(path).st_ino == ino and path.stat().st_size == 0  # the other writer's file, untouched
        assert e.w.bus.sinks == sinks_before
    finally:
        os.close(fd)
    # Unlocked, an empty file is one a writer left before its first commit: filled in place.
    with FlightRecorder(e.w, path):
        e.w.step()
    assert os.stat(path).st_ino == ino
    with Recording(path) as r:
        assert r.steps() == (0, 1)


RACE_CHILD = r"""
import os, sys, time
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from exporters.recorder import FlightRecorder, RecorderError

path, rank, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"))
while time.time() < start:
    pass
try:
    rec = FlightRecorder(w, path, meta={"rank": rank})
except RecorderError as exc:
    print("REFUSED " + str(exc))
    sys.exit(0)
for i in range(5):
    with w.batch([f"r{i}"]):
        w.alloc(4)
    w.step()
rec.close()
print("RECORDED")
"""


def test_two_writers_started_at_once_on_one_path(tmp_path):
    # Two ranks given the same file name, started together: exactly one records, the other gets a clear error, and
    # the file is the winner's complete recording (before: in about half the trials both failed with "disk I/O
    # error" / "readonly database" and no file was left, or the loser deleted the winner's file).
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for trial in range(3):
        path = tmp_path / f"run-{trial}.sqlite"
        start = time.time() + 4.0  # both children have imported torch by then
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RACE_CHILD, str(path), str(rank), str(start)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
            outs.append(out.strip())
        assert sorted(o.split(" ")[0] for o in outs) == ["RECORDED", "REFUSED"], outs
        refusal = next(o for o in outs if o.startswith("REFUSED"))
        assert refusal.endswith(
            (
                "another writer is creating or writing a recording there right now",
                "a recording exists there (pass overwrite=True)",
            )
        ), refusal
        winner = outs.index("RECORDED")
        with Recording(path) as r:
            assert r.meta["rank"] == winner and r.steps() == (0, 5)


def test_a_recording_being_written_is_not_overwritten(tmp_path):
    # overwrite=True while another writer fills the file: the writer kept its lock only until its constructor
    # returned, so the second deleted the first's live file (it then stopped: "deleted or replaced").
    e = Engine("paged-4", False, "immediate")
    path = tmp_path / "r.db"
    first = FlightRecorder(e.w, path)
    with pytest.raises(RecorderError, match="another writer is creating or writing a recording there right now"):
        FlightRecorder(Engine("paged-4", False, "immediate").w, path, overwrite=True)
    e.w.step()
    first.close()
    assert first.failed is None
    with Recording(path) as r:
        assert r.steps() == (0, 1)
    FlightRecorder(e.w, path, overwrite=True).close()  # closed: free to replace


def test_a_symlink_to_a_file_not_made_yet_is_recorded_through(tmp_path):
    e = Engine("paged-4", False, "immediate")
    target = tmp_path / "data" / "r.db"
    target.parent.mkdir()
    link = tmp_path / "r.db"
    link.symlink_to(target)
    with FlightRecorder(e.w, link):
        e.w.step()
    assert link.is_symlink()
    with Recording(target) as r:
        assert r.steps() == (0, 1)


def test_a_file_left_by_a_writer_killed_while_making_it_is_taken_over(tmp_path):
    # A writer killed after switching the file to WAL and before committing its metadata leaves a SQLite file with
    # (some of) the tables and no metadata: every later writer was refused, overwrite or not.
    e = Engine("paged-4", False, "immediate")
    for n, tables in enumerate((0, 2, len(fmt._TABLES))):
        path = tmp_path / f"r{n}.db"
        with contextlib.closing(sqlite3.connect(path)) as c:  # closed: the writer that made it is gone
            c.execute("PRAGMA journal_mode = WAL")
            for stmt in [x for x in fmt._SCHEMA.split(";") if "CREATE TABLE" in x][:tables]:
                c.execute(stmt)
            if not tables:
                c.execute("PRAGMA user_version = 1")  # a header page, no table
            c.commit()
        assert path.stat().st_size > 0
        with FlightRecorder(e.w, path):
            e.w.step()
        with Recording(path) as r:
            assert r.meta["format_version"] == FORMAT_VERSION
    other = tmp_path / "other.db"  # a database of someone else's: never replaced
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE notes (x)")
    with pytest.raises(RecorderError, match="the file exists and is not a recording"):
        FlightRecorder(e.w, other, overwrite=True)


def test_a_request_id_beyond_64_bits_is_stored_as_its_text(tmp_path):
    # uuid4().int ids stopped the writer at its first commit (SQLite INTEGER is 64-bit): every event was lost.
    import uuid

    rid = uuid.UUID("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0").int
    e = Engine("paged-4", False, "immediate")
    path = tmp_path / "r.db"
    with FlightRecorder(e.w, path) as rec:
        with e.w.batch([rid]):
            slots = e.w.alloc(8)
        e.w.free(slots)
        e.w.free(slots)  # a double free, attributed to nobody; the release below is clean
        e.w.release_request(rid)
        e.w.step()
    assert rec.failed is None
    with Recording(path) as r:
        assert r.request_span(str(rid)) is not None
        released = [ev_ for ev_ in r.events() if type(ev_) is ev.RequestReleased]
        assert [x.rid for x in released] == [str(rid)]


def test_corrupt_values_are_a_clear_error(tmp_path):
    # A file whose rows hold what the recorder never writes (text where a step number or a JSON document belongs):
    # the readers' aggregates raise RecordingError naming the file, as the rest of the reader does.
    e = Engine("paged-4", False, "immediate")
    path = tmp_path / "r.db"
    with FlightRecorder(e.w, path, snapshot_every=2):
        drive(e, RandomPick(4), 40, lambda e: None)
    checks = (
        ("UPDATE segments SET step = 'y' WHERE rowid = (SELECT max(rowid) FROM segments)", "step_series",
         "the step boundaries cannot be read"),
        ("UPDATE segments SET available = '{x' WHERE boundary IS NOT NULL", "step_series",
         "the step boundaries cannot be read"),
        ("UPDATE segments SET counts = '[1' ", "event_counts", "the event counts cannot be read"),
        ("UPDATE snapshots SET step = 'y'", "steps", "the step range cannot be read"),
    )  # fmt: skip
    for sql, method, message in checks:
        bad = damaged(path, tmp_path, sql)
        with Recording(bad) as r:
            call = getattr(r, method)
            with pytest.raises(RecordingError) as info:
                call(["Alloc"]) if method == "event_counts" else call()
        assert str(info.value).startswith(f"{bad}: {message} (")


def _run_until_failure(e: Engine, rec: FlightRecorder, snaps: dict, pick) -> None:
    def on_step(e):
        snaps[e.w.step_count] = e.w.snapshot()

    deadline = time.monotonic() + 30
    while rec.failed is None:
        assert time.monotonic() < deadline, "the writer never failed"
        drive(e, pick, 30, on_step)
        rec.flush(2.0)
    drive(e, pick, 60, on_step)  # the allocator keeps working: Engine.both checks every result against the twin
    e.w.step()


@pytest.mark.parametrize("fault", ["disk_full", "file_deleted"])
def test_write_fault_mid_run_stops_recording_quietly(tmp_path, monkeypatch, caplog, fault):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    if fault == "disk_full":
        real = writer_mod._open_writer

        def tiny_disk(path):
            conn = real(path)
            conn.execute("PRAGMA max_page_count = 40")  # SQLite then reports "database or disk is full"
            return conn

        monkeypatch.setattr(writer_mod, "_open_writer", tiny_disk)
    e = Engine("swa-4", False, "immediate")
    path = tmp_path / "fault.db"
    rec = FlightRecorder(e.w, path, snapshot_every=3, flush_interval=0.01)
    if fault == "file_deleted":
        for suffix in ("", "-wal", "-shm"):
            os.remove(str(path) + suffix)
    snaps = {0: e.w.snapshot()}
    _run_until_failure(e, rec, snaps, RandomPick(3))
    assert len(warnings_of(caplog)) == 1
    message = warnings_of(caplog)[0].getMessage()
    assert str(path) in message and ("full" in message if fault == "disk_full" else "deleted" in message)
    assert e.w.bus.dropped["recorder"] > 0
    assert list(e.w.violations) == []
    rec.close()
    assert len(warnings_of(caplog)) == 1  # closing does not warn again
    # What the sink took and the writer then lost counts with what it refused (kvalloc_events_dropped_total). A
    # full disk fails inside a transaction, so it loses that transaction's events; a deleted file is seen after a
    # commit, and loses only what was queued by then (possibly nothing).
    assert rec.lost_events > 0 or fault == "file_deleted"
    assert e.w.bus.drop_counts()["recorder"] == e.w.bus.dropped["recorder"] + rec.lost_events
    if fault == "disk_full":
        with Recording(path) as r:  # what was committed stays readable and right
            _, last = r.steps()
            assert last < e.w.step_count
            assert_state_equals(r.state_at(last), snaps[last], last)


# -- (g) retention --------------------------------------------------------------------------------------------------
def test_retention_by_events_keeps_replay_working(tmp_path):
    e = Engine("swa-4", False, "immediate")
    path = tmp_path / "ret.db"
    max_events = 150
    rec = FlightRecorder(e.w, path, snapshot_every=50, max_events=max_events, flush_interval=0.01)
    a = Req(e.new_rid())
    e.extend([a], [8])
    e.w.ledger[a.rid].kv_allocated_len += 1  # an early (rejected) write: retention keeps its violation
    early = list(e.w.violations)
    assert [v.invariant for v in early] == ["kv_allocated_len_page_aligned"]
    snaps: dict = {}

    def on_step(e):
        snaps[e.w.step_count] = e.w.snapshot()
        if e.w.step_count % 10 == 0:
            rec.flush()  # let retention run while the run goes on

    drive(e, RandomPick(11), 400, on_step)
    rec.close()
    assert e.w.bus.dropped["recorder"] == 0
    with Recording(path) as r:
        first, last = r.steps()
        assert last == e.w.step_count and first > 20
        n = sum(1 for _ in r.events())
        assert n <= 2 * max_events
        assert list(r.events(stop=first)) == []
        assert r.violations() == early
        for step in range(first, last + 1):
            if step in snaps:
                assert_state_equals(r.state_at(step), snaps[step], step)
        with pytest.raises(ValueError, match="not in the recording"):
            r.state_at(first - 1)


def test_retention_by_bytes_bounds_the_file(tmp_path):
    def run(max_bytes):
        e = Engine("paged-16", False, "immediate")
        path = tmp_path / f"b{max_bytes}.db"
        rec = FlightRecorder(e.w, path, snapshot_every=1000, max_bytes=max_bytes, flush_interval=0.01)
        snaps: dict = {}

        def on_step(e):
            snaps[e.w.step_count] = e.w.snapshot()
            if e.w.step_count % 10 == 0:
                rec.flush()

        # 2000 operations: the unbounded file is about 340 KiB. (With 1000 it was 192-204 KiB, its size moving
        # by a page or two with where the commits fall, and a bound of "more than 3 x 64 KiB" failed once in CI.)
        drive(e, RandomPick(5), 2000, on_step)
        rec.close()
        return path, snaps, e

    unbounded, _, _ = run(None)
    path, snaps, e = run(64 * 1024)
    assert unbounded.stat().st_size > 4 * 64 * 1024
    assert path.stat().st_size <= 2 * 64 * 1024
    with Recording(path) as r:
        first, last = r.steps()
        assert first > 0 and last == e.w.step_count
        for step in (first, (first + last) // 2, last):
            assert_state_equals(r.state_at(step), snaps[step], step)


@pytest.mark.parametrize("bound", ["bytes", "events"])
def test_retention_bounds_a_run_that_violates_every_step(tmp_path, bound):
    """A run that violates at every step (here: rejected ledger writes, 4 a step): the violations table keeps the
    first 100 of the run and the newest within its share of the bound (a quarter of max_bytes, half of
    max_events), counting the rest in meta's violations_dropped, so the file stays bounded and the history stays
    replayable. It used to keep every violation: a 256 KiB bound grew to 1.8 MB while retention deleted all the
    history but the current step trying to get under it."""
    import torch

    from instrumented_alloc import InstrumentedAllocator
    from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator

    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(256, 4, torch.float16, "cpu"))
    path = tmp_path / "violating.db"
    limits = {"max_bytes": 256 * 1024} if bound == "bytes" else {"max_events": 4000}
    rec = FlightRecorder(w, path, snapshot_every=20, flush_interval=0.01, **limits)
    seen: list = []
    w.subscribe(lambda batch: seen.extend(e.violation for e in batch if isinstance(e, ev.ViolationEvent)))
    with w.batch(["r"]):
        w.alloc(4)
    for i in range(1500):
        for _ in range(4):
            w.ledger["r"].kv_committed_len = 10**6 + i  # rejected: kv_committed_le_allocated
        w.step()
        assert rec.flush(5.0)  # nothing lost to a full queue: every violation reaches the file
    rec.close()
    assert len(seen) == 6000
    with Recording(path) as r:
        vs = r.violations()
        kept = [(v.step, v.message) for v in vs]
        assert kept[:100] == [(v.step, v.message) for v in seen[:100]]  # where it began
        assert kept[100:] == [(v.step, v.message) for v in seen[len(seen) - len(vs) + 100 :]]  # the newest
        assert int(r.meta["violations_dropped"]) == len(seen) - len(vs) > 0
        first, last = r.steps()
        assert last == w.step_count and last - first >= 20
        r.state_at(first)
        if bound == "bytes":
            assert path.stat().st_size <= 1.25 * 256 * 1024
            assert len(vs) < 1500
        else:
            assert len(vs) == 2000


def stuck_writer(rec, monkeypatch):
    """Hold the writer in its next write until the returned gate is set; ``entered`` is set once it is held."""
    gate, entered = threading.Event(), threading.Event()
    real_write = rec._writer.write

    def stuck_write(item):
        entered.set()
        gate.wait(10)
        return real_write(item)

    monkeypatch.setattr(rec._writer, "write", stuck_write)
    return gate, entered


# -- the bounded queue: a full queue drops, never blocks, and replay does not cross the gap ---------------------------
def test_full_queue_drops_batches_and_marks_the_gap(tmp_path, monkeypatch):
    e = Engine("paged-4", False, "immediate")
    path = tmp_path / "q.db"
    rec = FlightRecorder(e.w, path, snapshot_every=1000, queue_size=2, flush_interval=0.01)
    gate, entered = stuck_writer(rec, monkeypatch)
    snaps: dict = {}
    pick = RandomPick(2)

    def on_step(e):
        snaps[e.w.step_count] = e.w.snapshot()

    e.w.step()
    on_step(e)
    assert entered.wait(5)  # the writer holds the first batch and takes nothing more until the gate opens
    drive(e, pick, 40, on_step)
    assert e.w.bus.dropped["recorder"] > 0  # the writer is stuck: the sink refused, the engine went on
    rec._queue.queue_size = 10000  # from here on the writer keeps up: exactly one gap
    gate.set()
    assert rec.flush()
    drive(e, pick, 40, on_step)
    e.w.step()
    on_step(e)
    rec.close()
    with Recording(path) as r:
        lost = list(r.events(kinds=["EventsLost"]))
        assert len(lost) == 1 and lost[0].n_events > 0
        # One gap: every refused event is inside the marker's range, and counted.
        assert lost[0].n_events == e.w.bus.dropped["recorder"] == lost[0].last_seq - lost[0].first_seq + 1
        assert r.meta["events_dropped"] == e.w.bus.dropped["recorder"]
        resync = [s for s in r.snapshot_steps() if s > 0]
        assert resync and resync[0] >= lost[0].step, "a snapshot after the gap lets replay resume"
        missing, boundary_lost = [], []
        for step, s in snaps.items():
            try:
                state = r.state_at(step)
            except IncompleteHistory as exc:  # not "not in the recording": every step is inside its range
                missing.append(step)
                if "its step boundary was lost" in str(exc):
                    boundary_lost.append(step)
                continue
            assert_state_equals(state, s, step)
        assert missing and missing == list(range(missing[0], resync[0]))  # the steps whose boundaries were dropped
        # The steps whose own boundary was refused say so; the later ones cannot cross the gap's marker.
        with r._read() as conn:
            recorded = {int(x) for (x,) in conn.execute("SELECT step FROM segments WHERE boundary IS NOT NULL")}
        assert boundary_lost and boundary_lost == [step for step in missing if step not in recorded]


# -- hashed request ids --------------------------------------------------------------------------------------------
HASH_KEY = b"recorder-test-key"


def _pseudonym(rid) -> str:
    """Computed here independently of instrumented_alloc.redact: HMAC-SHA256 of the id's text, 16 hex digits."""
    import hashlib
    import hmac

    return "h:" + hmac.new(HASH_KEY, str(rid).encode(), hashlib.sha256).hexdigest()[:16]


class _IdEngine(Engine):
    """An Engine whose request ids are long and distinctive (a scan of the file cannot meet one by chance)."""

    def __init__(self, make_rid, *args):
        super().__init__(*args)
        self._make_rid = make_rid

    def new_rid(self):
        self.n += 1
        return self._make_rid(self.n)


def _texts_of_recording(path) -> list:
    """Every text the file holds: every text and blob column of every table, blobs decoded (block payloads
    through ``_decode_block``, deflated or not; snapshot ledgers and owners unpacked), and the raw bytes of the file
    itself."""
    out: list = []
    classes = fmt._classes_of(Recording(path).meta["kinds"])
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        assert set(tables) == set(fmt._TABLES)
        for table in tables:
            cols = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
            for row in conn.execute(f"SELECT * FROM {table}"):
                row = dict(zip(cols, row))
                for name, v in row.items():
                    if isinstance(v, (str, int)):
                        out.append(str(v))
                    elif isinstance(v, bytes):
                        out.append(v.decode("latin-1"))
                        if table == "blocks" and name == "payload":
                            events = decode._decode_block(v, row["seq"], row["step"], classes)
                            assert len(events) == row["n"]
                            out.extend(repr(e) for e in events)
                        elif table == "snapshots" and name == "ledger":
                            out.append(json.dumps(fmt._unpack(v)))
                        elif table == "snapshots" and name == "owner":
                            out.append(repr(decode._decode_owner(v).tolist()))
    finally:
        conn.close()
    out.append(Path(path).read_bytes().decode("latin-1"))
    return out


def _needles(rid) -> list:
    """How a raw request id could appear: its text, and for an int also SQLite's big-endian integer encoding."""
    if isinstance(rid, int):
        return [str(rid), rid.to_bytes(6, "big").decode("latin-1"), rid.to_bytes(8, "big").decode("latin-1")]
    return [rid]


def _assert_events_mapped(raw_events, hashed_events, h) -> None:
    assert len(raw_events) == len(hashed_events) > 0
    for a, b in zip(raw_events, hashed_events):
        assert type(a) is type(b) and a.seq == b.seq
        want = h.event_fields(a.__dict__)
        for f in a.__dataclass_fields__:
            x, y = want[f], getattr(b, f)
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and (x == y).all(), (type(a).__name__, f)
            else:
                assert x == y, (type(a).__name__, f, x, y)


@pytest.mark.parametrize(
    "make_rid",
    [lambda n: f"secret-request-{n:05d}", lambda n: 98_765_430_000 + n],
    ids=["str", "int"],
)
def test_hashed_request_ids(tmp_path, make_rid):
    from instrumented_alloc.redact import RequestIdHasher

    h = RequestIdHasher(HASH_KEY)
    e = _IdEngine(make_rid, "swa-4", False, "immediate")
    raw_path, hashed_path = tmp_path / "raw.db", tmp_path / "hashed.db"
    raw = FlightRecorder(e.w, raw_path, snapshot_every=5, flush_interval=0.05)
    hashed = FlightRecorder(e.w, hashed_path, snapshot_every=5, flush_interval=0.05, hash_request_ids=h)
    start = e.w.step_count
    drive(e, RandomPick(11), 120)
    # Violations naming a request: a rejected ledger write, a leak at release, an unknown id given to release.
    victim = next(r for r in e.reqs.values() if r.row)
    e.w.ledger[victim.rid].kv_allocated_len = e.w.ledger[victim.rid].kv_allocated_len + 1
    leaker = next(r for r in e.reqs.values() if r.row and r is not victim)
    e.w.release_request(leaker.rid)
    del e.reqs[leaker.rid]
    ghost = make_rid(99_999)
    with pytest.raises(ValueError):
        e.w.release_request(ghost)
    e.w.step()
    end = e.w.step_count
    raw.close()
    hashed.close()
    assert e.w.bus.dropped["recorder"] == 0 and raw.failed is None and hashed.failed is None
    rids = {make_rid(n) for n in range(1, e.n + 1)} | {ghost}

    with Recording(raw_path) as r, Recording(hashed_path) as hr:
        # The metadata says how ids are stored (never the key).
        assert r.meta["request_ids"] == {"scheme": "raw"}
        assert hr.meta["request_ids"] == {
            "scheme": "hmac-sha256",
            "prefix": "h:",
            "hex_digits": 16,
            "text": "str; int as decimal; else repr",
        }
        # Violations: rid and message redacted, everything else identical.
        rv, hv = r.violations(), hr.violations()
        assert [v.invariant for v in rv] == ["kv_allocated_len_page_aligned", "request_leak", "invalid_argument"]
        assert [v.rid for v in rv] == [victim.rid, leaker.rid, ghost]
        assert hv == [
            Violation(**{**v.__dict__, "rid": _pseudonym(v.rid), "message": h.message(v.message, v.rid)}) for v in rv
        ]
        held = rv[1].message.split("owning ")[1]
        assert hv[1].message == f"request {_pseudonym(leaker.rid)!r} released while still owning {held}"
        assert hv[2].message == f"release_request: rid: unknown request id {_pseudonym(ghost)!r}"
        assert hv[0].message == rv[0].message  # no id in it: untouched
        # Every event: the same, with each request id as its pseudonym.
        _assert_events_mapped(list(r.events()), list(hr.events()), h)
        # Replay: the state at every step equals the raw recording's with ids mapped.
        assert r.steps() == hr.steps() == (start, end)
        assert r.snapshot_steps() == hr.snapshot_steps()
        for step in range(start, end + 1):
            a, b = r.state_at(step), hr.state_at(step)
            assert (a.step, a.seq) == (b.step, b.seq)
            assert {k: v.tolist() for k, v in a.owners.items()} == {k: v.tolist() for k, v in b.owners.items()}
            assert b.ledger == {_pseudonym(k): v for k, v in a.ledger.items()}
            assert b.slot_rids == {s: _pseudonym(k) for s, k in a.slot_rids.items()}
        assert hr.request_span(_pseudonym(victim.rid)) == r.request_span(victim.rid) is not None

    # No raw id anywhere in the hashed file; the raw file, scanned the same way, has them all (the scan works).
    hashed_texts, raw_texts = _texts_of_recording(hashed_path), _texts_of_recording(raw_path)
    for rid in rids:
        assert not any(n in text for n in _needles(rid) for text in hashed_texts), rid
        assert any(str(rid) in text for text in raw_texts), rid
    assert any(_pseudonym(victim.rid) in text for text in hashed_texts)
    assert not any(HASH_KEY.decode() in text for text in hashed_texts)


def test_batches_refused_at_the_end_get_their_marker_at_close(tmp_path, monkeypatch):
    # The marker of refused batches is written before the next accepted one; at the end there is none, so close()
    # writes it: replay of the last step must not cross the events lost there (it showed them as never made).
    e = Engine("paged-4", False, "immediate")
    path = tmp_path / "end.db"
    rec = FlightRecorder(e.w, path, snapshot_every=1000, queue_size=1, flush_interval=0.01)
    gate, entered = stuck_writer(rec, monkeypatch)
    e.w.step()
    assert entered.wait(5)  # the writer holds the boundary's batch
    e.w.step()  # queued: the queue is full now
    seqs = []
    e.w.subscribe(lambda batch: seqs.extend(x.seq for x in batch))
    e.extend([Req("a")], [6])  # refused
    e.extend([Req("b")], [3])  # refused
    assert e.w.bus.dropped["recorder"] == len(seqs) > 0
    gate.set()
    rec.close()
    with Recording(path) as r:
        (marker,) = r.events(kinds=["EventsLost"])
        assert (marker.first_seq, marker.last_seq, marker.n_events) == (seqs[0], seqs[-1], len(seqs))
        assert marker.step == 2 and r.steps() == (0, 2)
        with pytest.raises(IncompleteHistory):
            replay.apply(r.state_at(2), r.events(start=2, stop=3))


# -- (h) damaged recordings: a clear error naming the file, never a bare exception or another step's state -----------
@pytest.fixture(scope="module")
def damaged_src(tmp_path_factory):
    """A real recording (two pools, snapshots at steps 0, 50, 100, blocks of 512 events) and the live snapshots."""
    path = tmp_path_factory.mktemp("damaged") / "good.db"
    e = Engine("swa-4", False, "immediate")
    snaps: dict = {}
    with FlightRecorder(e.w, path, snapshot_every=50) as rec:
        drive(e, RandomPick(5), 600, lambda e: snaps.__setitem__(e.w.step_count, e.w.snapshot()))
    assert rec.failed is None and e.w.step_count >= 100
    return path, snaps


def damaged(src, tmp_path, *sql, params=()):
    """A copy of ``src`` with ``sql`` applied by plain sqlite3 (statement i with ``params[i]``)."""
    bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}.db"
    with sqlite3.connect(src) as s, sqlite3.connect(bad) as d:
        s.backup(d)
    with sqlite3.connect(bad) as c:
        for i, stmt in enumerate(sql):
            c.execute(stmt, params[i] if i < len(params) else ())
    return bad


def _raises(cls, message, fn, *args):
    """``fn(*args)`` raises exactly ``cls`` with a message that starts with ``message``."""
    with pytest.raises(Exception) as info:
        fn(*args)
    assert type(info.value) is cls, (type(info.value), info.value)
    assert str(info.value).startswith(message), str(info.value)
    return info.value


def test_state_at_refuses_a_history_with_missing_blocks(damaged_src, tmp_path):
    # Blocks between the step-50 snapshot and step 99's boundary deleted (their segments kept): state_at(99) used to
    # return an earlier step's state (or step 99 with pages missing) silently; events() skipped them.
    src, snaps = damaged_src
    with Recording(src) as r:
        assert_state_equals(r.state_at(99), snaps[99], 99)
        blocks = [s for (s,) in r._conn.execute("SELECT seq FROM blocks WHERE step >= 50 AND step < 100 ORDER BY seq")]
        last = r._conn.execute("SELECT max(last) FROM segments WHERE block = ?", (blocks[1],)).fetchone()[0]
    assert len(blocks) >= 3
    for sql in (
        f"DELETE FROM blocks WHERE seq = {blocks[1]}",  # one in the middle: step 99's boundary still there
        f"DELETE FROM blocks WHERE seq >= {blocks[1]} AND step < 100",  # every one up to step 99's boundary
    ):
        bad = damaged(src, tmp_path, sql)
        with Recording(bad) as r:
            message = f"{bad}: the events of seq {blocks[1]}..{last} are missing (their block is indexed in segments"
            _raises(RecordingError, message, r.state_at, 99)
            _raises(RecordingError, message, lambda: list(r.events()))
            _raises(RecordingError, message, lambda: list(r.events(60, 99)))
            assert_state_equals(r.state_at(50), snaps[50], 50)  # a step whose history is intact still answers
            assert len(list(r.events(0, 40))) > 0
            assert_state_equals(r.state_at(100), snaps[100], 100)


def test_state_at_checks_that_the_replay_reached_the_step(damaged_src, tmp_path, monkeypatch):
    # A history the segments do not reveal as cut (the blocks' own rows say less than their index): the replay must
    # end at the step's boundary, or the answer is another step's state.
    src, _ = damaged_src
    with Recording(src) as r:
        end = r._conn.execute("SELECT boundary FROM segments WHERE step = 99 AND boundary IS NOT NULL").fetchone()[0]
        block = r._conn.execute("SELECT max(seq) FROM blocks WHERE seq <= ?", (end,)).fetchone()[0]
    bad = damaged(src, tmp_path, f"UPDATE blocks SET kinds = 1 WHERE seq = {block}")  # as if no state kind in it
    with Recording(bad) as r:
        e = _raises(RecordingError, f"{bad}: step 99: the replay from the snapshot at seq ", r.state_at, 99)
        assert f"not at the step's boundary (seq {end}): the events of seq " in str(e)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"Alloc"', "meta kinds is not a list of event kind names: 'Alloc'"),
        ('["Alloc","AllocFailed"]', "meta kinds lacks PageUpdate, LedgerUpdate, LedgerWrite, RequestReleased,"),
        ('["StepBoundary","StepBoundary"]', "meta kinds names a kind twice"),
        (None, "no kinds in its meta table"),
    ],
)
def test_damaged_meta_kinds_is_refused_at_open(damaged_src, tmp_path, value, message):
    # A string or a short list made the reader's state-kinds mask 0: state_at skipped every block silently; a meta
    # table without kinds raised a bare KeyError.
    src, _ = damaged_src
    if value is None:
        bad = damaged(src, tmp_path, "DELETE FROM meta WHERE key = 'kinds'")
    else:
        bad = damaged(src, tmp_path, "UPDATE meta SET value = ? WHERE key = 'kinds'", params=[(value,)])
    _raises(RecordingError, f"{bad}: unusable flight recording: {message}", Recording, bad)


def test_damaged_index_tables_are_refused_at_open(damaged_src, tmp_path):
    src, _ = damaged_src
    for sql, message in (
        ("DELETE FROM segments", "its segments table does not index its blocks (the first block has seq 1, the first"),
        ("DELETE FROM kindsets", "its kindsets table lacks the kinds"),
        ("DELETE FROM blocks WHERE seq = (SELECT max(seq) FROM blocks)",
         "its segments table does not index its blocks (the last block has seq "),
    ):
        bad = damaged(src, tmp_path, sql)
        _raises(RecordingError, f"{bad}: unusable flight recording: {message}", Recording, bad)


def _block_body(payload: bytes) -> bytes:
    import zlib

    return zlib.decompressobj(-15).decompress(payload[1:]) if payload[:1] == b"D" else payload[1:]


def test_a_damaged_block_header_is_a_recording_error(damaged_src, tmp_path):
    # np.dtype(",i4") (one bit flipped in '<i4') raised a bare SyntaxError; a length beyond int64 OverflowError.
    import struct

    src, _ = damaged_src
    with Recording(src) as r:
        seq, payload = r._conn.execute("SELECT seq, payload FROM blocks WHERE step >= 60 ORDER BY seq").fetchone()
    body = _block_body(payload)
    (n,) = struct.unpack_from("<I", body, 0)
    head, rest = body[4 : 4 + n], body[4 + n :]
    doc = json.loads(head)
    flipped = head.replace(b'"x":"<', b'"x":",', 1)
    assert flipped != head
    big = dict(doc, a=[doc["a"][0], doc["a"][1], [10**30, *doc["a"][2][1:]]])
    assert isinstance(doc["a"][0], str)
    for h, what in ((flipped, "SyntaxError"), (json.dumps(big, separators=(",", ":")).encode(), "OverflowError")):
        blob = b"B" + struct.pack("<I", len(h)) + h + rest
        bad = damaged(src, tmp_path, "UPDATE blocks SET payload = ? WHERE seq = ?", params=[(blob, seq)])
        with Recording(bad) as r:
            message = f"{bad}: the events of the block at seq {seq} cannot be decoded ({what}: "
            _raises(RecordingError, message, lambda: list(r.events()))
            _raises(RecordingError, message, r.state_at, 99)


@pytest.mark.parametrize(
    ("sql", "params", "message"),
    [
        ("UPDATE snapshots SET ledger = CAST(replace(CAST(ledger AS TEXT), '\"rows\"', '\"rgws\"') AS BLOB) "
         "WHERE step = 50", (), "(ValueError: the ledger document is not {rows, slot_rids})"),
        ("UPDATE snapshots SET ledger = ? WHERE step = 50", (b"R[1,2]",),
         "(ValueError: the ledger document is not {rows, slot_rids})"),
        ("UPDATE snapshots SET ledger = ? WHERE step = 50", (b'R{"rows":[["r1",3]],"slot_rids":[]}',),
         "(ValueError: a ledger row is not [request id, slot, allocated, committed, evicted]: ['r1', 3])"),
        ("UPDATE snapshots SET ledger = ? WHERE step = 50", (b'R{"rows":[[["r1"],3,1,1,0]],"slot_rids":[]}',),
         "(ValueError: a ledger row is not [request id, slot, allocated, committed, evicted]: [['r1'], 3, 1, 1, 0])"),
        ("UPDATE snapshots SET ledger = ? WHERE step = 50", (b"R" + b"[" * 100000,), "(RecursionError: "),
        ("UPDATE snapshots SET owner = 5 WHERE step = 50", (), "(ValueError: the owner array of pool "),
        ("UPDATE snapshots SET owner = x'5a00' WHERE step = 50", (), "(error: "),
        ("DELETE FROM snapshots WHERE step = 50 AND pool = 'swa'", (),
         "(ValueError: it holds pools ['full'], the run has ['full', 'swa'])"),
        ("UPDATE snapshots SET owner = (SELECT owner FROM snapshots s WHERE s.step = 0 AND s.pool = 'swa'), "
         "num_pages = 7 WHERE step = 50 AND pool = 'swa'", (),
         "(ValueError: pool 'swa' has 25 owner entries for 7 pages)"),
    ],
)  # fmt: skip
def test_a_damaged_snapshot_is_a_recording_error(damaged_src, tmp_path, sql, params, message):
    # Damaged ledger or owner rows leaked KeyError/TypeError/RecursionError or a ValueError without the file name; a
    # snapshot missing a pool (or with an owner array of another length) was taken as the base silently.
    src, snaps = damaged_src
    bad = damaged(src, tmp_path, sql, params=[params])
    with Recording(bad) as r:
        seq = r._conn.execute("SELECT seq FROM snapshots WHERE step = 50").fetchone()[0]
        for step in (50, 70):
            e = _raises(RecordingError, f"{bad}: the snapshot at seq {seq} cannot be used ", r.state_at, step)
            assert message in str(e)
        assert_state_equals(r.state_at(100), snaps[100], 100)


def test_events_that_do_not_fit_the_base_are_a_recording_error(damaged_src, tmp_path):
    # replay's own ValueError ("event N: unknown pool") named no file.
    src, _ = damaged_src
    with Recording(src) as r:
        seq = r._conn.execute("SELECT seq FROM snapshots WHERE step = 50").fetchone()[0]
    bad = damaged(src, tmp_path, "UPDATE meta SET value = ? WHERE key = 'pools'",
                  "DELETE FROM snapshots WHERE pool = 'swa'",
                  params=[('[{"name":"full","num_pages":24,"page_size":4}]',)])  # fmt: skip
    with Recording(bad) as r:
        e = _raises(RecordingError, f"{bad}: step 70 cannot be replayed from the snapshot at ", r.state_at, 70)
        assert f"at seq {seq}: event " in str(e) and "unknown pool 'swa'" in str(e)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("format_version", "4.9", "is not a flight recording (format_version 4.9 is not an integer)"),
        ("pools", "7", "unusable flight recording: meta pools is not a list of pools: 7"),
        ("pools", '[{"name":"full"}]', "unusable flight recording: meta pools holds a pool that is not {name, "),
        ("page_size", '"16"', "unusable flight recording: meta page_size is not an int >= 1: '16'"),
        ("sliding_window", '"x"', "unusable flight recording: meta sliding_window is not null or an int >= 1: 'x'"),
        ("violations_dropped", '"many"', "unusable flight recording: meta violations_dropped is not an int >= 0:"),
        ("page_size", None, "unusable flight recording: no page_size in its meta table"),
    ],
)
def test_damaged_meta_values_are_refused_at_open(damaged_src, tmp_path, key, value, message):
    src, _ = damaged_src
    if value is None:
        bad = damaged(src, tmp_path, "DELETE FROM meta WHERE key = ?", params=[(key,)])
    else:
        bad = damaged(src, tmp_path, "INSERT OR REPLACE INTO meta VALUES (?, ?)", params=[(key, value)])
    sep = " " if message.startswith("is not") else ": "
    _raises(RecordingError, f"{bad}{sep}{message}", Recording, bad)


def test_damaged_violation_rows_are_a_recording_error(tmp_path):
    e = Engine("paged-4", False, "immediate")
    path = tmp_path / "v.db"
    with FlightRecorder(e.w, path):
        a = Req(e.new_rid())
        e.extend([a], [8])
        e.w.ledger[a.rid].kv_allocated_len += 1  # a violation
        e.w.step()
    with Recording(path) as r:
        assert len(r.violations()) == 1
    bad = damaged(path, tmp_path, "UPDATE violations SET step = 'abc'")
    with Recording(bad) as r:
        _raises(RecordingError, f"{bad}: a violation row holds values the recorder never writes: (", r.violations)
