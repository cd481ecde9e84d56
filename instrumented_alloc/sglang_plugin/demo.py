"""``instrumented-alloc demo --engine sglang``: the demo on SGLang's real server, with this plugin inside it.

What ``run(options, recording=..., dashboard=...)`` does, in order:

1. Checks the input without starting anything: the faults (``--inject FAULT[@SECONDS]``, the plugin's faults that
   a plain server can show), the model, SGLang (the supported version, installed) and the plugin (registered in
   SGLang's ``sglang.srt.plugins`` group), the ports (SGLang's, the metrics' one per rank, the dashboard's), the
   recording directory (created, writable). A problem raises ``BadInput`` (one line; the command line exits 2)
   and leaves nothing started.
2. Writes the tiny model (``tiny_model``) into the working directory and starts ``python -m
   sglang.launch_server`` on 127.0.0.1 on the CPU, in a process group of its own (the kernel sends it SIGTERM if
   the demo dies), its output in ``server.log`` there, the plugin on (``KVALLOC_MODE``, ``KVALLOC_RECORD_DIR``,
   ``KVALLOC_METRICS_PORT``, ``KVALLOC_INJECT``; see ``config.py``) and imported from this checkout, and waits for
   its ``/health``. The hybrid model's SWA pool is as large as its full pool (``server_command`` says why).
3. Prints the metrics URL of each rank, the recording of each rank (``kvalloc-<server pid>-tp<N>-pp<N>.sqlite``,
   once it exists), and the dashboard's URL (``--dashboard``: the Streamlit app on those recordings).
4. Sends seeded traffic (``traffic.Stream``: shared prefixes, long generations) to ``/generate`` from
   ``concurrency`` threads, and each injected fault's one tagged request (``inject-<fault>-...``) at its second,
   with a progress line: requests, tokens, the violations the recordings hold so far. Until Ctrl-C (or SIGTERM,
   SIGHUP), ``duration`` seconds of traffic, ``requests`` requests, or the server's end.
5. Stops: aborts the traffic's requests in flight (SGLang's ``/abort_request``: SGLang releases them), lets the
   injected ones finish, lets the server go idle (the plugin's idle sweep runs, the recorder commits), stops the
   server (SIGTERM to it, then the process group; SIGKILL after a grace period), closes the
   dashboard, and prints a summary: requests, tokens, each injected fault and what the recordings say of its
   request, the violations per invariant of each recording, their paths, and the next command.

Exit status (returned): 0 a run that ended by its bound or Ctrl-C (faults found in record mode included); 1 the
server ended on its own: stopped by a violation (``--mode raise``), or failed (an injected fault that breaks
SGLang itself, e.g. ``swa-misaligned``, whose misaligned value SGLang's SWA tree stores and then fails on), or
never got ready; the recordings are kept either way. A scheduler that fails is seen in the server's log as well as
by the server's exit (SGLang's main process may take seconds to end after it, or not end).

Dependencies come from the composition root (``cli.py``): ``recording`` is the recording reader's class
(``exporters.recorder.Recording``), ``dashboard`` the dashboard launcher module (``check_port``, ``start``) or
None. This module imports neither.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from instrumented_alloc.sglang_plugin import faults, tiny_model, traffic
from instrumented_alloc.sglang_plugin.config import SUPPORTED_SGLANG, seconds

PROG = "instrumented-alloc"
PLUGIN = "exporters.sglang:register"  # the entry point the distribution installs
ROOT = Path(__file__).resolve().parents[2]  # what the server's processes import the plugin from (this checkout)

# The plugin's faults a plain server can show (prealloc-tail needs SGLang's PD decode side), and what they need.
FAULTS = {name: inv for name, inv in faults.FAULTS.items() if name != "prealloc-tail"}
NEEDS_SWA = frozenset({"swa-misaligned"})
# When a fault is sent without @SECONDS: FIRST_INJECT_S into the traffic, then one every INJECT_GAP_S, those that
# leave SGLang running first, then those that corrupt its free lists, then the one that ends it (SGLang's SWA tree
# fails on the misaligned length it stored).
FIRST_INJECT_S = 10.0
INJECT_GAP_S = 6.0
_ORDER = {"leak": 0, "no-release": 0, "cache-twice": 1, "double-free": 1, "swa-misaligned": 2}

START_TIMEOUT_S = 300.0  # the server's start (20-60 s on a small CPU machine)
DRAIN_S = 60.0  # at the end: the longest wait for the requests in flight
SETTLE_S = 2.0  # then idle, so that the plugin's idle sweep runs (KVALLOC_SWEEP_INTERVAL) and the recorder commits
STOP_GRACE_S = 30.0  # SIGTERM to SIGKILL
REQUEST_TIMEOUT_S = 300.0


class BadInput(ValueError):
    """Bad input: one line, nothing started (exit 2 on the command line)."""


@dataclass(frozen=True)
class Options:
    model: str = "swa"
    page_size: int = 16
    max_total_tokens: int = 4096
    tp_size: int = 1
    seed: int = 0
    mode: str = "record"
    inject: tuple = ()
    duration: float | None = None
    requests: int | None = None
    concurrency: int = 8
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    record_dir: str | None = None
    workdir: str | None = None
    sglang_port: int | None = None
    dashboard_port: int = 8501
    start_timeout: float = START_TIMEOUT_S


@dataclass
class Injection:
    fault: str
    at: float  # seconds into the traffic
    request: traffic.Request | None = None
    sent_at: float | None = None
    result: str | None = None  # "done" or why not

    @property
    def invariant(self) -> str:
        return FAULTS[self.fault]


# -- input -----------------------------------------------------------------------------------------------------------
def plan(specs, *, model: str) -> list[Injection]:
    """``FAULT[@SECONDS]`` values -> injections in time order. Raises ``BadInput``."""
    parsed = []
    for text in specs:
        name, sep, at_s = text.partition("@")
        if name not in FAULTS:
            extra = " (it needs SGLang's PD decode side)" if name in faults.FAULTS else ""
            raise BadInput(f"unknown fault {name!r}{extra}; known with --engine sglang: {', '.join(FAULTS)}")
        if name in NEEDS_SWA and model != "swa":
            raise BadInput(f"fault {name} needs the hybrid sliding-window model (--model swa)")
        at = None
        if sep:
            at = seconds(at_s)
            if at is None:
                raise BadInput(f"{text!r}: the time after @ must be a number of seconds >= 0, got {at_s!r}")
        if any(p[0] == name for p in parsed):
            raise BadInput(f"--inject {name} is given twice (one tagged request per fault)")
        parsed.append((name, at))
    auto = sorted((p for p in parsed if p[1] is None), key=lambda p: _ORDER[p[0]])
    out = [Injection(name, at) for name, at in parsed if at is not None]
    out += [Injection(name, FIRST_INJECT_S + i * INJECT_GAP_S) for i, (name, _) in enumerate(auto)]
    return sorted(out, key=lambda j: j.at)


def _check_options(o: Options) -> None:
    if o.mode not in ("record", "raise"):
        raise BadInput(f"--mode {o.mode} with --engine sglang: the plugin runs in record or raise mode")
    if o.model not in tiny_model.KINDS:
        raise BadInput(f"--model {o.model!r}: expected one of {', '.join(tiny_model.KINDS)}")
    for flag, value, low in (
        ("--page-size", o.page_size, 1),
        ("--max-total-tokens", o.max_total_tokens, 1),
        ("--tp-size", o.tp_size, 1),
        ("--concurrency", o.concurrency, 1),
    ):
        if value < low:
            raise BadInput(f"{flag} must be >= {low}, got {value}")
    if o.duration is not None and not o.duration > 0:
        raise BadInput(f"--duration must be > 0 seconds, got {o.duration:g}")
    if o.requests is not None and o.requests < 1:
        raise BadInput(f"--requests must be >= 1, got {o.requests}")
    if o.max_total_tokens < o.page_size * 16:
        raise BadInput(f"--max-total-tokens {o.max_total_tokens}: at least 16 pages ({o.page_size * 16} tokens)")
    if o.tp_size > 1 and len(_cpus()) < o.tp_size and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        raise BadInput(f"--tp-size {o.tp_size}: one CPU core per rank, and this process may use {len(_cpus())}")


def _check_sglang() -> None:
    from importlib.metadata import PackageNotFoundError, entry_points, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        msg = f"--engine sglang needs sglang {SUPPORTED_SGLANG}; SGLang is not installed (make setup)"
        raise BadInput(msg) from None
    if found != SUPPORTED_SGLANG:
        raise BadInput(f"--engine sglang needs sglang {SUPPORTED_SGLANG}; this is sglang {found}")
    if not any(ep.value == PLUGIN for ep in entry_points(group="sglang.srt.plugins")):
        raise BadInput(
            "the plugin is not registered with SGLang (no sglang.srt.plugins entry point): install this "
            "distribution (pip install -e .)"
        )


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_port(flag: str, port: int, addr: str = "127.0.0.1") -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as exc:
            raise BadInput(f"{flag}: port {port} on {addr} is taken ({exc.strerror or exc}): choose another") from None


def _free_run(n: int, addr: str) -> int:
    """A port p with p .. p + n - 1 free on ``addr`` (one per rank)."""
    for _ in range(50):
        p = _free_port()
        if p + n - 1 > 65535:
            continue
        try:
            for q in range(p, p + n):
                _check_port("", q, addr)
        except BadInput:
            continue
        return p
    raise BadInput(f"--metrics-port 0: found no {n} consecutive free ports on {addr}")


def _usable_dir(flag: str, path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise BadInput(f"{flag} {path}: {exc.strerror or exc}") from None
    return path


# -- the server ------------------------------------------------------------------------------------------------------
def _pdeathsig():
    """A preexec function that has the kernel send SIGTERM to the server when this process dies (Linux), so that
    a demo killed outright leaves no server behind; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig():
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG

    return set_pdeathsig


