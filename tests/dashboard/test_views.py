"""The dashboard's pure views (``dashboard.views``) on hand-made inputs: exact rows, series and figures."""

from __future__ import annotations

import numpy as np
import pytest

from dashboard import views
from exporters.recorder import RecordingError, RecordingNotFoundError
from instrumented_alloc import Violation
from instrumented_alloc import events as ev
from instrumented_alloc.replay import LedgerRow, ReplayState, initial_owner
from instrumented_alloc.shadow import FREE, STAGED


def V(inv, step, rid=None, op="free", msg="m", trace=None):
    return Violation(invariant=inv, message=msg, pool="full", rid=rid, step=step, op=op, trace_id=trace)


def test_violation_rows_newest_first_and_limited():
    vs = [V("double_free", 3, "a", trace="abc"), V("request_leak", 7), V("pool_conservation", 9, 12)]
    rows = views.violation_rows(vs)
    assert [(r["step"], r["invariant"], r["request"]) for r in rows] == [
        (9, "pool_conservation", "12"),
        (7, "request_leak", ""),
        (3, "double_free", "a"),
    ]
    assert rows[2] == {
        "step": 3,
        "invariant": "double_free",
        "request": "a",
        "pool": "full",
        "op": "free",
        "message": "m",
        "trace id": "abc",
    }
    assert [r["step"] for r in views.violation_rows(vs, newest_first=False, limit=2)] == [3, 7]
    assert [r["step"] for r in views.violation_rows(vs, limit=2)] == [9, 7]  # the newest two
    assert views.jump_targets(vs) == [
        ("#1 step 3 · double_free · a", 3),
        ("#2 step 7 · request_leak", 7),
        ("#3 step 9 · pool_conservation · 12", 9),
    ]
    # Retention kept the violation of step 3, not its step: the picker goes to the oldest kept step and says so.
    assert views.jump_targets(vs, (5, 8)) == [
        ("#1 step 3 · double_free · a (step 3 is no longer kept: shows step 5)", 5),
        ("#2 step 7 · request_leak", 7),
        ("#3 step 9 · pool_conservation · 12 (step 9 is no longer kept: shows step 8)", 8),
    ]
    assert views.violation_lines(vs[:2]) == [
        ":red[**double_free**] · request **a** · free (full): m",
        ":red[**request_leak**] · no request · free (full): m",
    ]
    assert views.violation_lines([V("x", 1, msg="a_b [1, 2] `c` *d*")])[0].endswith("a\\_b \\[1, 2\\] \\`c\\` \\*d\\*")
    assert views.violation_summary({"double_free": 2, "request_leak": 1}) == [
        {"invariant": "double_free", "violations": 2},
        {"invariant": "request_leak", "violations": 1},
    ]


def test_occupancy_and_count_series():
    series = [(1, {"full": 60, "swa": 62}), (5, {"full": 50, "swa": 40})]
    pools = [{"name": "full", "num_pages": 64, "page_size": 4}, {"name": "swa", "num_pages": 64, "page_size": 4}]
    assert views.occupancy_series(series, pools) == {"step": [1, 5], "full used": [4, 14], "swa used": [2, 24]}
    counts = {"SwaEvict": [(0, 3), (20, 1)], "AllocFailed": [(10, 2)]}
    assert views.count_series(counts, {"SwaEvict": "evictions", "AllocFailed": "failures"}) == {
        "step": [0, 10, 20],
        "evictions": [3, 0, 1],
        "failures": [0, 2, 0],
    }
    assert views.count_series(counts, {"SwaEvict": "evictions"}, (3, 47), 10) == {
        "step": [0, 10, 20, 30, 40],
        "evictions": [3, 0, 1, 0, 0],
    }
    # A span whose last step starts a bucket keeps that bucket (and its events).
    assert views.count_series({"SwaEvict": [(0, 3), (40, 2)]}, {"SwaEvict": "evictions"}, (0, 40), 10) == {
        "step": [0, 10, 20, 30, 40],
        "evictions": [3, 0, 0, 0, 2],
    }


