"""``InstrumentedAllocator``: a drop-in wrapper that checks every invariant of a KV page allocator, per request,
on every call, and turns each failure into a structured ``Violation``.

Contracts:
- Drop-in: same methods, arguments and return values as the inner allocator (ours or SGLang's own classes,
  duck-typed). Every other attribute is forwarded untouched, reads and writes. The wrapper is an instance of a
  generated subclass of ``type(inner)``, so ``isinstance(wrapped, SWATokenToKVPoolAllocator)`` takes the same
  branch as the bare allocator does (SGLang's scheduler branches on it).
- Results: for every well-formed call the inner allocator runs exactly the call it was given, in every mode, so
  results and inner state are bit-identical to a bare allocator's run of the same calls. In ``mode="raise"`` a
  free whose indices are on the host and break an invariant is refused before it reaches the inner allocator
  (fail early, before corruption); everything else is checked after the call.
- Malformed calls (wrong type, dtype, device or shape; negative lengths; prefix > seq) are never forwarded (in any
  mode but off): recorded as ``invalid_argument``, then ``TypeError``/``ValueError`` naming the argument.
- No device sync: the host tier reads only ``*_cpu`` tensors, Python ints and tensor metadata. The slot tier reads
  the values of handed-out / freed indices: at once when they are CPU tensors (``verify="auto"`` or
  ``"immediate"``); otherwise (``verify="deferred"``, or accelerator tensors under ``"auto"``) they are copied
  with ``non_blocking=True`` (into pinned memory on CUDA, with an event recorded on the copy's stream, the current
  stream of the tensors' own GPU) and verified in call order at the next ``step()`` whose copies are complete, or
  at ``flush()`` / ``check_consistency()`` (which may wait). Only CUDA has that path: on another accelerator (XPU,
  MPS, HPU...) the copies are plain blocking ones, a sync per instrumented call. Deferred,
  a free's effect on its pages' owners' ledgers lands there too, after the host tier of the calls made since:
  where a fault left one page with two requests (``duplicate_allocation``), a later free of it can move the other
  request's ledger after that request's own later writes, so findings about those requests may differ from
  immediate verification's from that fault on; up to it, both report the same.
- Threading: every instrumented call holds the wrapper's lock, so calls from several threads are serialised and
  keep working; the engine's own ordering between threads is the engine's business.
- Sinks get the events of one call as one batch after the call; a failing sink never reaches the caller.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import operator
import threading
import time
import types
from collections import Counter, deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from instrumented_alloc import events as ev
from instrumented_alloc.allocators.base import BaseTokenToKVPoolAllocator, page_disjoint
from instrumented_alloc.allocators.paged import PagedTokenToKVPoolAllocator
from instrumented_alloc.allocators.token import TokenToKVPoolAllocator
from instrumented_alloc.argcheck import (
    ArgumentError,
    ArgumentTypeError,
    ArgumentValueError,
    check_batch,
    check_index_tensor,
    check_int,
    check_segments,
)
from instrumented_alloc.invariants import SEVERITY, InvariantViolation, Violation
from instrumented_alloc.ledger import KvLedger
from instrumented_alloc.selfcost import SelfCost
from instrumented_alloc.shadow import (
    FREE,
    LedgerSnapshot,
    PoolShadow,
    PoolSnapshot,
    entry_ids,
    has_repeat,
    pages_list,
    sorted_unique,
)

MODES = ("raise", "record", "off")
# "This op has no such argument" (None is a value a caller can pass, and must be rejected as one).
_ABSENT = object()
_I64 = np.dtype(np.int64)
_TORCH_I64 = torch.int64
_ADD = np.add
_MAX = np.maximum
_make_event = ev.make
# Positional builders of the kinds built on every call (see events.builder): no keyword dict, no template copy.
_B_ALLOC = ev.builder(ev.Alloc)
_B_FREE = ev.builder(ev.Free)
_B_LEDGER = ev.builder(ev.LedgerUpdate)
_B_PAGES = ev.builder(ev.PageUpdate)
_B_STEP = ev.builder(ev.StepBoundary)
_B_RELEASED = ev.builder(ev.RequestReleased)
_NOOP = {}.clear
VERIFY = ("auto", "immediate", "deferred")
# What a request's kv_allocated_len counts: whole pages (the host-allocator contract of SGLang's #35223: page-aligned,
# and the wrapper shrinks it with the request's frees), or tokens (SGLang 0.5.23: the engine writes every length,
# its pages are the ceiling, and frees leave the lengths to the engine).
ALLOCATED_LEN = ("pages", "tokens")

# Allocator methods the wrapper instruments. Any other attribute of the inner allocator is forwarded.
INSTRUMENTED_OPS = (
    "alloc",
    "alloc_extend",
    "alloc_decode",
    "alloc_extend_swa_tail",
    "alloc_logical_only",
    "free",
    "free_page_ids",
    "free_segment",
    "free_full",
    "free_full_segment",
    "free_swa",
    "free_swa_segment",
    "free_segments",
    "free_full_segments",
    "free_group_begin",
    "free_group_end",
    "merge_and_sort_free",
    "clear",
    "resize",
)

# Page-level faults after which a request's ledger-vs-pages comparison says nothing new.
_TAINTING = frozenset(
    {
        "duplicate_allocation",
        "slot_page_alignment",
        "swa_mapping_inconsistent",
        "double_free",
        "free_unallocated",
        "reserved_page_touched",
        "alloc_length_mismatch",
    }
)

# The decode fast path builds a _DecodeRoll once a mixed batch has been verified this many times in a row with
# nothing else changing the pages' owners in between. Building one costs what the roll saves on some 10 to 20
# decodes (measured in the demo engine's step loop, where numpy's cold paths make it several times dearer than
# in a tight loop), so it pays only on a batch that stays: in an engine whose batch changes every few decodes
# (requests joining and finishing, other requests' allocations in between) it is (almost) never built.
_ROLL_AFTER = 16
_ONE_B = np.ones(1, np.int64).tobytes()  # the bytes of int64 1

# Bindings each thread remembers (see _bind): a decode batch, an extend's, a few more.
_BIND_MEMO = 8

# A step boundary compares up to this many changed requests one by one in Python ints, more with numpy.
_FEW_DIRTY = 8

_OWN_ATTRS = frozenset({"ledger", "violations", "violation_counts", "mode", "inner", "trace_id_for", "bus"})


def _distinct_pages(slots: np.ndarray, ps: int, shift: int, offsets: np.ndarray) -> np.ndarray:
    """``sorted_unique(slots >> shift)`` (the sorted distinct pages of a set-shaped free, a fresh array). A row of
    whole-page runs (each run a page's slots in order from its first, the last run maybe shorter: what an engine
    frees for a finished request) is recognised from one slot per page, as the page-run extend check does (one
    bytes compare), and its pages sorted if none repeats; any other layout goes through ``sorted_unique``."""
    heads = slots[::ps] >> shift
    if slots.tobytes() == ((heads << shift)[:, None] + offsets).tobytes()[: slots.nbytes] and not has_repeat(heads):
        heads.sort()
        return heads
    return sorted_unique(slots >> shift)


def _count_decodes(led: KvLedger, slots: np.ndarray, shares) -> None:
    """Before a plain ``alloc`` adds ``shares`` (an int or one per slot) to the bound requests: a share of one slot
    to a request already holding KV is a decode step (SGLang decodes so at page size 1). The records it sets
    replace any a free saved (``KvLedger.kept``)."""
    if led.kept:
        led.unkeep(slots)
    held = led.committed[slots] > 0
    if type(shares) is int:
        if shares == 1:
            led.decode_steps[slots] += held
    else:
        held &= shares == 1
        led.decode_steps[slots] += held


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

    Three kinds of fields:
    - per-call state (``step``, ``seq``, ``events``, ``op``) and what the event paths build (``want_*``,
      refreshed by ``_sync_deltas`` whenever the sinks change);
    - the per-wrapper constants, set once at construction and never reassigned: the same objects as the
      wrapper's ``_w_inner``, ``_w_lock``, ``_w_ps``, ``_w_shift``, ``_w_clock``, ``_w_tls``, ``bus``,
      ``_w_to_raise``, ``_w_pending``, ``_w_deferred`` ... (the wrapper keeps its attribute too, for the cold
      paths and readers outside), except ``need_sort``, ``inner_checks``, ``atomic_free``, ``host``,
      ``capture_before``, ``fast_*``, ``consts`` and ``steps``, held here only (the wrapper's ``_w_*`` names for
      them are properties: its instance dict must stay within 30 names, see ``InstrumentedAllocator``);
    - the per-wrapper values that are reassigned (``run``, ``roll``: the decode fast path's ``_DecodeRun`` and
      ``_DecodeRoll``, at most one of them set, ``roll_key``: what decides when a roll is worth building; ``pools``,
      ``full``, ``swa``, ``counts``: replaced by ``resize``): held here only, the single source of truth; the
      wrapper's ``_w_run``, ``_w_pools``, ``_w_full`` and ``_w_swa`` are properties that read and write these
      slots;
    - ``ledger``: the wrapper's public ``ledger`` attribute (a plain attribute, what engines read per request),
      the same object; an assignment to the wrapper's ``ledger`` is mirrored here (``__setattr__``)."""

    __slots__ = (
        "atomic_free",
        "bus",
        "capture_before",
        "clock",
        "consts",
        "cost",
        "counts",
        "deferred",
        "detached",
        "device",
        "events",
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
        "off",
        "op",
        "pending",
        "pools",
        "ps",
        "raising",
        "roll",
        "roll_key",
        "run",
        "seq",
        "shift",
        "step",
        "steps",
        "swa",
        "swa_frees",
        "time_decode",
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
        self.time_decode = False
        # Deferred verification: request id -> its releases detached from the ledger and still queued.
        self.detached: dict = {}
        self.clock = clock
        self.tls = tls
        self.bus = bus
        self.to_raise = to_raise
        self.run = None  # the decode fast path's _DecodeRun (one pool, immediate verification)
        self.roll = None  # the decode fast path's _DecodeRoll (one pool, immediate verification)
        # (batch key, shadow version, streak) after the last verified _decode_fast call: see _decode_fast
        self.roll_key = None
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


class _DecodeRun:
    """What the decode fast path knows after a verified decode of a batch in step (every request at the same
    offset ``a`` of its page: the same length, or a single request), either one in which every request opened a
    page (``a`` = 0) or one mid-page that no run vouched for, so that the next ``ps - 1 - a`` decodes of the same
    requests can be verified by two comparisons instead of reading the pages again.

    Invariant (established by a verified call, kept while ``shadow.version`` and ``ledger.version`` are those
    recorded): the batch's pages read their requests' codes (-1 for an unattributed batch), and the opening call's
    slots and lengths sat at offset ``a`` of those pages. The k-th decode verified
    after it (k < ps - a) whose slots are exactly the opening ones + k and whose lengths are exactly the opening
    ones + k (row k - 1 of ``o_rows`` and ``seq_rows``) then passes every check of the general path: each slot
    continues its request's own page at its position's offset, and no request opens a page. Any change of the
    pages' owners (a free, an allocation, clear, resize) or of the ledger (a checked write, a release)
    invalidates it; a call that does not match exactly takes the full check. SWA allocators keep no run (their
    peers are read from a mapping the inner may change)."""

    __slots__ = ("end", "ledger_version", "o_rows", "row", "seq_rows", "shadow", "slots_b", "version")

    def __init__(self, shadow, ledger_version: int, slots_b, o_rows: bytes, seq_rows: bytes, row: int):
        self.shadow = shadow
        self.version = shadow.version
        self.ledger_version = ledger_version
        self.slots_b = slots_b  # the slots' bytes (None: an unattributed batch)
        # The expected arguments of the next ps - 1 decodes, one row of ``row`` bytes each: a matching call costs
        # two slices and two compares (memcmp), no array operation.
        self.o_rows = o_rows
        self.seq_rows = seq_rows
        self.row = row
        self.end = row  # where the next call's row ends (past the rows: the run is spent)


def _run_after(shadow, ledger, slots, o: np.ndarray, seq: np.ndarray, steps: np.ndarray):
    """The ``_DecodeRun`` after a verified call with slots ``o`` and lengths ``seq``: the next decodes' expected
    arguments, ``o`` and ``seq`` + each of ``steps`` (a column). (The class is looked up here at each call: tests
    replace it to keep no run.)"""
    return _DecodeRun(
        shadow,
        ledger.version,
        None if slots is None else slots.tobytes(),
        (o + steps).tobytes(),
        (seq + steps).tobytes(),
        o.nbytes,
    )


class _DecodeRoll:
    """What the decode fast path knows after a verified decode of a batch whose requests open their pages at
    different decodes (a sixteenth of the batch at each decode at page size 16: what a real engine's batch does),
    so that the following decodes of the same requests are verified with two array operations on the whole batch
    and a few on the requests that open a page at that decode only, for as long as the batch stays the same.

    Invariant (established by a verified call, kept while ``shadow.version`` and ``ledger.version`` are those
    recorded after this cache's own last write): ``last`` (this cache's own array) is the last verified call's
    slots, each at its position's offset in a page whose owner reads ``own`` (the request's code), and the
    ledger's page counts of the batch's requests are those read at creation plus the pages this cache opened
    (nothing else writes them without bumping one of the two versions).

    The rows repeat with period ps (every length grows by 1 per decode): row ``k`` (0 <= k < ps) of a cycle
    expects the lengths ``seq_rows`` row k (the creating call's + k + 1, + ps per cycle done); the requests that
    open a page at row ``k`` (length % ps == 1), each exactly once per cycle, are ``c[cuts[k]:cuts[k + 1]]``
    (ascending), with their owner codes, ledger slots, page counts and allocated lengths after the opening at the
    same places in ``own_next``, ``slots_next``, ``owned_next`` (+ 1 per cycle) and ``alloc_next`` (+ ps per
    cycle). ``keep[k]`` is all bits for a request that continues its page at row k, the offset bits for one that
    opens one. A call whose lengths are exactly the row's and whose slots less ``last``, masked by ``keep[k]``,
    all read 1 passes every check of the general path: a request that continues got ``last + 1`` (``last`` was
    not at its page's last offset, or it would open a page now), the same page, which it owns; one that opens got
    a slot at offset 0 (as ``last + 1``: ``last`` sat at the page's last offset), whose page is then checked as
    the general path checks it (free; a page outside the pool, or a negative slot's, reads as reserved; no page
    opened by two requests of the call, see ``PoolShadow.shared_in_call``). Its ledger
    values are what the general path writes (``allocated`` = length + ps - 1, page counts + 1). Anything else
    returns to the general fast path, which drops this cache. SWA allocators keep none (their peers are read from
    a mapping the inner may change)."""

    __slots__ = (
        "alloc_next",
        "c",
        "cuts",
        "end",
        "k",
        "keep",
        "last",
        "ledger_version",
        "ones_b",
        "own",
        "own_next",
        "owned_next",
        "row",
        "rows",
        "seq_rows",
        "shadow",
        "slots",
        "slots_b",
        "slots_next",
        "version",
    )

    def __init__(self, shadow, ledger, slots, own, last: np.ndarray, seq: np.ndarray, steps: np.ndarray):
        """``last``: this cache's own copy of the verified call's slots; ``seq``: its lengths (read here only);
        ``slots``: the batch's ledger slots (None: unattributed; read-only), ``own`` their owner codes (read-only,
        the same shape); ``steps``: the column 1 .. ps (read-only)."""
        ps = steps.shape[0]
        self.shadow = shadow
        self.version = shadow.version
        self.ledger_version = ledger.version
        self.slots = slots
        self.slots_b = None if slots is None else slots.tobytes()
        self.own = own
        self.last = last
        mask = ps - 1
        self.rows = rows = seq + steps  # a cycle's lengths, a row each
        self.seq_rows = rows.tobytes()
        # The row at which each request opens a page ((seq + k + 1) % ps == 1), and the requests by that row,
        # ascending within a row (a stable sort), cut by row.
        at = -seq
        at &= mask
        c = np.argsort(at, kind="stable")
        self.c = c
        self.cuts = [0, *np.bincount(at, minlength=ps).cumsum().tolist()]
        keep = (rows & mask) == 1
        keep = keep * ps
        keep -= 1
        self.keep = list(keep)  # the rows (views), indexed per call without making one
        self.ones_b = _ONE_B * seq.size  # what every masked difference must read
        self.own_next = own_next = own[c]
        own_next.setflags(write=False)  # never written: its slices are shared by page deltas (see _decode_roll)
        if slots is not None:
            self.slots_next = slots_next = slots[c]
            self.owned_next = [(name, arr[slots_next] + 1) for name, arr in ledger.owned.items()]
            alloc = seq[c] + at[c]
            alloc += ps  # the opening row's length (seq + k + 1) + ps - 1
            self.alloc_next = alloc
        self.row = seq.nbytes
        self.end = self.row  # where the next call's row ends in seq_rows
        self.k = 0  # the next call's row

    def next_cycle(self) -> None:
        """Past the cycle's last row: the same requests open at the same rows, ps tokens further."""
        ps = len(self.keep)
        self.rows += ps
        self.seq_rows = self.rows.tobytes()
        if self.slots is not None:
            for _, vals in self.owned_next:
                vals += 1
            self.alloc_next += ps
        self.k = 0
        self.end = self.row


def _page_counter(allocator, ps: int) -> tuple[Callable[[], int], Callable[[], int]]:
    """``(count, probe)``, two no-argument callables. ``count()`` returns ``allocator.available_size() // ps``:
    free + staged pages as the inner counts them (host ints and tensor lengths only: never a sync); ``probe()``
    a value that changes whenever ``available_size()`` does (what a free compares before and after an inner call
    that raised). For our paged allocator itself (exactly that
    class, its ``available_size`` not overridden on the instance) the same sum read directly, with the free list's
    ``shape[0]``: ``available_size`` is ``(len(free_pages) + num_staged_pages) * page_size``, and torch's
    ``len()`` of a tensor is a Python-level method (a microsecond per count, read several times per step). An
    ``available_size`` set on the instance (a test's patch, before or after wrapping) is called instead. Any
    other allocator (SGLang's among them): its own ``available_size``."""
    if type(allocator) is PagedTokenToKVPoolAllocator and int(allocator.page_size) == ps:
        # The patch check reads the bound method, not the instance's __dict__: reading an object's __dict__
        # makes CPython 3.11 materialise it, and every attribute access of the inner's own code is slower from
        # then on (3-7% of an off-mode call at page size 1, measured).
        own = PagedTokenToKVPoolAllocator.available_size

        def count() -> int:
            m = allocator.available_size
            if type(m) is not types.MethodType or m.__func__ is not own:
                return m() // ps
            return allocator.free_pages.shape[0] + allocator.num_staged_pages

        return count, count  # available_size() is count() * ps here: one changes exactly when the other does

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


class _Missing:
    """Hides an instrumented method the inner class lacks, so ``hasattr`` answers as for the bare allocator."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        raise AttributeError(f"{owner.__name__ if owner else 'allocator'} has no attribute {self.name!r}")


def _forward_property(name: str) -> property:
    """A data descriptor forwarding ``name`` to the inner allocator, read, write and delete. The read is a C getter
    (``attrgetter``): no Python frame per read; a method reads as the inner's bound method (looked up at each
    read, so an instance attribute of the inner shadowing it is honoured), and calling it costs no forwarding
    frame. A name the inner lacks raises the inner's own ``AttributeError`` (naming the inner's type), so
    ``hasattr`` and ``getattr(w, name, default)`` answer as for the bare allocator."""

    def set_inner(self, value) -> None:
        setattr(self._w_inner, name, value)

    def del_inner(self) -> None:
        delattr(self._w_inner, name)

    return property(operator.attrgetter(f"_w_inner.{name}"), set_inner, del_inner, doc=f"The inner's ``{name}``.")


def _stored_names(cls: type) -> set[str]:
    """Every attribute name the code of ``cls`` and its bases stores with ``x.name = ...`` (``STORE_ATTR``): the
    instance attributes its methods may create after construction (``clear()``, lazily). A superset (it also
    holds names stored on other objects): a forwarding property for a name the inner lacks answers as the inner
    does (``AttributeError``), so an extra name costs nothing but a ``dir()`` entry."""
    names: set[str] = set()
    seen: set = set()

    def scan(code) -> None:
        if code in seen:
            return
        seen.add(code)
        for ins in dis.get_instructions(code):
            if ins.opname == "STORE_ATTR":
                names.add(ins.argval)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                scan(const)

    for klass in cls.__mro__:
        if klass is object:
            continue
        for value in vars(klass).values():
            parts = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
            for part in parts:
                try:  # class attributes may be any object: one that misbehaves here has no code to scan
                    part = getattr(part, "__func__", part)  # staticmethod, classmethod
                    part = getattr(part, "func", part)  # functools.cached_property, partialmethod
                    part = inspect.unwrap(part)
                    code = getattr(part, "__code__", None)
                except Exception:
                    continue
                if isinstance(code, types.CodeType):
                    scan(code)
    return names


def _is_own(name: str, base: type) -> bool:
    """A name the wrapper keeps for itself (never forwarded): its private ``_w_*`` state, its public instance
    attributes, dunders, and every name the classes of ``base`` (``InstrumentedAllocator`` or a subclass of it)
    define."""
    if name.startswith("_w_") or name in _OWN_ATTRS or (name.startswith("__") and name.endswith("__")):
        return True
    return any(name in vars(klass) for klass in base.__mro__)


# (wrapper class, inner class) -> the generated class (see _subclass_for).
_SUBCLASSES: dict[tuple[type, type], type] = {}


def _forward_names(sub: type, names) -> None:
    """Give the generated class ``sub`` a forwarding property for each of ``names`` it does not answer yet.
    Cold: the class's creation and the first assignment of a new name through the wrapper (changing a class
    resets the interpreter's lookup caches for it)."""
    base = sub._w_base
    for name in names:
        if type(name) is str and name not in sub.__dict__ and not _is_own(name, base):
            setattr(sub, name, _forward_property(name))


