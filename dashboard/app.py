"""The Streamlit app: Live (follow a recording being written: its counts, the instrumentation's own cost per
iteration, occupancy, fragmentation, the newest state and violations) and Incident review (a step, its page map, the
violations, one request's lifeline), of one recording or of several side by side (one column each: per-rank
recordings of one run, each headed by its engine and rank from the run metadata). Layout only: the data comes
from ``dashboard.data``, every figure from the pure functions of ``dashboard.views`` and ``dashboard.pagemap``.

Configuration (set by ``dashboard.launch``, i.e. ``instrumented-alloc dashboard``): environment variables
``INSTRUMENTED_ALLOC_DASHBOARD_DIR`` (the directory whose recordings may be opened; default: the working
directory), ``INSTRUMENTED_ALLOC_DASHBOARD_RECORDING`` (the recordings selected first, one name a line),
``INSTRUMENTED_ALLOC_DASHBOARD_REFRESH`` (seconds between live refreshes; default 2).
Bad input is shown as a message on the page, never as a traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

# `streamlit run dashboard/app.py` puts dashboard/ itself on sys.path; the package's root must come first.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pandas as pd  # noqa: E402
import streamlit as st  # noqa: E402

from dashboard import data, pagemap, views  # noqa: E402
from dashboard.app_config import ENV_DIR, ENV_RECORDING, ENV_REFRESH  # noqa: E402

LIVE_VIOLATIONS = 200  # the live violation list shows this many newest violations, however old
PRIMARY = "primary_recording"  # session state: the recording the page opened with (see _key)


def _refresh() -> float:
    try:
        # A refresh must not come before the last one finished (a fragment re-run interrupts the running one).
        return max(1.0, float(os.environ.get(ENV_REFRESH, "2")))
    except ValueError:
        return 2.0


def _show_error(exc: BaseException) -> None:
    if isinstance(exc, data.DashboardInputError):
        st.error(str(exc))
    else:
        st.error(views.error_text(exc))


def _key(base: str, name: str) -> str:
    """The key of a widget of recording ``name``'s view. The recording the page opened with keeps the plain keys
    (``step``, ``jump``, ``request``); every other recording has its own (``step@run-tp1.sqlite``): each recording
    keeps its step while others are added or removed (ranks' step counters need not agree)."""
    return base if name == st.session_state.get(PRIMARY) else f"{base}@{name}"


def _side_by_side(names: list) -> list:
    """Where each recording's view goes: one column each for several, the page itself for one."""
    return st.columns(len(names)) if len(names) > 1 else [contextlib.nullcontext()]


def _legend(pm: pagemap.PageMap) -> None:
    parts = [
        f"<span style='display:inline-block;width:0.9em;height:0.9em;background:{color};"
        f"border:1px solid #94a3b8;vertical-align:middle'></span>&nbsp;{label}: <b>{n:,}</b>"
        for _, label, color, n in pm.legend
    ]
    st.markdown("&emsp;".join(parts), unsafe_allow_html=True)


def _page_maps(rec, ov: data.Overview, state, violations, step: int) -> None:
    slots = views.violation_slots(state, violations, step)
    lookback = int(ov.meta.get("snapshot_every") or 100)
    evicted = views.swa_evicted_pages(data.recent_events(rec, step, lookback)) if "swa" in state.owners else None
    for p in ov.pools:
        name = p["name"]
        pm = pagemap.page_map(state.owners[name], violation_slots=slots, swa_evicted=evicted if name == "swa" else None)
        st.markdown(f"**Page map: pool `{name}`** ({p['num_pages']:,} pages of {p['page_size']} tokens, step {step})")
        st.image(pm.image, caption=pm.rule, output_format="PNG")  # lossless: one colour per state
        _legend(pm)
        if pm.violation_runs:
            where = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in pm.violation_runs)
            more = " ..." if pm.more_violation_runs else ""
            st.caption(f"Pages in a violation in pool `{name}`: {where}{more}")
    if evicted is not None:
        st.caption(
            f"SWA-evicted: pages an SWA eviction released in steps {max(0, step - lookback)}..{step} that are "
            "still free (the SWA free followed by the request's swa_evicted_seqlen write)."
        )


def _figures(state, ov: data.Overview) -> None:
    f = views.step_figures(state, ov.pools, ov.meta.get("sliding_window"))
    c1, c2 = st.columns(2)
    c1.metric("requests live", f["requests_live"])
    c2.metric("SWA tokens outside the window", f["swa_outside_window_tokens"])
    # One column per pool, one row per figure: fits the narrow column beside the page maps.
    st.dataframe(pd.DataFrame(f["pools"]).set_index("pool").astype(object).T.astype(str))  # ints stay ints


