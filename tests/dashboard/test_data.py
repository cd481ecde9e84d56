"""Data access (``dashboard.data``) against a demo recording: the end-of-step state, one request's history."""

from __future__ import annotations

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
