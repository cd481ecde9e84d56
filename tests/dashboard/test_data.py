"""Data access (``dashboard.data``) against a demo recording: the end-of-step state, one request's history."""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboard import data, views
from exporters.recorder import Recording


@pytest.fixture
def rec(recordings):
    with Recording(recordings.dir / "faults.sqlite") as r:
        yield r


def test_state_at_the_end_of_a_step_is_the_next_boundary(rec):
    first, last = rec.steps()
    assert first == 0 and last >= 200  # the demo's 200 steps (and its final sweep's)
    for step in range(first, last):
        end, nxt = data.state_end_of(rec, step), rec.state_at(step + 1)
        for pool in nxt.owners:
            assert (end.owners[pool] == nxt.owners[pool]).all(), (step, pool)
        assert end.ledger == nxt.ledger, step
    with pytest.raises(data.DashboardInputError, match=f"step {last + 1} is not in the recording"):
        data.state_end_of(rec, last + 1)


def test_request_history_narrows_the_scan_without_losing_anything(rec, recordings):
    every = list(rec.events(kinds=data.LIFELINE_KINDS))
    for _, step, rid, _ in recordings.faults:
        events, start, lo, hi = data.request_history(rec, rid, 0)
        # The scan starts at a snapshot step before the request's first event (snapshots every 100 steps here).
        assert lo % 100 == 0 and lo <= step <= hi
        assert views.lifeline(rid, events, start_ledger=start) == views.lifeline(rid, every)
    assert data.request_history(rec, "no-such-request", 0) is None


def test_overview(rec):
    ov = data.overview(rec)
    assert (ov.first, ov.last, ov.finished) == (0, *rec.steps()[1:], True)
    assert ov.events == rec.event_count() and ov.violations == len(rec.violations())
    assert [p["name"] for p in ov.pools] == ["full", "swa"]


def test_a_hashed_recording_reads_the_same(tmp_path):
    """A recording with hashed request ids (the same run recorded twice, raw and hashed): the dashboard's data and
    views are the raw one's with every id as its pseudonym."""
    from instrumented_alloc.redact import RequestIdHasher
    from tests.dashboard.scenario import record

    h = RequestIdHasher(b"dashboard-test-key")
    faults = [("swa-misaligned", 20), ("double-free", 35), ("leak", 50)]
    raw_faults = record(tmp_path / "raw.sqlite", 80, faults)
    assert record(tmp_path / "hashed.sqlite", 80, faults, hash_request_ids=h) == raw_faults
    assert [f[0] for f in raw_faults] == ["swa-misaligned", "double-free", "leak"]
    with Recording(tmp_path / "raw.sqlite") as r, Recording(tmp_path / "hashed.sqlite") as hr:
        ov, hov = data.overview(r), data.overview(hr)
        assert (ov.first, ov.last, ov.pools, ov.events, ov.violations, ov.finished) == (
            hov.first, hov.last, hov.pools, hov.events, hov.violations, hov.finished
        )
        every = list(hr.events(kinds=data.LIFELINE_KINDS))
        for _, step, rid in raw_faults:
            events, start, lo, hi = data.request_history(r, rid, 0)
            hevents, hstart, hlo, hhi = data.request_history(hr, h(rid), 0)
            assert (hstart, hlo, hhi) == (start, lo, hi) and lo <= step <= hi
            life = views.lifeline(rid, events, start_ledger=start)
            hlife = views.lifeline(h(rid), hevents, start_ledger=hstart)
            assert hlife == views.lifeline(h(rid), every)
            assert hlife["rows"] and len(hlife["rows"]) == len(life["rows"])
            assert repr(hlife) == repr(life).replace(repr(rid), repr(h(rid))).replace(rid, h(rid))
        step = raw_faults[-1][1]
        state, hstate = data.state_end_of(r, step), data.state_end_of(hr, step)
        assert hstate.ledger == {h(k): v for k, v in state.ledger.items()}
        raw_violations = r.violations()
        assert views.violation_rows(hr.violations(), newest_first=False) == [
            {**row, "request": "" if v.rid is None else h(v.rid), "message": h.message(v.message, v.rid)}
            for row, v in zip(views.violation_rows(raw_violations, newest_first=False), raw_violations)
        ]
        assert any(v.rid is not None and repr(v.rid) in v.message for v in raw_violations)  # some message names one


