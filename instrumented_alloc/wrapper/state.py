"""The per-call state (``_CallState``, its one owner) and the small plumbing of a call: self-cost charging, the
pools' page counters, ``batch()``'s context managers.

Contract: the hot paths fetch ``self._w_st`` once per call and read everything else from it. Its per-wrapper
constants are set once in ``core.InstrumentedAllocator.__init__``; its per-call fields are written by the call in
progress (under the wrapper's lock); ``want_*`` only by ``emit._Events._sync_deltas``."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import numpy as np

from instrumented_alloc.ledger import KvLedger
from instrumented_alloc.selfcost import SelfCost
from instrumented_alloc.shadow import (
    PoolShadow,
)
from instrumented_alloc.wrapper.constants import _ABSENT


def _charged(fn: Callable) -> Callable:
    """An instrumented entry point whose own time (between its calls into the inner allocator, which stop and
    restart the stretch) is charged to ``checks`` (see ``selfcost``): a clock read in, one out."""

    @functools.wraps(fn)
    def charged(self, *args, **kwargs):
        cost = self._w_st.cost
        cost.start()
        try:
            return fn(self, *args, **kwargs)
        finally:
            cost.end_checks()

    return charged


def _inner_call(cost: SelfCost, method: Callable, index, start_pos=_ABSENT) -> Callable:
    """``method(index[, start_pos=...])`` as a call of no arguments that stops the wrapper's stretch for the inner's
    time (see ``_charged``): what the free paths forward."""

    def forward():
        cost.stop_checks()
        try:
            return method(index) if start_pos is _ABSENT else method(index, start_pos=start_pos)
        finally:
            cost.start()

    return forward


class _CallState:
    """What the per-call paths read and write, on a plain slotted object: a slot is the cheapest attribute there
    is to read and to assign, while the wrapper's own attributes are instance attributes (kept within the 30
    names CPython 3.11 holds inline, see ``InstrumentedAllocator``'s properties; off mode's are more, and its
    instrumented methods are not called) and assigning one goes through the forwarding ``__setattr__``. The hot
    paths fetch this object once per call and read everything else from it.

    Four kinds of fields:
    - per-call state (``step``, ``seq``, ``events``, ``op``) and what the event paths build (``want_*``, and
      ``note_*``/``time_*``: a per-call kind is built or counted in ``stats``, refreshed by ``_sync_deltas``
      whenever the sinks change);
    - the per-wrapper constants, set once at construction and never reassigned, held here only: the wrapper's
      ``_w_*`` names for them are properties that read these slots (its instance dict must stay within 30
      names, see ``InstrumentedAllocator``); ``inner`` alone is also the wrapper's ``_w_inner``, which every
      forwarded attribute reads;
    - the per-wrapper values that are reassigned (``run``: the decode fast path's ``_DecodeRun``; ``pools``,
      ``full``, ``swa``, ``counts``: replaced by ``resize``): held here only, the single source of truth; the
      wrapper's ``_w_run``, ``_w_pools``, ``_w_full`` and ``_w_swa`` are properties that read and write these
      slots;
    - ``ledger``: the wrapper's public ``ledger`` attribute (a plain attribute, what engines read per request),
      the same object; an assignment to the wrapper's ``ledger`` is mirrored here (``__setattr__``)."""

    __slots__ = (
        "atomic_free",
        "bind_memo",
        "bus",
        "capture_before",
        "clock",
        "consts",
        "cost",
        "counts",
        "decode_runs",
        "deferred",
        "detached",
        "device",
        "events",
        "extend_runs",
        "fast_alloc",
        "fast_decode",
        "fast_free",
        "full",
        "host",
        "inner",
        "inner_checks",
        "ledger",
        "lock",
        "need_sort",
        "note_alloc",
        "note_evict",
        "off",
        "op",
        "pending",
        "pools",
        "ps",
        "raising",
        "run",
        "seq",
        "shift",
        "stats",
        "step",
        "steps",
        "swa",
        "swa_frees",
        "time_decode",
        "time_free",
        "tls",
        "to_raise",
        "track_lengths",
        "views",
        "want_alloc",
        "want_evict",
        "want_free",
        "want_ledger",
        "want_pages",
        "want_released",
        "want_step",
        "want_write",
    )

    def __init__(self, clock, tls, bus, to_raise: list):
        self.step = 0  # the step counter
        self.seq = 0  # the last event's seq
        self.events: list = []  # events of the call in progress
        self.op = ""  # the op whose page updates are being published
        self.want_alloc = self.want_free = self.want_released = self.want_pages = False
        self.want_ledger = self.want_step = self.want_write = self.want_evict = False
        self.time_decode = self.time_free = self.note_alloc = self.note_evict = False
        # The step's statistics (a StepAccumulator) while a sink reads StepStats, else None.
        self.stats = None
        # Deferred verification: request id -> its releases detached from the ledger and still queued.
        self.detached: dict = {}
        self.clock = clock
        self.tls = tls
        self.bus = bus
        self.to_raise = to_raise
        self.run = None  # the decode fast path's _DecodeRun (one pool, immediate verification)
        self.ledger = self.pools = self.full = self.swa = self.counts = None  # set by the wrapper's __init__
        # The wrapper keeps each request's lengths in step with its frees (True), or they are the engine's alone
        # (False: allocated_len="tokens"; see InstrumentedAllocator).
        self.track_lengths = True
        # (attribute, pool name) -> the checked view of that pool's own allocator (see InstrumentedAllocator._w_sub).
        self.views: dict = {}


