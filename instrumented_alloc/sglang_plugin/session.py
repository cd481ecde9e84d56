"""One scheduler process's instrumentation: the wrapped allocator and what the hooks need to attribute its calls.

Contract:
- One ``Session`` per SGLang process (``current()``), made by the plugin at load when it is switched on. It holds
  no allocator until SGLang builds one (``wrap``), in a scheduler process only: every hook is a pass-through
  where there is none (the HTTP server, the detokenizer), and for an allocator that is not the wrapped one.
- The engine's thread calls every method; the wrapper's lock serialises what the exporters' threads read.
- ``kv_rid`` maps a request's KV record (``id(req.kv)``, SGLang's ``ReqKvInfo``, which names no request) to the
  request id, from the allocation that first names the request (an extend, a PD preallocation) to its release:
  the routed writes of the record (``kvrecord.py``) and the SWA evicted length's hook find the ledger row through
  it. A record being released (``releasing``) is not routed: the release zeroes it after the wrapper has checked
  the request.
- The request records' lengths (``kv_allocated_len``, ``kv_committed_len``, ``cache_protected_len``) reach the
  checked ledger one of two ways (``Config.ledger``):
  - ``immediate`` (raise mode, always): every write SGLang makes goes through the ledger as it is made, and a
    rejected value raises before SGLang stores it;
  - ``deferred`` (record mode's default): SGLang's writes are its own (no routing, nothing added per write). The
    batch's records are compared with the ledger together (``verify``: a vector read per field, one compare) at
    the end of each allocation hook, the iteration's one batch call, where SGLang has just written them (and its
    loop has just brought them into the cache); a released request's own record at its release. A value that
    differs is written through the checked ledger then, with the violation ids and request ids an immediate
    write reports, before anything of ours reads that row again. What it cannot see: a value SGLang writes and
    overwrites between two of those points.
- ``active`` is set by every hook that did work and cleared by the step: the scheduler loop busy-polls, and an
  iteration that did nothing costs one attribute test.
- Self-cost (``alloc.cost``, see ``selfcost``): every hook charges its own time to ``hooks`` (stopping it around
  SGLang's original function and around the wrapper's calls, which charge themselves), the deferred verification
  and the routed writes to ``ledger``.
"""

from __future__ import annotations

import atexit
import logging
import operator
import time

import numpy as np

from instrumented_alloc.sglang_plugin.config import Config
from instrumented_alloc.wrapper import InstrumentedAllocator

log = logging.getLogger("instrumented_alloc.sglang")

_RID = operator.attrgetter("rid")
_KV = operator.attrgetter("kv")
_ALLOCATED = operator.attrgetter("kv.kv_allocated_len")
_COMMITTED = operator.attrgetter("kv.kv_committed_len")
_PROTECTED = operator.attrgetter("kv.cache_protected_len")

_SESSION: Session | None = None


def current() -> Session | None:
    return _SESSION


def start(cfg: Config, *, attach_sinks=None) -> Session:
    global _SESSION
    if _SESSION is None:
        _SESSION = Session(cfg, attach_sinks=attach_sinks)
        atexit.register(_SESSION.close)  # the recorder's last batch, the metrics server
    return _SESSION


