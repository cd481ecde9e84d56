"""The command line: ``instrumented-alloc demo | dashboard | check | replay | presets``.

The composition root: the only core module that may import exporters/ and dashboard/, and only inside functions.
Exit codes: 0 success (``check``: a clean recording), 1 violations (``check``; ``demo --mode raise`` stopped by
one), 2 bad input or an unusable file (one line on stderr, never a traceback), 130 never: Ctrl-C stops a demo
cleanly (recording closed) and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time

PROG = "instrumented-alloc"
DEFAULT_UNBOUNDED_PACE = 50.0  # steps per second when the demo runs until Ctrl-C: watchable on a dashboard


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# -- demo ---------------------------------------------------------------------------------------------------------
# Flags of one engine only: (dest, flag, its value when not given).
_SIM_ONLY = (
    ("preset", "--preset", None), ("steps", "--steps", None), ("pace", "--pace", None), ("rate", "--rate", None),
    ("trace", "--trace", None), ("engine_label", "--engine-label", None), ("otlp_endpoint", "--otlp-endpoint", None),
    ("record", "--record", None), ("hash_request_ids", "--hash-request-ids", False),
    ("overwrite", "--overwrite", False), ("max_bytes", "--max-bytes", None),
)  # fmt: skip
_SGLANG_ONLY = (
    ("model", "--model", None), ("max_total_tokens", "--max-total-tokens", None), ("tp_size", "--tp-size", None),
    ("requests", "--requests", None), ("concurrency", "--concurrency", None), ("record_dir", "--record-dir", None),
    ("workdir", "--workdir", None), ("sglang_port", "--sglang-port", None),
)  # fmt: skip


def _demo_dispatch(args: argparse.Namespace) -> int:
    """``demo``: the simulated engine (``--engine sim``) or SGLang's real server (``--engine sglang``)."""
    other, engine = (_SGLANG_ONLY, "sglang") if args.engine == "sim" else (_SIM_ONLY, "sim")
    for dest, flag, unset in other:
        if getattr(args, dest) != unset:
            hint = " (the simulated engine records with --record PATH)" if dest == "record_dir" else ""
            hint = " (SGLang's server records one file per rank: --record-dir DIR)" if dest == "record" else hint
            raise UsageError(f"{flag} applies to --engine {engine} only{hint}")
    if args.engine == "sglang":
        return _demo_sglang(args)
    if args.preset is None:
        args.preset = "dense"
    if args.engine_label is None:
        args.engine_label = "demo"
    return _demo(args)


def _demo_sglang(args: argparse.Namespace) -> int:
    from instrumented_alloc.sglang_plugin import demo

    options = demo.Options(
        model=args.model or "swa",
        page_size=16 if args.page_size is None else args.page_size,
        max_total_tokens=args.max_total_tokens or 4096,
        tp_size=args.tp_size or 1,
        seed=args.seed,
        mode=args.mode,
        inject=tuple(args.inject),
        duration=args.duration,
        requests=args.requests,
        concurrency=8 if args.concurrency is None else args.concurrency,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        record_dir=args.record_dir,
        workdir=args.workdir,
        sglang_port=args.sglang_port,
        dashboard_port=args.dashboard_port,
    )
    try:
        launcher = _dashboard_launcher() if args.dashboard else None
        from exporters.recorder.reader import Recording

        return demo.run(options, recording=Recording, dashboard=launcher)
    except demo.BadInput as exc:
        raise UsageError(str(exc)) from None


