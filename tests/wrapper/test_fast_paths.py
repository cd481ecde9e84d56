"""Every fast path against the general path (``verify="deferred"`` takes none of them; ``fast_paths=False`` turns
them off under immediate verification): the same faults give the same violations -- id, message, request, pool, op --
and leave the same shadow and ledger; a page handed to two requests in one call is reported at the call."""

from __future__ import annotations

import numpy as np
import pytest

from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.invariants import InvariantViolation
from instrumented_alloc.wrapper import FAST_PATHS
from tests.engine_model import Req
from tests.wrapper.scenarios import CLEAN, DUP, PS, SCENARIOS, _decode, _extend, _listed_twice, _outcome, _start, paged


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_fast_path_reports_as_the_general_path(scenario):
    fast, general = _outcome(scenario("immediate")), _outcome(scenario("deferred"))
    assert fast[0] == general[0]
    assert fast[1:] == general[1:]
    if scenario in CLEAN:
        assert fast[0] == []
    else:
        assert fast[0], "the scenario injects a fault"


def test_guard_entry_is_not_a_page():
    w, _ = _start(paged, "immediate")
    shadow = w._w_full.shadow
    assert shadow.owner.size == shadow.num_pages + 1
    assert np.shares_memory(shadow.owner, shadow._owner_ext)


@pytest.mark.parametrize("scenario", list(DUP), ids=lambda f: f.__name__)
def test_page_handed_to_two_requests_in_one_call_is_reported_at_the_call(scenario):
    message, rid = DUP[scenario]
    w = scenario("immediate")
    first = w.violations[0]  # at the call, before any step or flush
    assert (first.invariant, first.message, first.rid) == ("duplicate_allocation", message, rid)
    assert first.step == w.step_count
    assert first.op == message.split()[0]
    fast, general = _outcome(w), _outcome(scenario("deferred"))
    assert fast == general
    assert fast[0][0][:3] == ("duplicate_allocation", message, rid)


@pytest.mark.parametrize("scenario", list(DUP), ids=lambda f: f.__name__)
def test_page_handed_to_two_requests_in_one_call_fast_path_declines_unchanged(scenario):
    # The fast paths off: the same outcome.
    fast = _outcome(scenario("immediate"))
    assert _outcome(scenario("immediate", fast_paths=False)) == fast


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
def test_page_handed_to_two_requests_in_one_call_raises_after_the_call(verify):
    w = InstrumentedAllocator(paged(), mode="raise", verify=verify)
    reqs = [Req(f"r{i}") for i in range(3)]
    _extend(w, reqs, [PS] * 3)
    w.step()
    _listed_twice(w.inner)
    n_free = len(w.inner.free_pages)
    with pytest.raises(InvariantViolation) as info:
        _decode(w, reqs)
        w.step()  # deferred: the call is verified at the step
    assert info.value.violation.invariant == "duplicate_allocation"
    assert info.value.violation.rid == "r0"
    assert len(w.inner.free_pages) == n_free - 3  # the inner's call went through: raised after it


def test_fast_paths_are_named():
    with pytest.raises(ValueError, match="unknown"):
        InstrumentedAllocator(paged(), fast_paths={"decode", "nope"})
    with pytest.raises(TypeError):
        InstrumentedAllocator(paged(), fast_paths="decode")
    for fast in (True, False, (), FAST_PATHS):
        InstrumentedAllocator(paged(), fast_paths=fast)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_no_fast_path_reports_as_every_fast_path(scenario):
    assert _outcome(scenario("immediate", fast_paths=False)) == _outcome(scenario("immediate"))
