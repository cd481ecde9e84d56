"""The event vocabulary and a small synchronous bus.

Contract:
- Every event is a frozen dataclass with ``seq`` (monotonic per allocator, gap-free across all event kinds),
  ``ts`` (the allocator's injected clock) and ``step`` (the wrapper's step counter).
- The wrapper collects the events of one allocator call (or one ``step()``) and hands them to every sink as
  one batch, on the calling thread, after the allocator call has returned (or, in raise mode, just before the
  exception leaves the wrapper).
- A sink is a callable ``sink(batch: Sequence[Event]) -> bool | None``. It must not block. Returning False
  ("refused") or raising drops that batch for that sink: the bus counts the dropped events per sink name in
  ``dropped`` and never lets the exception reach the allocator's caller. The first exception of each sink name is
  logged once (a warning on the ``instrumented_alloc.events`` logger naming the sink and the exception, pointing at
  ``dropped``); later failures of that sink are only counted (``errors`` keeps the latest text), so a sink that
  fails on every batch cannot flood the log. A refusal (False) is a sink's own decision and is not logged here.
- A sink that may block (network, disk, a lock) must be wrapped: ``instrumented_alloc.sinks.NonBlockingSink`` runs
  it on its own thread behind a bounded queue and refuses (counted here) when the queue is full. The bus itself
  stays synchronous: with no sink it costs nothing, and our own exporters never block (they only enqueue).
- No sink: the wrapper builds no events at all (``EventBus.active`` is False), so instrumentation with no
  subscriber costs nothing beyond the checks themselves. A sink may declare ``event_types`` (a set of event
  classes it reads); the wrapper then skips building the kinds nobody asked for (``PageUpdate``, ``LedgerUpdate``
  and ``Snapshot``, the costly ones, and ``Alloc``, ``Free``, ``RequestReleased``, ``StepBoundary``). ``seq``
  counts the events built, so it stays gap-free. Sinks still receive every event that was built and ignore the
  rest.
- A sink that reads ``Alloc`` may also declare ``decode_allocs = False``: it reads no ``Alloc`` of ``alloc_decode``
  (the engine's per-token call, most of the events in a decode-heavy run; what such a sink needs of a decode is in
  the call's ``LedgerUpdate``). The wrapper then builds none while no other sink reads them
  (``EventBus.wants_decode_allocs``); every other ``Alloc`` is built as before, and ``seq`` stays gap-free as
  above. Absent (or anything but False): the sink reads them. A sink still ignores any it receives because
  another sink asked for them.
- A sink that reads ``LedgerUpdate`` may also declare ``free_ledgers = False``: it reads no ``LedgerUpdate`` of a
  free (an update whose ``op`` does not start with ``alloc``: most of them in a run of short requests, one per
  free call, and each its own batch). While no other sink reads them (``EventBus.wants_free_ledgers``) the wrapper
  builds none; instead it keeps what each would have carried in ``EventBus.skipped_frees``: request slot ->
  ``(mark, allocated, committed)``, the slot's ledger values as the latest such free left them, ``mark`` being the
  allocator's ``seq`` at that free (the ``seq`` of the last event built before it: a ``LedgerUpdate`` of that slot
  with ``seq <= mark`` came before the free, one with ``seq > mark`` after it). An entry lives until the request's
  release (the slot may then be reused). Read it only while handling a batch, on the wrapper's thread: a sink
  behind a ``NonBlockingSink`` reads the dict later than its events, so that wrapper does not forward the
  declaration (the sink then receives free updates). Absent (or anything but False): the sink reads them; the
  dict is then not written (entries left from before stay, older than every later update).
- A sink that reads ``LedgerUpdate`` may also declare ``decode_ledgers = False``: it reads no ``LedgerUpdate`` of
  ``alloc_decode`` one by one, only their fold (``DecodeFold``, which it must then read): consecutive decodes of the
  same bound batch (the same slots array: one ``batch()`` block, or the next blocks binding the same ids while the id
  -> slot mapping is unchanged) as one event, built when the run ends, before the next call that changes those values,
  or could: any allocation other than a further decode of that batch, a free (but for a free of SWA pages alone, an
  SWA eviction, which changes none unless it leaves a request no page at all: that ends the run too), a release,
  ``clear()``/``resize()``, a change of the sinks. Step boundaries leave it open. Its values are the requests' ledger
  values then, which are the last decode's with any checked ledger write made since (a write builds its own
  ``LedgerWrite`` as usual, with an earlier ``seq`` than the fold's). While no other sink reads decodes' updates
  (``EventBus.wants_decode_ledgers``) and verification is immediate, the wrapper builds folds instead of the
  per-decode updates: a decode then builds no event at all for such a sink (most calls of a decode-heavy run).
  Otherwise (another sink reads them, or deferred verification, which publishes a decode's update at the step
  boundary) it builds the per-decode updates and no fold, and the sink receives those. Absent (or anything but False):
  the sink reads the per-decode updates.
- An event never changes after it is built, arrays included: each numpy array in an event is the event's own (a
  copy or a fresh gather no one else holds), or read-only memory that nothing writes (the slots of a ``batch()``
  binding and its owner codes, shared by that block's ``LedgerUpdate``s and page deltas, and by later blocks
  that bind the same ids while the id -> slot mapping is unchanged). Sinks must not write into them either.
- Not thread-safe by itself: the wrapper serialises calls (see ``wrapper.py``).
- Losses after a sink took the events (the OTel SDK failing to export the spans made of them, on its own thread)
  are not the bus's to see: the component registers a running total with ``add_loss_counter(name, counter)``, and
  ``drop_counts()`` (what ``kvalloc_events_dropped_total{sink}`` reports) is ``dropped`` plus those totals per
  sink name. ``counter()`` is called from any thread (a scrape's), must be cheap, and never decreases. Counters
  registered with the same ``key=`` (the component whose losses they count) are counted once, as their largest.
- ``make(cls, seq, ts, step, fields)`` is how the wrapper builds events on its hot path: the same frozen object the
  dataclass constructor builds (same fields, defaults, equality, repr, pickling), without the per-field
  ``object.__setattr__`` of a frozen dataclass's ``__init__`` (a third of the cost). A field with a default factory
  that ``fields`` leaves out gets a fresh ``factory()``, as the constructor gives it (``StepBoundary.available``).
- ``builder(cls)`` is the positional form for the hottest kinds: ``builder(cls)(seq, ts, step, *fields)`` (fields
  in declaration order, defaults as the constructor's) builds the same object again, with neither the keyword dict
  nor the template copy (one store per field into the instance's dict). Generated from
  ``dataclasses.fields(cls)``, so it cannot drift from the class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from instrumented_alloc.invariants import Violation

logger = logging.getLogger("instrumented_alloc.events")


@dataclass(frozen=True)
class Event:
    seq: int
    ts: float
    step: int


@dataclass(frozen=True)
class Alloc(Event):
    """A successful allocation. ``rids`` are the bound requests in batch order (empty when unattributed)."""

    op: str
    pool: str
    n_slots: int
    n_pages: int
    rids: tuple = ()
    duration: float = 0.0


@dataclass(frozen=True)
class AllocFailed(Event):
    """An allocation the allocator refused (returned None) for lack of pages."""

    op: str
    pool: str
    requested: int
    available: int
    rids: tuple = ()
    duration: float = 0.0


@dataclass(frozen=True)
class Free(Event):
    """Pages released (or held in a free group). ``rids``: the owners of the freed pages, when known."""

    op: str
    pool: str
    n_pages: int
    rids: tuple = ()
    duration: float = 0.0


@dataclass(frozen=True)
class SwaEvict(Event):
    """A request's SWA-evicted length moved from ``old`` to ``new`` tokens (``n_pages`` SWA pages)."""

    rid: object
    old: int
    new: int
    n_pages: int