class Server:
    """``python -m sglang.launch_server`` in a process group of its own, its output in a log file."""

    def __init__(self, argv: list, env: dict, cwd: str, log_path: str):
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_pdeathsig(),
            )  # fmt: skip
        self._log_pos = 0
        self._log_tail = ""
        self._failed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, base: str) -> bool:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to the server (SGLang stops its schedulers, which close their recordings), then to its process
        group, then SIGKILL; a Ctrl-C meanwhile goes straight to SIGKILL. Returns with the group gone (or only
        zombies left in it)."""
        try:
            if self.alive():
                self._signal(signal.SIGTERM, group=False)
                if not self._wait_exit(grace * 2 / 3):
                    self._signal(signal.SIGTERM, group=True)
                    if not self._wait_exit(grace / 3):
                        self._signal(signal.SIGKILL, group=True)
            self._wait_group(5.0)
        except KeyboardInterrupt:
            pass
        self._signal(signal.SIGKILL, group=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def _signal(self, sig, *, group: bool) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.proc.pid, sig)
            elif self.alive():
                os.kill(self.proc.pid, sig)

    def _wait_exit(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def _wait_group(self, timeout: float) -> None:
        """Until no process of the server's group is left (its schedulers exit after it), or ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)

    # What SGLang 0.5.23 logs when a scheduler fails: its main process may then take seconds to end (or hang in
    # its crash dump), so the demo watches the log too.
    FAILED = ("Scheduler hit an exception", "SIGQUIT received", "Received sigquit from a child process")

    def failed(self) -> bool:
        """Whether the server ended or logged that a scheduler failed (read incrementally from the log)."""
        if self._failed or not self.alive():
            return True
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_pos)
                chunk = f.read()
        except OSError:
            return False
        text = self._log_tail + chunk.decode(errors="replace")
        self._log_pos += len(chunk)
        self._log_tail = text[-200:]
        self._failed = any(m in text for m in self.FAILED)
        return self._failed

    def last_error(self) -> str | None:
        """The last exception line SGLang logged (its scheduler's traceback ends with it), if any."""
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return None
        found = re.findall(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Violation|Exit)\w*: .*$", text, re.M)
        return found[-1].strip() if found else None