def test_a_step_whose_own_events_were_lost_is_not_rebuilt(tmp_path, monkeypatch):
    # Step 2's boundary was recorded, its events were refused (the writer held up, the queue full), and the next
    # batch accepted is step 3's boundary: the loss marker is stamped 3, so the events stamped 2 alone do not
    # cross it. The end of step 2 must be refused, not shown without the lost events.
    import torch

    from exporters.recorder import FlightRecorder
    from instrumented_alloc import InstrumentedAllocator
    from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
    from tests.engine_model import Req, extend_args, split_extend
    from tests.exporters.test_recorder import stuck_writer

    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
    path = tmp_path / "lost.sqlite"
    rec = FlightRecorder(w, path, snapshot_every=1000, queue_size=1, flush_interval=0.01)
    gate, entered = stuck_writer(rec, monkeypatch)
    w.step()
    assert entered.wait(5)
    w.step()  # step 2's boundary: queued, the queue is full now
    a = Req("a")
    with w.batch(["a"]):
        split_extend([a], [6], w.alloc_extend(*extend_args([a], [6])))  # refused: lost
    assert w.bus.dropped["recorder"] > 0
    gate.set()
    assert rec.flush(5.0)
    w.step()  # step 3's boundary: accepted, after the marker
    rec.close()
    with Recording(path) as r:
        (marker,) = r.events(kinds=["EventsLost"])
        assert marker.step == 3
        data.state_end_of(r, 1)  # before the loss: fine
        with pytest.raises(data.DashboardInputError, match=r"^step 2 cannot be rebuilt: \d+ events in it were lost"):
            data.state_end_of(r, 2)


def test_a_request_seen_only_in_batch_calls_has_a_history(tmp_path):
    # Two requests prefilled and decoded together, never released: every event of theirs is a batch call, which
    # the recording does not index by request. Picked from a state where it is live, its history is still found.
    import torch

    from exporters.recorder import FlightRecorder
    from instrumented_alloc import InstrumentedAllocator
    from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
    from tests.engine_model import Req, decode_args, extend_args, split_extend

    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
    path = tmp_path / "batch.sqlite"
    with FlightRecorder(w, path, snapshot_every=1000):
        a, b = Req("a"), Req("b")
        with w.batch(["a", "b"]):
            split_extend([a, b], [6, 5], w.alloc_extend(*extend_args([a, b], [6, 5])))
        w.step()
        for _ in range(3):
            with w.batch(["a", "b"]):
                out = w.alloc_decode(*decode_args([a, b]))
            a.row.append(int(out[0]))
            b.row.append(int(out[1]))
            w.step()
    with Recording(path) as r:
        last = r.steps()[1]
        assert r.request_span("a") is None and data.request_history(r, "a", 0) is None
        state = data.state_end_of(r, last)
        assert "a" in state.ledger
        events, start, lo, hi = data.request_history(r, "a", 0, live_at=state.step)
        assert (lo, hi) == (0, last) and start is None
        life = views.lifeline("a", events, start_ledger=start)
        assert life["released"] is None and life["violations"] == 0
        assert [row["kv_committed_len"] for row in life["rows"]][-1] == 9  # 6 prefilled + 3 decoded


def test_snapshot_states_leave_out_what_retention_deleted_since(tmp_path):
    # The live view reads the recent snapshot steps, then each state: a bounded recording being written may delete
    # the oldest of those steps in between. They are left out, not shown as an error (the page used to stop there).
    from tests.exporters.test_recorder import bounded_recording

    path = tmp_path / "bounded.sqlite"
    rec, steps = bounded_recording(path, max_events=40, snapshot_every=4)
    steps(20)
    with Recording(path) as r:
        wanted = r.snapshot_steps()[-8:]
        live = {s: r.state_at(s) for s in wanted}
        assert len(wanted) >= 3
        while r.steps()[0] <= wanted[0]:
            steps(1)  # until retention deletes the oldest of them
        kept = [s for s in wanted if s >= r.steps()[0]]
        assert 0 < len(kept) < len(wanted)
        got = data.snapshot_states(r, reversed(wanted))
        assert [s for s, _ in got] == kept[::-1]
        for s, state in got:
            assert all((state.owners[p] == live[s].owners[p]).all() for p in state.owners)
        with pytest.raises(data.DashboardInputError, match="not in the recording"):
            data.snapshot_states(r, [r.steps()[1] + 10])  # not yet written: still an error
    rec.close()


# -- the instrumentation's self-cost ----------------------------------------------------------------------------------
PRE_SELFCOST = Path(__file__).resolve().parents[1] / "data" / "pre-selfcost.sqlite"  # see tests/exporters/test_recorder


def selfcost_recording(path, steps: int, work: int = 3) -> None:
    """A real wrapped paged allocator with a real FlightRecorder (snapshots every 10 steps, so no block of events
    spans more than 10 steps): ``work`` requests of 8 tokens allocated, freed and released per step."""
    import torch

    from exporters.recorder import FlightRecorder
    from instrumented_alloc import InstrumentedAllocator
    from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator

    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(256, 4, torch.float16, "cpu"), mode="record")
    with FlightRecorder(w, path, snapshot_every=10):
        for i in range(steps):
            for k in range(work):
                rid = f"r{i}-{k}"
                with w.batch([rid]):
                    out = w.alloc(8)
                w.free(out)
                w.release_request(rid)
            w.step()