def _state_property(field: str, doc: str) -> property:
    """A wrapper attribute whose one copy lives in the ``_CallState`` slot ``field`` (see ``_CallState``). Read
    through a C getter (``attrgetter``): no Python frame per read."""

    def set_field(self, value) -> None:
        setattr(self._w_st, field, value)

    return property(operator.attrgetter(f"_w_st.{field}"), set_field, doc=doc)


def _page_counter(allocator, ps: int) -> tuple[Callable[[], int], Callable[[], int]]:
    """``(count, probe)``, two no-argument callables. ``count()`` returns ``allocator.available_size() // ps``:
    free + staged pages as the inner counts them (host ints and tensor lengths only: never a sync); ``probe()``
    a value that changes whenever ``available_size()`` does (what a free compares before and after an inner call
    that raised). Both call the allocator's ``available_size`` each time, so a patched one is honoured."""

    def count() -> int:
        return allocator.available_size() // ps

    def probe() -> int:
        return allocator.available_size()  # not floored: a change of less than a page shows too

    return count, probe


class _Pool:
    """One pool's allocator object and the shadow of its pages. ``count()``: free + staged pages as the inner
    counts them; ``probe()``: changes whenever the inner's ``available_size()`` does (see ``_page_counter``)."""

    def __init__(self, name: str, allocator, shadow: PoolShadow, dedup_free: bool):
        self.name = name
        self.allocator = allocator
        self.shadow = shadow
        self.dedup_free = dedup_free
        self.page_size = shadow.page_size
        self.count, self.probe = _page_counter(allocator, shadow.page_size)

    def entries(self) -> int:
        """Free + staged pages as the inner allocator counts them (host ints and tensor lengths only)."""
        return self.count()

    def staged(self) -> int:
        a = self.allocator
        n = getattr(a, "num_staged_pages", None)
        if n is not None:
            return int(n)
        rel = getattr(a, "release_pages", None)
        return 0 if rel is None else len(rel)

    def census(self) -> np.ndarray:
        """Every free and staged page id the inner lists (a host copy: may synchronise)."""
        pages = self.allocator.get_all_free_pages()
        return pages.detach().to("cpu").numpy().astype(np.int64, copy=False)


def _make_pool(name: str, allocator, ledger: KvLedger, need_sort: bool) -> _Pool:
    ps = int(allocator.page_size)
    paged = hasattr(allocator, "num_pages")
    num_pages = int(allocator.num_pages) if paged else int(allocator.size)
    shadow = PoolShadow(name, ps, num_pages, dedup_free=paged, need_sort=need_sort, ledger=ledger)
    return _Pool(name, allocator, shadow, paged)


class _Binding:
    """What ``InstrumentedAllocator.batch()`` returns: binds on entry, unbinds on exit (a plain class: a generator
    context manager costs several microseconds per block, and an engine opens one per batched call)."""

    __slots__ = ("_alloc", "_lens", "_rids", "_tls")

    def __init__(self, alloc, rids, lens):
        self._alloc, self._rids, self._lens = alloc, rids, lens
        self._tls = None

    def __enter__(self):
        alloc = self._alloc
        self._tls = alloc._bind(self._rids, self._lens)
        return alloc

    def __exit__(self, *exc) -> None:
        self._tls.bound = None  # the wrapper's thread-local binding (what _bind returned)


class _OffBatch:
    """``batch()`` in off mode: nothing is bound."""

    __slots__ = ("_alloc",)

    def __init__(self, alloc):
        self._alloc = alloc

    def __enter__(self):
        return self._alloc

    def __exit__(self, *exc) -> None:
        return None


class _CacheInsert:
    """``InstrumentedAllocator.cache_insert``'s context manager: ``held`` is the caller's to set."""

    __slots__ = ("_alloc", "_rid", "_slot", "_slots", "held")

    def __init__(self, alloc, rid, slots):
        self._alloc, self._rid, self._slots = alloc, rid, slots
        self._slot = None
        self.held = None

    def __enter__(self):
        if not self._alloc._w_st.off:
            self._slot = self._alloc._cache_offer(self._rid, self._slots)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._slot is not None:
            self._alloc._cache_take(self._slot, self.held)
