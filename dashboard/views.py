"""Pure view functions: recording data (``Recording`` query results, replayed states, events) -> what the
dashboard shows (rows, series, figures, messages).

Contract: pure (numpy, the standard library, ``instrumented_alloc``; the recorder's exception types); no I/O, no
Streamlit, no clock. Inputs are never mutated. Rows are lists of dicts with fixed keys (the column names the app
shows), series are dicts of equal-length lists, so the app only lays them out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from exporters.recorder.reader import RecordingError, RecordingNotFoundError
from instrumented_alloc import events as ev
from instrumented_alloc.invariants import Violation
from instrumented_alloc.replay import ReplayState, to_snapshots
from instrumented_alloc.shadow import FREE
from instrumented_alloc.stats import pool_figures, requests_live, swa_outside_window_tokens

# A recording keeps trace ids with violations only: a request without a violation (or one whose span was not
# sampled, or no tracing) has none here.
NO_TRACE = "none recorded (trace ids are kept with violations only)"
# Ops that free pages of the SWA pool (an SWA eviction frees with one of them, then writes swa_evicted_seqlen).
SWA_FREE_OPS = frozenset({"free_swa", "free_swa_segment"})


# The run metadata that tells one rank's recording from another's, in the order shown: what ``instrumented-alloc
# demo`` writes (``engine``, its --engine-label) and what an engine passes as ``FlightRecorder(meta=...)`` for its
# scheduler process (the Prometheus exporter's const labels: ``tp_rank``, ``dp_rank``, ...; or one ``rank``).
RUN_KEYS = ("engine", "rank", "tp_rank", "pp_rank", "dp_rank", "ep_rank")


# -- the recording -------------------------------------------------------------------------------------------------
def run_identity(meta: Mapping) -> str:
    """Which engine and rank a recording is of, from its run metadata: "engine e0 · rank 0 · tp_rank 0" (the keys of
    ``RUN_KEYS`` the metadata has, in that order, with their values as stored); "" when it has none."""
    return " · ".join(f"{k} {_md(str(meta[k]))}" for k in RUN_KEYS if meta.get(k) is not None)


def code(text: str) -> str:
    """``text`` as one markdown code span, whatever it holds: fenced by more backticks than its longest run of
    them (padded with a space where it starts or ends with one), so that a name with a backtick cannot open or
    close a span of its own and leave ``$...$``, ``a@b`` or ``*`` outside one (rendered as maths, a mail link,
    emphasis)."""
    longest = run = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _n(n: int, what: str) -> str:
    return f"{n:,} {what}" + ("" if n == 1 else "s")


def recording_caption(name: str, ov) -> str:
    """The line that heads one recording's view: its name, engine and rank (``run_identity``), steps, events,
    violations, page size, window and whether it was closed. ``ov``: the recording's ``dashboard.data.Overview``
    (first, last, meta, events, violations, finished)."""
    who = run_identity(ov.meta)
    return (
        f"{code(name)} · "
        + (f"{who} · " if who else "")
        + f"steps {ov.first}..{ov.last} · {_n(ov.events, 'event')} · {_n(ov.violations, 'violation')} · page size "
        f"{ov.meta.get('page_size')} · window {ov.meta.get('sliding_window')} · "
        + ("finished" if ov.finished else "not closed (still being written, or cut off by a crash)")
    )


# -- violations ---------------------------------------------------------------------------------------------------
def violation_rows(violations: Iterable[Violation], *, newest_first: bool = True, limit: int | None = None) -> list:
    """One row per violation: step, invariant, request, pool, op, message, trace id (newest first by default)."""
    rows = [
        {
            "step": int(v.step),
            "invariant": v.invariant,
            "request": "" if v.rid is None else str(v.rid),
            "pool": v.pool or "",
            "op": v.op,
            "message": v.message,
            "trace id": v.trace_id or "",
        }
        for v in violations
    ]
    if newest_first:
        rows.reverse()
    return rows if limit is None else rows[:limit]


def violation_lines(violations: Iterable[Violation]) -> list:
    """One markdown line per violation, in order: ":red[**invariant**] · request **rid** · op (pool): message"."""
    out = []
    for v in violations:
        who = "no request" if v.rid is None else f"request **{v.rid}**"
        where = v.op + (f" ({v.pool})" if v.pool else "")
        out.append(f":red[**{v.invariant}**] · {who} · {where}: {_md(v.message)}")
    return out


def _md(text: str) -> str:
    """Plain text inside markdown: characters markdown would interpret are escaped."""
    for ch in "\\`*_[]<>#|~$":
        text = text.replace(ch, "\\" + ch)
    return text


def violation_summary(counts: Mapping[str, int]) -> list:
    """Rows (invariant, violations) from ``Recording.violation_counts()``, as given (most frequent first)."""
    return [{"invariant": k, "violations": int(n)} for k, n in counts.items()]


def jump_targets(violations: Sequence[Violation], steps: tuple[int, int] | None = None) -> list:
    """(label, step) for the jump-to-violation picker, in recording order: "step 29 · invariant · request".
    ``steps``: the (first, last) steps the recording can rebuild; a violation outside them (retention keeps every
    violation, not the steps before the oldest kept snapshot) jumps to the nearest one, and its label says so."""
    out = []
    for i, v in enumerate(violations):
        who = "" if v.rid is None else f" · {v.rid}"
        step = int(v.step)
        label = f"#{i + 1} step {step} · {v.invariant}{who}"
        if steps is not None and not steps[0] <= step <= steps[1]:
            shown = min(max(step, steps[0]), steps[1])
            label += f" (step {step} is no longer kept: shows step {shown})"
            step = shown
        out.append((label, step))
    return out


# -- time series --------------------------------------------------------------------------------------------------
def occupancy_series(series: Sequence, pools: Sequence[Mapping]) -> dict:
    """Used pages per pool over steps from ``Recording.step_series()``: {"step": [...], "<pool> used": [...]}.
    Used = the pool's pages (page 0 excluded) minus the free + staged entries the step boundary reports (see
    ``StepBoundary``: after a double free, entries the inner lists twice make this lower than the pages in use by
    the duplicates, where the page map and the step's figures count pages)."""
    out: dict = {"step": [int(s) for s, _ in series]}
    for p in pools:
        name, total = p["name"], int(p["num_pages"])
        out[f"{name} used"] = [total - int(avail.get(name, 0)) for _, avail in series]
    return out


