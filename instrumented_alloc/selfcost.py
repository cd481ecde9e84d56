"""What the instrumentation itself costs the engine: host seconds on the engine's thread, by part, per iteration.

Contract:
- Measured at boundaries only: a clock read where the engine's code hands over to ours (a wrapper call, a plugin
  hook, a routed write) and where ours hands back (the inner allocator's call, SGLang's original function, the
  sinks), never per inner operation. Each stretch of our code is charged to one part:
  - ``hooks``: the SGLang plugin's request bookkeeping in its hooks (naming the batch's requests, releases, the
    prefix cache's transfers);
  - ``ledger``: the request records' length writes (raise mode: each routed write; record mode: their deferred
    verification at the iteration boundary);
  - ``checks``: the wrapper's own work in an allocator call, the step boundary and the idle sweep (the events it
    builds included);
  - ``exporters``: the sinks' work on the engine's thread (what ``EventBus.deliver`` runs: the Prometheus sink's
    updates, the recorder's enqueue, the span bookkeeping). Their background threads are not the engine's time.
- ``start()`` opens a stretch, ``stop_<part>()`` charges it to that part and goes on with a new one from the same
  instant (a switch from one part to another is one call), ``end_<part>()`` charges it and closes it. Nested
  boundaries need no depth: our code that calls engine code stops its stretch first and starts a new one when it
  returns, so a wrapper call made from inside SGLang's original function inside a plugin hook is charged once,
  to its own part; a hook that calls the wrapper stops its stretch first, and goes on from the wrapper's end.
- The engine's thread is the only writer. Another thread (a scrape) reads ``totals()``: four floats, each as of
  some moment, never torn.
- ``close_iteration()`` marks a scheduler iteration's end (the wrapper's ``step()``): it counts the iteration and
  returns the seconds charged since the previous mark, what the per-iteration histogram observes.
- Pure: no I/O, no global state; the clock is a parameter.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PARTS = ("hooks", "ledger", "checks", "exporters")


class SelfCost:
    __slots__ = ("aside", "checks", "clock", "exporters", "hooks", "iterations", "ledger", "mark", "open", "since")

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.since = 0.0  # where the open stretch began
        # A stretch is open (from start() to the end_*() that closes it): what a switch in code that also runs
        # outside any charged call tests first (a stop there would charge the engine's time since the last one).
        self.open = False
        self.hooks = self.ledger = self.checks = self.exporters = 0.0
        self.iterations = 0
        self.mark = 0.0  # the total at the last close_iteration()
        self.aside = 0.0  # the seconds set aside (see set_aside): in the totals, in no iteration

    def start(self) -> None:
        self.since = self.clock()
        self.open = True

    def stop_hooks(self) -> None:
        t = self.clock()
        self.hooks += t - self.since
        self.since = t

    def stop_ledger(self) -> None:
        t = self.clock()
        self.ledger += t - self.since
        self.since = t

    def stop_checks(self) -> None:
        t = self.clock()
        self.checks += t - self.since
        self.since = t

    def stop_exporters(self) -> None:
        t = self.clock()
        self.exporters += t - self.since
        self.since = t

    def end_checks(self) -> None:
        self.stop_checks()
        self.open = False

    def end_hooks(self) -> None:
        self.stop_hooks()
        self.open = False

    def end_ledger(self) -> None:
        self.stop_ledger()
        self.open = False

    def total(self) -> float:
        return self.hooks + self.ledger + self.checks + self.exporters

    def totals(self) -> tuple[float, float, float, float]:
        """Cumulative seconds per part, in ``PARTS`` order."""
        return (self.hooks, self.ledger, self.checks, self.exporters)

    def close_iteration(self) -> float:
        """Count an iteration; the seconds charged since the last call."""
        total = self.hooks + self.ledger + self.checks + self.exporters
        spent, self.mark = total - self.mark, total
        self.iterations += 1
        return spent

    def set_aside(self) -> None:
        """What was charged since the last iteration's end belongs to no iteration (an idle sweep): it stays in the
        totals and is left out of the next ``close_iteration()``."""
        total = self.hooks + self.ledger + self.checks + self.exporters
        self.aside += total - self.mark
        self.mark = total

    def as_dict(self) -> dict:
        """``{"iterations": n, "seconds": {part: s}, "aside": s}``: what reports and tests read."""
        return {"iterations": self.iterations, "seconds": dict(zip(PARTS, self.totals())), "aside": self.aside}
