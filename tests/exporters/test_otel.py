"""OtelExporter: request spans from a wrapped allocator, OTLP/HTTP export to a real receiver, and an engine thread
that never waits on the network (collector down or slow).

In-memory tests use the SDK's InMemorySpanExporter behind a SimpleSpanProcessor; the OTLP tests run a small
HTTP receiver on 127.0.0.1 and assert on what it decoded, never on force_flush's return value.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from exporters.otel import OtelExporter
from instrumented_alloc import InstrumentedAllocator, Violation
from instrumented_alloc.allocators import (
    PagedTokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from instrumented_alloc.events import LedgerUpdate, RequestReleased, ViolationEvent
from instrumented_alloc.prealloc import alloc_for_decode_prealloc, swa_tail_len
from tests.engine_model import Req, allocator_state, decode_args, extend_args, split_extend, t
from tests.otlp_receiver import Receiver

PS = 4


# -- helpers ----------------------------------------------------------------------------------------------------
@pytest.fixture
def memory():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def paged(size=64):
    return InstrumentedAllocator(PagedTokenToKVPoolAllocator(size, PS, torch.float16, "cpu"), mode="record")


def extend(w, reqs, lens):
    with w.batch([r.rid for r in reqs]):
        out = w.alloc_extend(*extend_args(reqs, lens))
    split_extend(reqs, lens, out)
    return out


def decode(w, reqs):
    with w.batch([r.rid for r in reqs]):
        out = w.alloc_decode(*decode_args(reqs))
    for r, s in zip(reqs, out.tolist()):
        r.row.append(s)
    return out


def hex_id(span) -> str:
    return format(span.context.trace_id, "032x")


def request_spans(exporter) -> dict:
    return {s.attributes["kv.request.id"]: s for s in exporter.get_finished_spans() if s.name == "kv.request"}


def events(span, name=None) -> list:
    return [(e.name, dict(e.attributes)) for e in span.events if name is None or e.name == name]


# -- 1. request spans, in memory ---------------------------------------------------------------------------------
class _PerDecodeUpdates:
    """A sink that reads every decode's LedgerUpdate (it does not declare ``decode_ledgers = False``; it declares
    the exporter's other two, so nothing else is built for it): beside it the wrapper builds those updates instead
    of folds, and the exporter folds them itself."""

    name = "per-decode-updates"
    event_types = frozenset({LedgerUpdate})
    free_ledgers = False
    decode_allocs = False

    def __call__(self, batch) -> None:
        return None


def fold_in(w, where: str) -> None:
    """Where runs of decodes get folded for the exporter: "wrapper" (the exporter alone: ``DecodeFold``) or
    "exporter" (a sink that reads the per-decode updates is subscribed too)."""
    assert where in ("wrapper", "exporter")
    if where == "exporter":
        w.subscribe(_PerDecodeUpdates())


def test_request_spans_scripted(memory):
    provider, mem = memory
    w = paged()
    exp = OtelExporter(w, tracer_provider=provider)
    a, b = Req("a"), Req("b")
    extend(w, [a, b], [6, 9])
    w.step()
    for _ in range(3):
        decode(w, [a, b])
        w.step()
    # a finishes cleanly.
    w.free(t(a.row))
    w.release_request("a")
    # b: a double free of its first page (named after the page's last owner, b), a rejected ledger write, and a
    # release while still owning two pages.
    w.free(t(b.row[:4]))
    w.free(t(b.row[:4]))
    w.ledger["b"].kv_committed_len = 99
    w.release_request("b")
    w.step()

    spans = mem.get_finished_spans()
    assert sorted(s.name for s in spans) == ["kv.request", "kv.request"]
    reqs = request_spans(mem)
    sa, sb = reqs["a"], reqs["b"]
    assert dict(sa.attributes) == {
        "kv.request.id": "a",
        "kv.page_size": PS,
        "kv.allocated_len": 12,  # 6 + 3 decodes = 9 tokens, 3 pages
        "kv.committed_len": 9,
        "kv.swa_evicted_seqlen": 0,
        "kv.pages.peak": 3,
        "kv.pages.held_at_release": 0,
        "kv.violations": 0,
        "kv.decode_steps": 3,
        "kv.events_dropped": 0,
    }
    assert events(sa) == [
        ("kv.prefill", {"kv.op": "alloc_extend", "kv.step": 0, "kv.n_slots": 6, "kv.n_pages": 2, "kv.batch_size": 2}),
        ("kv.release", {"kv.pages_held": 0, "kv.pages_peak": 3, "kv.step": 4}),
    ]
    assert sa.status.status_code in (StatusCode.UNSET, StatusCode.OK)

    assert dict(sb.attributes) == {
        "kv.request.id": "b",
        "kv.page_size": PS,
        "kv.allocated_len": 12,
        "kv.committed_len": 12,
        "kv.swa_evicted_seqlen": 0,
        "kv.pages.peak": 3,
        "kv.pages.held_at_release": 2,
        "kv.violations": 3,
        "kv.decode_steps": 3,
        "kv.events_dropped": 0,
    }
    assert [name for name, _ in events(sb)] == [
        "kv.prefill",
        "kv.violation",
        "kv.violation",
        "kv.violation",
        "kv.release",
    ]
    assert events(sb, "kv.prefill")[0][1]["kv.n_slots"] == 9
    (_, v0), (_, v1), (_, v2) = events(sb, "kv.violation")
    assert v0["kv.violation.invariant"] == "double_free"
    assert v1["kv.violation.invariant"] == "kv_committed_le_allocated"
    assert v2["kv.violation.invariant"] == "request_leak"
    assert v2["kv.violation.message"] == (
        "request 'b' released while still owning 2 pages, neither freed nor handed to the prefix cache "
        "(full: [4, 5] (2 pages))"
    )
    assert events(sb, "kv.release") == [("kv.release", {"kv.pages_held": 2, "kv.pages_peak": 3, "kv.step": 4})]
    assert sb.status.status_code is StatusCode.ERROR
    assert sb.status.description.startswith("double_free: ")
    # Decode allocations are counted, never evented.
    for s in (sa, sb):
        assert {name for name, _ in events(s)} <= {"kv.prefill", "kv.violation", "kv.release"}

    # Violation records carry the trace id of their request's span.
    vs = list(w.violations)
    assert [v.invariant for v in vs] == ["double_free", "kv_committed_le_allocated", "request_leak"]
    assert vs[0].rid == "b"
    assert vs[0].trace_id == vs[1].trace_id == vs[2].trace_id == hex_id(sb)
    assert len(vs[1].trace_id) == 32
    assert hex_id(sa) != hex_id(sb)
    assert w.bus.dropped["otel"] == 0 and exp.errors == 0
    assert exp.open_requests == 0


def test_violation_in_first_call_opens_the_span(memory):
    """A violation raised by a request's very first allocation already carries that request's trace id."""
    provider, mem = memory
    w = paged()
    OtelExporter(w, tracer_provider=provider)
    a = Req("a")
    extend(w, [a], [6])
    used_page = a.row[0] // PS
    w.inner.free_pages = torch.cat([t([used_page]), w.inner.free_pages[1:]])  # an allocator bug
    c = Req("c")
    extend(w, [c], [4])
    (v,) = w.violations
    assert (v.invariant, v.rid) == ("duplicate_allocation", "c")
    assert w.ledger["c"].kv_allocated_len == 4
    w.release_request("c")  # c still owns its (shared) page: a leak too
    sc = request_spans(mem)["c"]
    assert v.trace_id == hex_id(sc)
    assert [name for name, _ in events(sc)] == ["kv.violation", "kv.prefill", "kv.violation", "kv.release"]
    assert sc.attributes["kv.violations"] == 2
    assert sc.status.status_code is StatusCode.ERROR


def test_page_size_one_alloc_prefill_decode_and_retraction(memory):
    """At page size 1 SGLang allocates prefill and decode with alloc(n): a one-slot alloc of a request that
    already holds KV is a decode. A retracted (freed, not released) request's re-prefill is measured from its
    current record."""
    provider, mem = memory
    w = InstrumentedAllocator(TokenToKVPoolAllocator(64, torch.float16, "cpu"), mode="record")
    OtelExporter(w, tracer_provider=provider)
    with w.batch(["a", "b"], lens=[3, 5]):
        ab = w.alloc(8)
    for _ in range(2):
        with w.batch(["a", "b"]):
            ab = torch.cat([ab, w.alloc(2)])
        w.step()
    a_slots = ab[[0, 1, 2, 8, 10]]
    w.free(a_slots)  # retract a: all its KV freed, the request is not released
    with w.batch(["a"]):
        a_slots = w.alloc(5)  # re-prefill its 5 tokens
    w.free(a_slots)
    w.release_request("a")
    sa = request_spans(mem)["a"]
    assert events(sa) == [
        ("kv.prefill", {"kv.op": "alloc", "kv.step": 0, "kv.n_slots": 3, "kv.n_pages": 3, "kv.batch_size": 2}),
        ("kv.prefill", {"kv.op": "alloc", "kv.step": 2, "kv.n_slots": 5, "kv.n_pages": 5}),
        ("kv.release", {"kv.pages_held": 0, "kv.pages_peak": 5, "kv.step": 2}),
    ]
    assert sa.attributes["kv.decode_steps"] == 2
    assert sa.attributes["kv.committed_len"] == sa.attributes["kv.allocated_len"] == 5
    assert not w.violations


def test_prefill_of_new_requests_with_a_cached_prefix(memory):
    """A new request whose prompt prefix is cached (a radix cache hit: alloc_extend with prefix_lens > 0 for a
    request the allocator never saw): its ledger share would overcount, so the prefill event gives the call's
    own slots and new pages, alone (kv.n_*) or for a batch of two (kv.batch_n_*)."""
    provider, mem = memory
    w = paged()
    exp = OtelExporter(w, tracer_provider=provider)
    p = Req("p")
    extend(w, [p], [8])  # 8 tokens, 2 full pages, kept in the prefix cache
    w.step()
    # q: prefix 8 cached, 6 new tokens (positions 8..13): 6 slots on 2 new pages.
    q = Req("q", row=list(p.row))
    extend(w, [q], [6])
    # r and s in one batch, each prefix 8 cached, 5 and 3 new tokens: 8 slots on 2 + 1 = 3 new pages.
    r, s = Req("r", row=list(p.row)), Req("s", row=list(p.row))
    extend(w, [r, s], [5, 3])
    for x in (q, r, s):
        w.release_request(x.rid)
    exp.shutdown()
    spans = request_spans(mem)
    assert events(spans["q"], "kv.prefill") == [
        ("kv.prefill", {"kv.op": "alloc_extend", "kv.step": 1, "kv.n_slots": 6, "kv.n_pages": 2})
    ]
    batch = {"kv.op": "alloc_extend", "kv.step": 1, "kv.batch_size": 2, "kv.batch_n_slots": 8, "kv.batch_n_pages": 3}
    assert events(spans["r"], "kv.prefill") == events(spans["s"], "kv.prefill") == [("kv.prefill", batch)]


def test_events_per_span_are_bounded(memory):
    provider, mem = memory
    w = paged()
    OtelExporter(w, tracer_provider=provider, max_events_per_span=3)
    a = Req("a")
    for _ in range(5):  # chunked prefill: five prefill events
        extend(w, [a], [4])
        w.step()
    for _ in range(6):
        decode(w, [a])
    w.free(t(a.row))
    w.release_request("a")
    sa = request_spans(mem)["a"]
    # The first two prefills, then the release in the place kept for it.
    assert [name for name, _ in events(sa)] == ["kv.prefill", "kv.prefill", "kv.release"]
    assert [e["kv.step"] for _, e in events(sa, "kv.prefill")] == [0, 1]
    assert sa.attributes["kv.events_dropped"] == 3
    assert sa.attributes["kv.decode_steps"] == 6
    assert sa.attributes["kv.allocated_len"] == 28 and sa.attributes["kv.committed_len"] == 26
    assert sa.attributes["kv.pages.peak"] == 7


def test_violation_without_request_gets_its_own_span(memory):
    provider, mem = memory
    w = paged()
    exp = OtelExporter(w, tracer_provider=provider)
    w.free_page_ids(t([12]))  # never handed out
    (s,) = mem.get_finished_spans()
    assert s.name == "kv.violation"
    assert s.status.status_code is StatusCode.ERROR
    assert s.attributes["kv.violation.invariant"] == "free_unallocated"
    assert s.attributes["kv.violation.op"] == "free_page_ids"
    assert s.attributes["kv.violation.pool"] == "full"
    assert s.attributes["kv.violation.message"] == w.violations[0].message
    assert s.end_time is not None and s.parent is None
    assert exp.open_requests == 0


def test_late_violation_of_a_released_request_joins_its_trace(memory):
    """A violation naming a request whose span ended (e.g. a later sweep's leak) lands in that trace."""
    provider, mem = memory
    w = paged()
    exp = OtelExporter(w, tracer_provider=provider)
    a = Req("a")
    extend(w, [a], [5])
    w.free(t(a.row))
    w.release_request("a")
    sa = request_spans(mem)["a"]
    assert exp.trace_id_for("a") == hex_id(sa)
    assert exp([ViolationEvent(seq=1, ts=0.0, step=9, violation=Violation("request_leak", "late", rid="a"))])
    late = mem.get_finished_spans()[-1]
    assert late.name == "kv.violation"
    assert late.context.trace_id == sa.context.trace_id
    assert late.parent.span_id == sa.context.span_id
    assert late.attributes["kv.request.id"] == "a"
    assert exp.trace_id_for("never-seen") is None


def test_sink_failure_never_reaches_the_allocator(memory, monkeypatch):
    provider, _ = memory
    w = paged()
    bare = PagedTokenToKVPoolAllocator(64, PS, torch.float16, "cpu")
    exp = OtelExporter(w, tracer_provider=provider)

    def boom(*args, **kwargs):
        raise RuntimeError("tracer down")

    monkeypatch.setattr(exp._tracer, "start_span", boom)
    a = Req("a")
    out = extend(w, [a], [6])
    assert torch.equal(out, bare.alloc_extend(*extend_args([Req("a")], [6])))
    assert exp.errors == 1 and "tracer down" in exp.last_error
    assert w.bus.dropped["otel"] > 0
    assert w.violations == type(w.violations)(maxlen=w.violations.maxlen)  # nothing recorded


def test_shutdown_detaches_and_ends_open_spans(memory):
    provider, mem = memory
    w = paged()
    exp = OtelExporter(w, tracer_provider=provider)
    a = Req("a")
    extend(w, [a], [6])
    assert exp.open_requests == 1 and not mem.get_finished_spans()
    assert exp.shutdown(timeout_millis=1000)
    (sa,) = mem.get_finished_spans()
    assert sa.attributes["kv.open_at_shutdown"] is True
    assert sa.attributes["kv.allocated_len"] == 8
    assert exp not in w.bus.sinks and w.trace_id_for is None
    decode(w, [a])  # the wrapper goes on without the exporter
    assert len(mem.get_finished_spans()) == 1


# -- 2. SWA: prealloc with a tail, evictions ---------------------------------------------------------------------
def test_swa_prealloc_and_evictions(memory):
    provider, mem = memory
    w = InstrumentedAllocator(
        SWATokenToKVPoolAllocator(64, 64, PS, torch.float16, "cpu", None, False), mode="record", sliding_window=8
    )
    OtelExporter(w, tracer_provider=provider)
    tail = swa_tail_len(20, 8, PS)
    assert tail == 8
    p = Req("p", row=alloc_for_decode_prealloc(w, rid="p", fill_len=20, swa_tail_len=tail).tolist())
    w.step()
    for _ in range(4):  # 24 tokens
        decode(w, [p])
        w.step()
    w.free_swa_segment(t(p.row[12:16]), start_pos=12)
    w.ledger["p"].swa_evicted_seqlen = 16
    w.step()
    # A second, ordinary request, decoding past two eviction points.
    q = Req("q")
    extend(w, [q], [10])
    for _ in range(6):  # 16 tokens: the window allows evicting 4, then 8
        decode(w, [q])
        if q.seq in (12, 16):
            done = w.ledger["q"].swa_evicted_seqlen
            w.free_swa_segment(t(q.row[done : q.seq - 8]), start_pos=done)
            w.ledger["q"].swa_evicted_seqlen = q.seq - 8
        w.step()
    w.free(t(p.row))
    w.release_request("p")
    w.free(t(q.row))
    w.release_request("q")
    assert not w.violations

    reqs = request_spans(mem)
    sp, sq = reqs["p"], reqs["q"]
    assert events(sp) == [
        (
            "kv.prealloc",
            {"kv.op": "alloc_extend_swa_tail", "kv.step": 0, "kv.n_slots": 20, "kv.n_pages": 5, "kv.swa_tail_len": 8},
        ),
        (
            "kv.swa_evict",
            {"kv.swa_evicted_seqlen.old": 0, "kv.swa_evicted_seqlen.new": 12, "kv.n_pages": 3, "kv.step": 0},
        ),
        (
            "kv.swa_evict",
            {"kv.swa_evicted_seqlen.old": 12, "kv.swa_evicted_seqlen.new": 16, "kv.n_pages": 1, "kv.step": 5},
        ),
        ("kv.release", {"kv.pages_held": 0, "kv.pages_peak": 6, "kv.step": 12}),
    ]
    assert sp.attributes["kv.swa_evicted_seqlen"] == 16
    assert sp.attributes["kv.allocated_len"] == 24 and sp.attributes["kv.committed_len"] == 24
    assert sp.attributes["kv.decode_steps"] == 4
    assert sp.status.status_code is StatusCode.UNSET

    assert [name for name, _ in events(sq)] == ["kv.prefill", "kv.swa_evict", "kv.swa_evict", "kv.release"]
    assert [
        (e["kv.swa_evicted_seqlen.old"], e["kv.swa_evicted_seqlen.new"], e["kv.n_pages"])
        for _, e in events(sq, "kv.swa_evict")
    ] == [(0, 4, 1), (4, 8, 1)]
    assert sq.attributes["kv.swa_evicted_seqlen"] == 8
    assert sq.attributes["kv.decode_steps"] == 6
    assert sq.attributes["kv.committed_len"] == 16


@pytest.mark.parametrize("where", ["exporter", "wrapper"])
def test_swa_evictions_leave_the_decode_fold_open(memory, where):
    """An SWA eviction of an open request (its ``swa_evicted_seqlen`` write and ``SwaEvict``) reads no record's
    values: the decode fold stays open across it. Folded by the exporter (per-decode updates delivered), the write
    is deferred and replayed at the flush where per-event updates put it: after the folded decodes' values when it
    is the later (a release right after the eviction), or replaced by a later decode's values (the decode carries
    the ledger as of its call), or applied whatever the decodes when it names a request they do not (one that
    holds KV but does not decode). Folded by the wrapper, the eviction's free of SWA pages changes no ledger value
    and leaves its fold open too; the write arrives first and the fold, built later, carries the values with it.
    The spans are the same either way."""
    provider, mem = memory
    w = InstrumentedAllocator(
        SWATokenToKVPoolAllocator(128, 128, PS, torch.float16, "cpu", None, False), mode="record", sliding_window=8
    )
    exp = OtelExporter(w, tracer_provider=provider)
    fold_in(w, where)
    p, q, r = Req("p"), Req("q"), Req("r")
    extend(w, [p, q, r], [10, 10, 14])

    def evict(req, upto):
        done = w.ledger[req.rid].swa_evicted_seqlen
        w.free_swa_segment(t(req.row[done:upto]), start_pos=done)
        w.ledger[req.rid].swa_evicted_seqlen = upto

    for _ in range(6):  # p and q from 10 to 16 tokens; r holds its 14 and does not decode
        decode(w, [p, q])
        w.step()
        if p.seq == 12:
            evict(p, 4)
            evict(q, 4)
            evict(r, 4)  # a request the decodes do not name
            if where == "exporter":
                assert exp._dec is not None and len(exp._dec[3]) == 3  # the fold stays open, the writes deferred
            else:
                assert exp._dec is None and w._w_st.fold[2] == 2  # the wrapper's fold stays open: two decodes
    evict(p, 8)  # after the latest decode: the value p's span ends with
    w.free(t(p.row))
    w.release_request("p")
    w.free(t(q.row))
    w.release_request("q")
    w.free(t(r.row))
    w.release_request("r")
    assert not w.violations
    spans = request_spans(mem)
    got = {
        rid: tuple(spans[rid].attributes[k] for k in ("kv.swa_evicted_seqlen", "kv.decode_steps", "kv.allocated_len"))
        for rid in "pqr"
    }
    assert got == {"p": (8, 6, 16), "q": (4, 6, 16), "r": (4, 0, 16)}
    assert [n for n, _ in events(spans["p"])] == ["kv.prefill", "kv.swa_evict", "kv.swa_evict", "kv.release"]
    assert [n for n, _ in events(spans["r"])] == ["kv.prefill", "kv.swa_evict", "kv.release"]


# -- 3. end to end over OTLP/HTTP --------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["env-gzip", "endpoint-arg"])
def test_otlp_http_end_to_end(otel_env, how):
    rx = Receiver()
    try:
        if how == "env-gzip":
            otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.base + "/v1/traces")
            otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
            w = paged()
            exp = OtelExporter(w)
            service = "instrumented-alloc"
        else:
            otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # endpoint= overrides it
            otel_env.setenv("OTEL_SERVICE_NAME", "kv-e2e")
            w = paged()
            exp = OtelExporter(w, endpoint=rx.base)
            service = "kv-e2e"
        a, b, c = Req("a"), Req("b"), Req("c")
        extend(w, [a, b, c], [6, 9, 3])
        for _ in range(2):
            decode(w, [a, b, c])
            w.step()
        w.free(t(a.row))
        w.release_request("a")
        w.release_request("b")  # leaks
        exp.force_flush(timeout_millis=5000)
        assert rx.wait_for(lambda r: {"a", "b"} <= set(r.request_spans()))
        got = rx.request_spans()
        assert set(got) == {"a", "b"}  # c is still running: its span is open
        span_a, attrs_a = got["a"]
        span_b, attrs_b = got["b"]
        assert attrs_a["kv.decode_steps"] == 2 and attrs_a["kv.allocated_len"] == 8
        assert attrs_b["kv.violations"] == 1 and attrs_b["kv.pages.held_at_release"] == 3
        assert span_b.status.code == span_b.status.STATUS_CODE_ERROR
        assert span_a.status.code == span_a.status.STATUS_CODE_UNSET
        assert [e.name for e in span_b.events] == ["kv.prefill", "kv.violation", "kv.release"]
        (leak,) = w.violations
        assert leak.trace_id == span_b.trace_id.hex()
        assert len(span_a.span_id) == 8 and span_a.trace_id != span_b.trace_id
        with rx.lock:
            services = {res.get("service.name") for res, _ in rx.spans}
            encodings = set(rx.encodings)
        assert services == {service}
        assert encodings == ({"gzip"} if how == "env-gzip" else {""})

        # Shutdown ends the spans still open and exports them.
        exp.shutdown(timeout_millis=5000)
        assert rx.wait_for(lambda r: "c" in r.request_spans())
        _, attrs_c = rx.request_spans()["c"]
        assert attrs_c["kv.open_at_shutdown"] is True and attrs_c["kv.committed_len"] == 5
    finally:
        rx.close()


