"""The page-run extend check (``fast_paths`` "extend_runs"): clean page-run extends are judged one slot per page;
the page deltas are the same with and without it."""

from __future__ import annotations

import pytest

from instrumented_alloc.shadow import PoolShadow
from instrumented_alloc.wrapper import FAST_PATHS
from tests.wrapper.scenarios import (
    PS,
    _extend,
    _outcome,
    _PageLog,
    _start,
    paged,
    paged_extend_runs_clean,
    paged_extend_runs_unbound_and_empty,
    swa_extend_runs_clean,
)


@pytest.mark.parametrize(
    "scenario",
    [paged_extend_runs_clean, swa_extend_runs_clean, paged_extend_runs_unbound_and_empty],
    ids=lambda f: f.__name__,
)
def test_clean_page_run_extends_take_the_fast_check(scenario, monkeypatch):
    # Their extends are judged one slot per page: the per-slot check (PoolShadow.on_alloc) never runs.
    def per_slot(*args, **kwargs):
        raise AssertionError("the per-slot extend check ran")

    monkeypatch.setattr(PoolShadow, "on_alloc", per_slot)
    assert _outcome(scenario("immediate"))[0] == []


def test_extend_page_delta_lists_each_new_page_once():
    # A chunk from inside a page: the continued page has no entry, each new page one (per-slot check).
    for general in (False, True):
        fast = set(FAST_PATHS) - {"extend_runs"} if general else True
        w, reqs = _start(paged, "immediate", lens=(PS + 1, PS), fast_paths=fast)
        log = _PageLog()
        log.start(w)
        w.subscribe(log)
        _extend(w, reqs, [2 * PS + 1, PS + 2])
        a, b = (w.ledger.slot_of(r.rid) for r in reqs)
        pages = [reqs[0].row[s] // PS for s in (2 * PS, 3 * PS)] + [reqs[1].row[s] // PS for s in (PS, 2 * PS)]
        assert log.updates == [("full", pages, [a, a, b, b])]
