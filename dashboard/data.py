"""Data access for the dashboard: which recordings it may open, and the queries each view needs.

Contract:
- Confinement: the dashboard opens only regular files under its configured directory (``RecordingDir``):
  a name is resolved (symlinks and ``..`` included) and refused unless the result lies inside the directory.
  Files are opened with ``Recording`` (SQLite ``mode=ro``): the dashboard never writes a recording.
- Every query goes to SQLite through ``Recording``'s public methods (aggregates, step ranges, one step's
  replay, one request's span): nothing here reads a whole recording into memory. The cost of each function
  is bounded by its arguments (a step, a request's lifetime, ``max_points``), not by the recording's size,
  except where noted.
- Errors a user can cause (a missing file, a file that is not a recording, a step that is not recorded, a name
  outside the directory) raise ``DashboardInputError`` whose message is what the page shows.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from exporters.recorder.reader import Recording, RecordingError
from instrumented_alloc import replay
from instrumented_alloc.replay import IncompleteHistory, ReplayState
from instrumented_alloc.selfcost import PARTS

SUFFIXES = (".sqlite", ".sqlite3", ".db", ".rec")
LIFELINE_KINDS = (
    "Alloc",
    "AllocFailed",
    "Free",
    "LedgerUpdate",
    "LedgerWrite",
    "SwaEvict",
    "RequestReleased",
    "ViolationEvent",
)
# The event kinds that change a replayed state (replay.py's contract).
STATE_KINDS = ("PageUpdate", "LedgerUpdate", "LedgerWrite", "RequestReleased", "StepBoundary", "EventsLost")
LIFELINE_MAX_STEPS = 5000  # a request's lifeline reads at most this many steps of events (the newest)
SELF_COST_STEPS = 200  # the live view's self-cost: over the newest this many steps (scheduler iterations)


class DashboardInputError(ValueError):
    """Something the user asked for cannot be shown; the message says what and why."""


def home_expanded(path: str) -> Path:
    """``path`` with a leading ``~`` or ``~/`` read as the user's home, as a shell does; any other name is taken
    literally. (``Path.expanduser`` also reads ``~name`` as user *name*'s home and raises when there is no such
    user, which made a recording named ``~x.sqlite`` unopenable.)"""
    if path == "~" or path.startswith("~" + os.sep):
        return Path(path).expanduser()
    return Path(path)


class RecordingDir:
    """The directory whose recordings the dashboard may open."""

    def __init__(self, root):
        self.root = home_expanded(os.fspath(root)).resolve()
        if not self.root.is_dir():
            raise DashboardInputError(f"{self.root}: not a directory (the dashboard's recording directory)")

    def names(self) -> list[str]:
        """Recording files directly under the directory (by suffix), newest first; SQLite's -wal/-shm excluded."""
        files = []
        for p in self.root.iterdir():
            if p.suffix in SUFFIXES and p.is_file() and not p.is_symlink():
                files.append((p.stat().st_mtime, p.name))
        return [n for _, n in sorted(files, key=lambda x: (-x[0], x[1]))]

    def resolve(self, name) -> Path:
        """The file ``name`` (relative to the directory, or absolute) names, if it lies inside the directory."""
        raw = home_expanded(os.fspath(name))
        p = (raw if raw.is_absolute() else self.root / raw).resolve()
        if p != self.root and self.root not in p.parents:
            raise DashboardInputError(
                f"{name}: outside the dashboard's recording directory {self.root} (start the dashboard with "
                "--dir to choose another)"
            )
        return p

    def open(self, name) -> Recording:
        """The recording ``name``, read-only; ``DashboardInputError`` with the reader's reason otherwise."""
        p = self.resolve(name)
        try:
            return Recording(p)
        except RecordingError as exc:  # RecordingNotFoundError included
            msg = str(exc)
            if "malformed" in msg:
                msg += ": the file is damaged or incomplete (cut short, or copied without its -wal file)"
            raise DashboardInputError(msg) from exc


@dataclass(frozen=True)
class Overview:
    """What every view needs first: the step range and the run's metadata."""

    first: int
    last: int
    meta: dict
    pools: list
    events: int
    violations: int
    finished: bool


def overview(rec: Recording) -> Overview:
    meta = rec.meta
    try:
        first, last = rec.steps()
    except RecordingError as exc:
        raise DashboardInputError(f"{rec.path}: {exc}") from exc
    counts = rec.violation_counts()
    return Overview(
        first=first,
        last=last,
        meta=meta,
        pools=list(meta.get("pools", [])),
        events=rec.event_count(),
        violations=sum(counts.values()),
        finished="end_time" in meta,
    )


