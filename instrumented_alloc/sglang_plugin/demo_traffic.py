"""The demo's load on the server and what it reads back: traffic threads, injected requests, recordings, progress.

Contract: ``Traffic`` sends the stream's requests from ``concurrency`` threads and counts every answer once (done,
aborted at the end, or failed); ``inject`` sends one tagged request from a thread of its own and writes its result
into the injection under the caller's lock. ``Recordings`` reads the server's recordings while they grow;
``close`` closes every reader it opened (a later read opens them again): the run closes them before it stops the
server, so that no reader of ours holds a recording while its writer closes it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from instrumented_alloc.sglang_plugin import traffic

if TYPE_CHECKING:
    from instrumented_alloc.sglang_plugin.demo import Injection, Options
    from instrumented_alloc.sglang_plugin.demo_server import Server

REQUEST_TIMEOUT_S = 300.0


@dataclass
class Counts:
    sent: int = 0
    done: int = 0
    aborted: int = 0  # in flight when the demo stopped: aborted through SGLang's /abort_request
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    errors: list = field(default_factory=list)  # the first few failures, for the summary

    @property
    def running(self) -> int:
        return self.sent - self.done - self.aborted - self.failed


def _post(base: str, path: str, doc: dict, timeout: float):
    r = urllib.request.Request(base + path, json.dumps(doc).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=timeout) as resp:
        return resp.read()


def generate(base: str, req: traffic.Request, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    return json.loads(_post(base, "/generate", req.body(), timeout))


def _why(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        try:
            detail = exc.read().decode(errors="replace").strip()[:200]
        except OSError:
            detail = ""
        return f"HTTP {exc.code}" + (f": {detail}" if detail else "")
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return f"{type(exc).__name__}: {exc}"


class Traffic:
    """``concurrency`` threads, each sending the stream's next request and waiting for its answer, until stopped or
    ``limit`` requests were sent. ``stop`` aborts the requests in flight (SGLang releases them as aborted)."""

    def __init__(self, base: str, stream: traffic.Stream, *, concurrency: int, limit: int | None):
        self.base, self.stream, self.limit = base, stream, limit
        self.counts = Counts()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.server_gone = False  # set before stopping when the server failed: its unanswered requests failed
        self.in_flight: set[str] = set()
        self.threads = [
            threading.Thread(target=self._worker, name=f"kvalloc-demo-traffic-{i}", daemon=True)
            for i in range(concurrency)
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _worker(self) -> None:
        c = self.counts
        while not self.stopping.is_set():
            with self.lock:
                if self.limit is not None and c.sent >= self.limit:
                    return
                req = self.stream.next_request()
                c.sent += 1
                self.in_flight.add(req.rid)
            try:
                res = generate(self.base, req)
            except Exception as exc:  # the server's answer or its absence; counted, shown in the summary
                with self.lock:
                    self.in_flight.discard(req.rid)
                    if self.stopping.is_set() and not self.server_gone:
                        c.aborted += 1
                    else:
                        c.failed += 1
                        if len(c.errors) < 3 and not self.stopping.is_set():
                            c.errors.append(f"{req.rid}: {_why(exc)}")
                self.stopping.wait(0.5)  # a server that went away: no busy loop before the demo notices
                continue
            meta = res.get("meta_info", {}) if isinstance(res, dict) else {}
            reason = meta.get("finish_reason") or {}
            with self.lock:
                self.in_flight.discard(req.rid)
                if isinstance(reason, dict) and reason.get("type") == "abort":
                    c.aborted += 1
                else:
                    c.done += 1
                c.prompt_tokens += int(meta.get("prompt_tokens", 0) or 0)
                c.completion_tokens += int(meta.get("completion_tokens", 0) or 0)
                c.cached_tokens += int(meta.get("cached_tokens", 0) or 0)

    def finished(self) -> bool:
        """Every thread is done (``limit`` reached and answered)."""
        return not any(t.is_alive() for t in self.threads)

    def stop(self, timeout: float, server: Server) -> None:
        """Send no more; abort the requests in flight and wait for their answers (while the server lives, at most
        ``timeout``)."""
        self.stopping.set()
        with self.lock:
            rids = sorted(self.in_flight)
        for rid in rids:
            # Answered already, or the server is going: its thread sees that.
            with contextlib.suppress(Exception):
                _post(self.base, "/abort_request", {"rid": rid}, 10)
        deadline = time.monotonic() + timeout
        for t in self.threads:
            while t.is_alive() and not server.failed() and time.monotonic() < deadline:
                t.join(0.2)


def inject(base: str, j: Injection, lock: threading.Lock, started: float) -> threading.Thread:
    """Send the injection's tagged request from a thread of its own; its result lands in ``j``."""
    j.sent_at = time.monotonic() - started

    def send():
        try:
            generate(base, j.request)
            result = "done"
        except Exception as exc:
            result = _why(exc)
        with lock:
            j.result = result

    t = threading.Thread(target=send, name=f"kvalloc-demo-inject-{j.fault}", daemon=True)
    t.start()
    return t