# -- 4. collector down or slow: the allocator never waits ---------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _round(w, k: int, outs: list, durations: list) -> None:
    """One scheduling round: four requests prefill, decode six steps, finish. Times every wrapped call."""

    def timed(fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        durations.append(time.perf_counter() - t0)
        if out is not None:
            outs.append(out.clone())

    reqs = [Req(f"r{k}.{i}") for i in range(4)]
    lens = [5, 7, 9, 3]
    rids = [r.rid for r in reqs]
    with w.batch(rids):
        t0 = time.perf_counter()
        out = w.alloc_extend(*extend_args(reqs, lens))
        durations.append(time.perf_counter() - t0)
    outs.append(out.clone())
    split_extend(reqs, lens, out)
    timed(w.step)
    for _ in range(6):
        with w.batch(rids):
            t0 = time.perf_counter()
            out = w.alloc_decode(*decode_args(reqs))
            durations.append(time.perf_counter() - t0)
        outs.append(out.clone())
        for r, s in zip(reqs, out.tolist()):
            r.row.append(s)
        timed(w.step)
    for r in reqs:
        timed(w.free, t(r.row))
        timed(w.release_request, r.rid)
    timed(w.step)


@pytest.mark.parametrize("collector", ["down", "slow"])
def test_collector_down_or_slow_never_blocks_the_allocator(otel_env, caplog, collector):
    caplog.set_level(logging.WARNING, logger="opentelemetry")
    rx = Receiver(delay=2.0) if collector == "slow" else None
    endpoint = rx.base if rx else f"http://127.0.0.1:{_free_port()}"
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.3")
    otel_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    otel_env.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "8")
    # A gen-2 collection of the whole test session's garbage can pause any call for a large fraction of a
    # second: it is not the network. Collect now, and keep the collector out of the timed loops.
    gc.collect()
    gc.disable()
    try:
        w = paged(256)
        exp = OtelExporter(w, endpoint=endpoint)

        def network_was_busy() -> bool:
            if rx is not None:  # an export has been hanging on the receiver for a while
                with rx.lock:
                    return rx.first_hit is not None and time.monotonic() - rx.first_hit > 0.5
            failures = [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]
            return len(failures) >= 2  # export attempts failed while the loop ran

        outs, durations = [], []
        start = time.perf_counter()
        rounds = 0
        while rounds < 20 or time.perf_counter() - start < 0.5 or not network_was_busy():
            _round(w, rounds, outs, durations)
            rounds += 1
            assert time.perf_counter() - start < 15, "the exporter never reached the network"
        with_exporter = time.perf_counter() - start

        w2 = paged(256)
        outs2, durations2 = [], []
        start = time.perf_counter()
        for k in range(rounds):
            _round(w2, k, outs2, durations2)
        bare = time.perf_counter() - start

        assert len(outs) == len(outs2) and all(torch.equal(x, y) for x, y in zip(outs, outs2))
        assert allocator_state(w) == allocator_state(w2)
        print(
            f"{collector}: {rounds} rounds, {len(durations)} calls: with exporter {with_exporter:.3f}s "
            f"(max call {max(durations) * 1e3:.2f} ms), bare {bare:.3f}s (max call {max(durations2) * 1e3:.2f} ms)"
        )
        assert max(durations) < 0.05, "an allocator call waited (on the network?)"
        assert max(durations2) < 0.05
        assert w.bus.dropped["otel"] == 0 and exp.errors == 0

        t0 = time.perf_counter()
        exp.shutdown(timeout_millis=300)
        assert time.perf_counter() - t0 < 2.0
    finally:
        gc.enable()
        if rx is not None:
            rx.close()


# -- hashed request ids ------------------------------------------------------------------------------------------
HASH_KEY = b"otel-test-key"


def _pseudonym(rid) -> str:
    """Computed here independently of instrumented_alloc.redact: HMAC-SHA256 of the id's text, 16 hex digits."""
    import hashlib
    import hmac

    return "h:" + hmac.new(HASH_KEY, str(rid).encode(), hashlib.sha256).hexdigest()[:16]


def _all_span_text(spans) -> str:
    parts = []
    for s in spans:
        parts += [s.name, repr(dict(s.attributes)), str(s.status.description)]
        parts += [repr((e.name, dict(e.attributes))) for e in s.events]
    return "\n".join(parts)


def test_hashed_request_ids_in_spans(memory):
    """str and int ids: kv.request.id, violation messages (on the request span, on a violation span of its own) and
    status descriptions carry the pseudonym; trace_id_for still takes the raw id."""
    from instrumented_alloc.redact import RequestIdHasher

    provider, mem = memory
    w = paged(64)
    exp = OtelExporter(w, tracer_provider=provider, hash_request_ids=RequestIdHasher(HASH_KEY))
    ok, leaky, num = Req("secret-ok-0001"), Req("secret-leaky-0002"), Req(123456789)
    extend(w, [ok, leaky, num], [5, 6, 3])
    decode(w, [ok, leaky, num])
    trace_ok = exp.trace_id_for("secret-ok-0001")  # the raw id: what the wrapper and the exemplars ask with
    assert trace_ok is not None and exp.trace_id_for(_pseudonym("secret-ok-0001")) is None
    w.free(t(ok.row))
    w.release_request(ok.rid)
    w.release_request(leaky.rid)  # still owns two pages: request_leak, on its span
    w.free(t(num.row))
    w.release_request(num.rid)
    with pytest.raises(ValueError):
        w.release_request("secret-ghost-0003")  # unknown: a kv.violation span of its own
    assert [(v.invariant, v.rid) for v in w.violations] == [
        ("request_leak", "secret-leaky-0002"),
        ("invalid_argument", "secret-ghost-0003"),
    ]
    assert w.violations[0].trace_id == exp.trace_id_for("secret-leaky-0002") is not None

    spans = request_spans(mem)
    assert sorted(spans) == sorted(_pseudonym(r) for r in ("secret-ok-0001", "secret-leaky-0002", "123456789"))
    assert hex_id(spans[_pseudonym("secret-ok-0001")]) == trace_ok
    p_leaky = _pseudonym("secret-leaky-0002")
    leak_span = spans[p_leaky]
    leak_msg = (
        f"request {p_leaky!r} released while still owning 2 pages, neither freed nor handed to the prefix cache "
        "(full: [3, 4] (2 pages))"
    )
    assert leak_span.status.status_code == StatusCode.ERROR
    assert leak_span.status.description == f"request_leak: {leak_msg}"
    assert events(leak_span, "kv.violation") == [
        (
            "kv.violation",
            {
                "kv.violation.invariant": "request_leak",
                "kv.violation.message": leak_msg,
                "kv.violation.severity": "error",
                "kv.violation.op": "release",
                "kv.step": 0,
                "kv.violation.pool": "full",
            },
        )
    ]
    (ghost,) = [s for s in mem.get_finished_spans() if s.name == "kv.violation"]
    ghost_msg = f"release_request: rid: unknown request id {_pseudonym('secret-ghost-0003')!r}"
    assert dict(ghost.attributes) == {
        "kv.violation.invariant": "invalid_argument",
        "kv.violation.message": ghost_msg,
        "kv.violation.severity": "error",
        "kv.violation.op": "release_request",
        "kv.step": 0,
        "kv.request.id": _pseudonym("secret-ghost-0003"),
    }
    assert ghost.status.description == f"invalid_argument: {ghost_msg}"
    text = _all_span_text(mem.get_finished_spans())
    for raw in ("secret-ok-0001", "secret-leaky-0002", "secret-ghost-0003", "123456789", "secret"):
        assert raw not in text, raw
    exp.shutdown()


def test_recorder_and_spans_agree_on_pseudonyms(memory, tmp_path):
    """One hasher shared by the recorder and the OTel exporter: a recording and the spans join on the pseudonym."""
    from exporters.recorder import FlightRecorder, Recording
    from instrumented_alloc.redact import RequestIdHasher

    provider, mem = memory
    h = RequestIdHasher(HASH_KEY)
    w = paged(64)
    exp = OtelExporter(w, tracer_provider=provider, hash_request_ids=h)
    rec = FlightRecorder(w, tmp_path / "r.db", hash_request_ids=h)
    reqs = [Req("alpha-request"), Req(42)]
    extend(w, reqs, [5, 9])
    decode(w, reqs)
    w.step()
    for r in reqs:
        w.free(t(r.row))
        w.release_request(r.rid)
    w.step()
    rec.close()
    exp.shutdown()
    with Recording(tmp_path / "r.db") as r:
        released = [e.rid for e in r.events(kinds=[RequestReleased])]
    assert released == [_pseudonym("alpha-request"), _pseudonym(42)]
    assert sorted(request_spans(mem)) == sorted(released)


# -- spans lost at export ------------------------------------------------------------------------------------------
def _finish_requests(w, names) -> None:
    reqs = [Req(n) for n in names]
    extend(w, reqs, [5] * len(reqs))
    for r in reqs:
        w.free(t(r.row))
        w.release_request(r.rid)


