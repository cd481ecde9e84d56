"""Property tests: random engine-like operation sequences over every allocator, wrapped (record mode) and bare.

For every call the wrapped result is bit-identical to the bare twin's; valid sequences produce zero violations;
at the end every request is finished, ``check_consistency()`` is clean, every page is free again, and the inner
state equals the bare twin's. Run with verify="immediate" and verify="deferred" (the accelerator path on CPU).

``CONFIGS``: our reference allocators, and SGLang 0.5.23's own classes (``*-sglang``: ``TokenToKVPoolAllocator``,
``PagedTokenToKVPoolAllocator``, ``SWATokenToKVPoolAllocator`` built on CPU by ``tests/sglang_compat.py``) in the
same sizes, wrapped and bare, so that the wrapper is exercised on the classes an engine really hands it, not only
on ours. (SGLang has no CPU-buildable HiSparse allocator: that one is ours alone.) A config's name is
``kind-page_size[-sglang]``; its factory stops the test (skip, or fail under CI) when SGLang cannot be built here.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import (
    HiSparseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from instrumented_alloc.events import PageUpdate
from instrumented_alloc.prealloc import alloc_for_decode_prealloc, alloc_for_decode_prealloc_hisparse, swa_tail_len
from instrumented_alloc.stats import pages_by_state
from tests import sglang_compat
from tests.engine_model import Req, allocator_state, decode_args, extend_args, t

F16 = torch.float16


def _sglang(make, require_swa: bool):
    """A factory of SGLang's own class: ``make(need_sort)`` once SGLang is known to build here."""

    def factory(ns):
        sglang_compat.require_sglang(require_swa=require_swa)
        return make(ns)

    return factory


CONFIGS = {
    "token-1": lambda ns: TokenToKVPoolAllocator(96, F16, "cpu", None, ns),
    "paged-4": lambda ns: PagedTokenToKVPoolAllocator(4 * 24, 4, F16, "cpu", None, ns),
    "paged-16": lambda ns: PagedTokenToKVPoolAllocator(16 * 16, 16, F16, "cpu", None, ns),
    "swa-1": lambda ns: SWATokenToKVPoolAllocator(96, 96, 1, F16, "cpu", None, ns),
    "swa-4": lambda ns: SWATokenToKVPoolAllocator(4 * 24, 4 * 24, 4, F16, "cpu", None, ns),
    "swa-16": lambda ns: SWATokenToKVPoolAllocator(16 * 16, 16 * 20, 16, F16, "cpu", None, ns),
    "hisparse-4": lambda ns: HiSparseTokenToKVPoolAllocator(4 * 16, 4, F16, "cpu", None, ns, 2),
    "token-1-sglang": _sglang(lambda ns: sglang_compat.make_sglang_token(96, ns, dtype=F16), False),
    "paged-4-sglang": _sglang(lambda ns: sglang_compat.make_sglang_paged(4 * 24, 4, ns, dtype=F16), False),
    "paged-16-sglang": _sglang(lambda ns: sglang_compat.make_sglang_paged(16 * 16, 16, ns, dtype=F16), False),
    "swa-1-sglang": _sglang(lambda ns: sglang_compat.make_sglang_swa(96, 96, 1, ns, dtype=F16), True),
    "swa-4-sglang": _sglang(lambda ns: sglang_compat.make_sglang_swa(4 * 24, 4 * 24, 4, ns, dtype=F16), True),
    "swa-16-sglang": _sglang(lambda ns: sglang_compat.make_sglang_swa(16 * 16, 16 * 20, 16, ns, dtype=F16), True),
}


