"""OtelExporter: sampling by the SDK's samplers at each span's start; tracing off when no span can be sampled;
trace ids and exemplars only for sampled requests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from exporters.otel import OtelExporter
from tests.engine_model import Req, t
from tests.exporters.otel.helpers import (
    HASH_KEY,
    decode,
    demo_spans,
    equivalence_scenario,
    extend,
    one_request,
    paged,
    scenario_spans,
    sdk_samplers,
    swa_alloc,
)
from tests.otlp_receiver import Receiver


@pytest.mark.parametrize(
    "env, n_spans, subscribed",
    [
        ({}, 8, True),
        ({"OTEL_TRACES_SAMPLER": "always_on"}, 8, True),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, 0, False),
        # No root span, but an engine's sampled span named by set_parent would have its child sampled.
        ({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}, 0, True),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, 0, False),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1"}, 8, True),
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1"}, 8, True),
        ({"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "12"}, 8, True),
        ({"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "4"}, 8, True),
        ({"OTEL_SDK_DISABLED": "true"}, 0, False),
    ],
)
def test_own_provider_applies_the_samplers_and_limits_of_the_environment(otel_env, env, n_spans, subscribed):
    """Our own provider's spans follow ``OTEL_TRACES_SAMPLER`` and the span limits of the environment (a limit
    trims what it trims). Tracing that can produce no span (every span dropped, or the SDK disabled) subscribes to
    nothing: the wrapper then builds no event at all."""
    for k, v in env.items():
        otel_env.setenv(k, v)
    mem = InMemorySpanExporter()
    w = swa_alloc()
    exp = OtelExporter(w, span_exporter=mem, max_events_per_span=4, hash_request_ids=HASH_KEY)
    assert (exp in w.bus.sinks) is subscribed
    assert w.bus.active is subscribed
    ids = equivalence_scenario(w, exp)
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


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(sdk_samplers())),
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
def test_samples_nothing_only_when_no_span_of_ours_can_be_sampled(name, trace_id, parent):
    """``samples_nothing`` (which turns tracing off) holds exactly for the samplers that drop every root span and
    every child of any parent (remote or local, sampled or not): for those, ``should_sample`` drops whatever the
    trace id and parent; every other sampler of the SDK samples some span of ours."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    from exporters.otel.sampling import samples_nothing

    sampler = sdk_samplers()[name]
    if parent is None:
        context = Context()
    else:
        flags = TraceFlags(TraceFlags.SAMPLED if "sampled" in parent else TraceFlags.DEFAULT)
        span_id = 0 if parent == "invalid" else 0x1234
        pctx = SpanContext(trace_id, span_id, is_remote=parent.startswith("remote"), trace_flags=flags)
        context = set_span_in_context(NonRecordingSpan(pctx), Context())
    want = sampler.should_sample(context, trace_id, "kv.request").decision.is_sampled()
    nothing = name in ("always_off", "traceidratio 0")
    assert samples_nothing(sampler) is nothing
    if nothing:
        assert want is False


@pytest.mark.parametrize(
    "env_sampler, arg",
    [("traceidratio", "0.5"), ("parentbased_traceidratio", "0.5"), ("parentbased_traceidratio", "0.25")],
)
def test_sampled_spans_are_the_sdks_ids_included(otel_env, env_sampler, arg):
    """Under a ratio sampler, our own provider and the SDK's spans (a provider passed in, the same sampler) from the
    same random source: the same spans kept, the same trace and span ids, parents, attributes and events; the same
    ``trace_id_for`` (None for a request whose span was dropped) and the same trace ids on the violations. Across
    the seeds, some requests are sampled and some dropped (a dropped request's exemplar: see
    ``test_exemplars_link_sampled_traces_only``)."""

    otel_env.setenv("OTEL_TRACES_SAMPLER", env_sampler)
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    sdk_sampler = TracerProvider().sampler

    def own(w, mem):
        exp = OtelExporter(w, span_exporter=mem, max_events_per_span=4, hash_request_ids=HASH_KEY)
        assert not exp._off
        return exp

    def sdk(w, mem):
        provider = TracerProvider(sampler=sdk_sampler)
        provider.add_span_processor(SimpleSpanProcessor(mem))
        exp = OtelExporter(w, tracer_provider=provider, max_events_per_span=4, hash_request_ids=HASH_KEY)
        return exp

    kept = dropped = 0
    for seed in range(12):
        got = scenario_spans(own, seed)
        assert got == scenario_spans(sdk, seed)
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