@dataclass(frozen=True)
class LedgerWrite(Event):
    """An accepted write of one ledger field (rejected writes produce a ViolationEvent instead)."""

    rid: object
    field: str
    old: int
    new: int


@dataclass(frozen=True)
class RequestReleased(Event):
    """A request's release: ``pages_held`` its pages of every pool still held (> 0: a leak), ``pages_peak`` the
    most full-pool pages it held at once."""

    rid: object
    pages_held: int
    pages_peak: int = 0


@dataclass(frozen=True)
class ViolationEvent(Event):
    violation: Violation


@dataclass(frozen=True)
class Snapshot(Event):
    """Periodic state of one pool: ``owner`` is the page-owner code array as little-endian int32 bytes
    (see ``shadow.py`` for the codes); ``slots``/``rids`` name the request slots that appear in it."""

    pool: str
    page_size: int
    num_pages: int
    owner: bytes
    rids: tuple = ()
    ledger: tuple = ()


@dataclass(frozen=True)
class PageUpdate(Event):
    """How the shadow of ``pool`` changed: ``owner[pages] = owners`` (numpy int64 page ids and int32 codes or
    ledger slots of the same shape, see ``shadow.py``), applied in entry order: the last entry of a page is its
    owner. Emitted in the order the shadow changed (for deferred verification: at the step boundary), so that
    a recording replays page states exactly.

    What it lists: every page whose owner the call changed, with its new owner, and as a rule nothing else. An
    allocation lists each page it gave an owner once (not once per slot), a decode only the pages its requests
    opened (a request that continues its own page has no entry), a free the distinct pages it released, a
    ``clear()``/``resize()`` every page ``0..num_pages`` (replay reads that as a reset). Never empty: a call that
    changes no owner (a decode in which no request opens a page) publishes no ``PageUpdate``.
    The wrapper drops entries that change nothing only where a path knows them without extra work, so an entry
    may still be a no-op (a page that read that owner already), and a page may appear more than once: in a call
    that breaks a check (its pages as judged, one entry per slot or freed page), a set-shaped free inside a free
    group of pages the group already holds, an allocation that put one page in two places of the call (two
    requests, or one request's slots out of page order). Readers must not take the number of entries for a
    count of pages changed, nor of slots."""

    op: str
    pool: str
    pages: Any
    owners: Any


