"""A minimal OTLP/HTTP traces receiver for tests and the soak: a real HTTP server on 127.0.0.1 that decodes every
``ExportTraceServiceRequest`` it is sent (what an OpenTelemetry Collector's OTLP/HTTP receiver does first)."""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(any_value):
    return getattr(any_value, any_value.WhichOneof("value"))


class Receiver:
    """A minimal OTLP/HTTP traces endpoint on 127.0.0.1: decodes every POST /v1/traces and keeps its spans.

    ``status``: the HTTP status it answers with (settable while it runs: a collector failing, then recovering). Any
    status but 200 is answered without decoding or keeping the body (a collector that failed accepted nothing) and
    counted in ``errors_sent``. ``port``: bind this port (a collector coming back where it was); 0: an ephemeral one.
    """

    def __init__(self, delay: float = 0.0, *, keep: bool = True, status: int = 200, port: int = 0):
        self.delay = delay
        self.keep = keep  # False: count spans only (a soak must not grow the receiver's memory)
        self.status = status
        self.errors_sent = 0
        self.n_spans = 0
        self.spans: list = []  # (resource attributes, span proto)
        self.scopes: list = []  # the instrumentation scope's name of each span in ``spans``
        self.encodings: list = []
        self.paths: list = []  # the request target of every POST (path and query), when ``keep``
        self.hits = 0
        self.first_hit: float | None = None
        self.lock = threading.RLock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                try:
                    body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                    with receiver.lock:
                        receiver.hits += 1
                        if receiver.first_hit is None:
                            receiver.first_hit = time.monotonic()
                    if receiver.delay:
                        time.sleep(receiver.delay)
                    if receiver.keep:
                        with receiver.lock:
                            receiver.paths.append(self.path)
                    if urlsplit(self.path).path != "/v1/traces":  # a query (?tenant=...) is the client's to add
                        self.send_response(404)
                        self.end_headers()
                        return
                    status = receiver.status
                    if status != 200:
                        with receiver.lock:
                            receiver.errors_sent += 1
                        payload = b"collector unavailable"
                        self.send_response(status)
                        self.send_header("Content-Type", "text/plain")
                        self.send_header("Content-Length", str(len(payload)))
                        self.end_headers()
                        self.wfile.write(payload)
                        return
                    encoding = self.headers.get("Content-Encoding", "")
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    req = ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    got, scopes = [], []
                    for rs in req.resource_spans:
                        res = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            got += [(res, span) for span in ss.spans]
                            scopes += [ss.scope.name] * len(ss.spans)
                    with receiver.lock:
                        receiver.n_spans += len(got)
                        if receiver.keep:
                            receiver.encodings.append(encoding)
                            receiver.spans += got
                            receiver.scopes += scopes
                    payload = ExportTraceServiceResponse().SerializeToString()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the exporter gave up waiting (the slow case)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def wait_for(self, predicate, timeout: float = 10.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if predicate(self):
                    return True
            time.sleep(0.02)
        return False

    def request_spans(self) -> dict:
        with self.lock:
            out = {}
            for _, s in self.spans:
                if s.name == "kv.request":
                    attrs = {kv.key: _value(kv.value) for kv in s.attributes}
                    out[attrs["kv.request.id"]] = (s, attrs)
            return out

    @property
    def endpoint(self) -> str:
        return self.base + "/v1/traces"

    def span_count(self) -> int:
        with self.lock:
            return self.n_spans

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