@pytest.mark.parametrize(
    "preset, page_size, seed, inject, verify",
    [
        ("swa-128", None, 2, ("double-free@60", "swa-misaligned@120"), "immediate"),
        ("dense", 64, 5, ("double-free@30", "leak@100"), "deferred"),
    ],
)
def test_demo_spans_under_a_ratio_sampler_are_the_sdks(otel_env, preset, page_size, seed, inject, verify):
    """Faulted demo runs under ``parentbased_traceidratio`` 0.3: our own provider keeps the same requests' spans as
    the SDK's spans under the same sampler and ids, with the same content; about the sampled share of them, each
    equal to that request's span when every request is traced."""

    otel_env.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.3")
    sampler = TracerProvider().sampler
    own, violations = demo_spans(preset, page_size, seed, inject, verify, "own", sampler=sampler)
    sdk, sdk_violations = demo_spans(preset, page_size, seed, inject, verify, "sdk", sampler=sampler)
    assert sdk_violations == violations and violations
    assert sdk == own
    otel_env.delenv("OTEL_TRACES_SAMPLER")
    everything, _ = demo_spans(preset, page_size, seed, inject, verify, "own")
    n_all = sum(s[0] == "kv.request" for s in everything)
    n_kept = sum(s[0] == "kv.request" for s in own)
    assert n_all >= 50 and 0.1 * n_all < n_kept < 0.5 * n_all
    # A kept span is the span the request gets when everything is traced (its content does not depend on sampling).
    from collections import Counter

    assert not Counter(own) - Counter(everything)


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


def test_sampler_argument_configures_the_own_provider(otel_env):
    """``sampler=`` is the own provider's sampler, in place of OTEL_TRACES_SAMPLER (set here to something else, to
    show it is not read): a sampler our own provider knows keeps it (same spans as the SDK's under that sampler and
    random source), one it does not gets the SDK's spans, ALWAYS_OFF subscribes to nothing; a non-sampler or a
    sampler with a tracer_provider is refused, naming the argument."""
    import random

    from opentelemetry.sdk.trace import sampling as smp

    otel_env.setenv("OTEL_TRACES_SAMPLER", "always_off")

    def own(w, mem):
        exp = OtelExporter(w, span_exporter=mem, hash_request_ids=HASH_KEY, sampler=smp.ParentBasedTraceIdRatio(0.5))
        return exp

    def sdk(w, mem):
        provider = TracerProvider(sampler=smp.ParentBasedTraceIdRatio(0.5))
        provider.add_span_processor(SimpleSpanProcessor(mem))
        return OtelExporter(w, tracer_provider=provider, hash_request_ids=HASH_KEY)

    kept = 0
    for seed in range(4):
        got = scenario_spans(own, seed)
        assert got == scenario_spans(sdk, seed)
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
    assert not exp._off and exp in w.bus.sinks  # the SDK's spans apply it
    assert exp.shutdown(timeout_millis=5000)
    w = paged()
    off = OtelExporter(w, span_exporter=InMemorySpanExporter(), sampler=smp.ALWAYS_OFF)
    assert off._off and off not in w.bus.sinks
    off.shutdown(timeout_millis=5000)
    with pytest.raises(TypeError, match="sampler: expected an OpenTelemetry SDK Sampler, got float"):
        OtelExporter(paged(), span_exporter=InMemorySpanExporter(), sampler=0.1)
    with pytest.raises(ValueError, match="sampler= configures the exporter's own provider"):
        OtelExporter(paged(), tracer_provider=TracerProvider(), sampler=smp.ALWAYS_ON)


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
                assert not exp._off
            else:
                provider = TracerProvider(sampler=sampler())
                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=rx.base + "/v1/traces")))
                exp = OtelExporter(w, tracer_provider=provider)
            with engine.start_as_current_span("engine.request") as es:
                assert exp.set_parent("a", es) is True
                one_request(w, "a")  # a child of the local sampled engine span: sampled
                engine_ctx = es.get_span_context()
            one_request(w, "b")  # a root: dropped
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

