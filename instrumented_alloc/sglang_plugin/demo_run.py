"""One run of the demo, once its input is checked: start the server, announce, send traffic, stop, summarise.

Contract: ``DemoRun.run`` stops the server, the traffic and the dashboard whatever ends the run (its bound,
Ctrl-C, SIGTERM or SIGHUP, the server's end), then prints the summary; it returns the exit status of the module
contract in ``demo.py`` (0, or 1 when the server ended on its own or never got ready).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from instrumented_alloc.sglang_plugin.demo_server import Server, server_command, server_env
from instrumented_alloc.sglang_plugin.demo_traffic import Counts, Progress, Recordings, Traffic, inject

PROG = "instrumented-alloc"
DRAIN_S = 60.0  # at the end: the longest wait for the requests in flight
SETTLE_S = 2.0  # then idle, so that the plugin's idle sweep runs (KVALLOC_SWEEP_INTERVAL) and the recorder commits


@contextlib.contextmanager
def stop_signals():
    """SIGTERM and SIGHUP stop the demo as Ctrl-C does (a KeyboardInterrupt in the main thread), so that the server,
    in a process group of its own, is stopped too. Only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class DemoRun:
    """The run's state: what ``_stop`` must stop and what ``_summary`` reports. Written by the main thread only
    (the injections' results under ``lock``)."""

    def __init__(self, o, injections, stream, reader, dashboard, out, err):
        self.o, self.injections, self.stream = o, injections, stream
        self.reader, self.dashboard, self.out, self.err = reader, dashboard, out, err
        self.server: Server | None = None
        self.dash = None
        self.traffic: Traffic | None = None
        self.recs: Recordings | None = None
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.ready_s: float | None = None
        self.traffic_s = 0.0
        self.gone_s: float | None = None  # when the server was seen ending on its own (since its start)
        self.exit_code: int | None = None  # its exit code then, if it had exited

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def warn(self, text: str) -> None:
        print(f"{PROG}: {text}", file=self.err, flush=True)

    def run(self, port, metrics_port, workdir, model_dir, record_dir) -> int:
        o = self.o
        base = f"http://127.0.0.1:{port}"
        log_path = os.path.join(workdir, "server.log")
        how = "finished"
        self.t0 = time.monotonic()
        try:
            self.server = server = Server(
                server_command(o, model_dir, port), server_env(o, record_dir, metrics_port, self.injections),
                workdir, log_path,
            )  # fmt: skip
            self.recs = Recordings(record_dir, server.pid, self.reader)
            tp = f", tp {o.tp_size}" if o.tp_size > 1 else ""
            self.say(
                f"sglang: starting the server on {base} (pid {server.pid}, mode {o.mode}{tp}); its log: {log_path}"
            )
            if self._wait_ready(base):
                self.ready_s = time.monotonic() - self.t0
                self.say(f"sglang: ready in {self.ready_s:.1f}s")
                self._announce_outputs(metrics_port, record_dir, log_path)
                self._traffic(base)
        except KeyboardInterrupt:
            how = "stopped (Ctrl-C)" if self.ready_s is not None else "stopped (Ctrl-C) before the server was ready"
        finally:
            self._stop()
        rc = 0
        if self.gone_s is not None or (self.ready_s is None and how == "finished"):
            how, rc = self._server_gone(), 1
        self._summary(how)
        return rc

    def _wait_ready(self, base: str) -> bool:
        server = self.server
        deadline = self.t0 + self.o.start_timeout
        while not server.failed():
            if server.healthy(base):
                return True
            if time.monotonic() > deadline:
                self.warn(f"SGLang's server did not answer {base}/health within {self.o.start_timeout:g}s")
                return False
            time.sleep(0.5)
        self._gone()
        return False

    def _announce_outputs(self, metrics_port, record_dir: str, log_path: str) -> None:
        o = self.o
        if metrics_port is not None:
            for r in range(o.tp_size):
                self.say(f"metrics: http://{o.metrics_addr}:{metrics_port + r}/metrics (tp{r})")
        paths = self._wait_recordings()
        for p in paths:
            self.say(f"recording: {p}")
        if len(paths) < o.tp_size:
            self.warn(
                f"expected {o.tp_size} recordings in {record_dir}, found {len(paths)}: did the plugin load? "
                f"(see {log_path})"
            )
        if self.dashboard is not None and paths:
            try:
                self.dash = self.dashboard.start(paths, port=o.dashboard_port)
            except (OSError, ValueError) as exc:
                self.warn(f"--dashboard: {exc}; the demo goes on without it")
            else:
                self.say(f"dashboard: {self.dash.url}")
        bound = f"for {o.requests} requests" if o.requests else "until Ctrl-C"
        bound = f"for {o.duration:g}s" if o.duration else bound
        self.say(f"traffic: seed {o.seed}, {o.concurrency} concurrent requests with shared prefixes, {bound}")
        for j in self.injections:
            self.say(f"inject: {j.fault} at {j.at:g}s, request {j.request.rid} (expects {j.invariant})")

    def _wait_recordings(self, timeout: float = 10.0) -> list[str]:
        """The plugin creates each rank's recording while the scheduler builds its KV cache, before /health answers;
        a moment more for a slow file system."""
        deadline = time.monotonic() + timeout
        while True:
            paths = self.recs.paths()
            if len(paths) >= self.o.tp_size or time.monotonic() > deadline or self.server.failed():
                return paths
            time.sleep(0.2)

    def _traffic(self, base: str) -> None:
        """Until the bound, or the server's end (``gone_s`` set); Ctrl-C propagates."""
        o, server = self.o, self.server
        self.traffic = tr = Traffic(base, self.stream, concurrency=o.concurrency, limit=o.requests)
        progress = Progress(o, tr, self.recs, self.err)
        start = time.monotonic()
        pending = list(self.injections)
        tr.start()
        try:
            while True:
                now = self.traffic_s = time.monotonic() - start
                if server.failed():
                    self._gone()
                    return
                if (o.duration is not None and now >= o.duration) or (o.requests is not None and tr.finished()):
                    return
                while pending and pending[0].at <= now:
                    inject(base, pending.pop(0), self.lock, start)
                progress.update()
                time.sleep(0.1)
        finally:
            self.traffic_s = time.monotonic() - start
            progress.done()

    def _stop(self) -> None:
        """Abort the traffic in flight, let the injected requests finish, settle, stop the server, close the
        dashboard; a Ctrl-C here skips to stopping the server."""
        server = self.server
        try:
            if self.traffic is not None and server is not None and not server.failed():
                self.traffic.stop(DRAIN_S, server)
                deadline = time.monotonic() + DRAIN_S
                while (
                    not server.failed()
                    and time.monotonic() < deadline
                    and any(j.sent_at is not None and j.result is None for j in self.injections)
                ):
                    time.sleep(0.1)
                if not server.failed():
                    time.sleep(SETTLE_S)
                if server.failed() and self.gone_s is None:
                    self._gone()
        except KeyboardInterrupt:
            pass
        finally:
            if self.traffic is not None:
                self.traffic.server_gone = self.gone_s is not None
                self.traffic.stopping.set()
            if self.recs is not None:
                self.recs.close()  # no reader of ours holds a recording while its writer closes it
            if server is not None:
                server.stop()
            if self.dash is not None:
                with contextlib.suppress(KeyboardInterrupt):
                    self.dash.stop()

    def _gone(self) -> None:
        self.gone_s = time.monotonic() - self.t0
        self.exit_code = self.server.proc.poll()

    def _server_gone(self) -> str:
        """How the run ended when the server ended on its own (or never got ready); says why on stderr."""
        server = self.server
        if server is None:
            return "stopped"
        if self.o.mode == "raise" and self.recs is not None:
            first = min((v for vs in self.recs.violations().values() for v in vs), key=lambda v: v.ts, default=None)
            if first is not None:
                self.warn(f"violation at step {first.step} (request {first.rid}): [{first.invariant}] {first.message}")
                return "stopped by a violation (mode raise): SGLang's scheduler raised it, the server ended"
        if self.gone_s is None:
            return "stopped: SGLang's server never got ready"
        ready = "while starting" if self.ready_s is None else f"{self.gone_s:.1f}s after its start"
        if self.exit_code is not None:
            self.warn(f"SGLang's server failed {ready}: it exited with code {self.exit_code}")
        else:
            self.warn(f"SGLang's server failed {ready}: it logged a failed scheduler, and was stopped")
        last = server.last_error()
        if last:
            self.warn(f"its last error: {last}")
        self.warn(f"its log: {server.log_path}")
        return "stopped: SGLang's server failed" if self.ready_s is not None else "SGLang's server failed to start"

    def _summary(self, how: str) -> None:
        say = self.say
        c = self.traffic.counts if self.traffic is not None else Counts()
        ready = f" (the server was ready in {self.ready_s:.1f}s)" if self.ready_s is not None else ""
        unanswered = f", {c.running} unanswered" if c.running else ""
        say(
            f"{how} after {self.traffic_s:.1f}s of traffic{ready}: requests {c.done} done, {c.aborted} aborted at "
            f"the end, {c.failed} failed{unanswered}; tokens: {c.prompt_tokens} prompt ({c.cached_tokens} from the "
            f"prefix cache), {c.completion_tokens} generated"
        )
        for e in c.errors:
            self.warn(f"a request failed: {e}")
        if self.recs is None:
            return
        violations = self.recs.violations()
        for j in self.injections:
            if j.sent_at is None:
                self.warn(f"--inject {j.fault}@{j.at:g} never sent (the run ended {self.traffic_s:.1f}s in)")
                continue
            found = [v for vs in violations.values() for v in vs if v.rid == j.request.rid]
            seen = sorted({v.invariant for v in found})
            verdict = f"recorded: {', '.join(seen)} at step {found[0].step}" if found else "nothing recorded for it"
            answer = "" if j.result == "done" else f"; its answer: {j.result or 'none (the server ended first)'}"
            say(
                f"injected {j.fault} at {j.sent_at:.1f}s: request {j.request.rid} (expects {j.invariant}); "
                f"{verdict}{answer}"
            )
        paths = self.recs.paths()
        counts = self.recs.counts()
        self.recs.close()
        for p in paths:
            per = counts.get(p, {})
            listed = ", ".join(f"{k} {v}" for k, v in sorted(per.items())) if per else "none"
            say(f"violations ({os.path.basename(p)}): {listed}")
        for p in paths:
            say(f"recording: {p}")
        if paths:
            nexts = [f"{PROG} check {p}" for p in paths] + [f"{PROG} dashboard {' '.join(paths)}"]
            say("next: " + "\n      ".join(nexts))
        else:
            say("no recording was written")
