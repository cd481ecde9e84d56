"""Page ownership that follows a prefix cache, and SGLang 0.5.23's token-counted ``kv_allocated_len``.

- ``allocated_len``: "pages" (kv_allocated_len promised page-aligned, shrunk by the wrapper with the request's
  frees) or "tokens" (any value >= 0, the request's pages are the ceiling, frees leave the lengths to the engine).
- ``cache_protected_len``: the request's first tokens whose KV the prefix cache owns; its own pages are those of
  ``[cache_protected_len, kv_allocated_len)`` (on the SWA pool from ``max(cache_protected_len,
  swa_evicted_seqlen)``). A checked write.
- The prefix cache is an owner (the ledger's ``cache_slot()``, named ``CACHE_RID``), never a request.
- ``cache_insert``: the offered pages must be the request's own; what the cache holds afterwards passes to it (in
  the SWA pool through the mapping); the engine frees the duplicates inside the insert; the cache's later frees
  are any owner's.
- ``check_consistency(cached=..., idle=...)``: the cache's pages against what the engine's cache holds, and the
  requests never released once the engine is idle.
- ``request_leak`` at release names the pages; an SWA tail's implied evicted length is checked at the allocation.

Driven as an engine with a prefix cache drives it (a chunked prefill handing its first chunk over, a second
request reusing the prefix, evictions, duplicates), at page size 1 and 16, on our reference allocators and on
SGLang's own, with immediate and deferred verification (deferred on the CPU queues the checks to the next
``step()``), in record and raise modes. Every allocator call also runs on a bare twin: the results must agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instrumented_alloc import InstrumentedAllocator, InvariantViolation
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from instrumented_alloc.events import Free, LedgerUpdate, RequestReleased
from instrumented_alloc.ledger import CACHE_RID
from instrumented_alloc.shadow import FREE, PRISTINE, RESERVED
from tests import sglang_compat
from tests.engine_model import Req, decode_args, extend_args, t

F16 = torch.float16
PAGES = 64  # pages per pool


def _sg(require_swa: bool, make):
    def factory():
        sglang_compat.require_sglang(require_swa)
        return make()

    return factory


# One pool: SGLang's token allocator at page size 1, its paged allocator at 16 (and ours of the same classes).
ONE_POOL = {
    "ours-ps1": lambda: TokenToKVPoolAllocator(PAGES, F16, "cpu", None, False),
    "ours-ps16": lambda: PagedTokenToKVPoolAllocator(PAGES * 16, 16, F16, "cpu", None, False),
    "sglang-ps1": _sg(False, lambda: sglang_compat.make_sglang_token(PAGES)),
    "sglang-ps16": _sg(False, lambda: sglang_compat.make_sglang_paged(PAGES * 16, 16)),
}
SWA = {
    "ours-swa-ps1": lambda: SWATokenToKVPoolAllocator(PAGES, PAGES, 1, F16, "cpu", None, False),
    "ours-swa-ps16": lambda: SWATokenToKVPoolAllocator(PAGES * 16, PAGES * 16, 16, F16, "cpu", None, False),
    "sglang-swa-ps1": _sg(True, lambda: sglang_compat.make_sglang_swa(PAGES, PAGES, 1)),
    "sglang-swa-ps16": _sg(True, lambda: sglang_compat.make_sglang_swa(PAGES * 16, PAGES * 16, 16)),
}
VERIFY = ("immediate", "deferred")


class Engine:
    """An engine with a prefix cache over a wrapped allocator; every allocator call also runs on a bare twin."""

    def __init__(self, make, *, mode="record", verify="immediate", allocated_len="pages", window=None):
        self.inner, self.bare = make(), make()
        self.events: list = []
        self.w = InstrumentedAllocator(
            self.inner,
            mode=mode,
            verify=verify,
            allocated_len=allocated_len,
            sliding_window=window,
            sinks=[self.events.extend],
        )
        self.ps = self.inner.page_size
        self.tokens = allocated_len == "tokens"
        self.deferred = verify == "deferred"

    def call(self, name, *args, **kwargs):
        rw = getattr(self.w, name)(*args, **kwargs)
        rb = getattr(self.bare, name)(*args, **kwargs)
        assert (rw is None and rb is None) or torch.equal(rw, rb)
        return rw

    def both(self, name, *args, **kwargs) -> None:
        """A call the wrapper does not instrument (the mapping's setters): on both twins."""
        getattr(self.w, name)(*args, **kwargs)
        getattr(self.bare, name)(*args, **kwargs)

    def grow(self, req: Req, n: int, *, protected: int | None = None) -> list:
        """``req`` grows by ``n`` tokens: ``alloc`` at page size 1 (as SGLang's scheduler does), ``alloc_extend``
        above. ``protected``: a new request whose row starts with a prefix the cache holds (``req.row`` already
        points at the cache's slots there); the engine writes its ``cache_protected_len`` (and at page size 1,
        where ``alloc`` adds to the lengths, the prefix's lengths) before the allocation."""
        with self.w.batch([req.rid]):
            if protected is not None:
                kv = self.w.ledger[req.rid]
                kv.cache_protected_len = protected
                if self.ps == 1:
                    kv.kv_allocated_len = kv.kv_committed_len = protected
            out = self.call("alloc", n) if self.ps == 1 else self.call("alloc_extend", *extend_args([req], [n]))
        req.row.extend(out.tolist())
        self.engine_lengths(req)
        return out.tolist()

    def decode(self, req: Req) -> None:
        with self.w.batch([req.rid]):
            out = self.call("alloc", 1) if self.ps == 1 else self.call("alloc_decode", *decode_args([req]))
        req.row.extend(out.tolist())
        self.engine_lengths(req)

    def engine_lengths(self, req: Req) -> None:
        """SGLang 0.5.23 writes the request's allocated length in tokens after each allocation."""
        if self.tokens:
            self.w.ledger[req.rid].kv_allocated_len = req.seq

    def insert(self, req: Req, up_to: int, *, inside=None) -> None:
        """The engine inserts ``req``'s KV up to ``up_to`` into its cache (SGLang's checkpoint): offered is the row
        from the protected length, ``inside`` runs during the insert (frees of duplicates, row rewrites), held is
        the row over the same positions afterwards; then the protected length is written."""
        kv = self.w.ledger[req.rid]
        p0 = kv.cache_protected_len
        with self.w.cache_insert(req.rid, t(req.row[p0:up_to])) as ins:
            if inside is not None:
                inside()
            ins.held = t(req.row[p0:up_to])
        kv.cache_protected_len = up_to

    def pages(self, slots) -> list[int]:
        return sorted({s // self.ps for s in slots})

    def owner(self, pages, pool: str = "full") -> list[int]:
        return self.w.snapshot()[pool].owner[list(pages)].tolist()

    def owned(self, *rids, pool: str = "full") -> list[int]:
        led = self.w.ledger
        return [int(led.owned[pool][led.cache if r == CACHE_RID else led.slot_of(r, create=False)]) for r in rids]

    def slot(self, rid) -> int:
        return self.w.ledger.cache if rid == CACHE_RID else self.w.ledger.slot_of(rid, create=False)

    def lengths(self, rid) -> tuple[int, int, int]:
        kv = self.w.ledger[rid]
        return kv.kv_allocated_len, kv.kv_committed_len, kv.cache_protected_len


def seen(w) -> list:
    return [(v.invariant, v.rid, v.pool, v.op, v.message) for v in w.violations]


def _cached_slots(e: Engine, pages) -> torch.Tensor:
    """Every slot of ``pages``: what an engine's cache lists for them (SGLang's ``all_values_flatten()``)."""
    return t(p * e.ps + i for p in pages for i in range(e.ps))


# -- allocated_len -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["bytes", "Pages", None, 16])
def test_allocated_len_is_pages_or_tokens(value):
    with pytest.raises(ValueError) as info:
        InstrumentedAllocator(ONE_POOL["ours-ps16"](), allocated_len=value)
    assert str(info.value) == f"allocated_len: expected one of ('pages', 'tokens'), got {value!r}"


@pytest.mark.parametrize("kind", ["ours-ps16", "sglang-ps16"])
@pytest.mark.parametrize("mode", ["record", "raise"])
def test_tokens_accepts_any_non_negative_allocated_len(kind, mode):
    e = Engine(ONE_POOL[kind], mode=mode, allocated_len="tokens")
    a = Req("a")
    e.grow(a, 18)
    kv = e.w.ledger["a"]
    assert (kv.kv_allocated_len, kv.kv_committed_len) == (18, 18)
    for value in (19, 31, 32, 18):  # token counts, any remainder
        kv.kv_allocated_len = value
        assert kv.kv_allocated_len == value
    e.w.step()
    assert list(e.w.violations) == []
    if mode == "raise":
        with pytest.raises(InvariantViolation) as info:
            kv.kv_allocated_len = -1
        assert info.value.violation is e.w.violations[0]
    else:
        kv.kv_allocated_len = -1
    assert kv.kv_allocated_len == 18  # never stored
    assert seen(e.w) == [
        ("kv_allocated_len_page_aligned", "a", None, "ledger", "kv_allocated_len=-1 is negative; kept 18"),
        ("kv_committed_le_allocated", "a", None, "ledger", "kv_allocated_len=-1 < kv_committed_len=18; kept 18"),
        ("swa_evicted_le_allocated", "a", None, "ledger", "kv_allocated_len=-1 < swa_evicted_seqlen=0; kept 18"),
    ]


@pytest.mark.parametrize("kind", ["ours-ps16", "sglang-ps16"])
@pytest.mark.parametrize("mode", ["record", "raise"])
def test_pages_refuses_an_allocated_len_off_the_page(kind, mode):
    e = Engine(ONE_POOL[kind], mode=mode)
    a = Req("a")
    e.grow(a, 18)
    kv = e.w.ledger["a"]
    assert (kv.kv_allocated_len, kv.kv_committed_len) == (32, 18)  # whole pages
    if mode == "raise":
        with pytest.raises(InvariantViolation):
            kv.kv_allocated_len = 18
    else:
        kv.kv_allocated_len = 18
    assert kv.kv_allocated_len == 32
    assert seen(e.w) == [
        (
            "kv_allocated_len_page_aligned",
            "a",
            None,
            "ledger",
            "kv_allocated_len=18 is not a non-negative multiple of page_size=16 (remainder 2); kept 32",
        )
    ]


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_tokens_pages_are_the_ceiling_and_frees_leave_the_lengths(kind, verify):
    e = Engine(ONE_POOL[kind], verify=verify, allocated_len="tokens")
    ps = e.ps
    a = Req("a")
    e.grow(a, 2 * ps + 2)  # 2 pages and 2 tokens: 3 pages at page size 16, 4 at page size 1
    n = 3 if ps == 16 else 4
    e.w.step()
    assert e.lengths("a") == (2 * ps + 2, 2 * ps + 2, 0)
    assert e.owned("a") == [n]
    # The request's last page goes back: the lengths are the engine's, the wrapper leaves them.
    e.call("free", t(a.row[(n - 1) * ps :]))
    assert e.lengths("a") == (2 * ps + 2, 2 * ps + 2, 0)
    e.w.step()
    assert e.owned("a") == [n - 1]
    assert seen(e.w) == [
        (
            "ledger_matches_pages",
            "a",
            "full",
            "step",
            f"request 'a': kv_allocated_len={2 * ps + 2} means {n} full pages, it owns {n - 1}",
        )
    ]
    # The engine writes the lengths it kept: the next boundary is clean.
    kv = e.w.ledger["a"]
    kept = (n - 1) * ps if ps == 16 else 2 * ps + 1
    kv.kv_committed_len = kv.kv_allocated_len = kept
    e.w.step()
    assert len(e.w.violations) == 1
    # Every page freed: the lengths stay (no reset) until the engine writes them or releases the request.
    e.call("free", t(a.row[: (n - 1) * ps]))
    assert e.lengths("a") == (kept, kept, 0)
    e.w.release_request("a")
    e.w.step()
    assert len(e.w.violations) == 1
    assert e.w.check_consistency(idle=True) == []


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_pages_frees_shrink_the_lengths(kind, verify):
    e = Engine(ONE_POOL[kind], verify=verify)
    ps = e.ps
    a = Req("a")
    e.grow(a, 2 * ps + 2)
    n = 3 if ps == 16 else 4
    assert e.lengths("a") == (n * ps, 2 * ps + 2, 0)
    e.call("free", t(a.row[(n - 1) * ps :]))
    e.w.step()
    assert e.lengths("a") == ((n - 1) * ps, (n - 1) * ps, 0)
    e.call("free", t(a.row[: (n - 1) * ps]))
    e.w.step()
    assert e.lengths("a") == (0, 0, 0)  # no page left: zeroed
    e.w.release_request("a")
    assert list(e.w.violations) == []


# -- cache_protected_len -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ours-ps16", "sglang-ps16"])
@pytest.mark.parametrize("mode", ["record", "raise"])
def test_protected_len_is_a_checked_write(kind, mode):
    e = Engine(ONE_POOL[kind], mode=mode)
    a = Req("a")
    e.grow(a, 48)
    kv = e.w.ledger["a"]
    kv.cache_protected_len = 32
    assert kv.cache_protected_len == 32
    for value in (-16, 40, 8):
        if mode == "raise":
            with pytest.raises(InvariantViolation) as info:
                kv.cache_protected_len = value
            assert info.value.invariant == "ledger_matches_pages"
        else:
            kv.cache_protected_len = value
        assert kv.cache_protected_len == 32  # never stored
    assert seen(e.w) == [
        (
            "ledger_matches_pages",
            "a",
            None,
            "ledger",
            f"cache_protected_len={value} is not a non-negative multiple of page_size=16: the prefix cache holds "
            "whole pages; kept 32",
        )
        for value in (-16, 40, 8)
    ]


def test_protected_len_at_page_size_1_is_any_non_negative_int():
    e = Engine(ONE_POOL["ours-ps1"])
    a = Req("a")
    e.grow(a, 5)
    kv = e.w.ledger["a"]
    kv.cache_protected_len = np.int64(3)  # numbers.Integral: accepted
    assert kv.cache_protected_len == 3 and type(kv.cache_protected_len) is int
    kv.cache_protected_len = -1
    assert kv.cache_protected_len == 3
    assert [v.message for v in e.w.violations] == [
        "cache_protected_len=-1 is not a non-negative multiple of page_size=1: the prefix cache holds whole pages; "
        "kept 3"
    ]


@pytest.mark.parametrize("verify", VERIFY)
def test_protected_pages_are_not_the_requests_own(verify):
    # The request's own pages are those of [cache_protected_len, kv_allocated_len): a protected length the pages do
    # not bear out is a mismatch at the next boundary, naming the protected length.
    e = Engine(ONE_POOL["ours-ps16"], verify=verify)
    a = Req("a")
    e.grow(a, 48)
    e.w.step()
    e.w.ledger["a"].cache_protected_len = 32  # the engine says the cache owns 2 pages; it was never handed them
    e.w.step()
    assert seen(e.w) == [
        (
            "ledger_matches_pages",
            "a",
            "full",
            "step",
            "request 'a': kv_allocated_len=48, cache_protected_len=32 means 1 full pages, it owns 3",
        )
    ]
    assert e.w.violations[0].step == 2


# -- the prefix cache's owner slot ---------------------------------------------------------------------------------
def test_the_cache_slot_is_an_owner_and_no_request():
    e = Engine(ONE_POOL["ours-ps16"])
    led = e.w.ledger
    a = Req("a")
    e.grow(a, 32)
    assert led.cache == -1  # reserved lazily: an engine without a prefix cache keeps its slot numbers
    e.insert(a, 32)
    cache = led.cache
    assert (led.slot_of("a", create=False), cache) == (0, 1)
    assert led.cache_slot() == cache  # once
    assert led.rid_of(cache) == CACHE_RID == "<prefix cache>"
    assert bool(led.live[cache])
    assert (len(led), list(led), led.live_slots().tolist()) == (1, ["a"], [0])
    assert CACHE_RID not in led
    with pytest.raises(KeyError):
        led[CACHE_RID]
    b = Req("b")
    e.grow(b, 16)
    assert led.slot_of("b", create=False) == 2  # a request never gets the cache's slot
    snap = e.w.snapshot()["full"]
    assert snap.owner[:5].tolist() == [RESERVED, cache, cache, 2, PRISTINE]
    assert snap.slot_rids == {cache: CACHE_RID, 2: "b"}
    assert snap.ledger.rids == ("a", "b")  # no ledger row for the cache
    e.w.step()
    assert list(e.w.violations) == []


# -- cache_insert: an engine's prefix cache ------------------------------------------------------------------------
def _no_ledger_row_for_the_cache(e: Engine) -> None:
    cache = e.w.ledger.cache
    for ev in e.events:
        if isinstance(ev, LedgerUpdate):
            assert CACHE_RID not in ev.rids and cache not in np.asarray(ev.slots).tolist(), ev


def _cached_prefix(e: Engine) -> Req:
    """Request 'a' computes 2 pages, hands them to the cache and finishes: the cache holds pages 1 and 2."""
    a = Req("a")
    e.grow(a, 2 * e.ps)
    e.insert(a, 2 * e.ps)
    e.w.release_request("a")
    e.w.step()
    assert e.pages(a.row) == [1, 2]
    return a


@pytest.mark.parametrize("allocated_len", ["pages", "tokens"])
@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_a_chunked_request_hands_its_first_chunk_to_the_cache_and_goes_on(kind, verify, allocated_len):
    e = Engine(ONE_POOL[kind], verify=verify, allocated_len=allocated_len)
    ps = e.ps
    a = Req("a")
    e.grow(a, 2 * ps)  # the first chunk: pages 1 and 2
    e.w.step()
    e.insert(a, 2 * ps)
    cache = e.w.ledger.cache
    assert cache == 1  # a is slot 0
    e.w.step()
    assert e.owner([1, 2]) == [cache, cache]
    assert e.owned("a", CACHE_RID) == [0, 2]
    assert e.lengths("a") == (2 * ps, 2 * ps, 2 * ps)
    # The next chunk extends from the protected length: its pages are the request's own.
    e.grow(a, ps + 1)
    e.w.step()
    assert e.pages(a.row[2 * ps :]) == [3, 4]
    assert e.owner([1, 2, 3, 4]) == [cache, cache, 0, 0]
    assert e.owned("a", CACHE_RID) == [2, 2]
    assert e.lengths("a") == (3 * ps + 1 if e.tokens else 4 * ps, 3 * ps + 1, 2 * ps)
    e.decode(a)  # page size 16: in page 4; page size 1: page 5
    e.w.step()
    assert e.owned("a") == [2 if ps == 16 else 3]
    assert list(e.w.violations) == []
    # It finishes: the cache takes its whole pages, the engine frees the partial last one, then releases it.
    whole = a.seq // ps * ps
    e.insert(a, whole)
    if whole < a.seq:
        e.call("free", t(a.row[whole:]))
    e.w.release_request("a")
    e.w.step()
    cached = [1, 2, 3] if ps == 16 else [1, 2, 3, 4, 5]
    assert e.pages(a.row[:whole]) == cached
    assert e.owner(cached) == [cache] * len(cached)
    if ps == 16:
        assert e.owner([4]) == [FREE]  # the partial last page
    assert e.owned(CACHE_RID) == [len(cached)]
    # Its peak: the most pages it owned at once (the cache's are not its own once handed over).
    released = [(ev.rid, ev.pages_held, ev.pages_peak) for ev in e.events if isinstance(ev, RequestReleased)]
    assert released == [("a", 0, 2 if ps == 16 else 3)]
    assert e.w.check_consistency(cached=t(a.row[:whole]), idle=True) == []
    assert list(e.w.violations) == []
    _no_ledger_row_for_the_cache(e)


@pytest.mark.parametrize("allocated_len", ["pages", "tokens"])
@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_a_second_request_reuses_the_cached_prefix(kind, verify, allocated_len):
    e = Engine(ONE_POOL[kind], verify=verify, allocated_len=allocated_len)
    ps = e.ps
    a = _cached_prefix(e)
    cache = e.w.ledger.cache
    b = Req("b", row=a.row[: 2 * ps])  # the prefix matched: b's row points at the cache's slots
    e.grow(b, ps + 1, protected=2 * ps)
    e.w.step()
    b_slot = e.slot("b")
    assert b_slot == 0  # a's slot, released clean, is reused
    assert e.pages(b.row[2 * ps :]) == [3, 4]
    assert e.owner([1, 2, 3, 4]) == [cache, cache, b_slot, b_slot]
    assert e.owned("b", CACHE_RID) == [2, 2]  # b owns its own pages only
    assert e.lengths("b") == (3 * ps + 1 if e.tokens else 4 * ps, 3 * ps + 1, 2 * ps)
    e.decode(b)
    e.w.step()
    # b finishes without inserting: it frees its own pages; the cache's are untouched.
    e.call("free", t(b.row[2 * ps :]))
    e.w.release_request("b")
    e.w.step()
    assert e.owner([1, 2]) == [cache, cache]
    assert e.owner([3, 4]) == [FREE, FREE]
    assert e.owned(CACHE_RID) == [2]
    # a handed both its pages to the cache (its peak is 2 all the same); b owned 2, or 3 with its decode at page
    # size 1.
    released = [(ev.rid, ev.pages_held, ev.pages_peak) for ev in e.events if isinstance(ev, RequestReleased)]
    assert released == [("a", 0, 2), ("b", 0, 2 if ps == 16 else 3)]
    assert e.w.check_consistency(cached=t(a.row), idle=True) == []
    assert list(e.w.violations) == []
    _no_ledger_row_for_the_cache(e)


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_the_cache_evicts_its_pages(kind, verify):
    e = Engine(ONE_POOL[kind], verify=verify)
    ps = e.ps
    a = _cached_prefix(e)
    cache = e.w.ledger.cache
    before = len(e.events)
    e.call("free", t(a.row[ps:]))  # the cache evicts its last page: no request is touched
    e.w.step()
    assert e.owner([1, 2]) == [cache, FREE]
    assert e.owned(CACHE_RID) == [1]
    frees = [ev for ev in e.events[before:] if isinstance(ev, Free)]
    assert [(ev.op, ev.pool, ev.n_pages, ev.rids) for ev in frees] == [("free", "full", 1, (CACHE_RID,))]
    assert [ev for ev in e.events[before:] if isinstance(ev, LedgerUpdate)] == []
    assert e.w.check_consistency(cached=t(a.row[:ps]), idle=True) == []
    e.call("free", t(a.row[:ps]))
    e.w.step()
    assert e.owner([1, 2]) == [FREE, FREE]
    assert e.owned(CACHE_RID) == [0]
    assert e.inner.available_size() == e.bare.available_size() == PAGES * ps
    assert e.w.check_consistency(cached=t([]), idle=True) == []
    # The freed pages are allocatable again, to anyone.
    c = Req("c")
    e.grow(c, 2 * ps)
    e.w.step()
    assert list(e.w.violations) == []
    assert len(e.w.ledger) == 1


@pytest.mark.parametrize("verify", VERIFY)
def test_a_boundary_with_many_changed_requests_compares_no_row_of_the_cache(verify):
    # More than a handful of changed requests are compared as arrays: the cache's slot, changed by its eviction,
    # has no ledger row among them.
    e = Engine(ONE_POOL["ours-ps16"], verify=verify)
    a = _cached_prefix(e)
    reqs = [Req(f"r{i}") for i in range(10)]
    for r in reqs:
        e.grow(r, 32)
    e.w.step()
    for r in reqs:
        e.call("free", t(r.row[16:]))  # each gives its last page back: its lengths follow
    e.call("free", t(a.row[16:]))  # the cache evicts a page
    e.w.step()
    assert list(e.w.violations) == []
    assert [e.lengths(r.rid) for r in reqs] == [(16, 16, 0)] * 10
    assert e.owned(CACHE_RID) == [1]
    _no_ledger_row_for_the_cache(e)


@pytest.mark.parametrize("allocated_len", ["pages", "tokens"])
@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_duplicates_freed_inside_the_insert(kind, verify, allocated_len):
    # b computed the cached prefix itself (it arrived before a's insert): inserting, the engine frees b's copies of
    # the 2 cached pages and points b's row at the cache's; b's third page is new to the cache and passes to it.
    e = Engine(ONE_POOL[kind], verify=verify, allocated_len=allocated_len)
    ps = e.ps
    a = _cached_prefix(e)
    cache = e.w.ledger.cache
    b = Req("b")
    e.grow(b, 3 * ps)
    e.w.step()
    assert e.pages(b.row) == [3, 4, 5]

    def dedup():
        e.call("free", t(b.row[: 2 * ps]))
        b.row[: 2 * ps] = a.row

    e.insert(b, 3 * ps, inside=dedup)
    e.w.step()
    assert e.owner([1, 2, 3, 4, 5]) == [cache, cache, FREE, FREE, cache]
    assert e.owned("b", CACHE_RID) == [0, 3]
    assert e.lengths("b") == (3 * ps, 3 * ps, 3 * ps)
    assert list(e.w.violations) == []
    e.w.release_request("b")
    e.w.step()
    assert e.w.check_consistency(cached=_cached_slots(e, [1, 2, 5]), idle=True) == []
    assert list(e.w.violations) == []
    _no_ledger_row_for_the_cache(e)


# -- the SWA pool --------------------------------------------------------------------------------------------------
def _swa_cached_prefix(e: Engine) -> Req:
    """Request 'a' computes 2 pages and hands them to the cache (full and SWA), then finishes."""
    a = Req("a")
    e.grow(a, 2 * e.ps)
    e.insert(a, 2 * e.ps)
    e.w.release_request("a")
    e.w.step()
    assert e.pages(a.row) == [1, 2]
    cache = e.w.ledger.cache
    assert e.owner([1, 2]) == e.owner([1, 2], "swa") == [cache, cache]
    assert e.owned(CACHE_RID) == e.owned(CACHE_RID, pool="swa") == [2]
    return a


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(SWA))
def test_swa_the_cache_adopts_the_requests_swa_page_for_its_own_full_slots(kind, verify):
    # The cache's node lost its SWA KV (tombstoned: the SWA side evicted, the full side kept and locked by a
    # reader); b computed the same tokens and inserts them. The cache keeps its full slots, points their mapping at
    # b's SWA slots and frees b's full slots (SGLang's RecoverSWAWithLockedFull): b's SWA pages pass to the cache
    # through the mapping of the slots the cache's row holds.
    e = Engine(SWA[kind], verify=verify, allocated_len="tokens")
    ps = e.ps
    a = _swa_cached_prefix(e)
    cache = e.w.ledger.cache
    e.call("free_swa_segment", t(a.row), start_pos=0)  # the cache's SWA side is evicted
    e.w.step()
    assert e.owner([1, 2], "swa") == [FREE, FREE]
    assert e.owned(CACHE_RID) + e.owned(CACHE_RID, pool="swa") == [2, 0]
    b = Req("b")
    e.grow(b, 2 * ps)
    e.w.step()
    b_slot = e.slot("b")
    assert e.pages(b.row) == [3, 4]
    swa_slots = e.inner.full_to_swa_index_mapping[t(b.row)]
    swa_pages = e.pages(swa_slots.tolist())
    # The SWA pages 1 and 2 the cache freed: the paged allocator reuses them first, the token allocator last.
    assert swa_pages == ([1, 2] if ps == 16 else [3, 4])
    assert e.owner(swa_pages, "swa") == [b_slot, b_slot]

    def adopt():
        incoming = t(b.row)
        e.both("clear_full_to_swa_mapping", incoming)
        e.both("set_full_to_swa_mapping", t(a.row), swa_slots)
        e.call("free_full_segment", incoming, start_pos=0)
        b.row[:] = a.row

    e.insert(b, 2 * ps, inside=adopt)
    e.w.step()
    assert e.owner([1, 2, 3, 4]) == [cache, cache, FREE, FREE]
    assert e.owner(swa_pages, "swa") == [cache, cache]
    assert e.owned("b", CACHE_RID) + e.owned("b", CACHE_RID, pool="swa") == [0, 2, 0, 2]
    assert b_slot == 0 and list(e.w.violations) == []
    e.w.release_request("b")
    e.w.step()
    assert e.w.check_consistency(cached=t(a.row), idle=True) == []
    # The cache evicts the whole node: both sides go back.
    e.call("free_segment", t(a.row), start_pos=0)
    e.w.step()
    assert e.owner([1, 2]) == [FREE, FREE] and e.owner(swa_pages, "swa") == [FREE, FREE]
    assert e.owned(CACHE_RID) + e.owned(CACHE_RID, pool="swa") == [0, 0]
    assert e.w.check_consistency(cached=t([]), idle=True) == []
    assert list(e.w.violations) == []


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(SWA))
def test_swa_the_cache_replaces_its_full_slots_with_the_requests(kind, verify):
    # The same tombstoned node, not locked: the cache frees its own full slots (SGLang's FreeDeviceKVFullOnly) and
    # takes b's slots whole, full and SWA.
    e = Engine(SWA[kind], verify=verify, allocated_len="tokens")
    ps = e.ps
    a = _swa_cached_prefix(e)
    cache = e.w.ledger.cache
    e.call("free_swa_segment", t(a.row), start_pos=0)
    b = Req("b")
    e.grow(b, 2 * ps)
    e.w.step()
    swa_pages = e.pages(e.inner.full_to_swa_index_mapping[t(b.row)].tolist())
    assert swa_pages == ([1, 2] if ps == 16 else [3, 4])
    e.insert(b, 2 * ps, inside=lambda: e.call("free_full_segment", t(a.row), start_pos=0))
    e.w.step()
    assert e.owner([1, 2, 3, 4]) == [FREE, FREE, cache, cache]
    assert e.owner(swa_pages, "swa") == [cache, cache]
    assert e.owned("b", CACHE_RID) + e.owned("b", CACHE_RID, pool="swa") == [0, 2, 0, 2]
    e.w.release_request("b")
    e.w.step()
    assert e.w.check_consistency(cached=t(b.row), idle=True) == []
    assert list(e.w.violations) == []


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", ["ours-swa-ps16", "sglang-swa-ps16"])
def test_swa_own_pages_start_after_the_protected_prefix_or_the_evicted_length(kind, verify):
    # On the SWA pool a request's own pages are those of [max(cache_protected_len, swa_evicted_seqlen),
    # kv_allocated_len). Window 32: a's first 2 pages are the cache's, then it grows to 6 pages.
    e = Engine(SWA[kind], verify=verify, window=32)
    a = Req("a")
    e.grow(a, 32)
    e.insert(a, 32)
    e.grow(a, 64)
    e.w.step()
    assert e.owned("a") + e.owned("a", pool="swa") == [4, 4]
    # The window evicts page 2 (positions 32..47); the engine has not written the evicted length yet.
    e.call("free_swa_segment", t(a.row[32:48]), start_pos=32)
    e.w.step()
    assert seen(e.w) == [
        (
            "ledger_matches_pages",
            "a",
            "swa",
            "step",
            "request 'a': kv_allocated_len=96, cache_protected_len=32, swa_evicted_seqlen=0 means 4 swa pages, it "
            "owns 3",
        )
    ]
    kv = e.w.ledger["a"]
    kv.swa_evicted_seqlen = 48  # past the protected prefix: the evicted length counts from here
    e.w.step()
    e.call("free_swa_segment", t(a.row[48:64]), start_pos=48)
    kv.swa_evicted_seqlen = 64  # seq_len 96, window 32: at most 64
    e.w.step()
    assert e.owned("a") + e.owned("a", pool="swa") == [4, 2]
    assert len(e.w.violations) == 1
    kv.swa_evicted_seqlen = 80  # inside the window
    assert seen(e.w)[1] == (
        "swa_evicted_within_window",
        "a",
        None,
        "ledger",
        "swa_evicted_seqlen=80 reaches into the window: seq_len=96, window=32, at most 64 may be evicted",
    )


def test_swa_the_cached_prefix_may_count_as_evicted_inside_the_window():
    # The prefix's SWA KV is the cache's: the request may count it as evicted before its own window moves (SGLang
    # moves the evicted length past the prefix before its first eviction).
    e = Engine(SWA["ours-swa-ps16"], window=32)
    a = Req("a")
    e.grow(a, 64)
    e.insert(a, 64)
    e.grow(a, 16)  # seq_len 80: the window alone allows 48
    kv = e.w.ledger["a"]
    kv.swa_evicted_seqlen = 64
    e.w.step()
    assert kv.swa_evicted_seqlen == 64 and list(e.w.violations) == []
    kv.swa_evicted_seqlen = 80
    assert [v.message for v in e.w.violations] == [
        "swa_evicted_seqlen=80 reaches into the window: seq_len=80, window=32, at most 64 may be evicted"
    ]


# -- faults at the insert ------------------------------------------------------------------------------------------
def _boundary_raises(e: Engine, action) -> InvariantViolation | None:
    """``action`` in record mode; in raise mode it raises (immediate), or the next ``step()`` does (deferred)."""
    if e.w.mode != "raise":
        action()
        e.w.step()
        return None
    if e.deferred:
        action()
        with pytest.raises(InvariantViolation) as info:
            e.w.step()
    else:
        with pytest.raises(InvariantViolation) as info:
            action()
    return info.value


@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_pages_handed_to_the_cache_twice_are_a_double_free(kind, verify, mode):
    # The engine inserts a's first chunk, forgets that it did (its protected length stays 0) and inserts it again.
    e = Engine(ONE_POOL[kind], verify=verify, mode=mode, allocated_len="tokens")
    ps = e.ps
    a = Req("a")
    e.grow(a, 2 * ps)
    e.insert(a, 2 * ps)
    e.w.ledger["a"].cache_protected_len = 0
    cache = e.w.ledger.cache
    raised = _boundary_raises(e, lambda: e.insert(a, 2 * ps))
    want = (
        "double_free",
        "a",
        "full",
        "cache_insert",
        "request 'a' offers the prefix cache [1, 2] (2 pages) which the prefix cache owns already: handed to it twice",
    )
    assert seen(e.w) == [want]
    assert e.w.violations[0].step == (1 if e.deferred else 0)
    if raised is not None:
        assert raised.violation is e.w.violations[0]
    assert e.owner([1, 2]) == [cache, cache]
    assert e.owned("a", CACHE_RID) == [0, 2]
    e.w.step()  # a's ledger (protected 0) disagrees with its pages for the reason reported: not again
    assert seen(e.w) == [want]


@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_offering_pages_not_its_own_is_a_double_free(kind, verify, mode):
    e = Engine(ONE_POOL[kind], verify=verify, mode=mode, allocated_len="tokens")
    ps = e.ps
    a, b = Req("a"), Req("b")
    e.grow(a, 2 * ps)
    e.grow(b, 2 * ps)
    e.w.step()
    assert e.pages(a.row + b.row) == [1, 2, 3, 4]
    # a offers one page of b's and one of its own, and says the cache holds both after.
    offered = b.row[:ps] + a.row[ps:]

    def insert():
        with e.w.cache_insert("a", t(offered)) as ins:
            ins.held = t(offered)

    raised = _boundary_raises(e, insert)
    assert seen(e.w) == [
        (
            "double_free",
            "a",
            "full",
            "cache_insert",
            "request 'a' offers the prefix cache [3] (1 pages) which are not its own (page 3 is owned by request 'b')",
        )
    ]
    cache = e.w.ledger.cache
    assert cache == 2  # reserved at the call
    if raised is not None and not e.deferred:
        assert raised.violation is e.w.violations[0]
        assert e.owner([1, 2, 3, 4]) == [0, 0, 1, 1]  # refused at the offer: the block never ran
    else:
        # Record mode goes on (and deferred raise mode raised at the boundary, after the insert's effect): what the
        # cache holds that was a's passed (page 2); b's page stayed b's.
        assert e.owner([1, 2, 3, 4]) == [0, cache, 1, 1]
    e.w.step()
    assert len(e.w.violations) == 1


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_offering_a_free_page_is_a_double_free(kind, verify):
    e = Engine(ONE_POOL[kind], verify=verify, allocated_len="tokens")
    ps = e.ps
    a = Req("a")
    e.grow(a, 2 * ps)
    e.call("free", t(a.row[ps:]))  # a's last page went back, but its row still names it
    kv = e.w.ledger["a"]
    kv.kv_committed_len = kv.kv_allocated_len = ps
    e.w.step()
    e.insert(a, 2 * ps)
    e.w.step()
    assert seen(e.w) == [
        (
            "double_free",
            "a",
            "full",
            "cache_insert",
            "request 'a' offers the prefix cache [2] (1 pages) which are not its own (page 2 is free)",
        )
    ]
    cache = e.w.ledger.cache
    assert e.owner([1, 2]) == [cache, FREE]  # a free page never passes to the cache


# -- check_consistency(cached=..., idle=...) -----------------------------------------------------------------------
@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_the_sweep_compares_the_cache_with_what_it_was_handed(kind, verify):
    e = Engine(ONE_POOL[kind], verify=verify, allocated_len="tokens")
    ps = e.ps
    a = _cached_prefix(e)
    b = Req("b")
    e.grow(b, 2 * ps)
    e.w.step()
    assert e.pages(b.row) == [3, 4]
    assert e.w.check_consistency(cached=t(a.row)) == []
    # The engine's cache lost page 2 (it neither freed it nor holds it) and lists b's page 3 as its own.
    found = e.w.check_consistency(cached=t(a.row[:ps] + b.row[:ps]))
    want = [
        (
            "pool_conservation",
            None,
            "full",
            "sweep",
            "sweep: full pages [2] (1 pages) were handed to the prefix cache, which holds them no more and never "
            "freed them: neither free nor owned",
        ),
        (
            "pool_conservation",
            "b",
            "full",
            "sweep",
            "sweep: the prefix cache holds full pages [3] (1 pages) that were never handed to it (page 3 is owned "
            "by request 'b')",
        ),
    ]
    assert seen(e.w) == want and found == list(e.w.violations)
    assert e.w.check_consistency(cached=t(a.row[:ps] + b.row[:ps])) == []  # once per page set
    # A free page the cache lists (b's page 4, freed).
    e.call("free", t(b.row[ps:]))
    e.w.ledger["b"].kv_allocated_len = ps
    e.w.step()
    assert [v.message for v in e.w.check_consistency(cached=t(a.row + b.row[ps:]))] == [
        "sweep: the prefix cache holds full pages [4] (1 pages) that were never handed to it (page 4 is free)"
    ]
    assert e.w.violations[-1].rid is None


def test_the_cache_sweep_raises_in_raise_mode():
    e = Engine(ONE_POOL["ours-ps16"], mode="raise")
    a = _cached_prefix(e)
    with pytest.raises(InvariantViolation) as info:
        e.w.check_consistency(cached=t(a.row[:16]))
    assert (info.value.invariant, info.value.violation.op) == ("pool_conservation", "sweep")
    assert "full pages [2] (1 pages) were handed to the prefix cache" in str(info.value)


@pytest.mark.parametrize("value", [[1, 2], torch.zeros((2, 2), dtype=torch.int64), None])
def test_the_cache_sweep_takes_a_1d_tensor(value):
    e = Engine(ONE_POOL["ours-ps16"])
    _cached_prefix(e)
    if value is None:
        assert e.w.check_consistency(cached=None) == []  # no cache to compare: the cache's pages are not judged
        return
    with pytest.raises(TypeError) as info:
        e.w.check_consistency(cached=value)
    assert str(info.value).startswith("cached: expected a 1-D index tensor, got ")


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", ["ours-ps1", "ours-ps16", "sglang-ps16"])
def test_an_idle_engine_names_the_requests_never_released(kind, verify):
    e = Engine(ONE_POOL[kind], verify=verify, allocated_len="tokens")
    ps = e.ps
    a, b, c = Req("a"), Req("b"), Req("c")
    e.grow(a, 2 * ps)
    e.grow(b, ps)
    e.grow(c, ps)
    e.insert(c, ps)  # c owns nothing: all its KV is the cache's
    e.w.step()
    assert e.w.check_consistency() == []  # not idle: live requests own pages
    found = e.w.check_consistency(cached=t(c.row), idle=True)
    assert [(v.invariant, v.rid, v.pool, v.op, v.message) for v in found] == [
        (
            "request_leak",
            "a",
            "full",
            "sweep",
            "the engine is idle, yet request 'a' still owns 2 pages (full: [1, 2] (2 pages)): it was never released",
        ),
        (
            "request_leak",
            "b",
            "full",
            "sweep",
            "the engine is idle, yet request 'b' still owns 1 pages (full: [3] (1 pages)): it was never released",
        ),
    ]
    assert e.w.check_consistency(cached=t(c.row), idle=True) == []  # once per request
    assert len(e.w.violations) == 2


@pytest.mark.parametrize("kind", ["ours-swa-ps16", "sglang-swa-ps16"])
def test_an_idle_engine_names_every_pool_of_a_request_never_released(kind):
    e = Engine(SWA[kind], allocated_len="tokens")
    a = Req("a")
    e.grow(a, 32)
    e.w.step()
    assert [v.message for v in e.w.check_consistency(idle=True)] == [
        "the engine is idle, yet request 'a' still owns 4 pages (full: [1, 2] (2 pages); swa: [1, 2] (2 pages)): it "
        "was never released"
    ]


# -- request_leak names the pages ----------------------------------------------------------------------------------
@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_a_release_while_owning_pages_names_them(kind, verify):
    e = Engine(ONE_POOL[kind], verify=verify, allocated_len="tokens")
    ps = e.ps
    a = Req("a")
    e.grow(a, 3 * ps)
    e.insert(a, ps)  # the first page is the cache's: not a leak
    e.w.step()
    e.w.release_request("a")
    e.w.step()
    assert seen(e.w) == [
        (
            "request_leak",
            "a",
            "full",
            "release",
            "request 'a' released while still owning 2 pages, neither freed nor handed to the prefix cache "
            "(full: [2, 3] (2 pages))",
        )
    ]
    assert e.w.violations[0].step == (1 if verify == "immediate" else 2)
    released = [ev for ev in e.events if isinstance(ev, RequestReleased)]
    assert [(ev.rid, ev.pages_held) for ev in released] == [("a", 2)]
    # Reported once: the sweep knows the slot leaked.
    assert e.w.check_consistency(idle=True) == []
    assert len(e.w.violations) == 1


def test_the_sweep_names_pages_a_released_slot_still_owns():
    # The pages of a slot released as clean (its count said 0: the bookkeeping of pages and counts disagreed) are
    # found by the sweep, with the step of the release.
    e = Engine(ONE_POOL["ours-ps16"])
    a = Req("a")
    e.grow(a, 32)
    e.w.step()
    e.w.step()
    e.w.ledger.owned["full"][e.slot("a")] = 0  # the drift
    e.w.release_request("a")
    assert list(e.w.violations) == []
    found = e.w.check_consistency()
    assert [(v.invariant, v.rid, v.pool, v.op, v.message) for v in found] == [
        (
            "request_leak",
            None,
            "full",
            "sweep",
            "full pages [1, 2] (2 pages) are owned by request None (slot 0), released at step 2 without freeing them",
        )
    ]


# -- the SWA tail's implied evicted length -------------------------------------------------------------------------
def _tail_args(seq: int):
    return (t([0]), t([0]), t([seq]), t([seq]), t([-1]), seq)


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", ["ours-swa-ps16", "sglang-swa-ps16"])
def test_a_misaligned_swa_tail_is_reported_at_the_allocation_once(kind, verify):
    # PD decode prealloc of 100 tokens with a 32-token SWA tail: the first 68 positions have no SWA KV, an evicted
    # length that is not a whole number of pages. Reported from host values at the call (deferred too), naming the
    # request; the engine's later write of that same length is refused without a second report.
    e = Engine(SWA[kind], verify=verify, window=32)
    with e.w.batch(["d"]):
        out = e.call("alloc_extend_swa_tail", *_tail_args(100), 32)
    assert out.shape == (100,)
    want = (
        "swa_evicted_seqlen_page_aligned",
        "d",
        "swa",
        "alloc_extend_swa_tail",
        "request 'd': alloc_extend_swa_tail with seq_len=100, swa_tail_len=32 implies swa_evicted_seqlen=68, not a "
        "non-negative multiple of page_size=16 (remainder 4)",
    )
    assert seen(e.w) == [want] and e.w.violations[0].step == 0
    kv = e.w.ledger["d"]
    assert e.w.ledger.reported_evicted == {e.slot("d"): 68}
    kv.swa_evicted_seqlen = 68
    assert kv.swa_evicted_seqlen == 0  # refused, not reported again
    assert e.w.ledger.reported_evicted == {}
    e.w.step()
    assert seen(e.w) == [want]  # the ledger against the pages: the root cause was reported
    kv.swa_evicted_seqlen = 68  # a second write of it is a fault of its own
    assert seen(e.w)[1] == (
        "swa_evicted_seqlen_page_aligned",
        "d",
        None,
        "ledger",
        "swa_evicted_seqlen=68 is not a non-negative multiple of page_size=16 (remainder 4); kept 0",
    )


@pytest.mark.parametrize("kind", ["ours-swa-ps16", "sglang-swa-ps16"])
def test_a_misaligned_swa_tail_is_refused_before_the_allocation_in_raise_mode(kind):
    e = Engine(SWA[kind], mode="raise", window=32)
    before = (e.inner.full_available_size(), e.inner.swa_available_size())
    with pytest.raises(InvariantViolation) as info, e.w.batch(["d"]):
        e.w.alloc_extend_swa_tail(*_tail_args(100), 40)
    assert info.value.invariant == "swa_evicted_seqlen_page_aligned"
    assert (info.value.violation.rid, info.value.violation.op) == ("d", "alloc_extend_swa_tail")
    assert "seq_len=100, swa_tail_len=40 implies swa_evicted_seqlen=60" in info.value.violation.message
    assert (e.inner.full_available_size(), e.inner.swa_available_size()) == before  # nothing handed out
    assert e.w.ledger["d"].kv_allocated_len == 0
    # The aligned tail (36: evicted 64) goes through.
    with e.w.batch(["d"]):
        out = e.w.alloc_extend_swa_tail(*_tail_args(100), 36)
    assert out.shape == (100,) and len(e.w.violations) == 1


def test_a_misaligned_swa_tail_of_no_bound_request_names_none():
    e = Engine(SWA["ours-swa-ps16"])
    e.call("alloc_extend_swa_tail", *_tail_args(100), 32)
    assert seen(e.w) == [
        (
            "swa_evicted_seqlen_page_aligned",
            None,
            "swa",
            "alloc_extend_swa_tail",
            "alloc_extend_swa_tail with seq_len=100, swa_tail_len=32 implies swa_evicted_seqlen=68, not a "
            "non-negative multiple of page_size=16 (remainder 4)",
        )
    ]
    assert e.w.ledger.reported_evicted == {}


# -- pages mode: the lengths a free leaves a request with a protected prefix ---------------------------------------
@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", list(ONE_POOL))
def test_pages_a_free_shrinks_the_lengths_to_the_protected_prefix_and_the_pages_left(kind, verify):
    # allocated_len="pages": the wrapper follows a request's frees with its lengths. A request whose first 2 pages
    # are the cache's (protected) and which owns 2 more gives its last page back (a retracted tail): it keeps its
    # protected prefix and its one page left, 3 pages' worth, not 1.
    e = Engine(ONE_POOL[kind], verify=verify)
    ps = e.ps
    a = Req("a")
    e.grow(a, 2 * ps)
    e.insert(a, 2 * ps)
    e.grow(a, 2 * ps)
    e.w.step()
    assert e.lengths("a") == (4 * ps, 4 * ps, 2 * ps)
    e.call("free", t(a.row[3 * ps :]))
    e.w.step()
    assert e.lengths("a") == (3 * ps, 3 * ps, 2 * ps)
    assert e.owned("a", CACHE_RID) == [1, 2]
    assert list(e.w.violations) == []
    e.call("free", t(a.row[2 * ps : 3 * ps]))  # its own pages all gone: zeroed
    e.w.step()
    assert e.lengths("a") == (0, 0, 0)
    e.w.release_request("a")
    assert e.w.check_consistency(cached=t(a.row[: 2 * ps]), idle=True) == []
    assert list(e.w.violations) == []


def test_pages_a_free_on_the_all_swa_allocator_keeps_the_protected_prefix():
    # SGLang's all-SWA allocator (one pool, page size 1): a free other than the window's shrinks the lengths to
    # what the pages cover, the protected prefix included.
    e = Engine(_sg(True, lambda: sglang_compat.make_sglang_pure_swa(PAGES)))
    a = Req("a")
    e.grow(a, 2)
    e.insert(a, 2)
    e.grow(a, 2)
    e.w.step()
    e.call("free", t(a.row[3:]))
    e.w.step()
    assert e.lengths("a") == (3, 3, 2)
    assert list(e.w.violations) == []


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", [*ONE_POOL, "ours-swa-ps1", "ours-swa-ps16", "sglang-swa-ps16"])
def test_pages_duplicates_freed_inside_the_insert_leave_the_lengths(kind, verify):
    # allocated_len="pages": the pages a request frees inside its insert are copies the cache holds, positions that
    # become protected: its lengths stay (they were cut to its pages left, or zeroed when none was left, and the
    # protected length written after the insert then stood past them). b computed exactly the cached prefix, gives
    # all of it back inside the insert (on the SWA allocator with free(), both pools), and goes on decoding.
    e = Engine({**ONE_POOL, **SWA}[kind], verify=verify)
    ps = e.ps
    a = _cached_prefix(e)
    b = Req("b")
    e.grow(b, 2 * ps)
    e.w.step()

    def dedup():
        e.call("free", t(b.row))
        b.row[:] = a.row

    e.insert(b, 2 * ps, inside=dedup)
    e.w.step()
    assert e.w.ledger.inserting == set()
    assert e.lengths("b") == (2 * ps, 2 * ps, 2 * ps)
    assert e.owned("b", CACHE_RID) == [0, 2]
    e.decode(b)
    e.w.step()
    assert e.lengths("b") == (3 * ps, 2 * ps + 1, 2 * ps)
    assert e.owned("b") == [1]
    assert list(e.w.violations) == []
    # Outside an insert, a free shrinks the lengths again: b's one page back, none left, its lengths zeroed.
    e.call("free", t(b.row[2 * ps :]))
    e.w.step()
    assert e.lengths("b") == (0, 0, 0)
    e.w.release_request("b")
    assert e.w.check_consistency(cached=t(a.row), idle=True) == []
    assert list(e.w.violations) == []


@pytest.mark.parametrize("verify", VERIFY)
def test_an_insert_ends_whatever_it_holds(verify):
    # The insert ends at the take, in call order: with nothing held, an empty hold, a hold of the wrong type, or
    # refused at the offer (raise mode).
    e = Engine(ONE_POOL["ours-ps16"], verify=verify)
    a = Req("a")
    e.grow(a, 32)
    for held in (None, t([])):
        with e.w.cache_insert("a", t(a.row)) as ins:
            ins.held = held
        e.w.step()
        assert e.w.ledger.inserting == set()
    with pytest.raises(TypeError) as info, e.w.cache_insert("a", t(a.row)) as ins:
        ins.held = a.row
    assert str(info.value).startswith("held: ")
    e.w.step()
    assert e.w.ledger.inserting == set()
    assert [v.invariant for v in e.w.violations] == ["invalid_argument"]
    assert e.owned("a", CACHE_RID) == [2, 0]  # nothing passed


def test_an_insert_refused_in_raise_mode_ends_there():
    e = Engine(ONE_POOL["ours-ps16"], mode="raise")
    a = Req("a")
    e.grow(a, 32)
    e.insert(a, 32)
    e.w.ledger["a"].cache_protected_len = 0
    with pytest.raises(InvariantViolation):
        e.insert(a, 32)
    assert e.w.ledger.inserting == set()
