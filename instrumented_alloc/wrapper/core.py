"""The public class, ``InstrumentedAllocator``: construction, configuration and the public attributes; the checks
are its mixins' (see the package docstring). ``__init__`` sets the per-wrapper constants once, on the instance
and on the per-call state (``state._CallState``)."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from instrumented_alloc import events as ev
from instrumented_alloc.allocators.base import BaseTokenToKVPoolAllocator
from instrumented_alloc.allocators.paged import PagedTokenToKVPoolAllocator
from instrumented_alloc.allocators.token import TokenToKVPoolAllocator
from instrumented_alloc.argcheck import (
    check_int,
)
from instrumented_alloc.ledger import KvLedger
from instrumented_alloc.selfcost import SelfCost
from instrumented_alloc.shadow import (
    LedgerSnapshot,
    PoolSnapshot,
)
from instrumented_alloc.wrapper.alloc import _AllocChecks
from instrumented_alloc.wrapper.constants import (
    _NOOP,
    _OWN_ATTRS,
    ALLOCATED_LEN,
    FAST_PATHS,
    INSTRUMENTED_OPS,
    MODES,
    VERIFY,
)
from instrumented_alloc.wrapper.decode import _DecodeChecks
from instrumented_alloc.wrapper.emit import _Events
from instrumented_alloc.wrapper.extend import _ExtendChecks
from instrumented_alloc.wrapper.forwarding import _forward_names, _pool_view, _subclass_for
from instrumented_alloc.wrapper.free_parts import _FreeParts
from instrumented_alloc.wrapper.frees import _FreeChecks
from instrumented_alloc.wrapper.pools import _PoolTransitions
from instrumented_alloc.wrapper.requests import _Requests
from instrumented_alloc.wrapper.state import _CallState, _make_pool, _OffBatch, _state_property
from instrumented_alloc.wrapper.sweeps import _Sweeps
from instrumented_alloc.wrapper.verify import _Verification


def _fast_paths(value) -> frozenset:
    """The constructor's ``fast_paths`` as the set of ``FAST_PATHS`` names switched on."""
    if value is True:
        return frozenset(FAST_PATHS)
    if value is False:
        return frozenset()
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"fast_paths: expected a bool or names of {FAST_PATHS}, got {value!r}")
    names = frozenset(value)
    unknown = names - set(FAST_PATHS)
    if unknown:
        raise ValueError(f"fast_paths: unknown {sorted(unknown)}; expected names of {FAST_PATHS}")
    return names


class InstrumentedAllocator(
    _Requests,
    _AllocChecks,
    _ExtendChecks,
    _DecodeChecks,
    _FreeChecks,
    _FreeParts,
    _PoolTransitions,
    _Sweeps,
    _Verification,
    _Events,
):
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
    one inner lacks answers as that inner does (``AttributeError``).

    ``fast_paths`` (True: all; False: none; or names of ``FAST_PATHS``): the fast paths of immediate verification
    (``alloc``, ``decode``, ``decode_runs``, ``extend_runs``, ``free``) and of the bookkeeping (``bind_memo``).
    Each verifies the usual call of its kind more cheaply and changes nothing when it declines; the general path
    then judges the call. The findings, state and events are the same either way: switching them off is how tests
    compare the two, and what to try when a fast path is suspected."""

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
        fast_paths: bool | Iterable[str] = True,
    ):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if allocated_len not in ALLOCATED_LEN:
            raise ValueError(f"allocated_len: expected one of {ALLOCATED_LEN}, got {allocated_len!r}")
        if verify not in VERIFY:
            raise ValueError(f"verify: expected one of {VERIFY}, got {verify!r}")
        if sliding_window is not None:
            check_int("sliding_window", sliding_window, minimum=1)
        fast = _fast_paths(fast_paths)
        s = object.__setattr__
        s(self, "_w_inner", inner)
        s(self, "inner", inner)
        s(self, "mode", mode)
        s(self, "bus", ev.EventBus(sinks))
        # Per-call mutable state and the per-wrapper constants live on a plain slotted object (see _CallState);
        # the ``_w_*`` names below that are properties of this class write it (one copy).
        s(self, "_w_st", _CallState(clock, threading.local(), self.bus, []))  # batch() binding is per thread
        s(self, "_w_off", mode == "off")
        s(self, "_w_raise", mode == "raise")
        s(self, "_w_lock", threading.RLock())
        s(self, "_w_pending", deque())
        s(self, "_w_snapshot_every", int(snapshot_every))
        s(self, "_w_mismatch_reported", {})
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
        s(self, "_w_fast_decode", "decode" in fast and not deferred and ps > 1 and self._w_shift is not None)
        s(self, "_w_consts", {})
        s(self, "_w_run", None)  # the decode fast path's _DecodeRun (one pool, immediate verification)
        s(self, "_w_steps", np.arange(1, ps, dtype=np.int64)[:, None])  # a run's decodes after its opening one
        s(self, "_w_fast_alloc", "alloc" in fast and not deferred and self._w_st.swa is None and ps == 1)
        # Immediate frees with a power-of-two page size > 1 on paged pools take the fast path first.
        s(
            self,
            "_w_fast_free",
            "free" in fast
            and not deferred
            and ps > 1
            and self._w_shift is not None
            and all(p.dedup_free for p in self._w_pools.values())
            # One pool for both sides: its free ops release it in other shapes than the fast path reads them.
            and self._w_swa_frees != "pool",
        )
        s(self, "_w_off_batch", _OffBatch(self))
        # The constants again on the call state, the same objects (see _CallState): what the hot paths read.
        st = self._w_st
        st.inner = inner
        st.cost = ledger.cost = SelfCost(cost_clock)
        st.track_lengths = allocated_len == "pages"
        st.inner_checks, st.atomic_free = self._w_inner_checks, self._w_atomic_free
        st.capture_before = self._w_capture_before
        st.fast_decode, st.fast_alloc, st.fast_free = self._w_fast_decode, self._w_fast_alloc, self._w_fast_free
        st.decode_runs, st.extend_runs = "decode_runs" in fast, "extend_runs" in fast
        st.bind_memo = "bind_memo" in fast
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
    _w_clock = _state_property("clock", "The injected clock of the events and violations.")
    _w_tls = _state_property("tls", "The thread-local that holds each thread's ``batch()`` binding.")
    _w_to_raise = _state_property("to_raise", "Raise mode: the violations of the call in progress, to raise.")
    _w_lock = _state_property("lock", "The lock every instrumented call holds (reentrant).")
    _w_pending = _state_property("pending", "Deferred verification: the queued slot-tier checks, in call order.")
    _w_off = _state_property("off", "Off mode: nothing is checked.")
    _w_raise = _state_property("raising", "Raise mode.")
    _w_ps = _state_property("ps", "The page size.")
    _w_shift = _state_property("shift", "log2 of the page size when it is a power of two, else None.")
    _w_device = _state_property("device", "The inner's device.")
    _w_deferred = _state_property("deferred", "The slot tier is verified at step boundaries (see ``verify``).")
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
