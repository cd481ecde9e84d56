"""OtelExporter: export through the SDK's OTLPSpanExporter to a real OTLP/HTTP receiver, an engine thread that never
waits on the network (collector down or slow), every lost span counted, and the OTEL_* exporter configuration.
"""

from __future__ import annotations

import gc
import logging
import os
import time

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from exporters.otel import OtelExporter
from tests.engine_model import Req, allocator_state, t
from tests.exporters.otel.helpers import (
    ENGINE_TRACE_B,
    ENGINE_TRACE_C,
    HASH_KEY,
    comparable,
    console_spans,
    decode,
    equivalence_scenario,
    extend,
    finish_requests,
    free_port,
    from_otlp,
    from_sdk,
    one_request,
    paged,
    pseudonym,
    run_round,
    swa_alloc,
    three_requests,
)
from tests.otlp_receiver import Receiver


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


@pytest.mark.parametrize("collector", ["down", "slow"])
def test_collector_down_or_slow_never_blocks_the_allocator(otel_env, caplog, collector):
    caplog.set_level(logging.WARNING, logger="opentelemetry")
    rx = Receiver(delay=2.0) if collector == "slow" else None
    endpoint = rx.base if rx else f"http://127.0.0.1:{free_port()}"
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
            run_round(w, rounds, outs, durations)
            rounds += 1
            assert time.perf_counter() - start < 15, "the exporter never reached the network"
        with_exporter = time.perf_counter() - start

        w2 = paged(256)
        outs2, durations2 = [], []
        start = time.perf_counter()
        for k in range(rounds):
            run_round(w2, k, outs2, durations2)
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