def _demo(args: argparse.Namespace) -> int:
    from instrumented_alloc.invariants import InvariantViolation
    from instrumented_alloc.sim import FaultError, TraceError, build_engine, parse_trace, resolve_preset

    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if args.duration is not None and not args.duration > 0:
        raise UsageError(f"--duration must be > 0 seconds, got {args.duration}")
    if args.pace is not None and not args.pace > 0:
        raise UsageError(f"--pace must be > 0 steps per second, got {args.pace}")
    try:
        preset = resolve_preset(args.preset, page_size=args.page_size, rate=args.rate)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    trace = None
    if args.trace is not None:
        try:
            with open(args.trace, encoding="utf-8") as f:
                trace = parse_trace(f, source=args.trace, max_tokens=preset.full_tokens)
        except OSError as exc:
            raise UsageError(f"trace {args.trace}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"trace {args.trace}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except TraceError as exc:
            raise UsageError(str(exc)) from None
    try:
        engine = build_engine(
            preset, seed=args.seed, mode=args.mode, inject=args.inject, steps=args.steps, trace=trace
        )
    except FaultError as exc:
        raise UsageError(str(exc)) from None

    closers: list = []
    try:
        _attach_exporters(args, engine, preset, closers)
    except BaseException:
        for close in reversed(closers):
            close()
        raise
    pace = args.pace
    if pace is None and args.steps is None and args.duration is None:
        pace = DEFAULT_UNBOUNDED_PACE
    progress = _Progress(engine, args.steps, args.duration, sys.stderr)
    rc, how = 0, "finished"
    start = time.monotonic()
    next_at = start
    interrupt = _StepInterrupt()
    try:
        while True:
            if args.steps is not None and engine.step_no >= args.steps:
                break
            if args.duration is not None and time.monotonic() - start >= args.duration:
                break
            with interrupt:
                engine.step()
            progress.update()
            if pace:
                next_at += 1.0 / pace
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                else:
                    next_at = time.monotonic()  # behind: don't burst to catch up
    except KeyboardInterrupt:
        how = "stopped (Ctrl-C)"
    except InvariantViolation as exc:
        rc, how = 1, "stopped by a violation (mode raise)"
        progress.done()
        print(f"{PROG}: violation at step {exc.violation.step}: {exc}", file=sys.stderr)
    except AssertionError as exc:
        rc, how = 1, _crashed(engine, exc)
    progress.done()
    findings = []
    try:
        if rc == 0:
            findings = engine.shutdown()
    except KeyboardInterrupt:
        pass
    except AssertionError as exc:
        rc, how = 1, _crashed(engine, exc)
    finally:
        for close in reversed(closers):
            close()
    _summary(engine, how, findings, time.monotonic() - start)
    return rc


class _StepInterrupt:
    """Ctrl-C (SIGINT) during an engine step takes effect when the step ends: a KeyboardInterrupt raised inside an
    allocator call would leave the inner allocator changed and the wrapper's shadow not, and the shutdown sweep
    would then report violations the engine never made (``pool_conservation``, ``request_leak``). A second Ctrl-C
    in the same step interrupts at once. Outside a step (pacing sleeps) Ctrl-C interrupts at once, as before.
    Only in the main thread, and only where SIGINT has Python's default handler (a shell that ignores it for a
    background job is left alone)."""

    def __init__(self):
        self.hit = False
        self.active = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )

    def _handler(self, signum, frame):
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __enter__(self):
        if self.active:
            signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.active:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.hit and exc_type is None:
            raise KeyboardInterrupt
        return False


def _crashed(engine, exc: AssertionError) -> str:
    # The allocator's own asserts (SGLang's over-credit checks) end a run that injected faults corrupted, as they
    # would end a real engine; the recording keeps everything up to here.
    print(f"{PROG}: the allocator itself failed at step {engine.step_no}: {exc}", file=sys.stderr)
    return "stopped: the allocator failed"


