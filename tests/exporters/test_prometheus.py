"""exporters.prometheus in single-process mode against a real wrapped allocator, promtool and a real Prometheus
server (multiprocess mode, with real processes: test_prometheus_multiprocess.py).

The scripted scenario runs on an SWA allocator (two pools, page size 4, 16 full pages and 8 SWA pages, window 8);
every expected value is derived by hand in ``scenario``'s comments. Tests that need the ``promtool`` or
``prometheus`` binaries skip when they are missing, and fail instead when CI == "true". Marks: ``integration`` on
tests that run promtool or a Prometheus server.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.utils import floatToGoString

from exporters.prometheus import OP_DURATION_BUCKETS, PrometheusExporter
from instrumented_alloc import INVARIANTS, InstrumentedAllocator, stats
from instrumented_alloc import events as ev
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from tests.engine_model import Req, extend_args, split_extend, t
from tests.prometheus_server import api, need_binary, query, wait_until_up
from tests.public_api import foreign_private_names, private_imports

REPO = Path(__file__).resolve().parents[2]
PS = 4
FULL_PAGES, SWA_PAGES = 16, 8
CAPACITY = {"full": FULL_PAGES + 1, "swa": SWA_PAGES + 1}  # page 0 (reserved) included
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CONST = {"engine": "e0", "tp_rank": "0"}


def make_alloc(**kw):
    inner = SWATokenToKVPoolAllocator(FULL_PAGES * PS, SWA_PAGES * PS, PS, torch.float16, "cpu")
    return InstrumentedAllocator(inner, mode="record", sliding_window=8, **kw)


def extend(w, reqs, lens):
    with w.batch([r.rid for r in reqs]):
        out = w.alloc_extend(*extend_args(reqs, lens))
    if out is not None:
        split_extend(reqs, lens, out)
    return out


def scenario(w) -> None:
    """A few requests, an SWA eviction, a double free, a release with a leak, an allocation failure.

    Pages are handed out from the head of the free list in order, freed pages go back to the head.
    """
    a, b, d = Req("req-a"), Req("req-b"), Req("req-d")
    extend(w, [a, b], [14, 6])  # full: a 1-4, b 5-6 (6 pages); swa: a 1-4, b 5-6 (6 pages)
    w.step()
    w.free_swa_segment(t(a.row[0:4]), start_pos=0)  # swa page 1 back (1 page freed)
    w.ledger[a.rid].swa_evicted_seqlen = 4  # 4 tokens evicted (window 8, seq 14: up to 6 allowed)
    extend(w, [d], [10])  # full: d 7-9; swa: d 1, 7, 8 (3 pages each); the swa pool is now full
    w.step()
    w.free(t(b.row))  # full 5-6 and swa 5-6 freed (2 + 2 pages)
    w.free(t(b.row))  # double_free of req-b's pages (named by the pages' last owner): full 5-6 listed twice
    w.release_request(b.rid)  # owns nothing: no leak; peak 2 pages
    w.step()
    w.release_request(a.rid)  # request_leak: still owns full 1-4 and swa 2-4 (trace id -> exemplar); peak 4
    c = Req("req-c")
    assert extend(w, [c], [100]) is None  # 25 pages: AllocFailed(op=alloc_extend, pool=swa, the one shortest)
    w.step()


def sample(reg, name, **labels):
    return reg.get_sample_value(name, {**CONST, **labels})


@pytest.fixture
def run():
    """A wrapped allocator with an exporter (const labels CONST) after ``scenario``; closes the exporter."""
    made = []

    def make(**exporter_kw):
        w = make_alloc()
        w.trace_id_for = lambda rid: TRACE
        exp = PrometheusExporter(w, const_labels=CONST, multiprocess=False, **exporter_kw)
        made.append(exp)
        scenario(w)
        return w, exp

    yield make
    for exp in made:
        exp.close()


# -- 1. exact values -----------------------------------------------------------------------------------------------
def test_values_after_scripted_scenario(run):
    w, exp = run()
    reg = exp.registry
    pages = {
        pool: {s: sample(reg, "kvalloc_pages", pool=pool, state=s) for s in stats.STATES} for pool in ("full", "swa")
    }
    # full: a 1-4 (leaked) + d 7-9 used, b's 5-6 and 10-16 free; swa: a 2-4 + d 1,7,8 used, b's 5-6 free.
    assert pages["full"] == {"free": 9, "used": 7, "staged": 0, "reserved": 1}
    assert pages["swa"] == {"free": 2, "used": 6, "staged": 0, "reserved": 1}
    for pool, cap in CAPACITY.items():
        assert sum(pages[pool].values()) == cap

    expected_violations = dict.fromkeys(INVARIANTS, 0.0) | {"double_free": 1.0, "request_leak": 1.0}
    got = {inv: sample(reg, "kvalloc_invariant_violations_total", invariant=inv) for inv in INVARIANTS}
    assert got == expected_violations
    assert dict(w.violation_counts) == {"double_free": 1, "request_leak": 1}

    assert sample(reg, "kvalloc_alloc_failures_total", pool="swa", op="alloc_extend") == 1
    assert sample(reg, "kvalloc_alloc_failures_total", pool="full", op="alloc_extend") == 0
    assert sample(reg, "kvalloc_alloc_failures_total", pool="full", op="alloc_decode") == 0
    assert sample(reg, "kvalloc_pages_allocated_total", pool="full") == 6 + 3
    assert sample(reg, "kvalloc_pages_allocated_total", pool="swa") == 6 + 3
    assert sample(reg, "kvalloc_pages_freed_total", pool="full") == 2 + 2  # the double free's entries count
    assert sample(reg, "kvalloc_pages_freed_total", pool="swa") == 1 + 2
    assert sample(reg, "kvalloc_swa_evicted_tokens_total") == 4
    assert sample(reg, "kvalloc_events_dropped_total", sink="prometheus") == 0

    assert sample(reg, "kvalloc_page_size_tokens") == PS
    assert sample(reg, "kvalloc_requests_live") == 1  # d; a was released (leaking) and is no longer live
    assert sample(reg, "kvalloc_swa_outside_window_tokens") == 10 - 8  # d: committed 10, window 8, evicted 0

    fig = stats.figures(w.snapshot())
    for pool in ("full", "swa"):
        pf = fig["pools"][pool]
        assert sample(reg, "kvalloc_internal_fragmentation_ratio", pool=pool) == pf["internal_fragmentation"]
        assert sample(reg, "kvalloc_external_fragmentation_ratio", pool=pool) == pf["external_fragmentation"]
        assert sample(reg, "kvalloc_free_runs", pool=pool) == pf["free_run_count"]
        assert sample(reg, "kvalloc_largest_free_run_pages", pool=pool) == pf["largest_free_run"]
    # By hand: d holds 3 pages = 12 slots for 10 committed tokens in both pools.
    assert sample(reg, "kvalloc_internal_fragmentation_ratio", pool="full") == pytest.approx(1 - 10 / 12)
    # full free runs: 5-6 and 10-16 -> 2 runs, largest 7 of 9 free; swa: 5-6 -> 1 run, nothing scattered.
    assert sample(reg, "kvalloc_free_runs", pool="full") == 2
    assert sample(reg, "kvalloc_largest_free_run_pages", pool="full") == 7
    assert sample(reg, "kvalloc_external_fragmentation_ratio", pool="full") == pytest.approx(1 - 7 / 9)
    assert sample(reg, "kvalloc_external_fragmentation_ratio", pool="swa") == 0

    # Peak pages at release: b 2, a 4.
    assert sample(reg, "kvalloc_request_pages_count", pool="full") == 2
    assert sample(reg, "kvalloc_request_pages_sum", pool="full") == 6
    assert sample(reg, "kvalloc_request_pages_bucket", pool="full", le="2.0") == 1
    # One duration observation per inner call: two extends (the refused one emits no Alloc), two frees, one
    # SWA segment free.
    assert sample(reg, "kvalloc_op_duration_seconds_count", op="alloc_extend") == 2
    assert sample(reg, "kvalloc_op_duration_seconds_count", op="free") == 2
    assert sample(reg, "kvalloc_op_duration_seconds_count", op="free_swa_segment") == 1


def test_the_metric_catalog_is_stable(run):
    # The catalog is public (the dashboard, the alert rules and users' queries read it): every family, in
    # exposition order, with its type and its own labels (the const labels aside).
    _, exp = run()
    got = [
        (fam.name, fam.type, tuple(sorted({k for s in fam.samples for k in s.labels} - set(CONST) - {"le"})))
        for fam in exp.registry.collect()
    ]
    assert got == [
        ("kvalloc_invariant_violations", "counter", ("invariant",)),
        ("kvalloc_alloc_failures", "counter", ("op", "pool")),
        ("kvalloc_pages_allocated", "counter", ("pool",)),
        ("kvalloc_pages_freed", "counter", ("pool",)),
        ("kvalloc_swa_evicted_tokens", "counter", ()),
        ("kvalloc_op_duration_seconds", "histogram", ("op",)),
        ("kvalloc_request_pages", "histogram", ("pool",)),
        ("kvalloc_overhead_seconds", "counter", ("part",)),
        ("kvalloc_overhead_iteration_seconds", "histogram", ()),
        ("kvalloc_pages", "gauge", ("pool", "state")),
        ("kvalloc_page_size_tokens", "gauge", ()),
        ("kvalloc_requests_live", "gauge", ()),
        ("kvalloc_internal_fragmentation_ratio", "gauge", ("pool",)),
        ("kvalloc_external_fragmentation_ratio", "gauge", ("pool",)),
        ("kvalloc_free_runs", "gauge", ("pool",)),
        ("kvalloc_largest_free_run_pages", "gauge", ("pool",)),
        ("kvalloc_swa_outside_window_tokens", "gauge", ()),
        ("kvalloc_events_dropped", "counter", ("sink",)),
    ]


def test_op_duration_histogram_is_the_events_durations_in_seconds():
    # The histogram observes each inner call's own duration, in seconds: a list sink on the same allocator sees
    # the events the exporter aggregates (the full pool's Alloc/Free of each call, and the SWA-only frees).
    w = make_alloc()
    exp = PrometheusExporter(w, const_labels=CONST, multiprocess=False)
    tap = _Tap()
    w.subscribe(tap)
    try:
        scenario(w)
        durations: dict = {}
        for e in (e for batch in tap.batches for e in batch):
            if type(e) in (ev.Alloc, ev.Free) and (e.pool == "full" or e.op in ("free_swa", "free_swa_segment")):
                durations.setdefault(e.op, []).append(e.duration)
        assert {op: len(ds) for op, ds in durations.items()} == {"alloc_extend": 2, "free": 2, "free_swa_segment": 1}
        reg = exp.registry
        for op, ds in durations.items():
            assert all(d > 0 for d in ds)  # measured: a zero would hide the unit
            total = 0.0
            for d in ds:  # the exporter's running sum, in the same order
                total += d
            assert sample(reg, "kvalloc_op_duration_seconds_sum", op=op) == total
            for le in OP_DURATION_BUCKETS:
                n = sum(d <= le for d in ds)
                assert sample(reg, "kvalloc_op_duration_seconds_bucket", op=op, le=floatToGoString(le)) == n, (op, le)
            assert sample(reg, "kvalloc_op_duration_seconds_bucket", op=op, le="+Inf") == len(ds)
            assert sample(reg, "kvalloc_op_duration_seconds_count", op=op) == len(ds)
    finally:
        exp.close()


def test_swa_evicted_tokens_count_each_eviction_once():
    # Two successive evictions of one request (window 8, 16 tokens): 0 -> 4, then 4 -> 8 tokens: 4 + 4.
    w = make_alloc()
    exp = PrometheusExporter(w, const_labels=CONST, multiprocess=False)
    try:
        a = Req("req-a")
        extend(w, [a], [16])  # full and swa: a 1-4
        w.step()
        got = []
        for lo, hi in ((0, 4), (4, 8)):
            w.free_swa_segment(t(a.row[lo:hi]), start_pos=lo)  # one swa page back each time
            w.ledger[a.rid].swa_evicted_seqlen = hi
            w.step()
            got.append(sample(exp.registry, "kvalloc_swa_evicted_tokens_total"))
        assert got == [4, 8]
        assert sample(exp.registry, "kvalloc_pages_freed_total", pool="swa") == 2
        assert dict(w.violation_counts) == {}
    finally:
        exp.close()


def test_histogram_sums_across_scrapes():
    # A scrape publishes what the sink aggregated since the last one: the sum is the running sum, not the sum
    # added again on top of what an earlier scrape published.
    w = make_alloc()
    exp = PrometheusExporter(w, const_labels=CONST, multiprocess=False)
    reg = exp.registry
    try:
        a, b = Req("req-a"), Req("req-b")
        extend(w, [a, b], [16, 6])  # a 4 pages, b 2 pages
        w.step()
        assert sample(reg, "kvalloc_request_pages_count", pool="full") == 0
        w.free(t(b.row))
        w.release_request(b.rid)  # peak 2
        assert sample(reg, "kvalloc_request_pages_sum", pool="full") == 2
        assert sample(reg, "kvalloc_request_pages_count", pool="full") == 1
        w.free(t(a.row))
        w.release_request(a.rid)  # peak 4
        assert sample(reg, "kvalloc_request_pages_sum", pool="full") == 2 + 4
        assert sample(reg, "kvalloc_request_pages_count", pool="full") == 2
        assert sample(reg, "kvalloc_request_pages_bucket", pool="full", le="2.0") == 1
        assert sample(reg, "kvalloc_request_pages_bucket", pool="full", le="4.0") == 2
        assert sample(reg, "kvalloc_request_pages_sum", pool="full") == 6  # a scrape with nothing new: unchanged
        assert dict(w.violation_counts) == {}
    finally:
        exp.close()


def test_collections_while_the_engine_runs_never_go_back_and_end_exact():
    # Single-process families are built at collection time from totals the sink writes without a lock: collections
    # on another thread while the engine runs all succeed, a counter never goes back, and one after the run has
    # every event.
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, PS, torch.float16, "cpu"), mode="record")
    exp = PrometheusExporter(w, multiprocess=False)
    reg, stop, seen, errors = exp.registry, threading.Event(), [], []

    def scrape():
        while not stop.is_set():
            try:
                seen.append(reg.get_sample_value("kvalloc_pages_allocated_total", {"pool": "full"}))
                generate_latest(reg)
            except Exception as exc:  # kept: the assertion below names it
                errors.append(exc)

    th = threading.Thread(target=scrape)
    th.start()
    try:
        for _ in range(300):
            w.free(w.alloc(8))  # 2 pages
            w.step()
    finally:
        stop.set()
        th.join(timeout=30)
    try:
        assert errors == [] and exp.last_error is None and exp.sink_errors == 0
        assert len(seen) > 1 and seen == sorted(seen)
        assert reg.get_sample_value("kvalloc_pages_allocated_total", {"pool": "full"}) == 600
        assert reg.get_sample_value("kvalloc_pages_freed_total", {"pool": "full"}) == 600
        assert reg.get_sample_value("kvalloc_op_duration_seconds_count", {"op": "alloc"}) == 300
        assert reg.get_sample_value("kvalloc_op_duration_seconds_bucket", {"op": "free", "le": "+Inf"}) == 300
        assert reg.get_sample_value("kvalloc_overhead_iteration_seconds_count") == 300
    finally:
        exp.close()


def test_created_series_follow_prometheus_clients_setting(run):
    # The families carry the samples prometheus_client's own Counter and Histogram would: a _created per counter
    # and histogram series while those are on (the default), none after disable_created_metrics().
    from prometheus_client import disable_created_metrics, enable_created_metrics

    _, exp = run()

    def names() -> list[str]:
        return [s.name for fam in exp.registry.collect() for s in fam.samples]

    was_on = any(n.endswith("_created") for n in names())
    try:
        enable_created_metrics()
        on = names()
        series = [n for n in on if n.endswith(("_total", "_count")) and n != "kvalloc_events_dropped_total"]
        assert len([n for n in on if n.endswith("_created")]) == len(series) > 30
        disable_created_metrics()
        off = names()
        assert [n for n in off if n.endswith("_created")] == []
        assert off == [n for n in on if not n.endswith("_created")]
    finally:
        (enable_created_metrics if was_on else disable_created_metrics)()


def test_gauges_are_computed_at_scrape_time_not_per_call():
    w = make_alloc()
    calls = []
    real = w.snapshot

    def counting_snapshot(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    object.__setattr__(w, "snapshot", counting_snapshot)
    exp = PrometheusExporter(w, multiprocess=False)
    try:
        scenario(w)
        assert calls == []  # nothing per allocator call nor per step
        assert exp.registry.get_sample_value("kvalloc_pages", {"pool": "full", "state": "used"}) == 7
        assert calls == [{"wait": False}]  # one snapshot per scrape, never waiting on deferred checks
    finally:
        exp.close()


def test_calls_on_a_pools_own_allocator_are_counted_once_each():
    """SGLang's caches call the pools' own allocators (the wrapper's checked views): each such call is one op-duration
    observation under its own op, and its pages count in its pool's churn."""
    w = make_alloc()
    exp = PrometheusExporter(w, multiprocess=False)
    try:
        cached = w.alloc_extend(*extend_args([Req("tree")], [16]))  # outside batch(): the cache's pages
        w.full_attn_allocator.free_segment(cached, start_pos=0)  # the unified radix cache's eviction, full side
        w.free_swa_segment(cached, start_pos=0)  # then its SWA side
        loaded = w.swa_attn_allocator.alloc(8)  # an external load into the SWA pool, aborted
        w.swa_attn_allocator.free(loaded)
        w.step()
        reg = exp.registry
        ops = (
            "alloc_extend",
            "full_attn_allocator.free_segment",
            "free_swa_segment",
            "swa_attn_allocator.alloc",
            "swa_attn_allocator.free",
        )
        count = "kvalloc_op_duration_seconds_count"
        assert {op: reg.get_sample_value(count, {"op": op}) for op in ops} == dict.fromkeys(ops, 1.0)
        assert reg.get_sample_value("kvalloc_pages_allocated_total", {"pool": "full"}) == 4
        assert reg.get_sample_value("kvalloc_pages_allocated_total", {"pool": "swa"}) == 4 + 2
        assert reg.get_sample_value("kvalloc_pages_freed_total", {"pool": "full"}) == 4
        assert reg.get_sample_value("kvalloc_pages_freed_total", {"pool": "swa"}) == 4 + 2
        violations = "kvalloc_invariant_violations_total"
        assert sum(reg.get_sample_value(violations, {"invariant": i}) for i in INVARIANTS) == 0
    finally:
        exp.close()


def test_violation_exemplar_carries_trace_id(run):
    _, exp = run()
    text = generate_openmetrics(exp.registry).decode()
    leak = [ln for ln in text.splitlines() if ln.startswith("kvalloc_invariant_violations_total{")]
    leak = [ln for ln in leak if 'invariant="request_leak"' in ln]
    assert len(leak) == 1 and f'# {{trace_id="{TRACE}"}} 1.0' in leak[0], leak
    # The double free is named after req-b, the pages' last owner: its trace id is the exemplar too.
    double = [ln for ln in text.splitlines() if 'invariant="double_free"' in ln and "_total" in ln]
    assert len(double) == 1 and f'# {{trace_id="{TRACE}"}} 1.0' in double[0], double


# -- 2. promtool -------------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_promtool_check_metrics(run):
    promtool = need_binary("promtool")
    _, exp = run()
    text = generate_latest(exp.registry)
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert res.returncode == 0, (res.stdout + res.stderr).decode()


# -- 3. a real Prometheus ----------------------------------------------------------------------------------------
def test_real_prometheus_scrapes_served_port(run, prometheus_server, tmp_path):
    _, exp = run()
    port = exp.serve()
    base = prometheus_server(port)
    wait_until_up(base, "kvalloc_pages", tmp_path)

    full = query(base, 'sum(kvalloc_pages{pool="full"})')
    assert float(full[0]["value"][1]) == CAPACITY["full"]
    swa = query(base, 'sum by (pool) (kvalloc_pages{pool="swa"})')
    assert float(swa[0]["value"][1]) == CAPACITY["swa"]
    double = query(base, 'kvalloc_invariant_violations_total{invariant="double_free"}')
    assert len(double) == 1 and float(double[0]["value"][1]) == 1
    assert double[0]["metric"]["engine"] == "e0" and double[0]["metric"]["tp_rank"] == "0"
    assert len(query(base, "kvalloc_invariant_violations_total")) == len(INVARIANTS)
    used = query(base, 'kvalloc_pages{pool="full",state="used"}')
    assert float(used[0]["value"][1]) == 7
    # Prometheus asks for OpenMetrics: the violation's trace id arrives as a stored exemplar.
    now = time.time()
    ex = api(
        base,
        "/api/v1/query_exemplars",
        query='kvalloc_invariant_violations_total{invariant="request_leak"}',
        start=now - 300,
        end=now + 60,
    )
    assert [e["labels"]["trace_id"] for series in ex for e in series["exemplars"]] == [TRACE]


def test_serve_negotiates_openmetrics_and_default_addr(run):
    _, exp = run()
    port = exp.serve()
    url = f"http://127.0.0.1:{port}/metrics"
    req = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        body = r.read().decode()
    assert f'trace_id="{TRACE}"' in body and body.rstrip().endswith("# EOF")
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        assert 'kvalloc_pages{engine="e0",pool="full",state="used",tp_rank="0"} 7.0' in r.read().decode()
    assert exp._httpd.server_address[0] == "127.0.0.1"  # loopback unless told otherwise


# -- 4. failures never reach the allocator's caller -----------------------------------------------------------------
def test_port_already_taken_names_the_port(run):
    _, exp = run()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"metrics port {port} on 127.0.0.1 is already in use") as info:
            exp.serve(port=port)
        assert info.value.errno == errno.EADDRINUSE
    assert exp.serve(port=0) > 0  # still usable afterwards


