"""OtelExporter: at most max_events_per_span events per span (the first ones and kv.release), the rest counted in
kv.events_dropped; span event limits of the environment and of a provider passed in.
"""

from __future__ import annotations

import logging

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from exporters.otel import OtelExporter
from tests.engine_model import Req, t
from tests.exporters.otel.helpers import (
    decode,
    events,
    extend,
    paged,
    received_events,
    request_spans,
    three_requests,
)
from tests.otlp_receiver import Receiver


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



def test_a_lower_span_event_count_limit_bounds_our_spans(otel_env):
    # OTEL_SPAN_EVENT_COUNT_LIMIT below max_events_per_span bounds our spans, by our policy: the first events and
    # kv.release kept, the rest counted in kv.events_dropped, so the SDK evicts nothing; the span's OTLP
    # dropped_events_count says what kv.events_dropped says.
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
            exp = OtelExporter(w)
            three_requests(w)
            exp.force_flush(timeout_millis=5000)
            assert rx.wait_for(lambda r: {"a", "b"} <= set(r.request_spans()))
            assert received_events(rx) == expected, limit
            exp.shutdown(timeout_millis=5000)
        finally:
            rx.close()



def test_events_beyond_the_bound_are_the_spans_dropped_events(otel_env):
    # The default limits, max_events_per_span=3, five chunked prefills: the first two prefills and the release
    # reach the collector; kv.events_dropped counts the rest, at release and at shutdown, and the span's OTLP
    # dropped_events_count says the same.
    rx = Receiver()
    try:
        w = paged()
        exp = OtelExporter(w, endpoint=rx.base, max_events_per_span=3)
        a = Req("a")
        for _ in range(5):
            extend(w, [a], [4])
            w.step()
        b = Req("b")
        for _ in range(4):
            extend(w, [b], [4])
        exp.shutdown(timeout_millis=5000)  # b is still open: ended by shutdown
        w.free(t(a.row))
        assert rx.wait_for(lambda r: {"a", "b"} <= set(r.request_spans()))
        got = received_events(rx)
        assert got["a"] == (["kv.prefill", "kv.prefill"], 3, 3)  # a's release comes after the shutdown: none
        assert got["b"] == (["kv.prefill", "kv.prefill"], 2, 2)
    finally:
        rx.close()



def test_a_provider_with_a_lower_event_limit_evicts_the_oldest_events_counted_and_said_once(caplog):
    # A tracer_provider passed in whose SpanLimits.max_events (3) is below max_events_per_span (64): the SDK keeps
    # the newest events (its policy; a provider's limits are not public), kv.events_dropped counts what it evicted,
    # and the first such span logs one warning naming our bound.
    from opentelemetry.sdk.trace import SpanLimits

    mem = InMemorySpanExporter()
    provider = TracerProvider(span_limits=SpanLimits(max_events=3))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    w = paged()
    exp = OtelExporter(w, tracer_provider=provider)
    with caplog.at_level(logging.WARNING, logger="exporters.otel"):
        for rid in ("a", "b"):
            r = Req(rid)
            for _ in range(5):
                extend(w, [r], [5])
                w.step()
            w.free(t(r.row))
            w.release_request(rid)
    warnings = [r.getMessage() for r in caplog.records if "max_events_per_span" in r.getMessage()]
    assert len(warnings) == 1 and "(64)" in warnings[0]
    s = mem.get_finished_spans()[0]
    assert [(e.name, e.attributes["kv.step"]) for e in s.events] == [
        ("kv.prefill", 3),
        ("kv.prefill", 4),
        ("kv.release", 5),
    ]
    assert s.dropped_events == 3 and s.attributes["kv.events_dropped"] == 3
    exp.shutdown()
    provider.shutdown()



def test_events_the_sdk_evicts_anyway_are_counted():
    # A provider that is not the SDK's (a wrapper around one): the SDK evicts the oldest events, and
    # kv.events_dropped counts them with the span's dropped events count.
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


def test_a_span_with_events_dropped_by_our_bound_goes_out_with_that_count_and_nothing_else_changed(otel_env):
    # Our own provider's exporters get such a span as a ReadableSpan copy whose dropped events count is
    # kv.events_dropped (the SDK span's own count has no public setter); everything else is the span's.
    from exporters.otel import TRACER_NAME

    mem = InMemorySpanExporter()
    w = paged()
    exp = OtelExporter(w, span_exporter=mem, max_events_per_span=2)
    a, b = Req("a"), Req("b")
    for _ in range(3):
        extend(w, [a], [4])
    extend(w, [b], [4])
    for r in (a, b):
        w.free(t(r.row))
        w.release_request(r.rid)
    assert exp.shutdown(timeout_millis=5000)
    spans = {s.attributes["kv.request.id"]: s for s in mem.get_finished_spans()}
    sa, sb = spans["a"], spans["b"]
    assert [e.name for e in sa.events] == [e.name for e in sb.events] == ["kv.prefill", "kv.release"]
    assert sa.attributes["kv.events_dropped"] == sa.dropped_events == 2 and sb.dropped_events == 0
    assert sa.resource is sb.resource is exp.tracer_provider.resource
    assert sa.instrumentation_scope.name == TRACER_NAME and sa.parent is None and sa.context.trace_flags.sampled
    assert sa.start_time < sa.end_time and sa.status.status_code is sb.status.status_code