@dataclass(frozen=True)
class LedgerUpdate(Event):
    """Ledger columns the wrapper itself wrote for the requests of one call (numpy arrays aligned with
    ``rids``/``slots``). Checked writes through ``ReqKvInfo`` are ``LedgerWrite`` events instead."""

    op: str
    rids: tuple
    slots: Any
    allocated: Any
    committed: Any
    evicted: Any


@dataclass(frozen=True)
class DecodeFold(Event):
    """``n`` consecutive ``alloc_decode`` calls of one bound batch, folded, for the sinks that declare
    ``decode_ledgers = False`` (see the module docstring): ``rids``/``slots`` (numpy) as the decodes' binding,
    ``allocated``/``committed``/``evicted`` (numpy, aligned with them) the requests' ledger values when the fold
    was built (the last decode's, with any checked write made since), ``first_step``/``last_step`` the steps of
    its first and last decode (``step``: when it was built)."""

    op: str
    rids: tuple
    slots: Any
    n: int
    first_step: int
    last_step: int
    allocated: Any
    committed: Any
    evicted: Any


@dataclass(frozen=True)
class StepBoundary(Event):
    """``alloc.step()`` was called; ``available`` maps pool name to the free + staged entries the shadow expects in
    the inner's free lists (O(1) to read: what the count check compares). After a double free the inner lists a
    page twice, so this exceeds the free pages by the duplicates until the list is merged or the pages reused."""

    available: dict = field(default_factory=dict)
    # What the instrumentation has cost the engine's thread so far, in seconds per part (``selfcost.PARTS``
    # order), and what it cost since the previous boundary (one scheduler iteration, where the engine steps once
    # per iteration).
    overhead: tuple = ()
    iteration_seconds: float = 0.0


# The fields that hold clock readings (timestamps, call durations, the instrumentation's own cost): two runs of the
# same calls publish the same events but for these.
CLOCK_FIELDS = frozenset({"ts", "duration", "overhead", "iteration_seconds"})

Sink = Callable[[Sequence[Event]], "bool | None"]

_MISSING = object()
_TEMPLATES: dict[type, tuple[dict, frozenset, tuple]] = {}


def _template(cls: type) -> tuple[dict, frozenset, tuple]:
    fs = dataclasses.fields(cls)
    tpl = {f.name: (f.default if f.default is not dataclasses.MISSING else _MISSING) for f in fs}
    factories = tuple((f.name, f.default_factory) for f in fs if f.default_factory is not dataclasses.MISSING)
    required = frozenset(
        f.name
        for f in fs
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in ("seq", "ts", "step")
    )
    t = _TEMPLATES[cls] = (tpl, required, factories)
    return t


