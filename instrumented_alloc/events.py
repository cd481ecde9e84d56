"""The event vocabulary and a small synchronous bus.

Contract:
- Every event is a frozen dataclass with ``seq`` (monotonic per allocator, gap-free across all kinds), ``ts`` (the
  allocator's injected clock) and ``step`` (the wrapper's step counter). An event never changes after it is built,
  arrays included: each array is the event's own, or read-only memory nothing writes (a ``batch()`` binding's
  slots and owner codes, shared by that block's events). Sinks must not write into them either.
- The wrapper hands the events of one allocator call (or one ``step()``) to every sink as one batch, on the calling
  thread, after the call returned (raise mode: just before the exception leaves the wrapper).
- A sink is a callable ``sink(batch) -> bool | None`` that must not block (wrap one that may in
  ``sinks.NonBlockingSink``). Returning False or raising drops that batch for that sink: counted per sink name in
  ``dropped``; the first exception of each sink name is logged once, later ones only counted (``errors``).
  Nothing a sink does reaches the allocator's caller.
- Typed subscription: a sink may declare ``event_types`` (the event classes it reads). The wrapper builds only the
  kinds some sink reads, none at all without a sink (``EventBus.active``); ``seq`` counts the events built, so it
  stays gap-free. A sink ignores the kinds it receives because another sink asked for them.
- Who reads what: the flight recorder reads the per-call stream (every kind but ``StepStats`` and ``Snapshot``);
  Prometheus reads ``StepStats`` (per-step sums of the per-call kinds), ``ViolationEvent`` and ``RequestReleased``;
  OpenTelemetry reads requests' allocations, ledger writes, evictions, releases and violations. ``StepStats`` is
  built only for a sink that names it (``wants_named``): a sink without ``event_types`` gets what it sums.
- ``RequestReleased`` is the per-request record at a request's end: its pages, its KV record as its allocations
  and checked ledger writes last left it (the frees that tear a request down do not zero it) and how many decode
  allocations included it. A consumer that needs a request's totals reads them there.
- Losses after a sink took the events are registered with ``add_loss_counter(name, counter)``; ``drop_counts()``
  (what ``kvalloc_events_dropped_total{sink}`` reports) is ``dropped`` plus those totals. Counters registered with
  the same ``key=`` count the same losses: counted once, as their largest.
- ``make(cls, seq, ts, step, fields)`` and ``builder(cls)(seq, ts, step, *fields)`` build the same frozen object as
  the constructor without its per-field ``object.__setattr__`` (the wrapper's hot paths); ``builder`` is generated
  from ``dataclasses.fields(cls)``, so it cannot drift from the class.
- Not thread-safe by itself: the wrapper serialises calls.
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
    most full-pool pages it held at once; ``allocated``/``committed``/``evicted`` its KV record (tokens) as its
    allocations and checked ledger writes last left it (the frees just before a release do not zero it);
    ``decode_steps`` the decode allocations that included it (each ``alloc_decode``, and each plain ``alloc`` of
    one slot for a request already holding KV: SGLang's decode at page size 1). Fields after ``pages_held`` were
    added with defaults: older recordings read them as those."""

    rid: object
    pages_held: int
    pages_peak: int = 0
    allocated: int = 0
    committed: int = 0
    evicted: int = 0
    decode_steps: int = 0


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


@dataclass(frozen=True)
class StepStats(Event):
    """What the per-call kinds of the calls since the previous boundary sum to (``stepstats.StepAccumulator``),
    built at every ``step()``, ``flush()`` and ``check_consistency()`` only while a sink names this class in its
    ``event_types`` (a sink that reads every kind has the per-call events themselves). ``allocated``/``freed``:
    pool -> pages (the ``Alloc``/``Free`` events' ``n_pages``); ``durations``: op -> each call's duration, one
    per call (its "full" event's, else its SWA-only op's); ``failures``: (pool, op) -> ``AllocFailed`` events;
    ``evicted``: the tokens ``SwaEvict`` events added. ``overhead``/``iteration_seconds``: as ``StepBoundary``'s
    at a ``step()``; ``()`` and 0.0 at ``flush()`` and sweeps, which close no iteration."""

    allocated: dict = field(default_factory=dict)
    freed: dict = field(default_factory=dict)
    durations: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    evicted: int = 0
    overhead: tuple = ()
    iteration_seconds: float = 0.0


# The fields that hold clock readings (timestamps, call durations, the instrumentation's own cost): two runs of the
# same calls publish the same events but for these.
CLOCK_FIELDS = frozenset({"ts", "duration", "durations", "overhead", "iteration_seconds"})

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
        self._named: frozenset = frozenset()  # the classes some sink's event_types names
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
        self._named = frozenset(t for s in self._sinks for t in (getattr(s, "event_types", None) or ()))
        if self.on_change is not None:
            self.on_change()

    def wants(self, cls: type) -> bool:
        """Whether some sink reads events of this class (every sink without ``event_types`` reads all)."""
        return self.active and (self._wanted is None or cls in self._wanted)

    def wants_named(self, cls: type) -> bool:
        """Whether some sink names this class in its ``event_types`` (a summary kind such as ``StepStats``: a sink
        that reads every kind reads what it sums instead)."""
        return self.active and cls in self._named

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
