"""The Streamlit app through Streamlit's AppTest (the real script, run headless in-process) on demo-engine
recordings with injected faults: violation ids, steps and request ids on the page; the step slider and the
jump-to-violation picker change the page map; a request's lifeline shows the ledger values the recording
holds; bad input is a message on the page, never a traceback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dashboard import data, views
from dashboard.app_config import ENV_DIR, ENV_RECORDING, ENV_REFRESH
from dashboard.pagemap import page_map
from exporters.recorder import Recording

try:
    from streamlit.testing.v1 import AppTest
except ImportError:  # pragma: no cover - the dashboard extra is not installed
    AppTest = None

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")


@pytest.fixture
def app(recordings, monkeypatch):
    if AppTest is None:
        from tests.ci import missing

        missing("streamlit is not installed (pip install -e '.[dashboard]')")

    def run(name: str, **env):
        monkeypatch.setenv(ENV_DIR, str(recordings.dir))
        monkeypatch.setenv(ENV_RECORDING, name)
        monkeypatch.setenv(ENV_REFRESH, "3600")  # AppTest runs the live fragment once per run
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        at = AppTest.from_file(APP, default_timeout=60).run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    return run


def table(at, i: int) -> list[dict]:
    """Rows of the i-th table: 0 the step's pool figures, 1 the violation summary, 2 every violation, then the
    lifeline."""
    return at.dataframe[i].value.to_dict("records")


def legend_counts(at) -> dict:
    """Pool -> {state label: pages} from the page map legends, in page order."""
    out = {}
    titles = [m.value for m in at.markdown if m.value.startswith("**Page map: pool")]
    legends = [m.value for m in at.markdown if "background:#" in m.value]
    for title, legend in zip(titles, legends):
        pool = re.search(r"pool `(\w+)`", title).group(1)
        out[pool] = {k: int(n.replace(",", "")) for k, n in re.findall(r"&nbsp;([^:<]+): <b>([\d,]+)</b>", legend)}
    return out


def recorded(recordings, name="faults.sqlite"):
    with Recording(recordings.dir / name) as r:
        return r.violations(), r.violation_counts(), r.steps()


def test_incident_review_opens_at_the_first_violation(app, recordings):
    (_, s1, rid1, inv1), (_, s2, rid2, inv2) = recordings.faults
    assert (inv1, inv2) == ("swa_evicted_seqlen_page_aligned", "double_free")
    vs, counts, _ = recorded(recordings)
    assert (vs[0].invariant, vs[0].step, vs[0].rid) == (inv1, s1, rid1)  # the seed's bug is the first violation
    at = app("faults.sqlite")
    assert at.slider(key="step").value == s1
    n_here = sum(1 for v in vs if v.step == s1)
    lines = [m.value for m in at.markdown]
    i = lines.index(f"**Violations at step {s1}: {n_here}**")
    assert lines[i + 1].startswith(
        f":red[**swa_evicted_seqlen_page_aligned**] · request **{rid1}** · ledger: swa\\_evicted\\_seqlen="
    )
    assert "is not a non-negative multiple of page\\_size=16" in lines[i + 1]
    # The full list is exactly what the recording holds, in order; both injected faults are in it.
    every = table(at, 2)
    assert [(x["step"], x["invariant"], x["request"]) for x in every] == [
        (v.step, v.invariant, "" if v.rid is None else str(v.rid)) for v in vs
    ]
    assert (s2, "double_free", rid2) in [(x["step"], x["invariant"], x["request"]) for x in every]
    assert {x["invariant"]: x["violations"] for x in table(at, 1)} == counts
    jump = at.selectbox(key="jump")
    assert jump.options[0] == f"#1 step {s1} · swa_evicted_seqlen_page_aligned · {rid1}"
    k = next(i for i, v in enumerate(vs) if v.invariant == "double_free")
    assert jump.options[k] == f"#{k + 1} step {s2} · double_free · {rid2}"


def test_the_step_slider_changes_the_page_map(app, recordings):
    vs, _, _ = recorded(recordings)
    quiet = vs[0].step - 20  # a step before any violation
    at = app("faults.sqlite")
    before = legend_counts(at)
    urls_before = [im.proto.imgs[0].url for im in at.image]
    at.slider(key="step").set_value(quiet).run()
    assert not at.exception
    after = legend_counts(at)
    assert [im.proto.imgs[0].url for im in at.image] != urls_before
    assert after != before
    # The page map of a step is the state at the end of that step: the same as the replayed next boundary.
    with Recording(recordings.dir / "faults.sqlite") as r:
        state = r.state_at(quiet + 1)
    for pool in ("full", "swa"):
        pm = page_map(state.owners[pool])
        # No violation yet: nothing is marked, the counts are the plain page states.
        assert after[pool]["used"] == pm.counts["used"] > 0
        assert after[pool]["free"] + after[pool]["SWA-evicted (released by an SWA eviction)"] == pm.counts["free"]
        assert after[pool]["in a violation (owned by a request a violation names)"] == 0
    # At the first violation the violating request's pages are marked, and where they are is said in page ids.
    assert before["full"]["in a violation (owned by a request a violation names)"] > 0
    assert not [c for c in at.caption if c.value.startswith("Pages in a violation")]
    at.slider(key="step").set_value(vs[0].step).run()
    where = [c.value for c in at.caption if c.value.startswith("Pages in a violation in pool `full`: ")]
    assert len(where) == 1
    runs = re.findall(r"(\d+)(?:-(\d+))?", where[0].split(": ", 1)[1])
    if not where[0].endswith("..."):  # all runs listed: they add up to the legend's count
        n = sum(int(b or a) - int(a) + 1 for a, b in runs)
        assert n == before["full"]["in a violation (owned by a request a violation names)"]


def test_jump_to_a_violation_moves_the_slider(app, recordings):
    _, (_, s2, rid2, _) = recordings.faults
    at = app("faults.sqlite")
    label = next(o for o in at.selectbox(key="jump").options if "double_free" in o)
    at.selectbox(key="jump").set_value(label).run()
    assert not at.exception
    assert at.slider(key="step").value == s2
    lines = "\n".join(m.value for m in at.markdown)
    assert f":red[**double_free**] · request **{rid2}** · free_full (full): free\\_full frees" in lines


def test_request_drilldown_shows_the_recorded_ledger_values(app, recordings):
    (_, s1, rid1, _), _ = recordings.faults
    vs, _, _ = recorded(recordings)
    bad = next(v for v in vs if v.rid == rid1 and v.op == "ledger")
    at = app("faults.sqlite")
    at.selectbox(key="request").set_value(rid1).run()
    assert not at.exception
    rows = table(at, len(at.dataframe) - 1)
    marked = [r for r in rows if r["mark"]]
    assert [(r["step"], r["event"], r["mark"], r["detail"]) for r in marked] == [
        (s1, "REJECTED write: swa_evicted_seqlen_page_aligned", "◀ violating write", bad.message)
    ]
    text = " ".join(m.value for m in at.markdown)
    assert f"Request **{rid1}**" in text and "none recorded (trace ids are kept with violations only)" in text
    # A row holds the values at the end of its step when the next row starts in a later step (a collapsed decode
    # row "alloc_decode x N (steps a-b)": at the end of step b). Each equals the replayed ledger of that step.
    last_per_step = {}
    for row, nxt in zip(rows, [*rows[1:], None]):
        run = re.search(r"\(steps \d+-(\d+)\)", row["event"])
        end = int(run.group(1)) if run else row["step"]
        if nxt is None or nxt["step"] > end:
            last_per_step[end] = row
    with Recording(recordings.dir / "faults.sqlite") as r:
        checked = 0
        for step, row in last_per_step.items():
            led = data.state_end_of(r, step).ledger.get(rid1)
            if led is None:  # released in that step
                continue
            assert (row["kv_allocated_len"], row["kv_committed_len"], row["swa_evicted_seqlen"]) == tuple(led), step
            checked += 1
    assert checked >= 3
    evicted = [r["swa_evicted_seqlen"] for r in rows if r["kv_allocated_len"] > 0]  # free_full zeroes the row
    assert evicted == sorted(evicted) and evicted[-1] > 0 and all(x % 16 == 0 for x in evicted)


def test_live_view_shows_counts_and_newest_violations_first(app, recordings):
    vs, _, (_, last) = recorded(recordings)
    at = app("faults.sqlite")
    at.radio(key="view").set_value("Live").run()
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["violations"] == str(len(vs)) and metrics["step"] == str(last)
    assert metrics["recording"] == "finished"
    vrows = next(t.value.to_dict("records") for t in at.dataframe if "invariant" in t.value.columns)
    # The newest 200 (app.LIVE_VIOLATIONS), however old: a window of the newest 500 steps went empty ten seconds
    # after a fault at the demo's pace, while the header still counted it.
    shown = vs[-200:]
    assert [(x["step"], x["invariant"]) for x in vrows] == [(v.step, v.invariant) for v in reversed(shown)]
    assert len(at.image) == 2  # the page maps of both pools


def test_live_view_shows_the_instrumentations_self_cost(app, recordings):
    # The demo's recording (200 steps): the figures of its newest 200 iterations, as data.self_cost computes them
    # from the file, each in its metric; the caption says which steps they cover.
    at = app("faults.sqlite")
    at.radio(key="view").set_value("Live").run()
    assert not at.exception and not at.error
    with Recording(recordings.dir / "faults.sqlite") as r:
        last = r.steps()[1]
        sc = data.self_cost(r, last)
    assert sc.recorded and sc.last == last and sc.iterations == data.SELF_COST_STEPS
    metrics = {m.label: m.value for m in at.metric}
    want = views.self_cost_metrics(sc)
    assert {label: metrics[label] for label, _, _ in want} == {label: value for label, value, _ in want}
    assert metrics["host µs per iteration"] == views.micros(sc.total) != "0.0 µs"
    assert float(metrics["iterations/s"].replace(",", "")) == pytest.approx(sc.iterations_per_second, abs=0.05)
    caption = next(c.value for c in at.caption if c.value.startswith("Host time the instrumentation"))
    assert f"over the 200 iterations of steps {last - 200}..{last}" in caption and "1% of it is 100 µs" in caption


def test_live_view_of_a_recording_made_before_the_self_cost_says_not_recorded(tmp_path, monkeypatch):
    # A recording written before step boundaries carried the self-cost (tests/data/pre-selfcost.sqlite, see
    # tests/exporters/test_recorder): both views open it, and the live view's self-cost reads "not recorded".
    import shutil

    if AppTest is None:
        from tests.ci import missing

        missing("streamlit is not installed (pip install -e '.[dashboard]')")
    shutil.copy(Path(__file__).resolve().parents[1] / "data" / "pre-selfcost.sqlite", tmp_path / "old.sqlite")
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_RECORDING, "old.sqlite")
    monkeypatch.setenv(ENV_REFRESH, "3600")
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception and not at.error, [m.value for m in at.error]
    assert "**Violations at step 12: 0**" in [m.value for m in at.markdown]
    at.radio(key="view").set_value("Live").run()
    assert not at.exception and not at.error, [m.value for m in at.error]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["step"] == "12" and metrics["recording"] == "finished"
    labels = [label for label, _, _ in views.self_cost_metrics(data.SelfCostWindow(recorded=False))]
    assert {metrics[label] for label in labels} == {"not recorded"}
    assert any(c.value.startswith("Self-cost: not recorded") for c in at.caption)


def test_clean_recording_has_no_violation(app, recordings):
    vs, _, (_, last) = recorded(recordings, "clean.sqlite")
    assert vs == []
    at = app("clean.sqlite")
    assert f"**Violations at step {last}: 0**" in [m.value for m in at.markdown]
    assert not [s for s in at.selectbox if s.key == "jump"]
    assert not at.error
    assert len(at.image) == 1  # a dense model: one pool


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("missing.sqlite", r"missing\.sqlite: no such file \(expected a flight recording\)"),
        ("notes.sqlite", r"notes\.sqlite (is not a flight recording|cannot be opened)"),
        ("empty.sqlite", r"empty\.sqlite is not a flight recording \(no table"),
        (
            "truncated.sqlite",
            r"truncated\.sqlite is not a flight recording \(database disk image is malformed\): "
            r"the file is damaged or incomplete",
        ),
        ("../outside.sqlite", r"outside the dashboard's recording directory"),
    ],
)
def test_bad_input_is_a_message_not_a_traceback(app, name, expected):
    at = app(name)
    assert len(at.error) == 1
    assert re.search(expected, at.error[0].value), at.error[0].value
    assert "Traceback" not in at.error[0].value


def test_recording_cut_off_by_a_crash_is_shown_up_to_its_last_transaction(app, recordings):
    at = app("crashed.sqlite")
    assert not at.error
    caption = " ".join(c.value for c in at.caption)
    assert "not closed (still being written, or cut off by a crash)" in caption
    at.radio(key="view").set_value("Live").run()
    assert not at.exception and not at.error
    assert {m.label: m.value for m in at.metric}["recording"] == "open"
    leak = recordings.crashed_leak
    every = table(at, 2)
    assert (leak.step, "request_leak", str(leak.rid)) in [(x["step"], x["invariant"], x["request"]) for x in every]


def test_a_recording_without_events_says_so(app):
    at = app("fresh.sqlite")
    assert not at.error
    assert [i.value for i in at.info] == ["This recording has no events yet: only the state when recording started."]
    assert len(at.image) == 2


def test_a_violation_older_than_the_kept_steps_opens_at_the_oldest_kept_step(tmp_path, monkeypatch):
    # Retention keeps every violation, not the steps before the oldest kept snapshot: the view opens at the oldest
    # step it can rebuild and the picker says where the violation went (it raised a slider error, the whole view
    # replaced by it).
    if AppTest is None:
        from tests.ci import missing

        missing("streamlit is not installed (pip install -e '.[dashboard]')")
    from exporters.recorder import FlightRecorder
    from tests.exporters.test_recorder import RandomPick, drive
    from tests.test_wrapper_properties import Engine

    e = Engine("swa-4", False, "immediate")
    path = tmp_path / "ret.sqlite"
    rec = FlightRecorder(e.w, path, snapshot_every=50, max_events=150, flush_interval=0.01)
    drive(e, RandomPick(11), 5)
    from tests.engine_model import Req

    rid = e.new_rid()
    e.extend([Req(rid)], [8])
    e.w.ledger[rid].kv_allocated_len += 1  # not page-aligned: a rejected write, kept by retention for good
    step = e.w.step_count

    def on_step(e):
        if e.w.step_count % 10 == 0:
            rec.flush()

    drive(e, RandomPick(12), 400, on_step)
    rec.close()
    with Recording(path) as r:
        first, _ = r.steps()
        assert [(v.invariant, v.step) for v in r.violations()][:1] == [("kv_allocated_len_page_aligned", step)]
        assert first > step
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_RECORDING, "ret.sqlite")
    monkeypatch.setenv(ENV_REFRESH, "3600")
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception and not at.error, [m.value for m in at.error]
    assert at.slider(key="step").value == first
    assert at.selectbox(key="jump").options[0] == (
        f"#1 step {step} · kv_allocated_len_page_aligned · {rid} (step {step} is no longer kept: shows step {first})"
    )


# -- several recordings side by side (one per rank) -----------------------------------------------------------------
RANK0 = (
    "`run-tp0.sqlite` · engine e0 · rank 0 · tp_rank 0 · steps 0..6 · 21 events · 1 violation · page size 4 · "
    "window None · finished"
)
RANK1 = (
    "`run-tp1.sqlite` · engine e0 · rank 1 · tp_rank 1 · steps 0..9 · 20 events · 1 violation · page size 4 · "
    "window None · finished"
)
DOUBLE_FREE = (
    ":red[**double_free**] · request **r0-2** · free (full): free frees \\[5, 6\\] (2 pages) that are not in use "
    "(page 5 is free, last owned by request slot 2)"
)
LEAK = (
    ":red[**request_leak**] · request **r1-0** · release (full): request 'r1-0' released while still owning 2 pages, "
    "neither freed nor handed to the prefix cache (full: \\[1, 2\\] (2 pages))"
)


@pytest.fixture
def ranks_app(ranks, monkeypatch):
    if AppTest is None:
        from tests.ci import missing

        missing("streamlit is not installed (pip install -e '.[dashboard]')")

    def run(*names: str):
        monkeypatch.setenv(ENV_DIR, str(ranks))
        monkeypatch.setenv(ENV_RECORDING, "\n".join(names))  # what `instrumented-alloc dashboard A B` passes
        monkeypatch.setenv(ENV_REFRESH, "3600")
        at = AppTest.from_file(APP, default_timeout=60).run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    return run


def side_by_side(at) -> list:
    """The recordings' columns, left to right: the page's first row of columns (the live view's is inside its
    fragment; each recording's own rows of columns are inside its column)."""

    def rows(block):
        for child in block.children.values():
            if getattr(child, "type", None) == "flex_container":
                kids = list(child.children.values())
                if kids and all(getattr(k, "type", None) == "column" for k in kids):
                    yield kids
                else:
                    yield from rows(child)

    return next(rows(at.main))


def charts_in(block) -> list[dict]:
    """The data of the charts directly in ``block``, in page order, each as {column: [values]}."""
    import pyarrow as pa

    return [
        pa.ipc.open_stream(e.proto.datasets[0].data.data).read_all().to_pydict()
        for e in block.children.values()
        if getattr(e, "type", None) == "vega_lite_chart"
    ]


def texts(block) -> list:
    return [m.value for m in block.markdown]


def table_of(block, i: int) -> list[dict]:
    return block.dataframe[i].value.to_dict("records")


def test_ranks_side_by_side_in_incident_review(ranks_app, ranks):
    for name, events in (("run-tp0.sqlite", 21), ("run-tp1.sqlite", 20)):
        with Recording(ranks / name) as r:
            assert r.event_count() == events  # the captions below count what the files hold
    at = ranks_app("run-tp0.sqlite", "run-tp1.sqlite")
    assert at.multiselect(key="recordings").value == ["run-tp0.sqlite", "run-tp1.sqlite"]
    assert at.caption[0].value == "`run-tp0.sqlite` · `run-tp1.sqlite` · Incident review"
    left, right = side_by_side(at)
    assert left.caption[0].value == RANK0 and right.caption[0].value == RANK1
    # Each rank opens at its own first violation, on its own step range (rank 1's counter ran ahead).
    assert [(s.key, s.value, s.min, s.max) for s in left.slider] == [("step", 4, 0, 6)]
    assert [(s.key, s.value, s.min, s.max) for s in right.slider] == [("step@run-tp1.sqlite", 7, 0, 9)]
    assert texts(left)[:2] == ["**Violations at step 4: 1**", DOUBLE_FREE]
    assert texts(right)[:2] == ["**Violations at step 7: 1**", LEAK]
    assert [s.options for s in left.selectbox if s.key == "jump"] == [["#1 step 4 · double_free · r0-2"]]
    assert [s.options for s in right.selectbox if s.key == "jump@run-tp1.sqlite"] == [
        ["#1 step 7 · request_leak · r1-0"]
    ]
    # The step's pool figures: rank 0 freed r0-2's two pages (4 of 6 used), rank 1 still holds its leaked ones.
    figures = [c.dataframe[0].value["full"].to_dict() for c in (left, right)]
    assert [(f["used"], f["free"]) for f in figures] == [("4", "12"), ("6", "10")]
    assert [c.dataframe[1].value.to_dict("records") for c in (left, right)] == [
        [{"invariant": "double_free", "violations": 1}],
        [{"invariant": "request_leak", "violations": 1}],
    ]
    every = [[(x["step"], x["invariant"], x["request"], x["op"]) for x in table_of(c, 2)] for c in (left, right)]
    assert every == [[(4, "double_free", "r0-2", "free")], [(7, "request_leak", "r1-0", "release")]]
    assert [len(c.image) for c in (left, right)] == [1, 1]  # each rank's page map, in its column

    # Each rank has its own step: moving rank 1's leaves rank 0's where it was.
    at.slider(key="step@run-tp1.sqlite").set_value(2).run()
    assert not at.exception
    left, right = side_by_side(at)
    assert texts(left)[:2] == ["**Violations at step 4: 1**", DOUBLE_FREE]
    assert texts(right)[0] == "**Violations at step 2: 0**"
    assert right.dataframe[0].value["full"].to_dict()["used"] == "6"  # three requests of two pages each

    # Dropping rank 0 lays rank 1 out alone, at the step it was at.
    at.multiselect(key="recordings").unselect("run-tp0.sqlite").run()
    assert not at.exception and not at.error
    assert [c.value for c in at.caption[:2]] == ["`run-tp1.sqlite` · Incident review", RANK1]
    assert [(s.key, s.value) for s in at.slider] == [("step@run-tp1.sqlite", 2)]


def test_ranks_side_by_side_in_the_live_view(ranks_app):
    at = ranks_app("run-tp0.sqlite", "run-tp1.sqlite")
    at.radio(key="view").set_value("Live").run()
    assert not at.exception and not at.error
    left, right = side_by_side(at)
    assert left.caption[0].value == RANK0 and right.caption[0].value == RANK1
    metrics = [{m.label: m.value for m in c.metric} for c in (left, right)]
    assert [(m["step"], m["events"], m["violations"], m["recording"]) for m in metrics] == [
        ("6", "21", "1", "finished"),
        ("9", "20", "1", "finished"),
    ]
    # Pages in use per step, from the free lists: rank 0's double free lists r0-2's two pages twice from step 4
    # on (reads 2, not 4); rank 1's leak keeps all six.
    charts = [charts_in(c) for c in (left, right)]
    assert charts[0][0] == {"step": [1, 2, 3, 4, 5, 6], "full used": [2, 4, 6, 6, 2, 2]}
    assert charts[1][0] == {"step": [1, 2, 3, 4, 5, 6, 7, 8, 9], "full used": [2, 4, 6, 6, 6, 6, 6, 6, 6]}
    vrows = [table_of(c, len(c.dataframe) - 1) for c in (left, right)]  # the live violation list comes last
    assert [[(x["step"], x["invariant"], x["request"]) for x in rows] for rows in vrows] == [
        [(4, "double_free", "r0-2")],
        [(7, "request_leak", "r1-0")],
    ]
    assert [s.value for c in (left, right) for s in c.subheader if s.value.startswith("Now")] == [
        "Now (step 6)",
        "Now (step 9)",
    ]
    assert [len(c.image) for c in (left, right)] == [1, 1]


def test_one_rank_alone_keeps_the_single_layout_and_says_its_rank(ranks_app):
    at = ranks_app("run-tp1.sqlite")
    assert at.multiselect(key="recordings").value == ["run-tp1.sqlite"]
    assert [c.value for c in at.caption[:2]] == ["`run-tp1.sqlite` · Incident review", RANK1]
    assert [(s.key, s.value) for s in at.slider] == [("step", 7)]
    # Adding rank 0 puts it beside rank 1, with its own step; rank 1 keeps the one it had.
    at.slider(key="step").set_value(8).run()
    at.multiselect(key="recordings").select("run-tp0.sqlite").run()
    assert not at.exception
    left, right = side_by_side(at)
    assert left.caption[0].value == RANK1 and right.caption[0].value == RANK0
    assert [(s.key, s.value) for s in at.slider] == [("step", 8), ("step@run-tp0.sqlite", 4)]


def test_a_rank_that_cannot_be_shown_is_a_message_in_its_column(ranks_app, ranks):
    at = ranks_app("run-tp0.sqlite", "run-tp9.sqlite")
    left, right = side_by_side(at)
    assert left.caption[0].value == RANK0 and not left.error
    missing = ranks.resolve() / "run-tp9.sqlite"
    assert [e.value for e in right.error] == [f"{missing}: no such file (expected a flight recording)"]


def test_no_recording_picked_says_so(ranks_app):
    at = ranks_app("run-tp0.sqlite")
    at.multiselect(key="recordings").unselect("run-tp0.sqlite").run()
    assert not at.exception and not at.error
    assert [i.value for i in at.info] == ["Pick one or more recordings in the sidebar."]


@pytest.fixture
def own_ranks(tmp_path, monkeypatch):
    """Two rank recordings of this test's own (``rank_recording``: run-tp0 steps 0..6, run-tp1 steps 0..9), which
    it may rewrite or delete, and a runner of the app over them."""
    from tests.dashboard.conftest import rank_recording

    if AppTest is None:
        from tests.ci import missing

        missing("streamlit is not installed (pip install -e '.[dashboard]')")
    rank_recording(tmp_path / "run-tp0.sqlite", 0, 6, 4)
    rank_recording(tmp_path / "run-tp1.sqlite", 1, 9, 7)

    def run(*names: str):
        monkeypatch.setenv(ENV_DIR, str(tmp_path))
        monkeypatch.setenv(ENV_RECORDING, "\n".join(names))
        monkeypatch.setenv(ENV_REFRESH, "3600")
        at = AppTest.from_file(APP, default_timeout=60).run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    return tmp_path, run


def test_a_recording_that_grows_keeps_its_picked_step(own_ranks):
    # A slider whose range changed is a new widget to Streamlit, which started it at its minimum: next to a
    # recording being written, a step picked on it jumped back to 0 at the next rerun.
    from tests.dashboard.conftest import rank_recording

    d, run = own_ranks
    at = run("run-tp0.sqlite", "run-tp1.sqlite")
    at.slider(key="step@run-tp1.sqlite").set_value(7).run()
    (d / "run-tp1.sqlite").unlink()
    rank_recording(d / "run-tp1.sqlite", 1, 12, 7)  # three more steps, as a live writer adds them
    at.slider(key="step").set_value(2).run()  # the other recording's slider
    assert not at.exception, [e.value for e in at.exception]
    grown = at.slider(key="step@run-tp1.sqlite")
    assert (grown.value, grown.max) == (7, 12)
    assert at.slider(key="step").value == 2


def test_a_picked_recording_that_disappears_says_so_in_its_column(own_ranks):
    # It was dropped from the selection without a word (a picked value missing from the options).
    d, run = own_ranks
    at = run("run-tp0.sqlite")
    at.multiselect(key="recordings").select("run-tp1.sqlite").run()
    (d / "run-tp1.sqlite").unlink()
    at.run()
    assert at.multiselect(key="recordings").value == ["run-tp0.sqlite", "run-tp1.sqlite"]
    _, right = side_by_side(at)
    assert [e.value for e in right.error] == [
        f"{(d / 'run-tp1.sqlite').resolve()}: no such file (expected a flight recording)"
    ]


def test_a_recording_named_with_a_leading_tilde_opens(own_ranks):
    # Path.expanduser read "~x" as user x's home and raised (no such user): the recording could not be opened.
    from tests.dashboard.conftest import rank_recording

    d, run = own_ranks
    rank_recording(d / "~x.sqlite", 0, 6, 4)
    at = run("~x.sqlite")
    assert not at.error, [e.value for e in at.error]
    assert at.caption[0].value.startswith("`~x.sqlite`")
