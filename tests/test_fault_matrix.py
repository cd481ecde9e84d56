"""The fault matrix (issue #9, part 2): every fault of an exporter or a sink, and what the engine sees of it.

For every fault the same four things are checked, on a wrapped allocator with real components attached (a real
OTLP/HTTP receiver, real SQLite files, a real ``PrometheusExporter`` registry, the OTel SDK) and a bare twin driven
with the same calls:
- allocator calls unaffected: every result bit-identical to the bare twin's, no exception, and each wrapped call
  under ``CALL_BOUND_S`` (timed per call, with the garbage collector off around the timed loop: a full collection
  of the whole session's garbage is not the fault under test);
- what is lost is counted: ``kvalloc_events_dropped_total{sink=...}`` read from the real registry, with exact
  numbers where the loss is on the bus;
- one log line per fault (not one per event or batch) where the component logs;
- recovery when the fault clears, where that makes sense.

Where each fault is proved ("here": this module; otel = tests/exporters/otel/test_export.py, prom =
tests/exporters/test_prometheus.py, recorder = tests/exporters/test_recorder.py, events = tests/test_events.py):

| fault | test |
|---|---|
| OTLP endpoint down | otel ``test_collector_down_or_slow_never_blocks_the_allocator[down]`` (never |
| | blocks); recovery on the same port: here ``test_otlp_collector_fails_then_recovers[down]`` |
| OTLP endpoint slow (timeouts) | otel ``test_collector_down_or_slow_never_blocks_the_allocator[slow]`` |
| OTLP endpoint slow (queue full) | here ``test_otlp_collector_slow_queue_full_is_counted`` |
| OTLP endpoint returns 500 / 503 | here ``test_otlp_collector_fails_then_recovers[500]``, ``[503]`` |
| metrics port taken | prom ``test_port_already_taken_names_the_port`` (the error names the port); the |
| | allocator keeps working, a second ``serve()`` scrapes right: here ``test_metrics_port_taken`` |
| recording disk full | recorder ``test_write_fault_mid_run_stops_recording_quietly[disk_full]`` (what was |
| | committed replays right); counts, latency, restart: here ``test_recording_write_fault[disk_full]`` |
| recording read-only | here ``test_recording_write_fault[read_only]`` (see below) |
| recording deleted mid-run | recorder ``test_write_fault_mid_run_stops_recording_quietly[file_deleted]``; |
| | counts, latency, restart: here ``test_recording_write_fault[deleted]`` |
| recorder queue full | recorder ``test_full_queue_drops_batches_and_marks_the_gap`` |
| unwritable recording path | recorder ``test_unwritable_path_fails_at_construction`` |
| a sink that raises | events ``test_bus_raising_sink_is_dropped_counted_and_never_propagates``, |
| | ``test_raising_sink_never_changes_results``; beside real exporters, one log line, recovery: here |
| | ``test_raising_sink_beside_real_exporters`` |
| a sink that refuses | events ``test_refusing_sink_counts_every_event`` |
| Prometheus sink / collector fails | prom ``test_failing_sink_never_reaches_the_caller``, |
| | ``test_failing_collector_keeps_the_scrape_alive`` |
| a sink that blocks | here ``test_blocking_sink_behind_nonblocking_sink`` (``instrumented_alloc.sinks``), and |
| | ``test_nonblocking_sink_failures_and_a_close_that_cannot_finish`` |

Read-only recording: chmod of the file or its directory mid-run cannot make this fault. The writer already holds the
database, its WAL and shared-memory files open, and permissions are checked at open, not per write (and the tests
may run as root, who ignores them anyway). So the database is made read-only the way SQLite itself sees it: the
writer's connection (captured through the ``exporters.recorder.writer._open_writer`` seam) gets
``PRAGMA query_only = ON`` mid-run, after which every write fails with SQLite's "attempt to write a readonly database".

OTel: the exporter's sink never refuses (it only builds spans in memory), so a failing collector drops nothing on the
bus (``alloc.bus.dropped["otel"]`` stays 0). The spans are lost at export, in the SDK's batch processor, which logs
one error per failed export request (a batch of up to ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` spans), never one per span;
the exporter's ``CountingSpanExporter`` counts every span of a failed export, and
``kvalloc_events_dropped_total{sink="otel"}`` reports them (``bus.drop_counts()``). The tests arrange exactly one
failed request and assert exactly one line, and exactly its spans counted.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import socket
import sqlite3
import threading
import time
import urllib.request
from contextlib import contextmanager

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import exporters.recorder.writer as recorder_mod
from exporters.otel import OtelExporter
from exporters.prometheus import PrometheusExporter
from exporters.recorder import FlightRecorder, Recording
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from instrumented_alloc.sinks import NonBlockingSink
from tests.engine_model import Req, allocator_state, decode_args, extend_args, split_extend, t
from tests.otlp_receiver import Receiver

PS = 4
CALL_BOUND_S = 0.05  # generous: a wrapped call takes tens of microseconds; a network or disk wait takes far longer
REQS_PER_ROUND = 4
DECODES_PER_ROUND = 6


# -- the harness ------------------------------------------------------------------------------------------------
def _paged(size=256):
    return PagedTokenToKVPoolAllocator(size, PS, torch.float16, "cpu")


class Tap:
    """A plain sink that keeps every batch it is handed (what every other sink was handed too)."""

    name = "tap"

    def __init__(self):
        self.batches: list = []

    def __call__(self, batch):
        self.batches.append(tuple(batch))

    @property
    def n_events(self) -> int:
        return sum(len(b) for b in self.batches)


class Harness:
    """A wrapped allocator with a real PrometheusExporter (and ``tap``) attached, and its bare twin."""

    def __init__(self):
        self.w = InstrumentedAllocator(_paged(), mode="record")
        self.bare = _paged()
        self.prom = PrometheusExporter(self.w, multiprocess=False)
        self.tap = Tap()
        self.w.subscribe(self.tap)
        self.durations: list = []
        self.rounds = 0

    def dropped(self, sink: str) -> float | None:
        """``kvalloc_events_dropped_total{sink=...}`` as a scrape of the real registry reads it."""
        return self.prom.registry.get_sample_value("kvalloc_events_dropped_total", {"sink": sink})

    def _call(self, name, *args):
        t0 = time.perf_counter()
        out = getattr(self.w, name)(*args)
        self.durations.append(time.perf_counter() - t0)
        ref = getattr(self.bare, name)(*args)
        assert (out is None and ref is None) or torch.equal(out, ref), name
        return out

    def round(self) -> list:
        """One scheduling round: REQS_PER_ROUND requests prefill, decode DECODES_PER_ROUND steps, free and
        finish. Every wrapped call is timed and compared with the bare twin. Returns the round's request ids."""
        k = self.rounds
        self.rounds += 1
        reqs = [Req(f"r{k}.{i}") for i in range(REQS_PER_ROUND)]
        lens = [5, 7, 9, 3]
        rids = [r.rid for r in reqs]
        with self.w.batch(rids):
            out = self._call("alloc_extend", *extend_args(reqs, lens))
        split_extend(reqs, lens, out)
        self._timed_step()
        for _ in range(DECODES_PER_ROUND):
            with self.w.batch(rids):
                out = self._call("alloc_decode", *decode_args(reqs))
            for r, s in zip(reqs, out.tolist()):
                r.row.append(s)
            self._timed_step()
        for r in reqs:
            self._call("free", t(r.row))
            t0 = time.perf_counter()
            self.w.release_request(r.rid)
            self.durations.append(time.perf_counter() - t0)
        self._timed_step()
        return rids

    def _timed_step(self):
        t0 = time.perf_counter()
        self.w.step()
        self.durations.append(time.perf_counter() - t0)

    def check_unaffected(self):
        assert allocator_state(self.w) == allocator_state(self.bare)
        assert list(self.w.violations) == []
        assert self.durations and max(self.durations) < CALL_BOUND_S, f"slowest call {max(self.durations):.4f}s"

    def close(self):
        self.prom.close()


