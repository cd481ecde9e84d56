"""OtelExporter: request ids in spans, as pseudonyms (hash_request_ids=) and as OTLP values."""

from __future__ import annotations

import uuid

import pytest
from opentelemetry.trace import StatusCode

from exporters.otel import OtelExporter
from instrumented_alloc.events import RequestReleased
from tests.engine_model import Req, t
from tests.exporters.otel.helpers import (
    HASH_KEY,
    all_span_text,
    decode,
    events,
    extend,
    from_otlp,
    hex_id,
    paged,
    pseudonym,
    request_spans,
)
from tests.otlp_receiver import Receiver


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
    assert trace_ok is not None and exp.trace_id_for(pseudonym("secret-ok-0001")) is None
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
    assert sorted(spans) == sorted(pseudonym(r) for r in ("secret-ok-0001", "secret-leaky-0002", "123456789"))
    assert hex_id(spans[pseudonym("secret-ok-0001")]) == trace_ok
    p_leaky = pseudonym("secret-leaky-0002")
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
    ghost_msg = f"release_request: rid: unknown request id {pseudonym('secret-ghost-0003')!r}"
    assert dict(ghost.attributes) == {
        "kv.violation.invariant": "invalid_argument",
        "kv.violation.message": ghost_msg,
        "kv.violation.severity": "error",
        "kv.violation.op": "release_request",
        "kv.step": 0,
        "kv.request.id": pseudonym("secret-ghost-0003"),
    }
    assert ghost.status.description == f"invalid_argument: {ghost_msg}"
    text = all_span_text(mem.get_finished_spans())
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
    assert released == [pseudonym("alpha-request"), pseudonym(42)]
    assert sorted(request_spans(mem)) == sorted(released)


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
        got = [s["attributes"]["kv.request.id"] for s in from_otlp(rx)]
    finally:
        rx.close()
    assert got == [str(big), edge, low, str(2**63)]