def _state():
    full = initial_owner(16)
    full[[1, 2, 3]] = 0  # request "a" (slot 0): 3 pages
    full[[8, 9]] = 1  # request "b" (slot 1): 2 pages
    full[12] = STAGED
    return ReplayState(
        step=5,
        seq=40,
        owners={"full": full},
        ledger={"a": LedgerRow(12, 10, 0), "b": LedgerRow(8, 8, 0)},
        slot_rids={0: "a", 1: "b", 2: "gone"},
    )


def test_step_figures_of_a_replayed_state():
    pools = [{"name": "full", "num_pages": 16, "page_size": 4}]
    f = views.step_figures(_state(), pools, None)
    # free pages: 4..7, 10..11, 13..16 -> runs 4, 2, 4; 10 free; largest 4 -> external 1 - 4/10 = 0.6.
    # internal: (10 + 8) committed of (3 + 2) * 4 = 20 slots -> 0.1.
    assert f == {
        "pools": [
            {
                "pool": "full",
                "free": 10,
                "used": 5,
                "staged": 1,
                "reserved": 1,
                "free runs": 3,
                "largest free run": 4,
                "external fragmentation": 0.6,
                "internal fragmentation": 0.1,
            }
        ],
        "requests_live": 2,
        "swa_outside_window_tokens": 0,
        "step": 5,
    }


def test_step_figures_of_a_replayed_swa_state_with_a_sliding_window():
    full, swa = initial_owner(16), initial_owner(16)
    full[1:6] = 0  # request "a" (slot 0): 20 tokens on 5 pages
    full[[8, 9]] = 1  # request "b" (slot 1): 6 tokens on 2 pages
    swa[2:6] = 0  # a's first 4 tokens evicted (page 1 freed): 16 tokens on 4 pages
    swa[[8, 9]] = 1
    state = ReplayState(
        step=5,
        seq=40,
        owners={"full": full, "swa": swa},
        ledger={"a": LedgerRow(20, 20, 4), "b": LedgerRow(8, 6, 0)},
        slot_rids={0: "a", 1: "b"},
        rid_slots={"a": 0, "b": 1},
    )
    pools = [{"name": "full", "num_pages": 16, "page_size": 4}, {"name": "swa", "num_pages": 16, "page_size": 4}]
    f = views.step_figures(state, pools, 8)
    # full: free 6..7, 10..16 -> runs 2, 7; external 1 - 7/9; internal 1 - (20 + 6) / (7 * 4).
    # swa: free 1, 6..7, 10..16 -> runs 1, 2, 7; external 1 - 7/10; internal 1 - (20 - 4 + 6) / (6 * 4).
    # Outside the window of 8: a 20 - 8 - 4 = 8 tokens, b none (6 < 8).
    assert f == {
        "pools": [
            {
                "pool": "full",
                "free": 9,
                "used": 7,
                "staged": 0,
                "reserved": 1,
                "free runs": 2,
                "largest free run": 7,
                "external fragmentation": 0.2222,
                "internal fragmentation": 0.0714,
            },
            {
                "pool": "swa",
                "free": 10,
                "used": 6,
                "staged": 0,
                "reserved": 1,
                "free runs": 3,
                "largest free run": 7,
                "external fragmentation": 0.3,
                "internal fragmentation": 0.0833,
            },
        ],
        "requests_live": 2,
        "swa_outside_window_tokens": 8,
        "step": 5,
    }
    assert views.step_figures(state, pools, None)["swa_outside_window_tokens"] == 0  # no window: none outside


def test_violation_slots_are_the_named_requests_up_to_the_step():
    vs = [V("request_leak", 3, "b"), V("double_free", 9, "a"), V("pool_conservation", 2)]
    assert views.violation_slots(_state(), vs, 5) == {1}
    assert views.violation_slots(_state(), vs, 9) == {0, 1}


def PU(seq, op, pages, owners, pool="swa"):
    return ev.PageUpdate(seq=seq, ts=0.0, step=seq, op=op, pool=pool, pages=np.array(pages), owners=np.array(owners))