def test_counting_exporter_with_your_own_provider():
    """A provider passed in, its exporter wrapped in CountingSpanExporter and passed as counting_exporter=: spans of
    failed exports are counted and reported under kvalloc_events_dropped_total{sink="otel"}."""
    from exporters.otel import CountingSpanExporter
    from exporters.prometheus import PrometheusExporter

    mem = InMemorySpanExporter()
    counting = CountingSpanExporter(mem)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(counting))
    w = paged(64)
    prom = PrometheusExporter(w, multiprocess=False)
    exp = OtelExporter(w, tracer_provider=provider, counting_exporter=counting)

    def sample():
        return prom.registry.get_sample_value("kvalloc_events_dropped_total", {"sink": "otel"})

    _finish_requests(w, ["a", "b", "c"])
    assert (counting.exported, counting.dropped, counting.failed_exports) == (3, 0, 0)
    assert exp.spans_dropped == 0 and sample() == 0.0
    mem.shutdown()  # from now on every export returns FAILURE
    _finish_requests(w, ["d", "e"])
    assert (counting.exported, counting.dropped, counting.failed_exports) == (3, 2, 2)
    assert exp.spans_dropped == 2 and sample() == 2.0 and w.bus.dropped["otel"] == 0
    assert w.bus.drop_counts()["otel"] == 2
    exp.shutdown()
    assert sample() == 2.0  # the total outlives the exporter
    prom.close()
    provider.shutdown()


def test_counting_exporter_counts_an_export_that_raises():
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from exporters.otel import CountingSpanExporter

    class Raising(SpanExporter):
        def export(self, spans):
            raise ConnectionError("collector gone")

    class Succeeding(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    c = CountingSpanExporter(Raising())
    with pytest.raises(ConnectionError):
        c.export([object(), object(), object()])
    assert (c.exported, c.dropped, c.failed_exports) == (0, 3, 1)
    ok = CountingSpanExporter(Succeeding())
    assert ok.export([object()] * 4) is SpanExportResult.SUCCESS
    assert (ok.exported, ok.dropped, ok.failed_exports) == (4, 0, 0)
    with pytest.raises(TypeError):
        CountingSpanExporter(object())


def test_counting_exporter_argument_checks(memory):
    from exporters.otel import CountingSpanExporter

    provider, _ = memory
    with pytest.raises(ValueError, match="counting_exporter"):
        OtelExporter(paged(64), counting_exporter=CountingSpanExporter(InMemorySpanExporter()))
    with pytest.raises(TypeError, match="counting_exporter"):
        OtelExporter(paged(64), tracer_provider=provider, counting_exporter=InMemorySpanExporter())


def test_counting_batch_processor_with_your_own_provider():
    """CountingBatchSpanProcessor in a provider passed in: while an export hangs, the spans beyond max_queue_size
    unsettled ones are refused and counted (the SDK's processor would evict the oldest silently); the admitted ones
    are exported in order; failed exports add to the same total, reported under
    kvalloc_events_dropped_total{sink="otel"}; an unsampled span is neither admitted nor counted."""
    import threading

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    from exporters.otel import CountingBatchSpanProcessor
    from exporters.prometheus import PrometheusExporter

    class Gate(SpanExporter):
        """Holds each export until released; fails them while ``failing``."""

        def __init__(self):
            self.release = threading.Event()
            self.entered = threading.Event()
            self.names: list = []
            self.failing = False

        def export(self, spans):
            self.entered.set()
            assert self.release.wait(10)
            if self.failing:
                return SpanExportResult.FAILURE
            self.names += [s.attributes["kv.request.id"] for s in spans]
            return SpanExportResult.SUCCESS

    gate = Gate()
    proc = CountingBatchSpanProcessor(gate, max_queue_size=6, max_export_batch_size=3, schedule_delay_millis=60000)
    assert proc.max_queue_size == 6 and proc.span_exporter is proc.counting
    provider = TracerProvider()
    provider.add_span_processor(proc)
    w = paged(256)
    prom = PrometheusExporter(w, multiprocess=False)
    exp = OtelExporter(w, tracer_provider=provider, counting_exporter=proc)

    def sample():
        return prom.registry.get_sample_value("kvalloc_events_dropped_total", {"sink": "otel"})

    names = [f"q{i}" for i in range(10)]
    _finish_requests(w, names[:3])  # 3 queued: the worker takes them and hangs in export
    assert gate.entered.wait(5)
    _finish_requests(w, names[3:])  # 3 more admitted (6 unsettled), the last 4 refused
    assert (proc.queue_full, proc.dropped, exp.spans_dropped, sample()) == (4, 4, 4, 4.0)
    assert w.bus.dropped["otel"] == 0
    gate.release.set()
    assert exp.force_flush(timeout_millis=5000)
    assert gate.names == names[:6] and proc.exported == 6

    gate.failing = True  # the collector now refuses: both spans counted at export
    _finish_requests(w, ["f0", "f1"])
    assert exp.force_flush(timeout_millis=5000)
    assert (proc.failed_exports, proc.dropped, sample()) == (1, 6, 6.0)

    off = TracerProvider(sampler=ALWAYS_OFF)
    off.add_span_processor(proc)
    off.get_tracer("t").start_span("unsampled").end()
    assert (proc.queue_full, proc.dropped) == (4, 6)

    exp.shutdown()
    provider.shutdown()
    assert sample() == 6.0  # the total outlives the exporter
    prom.close()


# -- the fast span path of our own provider ------------------------------------------------------------------------
def _equivalence_scenario(w, exp) -> dict:
    """Prefill, prealloc with an SWA tail, decodes, SWA evictions, violations (in a span, beyond the event bound,
    of an ended request, of no request), releases and requests left open at shutdown. Returns trace_id_for of
    every request, asked before shutdown (and for ended ones, after their release)."""
    p = Req("p", row=alloc_for_decode_prealloc(w, rid="p", fill_len=20, swa_tail_len=swa_tail_len(20, 8, PS)).tolist())
    w.step()
    a, b, q, c = Req("a"), Req("b"), Req(42), Req("c")
    extend(w, [a, b, q, c], [6, 9, 10, 3])
    w.step()
    for _ in range(6):
        decode(w, [a, b, q, c, p])
        if q.seq in (12, 16):
            done = w.ledger[42].swa_evicted_seqlen
            w.free_swa_segment(t(q.row[done : q.seq - 8]), start_pos=done)
            w.ledger[42].swa_evicted_seqlen = q.seq - 8
        w.step()
    w.free(t(a.row))
    w.release_request("a")
    # b: a double free, a rejected ledger write, a release while still owning pages: more events than the bound.
    w.free(t(b.row[:4]))
    w.free(t(b.row[:4]))
    w.ledger["b"].kv_committed_len = 99
    w.release_request("b")
    w.step()
    # Two violations naming no request: a's first page freed again after its release (free now, owned by no one)
    # and a page never handed out.
    w.free(t(a.row[:4]))
    w.free(t([250]))
    # A sweep's leak report for an ended request, as the wrapper would deliver it.
    leak = Violation("request_leak", "b 2 pages", rid="b")
    assert exp([ViolationEvent(seq=1, ts=0.0, step=w.step_count, violation=leak)])
    w.step()
    return {rid: exp.trace_id_for(rid) for rid in ("a", "b", "p", 42, "c")}


def _swa_alloc():
    return InstrumentedAllocator(
        SWATokenToKVPoolAllocator(256, 256, PS, torch.float16, "cpu", None, False), mode="record", sliding_window=8
    )


_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_CODES = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _from_sdk(spans, resource_of, scope_of) -> list:
    """SDK ReadableSpans as plain records: (trace id, span id, parent span id or None, the comparable part, times)."""
    out = []
    for s in spans:
        out.append(
            {
                "trace": format(s.context.trace_id, "032x"),
                "id": s.context.span_id,
                "parent": None if s.parent is None else (format(s.parent.trace_id, "032x"), s.parent.span_id),
                "name": s.name,
                "attributes": dict(s.attributes),
                "events": [(e.name, dict(e.attributes)) for e in s.events],
                "status": (s.status.status_code.name, s.status.description or ""),
                "kind": s.kind.name,
                "service": resource_of(s),
                "scope": scope_of(s),
                "times": (s.start_time, [e.timestamp for e in s.events], s.end_time),
            }
        )
    return out


def _from_otlp(rx: Receiver) -> list:
    from tests.otlp_receiver import _value

    out = []
    with rx.lock:
        got = list(zip(rx.spans, rx.scopes))
    for (res, s), scope in got:
        out.append(
            {
                "trace": s.trace_id.hex(),
                "id": int.from_bytes(s.span_id, "big"),
                "parent": (s.trace_id.hex(), int.from_bytes(s.parent_span_id, "big")) if s.parent_span_id else None,
                "name": s.name,
                "attributes": {kv.key: _value(kv.value) for kv in s.attributes},
                "events": [(e.name, {kv.key: _value(kv.value) for kv in e.attributes}) for e in s.events],
                "status": (_CODES[s.status.code], s.status.message),
                "kind": _KINDS[s.kind],
                "service": res.get("service.name"),
                "scope": scope,
                "times": (s.start_time_unix_nano, [e.time_unix_nano for e in s.events], s.end_time_unix_nano),
            }
        )
    return out


def _comparable(records: list, trace_ids: dict) -> list:
    """Records with ids replaced by what must match between the paths: the parent as the parent's (name, request
    id), the trace id as the request it belongs to (checked against trace_id_for), in a stable order."""
    by_id = {r["id"]: r for r in records}
    request_of_trace = {}
    for r in records:
        if r["name"] == "kv.request":
            request_of_trace[r["trace"]] = r["attributes"]["kv.request.id"]
    out = []
    for r in records:
        start, event_times, end = r["times"]
        assert start <= end and event_times == sorted(event_times)
        assert all(start <= ts <= end for ts in event_times)
        parent = None
        if r["parent"] is not None:
            ptrace, pid = r["parent"]
            assert ptrace == r["trace"]
            parent = (by_id[pid]["name"], by_id[pid]["attributes"]["kv.request.id"])
        comparable = {k: v for k, v in r.items() if k not in ("id", "trace", "times", "parent")}
        comparable["parent"] = parent
        comparable["trace_of"] = request_of_trace.get(r["trace"])  # None: a trace of its own
        out.append(comparable)
    # Every request's trace id is the one trace_id_for gave (raw id in, the span's trace out).
    hasher_ids = {r["attributes"]["kv.request.id"]: r["trace"] for r in records if r["name"] == "kv.request"}
    assert sorted(trace_ids.values()) == sorted(hasher_ids.values())
    return sorted(out, key=repr)


def test_fast_path_spans_equal_the_sdk_spans(otel_env):
    """The same scenario through a provider passed in (the SDK's spans, in memory) and through our own provider
    (the fast path, exported over OTLP/HTTP): the same spans, attribute for attribute, event for event."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    from exporters.otel import TRACER_NAME

    mem = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "instrumented-alloc"}))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    w1 = _swa_alloc()
    exp1 = OtelExporter(w1, tracer_provider=provider, max_events_per_span=4, hash_request_ids=HASH_KEY)
    assert exp1._fast is None
    ids1 = _equivalence_scenario(w1, exp1)
    exp1.shutdown(timeout_millis=5000)
    sdk = _from_sdk(
        mem.get_finished_spans(),
        lambda s: s.resource.attributes.get(SERVICE_NAME),
        lambda s: s.instrumentation_scope.name,
    )
    provider.shutdown()

    rx = Receiver()
    try:
        w2 = _swa_alloc()
        exp2 = OtelExporter(w2, endpoint=rx.base, max_events_per_span=4, hash_request_ids=HASH_KEY)
        assert exp2._fast is not None
        ids2 = _equivalence_scenario(w2, exp2)
        assert exp2.shutdown(timeout_millis=5000)
        assert rx.wait_for(lambda r: r.span_count() == len(sdk))
        fast = _from_otlp(rx)
    finally:
        rx.close()

    assert len(sdk) == len(fast) == 8  # 5 requests, 3 violation spans
    assert _comparable(fast, ids2) == _comparable(sdk, ids1)
    assert [v.invariant for v in w1.violations] == [v.invariant for v in w2.violations]
    # What the scenario covers, on the fast path's spans.
    reqs = {r["attributes"]["kv.request.id"]: r for r in fast if r["name"] == "kv.request"}
    assert set(reqs) == {_pseudonym(x) for x in ("a", "b", "p", 42, "c")}
    for rid in ("a", "b", "p", 42, "c"):
        assert reqs[_pseudonym(rid)]["trace"] == ids2[rid]
    rb = reqs[_pseudonym("b")]
    assert rb["attributes"]["kv.events_dropped"] == 1 and rb["status"][0] == "ERROR"
    assert rb["status"][1].startswith("double_free: ") and "'b'" not in rb["status"][1]
    assert [n for n, _ in rb["events"]] == ["kv.prefill", "kv.violation", "kv.violation", "kv.release"]
    assert [n for n, _ in reqs[_pseudonym(42)]["events"]] == ["kv.prefill", "kv.swa_evict", "kv.swa_evict"]
    assert [n for n, _ in reqs[_pseudonym("p")]["events"]] == ["kv.prealloc", "kv.swa_evict"]
    assert reqs[_pseudonym("p")]["attributes"]["kv.open_at_shutdown"] is True
    assert reqs[_pseudonym("a")]["status"] == ("UNSET", "")
    violations = sorted(
        (r["attributes"]["kv.violation.invariant"], r["parent"] is not None, r["trace"])
        for r in fast
        if r["name"] == "kv.violation"
    )
    assert [v[:2] for v in violations] == [("double_free", False), ("free_unallocated", False), ("request_leak", True)]
    assert violations[2][2] == ids2["b"]  # the sweep's leak: a child of b's ended span, in b's trace
    assert len({v[2] for v in violations} | set(ids2.values())) == 7
    assert {r["service"] for r in fast} == {"instrumented-alloc"}
    assert {r["scope"] for r in fast} == {TRACER_NAME}


@pytest.mark.parametrize(
    "env, fast, n_spans, subscribed",
    [
        ({}, True, 8, True),
        ({"OTEL_TRACES_SAMPLER": "always_on"}, True, 8, True),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, True, 0, False),
        # No root span, but an engine's sampled span named by set_parent would have its child sampled.
        ({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}, True, 0, True),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, True, 0, False),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1"}, True, 8, True),
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1"}, True, 8, True),
        ({"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "12"}, False, 8, True),
        ({"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "4"}, False, 8, True),
        ({"OTEL_SDK_DISABLED": "true"}, False, 0, False),
    ],
)
def test_own_provider_takes_the_sdk_path_unless_its_sampler_is_the_sdks_and_limits_trim_nothing(
    otel_env, env, fast, n_spans, subscribed
):
    """Our own provider's spans skip the SDK under any sampler ``OTEL_TRACES_SAMPLER`` names (the fast path makes
    the same decisions: see the sampling tests below) and limits that trim nothing of ours; a limit that trims or a
    disabled SDK gets the SDK's spans and their behaviour. Tracing that can produce no span (every span dropped, or
    the SDK disabled) subscribes to nothing: the wrapper then builds no event at all."""
    for k, v in env.items():
        otel_env.setenv(k, v)
    mem = InMemorySpanExporter()
    w = _swa_alloc()
    exp = OtelExporter(w, span_exporter=mem, max_events_per_span=4, hash_request_ids=HASH_KEY)
    assert (exp._fast is not None) is fast
    assert (exp in w.bus.sinks) is subscribed
    assert w.bus.active is subscribed
    ids = _equivalence_scenario(w, exp)
    if not n_spans:
        assert set(ids.values()) == {None}
        assert w.violations and {v.trace_id for v in w.violations} == {None}
    if not subscribed:
        assert exp.open_requests == 0 and w.trace_id_for is None
    assert exp.shutdown(timeout_millis=5000)
    spans = mem.get_finished_spans()
    assert len(spans) == n_spans
    assert exp.spans_dropped == 0 and exp.errors == 0
    if not spans:
        return
    assert all(s.context.trace_flags.sampled for s in spans)
    n_attrs = max(len(s.attributes) for s in spans)
    assert n_attrs == (4 if "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT" in env else 10)  # 10: a released request's span
    if "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT" in env:
        return
    messages = [s.attributes["kv.violation.message"] for s in spans if s.name == "kv.violation"]
    if "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT" in env:
        assert sorted(messages) == ["b 2 pages", "free frees [", "free frees ["]  # the SDK trimmed them to 12
    else:
        assert sorted(messages) == [
            "b 2 pages",
            "free frees [62] (1 pages) never handed out since clear()",
            "free frees [6] (1 pages) that are not in use (page 6 is free)",
        ]


def _sdk_samplers():
    from opentelemetry.sdk.trace import sampling as smp

    return {
        "always_on": smp.ALWAYS_ON,
        "always_off": smp.ALWAYS_OFF,
        "parentbased_always_on": smp.DEFAULT_ON,
        "parentbased_always_off": smp.DEFAULT_OFF,
        "traceidratio 0.3": smp.TraceIdRatioBased(0.3),
        "traceidratio 0": smp.TraceIdRatioBased(0.0),
        "traceidratio 1": smp.TraceIdRatioBased(1.0),
        "parentbased_traceidratio 0.3": smp.ParentBasedTraceIdRatio(0.3),
        # Delegates other than the defaults: a dropped parent's children sampled, a sampled one's by ratio.
        "parentbased inverted": smp.ParentBased(
            smp.TraceIdRatioBased(0.5),
            local_parent_sampled=smp.TraceIdRatioBased(0.2),
            local_parent_not_sampled=smp.ALWAYS_ON,
        ),
        "parentbased of parentbased": smp.ParentBased(smp.ParentBasedTraceIdRatio(0.7)),
        "parentbased remote inverted": smp.ParentBased(
            smp.ALWAYS_OFF,
            remote_parent_sampled=smp.TraceIdRatioBased(0.4),
            remote_parent_not_sampled=smp.ALWAYS_ON,
        ),
        # Only a child of a sampled in-process (local) parent is sampled: not "samples nothing".
        "parentbased local only": smp.ParentBased(smp.ALWAYS_OFF, remote_parent_sampled=smp.ALWAYS_OFF),
    }


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(_sdk_samplers())),
    trace_id=st.one_of(
        st.integers(1, 2**128 - 1),
        # Around the ratio bounds, in the low 64 bits the SDK compares.
        st.builds(lambda hi, lo: hi << 64 | lo, st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63, 2**64 - 1])),
        st.builds(
            lambda hi, r, d: hi << 64 | max(0, min(2**64 - 1, round(r * 2**64) + d)),
            st.integers(0, 2**64 - 1),
            st.sampled_from([0.2, 0.3, 0.5, 0.7]),
            st.integers(-2, 2),
        ),
    ),
    parent=st.sampled_from([None, "local sampled", "local dropped", "remote sampled", "remote dropped", "invalid"]),
)
def test_sampling_decision_is_the_samplers(name, trace_id, parent):
    """The fast path's decision for a span of ours (a root; a child of a local span, sampled or dropped: a violation
    span of an ended request; a child of a remote span, sampled or not: the engine's span named by set_parent) is
    what the SDK sampler's ``should_sample`` decides for it, for every sampler ``OTEL_TRACES_SAMPLER`` can build and
    parent-based ones with other delegates; ``_samples_nothing`` holds exactly when no root is sampled and no child
    of any parent (remote or local, sampled or not) is."""
    from opentelemetry.context import Context
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    from exporters.otel import _samples_nothing, _sampling_decision

    sampler = _sdk_samplers()[name]
    decide = _sampling_decision(sampler)
    assert decide is not None
    pctx = None
    if parent is None:
        context = Context()
    else:
        flags = TraceFlags(TraceFlags.SAMPLED if "sampled" in parent else TraceFlags.DEFAULT)
        span_id = 0 if parent == "invalid" else 0x1234
        pctx = SpanContext(trace_id, span_id, is_remote=parent.startswith("remote"), trace_flags=flags)
        context = set_span_in_context(NonRecordingSpan(pctx), Context())
    want = sampler.should_sample(context, trace_id, "kv.request").decision.is_sampled()
    assert decide(pctx, trace_id) is want
    nothing = name in ("always_off", "traceidratio 0")
    assert _samples_nothing(sampler) is nothing
    if nothing:
        assert want is False


def test_samplers_the_fast_path_does_not_know_take_the_sdk_path(otel_env):
    """A sampler whose decision the fast path cannot make exactly (RECORD_ONLY, a subclass overriding
    ``should_sample``, a parent-based one over such a root) gets the SDK's spans: ``_sampling_decision`` is None."""
    from opentelemetry.sdk.trace import sampling as smp

    from exporters.otel import _sampling_decision

    class Odd(smp.TraceIdRatioBased):
        def should_sample(self, *args, **kwargs):
            return smp.SamplingResult(smp.Decision.RECORD_AND_SAMPLE)

    for sampler in (
        smp.StaticSampler(smp.Decision.RECORD_ONLY),
        Odd(0.5),
        smp.ParentBased(Odd(0.5)),
        smp.ParentBased(smp.ALWAYS_ON, local_parent_not_sampled=smp.StaticSampler(smp.Decision.RECORD_ONLY)),
    ):
        assert _sampling_decision(sampler) is None