def _subclass_for(cls: type, base: type) -> type:
    """The generated subclass of ``(base, cls)`` for inner class ``cls`` (one per pair, cached; ``base`` is
    ``InstrumentedAllocator`` or a subclass of it): every name of ``cls`` the wrapper does not define forwards to
    the inner through a property (``_forward_property``: methods included), and so does every name the code of
    ``cls`` stores as an attribute (``_stored_names``); ``_Missing`` hides the instrumented methods ``cls``
    lacks."""
    sub = _SUBCLASSES.get((base, cls))
    if sub is not None:
        return sub
    ns: dict = {"__module__": base.__module__, "__doc__": base.__doc__, "_w_base": base}
    for name in dir(cls):
        if not _is_own(name, base):
            ns[name] = _forward_property(name)
    for name in INSTRUMENTED_OPS:
        if not hasattr(cls, name):
            ns[name] = _Missing(name)
    sub = type(f"{getattr(base, '_w_class_prefix', 'Instrumented')}{cls.__name__}", (base, cls), ns)
    _forward_names(sub, _stored_names(cls))
    _SUBCLASSES[(base, cls)] = sub
    return sub


class _PoolView:
    """One pool's own allocator (an SWA allocator's ``full_attn_allocator`` or ``swa_attn_allocator``) as the
    wrapper hands it out: SGLang's caches call these directly (the unified radix cache frees an evicted node's
    full pages with ``full_attn_allocator.free_segment``, on purpose without the composite's peer check, before
    its SWA component frees the SWA side; HiCache and external KV loads allocate and free on either side). A call
    that bypassed the wrapper would change a pool behind its shadow, and every later call on those pages would
    read as a fault (``duplicate_allocation``, ``pool_conservation``).

    ``alloc``, ``free``, ``free_segment`` and ``free_page_ids`` are checked and mirrored as the wrapper's own
    calls are, on this pool alone: pages handed out here belong to no request (a cache's), a free must release
    pages in use, raise mode refuses a bad one before the call; the op is named ``<attribute>.<method>``
    (``full_attn_allocator.free_segment``). No SWA peer check: these calls are below the mapping. Every other
    name reads and writes through to the allocator, as the wrapper's own forwarding does (an instance of a class
    made once per allocator class: ``isinstance`` answers as for the allocator). Other methods that change the
    pool (``alloc_extend``, ``alloc_decode``, ``clear``, its free groups) are forwarded unchecked: SGLang calls
    them on the composite allocator only. Threading and ordering: as the wrapper's calls (its lock)."""

    _w_base = None
    _w_class_prefix = "Checked"

    def __setattr__(self, name, value):
        setattr(self._w_inner, name, value)
        cls = type(self)
        if name not in cls.__dict__:
            _forward_names(cls, (name,))

    def __repr__(self) -> str:
        return f"<checked view of {self._w_attr} of {self._w_owner!r}: {self._w_inner!r}>"

    def alloc(self, need_size: int):
        return self._w_owner._w_sub_alloc(self._w_attr, self._w_pool, need_size)

    def free(self, free_index):
        return self._w_owner._w_sub_free(self._w_attr, self._w_pool, "free", free_index, _ABSENT)

    def free_segment(self, free_index, *, start_pos):
        return self._w_owner._w_sub_free(self._w_attr, self._w_pool, "free_segment", free_index, start_pos)

    def free_page_ids(self, page_ids):
        return self._w_owner._w_sub_free(self._w_attr, self._w_pool, "free_page_ids", page_ids, _ABSENT)


def _pool_view(owner, attr: str, pool: str, allocator) -> _PoolView:
    view = object.__new__(_subclass_for(type(allocator), _PoolView))
    for name, value in (("_w_inner", allocator), ("_w_owner", owner), ("_w_attr", attr), ("_w_pool", pool)):
        object.__setattr__(view, name, value)
    return view


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