def test_swa_evicted_pages_follow_the_free_then_write_rule():
    events = [
        PU(1, "free_swa_segment", [4, 5], [FREE, FREE]),
        ev.SwaEvict(seq=2, ts=0.0, step=2, rid="a", old=0, new=8, n_pages=2),  # 4, 5 evicted
        PU(3, "free_swa_segment", [6], [FREE]),  # a finish, not followed by a SwaEvict: not evicted
        PU(4, "free_swa_segment", [7], [FREE], pool="full"),  # another pool: ignored
        PU(5, "alloc_decode", [5], [3]),  # page 5 handed out again
        PU(6, "free", [9], [FREE]),
        ev.SwaEvict(seq=7, ts=0.0, step=7, rid="b", old=0, new=4, n_pages=1),  # page 9 was not an SWA free
    ]
    assert views.swa_evicted_pages(events).tolist() == [4]
    assert views.swa_evicted_pages([]).tolist() == []
    # An SWA free not followed by an eviction, then one that is: only the second free's pages were evicted.
    events = [
        PU(1, "free_swa", [6], [FREE]),
        PU(2, "free_swa_segment", [7], [FREE]),
        ev.SwaEvict(seq=3, ts=0.0, step=3, rid="a", old=0, new=4, n_pages=1),
    ]
    assert views.swa_evicted_pages(events).tolist() == [7]


