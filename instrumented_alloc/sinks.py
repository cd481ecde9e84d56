"""Sink adapters for the event bus (``instrumented_alloc.events``). Core: standard library only, no I/O of its own.

``NonBlockingSink(sink, *, queue_size=1024, name=None)`` makes any sink safe to subscribe, however slow it is.

Why: the bus is synchronous (a batch is handed to every sink on the engine's thread, inside the allocator call that
produced it), so that with no sink instrumentation costs nothing and with our own exporters it costs an enqueue.
A sink that blocks (a network call, a disk write, a lock another thread holds) would block the engine's call. Our
exporters never block (Prometheus aggregates in memory, OTel appends to the SDK's batch queue, the recorder's
writer runs behind a ``NonBlockingSink``); any other sink that might block should be wrapped in one.

It is the project's one bounded queue. As in OpenTelemetry's ``BatchSpanProcessor``, it owns the queue, the worker
thread and the drop policy, and the wrapped sink is a synchronous export of one item at a time.

Contract:
- Threading: ``__call__`` runs on the engine thread. It never waits for the wrapped sink: it appends the batch (as
  a tuple) to a bounded queue under a lock that the worker only holds to take one item, and returns True. One daemon
  thread (``nonblocking-sink:<name>``), started in the constructor, calls the wrapped sink with each batch.
- What is dropped: when ``queue_size`` batches are waiting, the batch is refused (``__call__`` returns False), so the
  bus counts its events in ``bus.dropped[name]`` (and ``kvalloc_events_dropped_total{sink=name}`` shows them).
  The first refusal logs one warning on the ``instrumented_alloc.sinks`` logger; later refusals are only counted.
  After ``close()`` every batch is refused.
- Ordering: the wrapped sink receives the accepted batches in the order they were accepted, one at a time, on the
  worker thread; refused batches are simply missing (the events' ``seq`` shows the gap).
- Failures of the wrapped sink (it raises or returns False) happen after the bus accepted the batch, so they are
  counted here, not in ``bus.dropped``: ``failed_batches``, ``failed_events``, ``last_error``; the first one logs one
  warning. The worker keeps going with the next batch.
- ``name``: what the bus counts under; default the wrapped sink's own name (``events.sink_name``), so wrapping a
  sink does not change its ``dropped`` key or metric label. ``event_types`` is the wrapped sink's, when it has one.
- ``flush(timeout)``: wait until every accepted batch has been handed to the wrapped sink and returned; False on
  timeout. ``close(timeout=5.0)``: refuse from now on, let the worker finish what is queued (waiting at most
  ``timeout`` seconds), stop it; returns whether it finished. A wrapped sink still blocked then keeps the daemon
  thread (it dies with the process); the queue it has not reached is discarded and counted in ``discarded_events``.
  Unsubscribe the wrapper from the allocator before closing it. Idempotent.
- Extensions (for a producer that owns its drop policy, such as the flight recorder): ``put(item, urgent=)``
  queues an item as it is, from one producer thread (no copy, no lock; the caller counts a refusal: put returns
  False and logs nothing);
  ``wake_at``: the worker is woken once that many items wait (or at once for ``urgent``, ``flush``, ``close``, a
  full queue), else it looks every ``poll`` seconds, so an ordinary put costs an append, no thread switch;
  ``idle()``: called on the worker thread when the queue has run empty after work, and again after the seconds it
  returns (None: not until more work); ``on_flush()``: called on the worker thread by ``flush`` once
  every earlier item was handed over (its result is flush's); ``start=False``: the worker starts at ``start()``;
  ``weight(item)``: the events an item holds (for ``discarded_events``); ``thread_name``: the worker's.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

from instrumented_alloc.events import Event, Sink, sink_name

logger = logging.getLogger("instrumented_alloc.sinks")


class _Marker:
    """A flush request in the queue: the worker sets ``done`` (and ``ok``) when it reaches it."""

    __slots__ = ("done", "ok")

    def __init__(self):
        self.done = threading.Event()
        self.ok = False


class NonBlockingSink:
    """Run ``sink`` on its own thread behind a bounded queue (see the module contract)."""

    def __init__(
        self,
        sink: Sink,
        *,
        queue_size: int = 1024,
        name: str | None = None,
        wake_at: int = 1,
        poll: float = 0.05,
        idle: Callable[[], float | None] | None = None,
        on_flush: Callable[[], bool] | None = None,
        weight: Callable[[object], int] = len,
        start: bool = True,
        thread_name: str | None = None,
    ):
        if not callable(sink):
            raise TypeError(f"sink: expected a callable, got {type(sink).__name__}")
        for label, value in (("queue_size", queue_size), ("wake_at", wake_at)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label}: expected an int >= 1, got {value!r}")
        self.sink = sink
        self.name = name or sink_name(sink)
        types = getattr(sink, "event_types", None)
        if types is not None:
            self.event_types = frozenset(types)
        self.queue_size = queue_size  # may be changed at any time
        self._wake_at = wake_at
        self._poll = None if wake_at == 1 else float(poll)  # every put wakes the worker: no polling
        self._idle = idle
        self._on_flush = on_flush
        self._weight = weight
        self._queue: collections.deque = collections.deque()
        lock = threading.Lock()
        self._cv = threading.Condition(lock)  # the worker waits here for work
        self._progress = threading.Condition(lock)  # flush() waits here for the worker
        self._closed = False
        self._markers_in = 0  # flush markers queued (flush, under the lock) and taken (the worker): not items
        self._markers_out = 0
        self._refusal_logged = False
        self._failure_logged = False
        self.accepted = 0  # items queued (flush markers aside)
        self.done = 0  # items the wrapped sink returned from (or raised on)
        self.failed_batches = 0
        self.failed_events = 0
        self.discarded_events = 0
        self.last_error: str | None = None
        thread = thread_name or f"nonblocking-sink:{self.name}"
        self._thread = threading.Thread(target=self._run, name=thread, daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        """Start the worker (once; for ``start=False``)."""
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    # -- engine thread -----------------------------------------------------------------------------------------
    def __call__(self, batch: Sequence[Event]) -> bool:
        with self._cv:
            if self._closed:
                return False
            if len(self._queue) >= self.queue_size:
                full = True
                self._cv.notify()  # a full queue: the worker must be at it
            else:
                full = False
                self._queue.append(tuple(batch))
                self.accepted += 1
                if len(self._queue) >= self._wake_at:
                    self._cv.notify()
        if full:
            if not self._refusal_logged:
                self._refusal_logged = True
                logger.warning(
                    "sink %r is not keeping up (%d batches queued); batches are dropped and counted in "
                    "bus.dropped[%r] until it catches up (further drops are not logged)",
                    self.name,
                    self.queue_size,
                    self.name,
                )
            return False
        return True

    def put(self, item, urgent: bool = False) -> bool:
        """Queue ``item`` for the wrapped sink without waiting; False (nothing queued) when the queue is full or
        closed. ``urgent``: wake the worker now (it is otherwise woken at ``wake_at`` items). One producer thread
        (the engine's): the append takes no lock (a deque's append is atomic; the worker only pops), only a
        wake-up does, so that the worker cannot miss it."""
        queue = self._queue
        if self._closed:
            return False
        if len(queue) >= self.queue_size:
            with self._cv:
                self._cv.notify()  # a full queue: the worker must be at it
            return False
        queue.append(item)
        self.accepted += 1
        if urgent or len(queue) >= self._wake_at:
            with self._cv:
                self._cv.notify()
        return True

    # -- control -----------------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Items accepted and not yet handed to the wrapped sink."""
        return max(0, len(self._queue) - (self._markers_in - self._markers_out))

    def flush(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cv:
            if self._closed or not self._thread.is_alive():
                # No worker to reach a marker: wait for the items to be handed over.
                while self.done < self.accepted and self._thread.is_alive():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._progress.wait(left)
                return self.done >= self.accepted
            marker = _Marker()
            self._queue.append(marker)  # beyond the bound: flush is never refused
            self._markers_in += 1
            self._cv.notify()
        return marker.done.wait(max(0.0, deadline - time.monotonic())) and marker.ok

    def close(self, timeout: float = 5.0) -> bool:
        with self._cv:
            if not self._closed:
                self._closed = True
                self._cv.notify_all()
        if self._thread.ident is not None:
            self._thread.join(max(0.0, timeout))
        if self._thread.is_alive() or self._thread.ident is None:
            with self._cv:
                left, self._queue = self._queue, collections.deque()
                self._markers_in = self._markers_out
            for x in list(left):
                if type(x) is _Marker:
                    x.done.set()
                else:
                    self.discarded_events += self._weight(x)
            return not left and self._thread.ident is None
        return True

    def __repr__(self) -> str:
        return f"NonBlockingSink({self.name!r}, pending={self.pending}, queue_size={self.queue_size})"

    # -- worker thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        # The only consumer: it pops without the lock (a deque's popleft is atomic, and nobody else pops), and takes
        # the lock only to sleep, so that an item costs the worker no lock and no notify.
        worked = False  # items handled since idle() last ran
        idle_at = None  # when idle() asked to run again (monotonic seconds)
        while True:
            queue = self._queue
            if not queue:
                with self._cv:
                    while not self._queue:
                        if self._closed:
                            return
                        if self._idle is not None and (
                            worked or (idle_at is not None and time.monotonic() >= idle_at)
                        ):
                            break
                        wait = self._poll
                        if idle_at is not None:
                            left = max(0.0, idle_at - time.monotonic())
                            wait = left if wait is None else min(wait, left)
                        self._cv.wait(wait)
                if not self._queue:  # the queue ran empty: the wrapped sink's idle work
                    worked = False
                    after = self._call(self._idle, None)
                    idle_at = None if after is None else time.monotonic() + after
                continue
            item = queue.popleft()
            if type(item) is _Marker:
                self._markers_out += 1
                item.ok = bool(self._call(self._on_flush, False)) if self._on_flush is not None else True
                item.done.set()
                continue
            worked = True
            ok: bool | None
            try:
                ok = self.sink(item)
            except Exception as exc:
                ok = False
                self.last_error = f"{type(exc).__name__}: {exc}"
            if ok is False:
                self.failed_batches += 1
                self.failed_events += self._weight(item)
                if not self._failure_logged:
                    self._failure_logged = True
                    logger.warning(
                        "sink %r failed on a batch on its worker thread (%s); such batches are counted in "
                        "failed_events (further failures are not logged)",
                        self.name,
                        self.last_error or "refused",
                    )
            self.done += 1
            if self._closed:  # only a flush after close() waits on done (flush markers otherwise)
                with self._cv:
                    self._progress.notify_all()

    def _call(self, fn, failed):
        try:
            return fn()
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            return failed