def make(cls: type, seq: int, ts: float, step: int, fields: dict) -> Event:
    """``cls(seq=seq, ts=ts, step=step, **fields)``, built by filling the instance dict directly (see the module
    docstring). Falls back to the constructor (which names the fault) when a required field is missing or an
    unknown one is given."""
    t = _TEMPLATES.get(cls) or _template(cls)
    tpl, required, factories = t
    if not fields.keys() >= required or not tpl.keys() >= fields.keys():
        return cls(seq=seq, ts=ts, step=step, **fields)
    d = tpl.copy()  # field order, defaults in place
    d["seq"] = seq
    d["ts"] = ts
    d["step"] = step
    d.update(fields)
    for name, factory in factories:
        if name not in fields:
            d[name] = factory()  # a fresh default per event, never one shared object
    e = object.__new__(cls)
    e.__dict__.update(d)
    return e


_BUILDERS: dict[type, Callable] = {}


def builder(cls: type) -> Callable:
    """The positional builder of ``cls`` (see the module docstring): ``b(seq, ts, step, *fields)``."""
    b = _BUILDERS.get(cls)
    if b is not None:
        return b
    params, stores, env = [], [], {"_cls": cls, "_new": object.__new__}
    for i, f in enumerate(dataclasses.fields(cls)):
        if f.default is not dataclasses.MISSING:
            env[f"_d{i}"] = f.default
            params.append(f"{f.name}=_d{i}")
            stores.append(f"    d[{f.name!r}] = {f.name}\n")
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_f{i}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            env["_MISSING"] = _MISSING
            stores.append(f"    d[{f.name!r}] = _f{i}() if {f.name} is _MISSING else {f.name}\n")
        else:
            params.append(f.name)
            stores.append(f"    d[{f.name!r}] = {f.name}\n")
    # One store per field into the new instance's dict, in field order (the constructor's order): a quarter
    # cheaper than building a dict and update()-ing the instance's with it.
    src = f"def build({', '.join(params)}):\n    e = _new(_cls)\n    d = e.__dict__\n{''.join(stores)}    return e\n"
    exec(src, env)  # generated from the dataclass's own field list: cannot drift from the class
    b = _BUILDERS[cls] = env["build"]
    b.__qualname__ = b.__name__ = f"build_{cls.__name__}"
    return b


def sink_name(sink) -> str:
    return getattr(sink, "name", None) or getattr(sink, "__name__", None) or type(sink).__name__


class _KeyedCounters:
    """Loss counters registered under one key (``EventBus.add_loss_counter``): the same losses, counted once."""

    __slots__ = ("counters", "key")

    def __init__(self, key, counters: list):
        self.key = key
        self.counters = counters

    def __call__(self) -> int:
        n = 0
        for counter in list(self.counters):
            with contextlib.suppress(Exception):
                n = max(n, int(counter()))
        return n