def state_at(rec: Recording, step: int) -> ReplayState:
    """The replayed state at ``step``; ``DashboardInputError`` when that step cannot be rebuilt."""
    try:
        return rec.state_at(step)
    except IncompleteHistory as exc:
        raise DashboardInputError(f"step {step} cannot be rebuilt: events before it were lost ({exc})") from exc
    except ValueError as exc:  # not in the recording; RecordingError (a ValueError) for an unreadable file
        raise DashboardInputError(str(exc)) from exc


def snapshot_states(rec: Recording, steps) -> list[tuple[int, ReplayState]]:
    """``(step, state)`` for each of ``steps`` (snapshot steps read a moment before) still in the recording, in the
    order given. A live recording's retention may delete the oldest of them between that read and this one: those
    are left out, not an error. Any other failure: ``DashboardInputError``."""
    out = []
    for s in steps:
        try:
            out.append((s, rec.state_at(s)))
        except IncompleteHistory as exc:
            raise DashboardInputError(f"step {s} cannot be rebuilt: events before it were lost ({exc})") from exc
        except ValueError as exc:
            if s < rec.steps()[0]:
                continue  # retention deleted it since the steps were read
            raise DashboardInputError(str(exc)) from exc
    return out


def state_end_of(rec: Recording, step: int) -> ReplayState:
    """The state at the end of step ``step``: the replayed state at its boundary plus the events stamped with that
    step (an event's ``step`` is the step counter when it happened, so a violation of step N is in this state,
    and for the last step of a live recording it is the newest committed state)."""
    st = state_at(rec, step)
    _no_loss_within(rec, step, st.seq)
    try:
        return replay.apply(st, rec.events(start=step, stop=step + 1, kinds=STATE_KINDS), inplace=True)
    except IncompleteHistory as exc:
        raise DashboardInputError(f"step {step} cannot be rebuilt: events in it were lost ({exc})") from exc


def _no_loss_within(rec: Recording, step: int, after_seq: int) -> None:
    """DashboardInputError when events of step ``step`` (after its boundary, seq ``after_seq``, and before the next
    step's boundary) were lost. Their ``EventsLost`` marker is stamped with the step of the next event recorded,
    which may be a later step: the events of this step alone would not cross it."""
    nxt = next(iter(rec.events(start=step + 1, stop=step + 2, kinds=("StepBoundary",))), None)
    before_seq = nxt.seq if nxt is not None else float("inf")
    for m in rec.events(start=step, kinds=("EventsLost",)):
        if m.first_seq > before_seq:
            break
        if m.last_seq > after_seq:
            raise DashboardInputError(
                f"step {step} cannot be rebuilt: {m.n_events} events in it were lost (seq {m.first_seq}..{m.last_seq}: "
                "the recorder's queue was full)"
            )


def recent_events(rec: Recording, step: int, lookback: int) -> list:
    """The page events of steps ``step - lookback .. step`` (what the SWA-evicted marking reads)."""
    return list(rec.events(start=max(0, step - lookback), stop=step + 1, kinds=("PageUpdate", "SwaEvict", "Free")))


def request_history(
    rec: Recording, rid, first_step: int, live_at: int | None = None
) -> tuple[list, tuple | None, int, int] | None:
    """The events one request's lifeline reads, with the ledger row it had before them.

    Returns (events, start_ledger, lo, hi) or None when the recording has nothing under ``rid``. The span comes
    from ``Recording.request_span`` (events stored under the request id: its own calls, ledger writes,
    release, violations); a batch call for several requests is not indexed by request, so the span is widened
    back to the newest snapshot step at which the request was not yet live (found by replaying snapshot steps,
    cheap: a snapshot step replays no event), and forward to the end of the recording when it was never
    released. ``live_at``: a step at which the request is known to be live (the state the caller picked it
    from): the span includes it, so a request whose every event so far is a batch call (a dense model's
    requests before their release, an SWA model's before their first eviction) still has its history. Bounded
    by ``LIFELINE_MAX_STEPS`` steps (the newest are kept)."""
    span = rec.request_span(rid)
    if span is None:
        if live_at is None:
            return None
        span = (live_at, live_at)
    elif live_at is not None:
        span = (min(span[0], live_at), max(span[1], live_at))
    lo, hi = span
    released = any(
        getattr(e, "rid", None) == rid for e in rec.events(start=hi, stop=hi + 1, kinds=("RequestReleased",))
    )
    if not released:
        hi = rec.steps()[1]
    start_ledger = None
    # The request is live at every snapshot from its first allocation to ``lo``: binary-search the newest snapshot
    # at which it was not (a handful of replays of snapshot steps, each a base with no event to apply).
    snaps = [s for s in rec.snapshot_steps() if s <= lo][-64:]
    live_at = {}

    def live(i: int) -> bool:
        if i not in live_at:
            try:
                row = rec.state_at(snaps[i]).ledger.get(rid)
            except ValueError:
                row = None
            live_at[i] = row
        return live_at[i] is not None

    a, b = 0, len(snaps) - 1
    if snaps and live(a):
        lo, start_ledger = snaps[0], tuple(live_at[0])  # born before the oldest snapshot searched
    elif snaps:
        while a < b:  # invariant: not live at a
            m = (a + b + 1) // 2
            if live(m):
                b = m - 1
            else:
                a = m
        lo = snaps[a]
    lo = max(lo, hi - LIFELINE_MAX_STEPS, first_step)
    if lo > first_step and start_ledger is None:
        st = state_at(rec, lo)
        row = st.ledger.get(rid)
        start_ledger = tuple(row) if row is not None else None
    # The state at step s (after boundary s) plus every event stamped with a step >= s: events of step s come
    # after its boundary.
    events = list(rec.events(start=lo, stop=hi + 1, kinds=LIFELINE_KINDS))
    return events, start_ledger, lo, hi


