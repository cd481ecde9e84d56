"""What ``PageUpdate`` lists (see its contract in events.py), on the fast paths and the general path alike:
replayed, the page deltas equal the live shadow."""

from __future__ import annotations

import pytest

from tests.wrapper.scenarios import (
    DUP,
    MIXED,
    MIXED_SCENARIOS,
    PS,
    RUN_SCENARIOS,
    SCENARIOS,
    _decode,
    _page_log,
    _PageLog,
    _start,
    big_paged,
    paged_decode_mixed_clean,
    paged_decode_run_clean,
    paged_decode_run_unbound,
    paged_extend_runs_clean,
    paged_frees_clean,
    swa_decode_clean,
    swa_extend_runs_clean,
    swa_frees_clean,
)

CLEAN_PAGE_SCENARIOS = [
    paged_decode_run_clean,
    paged_decode_run_unbound,
    paged_decode_mixed_clean,
    paged_extend_runs_clean,
    swa_extend_runs_clean,
    swa_decode_clean,
    paged_frees_clean,
    swa_frees_clean,
]


@pytest.mark.parametrize("scenario", CLEAN_PAGE_SCENARIOS, ids=lambda f: f.__name__)
def test_page_deltas_of_clean_calls_list_changes_alone_on_every_path(scenario, monkeypatch):
    # Every path publishes the same page deltas, and in calls that pass every check each entry changes its page's
    # owner (a decode that opens no page publishes none; an extend one entry per page, not per slot).
    fast = _page_log(scenario, "immediate", monkeypatch)
    assert (fast.no_ops, fast.repeats) == (0, 0)
    assert _page_log(scenario, "immediate", monkeypatch, general=True).updates == fast.updates
    assert _page_log(scenario, "deferred", monkeypatch).updates == fast.updates


@pytest.mark.parametrize(
    "scenario",
    [s for s in RUN_SCENARIOS + MIXED_SCENARIOS + SCENARIOS if s not in CLEAN_PAGE_SCENARIOS],
    ids=lambda f: f.__name__,
)
def test_page_deltas_of_faulty_calls_replay_to_the_shadow(scenario, monkeypatch):
    # Faults keep whatever entries their judged paths write (no-ops included): replay still equals the shadow.
    for verify in ("immediate", "deferred"):
        _page_log(scenario, verify, monkeypatch)
    _page_log(scenario, "immediate", monkeypatch, general=True)


def test_decode_page_delta_lists_the_opened_pages_in_batch_order():
    w, reqs = _start(big_paged, "immediate", lens=MIXED)
    log = _PageLog()
    log.start(w)
    w.subscribe(log)
    for _ in range(2 * PS):
        openers = [r for r in reqs if r.seq % PS == 0]  # the next position is a page's first
        n = len(log.updates)
        _decode(w, reqs)
        if not openers:
            assert len(log.updates) == n  # nothing changed: no PageUpdate
            continue
        (update,) = log.updates[n:]
        led = w.ledger
        assert update == ("full", [r.row[-1] // PS for r in openers], [led.slot_of(r.rid) for r in openers])


@pytest.mark.parametrize("scenario", list(DUP), ids=lambda f: f.__name__)
def test_page_handed_to_two_requests_in_one_call_publishes_what_the_general_path_publishes(scenario, monkeypatch):
    fast = _page_log(scenario, "immediate", monkeypatch)  # replay equals the live shadow (asserted inside)
    assert _page_log(scenario, "immediate", monkeypatch, general=True).updates == fast.updates