def _scenario_spans(exporter_of, seed: int, *, parents: bool = False) -> tuple[list, dict, list, dict | None]:
    """The equivalence scenario with the global random source seeded first (the SDK's RandomIdGenerator draws from
    it; so does the fast path, in the same order) and, with ``parents``, the engine's parents set first
    (``_engine_parents``). Returns its spans with their ids, parents (with their remote flag) and trace states;
    trace_id_for of each request; the trace ids the violations carry; set_parent's answers (None without)."""
    import random

    mem = InMemorySpanExporter()
    w = _swa_alloc()
    random.seed(seed)
    exp = exporter_of(w, mem)
    answers = _engine_parents(exp) if parents else None
    ids = _equivalence_scenario(w, exp)
    assert exp.shutdown(timeout_millis=5000)
    assert exp.errors == 0 and exp.spans_dropped == 0
    finished = mem.get_finished_spans()
    assert all(s.context.trace_flags.sampled for s in finished)
    spans = sorted(
        [
            (
                s.name,
                dict(s.attributes).get("kv.request.id"),
                format(s.context.trace_id, "032x"),
                s.context.span_id,
                tuple(s.context.trace_state.items()),
                None if s.parent is None else (format(s.parent.trace_id, "032x"), s.parent.span_id, s.parent.is_remote),
                tuple(sorted(dict(s.attributes).items())),
                tuple((e.name, tuple(sorted(dict(e.attributes).items()))) for e in s.events),
                s.status.status_code.name,
                s.status.description,
            )
            for s in finished
        ],
        key=repr,
    )
    return spans, ids, [v.trace_id for v in w.violations], answers


@pytest.mark.parametrize(
    "env_sampler, arg",
    [("traceidratio", "0.5"), ("parentbased_traceidratio", "0.5"), ("parentbased_traceidratio", "0.25")],
)
def test_sampled_spans_are_the_sdks_ids_included(otel_env, env_sampler, arg):
    """Under a ratio sampler, the fast path and the SDK's spans (a provider passed in, the same sampler) from the
    same random source: the same spans kept, the same trace and span ids, parents, attributes and events; the same
    ``trace_id_for`` (None for a request whose span was dropped) and the same trace ids on the violations. Across
    the seeds, some requests are sampled and some dropped (a dropped request's exemplar: see
    ``test_exemplars_link_sampled_traces_only``)."""
    from opentelemetry.sdk.trace import sampling as smp

    otel_env.setenv("OTEL_TRACES_SAMPLER", env_sampler)
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    sdk_sampler = smp._get_from_env_or_default()

    def fast(w, mem):
        exp = OtelExporter(w, span_exporter=mem, max_events_per_span=4, hash_request_ids=HASH_KEY)
        assert exp._fast is not None and exp._fast.roots is not None and not exp._off
        return exp

    def sdk(w, mem):
        provider = TracerProvider(sampler=sdk_sampler)
        provider.add_span_processor(SimpleSpanProcessor(mem))
        exp = OtelExporter(w, tracer_provider=provider, max_events_per_span=4, hash_request_ids=HASH_KEY)
        assert exp._fast is None
        return exp

    kept = dropped = 0
    for seed in range(12):
        got = _scenario_spans(fast, seed)
        assert got == _scenario_spans(sdk, seed)
        spans, ids, violation_traces, _ = got
        kept += sum(x is not None for x in ids.values())
        dropped += sum(x is None for x in ids.values())
        requests = {s[1]: s[2] for s in spans if s[0] == "kv.request"}
        assert sorted(requests.values()) == sorted(x for x in ids.values() if x is not None)
        assert set(violation_traces) <= set(ids.values()) | {s[2] for s in spans} | {None}
    assert kept >= 10 and dropped >= 10  # both outcomes, many times (60 requests)


def test_dropped_requests_cost_no_span_and_count_as_no_loss(otel_env):
    """Requests the sampler dropped: no span, no ``kv.request`` export, ``trace_id_for`` None, and nothing counted
    as dropped; their records still close at their release (no open request is left behind)."""
    import random

    otel_env.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    mem = InMemorySpanExporter()
    w = paged(size=256)
    random.seed(7)
    exp = OtelExporter(w, span_exporter=mem)
    reqs = [Req(f"r{i}") for i in range(16)]
    extend(w, reqs, [5] * 16)
    for _ in range(3):
        decode(w, reqs)
        w.step()
    traces = {r.rid: exp.trace_id_for(r.rid) for r in reqs}
    for r in reqs:
        w.free(t(r.row))
        w.release_request(r.rid)
    assert exp.open_requests == 0
    assert exp.shutdown(timeout_millis=5000)
    spans = mem.get_finished_spans()
    sampled = {rid for rid, x in traces.items() if x is not None}
    assert 0 < len(sampled) < 16
    assert sorted(s.attributes["kv.request.id"] for s in spans) == sorted(sampled)
    for s in spans:
        assert format(s.context.trace_id, "032x") == traces[s.attributes["kv.request.id"]]
        assert s.attributes["kv.decode_steps"] == 3 and s.attributes["kv.allocated_len"] == 8
    assert exp.spans_dropped == 0 and w.bus.dropped.get("otel", 0) == 0 and exp.errors == 0