def _attach_exporters(args, engine, preset, closers: list) -> None:
    alloc = engine.alloc
    if args.mode == "off" and (args.record or args.metrics_port is not None or args.otlp_endpoint):
        raise UsageError("--mode off records and exports nothing; drop --record/--metrics-port/--otlp-endpoint")
    if args.dashboard and not args.record:
        raise UsageError("--dashboard shows the live recording: give --record PATH too")
    if args.dashboard:
        # Before the recorder truncates an existing file (--overwrite): a dashboard that cannot start is bad input
        # that must leave nothing changed.
        try:
            _dashboard_launcher().check_port(args.dashboard_port)
        except OSError as exc:
            raise UsageError(f"--dashboard: {exc}") from None
    if args.max_bytes is not None and (args.max_bytes < 1 or not args.record):
        raise UsageError(
            f"--max-bytes must be >= 1, got {args.max_bytes}" if args.max_bytes < 1 else "--max-bytes needs --record"
        )
    if args.otlp_endpoint:
        import urllib.parse

        url = urllib.parse.urlsplit(args.otlp_endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise UsageError(
                f"--otlp-endpoint {args.otlp_endpoint!r}: expected an http:// or https:// URL "
                "(e.g. http://127.0.0.1:4318/v1/traces)"
            )
    hasher = None
    if args.hash_request_ids and (args.record or args.otlp_endpoint):  # metrics carry no request ids
        from instrumented_alloc.redact import RequestIdHasher

        hasher = RequestIdHasher.random()  # one key for this run, kept by nobody; shared so that ids still join
        print("request ids: hashed (HMAC-SHA256, a random key for this run) in the recording and the spans", flush=True)
    if args.metrics_port is not None:
        PrometheusExporter = _extra("exporters.prometheus", "prometheus").PrometheusExporter

        prom = PrometheusExporter(alloc, const_labels={"engine": args.engine_label})
        closers.append(prom.close)
        try:
            port = prom.serve(args.metrics_port, addr=args.metrics_addr)
        except OSError as exc:
            raise UsageError(exc.strerror or str(exc)) from None  # the message, without its "[Errno N]"
        print(f"metrics: http://{args.metrics_addr}:{port}/metrics", flush=True)
    if args.otlp_endpoint:
        OtelExporter = _extra("exporters.otel", "otel").OtelExporter

        otel = OtelExporter(alloc, endpoint=args.otlp_endpoint, hash_request_ids=hasher)
        closers.append(otel.shutdown)
        print(f"traces: OTLP/HTTP to {args.otlp_endpoint}", flush=True)
    if args.record:
        from exporters.recorder import FlightRecorder, RecorderError

        meta = {
            "preset": preset.name,
            "seed": args.seed,
            "inject": list(args.inject),
            "engine": args.engine_label,
            "preset_parameters": preset.parameters(),
        }
        try:
            rec = FlightRecorder(
                alloc, args.record, meta=meta, overwrite=args.overwrite, max_bytes=args.max_bytes,
                hash_request_ids=hasher,
            )
        except (RecorderError, OSError, ValueError) as exc:
            # The recorder speaks to Python callers; on the command line the keyword is the flag.
            message = str(exc).replace("(pass overwrite=True)", "(--overwrite replaces it)")
            raise UsageError(f"--record {args.record}: {message}") from None
        closers.append(rec.close)
        print(f"recording: {os.path.abspath(args.record)}", flush=True)
        if args.dashboard:
            _open_dashboard(args, closers)


def _open_dashboard(args, closers: list) -> None:
    start = _dashboard_launcher().start
    try:
        server = start(os.path.abspath(args.record), port=args.dashboard_port)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--dashboard: {exc}") from None
    closers.append(server.stop)
    print(f"dashboard: {server.url}", flush=True)


class _Progress:
    """A progress bar (bounded run) or status line (unbounded) on a terminal; on a pipe, a plain line now and
    then (every 10% of a bounded run, every 5 s otherwise), so logs stay readable."""

    def __init__(self, engine, steps, duration, out):
        self.engine, self.steps, self.duration, self.out = engine, steps, duration, out
        self.tty = out.isatty()
        self.start = self.last = time.monotonic()
        self.last_pct = -1
        self.shown = False

    def _line(self) -> str:
        e = self.engine
        full, swa = e.occupancy()
        occ = f"full {full:4.0%}" + (f" swa {swa:4.0%}" if e.preset.is_swa else "")
        tail = (f"occupancy {occ} | running {len(e.running):3d} waiting {len(e.waiting):3d} | "
                f"violations {e.violation_count()}")
        if self.steps:
            frac = e.step_no / self.steps
            bar = "#" * int(frac * 24)
            return f"[{bar:<24}] {frac:4.0%} step {e.step_no}/{self.steps} | {tail}"
        elapsed = time.monotonic() - self.start
        if self.duration:
            return f"{elapsed:5.1f}/{self.duration:g}s step {e.step_no} | {tail}"
        return f"step {e.step_no} ({elapsed:.0f}s) | {tail}"

    def update(self) -> None:
        now = time.monotonic()
        if self.tty:
            if now - self.last >= 0.1:
                self.last = now
                self.out.write("\r" + self._line() + "\x1b[K")
                self.out.flush()
                self.shown = True
            return
        if self.steps:
            pct = self.engine.step_no * 10 // self.steps
            if pct != self.last_pct:
                self.last_pct = pct
                print(self._line(), file=self.out, flush=True)
        elif now - self.last >= 5.0:
            self.last = now
            print(self._line(), file=self.out, flush=True)

    def done(self) -> None:
        if self.tty and self.shown:
            self.out.write("\r" + self._line() + "\x1b[K\n")
            self.out.flush()
            self.shown = False


def _summary(engine, how: str, findings, elapsed: float) -> None:
    st = engine.stats
    print(f"{how} after {st.steps} steps in {elapsed:.1f}s: {st.arrived} requests arrived, {st.admitted} admitted, "
          f"{st.finished} finished, {st.retracted} retracted, {st.rejected} rejected (queue full)")
    occ = f"peak occupancy: full pool {st.peak_occupancy:.0%}"
    if engine.preset.is_swa:
        occ += f", swa pool {st.peak_swa_occupancy:.0%}; {st.evictions} SWA evictions"
    print(occ)
    for f in engine.fired:
        print(f"injected {f.fault} at step {f.step}: {f.detail} (expects {f.invariant})")
    for inj in engine.unfired():
        # Asked for and never done (no request it could act on from its step to the end): said, so that a clean
        # run is not taken for a fault the wrapper missed.
        print(f"{PROG}: warning: --inject {inj.fault.name}@{inj.step} never fired (from step {inj.step} to the "
              "end no request gave it a chance)", file=sys.stderr)
    if engine.wrapped and engine.ledger is not None:
        counts = engine.alloc.violation_counts
        if counts:
            print("violations: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        else:
            print("violations: none")
        if findings:
            print(f"final consistency sweep: {len(findings)} findings")


# -- check / replay -----------------------------------------------------------------------------------------------
def _open_recording(path: str):
    from exporters.recorder.reader import Recording, RecordingError

    try:
        return Recording(path)
    except (RecordingError, OSError) as exc:
        raise _Unusable(str(exc)) from None


class _Unusable(Exception):
    """The recording cannot be used: one line, exit 2."""


def _check(args: argparse.Namespace) -> int:
    from exporters.recorder.reader import RecordingError
    from instrumented_alloc.invariants import INVARIANTS

    rec = _open_recording(args.recording)
    try:
        violations = rec.violations()
        span = "steps {}..{}".format(*rec.steps()) if rec.snapshot_steps() else "no steps"
        meta = rec.meta
    except RecordingError as exc:  # a file that opened but cannot be read (truncated, corrupt): it names the file
        raise _Unusable(str(exc)) from None
    except Exception as exc:  # anything else the reader raises (locked, ...)
        raise _Unusable(f"{args.recording}: {exc}") from None
    finally:
        rec.close()
    label = f"{args.recording} ({span}; preset {meta.get('preset', '-')})"
    if not violations:
        print(f"clean: no violations in {label}")
        return 0
    by_id: dict[str, list] = {}
    for v in violations:
        by_id.setdefault(v.invariant, []).append(v)
    print(f"{len(violations)} violations of {len(by_id)} invariants in {label}")
    dropped = int(meta.get("violations_dropped") or 0)
    if dropped:
        from exporters.recorder.format import FIRST_VIOLATIONS_KEPT

        print(
            f"  and {dropped} more that retention deleted (the run's first {FIRST_VIOLATIONS_KEPT} and the newest are "
            "kept; the counts below are of those kept)"
        )
    rows = [("invariant", "count", "first step", "first request", "severity")]
    for inv, vs in sorted(by_id.items(), key=lambda kv: (kv[1][0].step, kv[0])):
        f = vs[0]
        rows.append((inv, str(len(vs)), str(f.step), "-" if f.rid is None else str(f.rid), f.severity))
    _table(rows, right={1, 2})
    for inv, vs in sorted(by_id.items(), key=lambda kv: (kv[1][0].step, kv[0])):
        desc = INVARIANTS.get(inv, "")
        print(f"  {inv}: {desc}\n    first: {vs[0].message}")
    return 1


def _replay(args: argparse.Namespace) -> int:
    from instrumented_alloc.replay import to_snapshots
    from instrumented_alloc.stats import figures

    rec = _open_recording(args.recording)
    try:
        meta = rec.meta
        first, last = rec.steps()
        if not first <= args.step <= last:
            raise UsageError(f"step {args.step} is outside the recording (steps {first}..{last})")
        state = rec.state_at(args.step)
        violations = rec.violations(start=args.step, stop=args.step + 1)
    except ValueError as exc:  # RecordingError (it names the file), IncompleteHistory, a step not in the recording
        raise _Unusable(str(exc)) from None
    finally:
        rec.close()
    snaps = to_snapshots(state, page_size=meta["page_size"], sliding_window=meta.get("sliding_window"))
    fig = figures(snaps)
    print(f"{args.recording} at step {args.step} (preset {meta.get('preset', '-')}, page size {meta['page_size']}"
          + (f", window {meta['sliding_window']}" if meta.get("sliding_window") else "") + ")")
    rows = [("pool", "pages", "free", "used", "staged", "reserved", "int. frag", "ext. frag", "free runs",
             "largest run")]
    for name, p in fig["pools"].items():
        s = p["pages_by_state"]
        rows.append((name, str(sum(s.values())), str(s["free"]), str(s["used"]), str(s["staged"]),
                     str(s["reserved"]), f"{p['internal_fragmentation']:.3f}",
                     f"{p['external_fragmentation']:.3f}", str(p["free_run_count"]), str(p["largest_free_run"])))
    _table(rows, right=set(range(1, 10)))
    print(f"live requests: {fig['requests_live']}; SWA tokens outside the window: {fig['swa_outside_window_tokens']}")
    reqs = sorted(state.ledger.items(), key=lambda kv: -kv[1].allocated)
    if reqs:
        rows = [("request", "kv_allocated_len", "kv_committed_len", "swa_evicted_seqlen")]
        rows += [(str(rid), str(r.allocated), str(r.committed), str(r.evicted)) for rid, r in reqs[: args.requests]]
        _table(rows, right={1, 2, 3})
        if len(reqs) > args.requests:
            print(f"... and {len(reqs) - args.requests} more (--requests N shows more)")
    for v in violations:
        print(f"violation at this step: [{v.invariant}] {v.message}")
    return 0


def _table(rows, right=frozenset()) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())


# -- presets / dashboard --------------------------------------------------------------------------------------------
def _dashboard(args: argparse.Namespace) -> int:
    if args.refresh is not None and args.refresh < 1:
        raise UsageError(f"--refresh must be >= 1 second, got {args.refresh:g}")
    launch = _dashboard_launcher().launch
    try:
        recordings = [r for r in [args.recording, *args.more] if r is not None]
        return launch(recordings, port=args.port, directory=args.dir, refresh=args.refresh)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None


def _extra(name: str, extra: str):
    """Import the module ``name``; a missing optional dependency is bad input (exit 2) naming the extra."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise UsageError(f"needs the {extra} extra (pip install 'instrumented-alloc[{extra}]'): {exc}") from None


def _dashboard_launcher():
    """``dashboard.launch``, once streamlit is known to be installed (the app runs as ``python -m streamlit``: no
    import of it would fail before the child does)."""
    launcher = _extra("dashboard.launch", "dashboard")
    try:
        launcher.require_streamlit()
    except ImportError as exc:
        raise UsageError(f"needs the dashboard extra (pip install 'instrumented-alloc[dashboard]'): {exc}") from None
    return launcher


def _presets(args: argparse.Namespace) -> int:
    from instrumented_alloc.sim import FAULTS, PRESETS

    for p in PRESETS.values():
        print(f"{p.name}: {p.description}")
        params = p.parameters()
        del params["name"], params["description"]
        print("  " + ", ".join(f"{k}={v}" for k, v in params.items()))
    print("faults (--inject FAULT[@STEP]):")
    for f in FAULTS.values():
        needs = [w for w, b in (("an SWA preset", f.needs_swa), ("page size > 1", f.needs_pages)) if b]
        print(f"  {f.name}: {f.mistake} -> {f.invariant}" + (f" (needs {' and '.join(needs)})" if needs else ""))
    return 0


# -- parser -------------------------------------------------------------------------------------------------------
def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _port(text: str) -> int:
    v = _nonneg_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {v}")
    return v


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from instrumented_alloc.sglang_plugin import demo as sglang_demo  # its faults and times, for the help

    p = _Parser(
        prog=PROG,
        description="An invariant-checking, observable wrapper for LLM-serving KV-cache page allocators.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser(
        "demo",
        help="run the demo: a simulated engine, or SGLang's real server with the plugin (--engine sglang), with "
        "optional faults",
        description="Run the demo. --engine sim (the default): a simulated serving engine driving an instrumented "
        "reference allocator, optionally serving metrics, exporting traces and recording, with fault injection; "
        "without --steps or --duration it runs until Ctrl-C, paced for watching. --engine sglang: SGLang's real "
        "server on the CPU (a tiny model with dummy weights, python -m sglang.launch_server) with this plugin in "
        "it, seeded traffic over its HTTP API, one recording per rank, metrics per rank, faults injected into "
        "tagged requests; until Ctrl-C, --duration seconds of traffic or --requests requests.",
        epilog="Exit status: 0 the run ended (by its bound or Ctrl-C; faults found in record mode included); 1 "
        "stopped by a violation (--mode raise), or the engine failed (the simulated allocator's own assert; "
        "SGLang's server ended on its own or never got ready; its recordings are kept); 2 bad input (nothing is "
        "left running).",
    )
    demo.add_argument("--engine", choices=("sim", "sglang"), default="sim",
                      help="sim: the simulated engine (default); sglang: SGLang's real server with the plugin")
    bound = demo.add_mutually_exclusive_group()
    bound.add_argument("--steps", type=int, help="run this many engine steps (sim)")
    bound.add_argument("--duration", type=_finite,
                       help="run this many seconds (sglang: of traffic, after the server's start)")
    bound.add_argument("--requests", type=int, metavar="N", help="send this many requests (sglang)")
    demo.add_argument("--seed", type=int, default=0, help="workload and fault seed (default 0)")
    demo.add_argument("--mode", choices=("record", "raise", "off"), default="record",
                      help="record: report violations and go on; raise: stop at the first; off: no checks (sim)")
    demo.add_argument("--inject", action="append", default=[], metavar="FAULT[@WHEN]",
                      help="inject a fault (repeatable). sim: FAULT[@STEP] (see `presets`; without @STEP the seed "
                      "picks a step while the preset has traffic). sglang: FAULT[@SECONDS], one request tagged "
                      "inject-FAULT-... sent that many seconds into the traffic (default "
                      f"{sglang_demo.FIRST_INJECT_S:g}s, then every {sglang_demo.INJECT_GAP_S:g}s, a fault that ends "
                      f"SGLang last); {', '.join(sglang_demo.FAULTS)}")
    demo.add_argument("--page-size", type=int,
                      help="tokens per page (sim: 1, 16 or 64, default the preset's; sglang: default 16)")
    demo.add_argument("--metrics-port", type=_port, metavar="PORT",
                      help="serve Prometheus /metrics on this port (0: any free port); sglang: rank r on PORT + r")
    demo.add_argument("--metrics-addr", default="127.0.0.1", help="address to serve metrics on (default 127.0.0.1)")
    demo.add_argument("--dashboard", action="store_true",
                      help="open the Streamlit dashboard on the live recording(s)")
    demo.add_argument("--dashboard-port", type=_port, default=8501, help="dashboard port (default 8501)")

    sim = demo.add_argument_group("--engine sim (the simulated engine)")
    sim.add_argument("--preset", help="model preset (see `presets`; default dense)")
    sim.add_argument("--pace", type=_finite, help=f"at most this many steps per second (default: unpaced for "
                     f"--steps/--duration runs, {DEFAULT_UNBOUNDED_PACE:g} otherwise)")
    sim.add_argument("--rate", type=_finite, help="mean request arrivals per step (default: the preset's)")
    sim.add_argument("--trace", metavar="PATH", help="JSONL trace of {arrival, prompt_len, output_len} "
                     "(arrival in steps) instead of the synthetic workload")
    sim.add_argument("--engine-label", help="the `engine` const label on every metric (default demo)")
    sim.add_argument("--otlp-endpoint", metavar="URL", help="export kv.request spans over OTLP/HTTP to this URL "
                     "(e.g. http://127.0.0.1:4318/v1/traces)")
    sim.add_argument("--record", metavar="PATH", help="write a flight recording (SQLite) to PATH")
    sim.add_argument("--hash-request-ids", action="store_true",
                     help="store and export request ids as keyed pseudonyms (HMAC-SHA256 with a random key for "
                          "this run, the same in the recording and the spans)")
    sim.add_argument("--overwrite", action="store_true", help="replace an existing recording at PATH")
    sim.add_argument("--max-bytes", type=int, help="retention: keep the recording under about this many bytes")

    sgl = demo.add_argument_group("--engine sglang (SGLang's real server on the CPU, the plugin in it)")
    sgl.add_argument("--model", choices=("swa", "dense"),
                     help="the tiny model: swa, hybrid sliding window (default), or dense")
    sgl.add_argument("--max-total-tokens", type=int, metavar="N", help="SGLang's KV pool size in tokens (default 4096)")
    sgl.add_argument("--tp-size", type=int, metavar="N",
                     help="tensor-parallel ranks (default 1; one CPU core each at least), one recording each")
    sgl.add_argument("--concurrency", type=int, metavar="N", help="requests in flight (default 8)")
    sgl.add_argument("--record-dir", metavar="DIR",
                     help="write one recording per rank into DIR (default: WORKDIR/recordings); always on")
    sgl.add_argument("--workdir", metavar="DIR",
                     help="the model's files and the server's log (default: a new temporary directory, kept)")
    sgl.add_argument("--sglang-port", type=_port, metavar="PORT", help="SGLang's HTTP port (default: a free port)")
    demo.set_defaults(func=_demo_dispatch)

    dash = sub.add_parser(
        "dashboard",
        help="the Streamlit app: live view and incident review of flight recordings (127.0.0.1)",
        description="Start the Streamlit dashboard on 127.0.0.1. It opens recordings read-only, and only under "
        "--dir (default: the directory of RECORDING, else the working directory). Several RECORDINGs (e.g. one per "
        "rank) are shown side by side.",
    )
    dash.add_argument("recording", nargs="?", metavar="RECORDING", help="the flight recording selected first")
    dash.add_argument("more", nargs="*", metavar="RECORDING",
                      help="more recordings, shown side by side with the first (e.g. one per rank)")
    dash.add_argument("--port", type=_port, default=8501, help="TCP port on 127.0.0.1 (default 8501)")
    dash.add_argument("--dir", default=None, help="the directory whose recordings the dashboard may open")
    dash.add_argument("--refresh", type=_finite, default=None, help="seconds between live refreshes (default 2)")
    dash.set_defaults(func=_dashboard)

    check = sub.add_parser("check", help="list a recording's violations; exit 0 clean, 1 violations, 2 unusable",
                           description="Exit status: 0 no violations, 1 violations found, 2 the file is unusable.")
    check.add_argument("recording", help="path of a flight recording")
    check.set_defaults(func=_check)

    replay = sub.add_parser("replay", help="print a recording's pool state at a step")
    replay.add_argument("recording", help="path of a flight recording")
    replay.add_argument("--step", type=_nonneg_int, required=True, help="the step to reconstruct")
    replay.add_argument("--requests", type=_nonneg_int, default=20, help="live requests to list (default 20)")
    replay.set_defaults(func=_replay)

    presets = sub.add_parser("presets", help="list the demo presets with their parameters, and the faults")
    presets.set_defaults(func=_presets)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, _Unusable) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `instrumented-alloc presets | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
