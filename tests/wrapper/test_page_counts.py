"""Page counts: each pool's free + staged pages are what its allocator's ``available_size()`` says, read at every
count check (a patched ``available_size`` included), staged pages counted."""

from __future__ import annotations

import torch

from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import (
    PagedTokenToKVPoolAllocator,
)
from tests.engine_model import Req, t
from tests.wrapper.scenarios import PS, _extend, _start, swa


def test_page_count_follows_an_available_size_set_on_the_instance():
    # A patched available_size (on the instance, after wrapping) is what the count checks read: a count that
    # disagrees with the shadow is reported at the next step.
    w, _ = _start(swa, "immediate")
    inner = w.inner.swa_attn_allocator
    size = inner.available_size()
    inner.available_size = lambda size=size: size - PS  # one page fewer than the shadow expects
    w.step()
    assert w._w_swa.count() == (size - PS) // PS
    assert [(v.invariant, v.pool, v.op) for v in w.violations] == [("pool_conservation", "swa", "step")]


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
