"""Pure replay: a base state plus events -> the allocator's page and ledger state at any step.

Contract:
- Pure: numpy, the standard library and this package only; no I/O, no clock, no threads. Functions never mutate
  their inputs unless asked to (``apply(..., inplace=True)``).
- What is reconstructed (``ReplayState``): every pool's page-owner code array (exactly the wrapper shadow's
  ``owner``: index = page id, page 0 included, codes and ledger slots as in ``shadow.py``), the ledger row of every
  live request (``rid -> LedgerRow(allocated, committed, evicted)``), the request id of the ledger slots that
  appear in the owner arrays (``slot_rids``), and the position in the event stream (``step``, ``seq``).
- Which events change it, in ``seq`` order:
  ``PageUpdate``: ``owner[pool][pages] = owners`` (how the shadow changed, emitted in order); one that lists every
  page ``0..n-1`` is a ``clear()`` (or ``resize()``): the pool becomes that array (size included) and, as the
  wrapper does then, every live request's ledger row is zeroed;
  ``LedgerUpdate``: the listed rows are set (and their slots named);
  ``LedgerWrite``: one field of one row is set (the row is created, zeroed, if it was unknown);
  ``RequestReleased``: the row is dropped (a leaked slot keeps its name: its pages still carry it);
  ``Snapshot`` (the wrapper's own periodic snapshot): that pool's owners and the whole ledger are replaced;
  ``StepBoundary``: ``step`` moves to the boundary's step. Every other event leaves the state as it is.
  ``EventsLost`` (a marker a recorder writes where it could not take some events) makes replay across it
  impossible: ``apply`` raises ``IncompleteHistory``.
- Events whose ``seq`` is at or before ``state.seq`` are already part of the state and are skipped, so a base
  snapshot plus "every event after it" is applied without double counting. Events must come in ``seq`` order.
- The state at step N is: the newest base snapshot at or before N (a snapshot taken at a step boundary carries
  that ``StepBoundary``'s seq) + every event with a seq after the snapshot's seq, up to and including the
  ``StepBoundary`` of step N (``state_at``). The StepBoundary of step N follows all of step N's page and ledger
  events (``alloc.step()`` flushes them first), so this is what ``alloc.snapshot(wait=False)`` returned right after
  ``alloc.step()`` made ``step_count == N`` (the same as ``snapshot()`` unless deferred device checks were still in
  flight: their page changes are published, and replayed, when they complete). A base taken between boundaries
  (a recorder attached mid-run) is the state at the moment it was taken; it answers for its own step when no
  boundary of that step follows it.
- Replay trusts the wrapper's event contract (``events.py``): page and ledger changes are published completely and
  in order. It infers one change the wrapper does not publish as a ledger event: the ledger reset of ``clear()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from instrumented_alloc import events as ev
from instrumented_alloc.shadow import PRISTINE, RESERVED, LedgerSnapshot, PoolSnapshot

LEDGER_FIELDS = {"kv_allocated_len": 0, "kv_committed_len": 1, "swa_evicted_seqlen": 2}


class IncompleteHistory(ValueError):
    """Replay would cross events that were lost (an ``EventsLost`` marker): the state cannot be reconstructed."""


@dataclass(frozen=True)
class EventsLost(ev.Event):
    """A recorder could not take the events ``first_seq..last_seq`` (``n_events``): replay cannot cross here.
    ``seq`` is ``last_seq`` (a seq no recorded event has), ``step``/``ts`` those of the next recorded event."""

    first_seq: int = 0
    last_seq: int = 0
    n_events: int = 0


class LedgerRow(NamedTuple):
    allocated: int
    committed: int
    evicted: int


@dataclass
class ReplayState:
    """Pages and ledger at one point of the event stream (see the module contract)."""

    step: int
    seq: int
    owners: dict[str, np.ndarray]
    ledger: dict = field(default_factory=dict)
    slot_rids: dict = field(default_factory=dict)
    # The slot each request was last named at (slot_rids keeps older names: a leaked slot's pages still carry
    # its request's name, and a retracted request re-prefilled under its id gets a new slot).
    rid_slots: dict = field(default_factory=dict)

    def copy(self) -> ReplayState:
        return ReplayState(
            step=self.step,
            seq=self.seq,
            owners={k: v.copy() for k, v in self.owners.items()},
            ledger=dict(self.ledger),
            slot_rids=dict(self.slot_rids),
            rid_slots=dict(self.rid_slots),
        )

    def rids_in(self, pool: str) -> dict:
        """``slot -> rid`` for the slots that own pages of ``pool`` (as ``PoolSnapshot.slot_rids`` per pool)."""
        o = self.owners[pool]
        return {int(s): self.slot_rids.get(int(s)) for s in np.unique(o[o >= 0])}


def initial_owner(num_pages: int) -> np.ndarray:
    """The owner codes of a cleared pool of ``num_pages`` pages: ``num_pages + 1`` entries, page 0 RESERVED, the
    others PRISTINE (as ``PoolShadow.clear()`` leaves them)."""
    if num_pages < 0:
        raise ValueError(f"num_pages must be >= 0, got {num_pages}")
    owner = np.full(num_pages + 1, PRISTINE, np.int32)
    owner[0] = RESERVED
    return owner


def initial_state(pools: Mapping[str, int], *, step: int = 0, seq: int = 0) -> ReplayState:
    """A fresh allocator: every pool (name -> num_pages) cleared, no request."""
    return ReplayState(step=step, seq=seq, owners={n: initial_owner(k) for n, k in pools.items()})


def state_from_snapshots(snapshots: Mapping[str, PoolSnapshot], *, seq: int) -> ReplayState:
    """A base state from ``alloc.snapshot()`` taken when the last published event had seq ``seq``."""
    if not snapshots:
        raise ValueError("state_from_snapshots: no pool snapshot given")
    first = next(iter(snapshots.values()))
    led = first.ledger
    rows = {
        rid: LedgerRow(int(a), int(c), int(e))
        for rid, a, c, e in zip(led.rids, led.allocated, led.committed, led.evicted)
    }
    slot_rids = {int(s): r for s, r in zip(led.slots, led.rids)}
    for snap in snapshots.values():
        slot_rids.update({int(s): r for s, r in snap.slot_rids.items()})
    return ReplayState(
        step=int(first.step),
        seq=int(seq),
        owners={n: np.array(s.owner, dtype=np.int32, copy=True) for n, s in snapshots.items()},
        ledger=rows,
        slot_rids=slot_rids,
        rid_slots={r: int(s) for s, r in zip(led.slots, led.rids)},
    )


def apply(state: ReplayState, events: Iterable[ev.Event], *, inplace: bool = False) -> ReplayState:
    """Apply ``events`` (in seq order) to ``state``; returns the new state (``state`` itself when ``inplace``)."""
    st = state if inplace else state.copy()
    for e in events:
        if e.seq <= st.seq:
            continue
        _apply_one(st, e)
        st.seq = e.seq
    return st


def _apply_one(st: ReplayState, e: ev.Event) -> None:
    if isinstance(e, ev.PageUpdate):
        owner = st.owners.get(e.pool)
        if owner is None:
            raise ValueError(f"event {e.seq}: unknown pool {e.pool!r} (pools: {sorted(st.owners)})")
        pages = np.asarray(e.pages, dtype=np.int64)
        if _full_reset(pages):
            # Every page, page 0 included: the wrapper's clear() (or resize(), with a new size). The wrapper resets
            # the live requests' ledger rows at the same moment, without a ledger event of its own.
            st.owners[e.pool] = np.array(np.broadcast_to(e.owners, pages.shape), dtype=np.int32)
            st.ledger = dict.fromkeys(st.ledger, LedgerRow(0, 0, 0))
            return
        if pages.size and (pages.min() < 0 or pages.max() >= owner.size):
            raise ValueError(f"event {e.seq}: page ids outside pool {e.pool!r} (0..{owner.size - 1})")
        owner[pages] = e.owners
    elif isinstance(e, ev.LedgerUpdate):
        for rid, slot, a, c, x in zip(e.rids, e.slots, e.allocated, e.committed, e.evicted):
            st.ledger[rid] = LedgerRow(int(a), int(c), int(x))
            st.slot_rids[int(slot)] = rid
            st.rid_slots[rid] = int(slot)
    elif isinstance(e, ev.LedgerWrite):
        i = LEDGER_FIELDS.get(e.field)
        if i is None:
            raise ValueError(f"event {e.seq}: unknown ledger field {e.field!r}")
        row = list(st.ledger.get(e.rid, (0, 0, 0)))
        row[i] = int(e.new)
        st.ledger[e.rid] = LedgerRow(*row)
    elif isinstance(e, ev.RequestReleased):
        st.ledger.pop(e.rid, None)
        st.rid_slots.pop(e.rid, None)
    elif isinstance(e, ev.StepBoundary):
        st.step = e.step
    elif isinstance(e, ev.Snapshot):
        st.owners[e.pool] = np.frombuffer(e.owner, dtype="<i4").astype(np.int32)
        st.ledger = {rid: LedgerRow(int(a), int(c), int(x)) for rid, a, c, x in e.ledger}
        st.slot_rids.update({int(s): r for s, r in e.rids})
        st.rid_slots = {r: s for r, s in st.rid_slots.items() if r in st.ledger}  # the slots known for live rows
    elif isinstance(e, EventsLost):
        raise IncompleteHistory(
            f"{e.n_events} events (seq {e.first_seq}..{e.last_seq}, before step {e.step}) were lost: "
            "the state after them cannot be reconstructed from an earlier base"
        )


def _full_reset(pages: np.ndarray) -> bool:
    """Whether a page update lists every page 0..n-1 in order (only a pool's clear does: page 0 is reserved)."""
    n = pages.size
    return bool(n and pages[0] == 0 and pages[-1] == n - 1 and (n == 1 or (np.diff(pages) == 1).all()))


def state_at(bases: Iterable[ReplayState], events: Iterable[ev.Event], step: int) -> ReplayState:
    """The state at step ``step`` (see the module contract) from candidate ``bases`` and the event stream.

    ``bases``: states (snapshots) of the same run; ``events``: the events after them, in seq order. Raises
    ``ValueError`` when no base is at or before ``step``, or when the stream ends before step ``step``'s boundary
    (``IncompleteHistory`` when it crosses lost events).
    """
    events = list(events)
    end = None
    for e in events:
        if isinstance(e, ev.StepBoundary) and e.step == step:
            end = e.seq
    usable = [b for b in bases if b.step <= step and (end is None or b.seq <= end)]
    if end is None:
        # No boundary of that step: only a base taken at that very step answers.
        usable = [b for b in usable if b.step == step]
        if not usable:
            raise ValueError(f"step {step}: no step boundary and no base snapshot of that step")
        return max(usable, key=lambda b: b.seq).copy()
    if not usable:
        raise ValueError(f"step {step}: no base snapshot at or before it")
    base = max(usable, key=lambda b: b.seq)
    return apply(base, (e for e in events if e.seq <= end))


def to_snapshots(state: ReplayState, *, page_size: int, sliding_window: int | None = None) -> dict[str, PoolSnapshot]:
    """The replayed state as ``alloc.snapshot()`` would have returned it (one ``PoolSnapshot`` per pool), so
    ``stats.figures`` reads a recording exactly as it reads a live allocator. Ledger rows whose slot no page
    names get slot -1 (they hold no pages, so no figure counts them by slot)."""
    # A request's slot: where it was last named (a stale name of an earlier incarnation must not win); a request
    # known only from a snapshot's owner names, where its pages name it.
    slot_of = {rid: s for s, rid in state.slot_rids.items()}
    slot_of.update(state.rid_slots)
    rids = tuple(state.ledger)
    rows = [state.ledger[r] for r in rids]
    ledger = LedgerSnapshot(
        rids=rids,
        slots=np.array([slot_of.get(r, -1) for r in rids], np.int64),
        allocated=np.array([r.allocated for r in rows], np.int64),
        committed=np.array([r.committed for r in rows], np.int64),
        evicted=np.array([r.evicted for r in rows], np.int64),
        sliding_window=sliding_window,
    )
    return {
        name: PoolSnapshot(
            pool=name,
            page_size=int(page_size),
            num_pages=int(owner.size - 1),
            owner=owner.copy(),
            step=state.step,
            ledger=ledger,
            slot_rids=state.rids_in(name),
        )
        for name, owner in state.owners.items()
    }