class Engine:
    """Drives the wrapped allocator and a bare twin; keeps the model of the requests' KV rows."""

    def __init__(self, name: str, need_sort: bool, verify: str, mode: str = "record"):
        make = CONFIGS[name]
        self.kind = name.split("-")[0]
        self.bare = make(need_sort)
        self.inner = make(need_sort)
        self.ps = self.inner.page_size
        self.window = 3 * self.ps + 1 if self.kind == "swa" else None
        self.w = InstrumentedAllocator(self.inner, mode=mode, verify=verify, sliding_window=self.window)
        # A sink that rebuilds every pool's page owners from PageUpdate events alone (what a recording replays).
        self.replayed = {n: s.owner.copy() for n, s in self.w.snapshot().items()}
        self.w.subscribe(self.apply_events)
        self.reqs: dict[str, Req] = {}
        self.n = 0
        self.calls = 0

    def apply_events(self, batch) -> None:
        for e in batch:
            if isinstance(e, PageUpdate):
                self.replayed[e.pool][e.pages] = e.owners

    def check_replay(self) -> None:
        for name, snap in self.w.snapshot().items():
            assert (self.replayed[name] == snap.owner).all(), name

    def both(self, name, *args, **kwargs):
        rw = getattr(self.w, name)(*args, **kwargs)
        rb = getattr(self.bare, name)(*args, **kwargs)
        assert (rw is None) == (rb is None), name
        if rw is not None:
            assert rw.dtype == rb.dtype and torch.equal(rw, rb), name
        self.calls += 1
        return rw

    def new_rid(self) -> str:
        self.n += 1
        return f"r{self.n}"

    # -- operations ------------------------------------------------------------------------------------------
    def extend(self, reqs: list[Req], lens: list[int]) -> None:
        rids = [r.rid for r in reqs]
        if self.ps == 1:
            with self.w.batch(rids, lens=lens):
                out = self.both("alloc", sum(lens))
        else:
            with self.w.batch(rids):
                out = self.both("alloc_extend", *extend_args(reqs, lens))
        if out is None:
            for r in reqs:
                if r.rid not in self.reqs:
                    self.w.release_request(r.rid)  # the engine drops a new request it cannot admit
            return
        slots, i = out.tolist(), 0
        for r, n in zip(reqs, lens):
            r.row.extend(slots[i : i + n])
            i += n
            self.reqs[r.rid] = r

    def decode(self, reqs: list[Req]) -> None:
        if self.kind == "swa" and self.ps > 1:
            # SGLang's SWA alloc_decode allocates in both pools without checking capacity first and loses the
            # pages of the side that succeeded when the other is short: its scheduler checks decode capacity
            # (and retracts) before decoding. So does this engine (test_swa_decode_leak_is_reported covers it).
            need = sum(1 for r in reqs if (r.seq + 1) % self.ps == 1)
            if need > min(self.inner.full_available_size(), self.inner.swa_available_size()) // self.ps:
                return
        rids = [r.rid for r in reqs]
        with self.w.batch(rids):
            out = self.both("alloc", len(reqs)) if self.ps == 1 else self.both("alloc_decode", *decode_args(reqs))
        if out is None:
            return
        for r, s in zip(reqs, out.tolist()):
            r.row.append(s)

    def evict(self, r: Req) -> None:
        new = max(0, r.seq - self.window) // self.ps * self.ps
        if new <= r.evicted:
            return
        self.both("free_swa_segment", t(r.row[r.evicted : new]), start_pos=r.evicted)
        self.w.ledger[r.rid].swa_evicted_seqlen = new
        r.evicted = new

    def rollback(self, r: Req, pages_back: int) -> None:
        lo = r.evicted
        start = max(lo, (r.seq - 1) // self.ps * self.ps - (pages_back - 1) * self.ps)
        start = start // self.ps * self.ps
        if start < lo or start >= r.seq:
            return
        self.both("free_segment", t(r.row[start:]), start_pos=start)
        del r.row[start:]
        if not r.row:
            r.evicted = 0

    def finish(self, r: Req, plain: bool) -> None:
        if r.row:
            if self.kind == "swa" and not (plain and (self.ps > 1 or r.evicted == 0)):
                if r.evicted < r.seq:
                    self.both("free_swa_segment", t(r.row[r.evicted :]), start_pos=r.evicted)
                self.both("free_full", t(r.row))
            else:
                self.both("free", t(r.row))
        del self.reqs[r.rid]

    def prealloc(self, fill: int) -> None:
        rid = self.new_rid()
        if self.kind == "swa" and self.ps > 1:
            tail = swa_tail_len(fill, self.window, self.ps)
            out = alloc_for_decode_prealloc(self.w, rid=rid, fill_len=fill, swa_tail_len=tail)
            ev = fill - tail
            bare = self.bare.alloc_extend_swa_tail(*extend_args([Req("x")], [fill]), tail)
        elif self.kind == "hisparse":
            out = alloc_for_decode_prealloc_hisparse(self.w, rid=rid, fill_len=fill, uses_swa_tail=False)
            ev = 0
            bare = self.bare.alloc_logical_only(*extend_args([Req("x")], [fill]))
        else:
            out = alloc_for_decode_prealloc(self.w, rid=rid, fill_len=fill)
            ev = 0
            bare = self.bare.alloc_extend(*extend_args([Req("x")], [fill]))
        assert (out is None) == (bare is None)
        if out is None:
            self.w.release_request(rid)
        else:
            assert torch.equal(out, bare)
            self.reqs[rid] = Req(rid, out.tolist(), ev)


def run(data, name: str, need_sort: bool, verify: str) -> Engine:
    e = Engine(name, need_sort, verify)
    ps = e.ps
    for _ in range(data.draw(st.integers(5, 30), label="ops")):
        live = list(e.reqs.values())
        ops = ["extend_new", "step"]
        if live:
            ops += ["extend_more", "decode", "decode", "finish", "rollback"]
        if e.kind == "swa" and live:
            ops += ["evict"]
        if ps > 1 and e.kind in ("swa", "paged", "hisparse"):
            ops += ["prealloc"]
        if need_sort and e.kind in ("token", "paged"):
            ops += ["merge"]  # SGLang's SWA and HiSparse classes have no working merge of their own
        if len(live) >= 2:
            ops += ["group"]
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "extend_new":
            k = data.draw(st.integers(1, 3))
            lens = data.draw(st.lists(st.integers(1, 3 * ps + 3), min_size=k, max_size=k))
            e.extend([Req(e.new_rid()) for _ in range(k)], lens)
        elif op == "extend_more":
            reqs = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique_by=lambda r: r.rid))
            lens = data.draw(st.lists(st.integers(1, 2 * ps + 1), min_size=len(reqs), max_size=len(reqs)))
            e.extend(reqs, lens)
        elif op == "decode":
            reqs = [r for r in live if r.row]
            if reqs:
                e.decode(data.draw(st.lists(st.sampled_from(reqs), min_size=1, unique_by=lambda r: r.rid)))
        elif op == "finish":
            r = data.draw(st.sampled_from(live))
            e.finish(r, data.draw(st.booleans()))
            e.w.release_request(r.rid)
        elif op == "group":
            rs = data.draw(st.lists(st.sampled_from(live), min_size=2, max_size=3, unique_by=lambda r: r.rid))
            e.both("free_group_begin")
            for r in rs:
                e.finish(r, data.draw(st.booleans()))
            e.both("free_group_end")
            for r in rs:
                e.w.release_request(r.rid)
        elif op == "rollback":
            r = data.draw(st.sampled_from(live))
            if r.row:
                e.rollback(r, data.draw(st.integers(1, 2)))
        elif op == "evict":
            e.evict(data.draw(st.sampled_from(live)))
        elif op == "prealloc":
            e.prealloc(data.draw(st.integers(1, 4 * ps + 3)))
        elif op == "merge":
            e.both("merge_and_sort_free")
        else:
            e.w.step()
            e.check_replay()
        assert list(e.w.violations) == [], [str(v) for v in e.w.violations]
    for r in list(e.reqs.values()):
        e.finish(r, plain=True)
        e.w.release_request(r.rid)
    e.w.step()
    assert e.w.check_consistency() == []
    assert list(e.w.violations) == [], [str(v) for v in e.w.violations]
    e.check_replay()
    assert allocator_state(e.inner) == allocator_state(e.bare)
    for name, snap in e.w.snapshot().items():
        counts = pages_by_state(snap)
        assert counts["used"] == 0, (name, counts)
        assert counts["free"] + counts["staged"] == snap.num_pages
    assert len(e.w.ledger) == 0
    return e


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=25)
@given(data=st.data())
def test_random_sequences_identical_and_clean(name, need_sort, verify, data):
    run(data, name, need_sort, verify)