def count_series(
    counts: Mapping[str, Sequence], labels: Mapping[str, str], span: tuple[int, int] | None = None, bucket: int = 1
) -> dict:
    """Per-bucket event counts from ``Recording.event_counts()`` as one table: {"step": [...], label: [...]},
    zeros where a kind had no event in a bucket. With ``span`` (first, last step) every bucket of the span is a
    row (a continuous axis: quiet steps show as zeros); without it, only the buckets that had events."""
    steps = sorted({b for rows in counts.values() for b, _ in rows})
    if span is not None:
        bucket = max(1, int(bucket))
        steps = list(range(span[0] // bucket * bucket, span[1] + 1, bucket))
    out: dict = {"step": steps}
    for kind, label in labels.items():
        got = dict(counts.get(kind, ()))
        out[label] = [int(got.get(s, 0)) for s in steps]
    return out


# -- the instrumentation's self-cost --------------------------------------------------------------------------------
NOT_RECORDED = "not recorded"
# What the self-cost figures are compared with: a GPU decode step of a small model at a high batch.
STEP_SCALE = "a GPU decode step of a small model at a high batch takes about 10 ms; 1% of it is 100 µs"


def micros(seconds: float | None) -> str:
    """Seconds as microseconds for the page: "37.2 µs" (one decimal below 1,000 µs, none above); "–" for None."""
    if seconds is None:
        return "–"
    us = seconds * 1e6
    return f"{us:,.1f} µs" if us < 1000 else f"{us:,.0f} µs"


def self_cost_metrics(sc) -> list:
    """The live view's self-cost figures from a ``dashboard.data.SelfCostWindow``: ``[(label, value, help), ...]``:
    iterations per second, host µs per iteration (total, p99, then one per part). A recording whose boundaries do
    not carry the self-cost: every value "not recorded"; fewer than two boundaries: "–"."""
    rows = [
        ("iterations/s", "iterations per second (step boundaries per second of the recording's clock)"),
        ("host µs per iteration", "host time the instrumentation added to one scheduler iteration, on average"),
        ("p99 µs per iteration", "the 99th percentile of one iteration's added host time"),
    ]
    parts = list(sc.per_iteration) if sc.per_iteration else ["hooks", "ledger", "checks", "exporters"]
    rows += [(f"{part} µs", f"host time per iteration charged to {part}") for part in parts]
    if not sc.recorded:
        return [(label, NOT_RECORDED, why) for label, why in rows]
    its = sc.iterations_per_second
    values = [f"{its:,.1f}" if its is not None else "–", micros(sc.total), micros(sc.p99)]
    values += [micros(sc.per_iteration[p]) if sc.per_iteration else "–" for p in parts]
    return [(label, value, why) for (label, why), value in zip(rows, values)]


def self_cost_caption(sc, steps: int) -> str:
    """The line under the self-cost figures: which iterations they cover and what to compare them with."""
    if not sc.recorded:
        return (
            "Self-cost: not recorded (the recording was made before step boundaries carried the instrumentation's "
            "own host time)."
        )
    if not sc.iterations:
        return f"Self-cost: no iteration recorded yet (it needs two step boundaries within the newest {steps} steps)."
    return (
        f"Host time the instrumentation itself spent on the engine's thread per scheduler iteration, over the "
        f"{_n(sc.iterations, 'iteration')} of steps {sc.first}..{sc.last} (median {micros(sc.p50)}). For scale: "
        f"{STEP_SCALE}."
    )


# -- one step's state -----------------------------------------------------------------------------------------------
def pool_snapshots(state: ReplayState, pools: Sequence[Mapping], sliding_window: int | None) -> dict:
    """``PoolSnapshot``s (what ``instrumented_alloc.stats`` reads) of a replayed state, for the pools listed in
    the recording's metadata (their pools page in step, so they share one page size)."""
    page_size = int(pools[0]["page_size"]) if pools else 1
    snaps = to_snapshots(state, page_size=page_size, sliding_window=sliding_window)
    return {p["name"]: snaps[p["name"]] for p in pools}


def step_figures(state: ReplayState, pools: Sequence[Mapping], sliding_window: int | None) -> dict:
    """The metric catalog's figures at one step: {"pools": [row per pool], "requests_live",
    "swa_outside_window_tokens", "step"}; a pool row: pool, free, used, staged, reserved, free runs,
    largest free run, external fragmentation, internal fragmentation (ratios rounded to 4 places)."""
    snaps = pool_snapshots(state, pools, sliding_window)
    rows = []
    for name, snap in snaps.items():
        f = pool_figures(snap)
        s = f["pages_by_state"]
        rows.append(
            {
                "pool": name,
                "free": s["free"],
                "used": s["used"],
                "staged": s["staged"],
                "reserved": s["reserved"],
                "free runs": f["free_run_count"],
                "largest free run": f["largest_free_run"],
                "external fragmentation": round(f["external_fragmentation"], 4),
                "internal fragmentation": round(f["internal_fragmentation"], 4),
            }
        )
    ledger = next(iter(snaps.values())).ledger if snaps else None
    return {
        "pools": rows,
        "requests_live": requests_live(ledger) if ledger is not None else 0,
        "swa_outside_window_tokens": swa_outside_window_tokens(ledger) if ledger is not None else 0,
        "step": int(state.step),
    }


def violation_slots(state: ReplayState, violations: Iterable[Violation], step: int) -> set:
    """Ledger slots (page owners in ``state``) of the requests named by a violation at or before ``step``: the
    pages the page map marks "in a violation" (a leaked request's pages stay marked while it holds them)."""
    named = {v.rid for v in violations if v.rid is not None and v.step <= step}
    return {int(s) for s, r in state.slot_rids.items() if r in named}


def swa_evicted_pages(events: Iterable[ev.Event], pool: str = "swa") -> np.ndarray:
    """Pages of ``pool`` released by an SWA eviction in ``events`` (in seq order) and not handed out again.

    The rule (the wrapper does not tag a free as an eviction): an eviction is the engine's SWA free
    (``free_swa``/``free_swa_segment``) followed by the request's ``swa_evicted_seqlen`` write (a ``SwaEvict``
    event) before any other SWA free; the pages that free released are "SWA-evicted" until a later change
    gives them an owner again."""
    evicted: set = set()
    pending: list = []
    for e in events:
        if isinstance(e, ev.PageUpdate) and e.pool == pool:
            pages = np.asarray(e.pages, np.int64).ravel()
            owners = np.broadcast_to(np.asarray(e.owners), pages.shape)
            freed = pages[owners <= FREE]
            taken = pages[owners > FREE]
            evicted.difference_update(taken.tolist())
            if e.op in SWA_FREE_OPS:
                pending = freed.tolist()
            elif freed.size:  # another kind of free (a finish through free()): not an eviction
                evicted.difference_update(freed.tolist())
                pending = []
        elif isinstance(e, ev.SwaEvict):
            evicted.update(pending)
            pending = []
    return np.array(sorted(evicted), np.int64)


# -- one request's lifeline -----------------------------------------------------------------------------------------
def _call(rids) -> str:
    """How a call's totals read in one request's lifeline: a batch call's figures are the whole batch's."""
    return f"batch of {len(rids)} requests, " if len(rids) > 1 else ""


def _ledger_after(e, rid, cur: list) -> bool:
    """Update ``cur`` ([allocated, committed, evicted]) from a ledger event of ``rid``; True when it changed."""
    before = list(cur)
    if isinstance(e, ev.LedgerUpdate):
        for i, r in enumerate(e.rids):
            if r == rid:
                cur[:] = [int(e.allocated[i]), int(e.committed[i]), int(e.evicted[i])]
    elif isinstance(e, ev.LedgerWrite) and e.rid == rid:
        idx = {"kv_allocated_len": 0, "kv_committed_len": 1, "swa_evicted_seqlen": 2}.get(e.field)
        if idx is not None:
            cur[idx] = int(e.new)
    return cur != before


def _concerns(e, rid) -> bool:
    if isinstance(e, (ev.Alloc, ev.AllocFailed, ev.Free, ev.LedgerUpdate)):
        return rid in e.rids
    if isinstance(e, (ev.LedgerWrite, ev.SwaEvict, ev.RequestReleased)):
        return e.rid == rid
    if isinstance(e, ev.ViolationEvent):
        return e.violation.rid == rid
    return False


def lifeline(rid, events: Iterable[ev.Event], *, start_ledger: Sequence[int] | None = None) -> dict:
    """One request's KV history from ``events`` (in seq order; events of other requests are ignored).

    Returns {"rows": [...], "ledger": {"step", "kv_allocated_len", "kv_committed_len", "swa_evicted_seqlen"},
    "trace_id", "violations", "released"}. A row: step, mark ("◀ violating write" for a rejected ledger write,
    "⚠ <invariant>" for another violation, else ""), event (what happened), kv_allocated_len / kv_committed_len /
    swa_evicted_seqlen (the ledger after it), detail, seq (the first event's seq). Consecutive events of
    one call (its pools, its ledger update) are one row; consecutive decode steps are one row ("alloc_decode x N").
    ``start_ledger``: the request's ledger row before the first event (None: zeros)."""
    cur = list(start_ledger) if start_ledger is not None else [0, 0, 0]
    raw: list = []  # (key, step, seq, text, mark, detail)
    series = {"step": [], "kv_allocated_len": [], "kv_committed_len": [], "swa_evicted_seqlen": []}
    trace = None
    n_viol = 0
    released = None

    def point(step):
        if series["step"] and series["step"][-1] == step:
            for k in ("step", "kv_allocated_len", "kv_committed_len", "swa_evicted_seqlen"):
                series[k].pop()
        series["step"].append(step)
        series["kv_allocated_len"].append(cur[0])
        series["kv_committed_len"].append(cur[1])
        series["swa_evicted_seqlen"].append(cur[2])

    for e in events:
        if not _concerns(e, rid):
            continue
        changed = _ledger_after(e, rid, cur)
        if changed:
            point(int(e.step))
        if isinstance(e, ev.Alloc):
            raw.append(
                (
                    ("call", e.op, e.step),
                    e.step,
                    e.seq,
                    e.op,
                    "",
                    f"{e.pool}: {_call(e.rids)}{e.n_slots} slots, {e.n_pages} new pages",
                )
            )
        elif isinstance(e, ev.AllocFailed):
            raw.append(
                (
                    ("call", e.op, e.step),
                    e.step,
                    e.seq,
                    f"{e.op} failed",
                    "",
                    f"{e.pool}: {e.requested} wanted, {e.available} available",
                )
            )
        elif isinstance(e, ev.Free):
            raw.append((("call", e.op, e.step), e.step, e.seq, e.op, "", f"{e.pool}: {_call(e.rids)}{e.n_pages} pages"))
        elif isinstance(e, ev.LedgerUpdate):
            raw.append((("call", e.op, e.step), e.step, e.seq, e.op, "", ""))
        elif isinstance(e, ev.LedgerWrite):
            raw.append((("write", e.seq), e.step, e.seq, f"{e.field} = {e.new}", "", f"was {e.old}"))
        elif isinstance(e, ev.SwaEvict):
            raw.append(
                (("write", e.seq - 1), e.step, e.seq, f"SWA eviction {e.old} -> {e.new}", "", f"{e.n_pages} SWA pages")
            )
        elif isinstance(e, ev.RequestReleased):
            released = int(e.step)
            raw.append((("release", e.seq), e.step, e.seq, "released", "", f"{e.pages_held} pages still held"))
        elif isinstance(e, ev.ViolationEvent):
            v = e.violation
            n_viol += 1
            trace = trace or v.trace_id
            mark = "◀ violating write" if v.op == "ledger" else f"⚠ {v.invariant}"
            text = f"REJECTED write: {v.invariant}" if v.op == "ledger" else f"violation: {v.invariant}"
            raw.append((("violation", e.seq), e.step, e.seq, text, mark, v.message))
        raw[-1] = (*raw[-1][:6], tuple(cur))

    rows: list = []
    last_key = None
    for key, step, seq, text, mark, detail, led in raw:
        if key == last_key and rows:
            row = rows[-1]
            if detail and detail not in row["detail"]:
                row["detail"] = f"{row['detail']}; {detail}" if row["detail"] else detail
            row["kv_allocated_len"], row["kv_committed_len"], row["swa_evicted_seqlen"] = led
            continue
        last_key = key
        rows.append(
            {
                "step": int(step),
                "mark": mark,
                "event": text,
                "kv_allocated_len": led[0],
                "kv_committed_len": led[1],
                "swa_evicted_seqlen": led[2],
                "detail": detail,
                "seq": int(seq),
            }
        )
    return {
        "rows": _collapse_decodes(rows),
        "ledger": series,
        "trace_id": trace or NO_TRACE,
        "violations": n_viol,
        "released": released,
    }


def _collapse_decodes(rows: list) -> list:
    """Runs of consecutive one-token decode rows -> one row "alloc_decode x N (steps a-b)"."""
    out: list = []
    run = 0
    for row in rows:
        if row["event"] == "alloc_decode" and not row["mark"] and out and out[-1]["event"].startswith("alloc_decode"):
            run += 1
            prev = out[-1]
            prev["event"] = f"alloc_decode x {run + 1} (steps {prev['step']}-{row['step']})"
            for k in ("kv_allocated_len", "kv_committed_len", "swa_evicted_seqlen"):
                prev[k] = row[k]
            prev["detail"] = "one token per step"
            continue
        run = 0
        out.append(dict(row))
    return out


# -- messages ------------------------------------------------------------------------------------------------------
def error_text(exc: BaseException) -> str:
    """What the page says for a recording that cannot be shown (never a traceback)."""
    if isinstance(exc, RecordingNotFoundError):
        return f"No recording found: {exc}"
    if isinstance(exc, RecordingError):
        return f"This file cannot be shown as a flight recording: {exc}"
    return f"The recording could not be read ({type(exc).__name__}): {exc}"