def test_span_exporter_argument_checks(otel_env):
    w = paged()
    with pytest.raises(ValueError, match="span_exporter="):
        OtelExporter(w, span_exporter=InMemorySpanExporter(), endpoint="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="span_exporter="):
        OtelExporter(w, span_exporter=InMemorySpanExporter(), tracer_provider=TracerProvider())
    with pytest.raises(TypeError, match="span_exporter"):
        OtelExporter(w, span_exporter=object())


def test_fast_path_readable_span_fields_are_the_sdks(otel_env):
    """The fast path's ReadableSpan, field by field: its context equals what ``SpanContext(...)`` builds (is_valid,
    the default trace state), no links, INTERNAL, our provider's resource and scope; the processor's settled count
    (read lock-free by ``admit``) is the exported spans once they are exported."""
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
    from opentelemetry.trace.span import DEFAULT_TRACE_STATE

    from exporters.otel import TRACER_NAME

    mem = InMemorySpanExporter()
    w = paged()
    exp = OtelExporter(w, span_exporter=mem)
    assert exp._fast is not None
    reqs = [Req("a")]
    extend(w, reqs, [5])
    w.free(torch.tensor(reqs[0].row, dtype=torch.int64))
    w.release_request("a")
    assert exp.shutdown(timeout_millis=5000)
    (s,) = mem.get_finished_spans()
    ctx = s.context
    assert type(ctx) is SpanContext
    assert ctx == SpanContext(ctx.trace_id, ctx.span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    assert ctx.is_valid is True and ctx.is_remote is False and ctx.trace_state is DEFAULT_TRACE_STATE
    assert ctx.trace_flags.sampled and ctx.trace_id != 0 and ctx.span_id != 0
    assert s.name == "kv.request" and s.parent is None and s.links == () and s.kind is SpanKind.INTERNAL
    assert s.resource is exp.tracer_provider.resource
    assert s.instrumentation_scope.name == TRACER_NAME
    assert s.start_time <= s.end_time
    assert [e.name for e in s.events] == ["kv.prefill", "kv.release"] and type(s.events) is tuple
    assert exp._counting.counting.settled() == exp._counting.exported == 1


@pytest.mark.parametrize("where", ["exporter", "wrapper"])
def test_decodes_of_separate_blocks_with_equal_requests_are_folded(memory, where):
    """Decodes in separate ``batch()`` blocks naming the same requests in the same order (equal rid tuples, not
    the same object; steps between them: events this sink does not read) are folded into one pending update, the
    first decode too when every span is open; a decode of a different batch or a release applies it first (the
    frees before a release build no event for this sink: ``free_ledgers = False``).
    The spans are what per-step updates gave before the fold (the unfolded sink's values: allocated_len counts
    the slots of whole pages reserved, page size 4). The wrapper folds the same runs (the equal ids bind the same
    slots array while no request joins or leaves the ledger): it builds the fold at the next decode of another
    batch or at the free."""
    provider, mem = memory
    w = paged()
    exp = OtelExporter(w, tracer_provider=provider)
    fold_in(w, where)
    folds = w._w_st if where == "wrapper" else None
    a, b = Req("a"), Req("b")
    extend(w, [a, b], [5, 7])
    for _ in range(3):
        decode(w, [a, b])  # a new list, so a new rids tuple, each time
        w.step()
    if folds is None:
        assert exp._dec is not None and exp._dec[2] == 3  # all three folded (both spans were open): nothing applied
    else:
        assert exp._dec is None and folds.fold[2] == 3
    decode(w, [b])  # a different batch: the fold is applied, b alone starts a new one
    if folds is None:
        assert exp._dec[0] == ("b",) and exp._dec[2] == 1
    else:
        assert folds.fold[1] == ("b",) and folds.fold[2] == 1
        assert request_spans(mem) == {}  # the first fold was applied: no span ended
    for _ in range(2):
        decode(w, [a, b])
        w.step()
    assert (exp._dec if folds is None else folds.fold)[2] == 2
    w.free(t(a.row))
    if folds is None:
        assert exp._dec[2] == 2  # nothing delivered to this sink
    else:
        assert folds.fold is None  # built before the free changed a's values, delivered with the free
    w.release_request("a")
    assert exp._dec is None
    w.free(t(b.row))
    w.release_request("b")
    spans = request_spans(mem)
    sa, sb = spans["a"].attributes, spans["b"].attributes
    assert (sa["kv.decode_steps"], sa["kv.allocated_len"], sa["kv.committed_len"]) == (5, 12, 10)
    assert (sb["kv.decode_steps"], sb["kv.allocated_len"], sb["kv.committed_len"]) == (6, 16, 13)
    assert [n for n, _ in events(spans["a"])] == [n for n, _ in events(spans["b"])] == ["kv.prefill", "kv.release"]
    assert not w.violations


@pytest.mark.parametrize("where", ["exporter", "wrapper"])
def test_decode_of_a_request_without_an_open_span_opens_it_then_folds(memory, where):
    """An exporter attached after a request's prefill first sees it at a decode: folding itself, that decode opens
    the span and is applied at once (not folded: no span to fold into yet); the next equal decodes fold into it.
    With the wrapper folding, the span opens when the fold arrives (here with the free); the spans are the same."""
    provider, mem = memory
    w = paged()
    a, b = Req("a"), Req("b")
    extend(w, [a, b], [5, 7])
    exp = OtelExporter(w, tracer_provider=provider)
    fold_in(w, where)
    decode(w, [a, b])
    if where == "exporter":
        assert exp.open_requests == 2 and exp._dec[2] == 0  # the first decode applied in its pass
    else:
        assert exp.open_requests == 0 and w._w_st.fold[2] == 1
    decode(w, [a, b])
    decode(w, [a, b])
    assert (exp._dec[2] == 2) if where == "exporter" else (w._w_st.fold[2] == 3)
    w.free(t(a.row))
    w.release_request("a")
    sa = request_spans(mem)["a"]
    assert (sa.attributes["kv.decode_steps"], sa.attributes["kv.allocated_len"], sa.attributes["kv.committed_len"]) == (
        3,
        8,
        8,
    )
    assert [n for n, _ in events(sa)] == ["kv.release"]
    assert not w.violations


def test_decode_allocs_are_not_built_for_the_exporter_and_change_nothing_when_they_are():
    """The exporter declares ``decode_allocs = False`` (decodes are counted from their LedgerUpdate): alone, the
    wrapper builds no ``alloc_decode`` Alloc for it; with a sink that reads every event, it receives them and
    ignores them. The spans are the same either way, attribute for attribute, event for event."""
    from instrumented_alloc import events as ev

    class Keep:
        """Keeps every event; with ``like_otel``, declares what the exporter declares (so builds nothing more)."""

        name = "keep"

        def __init__(self, like_otel=False):
            self.events = []
            if like_otel:
                self.event_types = OtelExporter.event_types
                self.decode_allocs = OtelExporter.decode_allocs

        def __call__(self, batch):
            self.events.extend(batch)

    def run(extra):
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        w = InstrumentedAllocator(
            SWATokenToKVPoolAllocator(256, 256, PS, torch.float16, "cpu", None, False),
            mode="record",
            sliding_window=8,
            sinks=extra,
        )
        exp = OtelExporter(w, tracer_provider=provider)
        seen = Keep(like_otel=True)  # what the exporter received
        w.subscribe(seen)
        _equivalence_scenario(w, exp)
        exp.shutdown(timeout_millis=5000)
        spans = _from_sdk(
            exporter.get_finished_spans(), lambda s: s.resource.attributes.get("service.name"), lambda s: None
        )
        provider.shutdown()
        decode_allocs = [e for e in seen.events if type(e) is ev.Alloc and e.op == "alloc_decode"]
        return [
            {k: v for k, v in r.items() if k not in ("trace", "id", "times", "parent")} for r in spans
        ], decode_allocs

    alone, none_built = run([])
    with_keeper, built = run([Keep()])
    assert none_built == [] and len(built) == 6 * 2  # six decodes, two pools each
    assert alone == with_keeper
    assert sorted(r["attributes"].get("kv.decode_steps", -1) for r in alone if r["name"] == "kv.request") == [
        6,
        6,
        6,
        6,
        6,
    ]


def test_fast_path_builds_the_sdks_event_and_readable_span_records():
    """The fast path fills the SDK's ``Event`` and ``ReadableSpan`` directly (``_plain``) only because that stores
    what their constructors store; with this SDK it does, and a class whose constructor does anything else (computes,
    keeps a slot) gets its constructor."""
    from opentelemetry.sdk.trace import Event, ReadableSpan

    from exporters import otel

    assert otel._make_event is otel._fill_event and otel._make_readable is otel._fill_readable
    e, want = otel._make_event("kv.release", {"kv.step": 3}, 11), Event("kv.release", {"kv.step": 3}, 11)
    assert type(e) is Event and list(vars(e).items()) == list(vars(want).items())
    assert (e.name, dict(e.attributes), e.timestamp, e.dropped_attributes) == ("kv.release", {"kv.step": 3}, 11, 0)
    w = paged()
    exp = OtelExporter(w, span_exporter=InMemorySpanExporter())
    span = exp._fast.start_span("kv.request", {"kv.request.id": "a"})
    span.add_event("kv.prefill", {"kv.step": 0})
    got = []
    exp._fast.processor.admit = got.append
    span.end()
    (s,) = got
    args = (s.name, s.context, s.parent, s.resource, s.attributes, s._events, s.links, s.kind, None, s.status)
    ref = ReadableSpan(*args, s.start_time, s.end_time, s.instrumentation_scope)
    assert type(s) is ReadableSpan and list(vars(s).items()) == list(vars(ref).items())
    assert s.events[0].name == "kv.prefill" and s.dropped_events == s.dropped_attributes == 0
    exp.shutdown(timeout_millis=5000)

    class Computes:
        def __init__(self, x):
            self.x = x * 2

    def fill(x):
        c = object.__new__(Computes)
        c.x = x
        return c

    class Slotted:
        __slots__ = ("x",)

        def __init__(self, x):
            self.x = x

    assert otel._plain(Computes, fill, (3,)) is Computes
    assert otel._plain(Slotted, lambda x: Slotted(x), (3,)) is Slotted


def test_fast_request_record_gives_the_sdk_spans_attributes_in_their_order(memory, otel_env):
    """A fast-path request record builds its span's attributes in one dict at the end: the same keys, values and
    key order as the SDK span's (start attributes, then those set at the end), for a released request and for one
    ended open at shutdown; the same events and status."""

    def run(exp, w):
        a, b = Req("a"), Req("b")
        extend(w, [a, b], [5, 7])
        decode(w, [a, b])
        decode(w, [a, b])
        w.free(t(a.row))
        w.release_request("a")
        exp.shutdown(timeout_millis=5000)  # b is still open: ended with kv.open_at_shutdown

    def shape(spans):
        return sorted(
            (
                s.attributes["kv.request.id"],
                list(s.attributes.items()),
                [(e.name, list(e.attributes.items())) for e in s.events],
                s.status.status_code,
                s.parent,
                s.context.is_valid,
            )
            for s in spans
            if s.name == "kv.request"
        )

    provider, mem = memory
    w1 = paged()
    exp1 = OtelExporter(w1, tracer_provider=provider)
    assert exp1._fast is None
    run(exp1, w1)
    fast_mem = InMemorySpanExporter()
    w2 = paged()
    exp2 = OtelExporter(w2, span_exporter=fast_mem)
    assert exp2._fast is not None
    run(exp2, w2)
    sdk, fast = shape(mem.get_finished_spans()), shape(fast_mem.get_finished_spans())
    assert fast == sdk and len(fast) == 2
    assert [k for k, _ in fast[1][1]][:3] == ["kv.request.id", "kv.page_size", "kv.open_at_shutdown"]
    assert dict(fast[0][1])["kv.decode_steps"] == 2 and dict(fast[0][1])["kv.pages.held_at_release"] == 0


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
def test_free_ledgers_are_not_built_for_the_exporter_and_change_nothing_when_they_are(verify):
    """The exporter declares ``free_ledgers = False``: alone, the wrapper builds no LedgerUpdate of a free for it
    (a free call delivers nothing) and keeps the values each would have carried in ``bus.skipped_frees`` until the
    release; the exporter measures a request's next allocation from them. With a sink that reads every event, it
    receives the frees' updates instead. The spans are the same either way, attribute for attribute, event for
    event: a retracted request's re-prefill, a partial free followed by a decode (the free's values are older than
    the decode's: not used) and by an extend (used), in immediate and deferred verification."""
    from instrumented_alloc import events as ev

    class Keep:
        name = "keep"

        def __init__(self, like_otel=False):
            self.events = []
            if like_otel:
                self.event_types = OtelExporter.event_types
                self.decode_allocs = OtelExporter.decode_allocs
                self.free_ledgers = OtelExporter.free_ledgers

        def __call__(self, batch):
            self.events.extend(batch)

    def run(extra):
        mem = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(mem))
        w = InstrumentedAllocator(
            PagedTokenToKVPoolAllocator(128, PS, torch.float16, "cpu"), mode="record", verify=verify, sinks=extra
        )
        OtelExporter(w, tracer_provider=provider)
        seen = Keep(like_otel=True)
        w.subscribe(seen)
        # Two requests per allocation: a share measured from the wrong values makes the shares miss the call's
        # total, and the event then carries the batch's figures instead of the request's.
        a, b, c = Req("a"), Req("b"), Req("c")
        extend(w, [a, b, c], [5, 7, 6])
        for _ in range(2):
            decode(w, [a, b, c])
            w.step()
        w.free(t(a.row))  # retract a: all its KV freed, not released
        w.step()
        a.row = []
        extend(w, [a, c], [6, 2])  # a's re-prefill: 6 slots, measured from the free's values (0)
        w.free(t(b.row[8:]))  # b's last page (slot 8): its record shrinks to 8
        w.step()
        b.row = b.row[:8]
        decode(w, [b])  # newer than the free: b's next extend is measured from this decode (9)
        extend(w, [b, c], [3, 1])
        w.step()
        w.free(t(b.row[8:]))  # back to 8 tokens, then an extend measured from the free
        w.step()
        b.row = b.row[:8]
        extend(w, [b, c], [2, 1])
        w.step()
        skipped_live = dict(w.bus.skipped_frees)
        for r in (a, b, c):
            w.free(t(r.row))
            w.step()
            w.release_request(r.rid)
        w.step()
        assert not w.violations
        assert w.bus.skipped_frees == {}  # each entry dropped at its request's release
        spans = request_spans(mem)
        provider.shutdown()
        free_updates = [e for e in seen.events if type(e) is ev.LedgerUpdate and not e.op.startswith("alloc")]
        return spans, free_updates, skipped_live

    alone, none_built, skipped = run([])
    with_keeper, built, none_kept = run([Keep()])
    assert none_built == [] and len(built) == 6
    assert len(skipped) == 2 and none_kept == {}  # a's and b's slots, until their release
    assert alone.keys() == with_keeper.keys() == {"a", "b", "c"}
    for rid in alone:
        x, y = alone[rid], with_keeper[rid]
        assert list(x.attributes.items()) == list(y.attributes.items())
        assert [(e.name, list(e.attributes.items())) for e in x.events] == [
            (e.name, list(e.attributes.items())) for e in y.events
        ]
    assert [e["kv.n_slots"] for _, e in events(alone["a"], "kv.prefill")] == [5, 6]
    assert [e["kv.n_slots"] for _, e in events(alone["b"], "kv.prefill")] == [7, 3, 2]
    assert [e["kv.n_slots"] for _, e in events(alone["c"], "kv.prefill")] == [6, 2, 1, 1]


# -- 6. the OTLP request encoder ---------------------------------------------------------------------------------
def _sdk_request_bytes(spans) -> bytes:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return encode_spans(spans).SerializePartialToString()


def test_encoder_writes_the_sdks_request_bytes_for_our_spans(otel_env):
    """``_encode_request`` (what our own OTLP exporter sends) gives byte for byte the SDK encoder's request for
    the fast path's spans: request spans with every event kind, ERROR statuses, hashed ids, violation spans with
    and without a parent, spans left open at shutdown; in one batch and one span at a time."""
    from exporters.otel import _encode_request, _KeyCache

    mem = InMemorySpanExporter()
    w = _swa_alloc()
    exp = OtelExporter(w, span_exporter=mem, hash_request_ids=b"k" * 16)
    _equivalence_scenario(w, exp)
    exp.shutdown(timeout_millis=5000)
    spans = mem.get_finished_spans()
    assert len(spans) >= 8 and {s.name for s in spans} == {"kv.request", "kv.violation"}
    keys, cache = _KeyCache(), {}
    assert _encode_request(spans, keys, cache) == _sdk_request_bytes(spans)
    for s in spans:
        assert _encode_request([s], keys, cache) == _sdk_request_bytes([s])
    assert _encode_request([], keys, cache) == _sdk_request_bytes([]) == b""


def test_encoder_writes_the_sdks_request_bytes_for_any_sdk_span():
    """Spans of the SDK itself (a provider passed in): every attribute value type (and those the SDK encodes or
    refuses its own way: lists, None, bytes, an int beyond int64, a lone surrogate), limits that drop attributes
    and events, links, a remote parent with a trace state, several resources and scopes interleaved, equal
    resources in distinct objects. Byte for byte the SDK encoder's request."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits
    from opentelemetry.trace import (
        Link,
        NonRecordingSpan,
        SpanContext,
        Status,
        TraceFlags,
        TraceState,
        set_span_in_context,
    )

    from exporters.otel import _encode_request, _KeyCache

    mem = InMemorySpanExporter()
    providers = [
        TracerProvider(
            resource=Resource({"service.name": "x", "n": 1}),
            span_limits=SpanLimits(max_span_attributes=6, max_event_attributes=2),
        ),
        TracerProvider(
            resource=Resource({"service.name": "y"}, schema_url="https://s/1"), span_limits=SpanLimits(max_events=1)
        ),
        TracerProvider(resource=Resource({"service.name": "x", "n": 1})),  # equal to the first, another object
    ]
    for p in providers:
        p.add_span_processor(SimpleSpanProcessor(mem))
    values = {
        "s": "text",
        "empty": "",
        "uni": "ünï ✓",
        "long": "x" * 300,
        "t": True,
        "f": False,
        "zero": 0,
        "small": 127,
        "mid": 128,
        "big": 2**62,
        "neg": -5,
        "minus_big": -(2**63),
        "float": 1.5,
        "nan": float("nan"),
        "negzero": -0.0,
        "list": [1, 2, 3],
        "strs": ("a", "b"),
        "bools": [True, False],
    }
    remote = SpanContext(7, 8, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")]))
    for i, p in enumerate(providers * 2):
        tracer = p.get_tracer(f"scope{i % 2}", "1.0" if i % 2 else "", schema_url="https://scope" if i % 2 else None)
        ctx = set_span_in_context(NonRecordingSpan(remote)) if i == 3 else None
        span = tracer.start_span(
            f"span{i}", context=ctx, links=[Link(remote, {"l": 1})] if i == 4 else (), attributes={"i": i}
        )
        for k, v in values.items():
            span.set_attribute(k, v)
        span.add_event("e", {"a": 1, "b": "two", "c": [1.0]}, timestamp=1234567890123456789)
        span.add_event("", {})
        if i == 1:
            span.set_status(Status(StatusCode.ERROR, "bad ✗"))
        elif i == 2:
            span.set_status(Status(StatusCode.OK))
        span.end()
    # Values the SDK's span refuses at set_attribute, put into a ReadableSpan's attributes directly: the encoder
    # must do what the SDK's encoder does with them (encode None as an empty value, refuse the others and log).
    odd = mem.get_finished_spans()[0]
    odd._attributes = {"none": None, "bytes": b"\x00\x01", "huge": 2**64, "surrogate": "\ud800", 5: "int key"}
    spans = mem.get_finished_spans()
    assert len(spans) == 6 and spans[3].dropped_attributes > 0 and spans[3].events[0].dropped_attributes == 1
    assert spans[1].dropped_events == 1
    assert _encode_request(spans, _KeyCache(), {}) == _sdk_request_bytes(spans)
    for s in spans:
        assert _encode_request([s], _KeyCache(), {}) == _sdk_request_bytes([s])
    for p in providers:
        p.shutdown()


def test_own_provider_exports_with_the_direct_encoder(otel_env):
    """Our own provider's OTLP exporter is ``_OtlpSpanExporter``: it posts ``_encode_request``'s body (checked
    end to end against a receiver in test_otlp_http_end_to_end); after its shutdown it is the SDK's export."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    from exporters.otel import _OtlpSpanExporter

    w = paged()
    exp = OtelExporter(w, endpoint=f"http://127.0.0.1:{_free_port()}")
    assert type(exp._span_exporters[0].inner) is _OtlpSpanExporter and exp._span_exporters[0].inner._direct
    exp.shutdown(timeout_millis=2000)
    assert exp._span_exporters[0].inner.export([]) is SpanExportResult.FAILURE  # shut down: the SDK's answer

    # A request over max_request_size is dropped before anything is sent, as the SDK's exporter drops it.
    mem = InMemorySpanExporter()
    w = paged()
    exp = OtelExporter(w, span_exporter=mem)
    a = Req("a")
    extend(w, [a], [5])
    w.free(t(a.row))
    w.release_request("a")
    exp.shutdown(timeout_millis=2000)
    small = _OtlpSpanExporter(endpoint=f"http://127.0.0.1:{_free_port()}", max_request_size=10)
    sent = []
    small._client.export = lambda data: sent.append(data)
    assert small.export(mem.get_finished_spans()) is SpanExportResult.FAILURE and sent == []
    small.shutdown()


class _EveryKind:
    """A sink with no ``event_types``: the wrapper builds every kind for it (free LedgerUpdates, decode Allocs),
    so the exporter receives those instead of reading ``bus.skipped_frees``."""

    name = "every-kind"

    def __call__(self, batch) -> None:
        return None


def _demo_spans(preset, page_size, seed, inject, verify, variant, steps=300, sampler=None) -> tuple[list, list]:
    """The spans of a faulted demo run, without ids or times (a parent named by its request id), sorted; and
    the run's violation ids. ``variant``: "fast" (our provider, the exporter alone), "every-kind" (the same beside
    a sink that reads every kind) or "sdk" (a provider passed in: the SDK's spans). ``sampler``: the SDK sampler
    the provider passed in gets (our own provider reads OTEL_TRACES_SAMPLER: set it to the same); the ids are then
    drawn from the global random source seeded with ``seed``, so that both paths draw the same ids."""
    import random

    from instrumented_alloc.sim import build_engine

    e = build_engine(preset, seed=seed, page_size=page_size, inject=inject, steps=steps, verify=verify)
    mem = InMemorySpanExporter()
    if sampler is not None:
        random.seed(seed)
    if variant == "sdk":
        provider = TracerProvider() if sampler is None else TracerProvider(sampler=sampler)
        provider.add_span_processor(SimpleSpanProcessor(mem))
        exporter = OtelExporter(e.alloc, tracer_provider=provider)
        assert exporter._fast is None
    else:
        exporter = OtelExporter(e.alloc, span_exporter=mem)
        assert exporter._fast is not None
        if variant == "every-kind":
            e.alloc.subscribe(_EveryKind())
    e.run(steps)
    assert exporter.shutdown(timeout_millis=5000)
    assert exporter.errors == 0 and e.alloc.bus.dropped.get("otel", 0) == 0
    spans = mem.get_finished_spans()
    rid_of = {s.context.span_id: dict(s.attributes).get("kv.request.id") for s in spans}
    out = sorted(
        (
            s.name,
            tuple(sorted(dict(s.attributes).items())),
            tuple((x.name, tuple(sorted(dict(x.attributes).items()))) for x in s.events),
            s.status.status_code.name,
            s.status.description,
            None if s.parent is None else ("child of", rid_of.get(s.parent.span_id)),
        )
        for s in spans
    )
    return out, [v.invariant for v in e.alloc.violations]


@pytest.mark.parametrize(
    "preset, page_size, seed, inject, verify",
    [
        ("swa-128", None, 2, ("double-free@60", "swa-misaligned@120"), "immediate"),
        ("dense", 1, 1, ("leak@50", "duplicate-alloc@90"), "deferred"),
        ("pd-decode", None, 3, ("segment-unaligned@70",), "immediate"),
        ("swa-1024", None, 4, ("swa-inside-window@80", "alloc-len-misaligned@40"), "deferred"),
        ("dense", 64, 5, ("double-free@30", "leak@100"), "immediate"),
    ],
)
def test_demo_spans_are_the_same_on_every_path(preset, page_size, seed, inject, verify):
    """Faulted demo runs (continuous batching, chunked prefill, retraction, SWA eviction, the injected faults):
    the fast span path alone, the same beside a sink that has every kind built (the frees' LedgerUpdates arrive
    instead of ``bus.skipped_frees``, decode Allocs arrive and are ignored) and the SDK's own spans give the same
    spans, attribute for attribute and event for event. A differential fuzz of 131 such runs (random presets,
    page sizes, seeds, one to three faults, both verification modes) found no difference; these are five."""
    fast, violations = _demo_spans(preset, page_size, seed, inject, verify, "fast")
    assert violations  # the faults fired: the spans carry violations
    assert any(s[3] == "ERROR" for s in fast) and sum(s[0] == "kv.request" for s in fast) >= 10
    for variant in ("every-kind", "sdk"):
        other, other_violations = _demo_spans(preset, page_size, seed, inject, verify, variant)
        assert other_violations == violations
        assert other == fast


@pytest.mark.parametrize(
    "preset, page_size, seed, inject, verify",
    [
        ("swa-128", None, 2, ("double-free@60", "swa-misaligned@120"), "immediate"),
        ("dense", 64, 5, ("double-free@30", "leak@100"), "deferred"),
    ],
)
def test_demo_spans_under_a_ratio_sampler_are_the_sdks(otel_env, preset, page_size, seed, inject, verify):
    """Faulted demo runs under ``parentbased_traceidratio`` 0.3: the fast path keeps the same requests' spans as
    the SDK's spans under the same sampler and ids, with the same content; about the sampled share of them, each
    equal to that request's span when every request is traced."""
    from opentelemetry.sdk.trace import sampling as smp

    otel_env.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.3")
    sampler = smp._get_from_env_or_default()
    fast, violations = _demo_spans(preset, page_size, seed, inject, verify, "fast", sampler=sampler)
    sdk, sdk_violations = _demo_spans(preset, page_size, seed, inject, verify, "sdk", sampler=sampler)
    assert sdk_violations == violations and violations
    assert sdk == fast
    otel_env.delenv("OTEL_TRACES_SAMPLER")
    everything, _ = _demo_spans(preset, page_size, seed, inject, verify, "fast")
    n_all = sum(s[0] == "kv.request" for s in everything)
    n_kept = sum(s[0] == "kv.request" for s in fast)
    assert n_all >= 50 and 0.1 * n_all < n_kept < 0.5 * n_all
    # A kept span is the span the request gets when everything is traced (its content does not depend on sampling).
    from collections import Counter

    assert not Counter(fast) - Counter(everything)


def test_exemplars_link_sampled_traces_only(otel_env):
    """The OTel exporter under a ratio sampler beside the Prometheus exporter: a violation of a traced request
    carries its trace id and the violation counter's exemplar names it; one of a dropped request carries none,
    and its series has no exemplar (its trace is never exported)."""
    import random

    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    from exporters.prometheus import PrometheusExporter

    otel_env.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    for seed in range(64):  # a seed under which the first request is traced and the second is not
        w = paged(size=64)
        mem = InMemorySpanExporter()
        random.seed(seed)
        exp = OtelExporter(w, span_exporter=mem)
        prom = PrometheusExporter(w, registry=CollectorRegistry())
        a, b = Req("a"), Req("b")
        extend(w, [a, b], [5, 6])
        traced = exp.trace_id_for("a")
        if traced is not None and exp.trace_id_for("b") is None:
            break
        prom.close()
        exp.shutdown(timeout_millis=5000)
    else:
        pytest.fail("no seed of 64 traced a and dropped b")
    w.free(t(a.row[:4]))
    w.free(t(a.row[:4]))  # double_free, named after a
    w.release_request("b")  # b still holds its pages: request_leak, named after b
    assert [(v.invariant, v.rid, v.trace_id) for v in w.violations] == [
        ("double_free", "a", traced),
        ("request_leak", "b", None),
    ]
    text = generate_openmetrics(prom.registry).decode()
    series = {
        inv: [
            ln
            for ln in text.splitlines()
            if ln.startswith("kvalloc_invariant_violations_total{") and f'invariant="{inv}"' in ln
        ]
        for inv in ("double_free", "request_leak")
    }
    assert len(series["double_free"]) == 1 and f'# {{trace_id="{traced}"}} 1.0' in series["double_free"][0]
    assert len(series["request_leak"]) == 1 and "#" not in series["request_leak"][0]
    assert series["request_leak"][0].endswith(" 1.0")
    prom.close()
    assert exp.shutdown(timeout_millis=5000)
    spans = mem.get_finished_spans()
    assert [(s.name, s.attributes["kv.request.id"]) for s in spans if s.name == "kv.request"] == [("kv.request", "a")]
    assert format(spans[0].context.trace_id, "032x") == traced


# -- 9. the engine's spans as parents (set_parent) -----------------------------------------------------------------
ENGINE_TRACE_A = 0x0AF7651916CD43DD8448EB211C80319C
ENGINE_TRACE_B = "4bf92f3577b34da6a3ce929d0e0e4736"
ENGINE_TRACE_C = "5bf92f3577b34da6a3ce929d0e0e4737"


def _engine_parents(exp) -> dict:
    """Parents for the equivalence scenario's requests, as an engine would name them: a local sampled span with a
    trace state ("a"); W3C carriers from another process, sampled with a trace state ("b") and not sampled ("c"); a
    malformed carrier (42: stays a root); a Context holding a remote sampled span ("p"). Returns set_parent's
    answers."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState, set_span_in_context

    a = SpanContext(
        ENGINE_TRACE_A, 0xB7AD6B7169203331, False, TraceFlags(TraceFlags.SAMPLED), TraceState([("vendor", "a1")])
    )
    p = SpanContext(0x1111, 0x2222, True, TraceFlags(TraceFlags.SAMPLED))
    return {
        "a": exp.set_parent("a", a),
        "b": exp.set_parent("b", {"traceparent": f"00-{ENGINE_TRACE_B}-00f067aa0ba902b7-01", "tracestate": "eng=b"}),
        "c": exp.set_parent("c", {"traceparent": f"00-{ENGINE_TRACE_C}-00f067aa0ba902b8-00"}),
        42: exp.set_parent(42, {"traceparent": "00-not-a-trace-01"}),
        "p": exp.set_parent("p", set_span_in_context(NonRecordingSpan(p), Context())),
    }


@pytest.mark.parametrize("sampler_env", [None, ("parentbased_traceidratio", "0.5"), ("always_on", None)])
def test_set_parent_puts_request_spans_in_the_engines_traces(otel_env, sampler_env):
    """Requests whose parents the engine named: the fast path and the SDK's spans (same sampler, same random
    source) give the same spans, ids, parents, trace states and trace ids; a child of the engine's span has the
    engine's trace id, its parent (remote or local) and trace state; the parent-based sampler follows the engine's
    decision (the unsampled engine request "c" gets no span and no trace id), always_on does not; a malformed
    carrier leaves a root span; the leak found after b's release is a child of b's span, in the engine's trace."""
    from opentelemetry.sdk.trace import sampling as smp

    if sampler_env is not None:
        otel_env.setenv("OTEL_TRACES_SAMPLER", sampler_env[0])
        if sampler_env[1] is not None:
            otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", sampler_env[1])
    sdk_sampler = smp._get_from_env_or_default()

    def fast(w, mem):
        exp = OtelExporter(w, span_exporter=mem, max_events_per_span=4, hash_request_ids=HASH_KEY)
        assert exp._fast is not None
        return exp

    def sdk(w, mem):
        provider = TracerProvider(sampler=sdk_sampler)
        provider.add_span_processor(SimpleSpanProcessor(mem))
        return OtelExporter(w, tracer_provider=provider, max_events_per_span=4, hash_request_ids=HASH_KEY)

    for seed in range(4):
        got = _scenario_spans(fast, seed, parents=True)
        assert got == _scenario_spans(sdk, seed, parents=True)
    spans, ids, _, answers = got
    assert answers == {"a": True, "b": True, "c": True, 42: False, "p": True}
    req = {rid: s for s in spans if s[0] == "kv.request" for rid in [s[1]]}
    b_trace = ENGINE_TRACE_B
    assert req[_pseudonym("a")][2:6] == (
        format(ENGINE_TRACE_A, "032x"),
        req[_pseudonym("a")][3],
        (("vendor", "a1"),),
        (format(ENGINE_TRACE_A, "032x"), 0xB7AD6B7169203331, False),
    )
    assert req[_pseudonym("b")][2] == b_trace and req[_pseudonym("b")][4] == (("eng", "b"),)
    assert req[_pseudonym("b")][5] == (b_trace, 0x00F067AA0BA902B7, True)
    assert req[_pseudonym("p")][5] == (format(0x1111, "032x"), 0x2222, True)
    assert ids["a"] == format(ENGINE_TRACE_A, "032x") and ids["b"] == b_trace and ids["p"] == format(0x1111, "032x")
    leak = [s for s in spans if s[0] == "kv.violation" and s[5] is not None]
    assert len(leak) == 1 and leak[0][2] == b_trace and leak[0][5] == (b_trace, req[_pseudonym("b")][3], False)
    assert leak[0][4] == (("eng", "b"),)  # the child keeps its parent's trace state, as the SDK's samplers hand it
    if sampler_env is not None and sampler_env[0] == "always_on":
        assert _pseudonym("c") in req and req[_pseudonym("c")][2] == ENGINE_TRACE_C and ids["c"] == ENGINE_TRACE_C
    else:
        assert _pseudonym("c") not in req and ids["c"] is None
    if sampler_env is None or sampler_env[0] == "always_on":
        assert _pseudonym(42) in req and req[_pseudonym(42)][5] is None  # a root span of its own


