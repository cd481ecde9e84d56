"""The demo engine: every preset runs clean under pressure, every fault shows exactly its invariant id, and a
seed fixes the whole run."""

from __future__ import annotations

import dataclasses

import pytest

from instrumented_alloc import events as ev
from instrumented_alloc.sim import FAULTS, PRESETS, build_engine

STEPS = 5000


def _run_clean(preset: str, steps: int, **kw):
    eng = build_engine(preset, seed=0, **kw)
    eng.run(steps)
    assert dict(eng.alloc.violation_counts) == {}
    st = eng.stats
    findings = eng.shutdown()
    assert findings == []
    assert dict(eng.alloc.violation_counts) == {}
    # Every page back in the free list once the last request is gone.
    full, swa = eng.free_pages()
    assert full == eng._full_pages and swa == eng._swa_pages
    assert len(eng.alloc.ledger) == 0
    return st


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_runs_5000_steps_clean_under_pressure(preset):
    st = _run_clean(preset, STEPS)
    assert st.steps == STEPS
    assert st.finished > 100
    # Pressure, not an idle pool: the pool fills, the scheduler retracts at least once.
    assert st.peak_occupancy >= 0.8
    assert st.retracted >= 1
    if PRESETS[preset].is_swa:
        assert st.evictions > 100


@pytest.mark.parametrize(("preset", "page_size"), [("dense", 1), ("dense", 64), ("swa-128", 1), ("swa-128", 64),
                                                   ("swa-1024", 64), ("pd-decode", 64)])
def test_other_page_sizes_run_clean(preset, page_size):
    st = _run_clean(preset, 1500, page_size=page_size)
    assert st.finished > 10


def test_deferred_verification_runs_clean():
    _run_clean("swa-128", 1000, verify="deferred")


def test_pd_decode_requests_start_with_a_page_aligned_evicted_length():
    eng = build_engine("pd-decode", seed=3)
    seen = []
    eng.alloc.subscribe(lambda batch: seen.extend(e for e in batch if isinstance(e, ev.LedgerWrite)))
    eng.run(50)
    first = {}
    for e in seen:
        if e.field == "swa_evicted_seqlen":
            first.setdefault(e.rid, e.new)
    assert first, "no prefilled request was admitted"
    assert all(v % 16 == 0 for v in first.values())
    assert any(v > 0 for v in first.values())  # some arrived longer than the window: their head is never on the GPU


def _first_steps(violations):
    out = {}
    for v in violations:
        out.setdefault(v.invariant, v.step)
    return out


APPLICABLE = [
    (name, preset)
    for name, f in FAULTS.items()
    for preset in ("dense", "swa-128", "pd-decode")
    if not (f.needs_swa and not PRESETS[preset].is_swa)
]


@pytest.mark.parametrize(("fault", "preset"), APPLICABLE)
def test_each_fault_reports_exactly_its_invariant_at_the_step_it_fired(fault, preset):
    eng = build_engine(preset, seed=1, inject=[f"{fault}@400"], steps=1000)
    eng.run(1000)
    assert len(eng.fired) == 1
    fired = eng.fired[0]
    assert fired.fault == fault and fired.step >= 400
    vs = list(eng.alloc.violations)
    assert vs, "the fault was not reported"
    # Nothing before the mistake; at the step it fired, exactly the documented id (and nothing else), first.
    assert min(v.step for v in vs) == fired.step
    assert vs[0].invariant == FAULTS[fault].invariant
    at_step = {v.invariant for v in vs if v.step == fired.step}
    assert at_step == {FAULTS[fault].invariant}
    if fault != "duplicate-alloc":  # the violation names the request that received the page
        assert vs[0].rid == fired.rid


@pytest.mark.parametrize("fault", ["swa-misaligned", "swa-inside-window", "leak", "segment-unaligned",
                                   "alloc-len-misaligned"])
def test_faults_the_wrapper_contains_cause_no_other_violation(fault):
    # Rejected ledger writes are never stored and refused segment frees change nothing: the run goes on clean.
    eng = build_engine("swa-128", seed=2, inject=[f"{fault}@300"], steps=1500)
    eng.run(1500)
    ids = {v.invariant for v in eng.alloc.violations}
    assert ids == {FAULTS[fault].invariant}