@contextmanager
def no_gc():
    """Collect now, keep the collector out of the timed loop (see the module docstring)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def records(caplog, prefix: str, level=logging.WARNING) -> list:
    return [r for r in caplog.records if r.name.startswith(prefix) and r.levelno >= level]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- 1. the OTLP collector returns errors (or is down), then recovers --------------------------------------------
@pytest.mark.parametrize("fault", ["500", "503", "down"])
def test_otlp_collector_fails_then_recovers(otel_env, caplog, fault):
    caplog.set_level(logging.INFO)
    # One export attempt per force_flush: the batch processor's own timer (60 s) never fires during the test, and
    # a batch of 512 spans holds every span a flush has. The 0.3 s export timeout is shorter than the SDK's first
    # retry backoff (1 s +- 20%), so even a retryable 503 or a refused connection is one attempt and one error.
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.3")
    otel_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    if fault == "down":
        port, rx = _free_port(), None
    else:
        rx = Receiver(status=int(fault))
        port = rx.server.server_address[1]
    h = Harness()
    exp = OtelExporter(h.w, endpoint=f"http://127.0.0.1:{port}")
    try:
        with no_gc():
            outage = [rid for _ in range(5) for rid in h.round()]
        exp.force_flush(timeout_millis=5000)
        sdk_errors = records(caplog, "opentelemetry", logging.ERROR)
        assert len(sdk_errors) == 1, [r.getMessage() for r in sdk_errors]  # one failed request: one line
        # 500 is final; 503 and a refused connection are retryable, but the first backoff exceeds the timeout.
        expected = "code: 500" if fault == "500" else "due to timeout, max retries or shutdown"
        assert expected in sdk_errors[0].getMessage(), sdk_errors[0].getMessage()
        if rx is not None:
            assert rx.errors_sent == 1 and rx.span_count() == 0
        assert len(records(caplog, "opentelemetry")) == 1  # no retry warnings either
        h.check_unaffected()
        assert exp.errors == 0
        # The loss is at export, not on the bus: every span of the failed request is counted, as the registry shows.
        assert len(outage) == 5 * REQS_PER_ROUND == 20
        assert h.w.bus.dropped["otel"] == 0 and exp.spans_dropped == len(outage)
        assert h.dropped("otel") == len(outage) and h.dropped("prometheus") == 0

        # The collector comes back: on the same port (down), or answering 200 again.
        if rx is None:
            rx = Receiver(port=port)
        else:
            rx.status = 200
        with no_gc():
            after = [rid for _ in range(3) for rid in h.round()]
        exp.force_flush(timeout_millis=5000)
        assert rx.wait_for(lambda r: len(r.request_spans()) >= len(after))
        got = rx.request_spans()
        # Exactly the requests that finished after recovery: the failed batch is not retried later.
        assert sorted(got) == sorted(after) and not set(got) & set(outage)
        for _, attrs in got.values():
            assert attrs["kv.decode_steps"] == DECODES_PER_ROUND and attrs["kv.violations"] == 0
        assert len(records(caplog, "opentelemetry")) == 1  # recovery logs nothing
        # The count stopped growing: the spans after recovery arrived, none of them is counted as lost.
        assert exp.spans_dropped == len(outage) and h.dropped("otel") == len(outage)
        assert records(caplog, "exporters") == [] and records(caplog, "instrumented_alloc") == []
        h.check_unaffected()
    finally:
        exp.shutdown(timeout_millis=1000)
        h.close()
        if rx is not None:
            rx.close()


def test_otlp_collector_slow_queue_full_is_counted(otel_env, caplog):
    """A collector so slow that the batch queue fills: the spans refused at the full queue are counted exactly (the
    SDK's own processor would evict its oldest queued span with only a log line), the spans admitted arrive, and
    when the collector speeds up later spans arrive and the count stops growing."""
    caplog.set_level(logging.INFO)
    # A queue of 8 exported in batches of 4: the first batch leaves as soon as 4 are queued (the timer, 60 s,
    # never fires) and its export hangs 2 s at the receiver, far longer than the rounds below take.
    otel_env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    otel_env.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    otel_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "10")
    rx = Receiver(delay=2.0)
    h = Harness()
    exp = OtelExporter(h.w, endpoint=f"http://127.0.0.1:{rx.server.server_address[1]}")
    try:
        with no_gc():
            burst = [rid for _ in range(10) for rid in h.round()]
        assert len(burst) == 40
        # 8 spans admitted (4 being exported, 4 queued), the 32 others refused and counted, none evicted.
        assert exp.spans_dropped == 32 and h.dropped("otel") == 32 and h.w.bus.dropped["otel"] == 0
        h.check_unaffected()
        assert exp.force_flush(timeout_millis=15000)
        assert rx.wait_for(lambda r: len(r.request_spans()) >= 8)
        assert sorted(rx.request_spans()) == sorted(burst[:8])  # the first 8 ended, exactly
        assert records(caplog, "opentelemetry") == []  # no "Queue full" eviction, no export error

        rx.delay = 0.0
        later = []
        for _ in range(3):
            # A round (4 spans) at a time, each flushed: the queue of 8 cannot fill however late this machine
            # schedules the processor's worker (3 rounds at once could outrun it and be refused, counted).
            with no_gc():
                later += h.round()
            assert exp.force_flush(timeout_millis=5000)
        assert rx.wait_for(lambda r: len(r.request_spans()) >= 8 + len(later))
        assert sorted(rx.request_spans()) == sorted(burst[:8] + later)
        assert exp.spans_dropped == 32 and h.dropped("otel") == 32
        h.check_unaffected()
    finally:
        exp.shutdown(timeout_millis=5000)
        h.close()
        rx.close()


# -- 2. the metrics port is taken -----------------------------------------------------------------------------------
def test_metrics_port_taken(caplog):
    caplog.set_level(logging.WARNING)
    h = Harness()
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            with pytest.raises(OSError, match=f"metrics port {port} on 127.0.0.1 is already in use") as info:
                h.prom.serve(port=port)
            assert info.value.errno == errno.EADDRINUSE
            with no_gc():  # the exporter attached to the allocator is not broken by a failed serve()
                for _ in range(3):
                    h.round()
            h.check_unaffected()
        # A second serve() on a free port works and scrapes the exporter's current values.
        with no_gc():
            rids = h.round()
        extra = Req("open")
        with h.w.batch(["open"]):
            split_extend([extra], [6], h._call("alloc_extend", *extend_args([extra], [6])))
        port2 = h.prom.serve(port=0)
        assert port2 != port
        with urllib.request.urlopen(f"http://127.0.0.1:{port2}/metrics", timeout=5) as r:
            assert r.status == 200
            body = r.read().decode()
        assert 'kvalloc_pages{pool="full",state="used"} 2.0' in body  # the open request's two pages
        assert 'kvalloc_events_dropped_total{sink="prometheus"} 0.0' in body
        assert 'kvalloc_events_dropped_total{sink="tap"} 0.0' in body
        assert 'kvalloc_requests_live 1.0' in body and len(rids) == REQS_PER_ROUND
        assert records(caplog, "exporters") == []  # the failed serve() raised; it logs nothing
        h.check_unaffected()
    finally:
        h.close()


# -- 3. the recording's disk is full, read-only, or the file is deleted mid-run ---------------------------------------
@pytest.mark.parametrize("fault", ["disk_full", "read_only", "deleted"])
def test_recording_write_fault(tmp_path, monkeypatch, caplog, fault):
    caplog.set_level(logging.WARNING)
    conns: list = []
    real_open = recorder_mod._open_writer

    def open_writer(path):
        conn = real_open(path)
        if fault == "disk_full":
            conn.execute("PRAGMA max_page_count = 40")  # SQLite then reports "database or disk is full"
        conns.append(conn)
        return conn

    monkeypatch.setattr(recorder_mod, "_open_writer", open_writer)
    h = Harness()
    path = tmp_path / "fault.db"
    rec = FlightRecorder(h.w, path, snapshot_every=3, flush_interval=0.01)
    try:
        with no_gc():
            h.round()
        assert rec.flush(5.0) and rec.failed is None
        if fault == "read_only":
            conns[0].execute("PRAGMA query_only = ON")  # the writer is idle (flushed): see the module docstring
        elif fault == "deleted":
            for suffix in ("", "-wal", "-shm"):
                os.remove(str(path) + suffix)
        deadline = time.monotonic() + 30
        with no_gc():
            while rec.failed is None:
                assert time.monotonic() < deadline, "the writer never failed"
                h.round()
                rec.flush(2.0)
            for _ in range(3):  # after the failure: every batch is refused, the allocator goes on
                h.round()
        h.check_unaffected()

        warnings = records(caplog, "instrumented_alloc.recorder")
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        message = warnings[0].getMessage()
        expected = {"disk_full": "full", "read_only": "readonly", "deleted": "deleted"}[fault]
        assert str(path) in message and expected in message, message
        dropped = h.w.bus.dropped["recorder"]
        # The metric: refused batches (the bus) and events taken but never committed (lost_events) alike.
        # A deleted file is seen after a commit: it may have lost nothing it had taken; the others fail mid-write.
        assert dropped > 0 and (rec.lost_events > 0 or fault == "deleted")
        assert h.dropped("recorder") == dropped + rec.lost_events
        assert h.dropped("prometheus") == 0 and h.dropped("tap") == 0
        rec.close()
        assert len(records(caplog, "instrumented_alloc")) == 1  # closing does not warn again
        if fault != "deleted":
            # Every event the recorder was handed is accounted for: committed, lost (accepted but never committed)
            # or dropped (refused, counted on the bus).
            with Recording(path) as r:
                committed = len(list(r.events()))
            assert committed > 0 and committed + rec.lost_events + dropped == h.tap.n_events
            assert committed + h.dropped("recorder") == h.tap.n_events  # nothing missing from the metric

        # Recovery: the engine keeps running; a new recorder on a healthy file records everything from then on.
        monkeypatch.setattr(recorder_mod, "_open_writer", real_open)
        before = h.tap.n_events
        rec2 = FlightRecorder(h.w, tmp_path / "after.db", snapshot_every=3, flush_interval=0.01)
        with no_gc():
            for _ in range(2):
                h.round()
        rec2.close()
        with Recording(tmp_path / "after.db") as r:
            assert len(list(r.events())) == h.tap.n_events - before
        assert h.w.bus.dropped["recorder"] == dropped  # the new recorder dropped nothing
        assert h.dropped("recorder") == dropped + rec.lost_events  # and lost nothing: the total stands
        h.check_unaffected()
    finally:
        rec.close()
        h.close()


# -- 4. a sink that raises, beside the real exporters --------------------------------------------------------------
class Broken:
    """Raises on every batch while ``failing``; keeps what it is handed once it works again."""

    name = "broken"

    def __init__(self):
        self.failing = True
        self.batches: list = []

    def __call__(self, batch):
        if self.failing:
            raise RuntimeError("sink is down")
        self.batches.append(tuple(batch))


def test_raising_sink_beside_real_exporters(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    h = Harness()
    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    otel = OtelExporter(h.w, tracer_provider=provider)
    rec = FlightRecorder(h.w, tmp_path / "r.db", snapshot_every=3, flush_interval=0.01)
    broken = Broken()
    h.w.subscribe(broken)
    try:
        with no_gc():
            rids = [rid for _ in range(4) for rid in h.round()]
        h.check_unaffected()
        n_failed = h.tap.n_events
        assert n_failed > 100
        # The raising sink's every event is counted, under its name, and nothing else lost a single event.
        assert h.dropped("broken") == n_failed
        for other in ("prometheus", "otel", "recorder", "tap"):
            assert h.dropped(other) == 0, other
        warnings = records(caplog, "instrumented_alloc.events")
        assert len(warnings) == 1 and "'broken'" in warnings[0].getMessage()
        assert "RuntimeError: sink is down" in warnings[0].getMessage()
        # The real exporters beside it received everything.
        spans = {s.attributes["kv.request.id"]: s for s in mem.get_finished_spans() if s.name == "kv.request"}
        assert sorted(spans) == sorted(rids)
        assert all(s.attributes["kv.decode_steps"] == DECODES_PER_ROUND for s in spans.values())
        n_pages = sum(e.n_pages for b in h.tap.batches for e in b if type(e).__name__ == "Alloc")
        assert h.prom.registry.get_sample_value("kvalloc_pages_allocated_total", {"pool": "full"}) == n_pages
        assert rec.flush(5.0)
        with Recording(tmp_path / "r.db") as r:
            assert len(list(r.events())) == n_failed

        # Recovery: the sink works again and gets every later batch; the count stops growing, no new log line.
        broken.failing = False
        start = len(h.tap.batches)
        with no_gc():
            h.round()
        assert broken.batches == h.tap.batches[start:]
        assert h.dropped("broken") == n_failed
        assert len(records(caplog, "instrumented_alloc")) == 1
        h.check_unaffected()
    finally:
        rec.close()
        otel.shutdown()
        provider.shutdown()
        h.close()


# -- 5. a sink that blocks, wrapped in NonBlockingSink ---------------------------------------------------------------
class Blocking:
    """Blocks inside its first call until ``gate`` opens (forever, as far as the engine is concerned)."""

    name = "slowpoke"

    def __init__(self):
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batches: list = []

    def __call__(self, batch):
        self.entered.set()
        assert self.gate.wait(60)
        self.batches.append(tuple(batch))


def test_blocking_sink_behind_nonblocking_sink(caplog):
    caplog.set_level(logging.WARNING)
    # More batches than one round makes (about 23): after recovery the worker can fall a whole round behind (it
    # runs when the GIL switches threads, every few ms) without a refusal, so the recovery below is exact.
    queue_size = 64
    h = Harness()
    slow = Blocking()
    nb = NonBlockingSink(slow, queue_size=queue_size)
    h.w.subscribe(nb)
    try:
        assert nb.name == "slowpoke" and h.w.bus.dropped["slowpoke"] == 0  # counted under the wrapped sink's name
        # The first batch: the worker takes it and blocks in the sink. Waiting for that makes the rest exact: the
        # next queue_size batches are queued, every later one is refused.
        start = len(h.tap.batches)
        h._timed_step()
        assert slow.entered.wait(5)
        with no_gc():
            for _ in range(6):
                h.round()
        h.check_unaffected()
        handed = h.tap.batches[start:]
        accepted, refused = handed[: 1 + queue_size], handed[1 + queue_size :]
        assert len(refused) > 50
        n_refused = sum(len(b) for b in refused)
        assert h.w.bus.dropped["slowpoke"] == n_refused and h.dropped("slowpoke") == n_refused
        assert h.dropped("prometheus") == 0 and h.dropped("tap") == 0
        assert nb.pending == queue_size and slow.batches == []
        warnings = records(caplog, "instrumented_alloc")
        assert len(warnings) == 1 and warnings[0].name == "instrumented_alloc.sinks"
        assert "'slowpoke'" in warnings[0].getMessage()

        # Recovery: the sink unblocks, takes what was queued in order, then every later batch in order. Here the
        # engine waits for the worker after each batch (a sink behind it that flushes it): how long a loaded
        # machine keeps the worker off the CPU is not what this checks (a queue's worth of batches can pass).
        slow.gate.set()
        assert nb.flush(5.0)
        assert slow.batches == accepted
        drained = []

        def drain(batch) -> None:
            drained.append(nb.flush(5.0))

        drain.name = "drain"
        h.w.subscribe(drain)
        later = len(h.tap.batches)
        with no_gc():
            h.round()
        assert drained and all(drained)
        assert slow.batches == accepted + h.tap.batches[later:]
        assert h.dropped("slowpoke") == n_refused  # nothing refused once it keeps up
        assert len(records(caplog, "instrumented_alloc")) == 1
        assert nb.failed_events == 0
        h.check_unaffected()
        h.w.unsubscribe(nb)
        assert nb.close(5.0)
        assert nb([]) is False  # closed: refuses
    finally:
        slow.gate.set()
        nb.close(1.0)
        h.close()


def test_nonblocking_sink_failures_and_a_close_that_cannot_finish(caplog):
    caplog.set_level(logging.WARNING)
    h = Harness()

    def flaky(batch):
        if len(batch) % 2:
            raise ValueError("odd batch")
        return None

    nb = NonBlockingSink(flaky, queue_size=10_000, name="flaky")
    h.w.subscribe(nb)
    with no_gc():
        h.round()
    assert nb.flush(5.0)
    odd = [b for b in h.tap.batches if len(b) % 2]
    assert odd  # the round has batches of both parities
    # The failures happen after the bus accepted the batches: counted here, not on the bus; one log line.
    assert nb.failed_batches == len(odd) and nb.failed_events == sum(len(b) for b in odd)
    assert nb.last_error == "ValueError: odd batch"
    assert h.dropped("flaky") == 0
    warnings = records(caplog, "instrumented_alloc.sinks")
    assert len(warnings) == 1 and "'flaky'" in warnings[0].getMessage()
    h.w.unsubscribe(nb)
    assert nb.close()

    # A sink blocked for good: close() gives up after its timeout, discards (and counts) what was still queued.
    slow = Blocking()
    nb2 = NonBlockingSink(slow, queue_size=8)
    h.w.subscribe(nb2)
    h.w.step()
    assert slow.entered.wait(5)
    h.w.step()
    h.w.step()
    h.w.unsubscribe(nb2)
    t0 = time.perf_counter()
    assert nb2.close(0.2) is False
    assert time.perf_counter() - t0 < 2.0
    # Two step batches were still queued, a StepBoundary and a StepStats (the exporter's) each.
    assert nb2.discarded_events == 2 * 2 and nb2.pending == 0
    slow.gate.set()
    h.check_unaffected()
    h.close()
    with pytest.raises(ValueError, match="queue_size"):
        NonBlockingSink(flaky, queue_size=0)
    with pytest.raises(TypeError, match="callable"):
        NonBlockingSink(object())


def test_readonly_writer_error_text():
    """The read-only fault above relies on SQLite's own wording; pin it so that a change shows up here."""
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("PRAGMA query_only = ON")
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        conn.execute("INSERT INTO t VALUES (1)")
