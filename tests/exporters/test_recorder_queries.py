"""``Recording``'s aggregate and range queries (event_count, violation_counts, step_series, event_counts,
request_span): each equals the same figure computed from the decoded events, and a hand-driven run gives the
exact numbers."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from exporters.recorder import FlightRecorder, Recording
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc import events as ev
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from tests.dashboard.scenario import record
from tests.engine_model import Req, extend_args, split_extend, t


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "run.sqlite"
    injected = record(path, 90, faults=[("swa-misaligned", 20), ("leak", 60)], seed=3)
    with Recording(path) as r:
        yield r, injected


def test_counts_equal_the_decoded_events(rec):
    r, _ = rec
    events = list(r.events())
    assert r.event_count() == len(events)
    want = Counter(v.invariant for v in r.violations())
    assert r.violation_counts() == dict(sorted(want.items(), key=lambda kv: (-kv[1], kv[0])))
    assert r.violation_counts(start=60, stop=61) == dict(Counter(v.invariant for v in r.violations(60, 61)))
    per = Counter((type(e).__name__, e.step // 10 * 10) for e in events if type(e).__name__ in ("SwaEvict", "Alloc"))
    got = r.event_counts(["SwaEvict", ev.Alloc, "AllocFailed"], bucket=10)
    assert got == {
        k: sorted((b, n) for (kind, b), n in per.items() if kind == k) for k in ("SwaEvict", "Alloc", "AllocFailed")
    }
    assert got["AllocFailed"] == []
    sub = r.event_counts(["SwaEvict"], start=30, stop=50)
    assert sub["SwaEvict"] == sorted(
        Counter(e.step for e in events if isinstance(e, ev.SwaEvict) and 30 <= e.step < 50).items()
    )


def test_step_series_strides_over_the_boundaries(rec):
    r, _ = rec
    bounds = {e.step: dict(e.available) for e in r.events(kinds=["StepBoundary"])}
    assert sorted(bounds) == list(range(1, 91))
    assert r.step_series() == sorted(bounds.items())
    # 90 boundaries into at most 10 points: stride 9 from the first step.
    assert [s for s, _ in r.step_series(max_points=10)] == [1, 10, 19, 28, 37, 46, 55, 64, 73, 82]
    # 81 boundaries (10..90) into at most 10 points: stride 9 (stride 8 would give 11 points).
    assert [s for s, _ in r.step_series(start=10, max_points=10)] == [10, 19, 28, 37, 46, 55, 64, 73, 82]
    # 11 boundaries (1..11) into at most 10 points: stride 2.
    assert r.step_series(stop=12, max_points=10) == [(s, bounds[s]) for s in (1, 3, 5, 7, 9, 11)]
    assert r.step_series(start=50, stop=53) == [(s, bounds[s]) for s in (50, 51, 52)]
    assert r.step_series(start=500) == []


def _stored_under(e, rid) -> bool:
    """Whether the recorder stores ``e`` under request id ``rid`` (its own events, calls for it alone)."""
    if isinstance(e, ev.ViolationEvent):
        return e.violation.rid == rid
    if isinstance(e, (ev.Alloc, ev.LedgerUpdate, ev.Free, ev.AllocFailed)):
        return e.rids == (rid,)
    return getattr(e, "rid", None) == rid


def test_request_span(rec):
    r, injected = rec
    (_, s1, rid1), (_, s2, rid2) = injected
    for rid, step in ((rid1, s1), (rid2, s2)):
        steps = [e.step for e in r.events() if _stored_under(e, rid)]
        assert r.request_span(rid) == (min(steps), max(steps))
        lo, hi = r.request_span(rid)
        assert lo <= step <= hi
    assert r.request_span("no-such-request") is None


def test_exact_figures_of_a_hand_driven_run(tmp_path):
    inner = PagedTokenToKVPoolAllocator(4 * 16, 4, torch.float16, "cpu", None, False)
    w = InstrumentedAllocator(inner, mode="record")
    path = tmp_path / "hand.sqlite"
    with FlightRecorder(w, path, snapshot_every=2):
        a, b = Req("a"), Req("b")
        with w.batch(["a", "b"]):
            split_extend([a, b], [5, 8], w.alloc_extend(*extend_args([a, b], [5, 8])))  # 2 + 2 pages
        w.step()  # 1
        w.ledger["a"].kv_allocated_len = 7  # not page aligned: rejected
        w.step()  # 2
        w.free(t(b.row))
        w.free(t(b.row))  # double free
        w.release_request("b")
        w.step()  # 3
    with Recording(path) as r:
        assert r.violation_counts() == {"double_free": 1, "kv_allocated_len_page_aligned": 1}
        # 16 pages; a and b hold 2 each; after b's pages are freed twice the boundary reports 16 available: the
        # second free listed b's 2 pages again (the corruption a double free causes).
        assert r.step_series() == [(1, {"full": 12}), (2, {"full": 12}), (3, {"full": 16})]
        assert r.event_counts(["Alloc", "Free", "ViolationEvent"]) == {
            "Alloc": [(0, 1)],
            "Free": [(2, 2)],  # both frees were forwarded (record mode): two Free events
            "ViolationEvent": [(1, 1), (2, 1)],
        }
        assert r.request_span("a") == (1, 1)  # the batch call of a and b is stored without a request id
        assert r.request_span("b") == (2, 2)
        assert r.event_count() == len(list(r.events()))


def test_newest_violations(rec):
    r, _ = rec
    every = r.violations()
    assert len(every) == 2 and every[0].step < every[1].step
    assert r.violations(newest=1) == every[-1:]  # the newest, not the first
    assert r.violations(newest=2) == every  # still in order
    assert r.violations(newest=len(every) + 5) == every
    assert r.violations(newest=0) == []
    assert r.violations(stop=every[-1].step, newest=1) == every[:1]  # the newest of the range
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="newest: expected an int >= 0"):
            r.violations(newest=bad)
