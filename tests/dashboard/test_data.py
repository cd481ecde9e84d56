"""Data access (``dashboard.data``) against a real recording: the end-of-step state, one request's history."""

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
    assert (first, last) == (0, 80)
    for step in range(first, last):
        end, nxt = data.state_end_of(rec, step), rec.state_at(step + 1)
        for pool in nxt.owners:
            assert (end.owners[pool] == nxt.owners[pool]).all(), (step, pool)
        assert end.ledger == nxt.ledger, step
    with pytest.raises(data.DashboardInputError, match="step 81 is not in the recording"):
        data.state_end_of(rec, 81)


def test_request_history_narrows_the_scan_without_losing_anything(rec, recordings):
    every = list(rec.events(kinds=data.LIFELINE_KINDS))
    for _, _, rid in recordings.faults:
        events, start, lo, hi = data.request_history(rec, rid, 0)
        assert lo > 0 and hi < 80  # a bounded range of the recording, not all of it
        assert views.lifeline(rid, events, start_ledger=start) == views.lifeline(rid, every)
    assert data.request_history(rec, "no-such-request", 0) is None


def test_overview(rec):
    ov = data.overview(rec)
    assert (ov.first, ov.last, ov.finished) == (0, 80, True)
    assert ov.events == rec.event_count() and ov.violations == len(rec.violations())
    assert [p["name"] for p in ov.pools] == ["full", "swa"]