def test_set_parent_reaches_the_collector_as_a_remote_parent(otel_env):
    """Over OTLP/HTTP: the request span of a request whose engine span came in a W3C carrier arrives in the
    engine's trace, with the engine span's id as its parent, the remote-parent flags and the trace state; the
    request the engine did not sample arrives not at all."""
    with Receiver() as rx:
        w = paged(size=64)
        exp = OtelExporter(w, endpoint=rx.base)
        assert exp.set_parent("b", {"traceparent": f"00-{ENGINE_TRACE_B}-00f067aa0ba902b7-01", "tracestate": "e=1"})
        assert exp.set_parent("c", {"traceparent": f"00-{ENGINE_TRACE_C}-00f067aa0ba902b8-00"})
        b, c, d = Req("b"), Req("c"), Req("d")
        extend(w, [b, c, d], [5, 6, 3])
        for r in (b, c, d):
            w.free(t(r.row))
            w.release_request(r.rid)
        assert exp.shutdown(timeout_millis=5000)
        assert rx.wait_for(lambda r: r.span_count() == 2)
        with rx.lock:
            got = {s.attributes[0].value.string_value: s for _, s in rx.spans}
    assert set(got) == {"b", "d"}
    sb = got["b"]
    assert sb.trace_id.hex() == ENGINE_TRACE_B and sb.parent_span_id.hex() == "00f067aa0ba902b7"
    assert sb.trace_state == "e=1" and sb.flags == 0x300  # the context has an is_remote bit, and it is set
    sd = got["d"]
    assert sd.parent_span_id == b"" and sd.flags == 0x100 and sd.trace_id.hex() != ENGINE_TRACE_B


def test_encoder_writes_the_sdks_request_bytes_for_parented_spans(otel_env):
    """``_encode_request`` on request spans whose parents the engine named (local and remote, trace states) and on
    the violation span in such a trace: byte for byte the SDK encoder's request."""
    from exporters.otel import _encode_request, _KeyCache

    mem = InMemorySpanExporter()
    w = _swa_alloc()
    exp = OtelExporter(w, span_exporter=mem)
    _engine_parents(exp)
    _equivalence_scenario(w, exp)
    exp.shutdown(timeout_millis=5000)
    spans = mem.get_finished_spans()
    assert sum(s.parent is not None and s.parent.is_remote for s in spans) == 2
    assert sum(bool(s.context.trace_state) for s in spans) >= 3
    assert _encode_request(spans, _KeyCache(), {}) == _sdk_request_bytes(spans)
    for s in spans:
        assert _encode_request([s], _KeyCache(), {}) == _sdk_request_bytes([s])