class _Tap:
    name = "tap"

    def __init__(self):
        self.batches = []

    def __call__(self, batch):
        self.batches.append(list(batch))


def test_failing_sink_never_reaches_the_caller(monkeypatch):
    w = PagedTokenToKVPoolAllocator(64, PS, torch.float16, "cpu")
    bare = PagedTokenToKVPoolAllocator(64, PS, torch.float16, "cpu")
    w = InstrumentedAllocator(w, mode="record")
    exp = PrometheusExporter(w, multiprocess=False)
    tap = _Tap()
    w.subscribe(tap)
    try:

        def boom(op):
            raise RuntimeError("boom")

        monkeypatch.setattr(exp._totals, "new_duration", boom)  # the sink's first duration of an op raises
        a = Req("a")
        args = extend_args([a], [6])
        with w.batch(["a"]):
            out = w.alloc_extend(*args)  # no exception
        assert torch.equal(out, bare.alloc_extend(*args))
        w.step()  # the step's statistics reach the sink, which refuses the boundary's whole batch
        n_events = len(tap.batches[-1])
        assert any(type(e) is ev.StepStats for e in tap.batches[-1])
        reg = exp.registry
        assert reg.get_sample_value("kvalloc_events_dropped_total", {"sink": "prometheus"}) == n_events
        assert reg.get_sample_value("kvalloc_events_dropped_total", {"sink": "tap"}) == 0
        assert exp.sink_errors == 1 and "boom" in exp.last_error
        assert w.bus.errors == {}  # caught inside the exporter, reported to the bus as refused
        # The collector keeps working, and the allocator too.
        assert reg.get_sample_value("kvalloc_pages", {"pool": "full", "state": "used"}) == 2
        w.free(t(a.row))
    finally:
        exp.close()


