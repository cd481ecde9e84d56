"""Shared helpers of the OtelExporter tests: allocators, scripted requests, scenarios and span readers."""



from __future__ import annotations

import socket
import time

import torch
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from exporters.otel import OtelExporter
from instrumented_alloc import InstrumentedAllocator, Violation
from instrumented_alloc.allocators import (
    PagedTokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
)
from instrumented_alloc.events import ViolationEvent
from instrumented_alloc.prealloc import alloc_for_decode_prealloc, swa_tail_len
from tests.engine_model import Req, decode_args, extend_args, split_extend, t
from tests.otlp_receiver import Receiver

PS = 4


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_round(w, k: int, outs: list, durations: list) -> None:
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


HASH_KEY = b"otel-test-key"


def pseudonym(rid) -> str:
    """Computed here independently of instrumented_alloc.redact: HMAC-SHA256 of the id's text, 16 hex digits."""
    import hashlib
    import hmac

    return "h:" + hmac.new(HASH_KEY, str(rid).encode(), hashlib.sha256).hexdigest()[:16]


def all_span_text(spans) -> str:
    parts = []
    for s in spans:
        parts += [s.name, repr(dict(s.attributes)), str(s.status.description)]
        parts += [repr((e.name, dict(e.attributes))) for e in s.events]
    return "\n".join(parts)


def finish_requests(w, names) -> None:
    reqs = [Req(n) for n in names]
    extend(w, reqs, [5] * len(reqs))
    for r in reqs:
        w.free(t(r.row))
        w.release_request(r.rid)


def equivalence_scenario(w, exp) -> dict:
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


def swa_alloc():
    return InstrumentedAllocator(
        SWATokenToKVPoolAllocator(256, 256, PS, torch.float16, "cpu", None, False), mode="record", sliding_window=8
    )


KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


CODES = {0: "UNSET", 1: "OK", 2: "ERROR"}


def sdk_samplers():
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


def scenario_spans(exporter_of, seed: int, *, parents: bool = False) -> tuple[list, dict, list, dict | None]:
    """The equivalence scenario with the global random source seeded first (the SDK's RandomIdGenerator draws from
    it; so does our own provider, in the same order) and, with ``parents``, the engine's parents set first
    (``engine_parents``). Returns its spans with their ids, parents (with their remote flag) and trace states;
    trace_id_for of each request; the trace ids the violations carry; set_parent's answers (None without)."""
    import random

    mem = InMemorySpanExporter()
    w = swa_alloc()
    random.seed(seed)
    exp = exporter_of(w, mem)
    answers = engine_parents(exp) if parents else None
    ids = equivalence_scenario(w, exp)
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


class EveryKind:
    """A sink with no ``event_types``: the wrapper builds every kind for it (decode Allocs, page deltas, ...), which
    the exporter then receives too."""

    name = "every-kind"

    def __call__(self, batch) -> None:
        return None


def demo_spans(preset, page_size, seed, inject, verify, variant, steps=300, sampler=None) -> tuple[list, list]:
    """The spans of a faulted demo run, without ids or times (a parent named by its request id), sorted; and
    the run's violation ids. ``variant``: "own" (our provider, the exporter alone), "every-kind" (the same beside
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
    else:
        exporter = OtelExporter(e.alloc, span_exporter=mem)
        if variant == "every-kind":
            e.alloc.subscribe(EveryKind())
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


ENGINE_TRACE_A = 0x0AF7651916CD43DD8448EB211C80319C


ENGINE_TRACE_B = "4bf92f3577b34da6a3ce929d0e0e4736"


ENGINE_TRACE_C = "5bf92f3577b34da6a3ce929d0e0e4737"


def engine_parents(exp) -> dict:
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


def one_request(w, rid) -> None:
    r = Req(rid)
    extend(w, [r], [5])
    w.free(t(r.row))
    w.release_request(rid)


def three_requests(w) -> None:
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


def received_events(rx) -> dict:
    """rid -> (event names, dropped_events_count, kv.events_dropped) of the request spans the receiver decoded."""
    return {
        rid: ([e.name for e in s.events], s.dropped_events_count, attrs["kv.events_dropped"])
        for rid, (s, attrs) in rx.request_spans().items()
    }


def console_spans(text: str) -> list:
    """The spans the SDK's ConsoleSpanExporter printed (one JSON object per span), as (name, kv.request.id)."""
    import json

    out, i, dec = [], 0, json.JSONDecoder()
    while True:
        i = text.find("{", i)
        if i < 0:
            return sorted(out, key=str)
        obj, i = dec.raw_decode(text, i)
        out.append((obj["name"], obj["attributes"].get("kv.request.id")))


def from_sdk(spans, resource_of, scope_of) -> list:
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


def from_otlp(rx: Receiver) -> list:
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
                "status": (CODES[s.status.code], s.status.message),
                "kind": KINDS[s.kind],
                "service": res.get("service.name"),
                "scope": scope,
                "times": (s.start_time_unix_nano, [e.time_unix_nano for e in s.events], s.end_time_unix_nano),
            }
        )
    return out


def comparable(records: list, trace_ids: dict) -> list:
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
