"""OtelExporter.set_parent: request spans as children of the engine's own spans (a SpanContext, a Span, a Context or
W3C trace-context headers), in the engine's traces."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from exporters.otel import OtelExporter
from tests.engine_model import Req, t
from tests.exporters.otel.helpers import (
    ENGINE_TRACE_A,
    ENGINE_TRACE_B,
    ENGINE_TRACE_C,
    HASH_KEY,
    extend,
    paged,
    pseudonym,
    scenario_spans,
)


@pytest.mark.parametrize("sampler_env", [None, ("parentbased_traceidratio", "0.5"), ("always_on", None)])
def test_set_parent_puts_request_spans_in_the_engines_traces(otel_env, sampler_env):
    """Requests whose parents the engine named: our own provider and the SDK's spans (same sampler, same random
    source) give the same spans, ids, parents, trace states and trace ids; a child of the engine's span has the
    engine's trace id, its parent (remote or local) and trace state; the parent-based sampler follows the engine's
    decision (the unsampled engine request "c" gets no span and no trace id), always_on does not; a malformed
    carrier leaves a root span; the leak found after b's release is a child of b's span, in the engine's trace."""

    if sampler_env is not None:
        otel_env.setenv("OTEL_TRACES_SAMPLER", sampler_env[0])
        if sampler_env[1] is not None:
            otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", sampler_env[1])
    sdk_sampler = TracerProvider().sampler

    def own(w, mem):
        exp = OtelExporter(w, span_exporter=mem, max_events_per_span=4, hash_request_ids=HASH_KEY)
        return exp

    def sdk(w, mem):
        provider = TracerProvider(sampler=sdk_sampler)
        provider.add_span_processor(SimpleSpanProcessor(mem))
        return OtelExporter(w, tracer_provider=provider, max_events_per_span=4, hash_request_ids=HASH_KEY)

    for seed in range(4):
        got = scenario_spans(own, seed, parents=True)
        assert got == scenario_spans(sdk, seed, parents=True)
    spans, ids, _, answers = got
    assert answers == {"a": True, "b": True, "c": True, 42: False, "p": True}
    req = {rid: s for s in spans if s[0] == "kv.request" for rid in [s[1]]}
    b_trace = ENGINE_TRACE_B
    assert req[pseudonym("a")][2:6] == (
        format(ENGINE_TRACE_A, "032x"),
        req[pseudonym("a")][3],
        (("vendor", "a1"),),
        (format(ENGINE_TRACE_A, "032x"), 0xB7AD6B7169203331, False),
    )
    assert req[pseudonym("b")][2] == b_trace and req[pseudonym("b")][4] == (("eng", "b"),)
    assert req[pseudonym("b")][5] == (b_trace, 0x00F067AA0BA902B7, True)
    assert req[pseudonym("p")][5] == (format(0x1111, "032x"), 0x2222, True)
    assert ids["a"] == format(ENGINE_TRACE_A, "032x") and ids["b"] == b_trace and ids["p"] == format(0x1111, "032x")
    leak = [s for s in spans if s[0] == "kv.violation" and s[5] is not None]
    assert len(leak) == 1 and leak[0][2] == b_trace and leak[0][5] == (b_trace, req[pseudonym("b")][3], False)
    assert leak[0][4] == (("eng", "b"),)  # the child keeps its parent's trace state, as the SDK's samplers hand it
    if sampler_env is not None and sampler_env[0] == "always_on":
        assert pseudonym("c") in req and req[pseudonym("c")][2] == ENGINE_TRACE_C and ids["c"] == ENGINE_TRACE_C
    else:
        assert pseudonym("c") not in req and ids["c"] is None
    if sampler_env is None or sampler_env[0] == "always_on":
        assert pseudonym(42) in req and req[pseudonym(42)][5] is None  # a root span of its own


def test_set_parent_bad_input_late_calls_and_bounds(otel_env, monkeypatch):
    """What set_parent refuses (a type it does not know: TypeError naming it; a request whose span has started:
    ValueError naming the request) changes nothing; None forgets a parent (a request dropped before its first
    allocation); at most _MAX_PARENTS wait (the oldest forgotten, counted); with tracing off it accepts and does
    nothing."""
    from opentelemetry.trace import SpanContext, TraceFlags

    import exporters.otel.exporter as otel_mod

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


def test_a_retracted_requests_next_span_stays_in_the_engines_trace(otel_env):
    """A request released (retracted) and allocated again gets a second kv.request span, a child of the same engine
    span, unless set_parent names another parent (or None) before that allocation; on both paths."""
    from opentelemetry.trace import SpanContext, TraceFlags

    first = SpanContext(0xAAA, 0x111, True, TraceFlags(TraceFlags.SAMPLED))
    other = SpanContext(0xBBB, 0x222, True, TraceFlags(TraceFlags.SAMPLED))
    for path in ("own", "sdk"):
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