class InstrumentedAllocator:
    """Wrap ``inner`` (an allocator with SGLang's interface). See the module docstring for the contracts.

    Forwarding (the class defines no ``__getattr__``: on CPython 3.11 one turns off the interpreter's
    specialised attribute lookups on every instance, the engine's ``alloc.alloc_decode`` and the wrapper's own
    ``self.x`` alike). ``InstrumentedAllocator(inner)`` is an instance of a class generated once per inner class
    (``Instrumented<InnerClass>``, a subclass of ``InstrumentedAllocator`` and of ``type(inner)``) on which every
    forwarded name is a property that reads, writes and deletes the inner's attribute (a method reads as the
    inner's bound method, looked up at each read: an instance attribute of the inner shadowing it is honoured).
    Forwarded: the inner class's names (methods the wrapper does not instrument, attributes, properties); every
    name the inner class's code (its bases' included) assigns as an attribute anywhere (``self.x = ...`` in
    ``__init__``, in ``clear()``, in a lazy path: read from its bytecode when the class is generated); every
    name first assigned through the wrapper (the write lands on the inner; the property is added to the class
    then). A forwarded name the inner lacks raises the inner's own ``AttributeError`` (naming the inner's class),
    so ``hasattr`` answers as for the bare allocator; a name nothing forwards raises the generated class's (named
    ``Instrumented<InnerClass>``).
    Not forwarded: an attribute that code outside the inner class creates directly on the inner object (before or
    after wrapping, not through the wrapper) under a name the inner class's code never assigns (nor with a
    ``setattr`` of a computed name): read it from ``inner``, or assign it once through the wrapper. The wrapper
    never enumerates the inner's instance attributes: reading an object's ``__dict__`` makes CPython 3.11
    materialise it, which slows every attribute access of the inner's own code from then on (measured: off mode
    +3-5% at page size 1). The wrapper's own names (``_w_*``, ``ledger``, ``violations``, ``violation_counts``,
    ``mode``, ``inner``, ``trace_id_for``, ``bus`` and everything this class defines) are never forwarded: they
    win over the inner's. A generated class is shared by the wrappers of its inner class: a property for a name
    one inner lacks answers as that inner does (``AttributeError``)."""

    # The class the generated classes are made from (see _subclass_for); set on each generated class.
    _w_base = None

    def __new__(cls, inner=None, **kwargs):
        if cls._w_base is None:  # InstrumentedAllocator itself (or a subclass of it): make the generated class
            if inner is None:
                raise TypeError("InstrumentedAllocator(inner, ...): inner is required")
            cls = _subclass_for(type(inner), cls)
        return object.__new__(cls)

    def __init__(
        self,
        inner,
        *,
        mode: str = "record",
        sliding_window: int | None = None,
        verify: str = "auto",
        sinks: Sequence[Callable] = (),
        clock: Callable[[], float] = time.perf_counter,
        snapshot_every: int = 0,
        max_violations: int = 1000,
        allocated_len: str = "pages",
        cost_clock: Callable[[], float] = time.perf_counter,
    ):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if allocated_len not in ALLOCATED_LEN:
            raise ValueError(f"allocated_len: expected one of {ALLOCATED_LEN}, got {allocated_len!r}")
        if verify not in VERIFY:
            raise ValueError(f"verify: expected one of {VERIFY}, got {verify!r}")
        if sliding_window is not None:
            check_int("sliding_window", sliding_window, minimum=1)
        s = object.__setattr__
        s(self, "_w_inner", inner)
        s(self, "inner", inner)
        s(self, "mode", mode)
        s(self, "_w_off", mode == "off")
        s(self, "_w_raise", mode == "raise")
        s(self, "_w_clock", clock)
        s(self, "_w_lock", threading.RLock())
        s(self, "_w_to_raise", [])
        s(self, "_w_pending", deque())
        s(self, "_w_tls", threading.local())  # batch() binding is per thread
        s(self, "_w_snapshot_every", int(snapshot_every))
        s(self, "_w_mismatch_reported", {})
        s(self, "bus", ev.EventBus(sinks))
        # Per-call mutable state lives on a plain slotted object (see _CallState).
        s(self, "_w_st", _CallState(clock, self._w_tls, self.bus, self._w_to_raise))
        s(self, "violations", deque(maxlen=max_violations))
        s(self, "violation_counts", Counter())
        s(self, "trace_id_for", None)

        ps = int(inner.page_size)
        device = torch.device(inner.device)
        if verify == "immediate" and device.type != "cpu":
            # Immediate checks read the handed-out slots on the host during the call: on a device that is a sync
            # per call at best (and numpy cannot view device memory at all).
            raise ValueError(
                f"verify: 'immediate' reads the slots on the host during each call and needs a CPU allocator; "
                f"this one is on {device} (use 'auto' or 'deferred')"
            )
        need_sort = bool(getattr(inner, "need_sort", False))
        full_alloc = getattr(inner, "full_attn_allocator", None)
        swa_alloc = getattr(inner, "swa_attn_allocator", None)
        logical = getattr(inner, "logical_attn_allocator", None)
        # Two SWA layouts of SGLang's that page one pool only (see _swa_frees): a per-request SWA ring (the SWA
        # side lives in the request slot's ring, never lent by the SWA allocator: its frees are no-ops and the
        # mapping is never written) and the all-SWA allocator (PureSWATokenToKVPoolAllocator, whose full and SWA
        # allocators are one object: every free releases that one pool, free_full is a no-op).
        ring = full_alloc is not None and swa_alloc is not None and getattr(inner, "swa_req_ring", False) is True
        one_pool = full_alloc is not None and full_alloc is swa_alloc
        s(self, "_w_swa_frees", "none" if ring else "pool" if one_pool else "peers")
        if ring or one_pool:
            names, allocs = ("full",), (full_alloc,)
        elif full_alloc is not None and swa_alloc is not None:
            names, allocs = ("full", "swa"), (full_alloc, swa_alloc)
        elif logical is not None:
            names, allocs = ("full",), (logical,)
        else:
            names, allocs = ("full",), (inner,)
        ledger = KvLedger(ps, sliding_window=sliding_window, pools=names, aligned_allocated=allocated_len == "pages")
        ledger._observer = self
        ledger.lock = self._w_lock  # checked writes from the engine's threads are serialised with the calls
        s(self, "ledger", ledger)
        self._w_st.ledger = ledger  # the same object (see _CallState)
        s(self, "_w_ps", ps)
        s(self, "_w_need_sort", need_sort)
        s(self, "_w_shift", ps.bit_length() - 1 if ps & (ps - 1) == 0 else None)
        # Our reference allocators validate every argument before changing state: the wrapper then lets them
        # (and records their ArgumentError as invalid_argument) instead of validating twice.
        s(self, "_w_inner_checks", isinstance(inner, BaseTokenToKVPoolAllocator))
        # Our token and paged allocators (exactly those classes) validate, then change their lists, then return:
        # a free that raises changed nothing. SGLang's (and our SWA allocator, like SGLang's) may raise after.
        s(self, "_w_atomic_free", type(inner) in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator))
        s(self, "_w_device", device)
        s(self, "_w_host", device.type == "cpu")
        s(self, "_w_window", sliding_window)
        s(self, "_w_pools", {n: _make_pool(n, a, ledger, need_sort) for n, a in zip(names, allocs)})
        s(self, "_w_full", self._w_st.pools["full"])
        s(self, "_w_swa", self._w_st.pools.get("swa"))
        s(self, "_w_mapping_owner", inner if self._w_st.swa is not None else None)
        self._set_counts()
        deferred = device.type != "cpu" if verify == "auto" else verify == "deferred"
        s(self, "_w_deferred", deferred)
        s(self, "_w_cuda", device.type == "cuda")
        # The allocation paths capture the pools' free counts before the call only where a refusal or a merge can
        # follow a change (see _entries_before).
        s(self, "_w_capture_before", need_sort or len(self._w_st.pools) > 1)
        # Immediate decode checks with a power-of-two page size > 1 take the fast path first (one pool, or SWA's
        # two linked by the mapping).
        s(self, "_w_fast_decode", not deferred and ps > 1 and self._w_shift is not None)
        s(self, "_w_consts", {})
        s(self, "_w_run", None)  # the decode fast path's _DecodeRun (one pool, immediate verification)
        s(self, "_w_steps", np.arange(1, ps, dtype=np.int64)[:, None])  # a run's decodes after its opening one
        s(self, "_w_roll_steps", np.arange(1, ps + 1, dtype=np.int64)[:, None])  # a roll's cycle (see _DecodeRoll)
        s(self, "_w_fast_alloc", not deferred and self._w_st.swa is None and ps == 1)
        # Immediate frees with a power-of-two page size > 1 on paged pools take the fast path first.
        s(
            self,
            "_w_fast_free",
            not deferred
            and ps > 1
            and self._w_shift is not None
            and all(p.dedup_free for p in self._w_pools.values())
            # One pool for both sides: its free ops release it in other shapes than the fast path reads them.
            and self._w_swa_frees != "pool",
        )
        s(self, "_w_off_batch", _OffBatch(self))
        # The constants again on the call state, the same objects (see _CallState): what the hot paths read.
        st = self._w_st
        st.inner, st.lock, st.ps, st.shift = inner, self._w_lock, ps, self._w_shift
        st.pending, st.consts, st.steps, st.device = self._w_pending, self._w_consts, self._w_steps, device
        st.deferred, st.host, st.raising, st.need_sort = deferred, self._w_host, self._w_raise, need_sort
        st.off = self._w_off
        st.cost = ledger.cost = SelfCost(cost_clock)
        st.track_lengths = allocated_len == "pages"
        st.inner_checks, st.atomic_free = self._w_inner_checks, self._w_atomic_free
        st.capture_before = self._w_capture_before
        st.fast_decode, st.fast_alloc, st.fast_free = self._w_fast_decode, self._w_fast_alloc, self._w_fast_free
        self._sync_deltas()
        self.bus.on_change = self._sync_deltas  # alloc.bus.subscribe(sink) directly refreshes what is built too
        if mode == "off":
            # Off: the inner's own bound methods, so a call costs exactly what the bare call costs (the
            # instrumented methods below are never reached in this mode).
            for name in INSTRUMENTED_OPS:
                method = getattr(inner, name, None)
                if method is not None:
                    s(self, name, method)
            # The step boundary does nothing when off; the engine still calls it every step: a C-level no-op
            # (an empty dict's clear(): no arguments, returns None) instead of a Python method call.
            s(self, "step", _NOOP)

    # Reassigned per-wrapper values: one copy, on the call state (see _CallState).
    _w_run = _state_property("run", "The decode fast path's ``_DecodeRun`` (None: no run).")
    _w_pools = _state_property("pools", "Pool name -> ``_Pool`` (replaced by ``resize``).")
    _w_full = _state_property("full", "The full pool's ``_Pool``.")
    _w_swa = _state_property("swa", "The SWA pool's ``_Pool``, or None.")
    # Per-wrapper constants the hot paths read from the call state: one copy, there, so that the wrapper's
    # instance dict stays within the 30 names CPython 3.11 keeps inline (past that the dict is materialised, and
    # neither ``self.method()`` nor ``alloc.method()`` on the wrapper is specialised any more: about 25 ns more
    # per call). ``__init__`` assigns them as before (``object.__setattr__`` runs these setters).
    _w_need_sort = _state_property("need_sort", "The inner sorts its free list lazily (SGLang's need_sort).")
    _w_inner_checks = _state_property("inner_checks", "The inner validates every argument itself.")
    _w_atomic_free = _state_property("atomic_free", "A free that raises changed nothing in the inner.")
    _w_host = _state_property("host", "The inner's tensors are on the CPU.")
    _w_capture_before = _state_property("capture_before", "Allocations capture free counts before the call.")
    _w_fast_decode = _state_property("fast_decode", "Immediate decode checks take the fast path first.")
    _w_fast_alloc = _state_property("fast_alloc", "Immediate alloc checks take the fast path first.")
    _w_fast_free = _state_property("fast_free", "Immediate frees take the fast path first.")
    _w_consts = _state_property("consts", "Per-batch-size operands of the decode fast path.")
    _w_steps = _state_property("steps", "A decode run's steps after its opening decode (a column).")
    _w_swa_frees = _state_property(
        "swa_frees",
        "What the SWA frees release: 'peers' (the SWA pool, through the mapping), 'none' (a per-request SWA ring: "
        "no-ops) or 'pool' (one pool for both sides: the SWA frees release it, the full frees are no-ops).",
    )

    @property
    def cost(self) -> SelfCost:
        """What this wrapper (and whoever charges it: the SGLang plugin's hooks) costs the engine's thread, by
        part (``selfcost``); the engine's thread writes it, any thread may read ``cost.totals()``."""
        return self._w_st.cost

    @property
    def bound_rids(self) -> tuple | None:
        """The request ids the calling thread's ``batch()`` block binds, or None outside one."""
        bound = getattr(self._w_tls, "bound", None)
        return None if bound is None else bound[0]

    @property
    def bound_slots(self):
        """The ledger slots of ``bound_rids``, in order (a read-only int64 array), or None outside a ``batch()``."""
        bound = getattr(self._w_tls, "bound", None)
        return None if bound is None else bound[1]

    @property
    def _w_bound(self):
        return getattr(self._w_tls, "bound", None)

    @_w_bound.setter
    def _w_bound(self, value) -> None:
        self._w_tls.bound = value

    # -- attribute forwarding ---------------------------------------------------------------------------------
    # No __getattr__: on CPython 3.11 a class with one gets none of the interpreter's specialised attribute
    # lookups (every ``alloc.x`` by the engine and every ``self.x`` here would pay a generic lookup). The inner's
    # attributes are forwarded by properties on the generated class instead (see the class docstring).
    def __setattr__(self, name, value):
        if name.startswith("_w_") or name in _OWN_ATTRS:
            object.__setattr__(self, name, value)
            if name == "ledger":
                self._w_st.ledger = value  # the hot paths' copy (see _CallState)
        else:
            setattr(self._w_inner, name, value)
            cls = type(self)
            if name not in cls.__dict__:
                _forward_names(cls, (name,))  # a name new to the class: readable through the wrapper from now on

    def __repr__(self) -> str:
        return f"InstrumentedAllocator({self._w_inner!r}, mode={self.mode!r})"

    # -- the pools' own allocators ----------------------------------------------------------------------------
    @property
    def full_attn_allocator(self):
        """The inner's ``full_attn_allocator``: the pool's checked view (``_PoolView``) when it is a pool this
        wrapper tracks, else the object itself; ``AttributeError`` as the inner's when it has none."""
        return self._w_sub("full_attn_allocator")

    @property
    def swa_attn_allocator(self):
        """The inner's ``swa_attn_allocator``, as ``full_attn_allocator`` (a per-request SWA ring's SWA allocator
        is no tracked pool: the object itself)."""
        return self._w_sub("swa_attn_allocator")

    def _w_sub(self, attr: str):
        sub = getattr(self._w_inner, attr)
        st = self._w_st
        if st.off:
            return sub
        for pool in st.pools.values():
            if pool.allocator is sub:
                view = st.views.get((attr, pool.name))
                if view is None or view._w_inner is not sub:
                    view = st.views[(attr, pool.name)] = _pool_view(self, attr, pool.name, sub)
                return view
        return sub

    @_charged
    def _w_sub_alloc(self, attr: str, pool_name: str, need_size: int):
        """``<attr>.alloc(need_size)`` through its view: forwarded, the pages handed out checked and mirrored as
        held by no request (see ``_PoolView``)."""
        st = self._w_st
        with st.lock:
            op = f"{attr}.alloc"
            st.op = op
            n = self._validate(op, check_int, "need_size", need_size)
            pool = st.pools[pool_name]
            before = pool.entries()
            staged = pool.staged() if st.need_sort else 0
            st.cost.stop_checks()
            t0 = st.clock()
            try:
                out = pool.allocator.alloc(n)
            finally:
                st.cost.start()
            dt = st.clock() - t0
            if staged and pool.staged() == 0:
                # need_sort: an allocation that ran short merged the pool's staged pages into its free list first
                # (as _after_merge_check, for this pool alone): mirrored before the pages handed out are judged.
                self._slot_tier(pool.shadow.merged)
            if out is None:
                # A refusal must take no page (see _alloc_none).
                if pool.entries() != before:
                    pool.shadow.expected_entries = before
                    self._report(pool.shadow.check_count(pool.entries(), f"{op} returned None but"), pool_name, op)
                if self.bus.wants(ev.AllocFailed):
                    self._emit(
                        ev.AllocFailed,
                        op=op,
                        pool=pool_name,
                        requested=n,
                        available=int(pool.allocator.available_size()),
                        rids=(),
                        duration=dt,
                    )
                self._finish()
                return None
            ps = st.ps
            got = int(out.shape[0])
            if got != n:
                # SGLang's paged alloc takes a page-aligned need_size (its debug mode asserts it) and hands out
                # need_size // page_size pages: an unaligned one gets fewer slots than asked, as the wrapper's own
                # alloc reports.
                self._alloc_mismatch(op, n, got, pool_name)

            def verify(o):
                if ps == 1:
                    self._report(pool.shadow.on_alloc(o, -1, None, got, op), pool_name, op)
                else:
                    self._alloc_pages_check(pool, o, -1, got, op)

            self._slot_tier(verify, out)
            if st.want_alloc:
                st.seq = seq = st.seq + 1
                st.events.append(_B_ALLOC(seq, st.clock(), st.step, op, pool_name, got, got // ps, (), dt))
            self._finish()
            return out

    def _alloc_mismatch(self, op: str, n: int, got: int, pool: str) -> None:
        """``alloc_length_mismatch``: ``op`` (a plain ``alloc``, the wrapper's or a pool view's) asked for ``n``
        slots and got ``got``. The contract is exactly ``n`` (SGLang's paged allocators expect a page-aligned
        ``n``: an unaligned one is handed ``n // page_size`` pages, which the message names)."""
        ps = self._w_ps
        expect = n // ps * ps
        self._violate(
            "alloc_length_mismatch",
            f"{op}({n}) returned {got} slots"
            + (f" (page size {ps}: {n} is not a multiple, {expect} handed out)" if ps > 1 and got == expect else ""),
            op=op,
            pool=pool,
        )

    def _alloc_pages_check(self, pool: _Pool, slots: np.ndarray, own, got: int, op: str) -> None:
        """A plain ``alloc`` of ``got`` slots at page size > 1 (host ``slots``): whole pages from their first slot,
        handed out to ``own`` (owner code per page, or -1), mirrored in ``pool``'s shadow."""
        ps = self._w_ps
        starts = slots[::ps]
        if (starts % ps).any():
            self._violate(
                "slot_page_alignment",
                f"{op} returned a page not starting at a page boundary: slots {starts[:4].tolist()}",
                op=op,
                pool=pool.name,
            )
        self._report(pool.shadow.on_alloc(starts // ps, own, None, got // ps, op), pool.name, op)

    @_charged
    def _w_sub_free(self, attr: str, pool_name: str, method: str, index, start_pos):
        """``<attr>.<method>`` (``free``, ``free_segment``, ``free_page_ids``) through its view: checked (the
        pages must be in use; raise mode refuses a host-visible bad free before the call), forwarded, mirrored
        on that pool alone (see ``_PoolView``)."""
        st = self._w_st
        op = f"{attr}.{method}"
        with st.lock:
            st.op = op
            arg = "page_ids" if method == "free_page_ids" else "free_index"
            if start_pos is _ABSENT:
                self._validate(op, check_index_tensor, arg, index, st.device)
            else:
                self._segment_args(op, index, start_pos, pool=pool_name)
            pool = st.pools[pool_name]
            forward = _inner_call(st.cost, getattr(pool.allocator, method), index, start_pos)
            if index.numel() == 0:
                return forward()
            if method == "free":
                part = self._set_part(pool, index)
            elif method == "free_segment":
                part = self._segment_part(pool, index)
            else:
                part = (pool, lambda p: (p, False, None), (index,))
            held = getattr(pool.allocator, "free_group", None) is not None
            if not held and getattr(st.inner, "free_group", None) is not None:
                # The composite is in a free group its pool's own allocator is not in (SGLang's SWA allocator
                # opens one on its full allocator only; the all-SWA allocator holds frees in its own pile): the
                # pool's shadow holds the composite's frees, but this one releases at once.
                return self._outside_group(pool.shadow, lambda: self._free(op, forward, [part]))
            return self._free(op, forward, [part])

    def _outside_group(self, shadow: PoolShadow, call: Callable):
        """``call()`` (a free of ``shadow``'s pool that its allocator releases at once) with ``shadow`` out of
        its free group: judged and mirrored as an immediate free (a page the group holds is not in use: freeing
        it again is a double free), then the group state restored. In call order: both switches go through the
        slot tier, around the free's own queued checks when deferred."""
        saved = []

        def leave() -> None:
            saved.append(shadow.in_group)
            shadow.in_group = False

        def restore() -> None:
            shadow.in_group = saved.pop()

        self._slot_tier(leave)
        try:
            return call()
        finally:
            self._slot_tier(restore)

    # -- public API beyond SGLang's ---------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        return self._w_st.step

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(self._w_st.pools)

    @property
    def sliding_window(self) -> int | None:
        return self._w_window

    @property
    def deferred(self) -> bool:
        return self._w_deferred

    def subscribe(self, sink) -> None:
        with self._w_lock:
            self.bus.subscribe(sink)
            self._sync_deltas()

    def unsubscribe(self, sink) -> None:
        with self._w_lock:
            self.bus.unsubscribe(sink)
            self._sync_deltas()

    def _set_counts(self) -> None:
        # What step() reads for the count checks, in one attribute: (count, shadow) of each pool, in pool order.
        st = self._w_st
        st.counts = tuple((p.count, p.shadow) for p in st.pools.values())

    def _sync_deltas(self) -> None:
        # Page deltas and ledger updates are built only while some sink reads them.
        want = self.bus.wants(ev.PageUpdate)
        for p in self._w_st.pools.values():
            if want and p.shadow.deltas is None:
                p.shadow.deltas = []
            elif not want:
                p.shadow.deltas = None
        st, wants = self._w_st, self.bus.wants
        st.want_ledger = wants(ev.LedgerUpdate)
        st.want_pages = want
        # The per-call kinds are built only for a sink that reads them too (seq stays gap-free: it counts the
        # events built). Frees are timed only when their Free event is built.
        st.want_alloc = wants(ev.Alloc)
        # A decode is timed only for its Alloc events and a refusal's AllocFailed.
        st.time_decode = st.want_alloc or wants(ev.AllocFailed)
        st.want_free = wants(ev.Free)
        st.want_released = wants(ev.RequestReleased)
        st.want_step = wants(ev.StepBoundary)
        st.want_write = wants(ev.LedgerWrite)
        st.want_evict = wants(ev.SwaEvict)

    def batch(self, rids: Sequence, *, lens: Sequence[int] | None = None):
        """Bind the next calls' per-request segments to ``rids``, in batch order (a context manager; entering it
        returns the allocator).

        ``lens`` (optional) gives each request's share of a plain ``alloc(n)`` (page size 1 extends, where the
        call itself carries no per-request lengths); decode (``n == len(rids)``) and single-request allocs need
        none. Binding does not nest, and it belongs to the calling thread: calls from another thread are not
        attributed to it. Off mode attributes (and remembers) nothing: the block costs an attribute lookup.
        """
        if self._w_st.off:
            return self._w_off_batch
        return _Binding(self, rids, lens)

    def _bind(self, rids, lens):
        """Bind the calling thread to ``rids`` (see ``batch``); returns the thread-local that holds the binding.

        An engine binds the same batch step after step (its decode batch changes only when a request joins or
        leaves): each thread remembers its last few bindings (ids -> ledger slots), valid while the ledger's
        ``epoch`` (its id -> slot mapping) is unchanged. A remembered batch was checked (hashable, distinct)
        when it was first bound, and takes the same slots array (read-only, see below) and the same owner codes
        the decode fast path made for it."""
        try:
            rids = tuple(rids)
        except TypeError:
            raise ArgumentTypeError("rids", f"expected a sequence of hashable request ids, got {rids!r:.80}") from None
        st = self._w_st
        tls = st.tls
        memo = getattr(tls, "memo", None)
        if memo is None:
            memo = tls.memo = {}
        try:
            hit = memo.get(rids)
        except TypeError:  # an unhashable id: named below
            hit = None
        if hit is None:
            try:
                distinct = len(set(rids))
            except TypeError:
                raise ArgumentTypeError(
                    "rids", f"expected a sequence of hashable request ids, got {rids!r:.80}"
                ) from None
            if distinct != len(rids):
                raise ArgumentValueError("rids", "a request id appears twice in one batch")
        if lens is not None:
            if isinstance(lens, (str, bytes, torch.Tensor)) or not hasattr(lens, "__len__"):
                raise ArgumentTypeError("lens", f"expected a sequence of ints, got {type(lens).__name__}")
            if len(lens) != len(rids):
                raise ArgumentValueError("lens", f"has {len(lens)} entries for {len(rids)} requests")
            # Plain non-negative ints (the usual lens) pass with two C-level scans; anything else is checked
            # one by one, which names the bad entry.
            if not (set(map(type, lens)) <= {int} and (not len(lens) or min(lens) >= 0)):
                lens = [check_int("lens", x) for x in lens]
        with st.lock:
            if getattr(tls, "bound", None) is not None:
                raise RuntimeError("batch(): already inside a batch() block (binding does not nest)")
            led = st.ledger
            lens = None if lens is None else np.asarray(lens, np.int64)
            if hit is not None and hit[0] is led and hit[1] == led.epoch:
                # The same ids map to the same slots (see above): the remembered binding again, its own lens.
                bound = tls.bound = hit[2]
                bound[2] = lens
                return tls
            if st.detached and not st.detached.keys().isdisjoint(rids):
                # An id whose release is still queued (deferred verification) names a new request now: a
                # retracted request re-prefilled before the boundary that checks its release. Verify what has
                # landed (never waiting), so that the release and its RequestReleased come before the new
                # request's events, as they do under immediate verification. (Still queued behind a copy in
                # flight, it stays behind them: sinks that key requests by id then see the two overlap.)
                self._drain(wait=False)
                self._finish()  # raise mode: the release's violation is raised here, before this binding
            slots = led.slots_of(rids)
            # The binding's slots are read-only: the events of this block (LedgerUpdate.slots) and later bindings
            # of the same batch share them instead of a copy each, which is safe because slots_of returns a fresh
            # array that owns its memory.
            slots.flags.writeable = False
            # The last entry: the slots as owner codes (int32, read-only), made by the decode fast path when it
            # first needs them (it compares the pages' owners to them in one memcmp; an extend's binding never
            # needs them).
            bound = tls.bound = [rids, slots, lens, None]
            if len(memo) >= _BIND_MEMO:
                memo.clear()
            memo[rids] = (led, led.epoch, bound)
        return tls

    def cache_insert(self, rid, slots) -> _CacheInsert:
        """The engine inserts request ``rid``'s KV into its prefix cache (SGLang's ``tree_cache.checkpoint``), as a
        context manager around the insert: ``with alloc.cache_insert(rid, offered) as ins: ...; ins.held = slots``.

        ``offered``: the request's slots of the positions it offers, ``[cache_protected_len, up_to)`` of its row
        as it is before the insert. Every page of them must be the request's own: one the prefix cache owns
        already is a page handed to the cache twice, one free or another request's is not the request's to give
        (``double_free``, naming the request). During the insert the engine frees the pages the cache already had
        a copy of (as any free, except that with ``allocated_len="pages"`` they leave the request's lengths: those
        positions become protected, they are not dropped). ``ins.held`` (set by the caller before the block ends;
        None: nothing taken) are the slots the cache now holds for the request: its row over the positions that
        became protected, as it is after the insert (SGLang points it at the cache's own slots). Every page of
        them, and every SWA page they map to, that the request still owns passes to the cache (a cache that already
        held a position may adopt the request's SWA page for it). Index tensors are read as the slot tier reads
        indices: at once on the host, once their copies land from a device (taken at the call). The request's
        ``cache_protected_len`` is the engine's to write (``ledger[rid]``)."""
        return _CacheInsert(self, rid, slots)

    @_charged
    def _cache_offer(self, rid, slots):
        """``cache_insert``'s entry, under the lock: the request's slot, the offered slots, the check queued."""
        st = self._w_st
        with st.lock:
            st.op = "cache_insert"
            self._validate("cache_insert", check_index_tensor, "slots", slots, st.device)
            led = st.ledger
            try:
                known = rid in led
            except TypeError:
                known = False
            if not known:
                self._invalid("cache_insert", ArgumentValueError("rid", f"unknown request id {rid!r}"), rid=rid)
            slot = led.slot_of(rid, create=False)
            cache = led.cache_slot()
            full = st.full
            ps = st.ps

            def check(o: np.ndarray) -> None:
                led.inserting.add(slot)  # until the take (see KvLedger.inserting)
                pages = sorted_unique(o // ps)
                prev = full.shadow._owner_ext.take(pages, mode="clip")
                bad = (prev != slot) & (prev != -1)
                if not bad.any():
                    return
                for mask, what in (
                    (prev == cache, "which the prefix cache owns already: handed to it twice"),
                    ((prev != cache) & bad, "which are not its own"),
                ):
                    mask &= bad
                    if mask.any():
                        first = int(prev[mask][0])
                        who = (
                            "free" if first <= FREE else f"owned by request {led.rid_of(first)!r}" if first >= 0 else ""
                        )
                        self._violate(
                            "double_free",
                            f"request {rid!r} offers the prefix cache {pages_list(pages[mask])} {what}"
                            + (f" (page {int(pages[mask][0])} is {who})" if who and first != cache else ""),
                            slot=slot,
                            op="cache_insert",
                            pool="full",
                        )

            self._slot_tier(check, slots)
            try:
                self._finish()
            except InvariantViolation:
                led.inserting.discard(slot)  # refused (raise mode): no insert follows
                raise
        return slot

    @_charged
    def _cache_take(self, slot: int, held) -> None:
        """``cache_insert``'s exit, under the lock: the pages of ``held`` still owned by ``slot`` pass to the
        prefix cache, in the full pool and through the SWA mapping in the SWA pool."""
        st = self._w_st
        with st.lock:
            st.op = "cache_insert"
            led = st.ledger

            def end() -> None:
                led.inserting.discard(slot)

            if held is None:  # nothing taken: the insert ends
                self._slot_tier(end)
                return
            try:
                self._validate("cache_insert", check_index_tensor, "held", held, st.device)
            except ArgumentError:
                self._slot_tier(end)
                raise
            if not held.numel():
                self._slot_tier(end)
            else:
                cache = led.cache_slot()
                ps = st.ps
                taken_slots = held

                def take(o: np.ndarray, peers: np.ndarray | None = None) -> None:
                    parts = [(st.full, o)]
                    if peers is not None and st.swa is not None:
                        parts.append((st.swa, peers[peers > 0]))
                    for pool, idx in parts:
                        if not idx.size:
                            continue
                        shadow = pool.shadow
                        pages = sorted_unique(idx // ps)
                        mine = pages[shadow._owner_ext.take(pages, mode="clip") == slot]
                        if mine.size:
                            shadow._set(mine, cache)
                            owned = led.owned[pool.name]
                            if pool.name == "full":  # its peak before the pages leave it (as a free records it)
                                led.peak_pages[slot] = max(led.peak_pages.item(slot), owned.item(slot))
                            owned[slot] -= mine.size
                            owned[cache] += mine.size
                            led.dirty.add(slot)
                    end()

                if st.swa is not None and self._w_swa_frees == "peers":
                    self._slot_tier(take, taken_slots, self._peers_at(taken_slots))
                else:
                    self._slot_tier(take, taken_slots)
            self._finish()

    @_charged
    def release_request(self, rid) -> None:
        """The request finished (or was aborted): it must own no pages any more (``request_leak``)."""
        st = self._w_st  # the wrapper's state, read from it (see _CallState)
        if st.off:
            return
        with st.lock:
            try:
                known = rid in st.ledger
            except TypeError:
                known = None
            if known is None:
                self._invalid(
                    "release_request",
                    ArgumentTypeError("rid", f"expected a hashable request id, got {type(rid).__name__}"),
                )
            if not known:
                # The id is named (and carried as the violation's rid, so a hasher can redact it in the message).
                self._invalid("release_request", ArgumentValueError("rid", f"unknown request id {rid!r}"), rid=rid)
            st.op = "release"
            if st.deferred:
                # The id is forgotten now, its slot checked and released in call order (behind the queued checks
                # that still name it): a second release of the id is refused here, as under immediate
                # verification, and a request that takes the id again gets a slot of its own.
                slot = st.ledger.detach(rid)
                st.detached[rid] = st.detached.get(rid, 0) + 1
                self._slot_tier(lambda: self._do_release(rid, slot))
            else:
                self._do_release(rid)  # what _slot_tier does at once in immediate mode, without the closure
            if st.events or st.to_raise or st.want_pages:
                self._finish()

    @_charged
    def step(self) -> None:
        """A step boundary: deferred checks whose copies are complete, count conservation, the ledger against
        the pages, periodic snapshots. Never waits on the device."""
        st = self._w_st  # every read below from it (see _CallState)
        if st.off:
            return
        with st.lock:
            st.step += 1
            st.op = "step"
            cost = st.cost
            spent = cost.close_iteration()
            pending = st.pending
            if pending:
                self._drain(wait=False)
            if not pending:
                # _boundary_checks("step"), inline for the usual boundary (a method call costs what it checks):
                # every pool's count; on a mismatch the general form, which reports it; else the ledger against
                # the pages for the requests that changed (a few: one by one, as _check_ledger_pages does).
                for count, shadow in st.counts:
                    if count() != shadow.expected_entries:
                        self._boundary_checks("step")
                        break
                else:
                    dirty = st.ledger.dirty
                    if dirty:
                        if len(dirty) <= _FEW_DIRTY:
                            self._check_few_ledger_pages("step")
                        else:
                            self._check_ledger_pages("step", False)
            bus = st.bus
            if bus.active:
                if st.want_pages:
                    self._flush_deltas()
                if st.want_step:
                    st.seq = seq = st.seq + 1
                    st.events.append(
                        _B_STEP(
                            seq,
                            st.clock(),
                            st.step,
                            {n: p.shadow.expected_entries for n, p in st.pools.items()},
                            cost.totals(),
                            spent,
                        )
                    )
                if self._w_snapshot_every and st.step % self._w_snapshot_every == 0 and bus.wants(ev.Snapshot):
                    self._emit_snapshots()
            if st.events or st.to_raise:
                self._finish()

    @_charged
    def flush(self) -> None:
        """Complete every deferred check (waits for outstanding device copies) and the count checks."""
        if self._w_off:
            return
        with self._w_lock:
            self._w_st.op = "flush"
            self._drain(wait=True)
            self._boundary_checks("flush", every_request=True)
            self._finish()

    @_charged
    def check_consistency(self, *, cached=None, idle: bool = False) -> list[Violation]:
        """A full sweep, for idle time: conservation against the inner's free lists, free-list duplicates,
        pages owned by finished requests, the SWA mapping, the ledger against the pages. May synchronise.

        ``cached`` (optional): the full-pool slots the engine's prefix cache holds now (SGLang's
        ``tree_cache.all_values_flatten()``). The pool identity is then checked against the cache itself: free +
        request-owned + cache-owned + staged + reserved == capacity, where the cache-owned pages are those the
        cache holds. A page the wrapper saw handed to the cache that the cache holds no more (the cache lost it:
        SGLang's idle check counts it as a leak), and a page the cache holds that was never handed to it, are
        ``pool_conservation``, named with their pages and owners.

        ``idle``: the engine says that no request holds KV now (SGLang's scheduler is fully idle, where it runs its
        own leak check). A request the wrapper still knows that owns pages was never released: ``request_leak``,
        naming it and its pages (once per request)."""
        if self._w_off:
            return []
        with self._w_lock:
            before = sum(self.violation_counts.values())
            self._w_st.op = "sweep"
            self._drain(wait=True)
            found = []
            for pool in self._w_st.pools.values():
                found += [(pool.name, b) for b in pool.shadow.check_census(pool.census())]
            for pool_name, (inv, msg, slot) in found:
                self._violate(inv, msg, slot=slot, pool=pool_name, op="sweep")
            if cached is not None:
                self._sweep_cache(cached)
            if idle:
                self._sweep_unreleased()
            self._sweep_leaks()
            if self._w_st.swa is not None:
                self._sweep_mapping()
            self._boundary_checks("sweep", every_request=True)
            new = sum(self.violation_counts.values()) - before
            recent = list(self.violations)[-new:] if new else []
            self._finish()
            return recent

    def snapshot(self, *, wait: bool = True) -> dict[str, PoolSnapshot]:
        """A copy of every pool's page states and owners, with the live requests' ledger columns. Host only.

        With deferred verification, ``wait=True`` first completes the outstanding checks (may wait for device
        copies); ``wait=False`` (what exporters on other threads use) returns the state as of verified calls."""
        # Under the lock, only copies (the owner arrays, the live requests' columns, the slot -> id list): an
        # exporter's scrape holds the engine up for about those. What is derived from them (the slots that own
        # pages, their ids) is computed after, from the copies.
        with self._w_lock:
            if wait and self._w_deferred and not self._w_off:
                self._drain(wait=True)
            led = self._w_st.ledger
            slots = led.live_slots()
            rids = tuple(led.rid_of(int(s)) for s in slots)
            lsnap = LedgerSnapshot(
                rids=rids,
                slots=slots,
                allocated=led.allocated[slots].copy(),
                committed=led.committed[slots].copy(),
                evicted=led.evicted[slots].copy(),
                sliding_window=self._w_window,
            )
            slot_rid = led.slot_rids()
            step = self._w_st.step
            pools = [(n, p.page_size, p.shadow.num_pages, p.shadow.owner.copy()) for n, p in self._w_st.pools.items()]
        owner_slots = {}
        for _, _, _, owner in pools:
            used = np.unique(owner[owner >= 0])
            owner_slots.update({s: slot_rid[s] if s < len(slot_rid) else None for s in used.tolist()})
        return {
            n: PoolSnapshot(
                pool=n,
                page_size=ps,
                num_pages=num_pages,
                owner=owner,
                step=step,
                ledger=lsnap,
                slot_rids=owner_slots,
            )
            for n, ps, num_pages, owner in pools
        }

    # -- ledger observer (called by KvLedger on checked writes) -----------------------------------------------
    def ledger_rejected(self, slot: int, rid, violations, exc=None) -> None:
        with self._w_lock:
            self._w_st.ledger.tainted.add(slot)
            for inv, msg in violations:
                self._violate(inv, msg, slot=slot, op="ledger", pool=None)
            if exc is not None:
                self._w_to_raise.clear()  # the argument error itself is raised by the ledger
                self._deliver()
                return
            self._finish()

    def ledger_written(self, slot: int, rid, field: str, old: int, new: int) -> None:
        st = self._w_st
        write = st.want_write
        evict = st.want_evict and field == "swa_evicted_seqlen"
        if not (write or evict):
            return  # as with no sink: nothing to build, and a ledger write leaves no page delta to publish
        with st.lock:
            if write:
                self._emit(ev.LedgerWrite, rid=rid, field=field, old=old, new=new)
            if evict:
                ps = st.ps
                self._emit(ev.SwaEvict, rid=rid, old=old, new=new, n_pages=new // ps - old // ps)
            self._deliver()

    # -- allocation ops ---------------------------------------------------------------------------------------
    @_charged
    def alloc(self, need_size: int):
        st = self._w_st  # the wrapper's state, read from it (see _CallState)
        with st.lock:
            op = "alloc"
            st.op = op
            if type(need_size) is int and need_size >= 0:
                n = need_size  # what check_int accepts and returns unchanged
            else:
                n = self._validate(op, check_int, "need_size", need_size)
            bound = getattr(st.tls, "bound", None)
            if bound is not None and bound[2] is not None and int(_ADD.reduce(bound[2])) != n:
                self._invalid(
                    op, ArgumentValueError("lens", f"the bound lens sum to {int(bound[2].sum())}, alloc asks {n}")
                )
            before = self._entries_before() if st.capture_before else None
            st.cost.stop_checks()
            t0 = st.clock()
            try:
                out = st.inner.alloc(n)
            finally:
                st.cost.start()
            dt = st.clock() - t0
            if st.need_sort:
                self._after_merge_check(before)
            if out is None:
                return self._alloc_none(op, n, before, dt)
            fast = st.fast_alloc and bound is not None and n and out.shape[0] == n
            if fast and self._alloc_fast(st, out, n, bound, dt):
                return out
            ps = st.ps
            got = int(out.shape[0])
            if got != n:
                self._alloc_mismatch(op, n, got, "full")
            own, grow = self._alloc_owners(n if got == n else got)
            full = self._w_st.full
            if ps == 1:

                def verify(o, s=None):
                    bad = full.shadow.on_alloc(o, own, None, got, op)
                    self._report(bad, "full", op)
                    if s is not None:
                        swa_shadow = self._w_st.swa.shadow
                        # A full slot listed twice has one SWA peer for both: the SWA side repeats with it.
                        swa_shadow.relisted |= full.shadow.relisted
                        self._report(swa_shadow.on_alloc(s, own, None, got, op), "swa", op)

            else:

                def verify(o, s=None):
                    self._alloc_pages_check(full, o, own, got, op)

            self._host_alloc_ledger(op, grow)
            if self._w_st.swa is not None:
                self._slot_tier(verify, out, self._swa_peer(out))
            else:
                self._slot_tier(verify, out)
            self._emit_alloc(op, got, got // ps, dt)
            if self._w_st.swa is not None:
                self._emit_alloc(op, got, got, 0.0, pool="swa")
            self._finish()
            return out

    def alloc_extend(
        self,
        prefix_lens,
        prefix_lens_cpu,
        seq_lens,
        seq_lens_cpu,
        last_loc,
        extend_num_tokens,
        *args,
        **kwargs,
    ):
        inner = self._w_inner
        return self._extend(
            "alloc_extend",
            inner.alloc_extend,
            (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, *args),
            kwargs,
        )

    def alloc_logical_only(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        inner = self._w_inner
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        return self._extend("alloc_logical_only", inner.alloc_logical_only, args, {}, swa=False)

    def alloc_extend_swa_tail(
        self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, swa_tail_len
    ):
        inner = self._w_inner
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        return self._extend("alloc_extend_swa_tail", inner.alloc_extend_swa_tail, args, {}, tail=swa_tail_len)

    @_charged
    def _extend(self, op, call, args, kwargs, *, swa: bool = True, tail=_ABSENT):
        st = self._w_st  # the wrapper's state, read from it (see _CallState)
        with st.lock:
            st.op = op
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, n = args[:6]
            # An SWA tail is judged before the call (_tail_evicted_check reads seq_lens_cpu and swa_tail_len): its
            # arguments are validated here first, whoever the inner is.
            trusted = st.inner_checks and tail is _ABSENT and type(seq_lens) is torch.Tensor and seq_lens.dim() == 1
            if trusted:
                bs = seq_lens.shape[0]  # the inner validates everything before it changes anything
            else:
                bs = self._validate(
                    op,
                    check_batch,
                    st.device,
                    prefix_lens=prefix_lens,
                    prefix_lens_cpu=prefix_lens_cpu,
                    seq_lens=seq_lens,
                    seq_lens_cpu=seq_lens_cpu,
                    last_loc=last_loc,
                    extend_num_tokens=n,
                )
            if tail is not _ABSENT and not trusted:
                tail = self._validate(op, check_int, "swa_tail_len", tail)
                if bs != 1:
                    self._invalid(
                        op, ArgumentValueError("seq_lens", f"SWA tail allocation takes batch size 1, got {bs}")
                    )
                if tail > n:
                    self._invalid(op, ArgumentValueError("swa_tail_len", f"{tail} exceeds extend_num_tokens {n}"))
            bound = getattr(st.tls, "bound", None)
            if bound is None:
                slots = None
            elif len(bound[0]) == bs:
                slots = bound[1]
            else:
                slots = self._bound_slots(bs, op)  # raises: the bound batch does not match the call
            if tail is not _ABSENT:
                self._tail_evicted_check(op, seq_lens_cpu, tail, slots)
            if not st.capture_before:
                before = None
            elif st.need_sort:
                before = self._entries_before()
            else:
                # _entries_before's two-pool case, inline (an SWA allocator's every extend): free+staged page counts.
                before = [(p.count(), 0) for p in st.pools.values()]
            st.cost.stop_checks()
            t0 = st.clock()
            try:
                out = call(*args, tail, **kwargs) if tail is not _ABSENT else call(*args, **kwargs)
            except ArgumentError as exc:
                st.cost.start()
                self._invalid(op, exc)
            st.cost.start()
            dt = st.clock() - t0
            if st.need_sort:
                self._after_merge_check(before)
            if out is None:
                return self._alloc_none(op, n, before, dt)
            ps, shift = st.ps, st.shift
            prefix, seq = prefix_lens_cpu.numpy(), seq_lens_cpu.numpy()
            if prefix.dtype is not _I64:  # int32 lengths (the usual int64 needs no call)
                prefix = prefix.astype(np.int64)
            if seq.dtype is not _I64:
                seq = seq.astype(np.int64)
            ext = seq - prefix
            m = ps - 1
            if shift is not None:  # a shift floors as // does, for a third of the cost
                ceil_prefix, ceil_seq = (prefix + m) >> shift, (seq + m) >> shift
            else:
                ceil_prefix, ceil_seq = (prefix + m) // ps, (seq + m) // ps
            grow = ceil_seq - ceil_prefix
            # ufunc methods and ndarray.repeat are C calls; ndarray.sum, np.cumsum and np.repeat wrap them in
            # Python (a microsecond each on a batch).
            n_new = grow.item(0) if bs == 1 else int(_ADD.reduce(grow))
            got = int(out.shape[0])
            if got != n:
                self._violate(
                    "alloc_length_mismatch", f"{op} returned {got} slots for extend_num_tokens={n}", op=op, pool="full"
                )
                self._emit_alloc(op, got, n_new, dt)
                self._finish()
                return out
            # Every prefix ends on a page boundary (fresh requests, whole-page chunks): every slot opens a page taken
            # from the free list (on_alloc reads new_mask None as all new, and judges it with one comparison).
            if bs == 1:
                aligned = not prefix.item(0) % ps
            else:
                aligned = not np.count_nonzero(prefix & m if shift is not None else prefix % ps)
            # Immediate checks of an all-new extend whose pages are runs of page_size slots in call order (every
            # prefix page-aligned, every request but the last a whole number of pages: one request, or whole-page
            # chunks) try the page-run check first (_alloc_runs), which needs neither the slots' positions nor
            # their owners: those are built only when it declines (the per-slot check) or for a deferred check.
            runs = (
                aligned and shift is not None and not st.deferred and (bs == 1 or not np.count_nonzero(ext[:-1] & m))
            )
            full, swa_pool = st.full, st.swa
            led = st.ledger
            if slots is not None:
                if bs == 1:  # Python ints: a fancy-index update is a gather and a scatter
                    s0 = slots.item(0)
                    owned_full = led.owned["full"]
                    owned_full[s0] = owned_full.item(s0) + grow.item(0)
                    led.committed[s0] = seq.item(0)
                    # The request's allocated length: whole pages, or (allocated_len="tokens") its token count, the
                    # value the engine writes next (then no change to report).
                    led.allocated[s0] = ceil_seq.item(0) * ps if st.track_lengths else seq.item(0)
                else:
                    led.owned["full"][slots] += grow
                    led.committed[slots] = seq
                    led.allocated[slots] = ceil_seq * ps if st.track_lengths else seq
                if led.kept:
                    led.unkeep(slots)  # the record is this allocation's now
                if st.want_ledger:
                    self._emit_ledger(op, slots, bound[0], private=True)  # the binding's (read-only)
            swa_grow = None
            if swa and swa_pool is not None:
                if tail is _ABSENT:
                    swa_grow, swa_ext, swa_n_new = grow, ext, n_new
                    peer = self._swa_peer(out)
                elif tail > 0:
                    swa_n_new = (tail + ps - 1) // ps
                    swa_grow = np.array([swa_n_new], np.int64)
                    swa_ext = np.array([tail], np.int64)  # bs == 1: the tail is the request's whole SWA share
                    peer = self._swa_peer(out[-tail:])
                if swa_grow is not None and slots is not None:
                    owned_swa = led.owned["swa"]
                    if bs == 1:
                        s0 = slots.item(0)
                        owned_swa[s0] = owned_swa.item(s0) + swa_grow.item(0)
                    else:
                        owned_swa[slots] += swa_grow
            if runs:
                # Immediate: called directly, no closure (this is every fresh request's extend).
                o = out.numpy()
                pos = own = None
                if not self._alloc_runs(o, slots, grow, ext, full.shadow, n_new):
                    pos, own = self._extend_layout(prefix, ext, n, bs, slots)
                    self._check_extend(o, pos, own, full, None, n_new, op, "full")
                if swa_grow is not None and not self._alloc_runs(
                    peer, slots, swa_grow, swa_ext, swa_pool.shadow, swa_n_new
                ):
                    if tail is _ABSENT:
                        if pos is None:
                            pos, own = self._extend_layout(prefix, ext, n, bs, slots)
                        swa_pos, swa_own = pos, own
                    else:
                        swa_pos = np.arange(tail, dtype=np.int64)  # the SWA side lays the tail out from position 0
                        swa_own = -1 if slots is None else slots.astype(np.int32).repeat(swa_ext)
                    self._check_extend(peer, swa_pos, swa_own, swa_pool, None, swa_n_new, op, "swa")
            else:
                pos, own = self._extend_layout(prefix, ext, n, bs, slots)
                new_mask = None if aligned else pos >= (ceil_prefix * ps).repeat(ext)
                if swa_grow is not None:
                    if tail is _ABSENT:
                        swa_pos, swa_new, swa_own = pos, new_mask, own
                    else:
                        swa_pos = np.arange(tail, dtype=np.int64)  # the SWA side lays the tail out from position 0
                        swa_new = None  # every tail slot opens its page
                        swa_own = own if slots is None else own[-tail:]
                swa_args = (swa_pos, swa_own, swa_pool, swa_new, swa_n_new) if swa_grow is not None else None
                if st.deferred:
                    full_args = (pos, own, full, new_mask, n_new)
                    self._extend_deferred(out, peer if swa_grow is not None else None, full_args, swa_args, op)
                else:
                    # Immediate (host tensors): at once, no closure.
                    self._check_extend(out.numpy(), pos, own, full, new_mask, n_new, op, "full")
                    if swa_args is not None:
                        self._check_extend(peer, *swa_args, op, "swa")
            if st.want_alloc:
                emit_alloc = self._emit_alloc
                emit_alloc(op, got, n_new, dt)
                if swa_grow is not None:
                    emit_alloc(op, int(peer.shape[0]), swa_n_new, 0.0, pool="swa")
            if st.events or st.to_raise or st.want_pages:
                self._finish()
            return out

    def _tail_evicted_check(self, op: str, seq_lens_cpu, tail: int, slots) -> None:
        """An SWA tail allocation (PD decode prealloc) leaves the request's first ``seq_len - swa_tail_len``
        positions without SWA KV: that evicted length must be a non-negative multiple of page_size (the seed's
        invariant I2; ``free_swa_segment`` relies on it). Judged from host values before the call, so raise mode
        refuses the allocation before anything is handed out, and before the engine's own check of the same rule
        after the call (SGLang's bare ``assert``)."""
        ps = self._w_ps
        seq = int(seq_lens_cpu[0])
        evicted = seq - int(tail)
        if evicted >= 0 and not evicted % ps:
            return
        slot = -1 if slots is None else slots.item(0)
        rid = None if slot < 0 else self._w_st.ledger.rid_of(slot)
        if slot >= 0:
            self._w_st.ledger.reported_evicted[slot] = evicted
        self._violate(
            "swa_evicted_seqlen_page_aligned",
            (f"request {rid!r}: " if rid is not None else "")
            + f"{op} with seq_len={seq}, swa_tail_len={tail} implies swa_evicted_seqlen={evicted}, not a "
            f"non-negative multiple of page_size={ps} (remainder {evicted % ps})",
            slot=slot,
            op=op,
            pool="swa",
        )
        if self._w_st.raising:
            self._finish()  # raises: nothing is allocated

    def _extend_deferred(self, out, peer, full_args: tuple, swa_args: tuple | None, op: str) -> None:
        """Queue an extend's per-slot checks for when the slots' copies land (deferred verification). A method of
        its own: the closure would otherwise make a cell of each variable it reads on every extend."""
        check = self._check_extend

        def verify(o, s=None):
            check(o, *full_args, op, "full")
            if s is not None:
                check(s, *swa_args, op, "swa")

        if peer is not None:
            self._slot_tier(verify, out, peer)
        else:
            self._slot_tier(verify, out)

    @staticmethod
    def _extend_layout(prefix: np.ndarray, ext: np.ndarray, n: int, bs: int, slots):
        """The position of every slot an extend returned, and its owner (the bound request's ledger slot as an int32
        owner code, or -1 unattributed): what the per-slot check reads."""
        if bs == 1:
            p0 = prefix.item(0)
            pos = np.arange(p0, p0 + n, dtype=np.int64)
        else:
            # ufunc methods and ndarray.repeat are C calls; np.cumsum and np.repeat wrap them in Python.
            first = _ADD.accumulate(ext) - ext
            pos = np.arange(n, dtype=np.int64) + (prefix - first).repeat(ext)
        # Owner codes in the shadow's dtype (int32): its write and read-back then need no cast.
        return pos, (-1 if slots is None else slots.astype(np.int32).repeat(ext))

    def _check_extend(self, o: np.ndarray, pos: np.ndarray, own, pool: _Pool, new, n_new: int, op: str, name: str):
        """One pool's per-slot check of an extend's slots ``o`` (positions ``pos``, owners ``own``; ``new``: the
        open-page mask, None when every slot opens a page), then its mirror in the shadow (``on_alloc``)."""
        ps, shift = self._w_ps, self._w_shift
        # Bit operations where the page size is a power of two (they floor negatives as % and // do).
        if shift is not None:
            misaligned, pages = np.count_nonzero((o - pos) & (ps - 1)), o >> shift
        else:
            misaligned, pages = np.count_nonzero((o - pos) % ps), o // ps
        if misaligned:
            self._misaligned(o, pos, own, op, name)
        bad = pool.shadow.on_alloc(pages, own, new, n_new, op, True, o)  # runs: page_size slots per page
        if bad:
            self._report(bad, name, op)

    @_charged
    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        st = self._w_st  # every read below from it (see _CallState): the wrapper's own attributes are slow
        with st.lock:
            op = "alloc_decode"
            st.op = op
            if st.inner_checks and type(seq_lens) is torch.Tensor and seq_lens.dim() == 1:
                bs = seq_lens.shape[0]  # the inner validates everything before it changes anything
            else:
                bs = self._validate(
                    op, check_batch, st.device, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu, last_loc=last_loc
                )
            bound = getattr(st.tls, "bound", None)
            if bound is None:
                slots = None
            elif len(bound[0]) == bs:
                slots = bound[1]
            else:
                slots = self._bound_slots(bs, op)  # raises: the bound batch does not match the call
            if not st.capture_before:
                before = None
            elif st.need_sort:
                before = self._entries_before()
            else:
                # _entries_before's two-pool case, inline (an SWA allocator's every decode): free+staged page counts.
                before = [(p.count(), 0) for p in st.pools.values()]
            timed = st.time_decode  # the duration is only read by this call's Alloc or AllocFailed events
            cost = st.cost
            cost.stop_checks()
            t0 = st.clock() if timed else 0.0
            try:
                out = st.inner.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
            except ArgumentError as exc:
                cost.start()
                self._invalid(op, exc)
            cost.start()
            dt = st.clock() - t0 if timed else 0.0
            allocs = st.want_alloc  # this call's Alloc events are built
            if st.need_sort:  # only need_sort merges (before then holds the staged counts _after_merge_check reads)
                self._after_merge_check(before)
            if out is None:
                return self._alloc_none(op, bs, before, dt)
            n_new = None
            if st.fast_decode and out.shape[0] == bs:
                o = out.numpy()
                seq = seq_lens_cpu.numpy()
                run = st.run
                if (
                    run is not None
                    and o.tobytes() == run.o_rows[run.end - run.row : run.end]
                    and seq.tobytes() == run.seq_rows[run.end - run.row : run.end]
                    and o.dtype is _I64
                    and seq.dtype is _I64
                    and run.shadow is st.full.shadow
                    and run.version == run.shadow.version
                    and run.ledger_version == st.ledger.version
                    and run.slots_b == (None if slots is None else slots.tobytes())
                ):
                    # Inline (a method call costs a tenth of what is left here): every slot is the last verified
                    # one + 1 in a page its request owns, no request opens a page (see _DecodeRun). Apply what
                    # the full check applies to such a call.
                    run.end += run.row  # past the rows' end: an empty slice, which no call's bytes match
                    if slots is not None:
                        st.ledger.committed[slots] = seq
                        if not st.track_lengths:
                            st.ledger.allocated[slots] = seq  # tokens: the engine's next write (see _extend)
                    # No page delta: no owner changes (see PageUpdate), so the call publishes none.
                    n_new = 0
                else:
                    roll = st.roll
                    if roll is not None:
                        n_new = self._decode_roll(st, roll, o, seq, slots, bs)
                    if n_new is None:
                        n_new = self._decode_fast(st, o, seq, slots, bound, bs)
            if n_new is not None:
                if slots is not None:
                    st.ledger.decode_steps[slots] += 1
                    if st.want_ledger:
                        self._emit_ledger(op, slots, bound[0], private=True)  # the binding's (read-only)
                if allocs:
                    emit_alloc = self._emit_alloc
                    emit_alloc(op, bs, int(n_new), dt)
                    if st.swa is not None:
                        emit_alloc(op, bs, int(n_new), 0.0, pool="swa")
                # want_pages: a page delta alone is a batch too (a sink that reads only PageUpdate gets it now,
                # named for this call, not with the next call's events).
                if st.events or st.to_raise or st.want_pages:
                    self._finish()
                return out
            return self._decode_checked(op, out, seq_lens_cpu, bs, slots, allocs, dt)

    def _decode_checked(self, op: str, out, seq_lens_cpu, bs: int, slots, allocs: bool, dt: float):
        """``alloc_decode``'s general path (under the lock, after the inner call): every check, with the faults
        named. A method of its own: its closures would otherwise make a cell of each variable they read on every
        decode, the fast ones included."""
        ps = self._w_ps
        seq = seq_lens_cpu.numpy()
        # SGLang's rule for a page-opening decode (never true at page size 1, where it decodes in place).
        shift = self._w_shift
        new_mask = (seq & (ps - 1) if shift is not None else seq % ps) == 1
        n_new = int(np.count_nonzero(new_mask))
        got = out.shape[0]
        if got != bs:
            self._violate(
                "alloc_length_mismatch", f"{op} returned {got} slots for a batch of {bs}", op=op, pool="full"
            )
            if allocs:
                self._emit_alloc(op, got, n_new, dt)
            self._finish()
            return out
        own = -1
        if slots is not None:
            own = slots
            led = self._w_st.ledger
            led.committed[slots] = seq
            if n_new:
                openers = slots[new_mask]
                for arr in led.owned.values():
                    arr[openers] += 1
                led.allocated[openers] = (seq[new_mask] + (ps - 1)) // ps * ps
            if not self._w_st.track_lengths:
                led.allocated[slots] = seq  # tokens: the engine's next write (see _extend)
            led.decode_steps[slots] += 1
            if self._w_st.want_ledger:
                self._emit_ledger(op, slots, self._w_bound[0], private=True)  # the binding's (read-only)
        full, swa_pool = self._w_st.full, self._w_st.swa
        pos = seq - 1

        def check(o, pool, name):
            # Page sizes are powers of two in practice: bit operations are 2-3x cheaper than % and //.
            if shift is not None:
                misaligned = np.count_nonzero((o - pos) & (ps - 1))
                pages = o >> shift
            else:
                misaligned = np.count_nonzero((o - pos) % ps)
                pages = o // ps
            if misaligned:
                self._misaligned(o, pos, own, op, name)
            bad = pool.shadow.on_alloc(pages, own, new_mask, n_new, op)
            if bad:
                self._report(bad, name, op)

        def verify(o, s=None):
            check(o, full, "full")
            if s is not None:
                check(s, swa_pool, "swa")

        st = self._w_st
        st.roll = None  # the pages change below (or are reported); a run is dropped by the shadow's version
        if swa_pool is not None:
            self._slot_tier(verify, out, self._swa_peer(out))
        else:
            self._slot_tier(verify, out)
        if allocs:
            self._emit_alloc(op, got, n_new, dt)
            if swa_pool is not None:
                self._emit_alloc(op, got, n_new, 0.0, pool="swa")
        if st.events or st.to_raise or st.want_pages:
            self._finish()
        return out

    def _alloc_runs(
        self, o: np.ndarray, slots, grow: np.ndarray, ext: np.ndarray, shadow: PoolShadow, n_new: int
    ) -> bool:
        """One pool's check of an all-new extend (immediate, power-of-two page size) whose slots ``o`` form runs of
        page_size consecutive positions, each run starting on a page boundary (the last run may be shorter), each
        run one request's (see ``_extend``), for the case where every check passes: each run lies in one page at
        its positions' offsets (the run's k-th slot is its page's k-th: ``o`` equals its pages' first slots plus
        0 .. page_size - 1, compared as bytes), each run's page was free, and no two runs share a page (one
        duplicate test on the runs' pages: two requests', or one request's twice). That is the per-slot check
        (``slot % ps == position % ps``, ``on_alloc`` with every slot new) on one slot per page. Then it applies
        what ``on_alloc`` applies (owners: request ``r``'s ledger slot on its ``grow[r]`` pages, the page delta
        ``on_alloc`` records for it when deltas are kept, one entry per page, the free count) and returns True;
        otherwise it returns False having changed nothing, and the per-slot check runs and reports. ``slots``: the
        bound requests' ledger slots (None: unattributed); ``ext``: each request's slots in ``o`` (not read since
        the page delta keeps one entry per page; kept for the callers)."""
        ps, shift = self._w_ps, self._w_shift
        n = o.size
        if not n or o.dtype is not _I64:
            return False
        pages = o[::ps] >> shift  # one per run (a negative slot floors to a negative page: reserved below)
        # Each run's expected slots: its page's first slot + the offsets. One bytes compare checks alignment and
        # that no run leaves its page.
        expected = (pages << shift)[:, None] + shadow.offsets
        if o.tobytes() != expected.tobytes()[: o.nbytes]:
            return False
        # A page outside the pool reads as reserved (the clipped gather, see PoolShadow): not free.
        prev = shadow._owner_ext.take(pages, mode="clip")
        if _MAX.reduce(prev) > FREE:
            return False
        # One page opened twice in this call (the inner listed it twice), for two requests or for one: declined,
        # the owners as they were; the per-slot check reports it (PoolShadow.shared_in_call, with one page per run
        # here). Found by writing each run's id at its page and reading them back (the later run's id wins): a
        # scatter and a gather, where a sort of the pages would cost several times more at a batch's size.
        if n_new > 1:
            if pages.size != n_new:
                return False
            ids = entry_ids(n_new)
            owner = shadow.owner
            owner[pages] = ids
            if owner[pages].tobytes() != ids.tobytes():
                owner[pages] = prev
                return False
        if slots is None:
            own = -1
        elif slots.size == 1:
            own = slots.item(0)  # one request owns every page
        else:
            own = slots.astype(np.int32).repeat(grow)  # the owner codes' dtype: no cast below, a private delta
        shadow.owner[pages] = own
        shadow.version += 1  # the owners changed (see PoolShadow.version: a decode run must not outlive this)
        if shadow.deltas is not None:
            # What on_alloc records for such a call (runs: one entry per page, see PoolShadow._note_alloc); pages:
            # a shift computed here, held by no one else.
            shadow.note(pages, own, private=True)
        shadow.expected_entries -= n_new
        return True

    def _alloc_fast(self, st: _CallState, out, n: int, bound, dt: float) -> bool:
        """``alloc(n)`` at page size 1 on one pool, verified immediately, bound to requests (SGLang's decode and
        extend there), for the case where every check passes: every slot in range and free, and no slot handed to
        two requests (the owners read back, undone before declining). Then it applies what
        the general path applies (the requests' shares as in ``_alloc_owners``, their ledger rows, the shadow,
        the free count, the events in the same order) and returns True. Otherwise it returns False having changed
        nothing, and the general path checks the call and reports it. ``st``: the wrapper's ``_CallState``."""
        o = out.numpy()
        if o.dtype is not _I64:
            return False
        rids, slots, lens = bound[0], bound[1], bound[2]
        # Owner codes as int32 (the shadow's dtype): written and read back without a cast.
        own32 = bound[3]
        if own32 is None:
            own32 = bound[3] = slots.astype(np.int32)
            own32.setflags(write=False)  # shared by this block's page deltas (see _bind)
        if lens is not None:
            shares, own = lens, own32.repeat(lens)
        elif len(rids) == 1:
            shares, own = n, np.full(n, slots[0], np.int32)
        elif len(rids) == n:
            shares, own = 1, own32  # a decode: one slot each
        else:
            return False
        shadow = st.full.shadow
        # A slot outside the pool reads as reserved (the clipped gather, see PoolShadow): not free.
        prev = shadow._owner_ext.take(o, mode="clip")
        if np.count_nonzero(prev > FREE):
            return False  # handed out twice, reserved, or outside the pool: the general path reports it
        if shadow.relisted and n > 1 and has_repeat(o):
            return False  # one slot twice in this call, after a double free relisted it: the general path reports it
        shadow.owner[o] = own
        if n > 1 and len(rids) > 1 and shadow.owner[o].tobytes() != own.tobytes():
            # One slot handed to two requests in this call (the later write wins): undone, and declined; the
            # general path reports it (PoolShadow.shared_in_call).
            shadow.owner[o] = prev
            return False
        led = st.ledger
        _count_decodes(led, slots, shares)
        for arr in led.owned.values():
            arr[slots] += shares
        led.allocated[slots] += shares
        led.committed[slots] += shares
        self._emit_ledger("alloc", slots, rids, private=True)  # the binding's (read-only)
        shadow.version += 1  # owner written above (see PoolShadow.version)
        if shadow.deltas is not None:
            shadow.note(o, own)
        shadow.expected_entries -= n
        if st.bus.active:
            self._emit_alloc("alloc", n, n, dt)
            self._finish()
        return True

    def _decode_consts(self, bs: int) -> tuple:
        """Per-batch-size operands of the decode fast path (arrays: numpy's array-scalar ops cost more)."""
        consts = self._w_consts
        c = consts.get(bs)
        if c is None:
            if len(consts) > 64:
                consts.clear()
            ps = self._w_ps
            c = (
                np.full(bs, ps - 1, np.int64),  # offset in a page
                np.full(bs, (ps - 1) - 2**63, np.int64),  # the same plus the sign bit: a negative slot never matches
                np.ones(bs, np.int64),
                np.full(bs, self._w_shift, np.int64),
                np.full(bs, -1, np.int32),  # owner code of an unattributed slot
                np.zeros(bs, np.int64),
                np.full(bs, FREE, np.int32),
            )
            consts[bs] = c
        return c

    def _decode_fast(self, st: _CallState, o: np.ndarray, seq: np.ndarray, slots, bound, bs: int):
        """Immediate verification of a decode with a power-of-two page size > 1, for the case where every check
        passes: each slot (and on an SWA allocator its SWA peer, read from the mapping after the call) sits at its
        position's offset in its page; a request that opens a page got one that was free, and no other request of
        the call got the same one (``PoolShadow.shared_in_call``'s rule, applied before anything is written: the
        owners read back, or a duplicate test when unattributed), every other continues in a page it owns.
        Then it applies what the general path applies (ledger lengths and page counts, the shadows,
        the free counts) and returns the number of pages opened.
        Anything else (a fault, other dtypes) returns None having changed nothing: the general path then checks
        the call again and reports it. Whole-array compares go through ``tobytes`` (a memcmp): a tenth of the cost
        of a numpy reduction at this size. ``st``: the wrapper's ``_CallState`` (every read from it)."""
        st.roll = None  # reached when the roll is absent or does not vouch for this call: it is spent
        swa = st.swa
        shadow = st.full.shadow
        if swa is None:
            # How many calls here in a row had this batch with nothing else changing the pages' owners in
            # between: what a roll would have lasted (it is built after _ROLL_AFTER, see below; never on SWA
            # allocators). Updated on the way out of a verified call.
            key = bs if slots is None else slots.tobytes()
            last = st.roll_key
            streak = last[2] + 1 if last is not None and last[1] == shadow.version and last[0] == key else 1
        if o.dtype is not _I64 or seq.dtype is not _I64:
            return None
        mask, smask, _one, shift, unowned, zero, free = st.consts.get(bs) or self._decode_consts(bs)
        # The offset in its page of the position each new slot holds ((seq - 1) & mask, as seq + mask: -1 and
        # mask agree modulo ps); 0: the request opens a page. seq + mask is an opener's allocated length too.
        seq_m = seq + mask
        at = seq_m & mask
        at_b = at.tobytes()
        if (o & smask).tobytes() != at_b:
            return None  # slot_page_alignment, or a negative slot
        pages = o >> shift
        try:
            prev = shadow.owner[pages]
        except IndexError:
            return None  # a page past the end
        if swa is not None:
            # The SWA peers: the same offsets, the same owners (the slot check above bounds o by the mapping).
            peers = st.inner.full_to_swa_index_mapping.numpy()[o]
            if (peers & smask).tobytes() != at_b:
                return None
            swa_pages = peers >> shift
            swa_shadow = swa.shadow
            try:
                swa_prev = swa_shadow.owner[swa_pages]
            except IndexError:
                return None
        n_new = bs - np.count_nonzero(at)
        if slots is None:
            own = unowned  # owner codes (int32) of the pages, as they must read
        else:
            own = bound[3]
            if own is None:
                own = bound[3] = slots.astype(np.int32)
                own.setflags(write=False)  # shared by this block's page deltas (see _bind)
        if n_new == 0:
            own_b = own.tobytes()
            if prev.tobytes() != own_b or (swa is not None and swa_prev.tobytes() != own_b):
                return None  # a page owned by another request, free, or reserved
            if slots is not None:
                st.ledger.committed[slots] = seq
                if not st.track_lengths:
                    st.ledger.allocated[slots] = seq  # tokens: the engine's next write (see _extend)
            # The pages already read as own (just compared): no write, and no page delta (see PageUpdate).
            if swa is None:
                st.roll_key = (key, shadow.version, streak)
                a = at.item(0) if bs else 0
                rows = st.ps - 1 - a
                if bs and rows and not np.count_nonzero(at != a):
                    # A batch in step mid-page (every request at offset a; reached when no run vouched for the
                    # call: the prefix cache's transfers or a release spent it): its next decodes up to the pages'
                    # end are a run of their own, as after an opening call (see _DecodeRun).
                    st.run = _run_after(shadow, st.ledger, slots, o, seq, st.steps[:rows])
            return 0
        # Openers must find their page free (code <= FREE: clipped up to FREE, it reads FREE), the others their
        # own page (codes >= -1, which the clip leaves alone).
        if n_new == bs:
            opens = None  # every request opens a page (a batch in step, a single request): no masks
            expect_b = free.tobytes()
        else:
            opens = at == zero
            expect = own.copy()
            expect[opens] = FREE
            expect_b = expect.tobytes()
        if np.maximum(prev, free).tobytes() != expect_b or (
            swa is not None and np.maximum(swa_prev, free).tobytes() != expect_b
        ):
            return None
        # One page opened by two requests (the inner listed it twice): decline before anything is written, the
        # general path reports it (PoolShadow.shared_in_call). Attributed: the owners written read back as own
        # (the later write wins; undone at once when not); unattributed: a duplicate test on the opened pages.
        if n_new > 1:
            if slots is None:
                if has_repeat(pages if opens is None else pages[opens]) or (
                    swa is not None and has_repeat(swa_pages if opens is None else swa_pages[opens])
                ):
                    return None
            else:
                own_b = own.tobytes()
                owner = shadow.owner
                owner[pages] = own
                if owner[pages].tobytes() != own_b:
                    owner[pages] = prev
                    return None
                if swa is not None:
                    swa_owner = swa_shadow.owner
                    swa_owner[swa_pages] = own
                    if swa_owner[swa_pages].tobytes() != own_b:
                        swa_owner[swa_pages] = swa_prev
                        owner[pages] = prev
                        return None
        # pages and swa_pages: shifts computed here, held by no one else; own: read-only (see _bind) or the shared
        # unattributed constant (not private: copied). With non-openers, the page deltas keep the openers' entries
        # alone (boolean gathers: fresh): every other page read own already (see PageUpdate).
        private = slots is not None
        written = n_new > 1 and slots is not None  # the owners are in place (the read-back above)
        if swa is not None:
            if not written:
                swa_shadow.owner[swa_pages] = own
            swa_shadow.version += 1
            if swa_shadow.deltas is not None:
                if opens is None:
                    swa_shadow.note(swa_pages, own, private=private)
                else:
                    swa_shadow.note(swa_pages[opens], own[opens], private=True)
            swa_shadow.expected_entries -= n_new
        if slots is not None:
            led = st.ledger
            led.committed[slots] = seq
            openers = slots if opens is None else slots[opens]
            for arr in led.owned.values():
                arr[openers] += 1
            # An opener's position is a page's first (seq = k * ps + 1): it now holds ceil(seq / ps) * ps slots.
            led.allocated[openers] = seq_m if opens is None else seq_m[opens]
            if not st.track_lengths:
                led.allocated[slots] = seq  # tokens: the engine's next write (see _extend)
        if not written:
            shadow.owner[pages] = own
        shadow.version += 1
        if shadow.deltas is not None:
            if opens is None:
                shadow.note(pages, own, private=private)
            else:
                shadow.note(pages[opens], own[opens], private=True)
        shadow.expected_entries -= n_new
        if swa is not None:
            return n_new  # no cache on SWA allocators (see _DecodeRun)
        st.roll_key = (key, shadow.version, streak)
        # A roll is built once the batch has stayed (and nothing else changed the pages) for _ROLL_AFTER calls
        # here: building one costs many decodes' checks, which a batch that changes every few decodes (requests
        # joining and finishing, other requests' allocations in between) would pay again and again.
        if opens is not None and streak < _ROLL_AFTER:
            return n_new
        if opens is None:
            # A batch in step: each request now sits at offset 0 of a fresh page (see _DecodeRun). Two array
            # additions (the next ps - 1 calls' arguments) here, where the call opened a page for every request;
            # nothing on other calls.
            st.run = _run_after(shadow, st.ledger, slots, o, seq, st.steps)
        else:
            # Requests that open their pages at different decodes (see _DecodeRoll): the following decodes of the
            # same batch are verified against what this one established. o: the caller's, copied.
            st.run = None
            st.roll = _DecodeRoll(shadow, st.ledger, slots, own, o.copy(), seq, self._w_roll_steps)
        return n_new

    def _decode_roll(self, st: _CallState, roll: _DecodeRoll, o: np.ndarray, seq: np.ndarray, slots, bs: int):
        """The decode fast path on a batch the roll vouches for (see ``_DecodeRoll``): the number of pages opened,
        having applied what ``_decode_fast`` applies to the call (ledger lengths and page counts, the shadow, the
        free count, the same page delta), or None having changed nothing (``_decode_fast`` then judges the call
        and drops the roll). ``st``: the wrapper's ``_CallState``."""
        end = roll.end
        row = roll.row
        if (
            seq.tobytes() != roll.seq_rows[end - row : end]
            or o.dtype is not _I64
            or seq.dtype is not _I64
            or roll.shadow is not st.full.shadow
            or roll.version != roll.shadow.version
            or roll.ledger_version != st.ledger.version
            or not (slots is roll.slots or (slots is not None and roll.slots_b == slots.tobytes()))
        ):
            return None
        k = roll.k
        # Every slot less the last one, masked by the row's keep, reads 1 (see _DecodeRoll; wrapping int64
        # arithmetic: a difference whose 64 bits read 1 is o == last + 1).
        d = o - roll.last
        d &= roll.keep[k]
        if d.tobytes() != roll.ones_b:
            return None
        a, b = roll.cuts[k], roll.cuts[k + 1]
        n_new = b - a
        shadow = roll.shadow
        if n_new:
            shift, free = (st.consts.get(n_new) or self._decode_consts(n_new))[3::3]
            pages = o[roll.c[a:b]] >> shift
            # A page outside the pool (or a negative slot's) reads as reserved (the clipped gather, see
            # PoolShadow): not free.
            prev = shadow._owner_ext.take(pages, mode="clip")
            if np.maximum(prev, free).tobytes() != free.tobytes():
                return None  # a page in use or reserved
            # One page opened by two requests (the inner listed it twice): declined before anything else is
            # written, as _decode_fast does (the owners read back, undone at once; unattributed: a duplicate test).
            own_next = roll.own_next[a:b]
            if n_new > 1:
                if slots is None:
                    if has_repeat(pages):
                        return None
                else:
                    owner = shadow.owner
                    owner[pages] = own_next
                    if owner[pages].tobytes() != own_next.tobytes():
                        owner[pages] = prev
                        return None
            if slots is not None:
                led = st.ledger
                led.committed[slots] = seq
                openers = roll.slots_next[a:b]
                owned = led.owned
                for name, vals in roll.owned_next:
                    owned[name][openers] = vals[a:b]
                led.allocated[openers] = roll.alloc_next[a:b]
                if not st.track_lengths:
                    led.allocated[slots] = seq  # tokens: the engine's next write (see _extend)
            # Only the openers' pages change: every other page of the batch reads own already (the invariant).
            if n_new < 2 or slots is None:
                shadow.owner[pages] = own_next
            shadow.version += 1
            if shadow.deltas is not None:
                # The delta the general fast path records: the openers' pages (a shift computed here) and owners
                # (a slice of the roll's read-only own_next, int32), in batch order.
                shadow.note(pages, own_next, private=True)
            shadow.expected_entries -= n_new
        elif slots is not None:
            st.ledger.committed[slots] = seq
            if not st.track_lengths:
                st.ledger.allocated[slots] = seq  # tokens: the engine's next write (see _extend)
        roll.last = o.copy()  # the caller's: copied
        roll.version = shadow.version
        if k + 1 < len(roll.keep):
            roll.k = k + 1
            roll.end = end + row
        else:
            roll.next_cycle()
        return n_new

    # -- free ops ---------------------------------------------------------------------------------------------
    def free(self, free_index):
        return self._free_call("free", free_index, _ABSENT, "_free_parts")

    def free_full(self, free_index):
        return self._free_call("free_full", free_index, _ABSENT, "_free_full_parts")

    def free_page_ids(self, page_ids):
        return self._free_call("free_page_ids", page_ids, _ABSENT, "_page_ids_parts", arg="page_ids")

    def free_segment(self, free_index, *, start_pos):
        return self._free_call("free_segment", free_index, start_pos, "_segment_parts")

    def free_full_segment(self, free_index, *, start_pos):
        return self._free_call("free_full_segment", free_index, start_pos, "_full_segment_parts")

    def free_swa(self, free_index):
        return self._free_call("free_swa", free_index, _ABSENT, "_swa_parts")

    def free_swa_segment(self, free_index, *, start_pos):
        return self._free_call("free_swa_segment", free_index, start_pos, "_swa_segment_parts")

    @_charged
    def _free_call(self, op: str, index, start_pos, parts_of: str, *, arg: str = "free_index"):
        """Every free op: validate, then forward an empty free untouched, or check and mirror it (``_free``).
        ``parts_of``: the name of the method whose ``(index, op)`` lists what the op frees per pool; None when
        this allocator has nothing to check for it (an SWA op on a single pool). A name, looked up only when the
        fast path declines: a bound method per call costs a slow lookup on the wrapper (see _CallState)."""
        st = self._w_st  # every read below from it (see _CallState)
        with st.lock:
            st.op = op
            # The usual call (a 1-D int64 host tensor, for an allocator on the host; an aligned int start) is
            # accepted inline; anything else goes through the full argument checks, which name the fault.
            if not (
                type(index) is torch.Tensor
                and index.dtype is _TORCH_I64
                and st.host
                and index.is_cpu
                and index.dim() == 1
                and (start_pos is _ABSENT or (type(start_pos) is int and start_pos >= 0 and not start_pos % st.ps))
            ):
                if start_pos is _ABSENT:
                    self._validate(op, check_index_tensor, arg, index, st.device)
                else:
                    self._segment_args(op, index, start_pos)
            if st.fast_free and index.numel():
                result = self._free_fast(st, op, index, start_pos)
                if result is not _ABSENT:
                    return result
            forward = _inner_call(st.cost, getattr(st.inner, op), index, start_pos)
            if index.numel() == 0:
                return forward()
            parts = getattr(self, parts_of)(index, op)
            if parts is None:
                return forward()
            return self._free(op, forward, parts)

    def _free_fast(self, st: _CallState, op: str, index, start_pos):
        """Immediate verification of the usual free (power-of-two page size > 1, int64 host indices, not empty), for
        the case where every check passes: every page it releases, in each pool, is in use by one and the same
        request; no page repeats where the inner does not dedup; on an SWA allocator the SWA peers of a segment
        are all mapped (``free_swa_segment``, ``free_segment``) and a full free finds none still mapped
        (``free_full``, ``free_full_segment``). Then it forwards and mirrors what the general path mirrors and
        returns the inner's result: a free of one pool (every op but an SWA ``free_segment``) inline, the
        shadow's one-owner mirror (``PoolShadow.free_owned``) then the ledger and events as ``_after_free_one``
        makes them, with the general path's failure handling (an inner that raises after changing that pool's
        free list is mirrored first, through the general plans); two pools through ``_forward_free`` with those
        plans.
        Anything else (a fault, another op, another dtype) returns ``_ABSENT`` having changed nothing: the
        general path then checks the call and reports it. A segment's unmapped SWA peer (0, or the -1 sentinel)
        reads as page 0, reserved for good, which the owner test declines.

        The pages per pool are the general path's parts computed directly (``_full_set_part``,
        ``_full_segment_part``, ``_swa_segment_part``, ``_peer_released_check``), without their closures.
        ``st``: the wrapper's ``_CallState`` (every read from it)."""
        idx = index.numpy()
        if idx.dtype is not _I64:
            return _ABSENT
        ps, shift = st.ps, st.shift
        full, swa = st.full, st.swa
        if swa is None:
            if op == "free_segment":
                parts = ((full, idx[::ps] >> shift, False),)
            elif op == "free" or op == "free_full":
                parts = ((full, idx, True),)  # set-shaped on a single pool (slots: pages below)
            elif op == "free_full_segment":
                # A per-request SWA ring frees the segment's pages by id (see _full_segment_parts); a single
                # pool's is set-shaped.
                parts = ((full, idx[::ps] >> shift, False) if st.swa_frees == "none" else (full, idx, True),)
            else:
                return _ABSENT
        elif op == "free_swa_segment" or op == "free_segment":
            reps = idx[::ps]
            # A slot outside the mapping reads a clamped entry, as in _peers_at. An unmapped peer (0, or the -1
            # sentinel) names page 0 (or a negative page, read as page 0), reserved for good: the owner test below
            # declines it, and the general path reports it (swa_mapping_inconsistent).
            peers = st.inner.full_to_swa_index_mapping.numpy().take(reps, mode="clip")
            if op == "free_segment":
                parts = ((swa, peers >> shift, False), (full, reps >> shift, False))
            else:
                parts = ((swa, peers >> shift, False),)
        elif op == "free_full" or op == "free_full_segment":
            peers = st.inner.full_to_swa_index_mapping.numpy().take(idx, mode="clip")
            if _MAX.reduce(peers) > 0:
                return _ABSENT  # a live SWA peer: the general path reports it
            parts = ((full, idx, True) if op == "free_full" else (full, idx[::ps] >> shift, False),)
        else:
            return _ABSENT
        plans = []
        for pool, pages, dedup in parts:
            if dedup:
                pages = _distinct_pages(pages, ps, shift, pool.shadow.offsets)  # slots -> their distinct pages
            # One clipped gather (a page outside the pool reads as reserved) and one memcmp: every page owned by
            # the first page's owner, a request (>= 0). That is plan_free's usual case with the owner known.
            prev = pool.shadow._owner_ext.take(pages, mode="clip")
            if prev.item(0) < 0 or prev.tobytes() != prev[:1].tobytes() * prev.size:
                return _ABSENT
            if not dedup and has_repeat(pages):
                return _ABSENT
            plans.append((pool, (pages, pages, prev, int(pages.size), dedup)))
        method = getattr(st.inner, op)
        if len(plans) != 1:
            return self._forward_free(op, _inner_call(st.cost, method, index, start_pos), plans, st)
        # One pool: _forward_free and _apply_frees inlined, the mirror without apply_free's owner tests (done above).
        pool, plan = plans[0]
        # The free list this free releases into: the only one the mirror below changes, so the only count to
        # compare if the inner raises (one call, where _forward_free reads every pool's).
        available = None if st.atomic_free else pool.probe
        before = None if available is None else available()
        timed = st.want_free  # the duration is only read by the Free events
        clock = st.clock
        t0 = clock() if timed else 0.0
        st.cost.stop_checks()
        try:
            result = method(index) if start_pos is _ABSENT else method(index, start_pos=start_pos)
        except BaseException:
            st.cost.start()
            if available is not None and before != available():
                self._apply_frees(op, plans, clock() - t0 if timed else 0.0, st)
                self._deliver()
            raise
        st.cost.start()
        dt = clock() - t0 if timed else 0.0  # the inner call's alone, as the general path's Free events
        pages, _, prev, n, dedup = plan
        s = prev.item(0)
        pool.shadow.free_owned(pages, s, n, dedup)
        # _after_free_one, inlined.
        led = st.ledger
        # A request inserting into the cache frees copies the cache holds: its lengths stay (KvLedger.inserting).
        track = st.track_lengths and not (led.inserting and s in led.inserting)
        if pool is full and track:
            # The request's allocated length follows its full-pool pages when they shrink (after its protected prefix).
            led.shrink_one(s, led.owned["full"].item(s) * ps + led.protected.item(s))
        rids = None
        if timed:
            rids = (led.rid_of(s),)
            st.seq = seq = st.seq + 1
            st.events.append(_B_FREE(seq, clock(), st.step, op, pool.name, n, rids, dt))
        for arr in led.owned.values():
            if arr.item(s) > 0:
                break
        else:
            if track:  # else the engine's lengths: a request with no page left keeps them
                led.keep(s)
                led.reset(s)
                led.tainted.discard(s)
        led.dirty.add(s)
        # A released request's slot has no row to update, nor has the prefix cache's.
        if st.want_ledger and led.live.item(s) and s != led.cache:
            # prev[:1]: a view of a gather made for this free alone, never written.
            self._emit_ledger(op, prev[:1], rids or (led.rid_of(s),), private=True)
        if st.bus.active or st.to_raise or st.events:
            self._finish()
        return result

    def _free_parts(self, free_index, op):
        st = self._w_st
        if st.swa is not None:
            return self._swa_set_part(free_index) + self._full_set_part(free_index)
        if st.swa_frees == "pool":
            return self._one_pool_part(free_index, op)
        return self._full_set_part(free_index)

    def _free_full_parts(self, free_index, op):
        if self._w_st.swa_frees == "pool":
            return None  # one pool for both sides: its SWA frees released it, free_full is a no-op
        parts = self._full_set_part(free_index)
        return parts if self._w_st.swa is None else [self._peer_released_check(free_index, op), *parts]

    def _page_ids_parts(self, page_ids, op):
        return [(self._w_st.full, lambda p: (p, False, None), (page_ids,))]

    def _segment_parts(self, free_index, op):
        if self._w_st.swa_frees == "pool":
            return self._one_pool_part(free_index, op)
        parts = [self._full_segment_part(free_index)]
        return parts if self._w_st.swa is None else [self._swa_segment_part(free_index, op), *parts]

    def _full_segment_parts(self, free_index, op):
        if self._w_st.swa_frees == "pool":
            return None  # see _free_full_parts
        if self._w_st.swa is None and self._w_st.swa_frees != "none":
            # A single pool's free_full_segment is a set-shaped free (base class: free_full -> free).
            return self._full_set_part(free_index)
        # The two-pool SWA allocator and a per-request SWA ring (its mapping is never written, so no peer to
        # check) free the segment through the full allocator's free_segment: one page per page_size slots, by
        # id, no dedup (a page named twice is listed twice).
        part = self._full_segment_part(free_index)
        return [part] if self._w_st.swa is None else [self._peer_released_check(free_index, op), part]

    def _swa_parts(self, free_index, op):
        if self._w_st.swa is None:
            return self._one_pool_swa_free(free_index, op)
        return [*self._swa_set_part(free_index), self._full_range_check(free_index, op)]

    def _full_range_check(self, free_index, op):
        """``free_swa`` names full-pool slots only to look up their SWA peers: a slot outside the full pool reads
        as no peer there (the clipped lookup), while the inner indexes its mapping with it (a negative slot wraps
        around to a live request's peer). Reported as ``free_unallocated`` (raise mode refuses host indices
        before the call, as for any free)."""
        full = self._w_st.full.shadow
        ps = self._w_ps

        def check(idx):
            pages = idx // ps  # floor: a negative slot's page is negative
            oob = pages[(pages < 0) | (pages > full.num_pages)]
            if oob.size:
                self._violate(
                    "free_unallocated",
                    f"{op} frees slots outside the full pool (valid pages 1..{full.num_pages}): "
                    f"{idx[(pages < 0) | (pages > full.num_pages)][:8].tolist()} ({oob.size} slots)",
                    op=op,
                    pool="full",
                )

        return (None, check, (free_index,))

    def _swa_segment_parts(self, free_index, op):
        if self._w_st.swa is None:
            return self._one_pool_swa_free(free_index, op)
        return [self._swa_segment_part(free_index, op)]

    def _one_pool_swa_free(self, free_index, op):
        """An SWA free on an allocator with no SWA pool of its own: SGLang's all-SWA allocator releases its one
        pool (``_one_pool_part``); a per-request SWA ring, or an allocator with no SWA side, frees nothing
        (None: forwarded unchecked)."""
        return self._one_pool_part(free_index, op) if self._w_st.swa_frees == "pool" else None

    def _one_pool_part(self, free_index, op) -> list:
        """A free of SGLang's all-SWA allocator (``free``, ``free_segment``, ``free_swa``, ``free_swa_segment``):
        it releases ``free_index[free_index > 0]`` into its one token pool (set-shaped, no dedup at page size 1),
        at once or at the end of its free group. The entries it drops (slot 0, negative slots) are misuse,
        reported here (``reserved_page_touched``, ``free_unallocated``; raise mode refuses host indices before
        the call), and neither judged again nor counted as freed: the inner lists none of them."""
        pool = self._w_st.full
        num_pages = pool.shadow.num_pages

        def fn(idx):
            keep = idx > 0
            if keep.all():
                return idx, False, None
            dropped = idx[~keep]
            if (dropped == 0).any():
                self._violate("reserved_page_touched", f"{op} frees reserved slot 0", op=op, pool=pool.name)
            neg = dropped[dropped < 0]
            if neg.size:
                self._violate(
                    "free_unallocated",
                    f"{op} frees slots outside the pool (valid 1..{num_pages}): {neg[:8].tolist()} "
                    f"({neg.size} slots; the allocator drops them)",
                    op=op,
                    pool=pool.name,
                )
            return idx[keep], False, None

        return [(pool, fn, (free_index,))]

    def free_segments(self, segments):
        """SGLang's batched row free: each segment goes through the instrumented ``free_segment`` (the inner's
        own loop would call its own ``free_segment`` and bypass the checks). Malformed segments are rejected
        before any is freed."""
        for free_index, start_pos in page_disjoint(self._checked_segments("free_segments", segments), self._w_ps):
            self.free_segment(free_index, start_pos=start_pos)

    def free_full_segments(self, segments):
        for free_index, start_pos in page_disjoint(self._checked_segments("free_full_segments", segments), self._w_ps):
            self.free_full_segment(free_index, start_pos=start_pos)

    def _checked_segments(self, op: str, segments) -> list:
        with self._w_lock:
            self._w_st.op = op
            return self._validate(op, check_segments, "segments", segments, self._w_device)

    @_charged
    def resize(self, config):
        """Forwarded, then every pool's shadow is rebuilt for the new size (the inner clears itself)."""
        inner = self._w_inner
        with self._w_lock:
            self._w_st.op = "resize"
            self._drain(wait=True)
            self._w_st.cost.stop_checks()
            try:
                result = inner.resize(config)
            finally:
                self._w_st.cost.start()
            led = self._w_st.ledger
            need_sort = self._w_need_sort
            pools = {n: _make_pool(n, p.allocator, led, need_sort) for n, p in self._w_st.pools.items()}
            object.__setattr__(self, "_w_pools", pools)
            object.__setattr__(self, "_w_full", pools["full"])
            object.__setattr__(self, "_w_swa", pools.get("swa"))
            self._set_counts()
            self._sync_deltas()
            self._cleared()
            self._finish()
            return result

    def free_group_begin(self):
        return self._forward_then_mirror("free_group_begin", self._group_begin)

    def free_group_end(self):
        return self._forward_then_mirror("free_group_end", self._group_end)

    def merge_and_sort_free(self):
        return self._forward_then_mirror("merge_and_sort_free", self._merged)

    @_charged
    def _forward_then_mirror(self, name: str, mirror: Callable):
        """Argument-free state transitions: forward, then mirror them in the shadow in call order. A
        ``free_group_end`` that raises (SGLang's post-condition asserts fire inside its free of the held pages) is
        mirrored as far as the inner got: ``_group_end_failed``."""
        st = self._w_st
        with st.lock:
            st.op = name
            pools = st.pools.values()
            ending = name == "free_group_end"
            # The free counts before the call, to tell which pools a raising free_group_end changed: only when
            # the group may hold some free (an engine opens and ends a group every iteration, most of them empty;
            # deferred verification mirrors the frees later, so its shadow cannot say).
            held = ending and (st.deferred or any(p.shadow.held_set or p.shadow.held_ids for p in pools))
            before = [p.entries() for p in pools] if held else None
            st.cost.stop_checks()
            try:
                result = getattr(st.inner, name)()
            except BaseException:
                st.cost.start()
                if ending:
                    changed = () if before is None else (p.name for p, b in zip(pools, before) if b != p.entries())
                    self._group_end_failed(st, frozenset(changed))
                raise
            st.cost.start()
            if st.deferred:
                self._slot_tier(mirror)  # behind the queued checks
            else:
                mirror()  # what _slot_tier does at once in immediate mode
            if st.events or st.to_raise or st.want_pages:
                self._finish()
            return result

    @_charged
    def clear(self):
        inner = self._w_inner
        with self._w_lock:
            self._w_st.op = "clear"
            # Rare and never on the hot path: finish the queued checks first, so that nothing queued before the
            # clear lands after it (the host-side page counts are reset now, with the shadow).
            self._drain(wait=True)
            self._w_st.cost.stop_checks()
            try:
                result = inner.clear()
            finally:
                self._w_st.cost.start()
            self._cleared()
            self._finish()
            return result

    # -- free parts: (pool, fn(arrays) -> (pages, dedup, unmapped_mask), tensors) ---------------------------------
    # Page ids from slots: a shift when the page size is a power of two (it floors negatives as // does, and
    # costs less than a division).
    def _full_set_part(self, free_index) -> list:
        return [self._set_part(self._w_st.full, free_index)]

    def _full_segment_part(self, free_index):
        return self._segment_part(self._w_st.full, free_index)

    def _set_part(self, pool: _Pool, free_index):
        """The part of a set-shaped free of ``pool`` by its own slots (every distinct page touched)."""
        ps, shift = self._w_ps, self._w_shift
        if pool.dedup_free:
            if shift is not None:
                return (pool, lambda idx: (idx >> shift, True, None), (free_index,))
            return (pool, lambda idx: (idx // ps, True, None), (free_index,))
        return (pool, lambda idx: (idx, False, None), (free_index,))

    def _segment_part(self, pool: _Pool, free_index):
        """The part of a row-segment free of ``pool`` by its own slots (one page per ``page_size`` slots)."""
        ps, shift = self._w_ps, self._w_shift
        if pool.dedup_free:
            if shift is not None:
                return (pool, lambda idx: (idx[::ps] >> shift, False, None), (free_index,))
            return (pool, lambda idx: (idx[::ps] // ps, False, None), (free_index,))
        return (pool, lambda idx: (idx, False, None), (free_index,))

    def _peers_at(self, full_slots):
        """SWA peers of freed full slots, read before the inner clears them. Slot values outside the mapping (a
        free_unallocated fault the full part reports) read as no live peer (0 or the -1 sentinel) instead of
        failing the lookup. No sync: immediate mode (host tensors only) gathers from a numpy view of the
        mapping (``take(mode="clip")`` is the clamp), deferred mode with device ops. ``full_slots`` is a
        tensor, or in immediate mode its numpy view."""
        mapping = self._w_inner.full_to_swa_index_mapping
        if not self._w_deferred:
            idx = full_slots if type(full_slots) is np.ndarray else full_slots.numpy()
            return mapping.numpy().take(idx, mode="clip")
        return mapping[full_slots.to(torch.int64).clamp(0, mapping.shape[0] - 1)]

    def _swa_set_part(self, free_index) -> list:
        swa = self._w_st.swa
        ps = self._w_ps
        if not self._w_deferred:
            idx = free_index.numpy().astype(np.int64, copy=False)
            if ps > 1:
                idx = ((idx // ps * ps)[:, None] + np.arange(ps, dtype=np.int64)).reshape(-1)
        else:
            idx = free_index.to(torch.int64)
            if ps > 1:
                idx = ((idx // ps * ps)[:, None] + torch.arange(ps, dtype=torch.int64, device=idx.device)).reshape(-1)
        peers = self._peers_at(idx)
        if ps == 1:
            return [(swa, lambda p: self._peers_mapped(p, "free_swa"), (peers,))]
        return [(swa, lambda p: (p[p > 0] // ps, True, None), (peers,))]

    def _swa_segment_part(self, free_index, op):
        swa = self._w_st.swa
        ps = self._w_ps
        reps = free_index.numpy()[::ps] if not self._w_deferred else free_index[::ps]
        peers = self._peers_at(reps)
        return (swa, lambda p: self._peers_mapped(p, op), (peers,))

    def _peers_mapped(self, peers: np.ndarray, op: str):
        """SWA peers of page representatives must be mapped (> 0) when their SWA KV is freed."""
        ps = self._w_ps
        unmapped = peers <= 0
        if np.count_nonzero(unmapped):
            self._violate(
                "swa_mapping_inconsistent",
                f"{op}: {int(np.count_nonzero(unmapped))} of {peers.size} full pages have no live SWA peer "
                "(already evicted or never mapped); the SWA allocator will release page 0 for them",
                op=op,
                pool="swa",
            )
            return peers // ps, False, unmapped
        shift = self._w_shift
        return (peers >> shift if shift is not None else peers // ps), False, None

    def _peer_released_check(self, free_index, op):
        peers = self._peers_at(free_index)
        full = self._w_st.full.shadow
        ps = self._w_ps

        def check(p, idx):
            still = p > 0
            if np.count_nonzero(still):
                pages = idx[still] // ps
                owners = full.owner[pages[(pages >= 0) & (pages < full.owner.size)]]
                slot = int(owners[owners >= 0][0]) if (owners >= 0).any() else -1
                self._violate(
                    "swa_mapping_inconsistent",
                    f"{op}: {int(np.count_nonzero(still))} of {p.size} slots still map to a live SWA peer; free_swa "
                    "must come first (their SWA pages are stranded)",
                    slot=slot,
                    op=op,
                    pool="swa",
                )

        return (None, check, (peers, free_index))

    def _segment_args(self, op, free_index, start_pos, pool: str = "full") -> None:
        self._validate(op, check_index_tensor, "free_index", free_index, self._w_device)
        start = self._validate(op, check_int, "start_pos", start_pos)
        if start % self._w_ps:
            self._violate(
                "segment_start_unaligned",
                f"{op}: start_pos={start} is not a multiple of page_size={self._w_ps}",
                slot=self._segment_owner(free_index, pool),
                op=op,
                pool=pool,
            )
            self._finish()

    def _segment_owner(self, free_index, pool: str = "full") -> int:
        """The ledger slot owning the segment's first page, to name the request; -1 when unknown. Reads an index
        value, so only under immediate verification: on an accelerator that would be a sync, and the request stays
        unnamed; ``verify="deferred"`` on the host does as it does there (its shadow is a step behind, too)."""
        if self._w_st.deferred or free_index.device.type != "cpu" or free_index.numel() == 0:
            return -1
        page = int(free_index[0]) // self._w_ps
        owner = self._w_st.pools[pool].shadow.owner
        return int(owner[page]) if 0 <= page < owner.size else -1

    def _free(self, op: str, forward: Callable, parts: list):
        """Check (pre-call when the indices are on the host), forward, mirror. See the module contract."""
        self._w_st.op = op
        if not self._w_deferred:
            return self._free_now(op, forward, parts)
        timing = [0.0]  # wall time of the inner call alone, for the Free events

        def plan_all(arrays_per_part):
            plans = []
            for (pool, fn, _), arrays in zip(parts, arrays_per_part):
                r = fn(*arrays)
                if pool is None or r is None:
                    continue
                pages, dedup, unmapped = r
                bad, plan = pool.shadow.plan_free(pages, dedup=dedup, op=op, unmapped=unmapped)
                self._report(bad, pool.name, op)
                plans.append((pool, plan))
            return plans

        def apply_all(plans):
            touched = []
            for pool, plan in plans:
                owners = pool.shadow.apply_free(plan)
                touched.append((pool, owners, plan[3]))
            self._after_free(op, touched, timing[0])

        def timed_forward():
            t0 = self._w_clock()
            try:
                return forward()
            finally:
                timing[0] = self._w_clock() - t0

        tensors = [t for _, _, ts in parts for t in ts]
        shapes = [len(ts) for _, _, ts in parts]

        def deferred(*arrays, only=None):
            grouped, i = [], 0
            for k in shapes:
                grouped.append(arrays[i : i + k])
                i += k
            plans = plan_all(grouped)
            if only is not None:  # the inner raised: the pools it changed (see _mirror_on_failure)
                plans = [(pool, plan) for pool, plan in plans if pool.name in only]
                if not plans:
                    return
            apply_all(plans)

        def mirror_changed(changed):
            self._slot_tier(functools.partial(deferred, only=changed), *tensors)

        with self._mirror_on_failure(mirror_changed):
            result = timed_forward()
        self._slot_tier(deferred, *tensors)
        self._finish()
        return result

    def _free_now(self, op: str, forward: Callable, parts: list):
        """``_free`` with immediate verification (host tensors): check every part before the call (raise mode
        refuses a bad free there), forward, mirror. Written out without closures: this is every free's path."""
        plans = []
        for pool, fn, arrays in parts:
            if len(arrays) == 1:
                a = arrays[0]
                r = fn(a if type(a) is np.ndarray else a.numpy())
            else:
                r = fn(*(a if type(a) is np.ndarray else a.numpy() for a in arrays))
            if pool is None or r is None:
                continue
            pages, dedup, unmapped = r
            bad, plan = pool.shadow.plan_free(pages, dedup=dedup, op=op, unmapped=unmapped)
            if bad:
                self._report(bad, pool.name, op)
            plans.append((pool, plan))
        st = self._w_st
        if st.raising and st.to_raise:
            self._finish()  # raises: the inner allocator never sees the bad free
        return self._forward_free(op, forward, plans, st)

    def _forward_free(self, op: str, forward: Callable, plans: list, st: _CallState):
        """Forward a checked immediate free, then mirror its plans (and deliver). If the inner raises after
        changing its free lists (SGLang's post-condition asserts do), the change is mirrored before the exception
        propagates, pool by pool: the plans of the pools whose free lists changed (an SWA free that asserts after
        releasing its SWA pages and before its full ones mirrors the SWA plan alone); if it raised before changing
        anything, nothing is. ``st``: the wrapper's ``_CallState``."""
        # _mirror_on_failure, inlined (a generator context manager costs a few microseconds per free). Our token
        # and paged allocators change nothing when their free raises: no counts to capture for them.
        pools = st.pools.values()
        before = None if st.atomic_free else [p.probe() for p in pools]
        timed = st.want_free  # the duration is only read by the Free events
        clock = st.clock
        t0 = clock() if timed else 0.0
        try:
            result = forward()
        except BaseException:
            if before is not None:
                changed = [p for p, b in zip(pools, before) if b != p.probe()]
                done = [(pool, plan) for pool, plan in plans if pool in changed]
                if done:
                    self._apply_frees(op, done, clock() - t0 if timed else 0.0, st)
                    self._deliver()
            raise
        self._apply_frees(op, plans, clock() - t0 if timed else 0.0, st)
        if st.bus.active or st.to_raise or st.events:
            self._finish()
        return result

    def _apply_frees(self, op: str, plans: list, duration: float, st: _CallState) -> None:
        if len(plans) == 1:
            pool, plan = plans[0]
            owners = pool.shadow.apply_free(plan)
            if owners.size == 1:
                self._after_free_one(op, (pool, owners, plan[3]), duration, st)
            else:
                self._after_free(op, [(pool, owners, plan[3])], duration)
        else:
            self._after_free(op, [(pool, pool.shadow.apply_free(plan), plan[3]) for pool, plan in plans], duration)

    @contextlib.contextmanager
    def _mirror_on_failure(self, mirror: Callable):
        """If the inner raises after changing its free lists (SGLang's post-condition asserts do), mirror the
        change before the exception propagates: ``mirror(changed)``, ``changed`` the names of the pools whose free
        lists changed; if it raised before changing anything, mirror nothing."""
        pools = self._w_st.pools.values()
        before = [p.entries() for p in pools]
        try:
            yield
        except BaseException:
            changed = frozenset(p.name for p, b in zip(pools, before) if b != p.entries())
            if changed:
                mirror(changed)
                self._deliver()
            raise

    def _after_free(self, op: str, touched, duration: float = 0.0) -> None:
        """Ledger and events after a free. ``touched``: (pool, distinct owner slots, entries) per pool."""
        if len(touched) == 1 and touched[0][1].size == 1:
            return self._after_free_one(op, touched[0], duration, self._w_st)
        led = self._w_st.ledger
        ps = self._w_ps
        slots_all = []
        # Requests inserting into the cache free copies the cache holds: their lengths stay (KvLedger.inserting).
        inserting = np.fromiter(led.inserting, np.int64, len(led.inserting)) if led.inserting else None
        for pool, owners, n_entries in touched:
            if owners.size:
                slots_all.append(owners)
                if pool.name == "full" and self._w_st.track_lengths:
                    shrink = owners if inserting is None else owners[~np.isin(owners, inserting)]
                    if self._w_st.swa_frees == "pool":
                        self._one_pool_lengths(op, shrink)
                    else:
                        # The request's allocated length follows its full-pool pages when they shrink (after its
                        # protected prefix, the cache's pages).
                        led.shrink(shrink, led.owned["full"][shrink] * ps + led.protected[shrink])
            if self._w_st.want_free:
                self._emit(
                    ev.Free,
                    op=op,
                    pool=pool.name,
                    n_pages=int(n_entries),
                    rids=tuple(led.rid_of(int(s)) for s in owners),
                    duration=duration,
                )
        if slots_all:
            slots = slots_all[0] if len(slots_all) == 1 else np.unique(np.concatenate(slots_all))
            empty = np.ones(slots.size, bool)
            for arr in led.owned.values():
                empty &= arr[slots] <= 0
            if not self._w_st.track_lengths:
                empty[:] = False  # the engine's lengths: a request with no page left keeps them until it writes
            elif inserting is not None:
                empty &= ~np.isin(slots, inserting)
            for s in slots[empty]:
                led.keep(int(s))
                led.reset(int(s))
                led.tainted.discard(int(s))
            led.dirty.update(int(s) for s in slots)
            # slots: apply_free's owners (a gather or np.unique of one: fresh) or np.unique's result; read above,
            # never written, held by no one else. A released request's slot (its pages leaked, freed since) has no
            # ledger row to update: no entry (a LedgerUpdate names rows that exist; replay would revive it).
            live = led.live[slots]
            if led.cache >= 0:
                live &= slots != led.cache  # the prefix cache's slot has no ledger row
            self._emit_ledger(op, slots if live.all() else slots[live], private=True)

    def _one_pool_lengths(self, op: str, slots: np.ndarray) -> None:
        """``_after_free``'s length update on SGLang's all-SWA allocator, whose one pool (tracked as "full") holds
        a request's pages less those its window evicted. Its SWA frees (``free_swa``, ``free_swa_segment``) are
        that eviction, which the engine records next with its ``swa_evicted_seqlen`` write (SGLang's order, in
        mem_cache/common.py): the request's lengths stay, as on the two-pool allocator. Any other free shrinks
        them to what its pages cover: the pages it still owns after its evicted length or its protected prefix (the
        cache's pages), whichever is longer, as the ledger check counts them. ``slots``: the distinct
        owner slots of the freed pages."""
        if op == "free_swa" or op == "free_swa_segment":
            return
        led = self._w_st.ledger
        led.shrink(slots, led.owned["full"][slots] * self._w_ps + np.maximum(led.evicted[slots], led.protected[slots]))

    def _after_free_one(self, op: str, touched, duration: float, st: _CallState) -> None:
        """``_after_free`` for the usual free: one request's pages in one pool, in Python ints. ``st``: the
        wrapper's ``_CallState`` (every read from it)."""
        pool, owners, n_entries = touched
        led = st.ledger
        s = int(owners[0])
        # A request inserting into the cache frees copies the cache holds: its lengths stay (KvLedger.inserting).
        track = st.track_lengths and not (led.inserting and s in led.inserting)
        if pool.name == "full" and track:
            if st.swa_frees == "pool":
                self._one_pool_lengths(op, owners)
            else:
                # The request's allocated length follows its full-pool pages when they shrink (after its protected
                # prefix, the cache's pages).
                led.shrink_one(s, led.owned["full"].item(s) * st.ps + led.protected.item(s))
        rids = None
        if st.want_free:
            rids = (led.rid_of(s),)
            st.seq = seq = st.seq + 1
            st.events.append(_B_FREE(seq, st.clock(), st.step, op, pool.name, int(n_entries), rids, duration))
        for arr in led.owned.values():
            if arr.item(s) > 0:
                break
        else:
            if track:  # else the engine's lengths: a request with no page left keeps them
                led.keep(s)
                led.reset(s)
                led.tainted.discard(s)
        led.dirty.add(s)
        # A released request's slot has no row to update, nor has the prefix cache's.
        if st.want_ledger and led.live.item(s) and s != led.cache:
            # owners: apply_free's prev[:1], a view of a clipped gather made for this free alone: never written.
            self._emit_ledger(op, owners, rids or (led.rid_of(s),), private=True)

    # -- slot tier plumbing -------------------------------------------------------------------------------------
    def _slot_tier(self, fn: Callable, *tensors) -> None:
        """Run ``fn`` on host views of ``tensors``: now (CPU, immediate) or, in call order, once their
        non-blocking copies have landed (deferred). Immediate mode may pass numpy arrays already on the host
        (what ``_swa_peer`` and ``_peers_at`` return there)."""
        if not self._w_deferred:
            if len(tensors) == 1:
                t = tensors[0]
                fn(t if type(t) is np.ndarray else t.numpy())
            else:
                fn(*(t if type(t) is np.ndarray else t.numpy() for t in tensors))
            return
        event = None
        if self._w_cuda and tensors:
            copies = []
            for t in tensors:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                copies.append(buf)
            # The copies run on the current stream of the tensors' own GPU, which need not be the current device
            # (an engine that never set_device to the allocator's GPU): the event goes on that stream, or it could
            # complete before the copies have.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensors[0].device))
        else:
            # The caller may reuse its tensor (a view of req_to_token) before the boundary: keep a copy.
            copies = [t.detach().to("cpu", copy=True) for t in tensors]
        self._w_pending.append((fn, copies, event, self._w_st.op))

    def _drain(self, *, wait: bool) -> None:
        pending = self._w_pending
        current = self._w_st.op
        while pending:
            fn, copies, event, op = pending[0]
            if event is not None and not event.query():
                if not wait:
                    break
                event.synchronize()
            pending.popleft()
            self._w_st.op = op  # the page updates this verification makes belong to the call that queued it
            fn(*(c.numpy() for c in copies))
            if self.bus.active:
                self._flush_deltas()
        self._w_st.op = current

    def _swa_peer(self, full_slots):
        """SWA peers of handed-out full slots, read after the call. Immediate mode (host tensors only): a numpy
        gather on a view of the mapping (a torch index costs microseconds of dispatch); deferred: a device op
        whose result the slot tier copies without a sync."""
        mapping = self._w_inner.full_to_swa_index_mapping
        if not self._w_deferred:
            return mapping.numpy()[full_slots.numpy().astype(np.int64, copy=False)]
        return mapping[full_slots.to(torch.int64)]

    # -- helpers -------------------------------------------------------------------------------------------
    def _validate(self, op: str, check: Callable, *args, **kwargs):
        try:
            return check(*args, **kwargs)
        except ArgumentError as exc:
            self._invalid(op, exc)

    def _invalid(self, op: str, exc: Exception, *, rid=None):
        self._violate("invalid_argument", f"{op}: {exc}", op=op, rid=rid)
        self._w_to_raise.clear()  # the argument error is what the caller gets, in every mode
        self._deliver()
        raise exc

    def _bound_slots(self, bs: int, op: str):
        bound = self._w_bound
        if bound is None:
            return None
        rids, slots = bound[0], bound[1]
        if len(rids) != bs:
            self._invalid(op, ArgumentValueError("batch", f"{len(rids)} request ids bound, the call has {bs} requests"))
        return slots

    def _alloc_owners(self, n: int):
        """Owner per returned slot of a plain alloc(n), and each bound request's page growth."""
        bound = self._w_bound
        if bound is None:
            return -1, None
        rids, slots, lens = bound[:3]
        ps = self._w_ps
        if lens is not None and int(lens.sum()) == n:
            shares = lens
        elif len(rids) == 1:
            shares = np.array([n], np.int64)
        elif len(rids) == n:
            shares = np.ones(n, np.int64)
        else:
            return -1, None
        own = np.repeat(slots, shares) if ps == 1 else np.repeat(slots, shares // ps)
        return own, (slots, shares)

    def _host_alloc_ledger(self, op: str, grow) -> None:
        if grow is None:
            return
        slots, shares = grow
        led = self._w_st.ledger
        ps = self._w_ps
        pages = shares // ps if ps > 1 else shares
        _count_decodes(led, slots, shares)
        for name in led.owned:
            led.owned[name][slots] += pages
        led.allocated[slots] += pages * ps
        led.committed[slots] += shares
        self._emit_ledger(op, slots, self._w_bound[0], private=True)  # the binding's (read-only)

    def _entries_before(self):
        # Only a multi-pool allocator can refuse (None) after changing a pool (SGLang's SWA decode), and only
        # need_sort merges inside an allocation: otherwise nothing to capture.
        st = self._w_st  # every read below from it (see _CallState)
        if st.need_sort:
            return [(p.count(), p.staged()) for p in st.pools.values()]
        if len(st.pools) > 1:
            return [(p.count(), 0) for p in st.pools.values()]
        return None

    def _alloc_none(self, op: str, requested: int, before, duration: float = 0.0) -> None:
        """The inner refused: it must not have taken any page (SGLang's SWA decode can; that is reported)."""
        for pool, (was, _) in zip(self._w_st.pools.values(), before or ()):
            now = pool.entries()
            if now != was:
                pool.shadow.expected_entries = was
                bad = pool.shadow.check_count(now, f"{op} returned None but")
                self._report(bad, pool.name, op)
        if self.bus.wants(ev.AllocFailed):
            bound = self._w_bound
            # Name the pool that ran short: the one with fewer free slots.
            short = min(self._w_st.pools.values(), key=lambda p: p.allocator.available_size())
            self._emit(
                ev.AllocFailed,
                op=op,
                pool=short.name,
                requested=int(requested),
                available=int(short.allocator.available_size()),
                rids=bound[0] if bound else (),
                duration=duration,
            )
        self._finish()
        return None

    def _after_merge_check(self, before) -> None:
        # need_sort: an allocation that ran short merged the staged pages into the free list first. Judged
        # from the inner's host-side staged counts, since the shadow may still be behind (deferred mode).
        for pool, (_, staged_before) in zip(self._w_st.pools.values(), before):
            if staged_before and pool.staged() == 0:
                self._slot_tier(pool.shadow.merged)

    def _misaligned(self, o, pos, own, op, pool) -> None:
        bad = np.flatnonzero((o - pos) % self._w_ps)
        i = int(bad[0])
        slot = int(own[i]) if isinstance(own, np.ndarray) else -1
        self._violate(
            "slot_page_alignment",
            f"{op}: {bad.size} slots break slot % {self._w_ps} == position % {self._w_ps}; first: position "
            f"{int(pos[i])} got slot {int(o[i])}",
            slot=slot,
            op=op,
            pool=pool,
        )

    def _group_begin(self) -> None:
        st = self._w_st
        pools = st.pools
        if len(pools) == 1 and st.full.allocator is not st.inner and st.swa_frees == "peers":
            # HiSparse (one pool, its logical allocator: see __init__): free groups are no-ops (frees happen at
            # once), so nothing is held. Not SGLang's one-pool SWA layouts, whose groups hold: a per-request SWA
            # ring's opens one on its full allocator; the all-SWA allocator holds every free itself until the
            # group ends (and frees the held slots once more through its own free, no dedup at page size 1).
            return
        for p in pools.values():
            p.shadow.group_begin()

    def _group_end(self) -> None:
        for p in self._w_st.pools.values():
            p.shadow.group_end()

    def _group_end_failed(self, st: _CallState, changed: frozenset) -> None:
        """The inner's ``free_group_end`` raised. The pools whose free lists changed released their held pages:
        their group ends in the shadow. The others' held pages were not released; if the inner left its group
        (``free_group`` None, as SGLang's and ours leave it before freeing), they are lost to it: the shadow
        leaves the group and keeps them held (``PoolShadow.group_abandon``). If the inner changed nothing and is
        still in its group, nothing is mirrored. In call order (behind the queued checks, when deferred)."""
        group = getattr(st.inner, "free_group", _ABSENT)
        left = bool(changed) if group is _ABSENT else group is None
        if not changed and not left:
            return

        def mirror():
            for p in st.pools.values():
                if p.name in changed:
                    p.shadow.group_end()
                elif left:
                    p.shadow.group_abandon()

        if st.deferred:
            self._slot_tier(mirror)
        else:
            mirror()
        self._deliver()

    def _merged(self) -> None:
        for p in self._w_st.pools.values():
            p.shadow.merged()

    def _cleared(self) -> None:
        led = self._w_st.ledger
        for p in self._w_st.pools.values():
            p.shadow.clear()
            led.owned[p.name][:] = 0
        for s in led.live_slots():
            led.keep(int(s))  # a clear is no allocation: the requests' records stay what they were
            led.reset(int(s))
        led.tainted.clear()

    def _do_release(self, rid, detached: int | None = None) -> None:
        """Check and release request ``rid``; ``detached``: its slot, when the id was already detached from it
        (deferred verification, see ``release_request``)."""
        st = self._w_st
        led = st.ledger
        if detached is None:
            slot = led.slot_of(rid, create=False)
        else:
            slot = detached
            n = st.detached.get(rid, 0) - 1
            if n > 0:
                st.detached[rid] = n
            else:
                st.detached.pop(rid, None)
        owned = led.owned
        total = 0
        for a in owned.values():
            total += a.item(slot)  # Python ints: no dict, no numpy scalars on the usual (clean) release
        peak = max(led.peak_pages.item(slot), owned["full"].item(slot))
        led.released_step[slot] = st.step
        if total > 0:
            held = {n: a.item(slot) for n, a in owned.items()}
            # The pages themselves (a leak is rare: the owner arrays are scanned only then).
            detail = "; ".join(
                f"{n}: {pages_list(np.flatnonzero(st.pools[n].shadow.owner == slot))}"
                for n, v in held.items()
                if v and n in st.pools
            )
            self._violate(
                "request_leak",
                f"request {rid!r} released while still owning {total} pages, neither freed nor handed to the "
                f"prefix cache ({detail})",
                slot=slot,
                op="release",
                pool=next(n for n, v in held.items() if v),
            )
        if st.want_released:
            st.seq = seq = st.seq + 1
            allocated, committed, evicted = led.record(slot)
            st.events.append(
                _B_RELEASED(
                    seq, st.clock(), st.step, rid, total, peak, allocated, committed, evicted,
                    led.decode_steps.item(slot),
                )
            )  # fmt: skip
        if detached is None:
            led.release(rid, leaked=total > 0)
        else:
            led.release_slot(slot, leaked=total > 0)
        led.tainted.discard(slot)

    def _boundary_checks(self, op: str, *, every_request: bool = False) -> None:
        for pool in self._w_st.pools.values():
            shadow = pool.shadow
            entries = pool.count()
            if entries != shadow.expected_entries:  # check_count only on a mismatch (it reports, then resyncs)
                self._report(shadow.check_count(entries, op), pool.name, op)
        if every_request or self._w_st.ledger.dirty:
            self._check_ledger_pages(op, every_request)

    def _check_ledger_pages(self, op: str, every_request: bool) -> None:
        """Pages each request owns against its ledger. A step boundary compares the requests whose ledger or
        pages changed other than by the wrapper's own allocation updates (those keep both in step by
        construction, and the slot tier verifies the pages they name); flush and sweeps compare every one.
        Mismatches are reported pool by pool (full, then swa), each in the order of the compared slots."""
        led = self._w_st.ledger
        if every_request:
            slots = led.live_slots()
        else:
            dirty = led.dirty
            if not dirty:
                return
            if len(dirty) <= _FEW_DIRTY:
                # The usual boundary compares a few requests (one eviction, a finish): the same comparison in
                # Python ints costs a fraction of the dozen numpy calls of the vector form below.
                self._check_few_ledger_pages(op)
                return
            slots = np.fromiter(dirty, np.int64, len(dirty))
            live = led.live[slots]
            if led.cache >= 0:
                live &= slots != led.cache  # the prefix cache's slot has no ledger row to compare
            slots = slots[live]
        led.dirty.clear()
        if not slots.size:
            return
        ps, shift = self._w_ps, self._w_shift
        # Shifts where the page size is a power of two (they floor as // does, for a third of the cost).
        allocated = led.allocated[slots] + (ps - 1)
        want_full = allocated >> shift if shift is not None else allocated // ps
        # The request's own pages are those of [cache_protected_len, kv_allocated_len): the protected prefix (whole
        # pages) is the prefix cache's, for its SWA KV too.
        protected = led.protected[slots]
        pages_protected = protected >> shift if shift is not None else protected // ps
        checks = [("full", want_full - pages_protected)]
        if "swa" in led.owned or self._w_st.swa_frees == "pool":
            evicted = np.maximum(led.evicted[slots], protected)
            want_swa = want_full - (evicted >> shift if shift is not None else evicted // ps)
            # The all-SWA allocator's one pool is its SWA pool (tracked as "full"): evicted pages leave it.
            checks = [("full", want_swa)] if "swa" not in led.owned else [*checks, ("swa", want_swa)]
        for name, want in checks:
            have = led.owned[name][slots]
            # The usual boundary: equal int64 arrays, one memcmp (np.flatnonzero is a Python-level wrapper: only
            # on a mismatch).
            if have.tobytes() == want.tobytes():
                continue
            for i in np.flatnonzero(have != want):
                self._ledger_mismatch(op, name, int(slots[i]), int(want[i]), int(have[i]))

    def _check_few_ledger_pages(self, op: str) -> None:
        """``_check_ledger_pages`` of the dirty requests, one by one (for a handful of them)."""
        led = self._w_st.ledger
        live, allocated, evicted, protected = led.live, led.allocated, led.evicted, led.protected
        cache = led.cache  # the prefix cache's slot has no ledger row to compare
        slots = [s for s in led.dirty if live.item(s) and s != cache]  # the vector form's order: the set's
        led.dirty.clear()
        ps = self._w_ps
        full = led.owned["full"]
        swa = led.owned.get("swa")
        one_pool = self._w_st.swa_frees == "pool"  # the all-SWA allocator: evicted pages leave its one pool
        later = []  # the swa pool's mismatches, reported after every full one
        for s in slots:
            # The request's own pages: those of [cache_protected_len, kv_allocated_len).
            total = (allocated.item(s) + ps - 1) // ps
            p = protected.item(s)
            want = total - p // ps
            if one_pool:
                want = total - max(evicted.item(s), p) // ps
            have = full.item(s)
            if have != want:
                self._ledger_mismatch(op, "full", s, want, have)
            if swa is not None:
                want_swa = total - max(evicted.item(s), p) // ps
                have = swa.item(s)
                if have != want_swa:
                    later.append((s, want_swa, have))
        for s, want, have in later:
            self._ledger_mismatch(op, "swa", s, want, have)

    def _ledger_mismatch(self, op: str, name: str, s: int, want: int, have: int) -> None:
        """Report that request slot ``s`` owns ``have`` pages of pool ``name`` where its ledger means ``want``:
        once per distinct fact, and not for a request whose root cause (a rejected ledger write) was reported."""
        led = self._w_st.ledger
        if s in led.tainted:
            return
        key, fact = (name, s), (want, have)
        reported = self._w_mismatch_reported
        if reported.get(key) == fact:
            return
        reported[key] = fact
        protected = int(led.protected[s])
        self._violate(
            "ledger_matches_pages",
            f"request {led.rid_of(s)!r}: kv_allocated_len={int(led.allocated[s])}"
            + (f", cache_protected_len={protected}" if protected else "")
            + (f", swa_evicted_seqlen={int(led.evicted[s])}" if name == "swa" or self._w_st.swa_frees == "pool" else "")
            + f" means {want} {name} pages, it owns {have}",
            slot=s,
            op=op,
            pool=name,
        )

    def _sweep_cache(self, cached) -> None:
        """``check_consistency``'s comparison of the full pool's cache-owned pages with the cache's own."""
        if not isinstance(cached, torch.Tensor) or cached.dim() != 1:
            raise ArgumentTypeError("cached", f"expected a 1-D index tensor, got {type(cached).__name__}")
        st = self._w_st
        led = st.ledger
        shadow = st.full.shadow
        owner = shadow.owner
        held = cached.detach().to("cpu").numpy().astype(np.int64, copy=False) // st.ps
        held = sorted_unique(held[(held > 0) & (held < owner.size)])
        cache = led.cache
        ours = np.flatnonzero(owner == cache) if cache >= 0 else np.zeros(0, np.int64)
        lost = np.setdiff1d(ours, held, assume_unique=True)
        if lost.size and ("cache-lost", tuple(lost[:16].tolist())) not in shadow.reported:
            shadow.reported.add(("cache-lost", tuple(lost[:16].tolist())))
            self._violate(
                "pool_conservation",
                f"sweep: full pages {pages_list(lost)} were handed to the prefix cache, which holds them no more "
                "and never freed them: neither free nor owned",
                op="sweep",
                pool="full",
            )
        foreign = held[owner[held] != cache] if cache >= 0 else held
        if foreign.size and ("cache-foreign", tuple(foreign[:16].tolist())) not in shadow.reported:
            shadow.reported.add(("cache-foreign", tuple(foreign[:16].tolist())))
            first = int(owner[foreign[0]])
            what = (
                f"owned by request {led.rid_of(first)!r}"
                if first >= 0
                else "free" if first <= FREE else "handed out to no known request"
            )
            self._violate(
                "pool_conservation",
                f"sweep: the prefix cache holds full pages {pages_list(foreign)} that were never handed to it "
                f"(page {int(foreign[0])} is {what})",
                slot=first if first >= 0 else -1,
                op="sweep",
                pool="full",
            )

    def _sweep_unreleased(self) -> None:
        """``check_consistency(idle=True)``: the requests still known that own pages were never released."""
        st = self._w_st
        led = st.ledger
        for s in led.live_slots().tolist():
            held = {n: int(a[s]) for n, a in led.owned.items() if a[s] > 0 and n in st.pools}
            if not held or ("unreleased", s) in st.full.shadow.reported:
                continue
            st.full.shadow.reported.add(("unreleased", s))
            detail = "; ".join(f"{n}: {pages_list(np.flatnonzero(st.pools[n].shadow.owner == s))}" for n in held)
            self._violate(
                "request_leak",
                f"the engine is idle, yet request {led.rid_of(s)!r} still owns {sum(held.values())} pages "
                f"({detail}): it was never released",
                slot=s,
                op="sweep",
                pool=next(iter(held)),
            )

    def _sweep_leaks(self) -> None:
        led = self._w_st.ledger
        for pool in self._w_st.pools.values():
            owners = pool.shadow.owner
            used = np.unique(owners[owners >= 0])
            dead = used[~led.live[used]]
            for s in dead:
                s = int(s)
                key = ("leak", pool.name, s)
                if key in pool.shadow.reported or led.leaked[s]:
                    continue
                pool.shadow.reported.add(key)
                pages = np.flatnonzero(owners == s)
                self._violate(
                    "request_leak",
                    f"{pool.name} pages {pages_list(pages)} are owned by request {led.rid_of(s)!r} (slot {s}), "
                    f"released at step {led.released_step.item(s)} without freeing them",
                    slot=s,
                    op="sweep",
                    pool=pool.name,
                )

    def _sweep_mapping(self) -> None:
        mapping = self._w_inner.full_to_swa_index_mapping[:-1].detach().to("cpu").numpy()
        ps = self._w_ps
        full, swa = self._w_st.full.shadow, self._w_st.swa.shadow
        mapped = np.flatnonzero(mapping > 0)
        if not mapped.size:
            return
        swa_pages = mapping[mapped] // ps
        in_range = swa_pages < swa.owner.size
        swa_owner = np.full(swa_pages.shape, -100, np.int64)
        swa_owner[in_range] = swa.owner[swa_pages[in_range]]
        full_owner = full.owner[np.minimum(mapped // ps, full.owner.size - 1)]
        dead_peer = swa_owner < -1
        mismatch = (swa_owner >= 0) & (full_owner >= 0) & (swa_owner != full_owner)
        for mask, what in (
            (dead_peer, "point at SWA pages that are not in use"),
            (mismatch, "point at SWA pages owned by another request"),
        ):
            pages = np.unique(mapped[mask] // ps)
            key = ("map", what, tuple(pages[:16].tolist()))
            if pages.size and key not in swa.reported:
                swa.reported.add(key)
                self._violate(
                    "swa_mapping_inconsistent",
                    f"sweep: full pages {pages[:8].tolist()} ({pages.size}) {what}",
                    op="sweep",
                    pool="swa",
                )

    # -- reporting ----------------------------------------------------------------------------------------
    def _report(self, bad, pool: str | None, op: str) -> None:
        for inv, msg, slot in bad:
            self._violate(inv, msg, slot=slot, op=op, pool=pool)

    def _violate(
        self, invariant: str, message: str, *, slot: int = -1, op: str = "", pool: str | None = None, rid=None
    ):
        """Record a violation. Its request id: the owner of ``slot`` when one is given, else ``rid`` (an id the
        message names that owns no slot). A message names a request id only as ``request {rid!r}`` or
        ``request id {rid!r}`` with ``rid`` the violation's own (what ``redact.RequestIdHasher`` replaces)."""
        rid = self._w_st.ledger.rid_of(slot) if slot is not None and slot >= 0 else rid
        if rid is not None and invariant in _TAINTING:
            # The request's pages and its ledger no longer agree for a reason already reported.
            self._w_st.ledger.tainted.add(slot)
        trace = None
        if self.trace_id_for is not None and rid is not None:
            try:
                trace = self.trace_id_for(rid)
            except Exception:
                trace = None
        v = Violation(
            invariant=invariant,
            message=message,
            pool=pool,
            rid=rid,
            step=self._w_st.step,
            op=op,
            ts=self._w_clock(),
            trace_id=trace,
            severity=SEVERITY.get(invariant, "error"),
        )
        self.violations.append(v)
        self.violation_counts[invariant] += 1
        if self.bus.wants(ev.ViolationEvent):
            self._emit(ev.ViolationEvent, violation=v)
        if self._w_raise:
            self._w_to_raise.append(v)
        return v

    def _emit(self, cls, **fields) -> None:
        st = self._w_st
        st.seq += 1
        st.events.append(_make_event(cls, st.seq, st.clock(), st.step, fields))

    def _emit_alloc(self, op: str, n_slots: int, n_pages: int, dt: float, pool: str = "full") -> None:
        st = self._w_st
        if st.want_alloc:
            bound = getattr(st.tls, "bound", None)
            st.seq = seq = st.seq + 1
            st.events.append(
                _B_ALLOC(seq, st.clock(), st.step, op, pool, n_slots, n_pages, bound[0] if bound else (), dt)
            )

    def _emit_snapshots(self) -> None:
        led = self._w_st.ledger
        slots = led.live_slots()
        ledger_rows = tuple(
            (led.rid_of(int(s)), int(led.allocated[s]), int(led.committed[s]), int(led.evicted[s])) for s in slots
        )
        for p in self._w_st.pools.values():
            owner = p.shadow.owner
            used = np.unique(owner[owner >= 0])
            self._emit(
                ev.Snapshot,
                pool=p.name,
                page_size=p.page_size,
                num_pages=p.shadow.num_pages,
                owner=owner.astype("<i4", copy=False).tobytes(),
                rids=tuple((int(s), led.rid_of(int(s))) for s in used),
                ledger=ledger_rows,
            )

    def _flush_deltas(self) -> None:
        st = self._w_st
        if not st.want_pages:
            return
        for p in st.pools.values():
            shadow = p.shadow
            deltas = shadow.deltas
            if deltas:  # take_deltas, inlined: most calls have nothing to publish in some pool
                shadow.deltas = []
                clock, op, step, events, name = st.clock, st.op, st.step, st.events, p.name
                for pages, owners in deltas:
                    st.seq = seq = st.seq + 1
                    events.append(_B_PAGES(seq, clock(), step, op, name, pages, owners))

    def _emit_ledger(self, op: str, slots: np.ndarray, rids: tuple | None = None, *, private: bool = False) -> None:
        """A ``LedgerUpdate`` of ``slots`` (when some sink reads them). ``private``: the caller guarantees that
        nothing ever writes ``slots`` again (a fresh array no one else holds, or a read-only one whose memory no
        one writes), so the event may keep it as it is instead of a copy."""
        st = self._w_st
        if st.want_ledger and slots.size:
            led = st.ledger
            st.seq = seq = st.seq + 1
            st.events.append(
                _B_LEDGER(
                    seq,
                    st.clock(),
                    st.step,
                    op,
                    rids if rids is not None else tuple(led.rid_of(int(x)) for x in slots),
                    slots if private else slots.copy(),
                    # Gathers by an index array: already copies, owned by the event.
                    led.allocated[slots],
                    led.committed[slots],
                    led.evicted[slots],
                )
            )

    def _deliver(self) -> None:
        """Hand the call's events (page deltas first published as events when read) to the sinks, as one batch."""
        st = self._w_st
        if st.want_pages:
            self._flush_deltas()
        if st.events:
            batch, st.events = st.events, []
            cost = st.cost
            if cost.open:
                cost.stop_checks()
                st.bus.deliver(batch)
                cost.stop_exporters()
            else:
                st.bus.deliver(batch)

    def _finish(self) -> None:
        """End of a call: hand the events to the sinks, then (raise mode) raise the first violation."""
        # _deliver, inlined: every call that built an event ends here (one method call less per call).
        st = self._w_st
        if st.want_pages:
            self._flush_deltas()
        if st.events:
            batch, st.events = st.events, []
            cost = st.cost
            if cost.open:  # inside a charged call (subscribe() delivers outside one)
                cost.stop_checks()
                st.bus.deliver(batch)
                cost.stop_exporters()
            else:
                st.bus.deliver(batch)
        to_raise = st.to_raise
        if to_raise:
            first = to_raise[0]
            to_raise.clear()
            raise InvariantViolation(first)