def test_swa_decode_leak_is_reported():
    """SGLang 0.5.23's SWA alloc_decode returns None when one pool is short, keeping the other pool's new page."""
    inner = SWATokenToKVPoolAllocator(4 * 4, 4 * 8, 4, F16, "cpu", None, False)
    w = InstrumentedAllocator(inner, mode="record")
    a, b = Req("a"), Req("b")
    with w.batch(["a", "b"]):
        out = w.alloc_extend(*extend_args([a, b], [8, 8]))
    a.row, b.row = out[:8].tolist(), out[8:].tolist()
    assert inner.full_available_size() == 0 and inner.swa_available_size() == 16
    with w.batch(["a", "b"]):
        assert w.alloc_decode(*decode_args([a, b])) is None
    assert [v.invariant for v in w.violations] == ["pool_conservation"]
    assert w.violations[0].pool == "swa" and "2 pages left the free list" in w.violations[0].message
    assert inner.swa_available_size() == 8  # the SWA pool lost two pages to nobody
    w.step()
    assert w.check_consistency() == []  # the loss was reported once, at the call
    assert len(w.violations) == 1


@pytest.mark.parametrize("need_sort", [False, True])
def test_hisparse_free_groups_are_no_ops_for_the_wrapper_too(need_sort):
    """Found by the HiSparse state machines (tests/test_state_machines.py): HiSparse's free_group_begin/end are
    no-ops (frees happen at once, the mapping must be cleared at once), so the wrapper must not hold the group's
    frees in its shadow either."""
    e = Engine("hisparse-4", need_sort, "immediate", mode="raise")
    r = Req(e.new_rid())
    e.extend([r], [9])
    e.both("free_group_begin")
    e.rollback(r, 1)  # frees the last page, at once
    e.w.step()  # the count check: the inner's free list already has that page
    e.both("free_group_end")
    e.finish(r, plain=True)
    e.w.release_request(r.rid)
    e.w.step()
    assert e.w.check_consistency() == []
    assert list(e.w.violations) == []
    assert allocator_state(e.inner) == allocator_state(e.bare)