class EventBus:
    """Delivers batches of events to sinks; counts what a sink refused or failed on."""

    def __init__(self, sinks: Sequence[Sink] = ()):
        self._sinks: list[Sink] = []
        self.dropped: dict[str, int] = {}
        self.errors: dict[str, str] = {}
        self._loss_counters: dict[str, list] = {}
        self.active = False
        self._wanted: frozenset | None = frozenset()
        self._want_decode_allocs = False
        # Written by the wrapper while wants_free_ledgers is False (see the module docstring); plain attributes, read
        # by the wrapper on every free.
        self.want_free_ledgers = False
        self.want_decode_ledgers = False
        self.skipped_frees: dict[int, tuple[int, int, int]] = {}
        # Called after every subscribe/unsubscribe: the wrapper caches what it builds (see wants) and refreshes
        # the cache here, so a sink subscribed on the bus directly is served like one given to alloc.subscribe.
        self.on_change: Callable[[], None] | None = None
        for s in sinks:
            self.subscribe(s)

    def subscribe(self, sink: Sink) -> None:
        self._sinks.append(sink)
        self.dropped.setdefault(sink_name(sink), 0)
        self._update()

    def unsubscribe(self, sink: Sink) -> None:
        self._sinks.remove(sink)
        self._update()

    def _update(self) -> None:
        self.active = bool(self._sinks)
        wanted: set | None = set()
        for s in self._sinks:
            types = getattr(s, "event_types", None)
            if types is None:
                wanted = None
                break
            wanted.update(types)
        self._wanted = None if wanted is None else frozenset(wanted)
        self._want_decode_allocs = any(
            getattr(s, "decode_allocs", True) is not False
            and (getattr(s, "event_types", None) is None or Alloc in s.event_types)
            for s in self._sinks
        )
        self.want_free_ledgers = any(
            getattr(s, "free_ledgers", True) is not False
            and (getattr(s, "event_types", None) is None or LedgerUpdate in s.event_types)
            for s in self._sinks
        )
        self.want_decode_ledgers = any(
            getattr(s, "decode_ledgers", True) is not False
            and (getattr(s, "event_types", None) is None or LedgerUpdate in s.event_types)
            for s in self._sinks
        )
        if self.on_change is not None:
            self.on_change()

    def wants(self, cls: type) -> bool:
        """Whether some sink reads events of this class (every sink without ``event_types`` reads all)."""
        return self.active and (self._wanted is None or cls in self._wanted)

    def wants_decode_allocs(self) -> bool:
        """Whether some sink reads the ``Alloc`` events of ``alloc_decode`` (one that reads ``Alloc`` and does not
        declare ``decode_allocs = False``). Implies ``wants(Alloc)``."""
        return self._want_decode_allocs

    def wants_free_ledgers(self) -> bool:
        """Whether some sink reads the ``LedgerUpdate`` events of frees (one that reads ``LedgerUpdate`` and does
        not declare ``free_ledgers = False``). When False while ``wants(LedgerUpdate)``, the wrapper keeps
        ``skipped_frees`` instead of building them."""
        return self.want_free_ledgers

    def wants_decode_ledgers(self) -> bool:
        """Whether some sink reads the ``LedgerUpdate`` of each ``alloc_decode`` (one that reads ``LedgerUpdate``
        and does not declare ``decode_ledgers = False``). When False while ``wants(DecodeFold)``, the wrapper
        folds decodes instead (see the module docstring)."""
        return self.want_decode_ledgers

    def add_loss_counter(self, name: str, counter: Callable[[], int], *, key=None) -> None:
        """Count ``counter()`` (a running total, never decreasing) under sink ``name`` in ``drop_counts()``: what a
        sink lost after it took the events. Counters stay registered (a total must not go back). ``key``: what the
        counter counts the losses of (e.g. the component that loses them); counters registered under one name with
        the same key count the same losses (two sinks attached one after the other around one component, or one
        counting part of what another counts): that key is counted once, as the largest of its counters."""
        if not callable(counter):
            raise TypeError(f"counter: expected a callable, got {type(counter).__name__}")
        counters = self._loss_counters.setdefault(str(name), [])
        if key is None:
            counters.append(counter)
            return
        for entry in counters:
            if isinstance(entry, _KeyedCounters) and entry.key is key:
                entry.counters.append(counter)
                return
        counters.append(_KeyedCounters(key, [counter]))

    def drop_counts(self) -> dict[str, int]:
        """Per sink name: ``dropped`` (refused or failed batches' events) plus the loss counters' totals. A counter
        that raises counts as 0 in that call."""
        out = dict(self.dropped)
        for name, counters in list(self._loss_counters.items()):
            n = 0
            for counter in list(counters):
                with contextlib.suppress(Exception):
                    n += int(counter())
            out[name] = out.get(name, 0) + n
        return out

    @property
    def sinks(self) -> tuple:
        return tuple(self._sinks)

    def deliver(self, batch: Sequence[Event]) -> None:
        # Every wrapped call that built an event ends here: the loop does the call and one test per sink; what a
        # refusal or a failure costs is paid in _refused/_failed.
        if not batch:
            return
        for s in self._sinks:
            try:
                if s(batch) is False:
                    self._refused(s, len(batch))
            except Exception as exc:  # a sink must never break the allocator's caller
                self._failed(s, exc)
                self._refused(s, len(batch))

    def _refused(self, sink, n: int) -> None:
        name = sink_name(sink)
        self.dropped[name] = self.dropped.get(name, 0) + n

    def _failed(self, sink, exc: Exception) -> None:
        name = sink_name(sink)
        first = name not in self.errors
        self.errors[name] = f"{type(exc).__name__}: {exc}"
        if first:  # once per sink name: a sink failing on every batch must not flood the log
            logger.warning(
                "event sink %r failed: %s: %s; its batches are dropped and counted in bus.dropped[%r] "
                "(further failures of this sink are not logged)",
                name,
                type(exc).__name__,
                exc,
                name,
            )
