"""The step boundary compares the ledger of the requests that changed with their pages: pool by pool, once per
fact, a tainted request left out."""

from __future__ import annotations

from tests.wrapper.scenarios import PS, _start, swa


def _ledger_mismatches():
    # Requests whose pages disagree with their ledger in either pool (and one tainted), compared at a step.
    w, reqs = _start(swa, "immediate", lens=(2 * PS, 2 * PS, PS + 1, 3 * PS, PS))
    led = w.ledger
    slots = [led.slot_of(r.rid) for r in reqs]
    led.owned["full"][slots[0]] += 1
    led.owned["swa"][slots[1]] -= 1
    led.owned["full"][slots[3]] -= 2
    led.owned["swa"][slots[3]] += 1
    led.owned["full"][slots[4]] += 1
    led.tainted.add(slots[4])
    led.dirty.update(slots)
    w.step()
    led.dirty.update(slots)
    w.step()  # the same facts: reported once
    led.owned["swa"][slots[1]] -= 1
    led.dirty.update(slots[:2])
    w.step()  # a new fact for the same request: reported again
    return [(v.invariant, v.message, v.rid, v.pool, v.op) for v in w.violations]


def test_changed_requests_are_compared_pool_by_pool_once_per_fact():
    found = [(v[2], v[3]) for v in _ledger_mismatches()]
    assert found == [("r0", "full"), ("r3", "full"), ("r1", "swa"), ("r3", "swa"), ("r1", "swa")]
