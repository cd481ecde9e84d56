"""One scheduler process's instrumentation: the wrapped allocator and what the hooks need to attribute its calls.

Contract:
- One ``Session`` per SGLang process (``current()``), made by the plugin at load when it is switched on. It holds
  no allocator until SGLang builds one (``wrap``), in a scheduler process only: every hook is a pass-through
  where there is none (the HTTP server, the detokenizer), and for an allocator that is not the wrapped one.
- The engine's thread calls every method; the wrapper's lock serialises what the exporters' threads read.
- ``kv_rid`` maps a request's KV record (``id(req.kv)``, SGLang's ``ReqKvInfo``, which names no request) to the
  request id, from the first allocation that names the request to its release: the routed writes of the record
  (``kvrecord.py``) find the ledger row through it. A record being released (``releasing``) is not routed: the
  release zeroes it after the wrapper has checked the request.
- ``active`` is set by every hook that did work and cleared by the step: the scheduler loop busy-polls, and an
  iteration that did nothing costs one attribute test.
"""

from __future__ import annotations

import atexit
import logging
import time

from instrumented_alloc.sglang_plugin.config import Config
from instrumented_alloc.wrapper import InstrumentedAllocator

log = logging.getLogger("instrumented_alloc.sglang")

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
    def bind_records(self, reqs) -> list:
        """Name the requests' KV records (see ``kv_rid``); returns their ids, in batch order. A request new to the
        wrapper gets SGLang's span of it as the parent of its ``kv.request`` span (when tracing)."""
        rids = []
        kv_rid = self.kv_rid
        ledger = self.alloc.ledger
        for r in reqs:
            rid = r.rid
            if self.otel is not None and rid not in ledger:
                self.parent(r)
            kv_rid[id(r.kv)] = rid
            rids.append(rid)
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
        try:
            row = alloc.ledger[rid]
        except KeyError:
            return
        setattr(row, field, value)
        self.active = True

    def release(self, req, release, *args, **kwargs):
        """``release(req, ...)`` (SGLang's release of a request's KV), then the wrapper's release of the request:
        it must own no page it neither freed nor handed to the cache."""
        kv = req.kv
        key = id(kv)
        rid = self.kv_rid.get(key)
        if rid is None or rid not in self.alloc.ledger:
            return release(req, *args, **kwargs)
        self.releasing.add(key)
        try:
            out = release(req, *args, **kwargs)
        finally:
            self.releasing.discard(key)
        self.kv_rid.pop(key, None)
        self.active = self.dirty_since_sweep = True
        self.alloc.release_request(rid)
        return out

    def checkpoint(self, checkpoint, req, *, up_to: int, **kwargs):
        """SGLang's ``tree_cache.checkpoint(req, up_to=...)``: the request's row from its protected prefix to
        ``up_to`` is offered to the prefix cache; what the cache then protects for the request passes to it."""
        kv = req.kv
        rid = self.kv_rid.get(id(kv))
        p0 = kv.cache_protected_len
        if rid is None or kv.req_pool_idx is None or up_to <= p0 or rid not in self.alloc.ledger:
            return checkpoint(req, up_to=up_to, **kwargs)
        row = self.req_to_token[kv.req_pool_idx]
        with self.alloc.cache_insert(rid, row[p0:up_to]) as ins:
            out = checkpoint(req, up_to=up_to, **kwargs)
            p1 = kv.cache_protected_len
            if p1 > p0:
                ins.held = row[p0:p1]  # the row now points at the cache's slots there
        self.active = self.dirty_since_sweep = True
        return out

    # -- the scheduler loop -----------------------------------------------------------------------------------
    def step(self) -> None:
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
        cached = None
        if self.tree is not None and hasattr(self.tree, "all_values_flatten") and self.tree.supports_prefix_sharing():
            cached = self.tree.all_values_flatten()
        self.alloc.check_consistency(cached=cached, idle=_no_kv_held(scheduler))

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