# -- recordings ------------------------------------------------------------------------------------------------------
class Recordings:
    """The server's recordings (one per rank, named after the server's pid), read while they grow."""

    def __init__(self, directory: str, server_pid: int, reader):
        self.pattern = os.path.join(directory, f"kvalloc-{server_pid}-tp*-pp*.sqlite")
        self.reader = reader
        self.open: dict[str, object] = {}

    def paths(self) -> list[str]:
        return sorted(glob.glob(self.pattern))

    def _readers(self) -> dict:
        for p in self.paths():
            if p not in self.open:
                try:
                    self.open[p] = self.reader(p)
                except (OSError, ValueError):  # created, its schema not committed yet: next time
                    continue
        return self.open

    def counts(self) -> dict[str, dict[str, int]]:
        """Recording path -> invariant id -> violations recorded so far."""
        out = {}
        for p, rec in self._readers().items():
            try:
                out[p] = rec.violation_counts()
            except (OSError, ValueError):
                out[p] = {}
        return out

    def violations(self) -> dict[str, list]:
        out = {}
        for p, rec in self._readers().items():
            try:
                out[p] = rec.violations()
            except (OSError, ValueError):
                out[p] = []
        return out

    def close(self) -> None:
        for rec in self.open.values():
            with contextlib.suppress(Exception):
                rec.close()
        self.open.clear()


def _total(counts: dict) -> dict[str, int]:
    tot: dict[str, int] = {}
    for per in counts.values():
        for inv, n in per.items():
            tot[inv] = tot.get(inv, 0) + n
    return tot


# -- progress --------------------------------------------------------------------------------------------------------
class Progress:
    """A status line on a terminal (redrawn), a plain line every 5 s on a pipe (as the simulated demo's)."""

    def __init__(self, o: Options, traffic_: Traffic, recs: Recordings, out):
        self.o, self.traffic, self.recs, self.out = o, traffic_, recs, out
        self.tty = out.isatty()
        self.start = self.last = time.monotonic()
        self.shown = False

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        c = self.traffic.counts
        when = f"{elapsed:5.1f}/{self.o.duration:g}s" if self.o.duration else f"{elapsed:5.1f}s"
        done = f"{c.done}/{self.o.requests}" if self.o.requests else str(c.done)
        reqs = f"requests {done} done, {c.running} running" + (f", {c.failed} failed" if c.failed else "")
        toks = f"tokens {c.completion_tokens} generated, {c.cached_tokens} cached"
        tot = _total(self.recs.counts())
        viol = f"violations {sum(tot.values())}"
        if tot:
            viol += " (" + ", ".join(f"{k} {v}" for k, v in sorted(tot.items())) + ")"
        return f"{when} | {reqs} | {toks} | {viol}"

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            if force or now - self.last >= 0.5:
                self.last = now
                self.out.write("\r" + self.line() + "\x1b[K")
                self.out.flush()
                self.shown = True
        elif force or now - self.last >= 5.0:
            self.last = now
            print(self.line(), file=self.out, flush=True)

    def done(self) -> None:
        if self.tty and self.shown:
            self.out.write("\r" + self.line() + "\x1b[K\n")
            self.out.flush()
            self.shown = False