def test_double_free_corrupts_the_free_list_and_the_wrapper_sees_the_consequences():
    # Forwarded in record mode (results stay bit-identical to the bare allocator's), the double free puts pages
    # on the free list twice; the next allocations hand them out while in use.
    eng = build_engine("dense", seed=1, inject=["double-free@400"], steps=1000)
    eng.run(1000)
    first = _first_steps(eng.alloc.violations)
    assert first["double_free"] == eng.fired[0].step
    assert first["duplicate_allocation"] >= first["double_free"]


def test_unarmed_fault_step_is_picked_by_the_seed_while_there_is_traffic():
    a = build_engine("dense", seed=5, inject=["leak"], steps=2000)
    b = build_engine("dense", seed=5, inject=["leak"], steps=2000)
    c = build_engine("dense", seed=6, inject=["leak"], steps=2000)
    steps = [e._pending[0].step for e in (a, b, c)]
    assert steps[0] == steps[1]
    assert all(1 <= s <= 1000 for s in steps)
    a.run(2000)
    assert a.fired and a.fired[0].step >= steps[0]


def _strip(e):
    """An event as comparable plain data, without its wall-clock fields (timestamps, call durations, self-cost)."""
    d = {f.name: getattr(e, f.name) for f in dataclasses.fields(e) if f.name not in ev.CLOCK_FIELDS}
    if "violation" in d:
        d["violation"] = dataclasses.replace(d["violation"], ts=0.0)
    return type(e).__name__, {k: v.tolist() if hasattr(v, "tolist") else v for k, v in d.items()}


def test_same_seed_same_events():
    def events(seed):
        out = []
        eng = build_engine("swa-128", seed=seed, inject=["swa-misaligned@150"], steps=400)
        eng.alloc.subscribe(lambda batch: out.extend(_strip(e) for e in batch))
        eng.run(400)
        eng.shutdown()
        return out

    a, b, c = events(7), events(7), events(8)
    assert len(a) > 1000
    assert a == b
    assert a != c


def test_bare_engine_makes_the_same_calls_as_the_wrapped_one():
    wrapped = build_engine("swa-128", seed=4)
    bare = build_engine("swa-128", seed=4, wrapped=False)
    for _ in range(600):
        wrapped.step()
        bare.step()
        assert wrapped.free_pages() == bare.free_pages()
    assert [r.row for r in wrapped.running] == [r.row for r in bare.running]
    assert bare.shutdown() == []
    assert bare.free_pages() == (bare._full_pages, bare._swa_pages)


def test_raise_mode_stops_at_the_fault():
    from instrumented_alloc import InvariantViolation

    eng = build_engine("swa-128", seed=1, mode="raise", inject=["swa-misaligned@200"], steps=1000)
    with pytest.raises(InvariantViolation) as info:
        eng.run(1000)
    assert info.value.invariant == "swa_evicted_seqlen_page_aligned"
    assert info.value.violation.step == eng.fired[0].step


def test_leak_and_double_free_at_one_finish_do_not_cancel():
    # Both armed for a step where one request finishes alone: the leak keeps its pages, so the double free waits
    # for the next request freed (its "second" free of the leaked request would have been its first, and the two
    # faults cancelled: no violation at all).
    from instrumented_alloc.sim import parse_trace

    trace = parse_trace(
        [
            '{"arrival": 0, "prompt_len": 100, "output_len": 300}',
            '{"arrival": 500, "prompt_len": 300, "output_len": 200}',
            '{"arrival": 501, "prompt_len": 40, "output_len": 30}',
        ],
        "t.jsonl",
    )
    e = build_engine("dense", inject=["leak@520", "double-free@520"], steps=900, trace=trace)
    e.run(900)
    fired = {f.fault: f for f in e.fired}
    assert set(fired) == {"leak", "double-free"} and fired["leak"].rid != fired["double-free"].rid
    assert fired["double-free"].step > fired["leak"].step
    assert dict(e.alloc.violation_counts) == {"request_leak": 1, "double_free": 1}
