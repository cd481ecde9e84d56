"""Sink adapters for the event bus (``instrumented_alloc.events``). Core: standard library only, no I/O of its own.

``NonBlockingSink(sink, *, queue_size=1024, name=None)`` makes any sink safe to subscribe, however slow it is.

Why: the bus is synchronous (a batch is handed to every sink on the engine's thread, inside the allocator call that
produced it), so that with no sink instrumentation costs nothing and with our own exporters it costs an enqueue.
A sink that blocks (a network call, a disk write, a lock another thread holds) would block the engine's call. Our
exporters never block (Prometheus aggregates in memory, OTel appends to the SDK's batch queue, the recorder puts on
its own bounded queue); any other sink that might block should be wrapped in ``NonBlockingSink``.

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
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence

from instrumented_alloc.events import Event, Sink, sink_name

logger = logging.getLogger("instrumented_alloc.sinks")


class NonBlockingSink:
    """Run ``sink`` on its own thread behind a bounded queue (see the module contract)."""

    def __init__(self, sink: Sink, *, queue_size: int = 1024, name: str | None = None):
        if not callable(sink):
            raise TypeError(f"sink: expected a callable, got {type(sink).__name__}")
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"queue_size: expected an int >= 1, got {queue_size!r}")
        self.sink = sink
        self.name = name or sink_name(sink)
        types = getattr(sink, "event_types", None)
        if types is not None:
            self.event_types = frozenset(types)
        self.queue_size = queue_size
        self._queue: collections.deque = collections.deque()
        lock = threading.Lock()
        self._cv = threading.Condition(lock)  # the worker waits here for work
        self._progress = threading.Condition(lock)  # flush() waits here for the worker
        self._closed = False
        self._refusal_logged = False
        self._failure_logged = False
        self.accepted = 0  # batches queued
        self.done = 0  # batches the wrapped sink returned from (or raised on)
        self.failed_batches = 0
        self.failed_events = 0
        self.discarded_events = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"nonblocking-sink:{self.name}", daemon=True)
        self._thread.start()

    # -- engine thread -----------------------------------------------------------------------------------------
    def __call__(self, batch: Sequence[Event]) -> bool:
        with self._cv:
            if self._closed:
                return False
            if len(self._queue) >= self.queue_size:
                full = True
            else:
                full = False
                self._queue.append(tuple(batch))
                self.accepted += 1
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

    # -- control -----------------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Batches accepted and not yet handed to the wrapped sink."""
        with self._cv:
            return len(self._queue)

    def flush(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.done < self.accepted:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._progress.wait(left)
            return True

    def close(self, timeout: float = 5.0) -> bool:
        with self._cv:
            if not self._closed:
                self._closed = True
                self._cv.notify_all()
        self._thread.join(max(0.0, timeout))
        if self._thread.is_alive():
            with self._cv:
                left, self._queue = self._queue, collections.deque()
                self.discarded_events += sum(len(b) for b in left)
            return False
        return True

    def __repr__(self) -> str:
        return f"NonBlockingSink({self.name!r}, pending={self.pending}, queue_size={self.queue_size})"

    # -- worker thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:  # closed and drained
                    return
                batch = self._queue.popleft()
            ok: bool | None
            try:
                ok = self.sink(batch)
            except Exception as exc:
                ok = False
                self.last_error = f"{type(exc).__name__}: {exc}"
            if ok is False:
                self.failed_batches += 1
                self.failed_events += len(batch)
                if not self._failure_logged:
                    self._failure_logged = True
                    logger.warning(
                        "sink %r failed on a batch on its worker thread (%s); such batches are counted in "
                        "failed_events (further failures are not logged)",
                        self.name,
                        self.last_error or "refused",
                    )
            with self._cv:
                self.done += 1
                self._progress.notify_all()
