"""The free fast path (``fast_paths`` "free"): clean frees take it; a fault it leaves to the general path is still
refused before the call in raise mode; its distinct-page helper agrees with ``np.unique``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instrumented_alloc import InstrumentedAllocator, shadow
from instrumented_alloc.invariants import InvariantViolation
from instrumented_alloc.wrapper.frees import _distinct_pages
from tests.engine_model import Req, t
from tests.wrapper.scenarios import PS, _extend, _outcome, paged, paged_frees_clean, swa_frees_clean


@pytest.mark.parametrize("scenario", [paged_frees_clean, swa_frees_clean], ids=lambda f: f.__name__)
def test_clean_frees_take_the_fast_path(scenario, monkeypatch):
    # Every free of a clean run is judged by the fast path: the general immediate path is never reached.
    def general(*args, **kwargs):
        raise AssertionError("the general free path ran")

    monkeypatch.setattr(InstrumentedAllocator, "_free_now", general)  # a spy: which path judged the frees
    assert _outcome(scenario("immediate"))[0] == []


def test_fast_free_refused_in_raise_mode_before_the_inner_sees_it():
    # A fault the fast path leaves to the general path is still refused before the call in raise mode.
    w = InstrumentedAllocator(paged(), mode="raise", verify="immediate")
    reqs = [Req("a")]
    _extend(w, reqs, [2 * PS])
    w.free_segment(t(reqs[0].row[PS:]), start_pos=PS)
    free_before = w.inner.free_pages.clone()
    with pytest.raises(InvariantViolation) as info:
        w.free_segment(t(reqs[0].row), start_pos=0)
    assert info.value.violation.invariant == "double_free"
    assert torch.equal(w.inner.free_pages, free_before)


def _slot_arrays(rng):
    """Slot arrays a free may pass: page-run rows (whole, a partial last page, from mid-page), rows with a page
    twice, shuffled slots, negative and huge values, runs of one value, and short ones."""
    for n_pages in (1, 2, 5, 17, 70):
        pages = rng.choice(4096, size=n_pages, replace=False)
        row = (pages[:, None] * PS + np.arange(PS)).reshape(-1)
        yield row
        yield row[: -(PS - 1)]  # the last page partial
        yield row[1:]  # from mid-page
        yield np.concatenate([row, row[:PS]])  # a page twice
        yield rng.permutation(row)
        yield row[::-1].copy()
    for n in (1, 2, 3, 63, 64, 65, 200):
        yield rng.integers(-3 * PS, 50 * PS, size=n)
        yield np.full(n, 7 * PS + 1)
    yield np.array([-PS, -PS + 1, -PS + 2, -1])  # a run in the negative page -1
    yield np.array([2**40 * PS + i for i in range(PS)])


def test_distinct_pages_and_sorted_unique_are_np_unique():
    rng = np.random.default_rng(0)
    offsets = np.arange(PS, dtype=np.int64)
    shift = PS.bit_length() - 1
    for slots in _slot_arrays(rng):
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        want = np.unique(slots >> shift)
        for got in (_distinct_pages(slots, PS, shift, offsets), shadow.sorted_unique(slots >> shift)):
            assert got.dtype == np.int64
            assert got.tolist() == want.tolist()
            assert not np.shares_memory(got, slots)