def test_self_cost_over_the_newest_iterations(tmp_path):
    from instrumented_alloc.selfcost import PARTS

    path = tmp_path / "selfcost.sqlite"
    selfcost_recording(path, 300)
    with Recording(path) as r:
        last = data.overview(r).last
        assert last == 300
        every = {b.step: b for b in r.events(kinds=["StepBoundary"])}
        assert sorted(every) == list(range(1, 301))
        for steps, first in ((data.SELF_COST_STEPS, 100), (50, 250), (1000, 1)):
            sc = data.self_cost(r, last, steps)
            old, new = every[first], every[300]
            n = 300 - first
            assert (sc.recorded, sc.first, sc.last, sc.iterations) == (True, first, 300, n)
            assert list(sc.per_iteration) == list(PARTS)
            assert sc.per_iteration == {p: (new.overhead[i] - old.overhead[i]) / n for i, p in enumerate(PARTS)}
            assert sc.total == pytest.approx(sum(sc.per_iteration.values()), rel=1e-12)
            assert sc.seconds == new.ts - old.ts and sc.iterations_per_second == n / (new.ts - old.ts)
            # The per-iteration costs of the window's iterations (the boundaries after the oldest) add up to what
            # the totals grew by: nothing was charged outside an iteration in this run.
            costs = sorted(every[s].iteration_seconds for s in range(first + 1, 301))
            assert len(costs) == n and sum(costs) == pytest.approx(sc.total * n, rel=1e-9)
            assert sc.p50 in costs and sc.p99 in costs and sc.p50 <= sc.p99
            assert sum(c <= sc.p99 for c in costs) >= 0.99 * n and sum(c < sc.p99 for c in costs) < 0.99 * n
            assert sum(c <= sc.p50 for c in costs) >= 0.5 * n and sum(c < sc.p50 for c in costs) < 0.5 * n
            # No SGLang plugin: no hook time. The wrapper checks every call; the recorder's sink runs on this thread.
            assert sc.per_iteration["hooks"] == 0.0
            assert sc.per_iteration["checks"] > 0 and sc.per_iteration["exporters"] > 0
        metrics = views.self_cost_metrics(data.self_cost(r, last))
        assert [m[0] for m in metrics] == [
            "iterations/s",
            "host µs per iteration",
            "p99 µs per iteration",
            "hooks µs",
            "ledger µs",
            "checks µs",
            "exporters µs",
        ]
        sc = data.self_cost(r, last)
        assert metrics[1][1] == views.micros(sc.total) and metrics[6][1] == views.micros(sc.per_iteration["exporters"])
        assert metrics[3][1] == "0.0 µs"


def test_self_cost_reads_only_the_newest_steps(tmp_path):
    # The blocks of steps 20..99 deleted from a copy (their index kept): a read of the whole recording fails on the
    # hole, the self-cost of the newest 200 steps does not reach it and is what it was.
    import shutil
    import sqlite3

    from exporters.recorder import RecordingError

    path = tmp_path / "selfcost.sqlite"
    selfcost_recording(path, 300)
    with Recording(path) as r:
        want = data.self_cost(r, 300)
    holed = tmp_path / "holed.sqlite"
    shutil.copy(path, holed)
    with sqlite3.connect(holed) as conn:
        deleted = conn.execute("DELETE FROM blocks WHERE step >= 20 AND last_step < 100").rowcount
    assert deleted >= 5
    with Recording(holed) as r:
        with pytest.raises(RecordingError, match="not stored"):
            list(r.events(kinds=["StepBoundary"]))
        assert data.self_cost(r, 300) == want


def test_self_cost_of_a_recording_made_before_it_was_recorded_or_without_iterations(tmp_path):
    import torch

    from exporters.recorder import FlightRecorder
    from instrumented_alloc import InstrumentedAllocator
    from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator

    with Recording(PRE_SELFCOST) as r:  # its step boundaries have no overhead
        sc = data.self_cost(r, data.overview(r).last)
    assert sc == data.SelfCostWindow(recorded=False)
    assert {value for _, value, _ in views.self_cost_metrics(sc)} == {"not recorded"}
    assert views.self_cost_caption(sc, 200).startswith("Self-cost: not recorded (the recording was made before")
    # No step yet, then one step boundary: no iteration between two boundaries to divide by.
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"))
    rec = FlightRecorder(w, tmp_path / "young.sqlite")
    for steps in (0, 1):
        rec.flush()
        with Recording(tmp_path / "young.sqlite") as r:
            sc = data.self_cost(r, data.overview(r).last)
        assert sc == data.SelfCostWindow(recorded=True), steps
        assert {value for _, value, _ in views.self_cost_metrics(sc)} == {"–"}
        assert views.self_cost_caption(sc, 200).startswith("Self-cost: no iteration recorded yet")
        w.step()
    rec.close()