def test_set_parent_bad_input_late_calls_and_bounds(otel_env, monkeypatch):
    """What set_parent refuses (a type it does not know: TypeError naming it; a request whose span has started:
    ValueError naming the request) changes nothing; None forgets a parent (a request dropped before its first
    allocation); at most _MAX_PARENTS wait (the oldest forgotten, counted); with tracing off it accepts and does
    nothing."""
    from opentelemetry.trace import SpanContext, TraceFlags

    import exporters.otel as otel_mod

    ctx = SpanContext(0xABC, 0xDEF, True, TraceFlags(TraceFlags.SAMPLED))
    mem = InMemorySpanExporter()
    w = paged(size=64)
    exp = OtelExporter(w, span_exporter=mem)
    with pytest.raises(TypeError, match=r"set_parent: expected a SpanContext.*got int"):
        exp.set_parent("a", 12)
    with pytest.raises(TypeError, match="got str"):
        exp.set_parent("a", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert exp._parents == {}
    assert exp.set_parent("a", ctx) is True
    assert exp.set_parent("a", None) is False and exp._parents == {}
    assert exp.set_parent("a", {}) is False  # no traceparent: no valid context, a root span
    assert exp.set_parent("gone", ctx) is True
    assert exp.set_parent("gone", None) is False  # a request dropped before its first allocation: forgotten
    assert "gone" not in exp._parents
    a = Req("a")
    assert exp.set_parent("a", ctx)
    extend(w, [a], [5])
    assert exp._parents == {} and exp.trace_id_for("a") == format(0xABC, "032x")
    with pytest.raises(ValueError, match=r"set_parent: request 'a' already has its kv\.request span"):
        exp.set_parent("a", SpanContext(0x999, 0x998, True, TraceFlags(TraceFlags.SAMPLED)))
    assert exp.trace_id_for("a") == format(0xABC, "032x")
    monkeypatch.setattr(otel_mod, "_MAX_PARENTS", 3)
    for i in range(5):
        exp.set_parent(f"q{i}", ctx)
    assert list(exp._parents) == ["q2", "q3", "q4"] and exp.parents_dropped == 2
    w.free(t(a.row))
    w.release_request("a")
    assert exp.shutdown(timeout_millis=5000)
    (s,) = mem.get_finished_spans()
    assert s.parent == ctx and s.context.trace_id == 0xABC

    otel_env.setenv("OTEL_TRACES_SAMPLER", "always_off")
    w2 = paged(size=64)
    off = OtelExporter(w2, span_exporter=InMemorySpanExporter())
    assert off.set_parent("a", ctx) is False and off._parents == {}
    with pytest.raises(TypeError):
        off.set_parent("a", 1.5)
    assert off.shutdown(timeout_millis=5000)


def test_set_parent_takes_sglangs_request_trace_context(otel_env, monkeypatch):
    """SGLang 0.5.23's own request trace context (``TraceReqContext``: the root span its tokenizer starts from the
    client's ``traceparent``, pickled to the scheduler as SGLang ships a request, where ``root_span_context`` is an
    OpenTelemetry ``Context``) wired in as the README shows: the request's ``kv.request`` span is a child of SGLang's
    request span, in the client's trace. A disabled context (``TraceNullContext``, or tracing off) names none."""
    import pickle

    from tests.sglang_compat import require_sglang

    require_sglang(require_swa=False)
    import sglang.srt.observability.trace as sgl_trace

    from tests.ci import missing

    if not sgl_trace.opentelemetry_imported:
        missing("SGLang's tracing could not import OpenTelemetry (it needs opentelemetry-exporter-otlp-proto-grpc)")
    # What SGLang's process_tracing_init sets up, without its global provider and OTLP exporter: a tracer of the
    # test's own provider, the module's initialised flag, and this thread's info.
    engine_mem = InMemorySpanExporter()
    engine = TracerProvider()
    engine.add_span_processor(SimpleSpanProcessor(engine_mem))
    monkeypatch.setattr(sgl_trace, "opentelemetry_initialized", True)
    monkeypatch.setattr(sgl_trace, "tracer", engine.get_tracer("sglang"))
    monkeypatch.setattr(sgl_trace, "threads_info", {})
    sgl_trace.trace_set_thread_info("tokenizer")
    client_span = 0x00F067AA0BA902B7
    tokenizer_ctx = sgl_trace.TraceReqContext(
        "req-1", external_trace_header={"traceparent": f"00-{ENGINE_TRACE_B}-{client_span:016x}-01"}, trace_level=1
    )
    tokenizer_ctx.trace_req_start()
    scheduler_ctx = pickle.loads(pickle.dumps(tokenizer_ctx))  # the request crossing to the scheduler process

    mem = InMemorySpanExporter()
    w = paged(size=64)
    otel = OtelExporter(w, span_exporter=mem)
    for rid, trace_ctx in (
        ("req-1", scheduler_ctx),
        ("untraced", sgl_trace.TraceNullContext()),
        ("off", pickle.loads(pickle.dumps(sgl_trace.TraceReqContext("off", trace_level=0)))),
    ):
        # The README's wiring, verbatim but for the names.
        if trace_ctx.tracing_enable is True and trace_ctx.root_span_context is not None:
            assert otel.set_parent(rid, trace_ctx.root_span_context)
    assert list(otel._parents) == ["req-1"]
    reqs = [Req("req-1"), Req("untraced")]
    extend(w, reqs, [5, 3])
    for r in reqs:
        w.free(t(r.row))
        w.release_request(r.rid)
    tokenizer_ctx.trace_req_finish()
    assert otel.shutdown(timeout_millis=5000)

    (sglang_root,) = [s for s in engine_mem.get_finished_spans() if s.parent is not None and s.parent.is_remote]
    assert sglang_root.parent.span_id == client_span and format(sglang_root.context.trace_id, "032x") == ENGINE_TRACE_B
    spans = {s.attributes["kv.request.id"]: s for s in mem.get_finished_spans()}
    ours = spans["req-1"]
    assert format(ours.context.trace_id, "032x") == ENGINE_TRACE_B
    assert ours.parent.span_id == sglang_root.context.span_id and ours.parent.is_remote
    assert spans["untraced"].parent is None  # a root span of its own


def test_sampler_argument_configures_the_own_provider(otel_env):
    """``sampler=`` is the own provider's sampler, in place of OTEL_TRACES_SAMPLER (set here to something else, to
    show it is not read): a sampler the fast path knows keeps it (same spans as the SDK's under that sampler and
    random source), one it does not gets the SDK's spans, ALWAYS_OFF subscribes to nothing; a non-sampler or a
    sampler with a tracer_provider is refused, naming the argument."""
    import random

    from opentelemetry.sdk.trace import sampling as smp

    otel_env.setenv("OTEL_TRACES_SAMPLER", "always_off")

    def fast(w, mem):
        exp = OtelExporter(w, span_exporter=mem, hash_request_ids=HASH_KEY, sampler=smp.ParentBasedTraceIdRatio(0.5))
        assert exp._fast is not None and exp._fast.roots is not None
        return exp

    def sdk(w, mem):
        provider = TracerProvider(sampler=smp.ParentBasedTraceIdRatio(0.5))
        provider.add_span_processor(SimpleSpanProcessor(mem))
        return OtelExporter(w, tracer_provider=provider, hash_request_ids=HASH_KEY)

    kept = 0
    for seed in range(4):
        got = _scenario_spans(fast, seed)
        assert got == _scenario_spans(sdk, seed)
        kept += len(got[0])
    assert kept > 0

    class Coin(smp.Sampler):
        def should_sample(self, parent_context, trace_id, name, *args, **kwargs):
            return smp.SamplingResult(smp.Decision.RECORD_AND_SAMPLE if trace_id % 2 else smp.Decision.DROP)

        def get_description(self):
            return "coin"

    w = paged()
    random.seed(3)
    exp = OtelExporter(w, span_exporter=InMemorySpanExporter(), sampler=Coin())
    assert exp._fast is None and not exp._off and exp in w.bus.sinks  # the SDK's spans apply it
    assert exp.shutdown(timeout_millis=5000)
    w = paged()
    off = OtelExporter(w, span_exporter=InMemorySpanExporter(), sampler=smp.ALWAYS_OFF)
    assert off._off and off not in w.bus.sinks
    off.shutdown(timeout_millis=5000)
    with pytest.raises(TypeError, match="sampler: expected an OpenTelemetry SDK Sampler, got float"):
        OtelExporter(paged(), span_exporter=InMemorySpanExporter(), sampler=0.1)
    with pytest.raises(ValueError, match="sampler= configures the exporter's own provider"):
        OtelExporter(paged(), tracer_provider=TracerProvider(), sampler=smp.ALWAYS_ON)


def test_a_retracted_requests_next_span_stays_in_the_engines_trace(otel_env):
    """A request released (retracted) and allocated again gets a second kv.request span, a child of the same engine
    span, unless set_parent names another parent (or None) before that allocation; on both paths."""
    from opentelemetry.trace import SpanContext, TraceFlags

    first = SpanContext(0xAAA, 0x111, True, TraceFlags(TraceFlags.SAMPLED))
    other = SpanContext(0xBBB, 0x222, True, TraceFlags(TraceFlags.SAMPLED))
    for path in ("fast", "sdk"):
        mem = InMemorySpanExporter()
        w = paged(size=64)
        if path == "sdk":
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(mem))
            exp = OtelExporter(w, tracer_provider=provider)
        else:
            exp = OtelExporter(w, span_exporter=mem)
        assert exp.set_parent("a", first) and exp.set_parent("b", first) and exp.set_parent("c", first)

        def lifetime(w, rid):
            r = Req(rid)
            extend(w, [r], [5])
            w.free(t(r.row))
            w.release_request(rid)

        for rid in ("a", "b", "c"):
            lifetime(w, rid)
        lifetime(w, "a")  # re-prefilled: the same engine span
        assert exp.set_parent("b", other)
        lifetime(w, "b")  # a new parent named before it
        assert exp.set_parent("c", None) is False
        lifetime(w, "c")  # forgotten: a root span
        assert exp.shutdown(timeout_millis=5000)
        parents = [(s.attributes["kv.request.id"], s.parent) for s in mem.get_finished_spans()]
        assert parents == [("a", first), ("b", first), ("c", first), ("a", first), ("b", other), ("c", None)], path


@pytest.mark.parametrize("path", ["fast", "sdk"])
def test_a_retracted_request_re_prefilled_before_the_step_gets_its_own_span_under_deferred_verification(
    memory, path
):
    # The demo engine's retraction: free, release, and the same id prefilled again before the step boundary. Under
    # deferred verification the release is checked later; the spans must still be the ones immediate
    # verification gives (one per incarnation, each with its own values), on both span paths.
    def spans(verify):
        w = InstrumentedAllocator(
            PagedTokenToKVPoolAllocator(64, PS, torch.float16, "cpu"), mode="record", verify=verify
        )
        if path == "fast":
            mem = InMemorySpanExporter()
            exp = OtelExporter(w, span_exporter=mem)
        else:
            provider, mem = memory
            mem.clear()
            exp = OtelExporter(w, tracer_provider=provider)
        a = Req("a")
        extend(w, [a], [6])
        decode(w, [a])
        decode(w, [a])
        w.free(t(a.row))
        w.release_request("a")
        again = Req("a")
        extend(w, [again], [9])
        w.step()
        w.free(t(again.row))
        w.release_request("a")
        w.step()
        exp.shutdown() if path == "fast" else exp.force_flush()
        return [
            (
                {k: v for k, v in s.attributes.items()},
                [(e.name, {k: v for k, v in e.attributes.items() if k != "kv.step"}) for e in s.events],
            )
            for s in mem.get_finished_spans()
        ]

    immediate = spans("immediate")
    assert [(a["kv.allocated_len"], a["kv.committed_len"], a["kv.decode_steps"]) for a, _ in immediate] == [
        (8, 8, 2),
        (12, 9, 0),
    ]
    assert spans("deferred") == immediate


def test_request_ids_reach_the_collector_whatever_their_int_size():
    # OTLP's int_value is an int64: the SDK's encoder drops an attribute with a larger int (a UUID's int as a request
    # id) and logs it. Such an id goes out as its decimal text; ids within int64 stay ints.
    big, edge, low = uuid.UUID("1234567890abcdef1234567890abcdef").int, 2**63 - 1, -(2**63)
    rx = Receiver()
    try:
        w = paged()
        exp = OtelExporter(w, endpoint=rx.base)
        for rid in (big, edge, low, 2**63):
            r = Req(rid)
            extend(w, [r], [4])
            w.free(t(r.row))
            w.release_request(rid)
        assert exp.shutdown(timeout_millis=5000)
        assert rx.wait_for(lambda r: r.span_count() == 4)
        got = [s["attributes"]["kv.request.id"] for s in _from_otlp(rx)]
    finally:
        rx.close()
    assert got == [str(big), edge, low, str(2**63)]


@pytest.mark.parametrize("path", ["fast", "sdk"])
def test_attached_mid_run_at_page_size_1_counts_the_first_decode(memory, path):
    # SGLang decodes with alloc(bs) at page size 1: an alloc of one slot for a request that holds KV is a decode.
    # An exporter attached while requests already hold KV measures their next allocation from the ledger values
    # they had then, so the first decode after the attach is a decode, not a prefill.
    w = InstrumentedAllocator(TokenToKVPoolAllocator(64, torch.float16, "cpu"), mode="record")
    with w.batch(["a", "b"], lens=[3, 5]):
        ab = w.alloc(8)  # prefilled before tracing starts
    if path == "fast":
        mem = InMemorySpanExporter()
        exp = OtelExporter(w, span_exporter=mem)
    else:
        provider, mem = memory
        exp = OtelExporter(w, tracer_provider=provider)
    for _ in range(3):
        with w.batch(["a", "b"]):
            ab = torch.cat([ab, w.alloc(2)])
        w.step()
    w.free(ab[[0, 1, 2, 8, 10, 12]])
    w.release_request("a")
    exp.shutdown(timeout_millis=2000)
    (sa,) = [s for s in mem.get_finished_spans() if s.attributes["kv.request.id"] == "a"]
    assert sa.attributes["kv.decode_steps"] == 3 and sa.attributes["kv.allocated_len"] == 6
    assert [e.name for e in sa.events] == ["kv.release"]


def test_two_exporters_each_keep_their_trace_ids():
    # alloc.trace_id_for is one hook: each exporter's falls back to the one it replaced, and a shutdown puts that
    # back, so a violation of a request the remaining exporter traces still carries that span's trace id.
    w = paged(256)
    m1, m2 = InMemorySpanExporter(), InMemorySpanExporter()
    e1 = OtelExporter(w, span_exporter=m1)
    e2 = OtelExporter(w, span_exporter=m2)
    b = Req("b")
    extend(w, [b], [9])
    assert w.trace_id_for("b") == e2.trace_id_for("b") != e1.trace_id_for("b")  # the latest exporter's first
    assert e2.shutdown(timeout_millis=1000)
    assert w.trace_id_for == e1._trace_hook
    w.free(t(b.row[:4]))
    w.free(t(b.row[:4]))  # a double free of b's first page
    v = w.violations[-1]
    assert (v.invariant, v.rid) == ("double_free", "b") and v.trace_id == e1.trace_id_for("b")
    assert e1.shutdown(timeout_millis=1000) and w.trace_id_for is None
    (s,) = m1.get_finished_spans()
    assert hex_id(s) == v.trace_id and s.status.status_code is StatusCode.ERROR


def test_shutdown_keeps_its_time_when_the_span_exporters_own_shutdown_waits():
    # A span exporter whose shutdown waits for its export in flight: shutdown gives up after its timeout and does
    # not wait for that shutdown either.
    import threading

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    release = threading.Event()

    class Guarded(SpanExporter):
        def __init__(self):
            self.lock = threading.Lock()
            self.inside = threading.Event()

        def export(self, spans):
            with self.lock:
                self.inside.set()
                release.wait(10)
                return SpanExportResult.SUCCESS

        def shutdown(self):
            with self.lock:
                pass

    guarded = Guarded()
    w = paged()
    exp = OtelExporter(w, span_exporter=guarded)
    a = Req("a")
    extend(w, [a], [5])
    w.free(t(a.row))
    w.release_request("a")
    exp.force_flush(timeout_millis=100)
    try:
        assert guarded.inside.wait(5)  # the worker is inside export(), holding the lock
        t0 = time.monotonic()
        assert exp.shutdown(timeout_millis=300) is False
        assert time.monotonic() - t0 < 2.0
    finally:
        release.set()


# -- audit fixes: fork, OTEL_TRACES_EXPORTER, event limits, loss counters, samplers, small ones ----------------------
def _one_request(w, rid) -> None:
    r = Req(rid)
    extend(w, [r], [5])
    w.free(t(r.row))
    w.release_request(rid)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_exports_its_spans_as_a_fresh_processor(otel_env):
    # The parent's spans sit in the queue at the fork (a long schedule delay, a batch size above what is queued).
    # The SDK's at-fork hook empties the queue in the child; the processor must not go on counting those spans as
    # unsettled (before the fix the child refused 19 of its 20 spans as "queue full").
    rx = Receiver()
    try:
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.base)
        otel_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
        otel_env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "64")
        otel_env.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "64")
        w = paged(4096)
        exp = OtelExporter(w)
        for i in range(63):
            _one_request(w, f"parent{i}")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its counts through the pipe, never return into pytest
            code = 1
            try:
                for i in range(20):
                    _one_request(w, f"child{i}")
                exp.force_flush(timeout_millis=5000)
                p = exp._counting
                os.write(write, f"{p.queue_full} {p.exported} {w.bus.drop_counts()['otel']}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(read) as f:
            report = f.read()
        assert os.waitstatus_to_exitcode(status) == 0
        assert report == "0 20 0"  # nothing refused, the child's 20 exported, nothing lost
        assert exp.shutdown(timeout_millis=5000)  # the parent exports its own 63 spans
        names = sorted(rx.request_spans(), key=str)
        assert names == sorted([f"child{i}" for i in range(20)] + [f"parent{i}" for i in range(63)])
        assert rx.span_count() == 83 and w.bus.drop_counts()["otel"] == 0
    finally:
        rx.close()


def test_a_sampler_that_samples_only_children_of_a_local_parent_keeps_tracing_on(otel_env):
    # ParentBased(root=ALWAYS_OFF, remote_parent_sampled=ALWAYS_OFF) still samples the child of a sampled local
    # (in-process) parent: an engine span handed to set_parent. Before the fix the exporter read that sampler as
    # "samples nothing" and switched tracing off; the plain SDK exports the kv.request span.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import sampling as smp
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    def sampler():
        return smp.ParentBased(smp.ALWAYS_OFF, remote_parent_sampled=smp.ALWAYS_OFF)

    engine = TracerProvider().get_tracer("engine")
    got = {}
    for how in ("own", "sdk"):
        rx = Receiver()
        try:
            w = paged()
            if how == "own":
                exp = OtelExporter(w, sampler=sampler(), endpoint=rx.base)
                assert exp._fast is not None and not exp._off
            else:
                provider = TracerProvider(sampler=sampler())
                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=rx.base + "/v1/traces")))
                exp = OtelExporter(w, tracer_provider=provider)
            with engine.start_as_current_span("engine.request") as es:
                assert exp.set_parent("a", es) is True
                _one_request(w, "a")  # a child of the local sampled engine span: sampled
                engine_ctx = es.get_span_context()
            _one_request(w, "b")  # a root: dropped
            assert exp.trace_id_for("a") == format(engine_ctx.trace_id, "032x") and exp.trace_id_for("b") is None
            exp.shutdown(timeout_millis=5000)
            if how == "sdk":
                provider.shutdown()
            assert rx.wait_for(lambda r: r.span_count() >= 1)
            with rx.lock:
                spans = [s for _, s in rx.spans]
            got[how] = [
                (
                    s.name,
                    s.trace_id.hex(),
                    s.parent_span_id.hex(),
                    {kv.key for kv in s.attributes},
                    [e.name for e in s.events],
                )
                for s in spans
            ]
            assert got[how] == [
                (
                    "kv.request",
                    format(engine_ctx.trace_id, "032x"),
                    format(engine_ctx.span_id, "016x"),
                    {
                        "kv.request.id",
                        "kv.page_size",
                        "kv.allocated_len",
                        "kv.committed_len",
                        "kv.swa_evicted_seqlen",
                        "kv.violations",
                        "kv.decode_steps",
                        "kv.events_dropped",
                        "kv.pages.peak",
                        "kv.pages.held_at_release",
                    },
                    ["kv.prefill", "kv.release"],
                )
            ]
        finally:
            rx.close()
    # The same span on both paths (each in its own engine span's trace, checked above).
    assert [(n, k, e) for n, _, _, k, e in got["own"]] == [(n, k, e) for n, _, _, k, e in got["sdk"]]


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_queue_size_that_is_not_positive_raises_as_the_sdks_processor_does(otel_env, value):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from exporters.otel import CountingBatchSpanProcessor

    otel_env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", value)
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match="max_queue_size must be a positive integer"):
        BatchSpanProcessor(OTLPSpanExporter())  # the SDK's
    w = paged()
    with pytest.raises(ValueError, match=f"OTEL_BSP_MAX_QUEUE_SIZE='{value}'.*positive integer"):
        OtelExporter(w)
    with pytest.raises(ValueError, match="OTEL_BSP_MAX_QUEUE_SIZE"):
        CountingBatchSpanProcessor(InMemorySpanExporter())
    assert w.bus.sinks == ()  # nothing attached
    # A value that does not parse: the SDK's default (2048), as the SDK's processor reads it.
    otel_env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "lots")
    assert CountingBatchSpanProcessor(InMemorySpanExporter()).max_queue_size == 2048