def test_failing_collector_keeps_the_scrape_alive(run, monkeypatch, caplog):
    w, exp = run()

    def broken(**kwargs):
        raise RuntimeError("snapshot broke")

    object.__setattr__(w, "snapshot", broken)
    port = exp.serve()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        body = r.read().decode()
    assert "kvalloc_pages{" not in body  # gauges left out, not wrong
    assert 'kvalloc_invariant_violations_total{engine="e0",invariant="double_free",tp_rank="0"} 1.0' in body
    assert "kvalloc_events_dropped_total" in body
    assert "snapshot broke" in exp.last_error


def test_close_detaches(run):
    w, exp = run()
    exp.serve()
    exp.close()
    assert exp.sink not in w.bus.sinks
    assert list(exp.registry.collect()) == []
    exp.close()  # idempotent


def test_const_labels_cannot_shadow_catalog_labels():
    w = make_alloc()
    for bad in ({"pool": "x"}, {"invariant": "x"}, {"part": "x"}, {"1x": "y"}, {"__x": "y"}):
        with pytest.raises(ValueError, match="const_labels"):
            PrometheusExporter(w, const_labels=bad, multiprocess=False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, "1", True])
def test_refresh_interval_must_be_finite(bad):
    with pytest.raises(ValueError, match="refresh_interval: expected a finite number of seconds >= 0"):
        PrometheusExporter(make_alloc(), refresh_interval=bad)


def test_the_exporter_touches_no_private_attribute_of_prometheus_client():
    # Every private name the package reads or writes is one it defines itself, or the wrapper's lock (``close()``
    # asks whether its caller holds it): none of prometheus_client's.
    package = REPO / "exporters" / "prometheus"
    assert foreign_private_names(package) == {"_w_lock", "_is_owned"}
    assert private_imports(package, "prometheus_client") == []


# -- 5. label cardinality ----------------------------------------------------------------------------------------
def test_no_label_is_a_request_id(run):
    _, exp = run()
    rids = {"req-a", "req-b", "req-c", "req-d"}
    allowed = {"pool", "state", "invariant", "op", "sink", "part", "le", *CONST}
    n = 0
    for fam in exp.registry.collect():
        assert fam.name.startswith("kvalloc_")
        for s in fam.samples:
            n += 1
            assert set(s.labels) <= allowed, (s.name, s.labels)
            assert s.labels.get("part", "hooks") in ("hooks", "ledger", "checks", "exporters"), s.labels
            for v in s.labels.values():
                assert not any(rid in v for rid in rids), (s.name, s.labels)
    assert n > 100
