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

This module checks the input and starts the run; the server's lifecycle is in ``demo_server``, the traffic, the
recordings and the progress line in ``demo_traffic``, the run and its summary in ``demo_run``.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from dataclasses import dataclass

from instrumented_alloc.sglang_plugin import faults, tiny_model, traffic
from instrumented_alloc.sglang_plugin.config import SUPPORTED_SGLANG, seconds
from instrumented_alloc.sglang_plugin.demo_run import DRAIN_S, PROG, SETTLE_S, DemoRun, stop_signals
from instrumented_alloc.sglang_plugin.demo_server import (
    ROOT,
    STOP_GRACE_S,
    Server,
    server_command,
    server_env,
    usable_cpus,
)
from instrumented_alloc.sglang_plugin.demo_traffic import (
    REQUEST_TIMEOUT_S,
    Counts,
    Progress,
    Recordings,
    Traffic,
    generate,
    inject,
)

__all__ = [
    "DRAIN_S",
    "FAULTS",
    "FIRST_INJECT_S",
    "INJECT_GAP_S",
    "PROG",
    "REQUEST_TIMEOUT_S",
    "ROOT",
    "SETTLE_S",
    "START_TIMEOUT_S",
    "STOP_GRACE_S",
    "BadInput",
    "Counts",
    "Injection",
    "Options",
    "Progress",
    "Recordings",
    "Server",
    "Traffic",
    "generate",
    "inject",
    "plan",
    "run",
    "server_command",
    "server_env",
]

PLUGIN = "exporters.sglang:register"  # the entry point the distribution installs

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


class BadInput(ValueError):
    """Bad input: one line, nothing started (exit 2 on the command line)."""


@dataclass(frozen=True)
class Options:
    """The ``demo --engine sglang`` options, as the command line (``cli.py``) gives them."""

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
    """One fault's tagged request: when to send it, when it was sent, and its answer (``result``, written by its
    sender thread under the run's lock)."""

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
    n_cpus = len(usable_cpus())
    if o.tp_size > 1 and n_cpus < o.tp_size and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        raise BadInput(f"--tp-size {o.tp_size}: one CPU core per rank, and this process may use {n_cpus}")


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
    with stop_signals():
        return DemoRun(o, injections, stream, recording, dashboard, out, err).run(
            port, metrics_port, workdir, model_dir, record_dir
        )