# -- live ----------------------------------------------------------------------------------------------------------
def live(rdir: data.RecordingDir, names: list) -> None:
    @st.fragment(run_every=_refresh())
    def body() -> None:
        for place, name in zip(_side_by_side(names), names):
            with place:
                try:
                    with rdir.open(name) as rec:
                        _live(rec, name)
                except Exception as exc:  # shown on the page (in that recording's column), never a traceback
                    _show_error(exc)

    body()


def _live(rec, name: str) -> None:
    ov = data.overview(rec)
    st.caption(views.recording_caption(name, ov))
    c = st.columns(4)
    c[0].metric("step", ov.last)
    c[1].metric("events", f"{ov.events:,}")
    c[2].metric("violations", ov.violations)
    # A file without an end is being written or was cut off by a crash: the file alone cannot tell which.
    c[3].metric("recording", "finished" if ov.finished else "open", help="open: being written, or cut off by a crash")
    _self_cost(rec, ov)
    st.markdown(f"**{ov.violations} violations** so far")
    series = rec.step_series(max_points=500)
    st.subheader("Pages in use per pool")
    if series:
        st.line_chart(views.occupancy_series(series, ov.pools), x="step")
        if ov.violations:
            st.caption(
                "From the free-list entries at each step boundary: after a double free the allocator lists a page "
                "twice, so this reads lower than the pages in use (the page map counts pages)."
            )
    bucket = max(1, (ov.last - ov.first + 1) // 200)
    counts = rec.event_counts(("SwaEvict", "AllocFailed", "ViolationEvent"), bucket=bucket)
    st.subheader(f"SWA evictions, alloc failures and violations per {bucket} step{'s' if bucket > 1 else ''}")
    labels = {"SwaEvict": "SWA evictions", "AllocFailed": "alloc failures", "ViolationEvent": "violations"}
    table = views.count_series(counts, labels, (ov.first, ov.last), bucket)
    if any(any(table[k]) for k in labels.values()):
        st.bar_chart(table, x="step")
    else:
        st.caption("none yet")
    st.subheader("Fragmentation at the recent snapshots, newest first")
    frag = []
    for s, state in data.snapshot_states(rec, reversed(rec.snapshot_steps()[-8:])):  # newest first
        for row in views.step_figures(state, ov.pools, ov.meta.get("sliding_window"))["pools"]:
            frag.append({"step": s, **row})
    st.dataframe(frag, hide_index=True, height=220)
    state = data.state_end_of(rec, ov.last)
    st.subheader(f"Now (step {ov.last})")
    _figures(state, ov)
    st.subheader("Violations, newest first")
    vs = rec.violations(newest=LIVE_VIOLATIONS)
    if ov.violations > len(vs):
        st.caption(f"the newest {len(vs)} of {ov.violations:,} (Incident review lists them all)")
    st.dataframe(views.violation_rows(vs), hide_index=True)
    _page_maps(rec, ov, state, vs, ov.last)


def _self_cost(rec, ov: data.Overview) -> None:
    """The instrumentation's own cost over the newest iterations: one row of figures, then what they cover."""
    sc = data.self_cost(rec, ov.last)
    st.markdown(f"**Instrumentation self-cost**, newest {data.SELF_COST_STEPS} steps")
    figures = views.self_cost_metrics(sc)
    for row in (figures[:3], figures[3:]):  # the totals, then one per part (narrow columns beside other ranks)
        for col, (label, value, why) in zip(st.columns(len(row)), row):
            col.metric(label, value, help=why)
    st.caption(views.self_cost_caption(sc, data.SELF_COST_STEPS))


# -- incident review -----------------------------------------------------------------------------------------------
def incident(rdir: data.RecordingDir, name: str, *, narrow: bool = False) -> None:
    """Recording ``name``'s incident review; ``narrow``: in a column beside other recordings (one column of
    content: the step's figures above its page maps)."""
    with rdir.open(name) as rec:
        ov = data.overview(rec)
        violations = rec.violations()
        st.caption(views.recording_caption(name, ov))
        if ov.events == 0:
            st.info("This recording has no events yet: only the state when recording started.")
        targets = views.jump_targets(violations, (ov.first, ov.last))
        step_key, jump_key = _key("step", name), _key("jump", name)
        step = st.session_state.get(step_key)
        if step is None or not ov.first <= step <= ov.last:
            step = targets[0][1] if targets else ov.last
        # Set on every run, not only the first: a slider whose range changed (a recording being written, or
        # replaced) is a new widget to Streamlit, which would start it at its minimum.
        st.session_state[step_key] = step

        def jump() -> None:
            label = st.session_state.get(jump_key)
            for lab, s in targets:
                if lab == label:
                    st.session_state[step_key] = s

        if targets:
            st.selectbox(
                "Jump to a violation",
                [lab for lab, _ in targets],
                index=None,
                key=jump_key,
                on_change=jump,
                placeholder=f"{len(targets)} violations: pick one",
            )
        # A one-step recording has nothing to slide over (a slider needs min < max).
        step = st.slider("Step", ov.first, ov.last, key=step_key) if ov.last > ov.first else ov.first
        state = data.state_end_of(rec, step)

        if narrow:  # columns nest one level only, and _figures lays out columns of its own
            _step_panel(state, ov, violations, step)
            _page_maps(rec, ov, state, violations, step)
        else:
            left, right = st.columns([3, 2])
            with left:
                _page_maps(rec, ov, state, violations, step)
            with right:
                _step_panel(state, ov, violations, step)
        st.subheader(f"All violations ({len(violations)})")
        st.dataframe(views.violation_summary(rec.violation_counts()), hide_index=True)
        st.dataframe(views.violation_rows(violations, newest_first=False), hide_index=True)
        _request(rec, ov, state, violations, _key("request", name))


def _step_panel(state, ov: data.Overview, violations, step: int) -> None:
    st.subheader(f"Step {step}")
    _figures(state, ov)
    here = [v for v in violations if v.step == step]
    st.markdown(f"**Violations at step {step}: {len(here)}**")
    for line in views.violation_lines(here[:20]):
        st.markdown(line)
    if len(here) > 20:
        st.caption(f"... and {len(here) - 20} more in the list below")


def _request(rec, ov: data.Overview, state, violations, key: str) -> None:
    st.subheader("One request's KV lifeline")
    choices = data.request_choices(rec, state, violations)
    if not choices:
        st.caption("No request is live at this step or named by a violation.")
        return
    rid = st.selectbox("Request", choices, key=key, format_func=str)
    hist = data.request_history(rec, rid, ov.first, live_at=state.step if rid in state.ledger else None)
    if hist is None:
        st.warning(f"The recording holds no event of request {rid!r}.")
        return
    events, start_ledger, lo, hi = hist
    life = views.lifeline(rid, events, start_ledger=start_ledger)
    st.markdown(
        f"Request **{rid}** · steps {lo}..{hi} · violations: **{life['violations']}** · trace id: "
        f"`{life['trace_id']}` · "
        + (f"released at step {life['released']}" if life["released"] is not None else "not released in the recording")
    )
    if life["ledger"]["step"]:
        st.caption("Ledger values over time (tokens)")
        st.line_chart(life["ledger"], x="step", height=220)
    table = pd.DataFrame(life["rows"])
    # The violating rows stand out (red background); the rest of the table stays plain.
    styled = table.style.apply(lambda r: ["background-color: #fee2e2" if r["mark"] else "" for _ in r], axis=1)
    st.dataframe(styled, hide_index=True, column_config={"mark": st.column_config.TextColumn(width="medium")})


# -- page ------------------------------------------------------------------------------------------------------------
def main() -> None:
    st.set_page_config(page_title="instrumented-alloc: KV-cache allocator", layout="wide")
    st.title("KV-cache allocator: flight recordings")
    try:
        rdir = data.RecordingDir(os.environ.get(ENV_DIR, "."))
        names = rdir.names()
    except Exception as exc:
        _show_error(exc)
        return
    wanted = list(dict.fromkeys(n for n in os.environ.get(ENV_RECORDING, "").split("\n") if n))
    # Shown even when one is not a recording, or no longer there (picked, then deleted): its column then says why
    # (a picked name missing from the options would be dropped from the selection without a word).
    picked = st.session_state.get("recordings") or []
    names = list(dict.fromkeys([*(n for n in wanted if n not in names), *names, *picked]))
    with st.sidebar:
        st.caption(f"Recordings under {views.code(str(rdir.root))} (read-only)")
        if not names:
            st.info("No recording here yet (files ending in " + ", ".join(data.SUFFIXES) + ").")
            return
        default = wanted or names[:1]
        st.session_state.setdefault(PRIMARY, default[0])
        chosen = st.multiselect(
            "Recordings",
            names,
            default=default,
            key="recordings",
            help="Several are shown side by side, one column each (e.g. the recordings of a run's ranks).",
        )
        view = st.radio("View", ["Incident review", "Live"], key="view")
    if not chosen:
        st.info("Pick one or more recordings in the sidebar.")
        return
    st.caption(" · ".join(map(views.code, chosen)) + f" · {view}")
    if view == "Live":
        live(rdir, chosen)
        return
    for place, name in zip(_side_by_side(chosen), chosen):
        with place:
            try:
                incident(rdir, name, narrow=len(chosen) > 1)
            except Exception as exc:  # shown on the page (in that recording's column), never a traceback
                _show_error(exc)


main()