def test_an_endpoint_with_a_query_gets_the_traces_path_before_it(otel_env):
    rx = Receiver()
    try:
        w = paged()
        exp = OtelExporter(w, endpoint=rx.base + "?tenant=t1")
        _one_request(w, "a")
        assert exp.shutdown(timeout_millis=5000)
        assert rx.wait_for(lambda r: "a" in r.request_spans())
        with rx.lock:
            assert rx.paths == ["/v1/traces?tenant=t1"]
        assert rx.span_count() == 1 and w.bus.drop_counts()["otel"] == 0
    finally:
        rx.close()


def test_exporters_sharing_one_counting_processor_count_its_losses_once(otel_env):
    # A provider with one CountingBatchSpanProcessor whose collector is down, passed as counting_exporter= to an
    # exporter that is shut down and then to a new one on the same allocator, and to a third beside it by its
    # CountingSpanExporter alone: every lost span is counted once under kvalloc_events_dropped_total{sink="otel"}
    # (before the fix, once per exporter), and the first exporter's past losses stay counted.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from exporters.otel import CountingBatchSpanProcessor
    from exporters.prometheus import PrometheusExporter

    otel_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    dead = f"http://127.0.0.1:{_free_port()}/v1/traces"
    proc = CountingBatchSpanProcessor(OTLPSpanExporter(endpoint=dead, timeout=0.2))
    provider = TracerProvider()
    provider.add_span_processor(proc)
    w = paged(256)
    prom = PrometheusExporter(w, multiprocess=False)
    try:
        e1 = OtelExporter(w, tracer_provider=provider, counting_exporter=proc)
        for i in range(2):
            _one_request(w, f"first{i}")
        e1.shutdown(timeout_millis=3000)
        assert proc.dropped == 2 and w.bus.drop_counts()["otel"] == 2
        e2 = OtelExporter(w, tracer_provider=provider, counting_exporter=proc)  # re-attached, same provider
        e3 = OtelExporter(w, tracer_provider=provider, counting_exporter=proc.counting)  # beside it
        for i in range(5):
            _one_request(w, f"r{i}")
        e2.force_flush(timeout_millis=5000)
        # e2 and e3 both end each request's span: 10 spans, each lost once.
        assert proc.dropped == 2 + 10 and e2.spans_dropped == 12 and e3.spans_dropped == 12
        assert w.bus.drop_counts()["otel"] == 12
        assert prom.registry.get_sample_value("kvalloc_events_dropped_total", {"sink": "otel"}) == 12.0
        e2.shutdown(timeout_millis=3000)
        e3.shutdown(timeout_millis=3000)
        assert w.bus.drop_counts()["otel"] == 12  # the totals outlive the exporters
    finally:
        prom.close()
        provider.shutdown()


def _three_requests(w) -> None:
    """a: prefill, decodes, release; b: prefill, a leak at its release (kv.violation), release; c: still open."""
    a, b, c = Req("a"), Req("b"), Req("c")
    extend(w, [a, b, c], [6, 9, 3])
    w.step()
    for _ in range(2):
        decode(w, [a, b, c])
        w.step()
    w.free(t(a.row))
    w.release_request("a")
    w.release_request("b")  # leaks: a violation on b's span


def _received_events(rx) -> dict:
    """rid -> (event names, dropped_events_count, kv.events_dropped) of the request spans the receiver decoded."""
    return {
        rid: ([e.name for e in s.events], s.dropped_events_count, attrs["kv.events_dropped"])
        for rid, (s, attrs) in rx.request_spans().items()
    }


@pytest.mark.parametrize("path", ["fast", "sdk"])
def test_a_lower_span_event_count_limit_bounds_our_spans(otel_env, path):
    # OTEL_SPAN_EVENT_COUNT_LIMIT below max_events_per_span bounds our spans (before the fix the own provider raised
    # it to max_events_per_span: 3 events under a limit of 2). The exporter's policy keeps the first events and
    # kv.release; kv.events_dropped and the span's dropped_events_count agree.
    from opentelemetry.sdk.trace import sampling as smp

    class Unknown(smp.ParentBased):  # a sampler the fast path does not know: the SDK's spans
        def should_sample(self, *args, **kwargs):
            return super().should_sample(*args, **kwargs)

    want = {
        "2": {"a": (["kv.prefill", "kv.release"], 0, 0), "b": (["kv.prefill", "kv.release"], 1, 1)},
        "0": {"a": ([], 2, 2), "b": ([], 3, 3)},
        "unset": {
            "a": (["kv.prefill", "kv.release"], 0, 0),
            "b": (["kv.prefill", "kv.violation", "kv.release"], 0, 0),
        },
    }
    for limit, expected in want.items():
        rx = Receiver()
        try:
            otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.base)
            if limit == "unset":
                otel_env.delenv("OTEL_SPAN_EVENT_COUNT_LIMIT", raising=False)  # the SDK's default, 128: raised to 64
            else:
                otel_env.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", limit)
            w = paged()
            exp = OtelExporter(w, sampler=Unknown(smp.ALWAYS_ON) if path == "sdk" else None)
            assert (exp._fast is not None) is (path == "fast")
            _three_requests(w)
            exp.force_flush(timeout_millis=5000)
            assert rx.wait_for(lambda r: {"a", "b"} <= set(r.request_spans()))
            assert _received_events(rx) == expected, limit
            exp.shutdown(timeout_millis=5000)
        finally:
            rx.close()


@pytest.mark.parametrize("path", ["fast", "sdk"])
def test_events_beyond_the_bound_are_the_spans_dropped_events(otel_env, path):
    # The default limits, max_events_per_span=3, five chunked prefills: the first two prefills and the release
    # reach the collector; dropped_events_count says the 3 kv.events_dropped says (before the fix: 0).
    from opentelemetry.sdk.trace import sampling as smp

    class Unknown(smp.ParentBased):
        def should_sample(self, *args, **kwargs):
            return super().should_sample(*args, **kwargs)

    rx = Receiver()
    try:
        w = paged()
        exp = OtelExporter(
            w, endpoint=rx.base, max_events_per_span=3, sampler=Unknown(smp.ALWAYS_ON) if path == "sdk" else None
        )
        a = Req("a")
        for _ in range(5):
            extend(w, [a], [4])
            w.step()
        b = Req("b")
        for _ in range(4):
            extend(w, [b], [4])
        exp.shutdown(timeout_millis=5000)  # b is still open: ended by shutdown, through finish()
        w.free(t(a.row))
        assert rx.wait_for(lambda r: {"a", "b"} <= set(r.request_spans()))
        got = _received_events(rx)
        assert got["a"] == (["kv.prefill", "kv.prefill"], 3, 3)  # a's release comes after the shutdown: none
        assert got["b"] == (["kv.prefill", "kv.prefill"], 2, 2)
    finally:
        rx.close()


def test_a_provider_with_a_lower_event_limit_bounds_our_spans_and_says_so(caplog):
    # A tracer_provider passed in whose SpanLimits.max_events (3) is below max_events_per_span (64): one warning
    # naming both, and our bound becomes 3, so the SDK evicts nothing (before the fix it evicted the first prefill
    # and kv.events_dropped said 0 while 3 events were gone).
    from opentelemetry.sdk.trace import SpanLimits

    mem = InMemorySpanExporter()
    provider = TracerProvider(span_limits=SpanLimits(max_events=3))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    w = paged()
    with caplog.at_level(logging.WARNING, logger="exporters.otel"):
        exp = OtelExporter(w, tracer_provider=provider)
    warnings = [r.getMessage() for r in caplog.records if "max_events" in r.getMessage()]
    assert len(warnings) == 1 and "(3)" in warnings[0] and "(64)" in warnings[0]
    a = Req("a")
    for _ in range(5):
        extend(w, [a], [5])
        w.step()
    w.free(t(a.row))
    w.release_request("a")
    (s,) = mem.get_finished_spans()
    assert [(e.name, e.attributes["kv.step"]) for e in s.events] == [
        ("kv.prefill", 0),
        ("kv.prefill", 1),
        ("kv.release", 5),
    ]
    assert s.dropped_events == 3 and s.attributes["kv.events_dropped"] == 3
    exp.shutdown()
    provider.shutdown()


def test_events_the_sdk_evicts_anyway_are_counted():
    # A provider whose limits the exporter cannot read (a wrapper hiding them): the SDK evicts the oldest events,
    # and kv.events_dropped counts them with the span's dropped events count.
    from opentelemetry.sdk.trace import SpanLimits

    mem = InMemorySpanExporter()
    inner = TracerProvider(span_limits=SpanLimits(max_events=2))
    inner.add_span_processor(SimpleSpanProcessor(mem))

    class Hiding:
        def get_tracer(self, *args, **kwargs):
            return inner.get_tracer(*args, **kwargs)

        def force_flush(self, timeout_millis=30000):
            return inner.force_flush(timeout_millis)

    w = paged()
    exp = OtelExporter(w, tracer_provider=Hiding())
    a = Req("a")
    for _ in range(4):
        extend(w, [a], [5])
    w.free(t(a.row))
    w.release_request("a")
    (s,) = mem.get_finished_spans()
    assert [e.name for e in s.events] == ["kv.prefill", "kv.release"]
    assert s.dropped_events == 3 and s.attributes["kv.events_dropped"] == 3
    exp.shutdown()
    inner.shutdown()


def _console_spans(text: str) -> list:
    """The spans the SDK's ConsoleSpanExporter printed (one JSON object per span), as (name, kv.request.id)."""
    import json

    out, i, dec = [], 0, json.JSONDecoder()
    while True:
        i = text.find("{", i)
        if i < 0:
            return sorted(out, key=str)
        obj, i = dec.raw_decode(text, i)
        out.append((obj["name"], obj["attributes"].get("kv.request.id")))


def test_traces_exporter_none_exports_nothing_and_loses_nothing(otel_env):
    # OTEL_TRACES_EXPORTER=none with a collector that is down: before the fix every span was sent over OTLP/HTTP
    # anyway and counted as lost; now tracing is off (nothing would be exported), nothing sent, nothing counted.
    rx = Receiver()
    try:
        otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.base)
        w = paged()
        exp = OtelExporter(w)
        assert w.bus.sinks == () and exp.trace_id_for("a") is None
        _three_requests(w)
        assert exp.shutdown(timeout_millis=3000)
        time.sleep(0.2)
        assert rx.span_count() == 0 and rx.hits == 0
        assert w.bus.drop_counts()["otel"] == 0 and exp.spans_dropped == 0
        assert all(v.trace_id is None for v in w.violations)
    finally:
        rx.close()


def test_traces_exporter_console_and_lists(otel_env, monkeypatch):
    # console: the SDK's ConsoleSpanExporter (stdout), nothing over OTLP; "otlp,console": both get every span.
    import io

    import exporters.otel as otel_mod

    sdk_console = otel_mod.ConsoleSpanExporter
    out = io.StringIO()
    # The SDK's exporter binds sys.stdout at import: here it writes to ``out``.
    monkeypatch.setattr(otel_mod, "ConsoleSpanExporter", lambda: sdk_console(out=out))

    def printed():
        text = out.getvalue()
        out.seek(0)
        out.truncate()
        return _console_spans(text)

    rx = Receiver()
    try:
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.base)
        otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
        w = paged()
        exp = OtelExporter(w)
        _three_requests(w)
        assert exp.shutdown(timeout_millis=3000)
        assert printed() == [("kv.request", "a"), ("kv.request", "b"), ("kv.request", "c")]
        assert rx.hits == 0 and w.bus.drop_counts()["otel"] == 0

        otel_env.setenv("OTEL_TRACES_EXPORTER", " otlp , console,otlp")  # each name once, as the SDK reads it
        otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        w = paged()
        exp = OtelExporter(w)
        _three_requests(w)
        assert exp.shutdown(timeout_millis=3000)
        assert printed() == [("kv.request", "a"), ("kv.request", "b"), ("kv.request", "c")]
        assert rx.wait_for(lambda r: r.span_count() >= 3)
        got = {rid: [e.name for e in s.events] for rid, (s, _) in rx.request_spans().items()}
        assert got == {
            "a": ["kv.prefill", "kv.release"],
            "b": ["kv.prefill", "kv.violation", "kv.release"],
            "c": ["kv.prefill"],
        }
        assert rx.span_count() == 3 and exp._counting.exported == 6 and w.bus.drop_counts()["otel"] == 0
    finally:
        rx.close()


def test_otlp_protocol_grpc_exports_over_grpc(otel_env):
    # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc: the SDK's gRPC exporter (installed here), to a real gRPC
    # TraceService; nothing goes to the OTLP/HTTP receiver.
    from concurrent import futures

    from tests.ci import missing

    try:
        import grpc
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
    except ImportError as exc:
        missing(f"OTLP/gRPC export needs opentelemetry-exporter-otlp-proto-grpc and grpcio (sglang-compat): {exc}")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    got = []

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    got.extend(ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")  # the traces variable first, as in the SDK
        otel_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
        w = paged()
        exp = OtelExporter(w, endpoint=f"http://127.0.0.1:{port}")
        _three_requests(w)
        assert exp.shutdown(timeout_millis=10000)
        spans = {}
        for s in got:
            attrs = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in s.attributes}
            spans[attrs["kv.request.id"]] = ([e.name for e in s.events], attrs["kv.violations"])
        assert spans == {
            "a": (["kv.prefill", "kv.release"], 0),
            "b": (["kv.prefill", "kv.violation", "kv.release"], 1),
            "c": (["kv.prefill"], 0),
        }
        assert exp._counting.exported == 3 and w.bus.drop_counts()["otel"] == 0
    finally:
        server.stop(0)


def test_traces_exporter_errors_name_the_variable(otel_env, monkeypatch):
    import sys

    otel_env.setenv("OTEL_TRACES_EXPORTER", "zipkin_nope")
    with pytest.raises(ValueError, match=r"OTEL_TRACES_EXPORTER='zipkin_nope': unknown span exporter 'zipkin_nope'"):
        OtelExporter(paged())
    otel_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match=r"OTEL_EXPORTER_OTLP_PROTOCOL='http/json': unsupported OTLP protocol"):
        OtelExporter(paged())
    # grpc without its package: a clear error naming the package and the variable.
    otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    w = paged()
    with pytest.raises(ValueError, match=r"opentelemetry-exporter-otlp-proto-grpc.*OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        OtelExporter(w)
    assert w.bus.sinks == ()