def test_own_provider_exports_over_otlp_what_a_provider_passed_in_keeps_in_memory(otel_env):
    """The same scenario through a provider passed in (in memory) and through our own provider (the SDK's
    OTLPSpanExporter, decoded by a real receiver): the same spans, attribute for attribute, event for event."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    from exporters.otel import TRACER_NAME

    mem = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "instrumented-alloc"}))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    w1 = swa_alloc()
    exp1 = OtelExporter(w1, tracer_provider=provider, max_events_per_span=4, hash_request_ids=HASH_KEY)
    ids1 = equivalence_scenario(w1, exp1)
    exp1.shutdown(timeout_millis=5000)
    sdk = from_sdk(
        mem.get_finished_spans(),
        lambda s: s.resource.attributes.get(SERVICE_NAME),
        lambda s: s.instrumentation_scope.name,
    )
    provider.shutdown()

    rx = Receiver()
    try:
        w2 = swa_alloc()
        exp2 = OtelExporter(w2, endpoint=rx.base, max_events_per_span=4, hash_request_ids=HASH_KEY)
        ids2 = equivalence_scenario(w2, exp2)
        assert exp2.shutdown(timeout_millis=5000)
        assert rx.wait_for(lambda r: r.span_count() == len(sdk))
        otlp = from_otlp(rx)
    finally:
        rx.close()

    assert len(sdk) == len(otlp) == 8  # 5 requests, 3 violation spans
    assert comparable(otlp, ids2) == comparable(sdk, ids1)
    assert [v.invariant for v in w1.violations] == [v.invariant for v in w2.violations]
    # What the scenario covers, on the exported spans.
    reqs = {r["attributes"]["kv.request.id"]: r for r in otlp if r["name"] == "kv.request"}
    assert set(reqs) == {pseudonym(x) for x in ("a", "b", "p", 42, "c")}
    for rid in ("a", "b", "p", 42, "c"):
        assert reqs[pseudonym(rid)]["trace"] == ids2[rid]
    rb = reqs[pseudonym("b")]
    assert rb["attributes"]["kv.events_dropped"] == 1 and rb["status"][0] == "ERROR"
    assert rb["status"][1].startswith("double_free: ") and "'b'" not in rb["status"][1]
    assert [n for n, _ in rb["events"]] == ["kv.prefill", "kv.violation", "kv.violation", "kv.release"]
    assert [n for n, _ in reqs[pseudonym(42)]["events"]] == ["kv.prefill", "kv.swa_evict", "kv.swa_evict"]
    assert [n for n, _ in reqs[pseudonym("p")]["events"]] == ["kv.prealloc", "kv.swa_evict"]
    assert reqs[pseudonym("p")]["attributes"]["kv.open_at_shutdown"] is True
    assert reqs[pseudonym("a")]["status"] == ("UNSET", "")
    violations = sorted(
        (r["attributes"]["kv.violation.invariant"], r["parent"] is not None, r["trace"])
        for r in otlp
        if r["name"] == "kv.violation"
    )
    assert [v[:2] for v in violations] == [("double_free", False), ("free_unallocated", False), ("request_leak", True)]
    assert violations[2][2] == ids2["b"]  # the sweep's leak: a child of b's ended span, in b's trace
    assert len({v[2] for v in violations} | set(ids2.values())) == 7
    assert {r["service"] for r in otlp} == {"instrumented-alloc"}
    assert {r["scope"] for r in otlp} == {TRACER_NAME}


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

    finish_requests(w, ["a", "b", "c"])
    assert (counting.exported, counting.dropped, counting.failed_exports) == (3, 0, 0)
    assert exp.spans_dropped == 0 and sample() == 0.0
    mem.shutdown()  # from now on every export returns FAILURE
    finish_requests(w, ["d", "e"])
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
    finish_requests(w, names[:3])  # 3 queued: the worker takes them and hangs in export
    assert gate.entered.wait(5)
    finish_requests(w, names[3:])  # 3 more admitted (6 unsettled), the last 4 refused
    assert (proc.queue_full, proc.dropped, exp.spans_dropped, sample()) == (4, 4, 4, 4.0)
    assert w.bus.dropped["otel"] == 0
    gate.release.set()
    assert exp.force_flush(timeout_millis=5000)
    assert gate.names == names[:6] and proc.exported == 6

    gate.failing = True  # the collector now refuses: both spans counted at export
    finish_requests(w, ["f0", "f1"])
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


def test_span_exporter_argument_checks(otel_env):
    w = paged()
    with pytest.raises(ValueError, match="span_exporter="):
        OtelExporter(w, span_exporter=InMemorySpanExporter(), endpoint="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="span_exporter="):
        OtelExporter(w, span_exporter=InMemorySpanExporter(), tracer_provider=TracerProvider())
    with pytest.raises(TypeError, match="span_exporter"):
        OtelExporter(w, span_exporter=object())


def test_own_provider_spans_carry_its_resource_scope_and_a_plain_context(otel_env):
    """our own provider's ReadableSpan, field by field: its context equals what ``SpanContext(...)`` builds (is_valid,
    the default trace state), no links, INTERNAL, our provider's resource and scope; the processor's settled count
    (read lock-free by ``admit``) is the exported spans once they are exported."""
    from opentelemetry.trace import SpanContext, SpanKind
    from opentelemetry.trace.span import DEFAULT_TRACE_STATE

    from exporters.otel import TRACER_NAME

    mem = InMemorySpanExporter()
    w = paged()
    exp = OtelExporter(w, span_exporter=mem)
    reqs = [Req("a")]
    extend(w, reqs, [5])
    w.free(torch.tensor(reqs[0].row, dtype=torch.int64))
    w.release_request("a")
    assert exp.shutdown(timeout_millis=5000)
    (s,) = mem.get_finished_spans()
    ctx = s.context
    assert type(ctx) is SpanContext
    assert ctx.is_valid is True and ctx.is_remote is False and ctx.trace_state is DEFAULT_TRACE_STATE
    assert ctx.trace_flags.sampled and ctx.trace_id != 0 and ctx.span_id != 0
    assert s.name == "kv.request" and s.parent is None and s.links == () and s.kind is SpanKind.INTERNAL
    assert s.resource is exp.tracer_provider.resource
    assert s.instrumentation_scope.name == TRACER_NAME
    assert s.start_time <= s.end_time
    assert [e.name for e in s.events] == ["kv.prefill", "kv.release"] and type(s.events) is tuple
    assert exp._counting.counting.settled() == exp._counting.exported == 1


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
            one_request(w, f"parent{i}")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its counts through the pipe, never return into pytest
            code = 1
            try:
                for i in range(20):
                    one_request(w, f"child{i}")
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
        one_request(w, "a")
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
    dead = f"http://127.0.0.1:{free_port()}/v1/traces"
    proc = CountingBatchSpanProcessor(OTLPSpanExporter(endpoint=dead, timeout=0.2))
    provider = TracerProvider()
    provider.add_span_processor(proc)
    w = paged(256)
    prom = PrometheusExporter(w, multiprocess=False)
    try:
        e1 = OtelExporter(w, tracer_provider=provider, counting_exporter=proc)
        for i in range(2):
            one_request(w, f"first{i}")
        e1.shutdown(timeout_millis=3000)
        assert proc.dropped == 2 and w.bus.drop_counts()["otel"] == 2
        e2 = OtelExporter(w, tracer_provider=provider, counting_exporter=proc)  # re-attached, same provider
        e3 = OtelExporter(w, tracer_provider=provider, counting_exporter=proc.counting)  # beside it
        for i in range(5):
            one_request(w, f"r{i}")
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
        three_requests(w)
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

    import exporters.otel.export as otel_mod

    sdk_console = otel_mod.ConsoleSpanExporter
    out = io.StringIO()
    # The SDK's exporter binds sys.stdout at import: here it writes to ``out``.
    monkeypatch.setattr(otel_mod, "ConsoleSpanExporter", lambda: sdk_console(out=out))

    def printed():
        text = out.getvalue()
        out.seek(0)
        out.truncate()
        return console_spans(text)

    rx = Receiver()
    try:
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.base)
        otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
        w = paged()
        exp = OtelExporter(w)
        three_requests(w)
        assert exp.shutdown(timeout_millis=3000)
        assert printed() == [("kv.request", "a"), ("kv.request", "b"), ("kv.request", "c")]
        assert rx.hits == 0 and w.bus.drop_counts()["otel"] == 0

        otel_env.setenv("OTEL_TRACES_EXPORTER", " otlp , console,otlp")  # each name once, as the SDK reads it
        otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        w = paged()
        exp = OtelExporter(w)
        three_requests(w)
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
        three_requests(w)
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