def test_lifeline_rows_ledger_series_and_the_violating_write():
    rid = "r1"
    bad = Violation(
        invariant="swa_evicted_seqlen_page_aligned",
        message="swa_evicted_seqlen=1 ...",
        pool=None,
        rid=rid,
        step=4,
        op="ledger",
        trace_id="0af7651916cd43dd8448eb211c80319c",
    )
    E = dict(ts=0.0)
    events = [
        ev.LedgerUpdate(
            seq=1,
            step=1,
            op="alloc_extend",
            rids=(rid,),
            slots=np.array([0]),
            allocated=np.array([8]),
            committed=np.array([6]),
            evicted=np.array([0]),
            **E,
        ),
        ev.Alloc(seq=2, step=1, op="alloc_extend", pool="full", n_slots=6, n_pages=2, rids=(rid,), **E),
        ev.Alloc(seq=3, step=1, op="alloc_extend", pool="swa", n_slots=6, n_pages=2, rids=(rid,), **E),
        ev.Alloc(seq=4, step=2, op="alloc_decode", pool="full", n_slots=2, n_pages=0, rids=(rid, "x"), **E),
        ev.LedgerUpdate(
            seq=5,
            step=2,
            op="alloc_decode",
            rids=(rid, "x"),
            slots=np.array([0, 1]),
            allocated=np.array([8, 4]),
            committed=np.array([7, 1]),
            evicted=np.array([0, 0]),
            **E,
        ),
        ev.LedgerUpdate(
            seq=6,
            step=3,
            op="alloc_decode",
            rids=("x", rid),
            slots=np.array([1, 0]),
            allocated=np.array([4, 8]),
            committed=np.array([2, 8]),
            evicted=np.array([0, 0]),
            **E,
        ),
        ev.Alloc(seq=7, step=3, op="alloc_decode", pool="full", n_slots=2, n_pages=0, rids=("x", rid), **E),
        ev.Alloc(seq=8, step=3, op="alloc_decode", pool="full", n_slots=1, n_pages=1, rids=("x",), **E),  # not r1's
        ev.ViolationEvent(seq=9, step=4, violation=bad, **E),
        ev.Free(seq=10, step=4, op="free_swa_segment", pool="swa", n_pages=1, rids=(rid,), **E),
        ev.LedgerWrite(seq=11, step=4, rid=rid, field="swa_evicted_seqlen", old=0, new=4, **E),
        ev.SwaEvict(seq=12, step=4, rid=rid, old=0, new=4, n_pages=1, **E),
        ev.RequestReleased(seq=13, step=6, rid=rid, pages_held=0, pages_peak=2, **E),
    ]
    life = views.lifeline(rid, events)
    table = [
        (r["step"], r["event"], r["kv_allocated_len"], r["kv_committed_len"], r["swa_evicted_seqlen"], r["mark"])
        for r in life["rows"]
    ]
    assert table == [
        (1, "alloc_extend", 8, 6, 0, ""),
        (2, "alloc_decode x 2 (steps 2-3)", 8, 8, 0, ""),
        (4, "REJECTED write: swa_evicted_seqlen_page_aligned", 8, 8, 0, "◀ violating write"),
        (4, "free_swa_segment", 8, 8, 0, ""),
        (4, "swa_evicted_seqlen = 4", 8, 8, 4, ""),
        (6, "released", 8, 8, 4, ""),
    ]
    assert life["rows"][0]["detail"] == "full: 6 slots, 2 new pages; swa: 6 slots, 2 new pages"
    assert life["rows"][4]["detail"] == "was 0; 1 SWA pages"
    assert life["rows"][2]["detail"] == "swa_evicted_seqlen=1 ..."
    assert life["ledger"] == {
        "step": [1, 2, 3, 4],
        "kv_allocated_len": [8, 8, 8, 8],
        "kv_committed_len": [6, 7, 8, 8],
        "swa_evicted_seqlen": [0, 0, 0, 4],
    }
    assert life["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert (life["violations"], life["released"]) == (1, 6)
    other = views.lifeline("x", events, start_ledger=(4, 0, 0))
    assert other["trace_id"] == views.NO_TRACE and other["released"] is None
    assert [(r["event"], r["kv_committed_len"], r["detail"]) for r in other["rows"]] == [
        ("alloc_decode x 2 (steps 2-3)", 2, "one token per step")
    ]
    first = views.lifeline("x", events[:5])["rows"]
    assert [r["detail"] for r in first] == ["full: batch of 2 requests, 2 slots, 0 new pages"]


def test_error_text_names_the_problem():
    assert views.error_text(RecordingNotFoundError("/d/x.sqlite: no such file")) == (
        "No recording found: /d/x.sqlite: no such file"
    )
    assert views.error_text(RecordingError("/d/y is not a flight recording (no table events)")) == (
        "This file cannot be shown as a flight recording: /d/y is not a flight recording (no table events)"
    )
    assert views.error_text(OSError("disk")) == "The recording could not be read (OSError): disk"


def test_run_identity_and_recording_caption():
    from types import SimpleNamespace

    meta = {"tp_rank": 1, "engine": "e0", "rank": 1, "dp_rank": 0, "preset": "dense", "page_size": 4}
    assert views.run_identity(meta) == "engine e0 · rank 1 · tp_rank 1 · dp_rank 0"  # RUN_KEYS order, 0 included
    assert views.run_identity({"preset": "dense", "rank": None}) == ""
    assert views.run_identity({"engine": "a_b*"}) == "engine a\\_b\\*"  # markdown-escaped
    ov = SimpleNamespace(first=3, last=9, meta=meta, events=1234, violations=1, finished=True)
    assert views.recording_caption("run-tp1.sqlite", ov) == (
        "`run-tp1.sqlite` · engine e0 · rank 1 · tp_rank 1 · dp_rank 0 · steps 3..9 · 1,234 events · 1 violation · "
        "page size 4 · window None · finished"
    )
    ov = SimpleNamespace(first=0, last=0, meta={"page_size": 16, "sliding_window": 128}, events=1, violations=0,
                         finished=False)  # fmt: skip
    assert views.recording_caption("a.sqlite", ov) == (
        "`a.sqlite` · steps 0..0 · 1 event · 0 violations · page size 16 · window 128 · not closed (still being "
        "written, or cut off by a crash)"
    )


@pytest.mark.parametrize(
    ("text", "span"),
    [
        ("run-tp0.sqlite", "`run-tp0.sqlite`"),
        ("tick`name.sqlite", "``tick`name.sqlite``"),
        ("a``b", "```a``b```"),
        ("`edge`", "`` `edge` ``"),
        ("math $x$ a@b.sqlite", "`math $x$ a@b.sqlite`"),
    ],
)
def test_a_name_is_one_code_span_whatever_it_holds(text, span):
    # Backtick-fenced as they were, a name with a backtick closed its span early: the rest of the caption
    # rendered as maths ($x$), mail links (a@b.sqlite) and a stray span.
    assert views.code(text) == span
