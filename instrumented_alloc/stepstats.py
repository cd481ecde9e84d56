"""Per-step statistics: what the per-call events of one step would sum to, kept without building them.

Contract: ``StepAccumulator`` is written only by the wrapper, under its lock, at the sites that build (or would
build) ``Alloc``, ``Free``, ``AllocFailed`` and ``SwaEvict``; ``take()`` hands its dicts over at a boundary (they
become the ``StepStats`` event's, never written again) and starts fresh ones. Its sums are exactly what the per-call
events of the same calls carry: pages per pool, one duration per call, refusals per (pool, op), evicted tokens.
Bounded: ``alloc``/``free`` return True once an op holds ``MAX_PENDING`` durations, and the wrapper then publishes
at once (a caller that never steps must not grow the lists without end).
"""

from __future__ import annotations

# Ops that touch only the SWA pool: the SWA frees, and every call on the SWA pool's own allocator (its checked
# view, see the wrapper's _PoolView). Every other call publishes a "full" event, which carries the call's duration:
# a call's duration is counted once, from its "full" event or else from its SWA-only one.
SWA_ONLY_OPS = frozenset(
    {
        "free_swa",
        "free_swa_segment",
        "swa_attn_allocator.alloc",
        "swa_attn_allocator.free",
        "swa_attn_allocator.free_segment",
        "swa_attn_allocator.free_page_ids",
    }
)


# Durations one op may hold before the wrapper publishes them without waiting for a boundary.
MAX_PENDING = 65536


class StepAccumulator:
    """What happened since the last boundary (see the module docstring). ``allocated``/``freed``: pool -> pages
    (a pool appears once it moved a page); ``durations``: op -> each call's seconds, in call order; ``failures``:
    (pool, op) -> refusals; ``evicted``: SWA-evicted tokens (only increases count)."""

    __slots__ = ("allocated", "durations", "evicted", "failures", "freed")

    def __init__(self):
        self.allocated: dict[str, int] = {}
        self.freed: dict[str, int] = {}
        self.durations: dict[str, list[float]] = {}
        self.failures: dict[tuple[str, str], int] = {}
        self.evicted = 0

    def alloc(self, op: str, pool: str, n_pages: int, duration: float) -> bool:
        """What an ``Alloc`` event of these fields carries. True: publish now (see the module docstring)."""
        if n_pages:
            d = self.allocated
            d[pool] = d.get(pool, 0) + n_pages
        return (pool == "full" or op in SWA_ONLY_OPS) and self._duration(op, duration)

    def free(self, op: str, pool: str, n_pages: int, duration: float) -> bool:
        """What a ``Free`` event of these fields carries. True: publish now (see the module docstring)."""
        if n_pages:
            d = self.freed
            d[pool] = d.get(pool, 0) + n_pages
        return (pool == "full" or op in SWA_ONLY_OPS) and self._duration(op, duration)

    def _duration(self, op: str, duration: float) -> bool:
        durations = self.durations.get(op)
        if durations is None:
            durations = self.durations[op] = []
        durations.append(duration)
        return len(durations) >= MAX_PENDING

    def failure(self, pool: str, op: str) -> None:
        """What an ``AllocFailed`` event carries."""
        key = (pool, op)
        self.failures[key] = self.failures.get(key, 0) + 1

    def evict(self, old: int, new: int) -> None:
        """What a ``SwaEvict`` event carries: its growth counts (a decrease evicts nothing)."""
        if new > old:
            self.evicted += new - old

    def take(self) -> tuple[dict, dict, dict, dict, int]:
        """``(allocated, freed, durations, failures, evicted)``, handed over; the accumulator starts empty."""
        out = (self.allocated, self.freed, self.durations, self.failures, self.evicted)
        self.allocated, self.freed, self.durations, self.failures, self.evicted = {}, {}, {}, {}, 0
        return out
