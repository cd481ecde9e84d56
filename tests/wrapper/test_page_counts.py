"""Page counts (``fast_paths`` "page_counts": our paged allocator's free + staged pages read directly) read what
the allocator's ``available_size()`` reads, and report alike on faulted engines."""

from __future__ import annotations

import contextlib

import pytest
import torch

from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import (
    PagedTokenToKVPoolAllocator,
)
from instrumented_alloc.wrapper import FAST_PATHS
from tests.engine_model import Req, t
from tests.wrapper.scenarios import PS, _extend, _outcome, _random_engine, _start, swa

# Page counts (fast path "page_counts"): our paged allocator's free + staged pages read directly (free_pages.shape[0]),
# what every count check of the wrapper compares, against the allocator's own available_size() // page_size.
NO_DIRECT = set(FAST_PATHS) - {"page_counts"}  # every count through available_size()


@contextlib.contextmanager
def _constructed_with(monkeypatch, **kwargs):
    """Every wrapper built inside (the demo engine's included) gets these constructor keywords."""
    real = InstrumentedAllocator.__init__

    def init(self, inner, **kw):
        real(self, inner, **{**kw, **kwargs})

    with monkeypatch.context() as m:
        m.setattr(InstrumentedAllocator, "__init__", init)
        yield


def _checked_counts(monkeypatch):
    """Every step() first asserts that each pool's count reads what its allocator's available_size() says."""
    real = InstrumentedAllocator.step
    seen = []

    def step(self):
        for p in self._w_pools.values():
            assert p.count() == p.allocator.available_size() // p.page_size
            assert p.probe() * p.page_size == p.allocator.available_size()  # probe: the same count, in pages
            seen.append(p.count is p.probe)  # the direct read (the generic counter's are two functions)
        return real(self)

    monkeypatch.setattr(InstrumentedAllocator, "step", step)
    return seen


@pytest.mark.parametrize("seed", range(4))
def test_page_counts_read_what_available_size_reads(seed, monkeypatch):
    seen = _checked_counts(monkeypatch)
    _random_engine(seed)
    assert len(seen) > 50 and all(seen)


def _sim_outcome(preset, seed, inject):
    from instrumented_alloc.sim import build_engine

    e = build_engine(preset, seed=seed, inject=inject, steps=300, verify="immediate")
    e.run(300)
    e.shutdown()
    direct = [p.count is p.probe for p in e.alloc._w_pools.values()]
    return _outcome(e.alloc), direct


SIM_CASES = [
    ("swa-128", ("duplicate-alloc@40", "double-free@60", "leak@80")),
    ("swa-128", ("swa-misaligned@50", "segment-unaligned@90")),
    ("dense", ("duplicate-alloc@40", "double-free@60", "leak@80")),
]


@pytest.mark.parametrize("case", range(len(SIM_CASES)))
@pytest.mark.parametrize("seed", range(2))
def test_page_counts_report_as_available_size_on_faulted_engines(case, seed, monkeypatch):
    # The demo engine with faults that corrupt the free lists (a page listed while in use, freed twice, leaked):
    # every count check reports and resyncs as with the allocator's available_size() read each time.
    preset, inject = SIM_CASES[case]
    fast, direct = _sim_outcome(preset, seed, inject)
    assert fast[0] and all(direct)  # faults reported, counts read directly (the comparison is not vacuous)
    with _constructed_with(monkeypatch, fast_paths=NO_DIRECT):
        general, direct = _sim_outcome(preset, seed, inject)
    assert not any(direct)
    assert general == fast


def test_page_counts_on_an_swa_engine_read_available_size(monkeypatch):
    seen = _checked_counts(monkeypatch)
    from instrumented_alloc.sim import build_engine

    e = build_engine("swa-128", seed=3, inject=("duplicate-alloc@40", "double-free@60"), steps=200, verify="immediate")
    e.run(200)
    assert len(seen) >= 400 and all(seen)  # two pools, every step


def test_page_count_follows_an_available_size_set_on_the_instance():
    # A patched available_size (on the instance, after wrapping) is what the count checks read: a count that
    # disagrees with the shadow is reported at the next step, as without the direct read.
    found = []
    for fast in (True, NO_DIRECT):
        w, _ = _start(swa, "immediate", fast_paths=fast)
        inner = w.inner.swa_attn_allocator
        size = inner.available_size()
        inner.available_size = lambda size=size: size - PS  # one page fewer than the shadow expects
        w.step()
        found.append([(v.invariant, v.pool, v.op) for v in w.violations])
        assert w._w_swa.count() == (size - PS) // PS
    assert found[0] == found[1] != []


def test_page_count_reads_staged_pages_with_need_sort():
    inner = PagedTokenToKVPoolAllocator(128, PS, torch.float16, "cpu", None, True)
    w = InstrumentedAllocator(inner, mode="record", verify="immediate")
    reqs = [Req("a"), Req("b")]
    _extend(w, reqs, [2 * PS, PS])
    w.free(t(reqs[0].row))
    assert inner.num_staged_pages == 2
    assert w._w_full.count() == inner.available_size() // PS == len(inner.free_pages) + 2
    w.step()
    assert list(w.violations) == []