class Session:
    def __init__(self, cfg: Config, *, clock=time.monotonic, attach_sinks=None):
        self.cfg = cfg
        # attach_sinks(session, server_args, model_config): the exporters, injected (see sglang_plugin.register).
        self.attach_sinks = attach_sinks
        self.clock = clock
        self.alloc: InstrumentedAllocator | None = None
        self.req_to_token = None  # SGLang's req_to_token_pool.req_to_token (rows of slots), set at build
        self.tree = None  # SGLang's tree cache, set at build
        self.kv_rid: dict[int, object] = {}
        self.releasing: set[int] = set()
        self.deferred = cfg.ledger == "deferred"
        # (requests, their id()s, their ids) of the last batch bound: held, so that those id()s stay theirs.
        self.last_batch: tuple = ((), [], [])
        self.active = False  # a hook did work since the last step
        self.dirty_since_sweep = False  # ... since the last consistency sweep
        self.last_sweep = -float("inf")
        self.closers: list = []
        self.labels: dict = {}  # SGLang's labels of this scheduler (exporters.sglang.rank_labels)
        self.recording: str | None = None
        self.metrics_url: str | None = None
        self.prometheus = None
        self.otel = None
        self.errors: dict[str, str] = {}  # exporter name -> why it could not start

    # -- the allocator ----------------------------------------------------------------------------------------
    def wrap(self, inner, *, sliding_window: int | None) -> InstrumentedAllocator:
        """Wrap SGLang's allocator (once: a draft worker that builds again gets the same wrapper)."""
        if isinstance(inner, InstrumentedAllocator):
            return inner
        if self.alloc is not None:
            raise RuntimeError(
                f"instrumented-alloc: a second KV allocator in one scheduler process ({type(inner).__name__}); "
                "this plugin instruments one per process"
            )
        self.alloc = InstrumentedAllocator(
            inner, mode=self.cfg.mode, sliding_window=sliding_window, allocated_len="tokens"
        )
        return self.alloc

    def owns(self, allocator) -> bool:
        return allocator is not None and allocator is self.alloc

    # -- requests -----------------------------------------------------------------------------------------------
    def bind_records(self, reqs, *, fresh: bool = True) -> list:
        """The requests' ids, in batch order. ``fresh`` (an extend, a PD preallocation: requests may be new, or
        come back retracted): their KV records are named too (see ``kv_rid``), and a request new to the wrapper
        gets SGLang's span of it as the parent of its ``kv.request`` span (when tracing). A decode batch names
        requests an extend named: their ids alone; the same requests as the last batch's (the usual decode) give
        the last ids without reading a request (``last_batch``)."""
        ids = list(map(id, reqs))  # reads the list alone, not the requests
        _held, last_ids, last_rids = self.last_batch
        if ids == last_ids:
            # The same objects (the last batch's requests are held there, so no id of theirs was reused): the same
            # ids, which a request never changes.
            rids = last_rids
        else:
            rids = list(map(_RID, reqs))
            self.last_batch = (reqs, ids, rids)
        if fresh:
            if self.otel is not None:
                ledger = self.alloc.ledger
                for r in reqs:
                    if r.rid not in ledger:
                        self.parent(r)
            self.kv_rid.update(zip(map(id, map(_KV, reqs)), rids))
        return rids

    def parent(self, req) -> None:
        """SGLang's root span of ``req`` (``req.time_stats.trace_ctx``) as its ``kv.request`` span's parent."""
        ctx = getattr(getattr(getattr(req, "time_stats", None), "trace_ctx", None), "root_span_context", None)
        if ctx is not None:
            try:
                self.otel.set_parent(req.rid, ctx)
            except (TypeError, ValueError) as exc:
                log.warning("instrumented-alloc: request %r: no parent span: %s", req.rid, exc)

    def protect(self, reqs) -> None:
        """Give the wrapper each request's ``cache_protected_len`` (the prefix the cache lends it), as SGLang has
        it before the allocation: a new request's matched prefix; for a request the wrapper knows, a value it
        already has (its writes are routed)."""
        led = self.alloc.ledger
        for r in reqs:
            p = r.kv.cache_protected_len
            kv = led[r.rid]
            if kv.cache_protected_len != p:
                kv.cache_protected_len = p

    def routed_write(self, kv, field: str, value) -> None:
        """A write of ``field`` of SGLang's record ``kv``, before SGLang stores it: through the checked ledger when
        the record names a request the wrapper knows (in raise mode a rejected value raises here, unstored)."""
        key = id(kv)
        rid = self.kv_rid.get(key)
        if rid is None or key in self.releasing:
            return
        alloc = self.alloc
        cost = alloc.cost
        cost.start()
        try:
            row = alloc.ledger[rid]
        except KeyError:
            cost.end_ledger()
            return
        try:
            setattr(row, field, value)
        finally:
            cost.end_ledger()
        self.active = True

    def verify(self, reqs: list, slots, *, protected: bool) -> None:
        """Deferred: compare the records of ``reqs`` (their ledger ``slots``) with the ledger, a vector read and
        compare per field (``protected``: the protected prefix too, which only an extend or a preallocation moves),
        and write each value that differs through the checked ledger, in the order SGLang writes them (see the
        module docstring). Charged to ``ledger``; the caller stops its own stretch first."""
        alloc = self.alloc
        cost = alloc.cost
        cost.start()
        try:
            led = alloc.ledger
            # Lists compared whole (C-level): on a batch of a few hundred, cheaper than numpy's per-call overhead.
            a = list(map(_ALLOCATED, reqs))
            c = list(map(_COMMITTED, reqs))
            p = list(map(_PROTECTED, reqs)) if protected else None
            if (
                a != led.allocated[slots].tolist()
                or c != led.committed[slots].tolist()
                or (p is not None and p != led.protected[slots].tolist())
            ):
                if p is None:
                    p = list(map(_PROTECTED, reqs))
                differ = (
                    (np.array(a) != led.allocated[slots])
                    | (np.array(c) != led.committed[slots])
                    | (np.array(p) != led.protected[slots])
                )
                for i in np.flatnonzero(differ).tolist():
                    self._adopt(reqs[i], a[i], c[i], p[i])
        finally:
            cost.end_ledger()

    def _adopt(self, req, allocated: int, committed: int, protected: int) -> None:
        """SGLang's values of one request's record, through the checked ledger (each reported as an immediate
        write of it would be: the rule it breaks, the request's id): the protected prefix first (an allocation
        reads it first), then the allocated length before the committed one unless that would put the committed
        length past a shrinking allocated one (the order SGLang writes them in)."""
        led = self.alloc.ledger
        try:
            row = led[req.rid]
        except KeyError:
            return  # released since (a release verifies first: not reached)
        if row.cache_protected_len != protected:
            row.cache_protected_len = protected
        if allocated >= row.kv_committed_len:
            order = (("kv_allocated_len", allocated), ("kv_committed_len", committed))
        else:
            order = (("kv_committed_len", committed), ("kv_allocated_len", allocated))
        for field, value in order:
            if getattr(row, field) != value:
                setattr(row, field, value)

    def release(self, req, release, *args, **kwargs):
        """``release(req, ...)`` (SGLang's release of a request's KV), then the wrapper's release of the request:
        it must own no page it neither freed nor handed to the cache."""
        alloc = self.alloc
        cost = alloc.cost
        cost.start()
        kv = req.kv
        key = id(kv)
        rid = self.kv_rid.get(key)
        if rid is None or rid not in alloc.ledger:
            cost.end_hooks()
            return release(req, *args, **kwargs)
        if self.deferred:
            row = alloc.ledger[rid]
            if (kv.kv_allocated_len, kv.kv_committed_len, kv.cache_protected_len) != (
                row.kv_allocated_len,
                row.kv_committed_len,
                row.cache_protected_len,
            ):
                cost.stop_hooks()
                self.verify([req], [row.slot], protected=True)  # what SGLang wrote since, before the release
        self.releasing.add(key)
        cost.stop_hooks()
        try:
            out = release(req, *args, **kwargs)
        finally:
            cost.start()
            self.releasing.discard(key)
        self.kv_rid.pop(key, None)
        self.active = self.dirty_since_sweep = True
        cost.stop_hooks()
        alloc.release_request(rid)  # charges itself
        return out

    def checkpoint(self, checkpoint, req, *, up_to: int, **kwargs):
        """SGLang's ``tree_cache.checkpoint(req, up_to=...)``: the request's row from its protected prefix to
        ``up_to`` is offered to the prefix cache; what the cache then protects for the request passes to it."""
        alloc = self.alloc
        cost = alloc.cost
        cost.start()
        kv = req.kv
        rid = self.kv_rid.get(id(kv))
        p0 = kv.cache_protected_len
        if rid is None or kv.req_pool_idx is None or up_to <= p0 or rid not in alloc.ledger:
            cost.end_hooks()
            return checkpoint(req, up_to=up_to, **kwargs)
        row = self.req_to_token[kv.req_pool_idx]
        cost.stop_hooks()
        with alloc.cache_insert(rid, row[p0:up_to]) as ins:  # the offer and the take charge themselves
            try:
                out = checkpoint(req, up_to=up_to, **kwargs)
            finally:
                cost.start()
            p1 = kv.cache_protected_len
            if self.deferred and p1 != p0:
                alloc.ledger[rid].cache_protected_len = p1  # the write an immediate ledger routes in there
            if p1 > p0:
                ins.held = row[p0:p1]  # the row now points at the cache's slots there
            cost.stop_hooks()
        self.active = self.dirty_since_sweep = True
        return out

    # -- the scheduler loop -----------------------------------------------------------------------------------
    def step(self) -> None:
        """The iteration boundary: the wrapper's step (which closes the iteration's self-cost)."""
        if self.active:
            self.active = False
            self.dirty_since_sweep = True
            self.alloc.step()

    def idle(self, scheduler) -> None:
        """Where SGLang runs its idle leak check: a consistency sweep once the scheduler is fully idle after some
        activity, at most every ``sweep_interval`` seconds."""
        if not self.dirty_since_sweep:
            return
        now = self.clock()
        if now - self.last_sweep < self.cfg.sweep_interval or not scheduler.is_fully_idle():
            return
        self.step()
        self.last_sweep = now
        self.dirty_since_sweep = False
        cost = self.alloc.cost
        cost.start()
        cached = None
        if self.tree is not None and hasattr(self.tree, "all_values_flatten") and self.tree.supports_prefix_sharing():
            cached = self.tree.all_values_flatten()
        idle = _no_kv_held(scheduler)
        cost.stop_hooks()
        self.alloc.check_consistency(cached=cached, idle=idle)
        cost.set_aside()  # idle time's work: in the totals, in no iteration's

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception:
                log.exception("instrumented-alloc: closing an exporter failed")
        self.closers.clear()


def _no_kv_held(scheduler) -> bool:
    """Whether a fully idle scheduler holds no request's KV: not while streaming sessions keep rows, PD decode has
    deferred releases pending, or HiSparse backs KV up (where SGLang skips its own idle check too)."""
    if getattr(scheduler, "enable_hisparse", False):
        return False
    queue = getattr(scheduler, "disagg_decode_transfer_queue", None)
    if queue is not None and queue.has_pending_deferred_releases():
        return False
    observer = getattr(scheduler, "pool_stats_observer", None)
    return observer is None or not observer.session_held_req_count()