@dataclass(frozen=True)
class SelfCostWindow:
    """What the instrumentation cost the engine's thread over a recording's newest iterations (``self_cost``).

    ``recorded``: whether the step boundaries carry the self-cost (False for a recording made before they did:
    "not recorded", every figure None). ``first``, ``last``: the steps of the oldest and newest boundary of the
    window that carry it; ``iterations``: ``last - first`` (each step boundary closes one scheduler iteration, so
    boundaries lost from the recording do not shorten it); 0 with fewer than two such boundaries (every figure
    None). ``seconds``: the recording's clock from the oldest boundary to the newest. ``per_iteration``: part
    (``selfcost.PARTS``, in order) -> host seconds per iteration: the part's cumulative seconds at the newest
    boundary minus at the oldest, over ``iterations`` (what ``kvalloc_overhead_seconds_total`` over the iteration
    count gives in Grafana; time charged outside any iteration, an idle sweep's, is included). ``total``: their
    sum. ``iterations_per_second``: ``iterations / seconds``. ``p50``, ``p99``: of the newer boundaries'
    ``iteration_seconds`` (one per iteration of the window; nearest rank: an iteration's own value)."""

    recorded: bool
    first: int | None = None
    last: int | None = None
    iterations: int = 0
    seconds: float | None = None
    per_iteration: dict | None = None
    total: float | None = None
    iterations_per_second: float | None = None
    p50: float | None = None
    p99: float | None = None


def _nearest_rank(sorted_values: list, q: float) -> float:
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def self_cost(rec: Recording, last: int, steps: int = SELF_COST_STEPS) -> SelfCostWindow:
    """The self-cost over steps ``last - steps .. last`` (``last``: the recording's newest step, ``Overview.last``),
    from the step boundaries there alone: reads the events of that step range only (``Recording.events`` with a
    step range and the boundary kind), however long the recording."""
    boundaries = list(rec.events(start=max(0, last - steps), stop=last + 1, kinds=("StepBoundary",)))
    if boundaries and not any(b.overhead for b in boundaries):
        return SelfCostWindow(recorded=False)
    boundaries = [b for b in boundaries if len(b.overhead) == len(PARTS)]
    if len(boundaries) < 2 or boundaries[-1].step <= boundaries[0].step:
        return SelfCostWindow(recorded=True)
    old, new = boundaries[0], boundaries[-1]
    n = new.step - old.step
    per = {part: (b - a) / n for part, a, b in zip(PARTS, old.overhead, new.overhead)}
    seconds = new.ts - old.ts
    costs = sorted(b.iteration_seconds for b in boundaries[1:])
    return SelfCostWindow(
        recorded=True,
        first=old.step,
        last=new.step,
        iterations=n,
        seconds=seconds,
        per_iteration=per,
        total=sum(per.values()),
        iterations_per_second=n / seconds if seconds > 0 else None,
        p50=_nearest_rank(costs, 0.5),
        p99=_nearest_rank(costs, 0.99),
    )


def request_choices(rec: Recording, state: ReplayState, violations) -> list:
    """Request ids worth a drill-down: those named by a violation (recording order), then those live at the
    step, without repeats."""
    out: list = []
    seen = set()
    for r in [v.rid for v in violations if v.rid is not None] + list(state.ledger):
        if r not in seen:
            seen.add(r)
            out.append(r)
    return out


__all__ = [
    "LIFELINE_KINDS",
    "SELF_COST_STEPS",
    "DashboardInputError",
    "Overview",
    "RecordingDir",
    "SelfCostWindow",
    "overview",
    "recent_events",
    "request_choices",
    "request_history",
    "self_cost",
    "state_at",
    "state_end_of",
]