def server_command(o: Options, model_dir: str, port: int) -> list:
    # The hybrid model's SWA pool as large as its full pool: on the CPU, SGLang's torch_native attention reads an
    # SWA layer's KV at the request's full-pool slots, and with SGLang's default ratio (0.8) the first full slot past
    # the SWA pool's size ends the scheduler with an IndexError (traffic that fills most of the pool reaches it).
    swa = ["--swa-full-tokens-ratio", "1"] if o.model == "swa" else []
    return [
        sys.executable, "-m", "sglang.launch_server",
        *swa,
        "--model-path", model_dir,
        "--load-format", "dummy",
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--disable-cuda-graph",
        "--page-size", str(o.page_size),
        "--max-total-tokens", str(o.max_total_tokens),
        "--tp-size", str(o.tp_size),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--log-level", "warning",
    ]  # fmt: skip


def server_env(o: Options, record_dir: str, metrics_port: int | None, injections) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVALLOC_", "PROMETHEUS_MULTIPROC"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", KVALLOC_MODE=o.mode, KVALLOC_RECORD_DIR=record_dir)
    env.setdefault("SGLANG_SWA_EVICTION_INTERVAL", "16")  # the window evicts often: the demo's SWA traffic
    if metrics_port is not None:
        env["KVALLOC_METRICS_PORT"] = str(metrics_port)
        env["KVALLOC_METRICS_ADDR"] = o.metrics_addr
    if injections:
        env["KVALLOC_INJECT"] = ",".join(j.fault for j in injections)
        # SGLang's own idle leak check would end the scheduler at the first injected leak; it logs instead.
        env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "0"
    if o.tp_size > 1 and not env.get("SGLANG_CPU_OMP_THREADS_BIND"):
        cpus = _cpus()
        share = len(cpus) // o.tp_size
        groups = [cpus[i * share : (i + 1) * share] for i in range(o.tp_size)]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(map(_cpulist, groups))
    return env


def _cpulist(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the kernel's cpu list format, as SGLANG_CPU_OMP_THREADS_BIND takes it)."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# -- traffic ---------------------------------------------------------------------------------------------------------
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


# -- signals ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _stop_signals():
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


# -- the run ---------------------------------------------------------------------------------------------------------
def run(o: Options, *, recording, dashboard=None, out=None, err=None) -> int:
    """The demo (see the module contract). ``BadInput`` before anything started."""
    out = out or sys.stdout
    err = err or sys.stderr
    injections = plan(o.inject, model=o.model)
    _check_options(o)
    _check_sglang()
    port = o.sglang_port or _free_port()
    if o.sglang_port:
        _check_port("--sglang-port", port)
    metrics_port = o.metrics_port
    if metrics_port == 0:
        metrics_port = _free_run(o.tp_size, o.metrics_addr)
    elif metrics_port is not None:
        if metrics_port + o.tp_size - 1 > 65535:
            raise BadInput(f"--metrics-port {metrics_port}: one port per rank, up to {metrics_port + o.tp_size - 1}")
        for r in range(o.tp_size):
            _check_port("--metrics-port" + (f" (rank {r})" if o.tp_size > 1 else ""), metrics_port + r, o.metrics_addr)
        if port in range(metrics_port, metrics_port + o.tp_size):
            raise BadInput(f"--metrics-port {metrics_port}: SGLang's server listens on {port}")
    if dashboard is not None:
        try:
            dashboard.check_port(o.dashboard_port)
        except OSError as exc:
            raise BadInput(f"--dashboard: {exc}") from None
    record_dir = _usable_dir("--record-dir", o.record_dir) if o.record_dir else None
    workdir = _usable_dir("--workdir", o.workdir) if o.workdir else tempfile.mkdtemp(prefix="kvalloc-sglang-demo-")
    record_dir = record_dir or _usable_dir("--record-dir", os.path.join(workdir, "recordings"))
    stream = traffic.Stream(o.seed)
    for j in injections:
        j.request = stream.tagged(faults.tag(j.fault))

    model_dir = tiny_model.write(os.path.join(workdir, f"model-{o.model}"), o.model)
    window = f", sliding window {tiny_model.WINDOW} every other layer" if o.model == "swa" else ""
    print(f"model: tiny {o.model} (dummy weights{window}) in {model_dir}; page size {o.page_size}", file=out)
    with _stop_signals():
        return _Run(o, injections, stream, recording, dashboard, out, err).run(
            port, metrics_port, workdir, model_dir, record_dir
        )


class _Run:
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
