"""The command line, through the installed console script (real subprocesses), plus a few in-process runs
where only the result matters (the same seed gives the same recording)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from exporters.recorder import Recording
from instrumented_alloc import cli
from instrumented_alloc.events import CLOCK_FIELDS
from instrumented_alloc.sim import FAULTS, PRESETS
from tests.ctrl_c import restore_sigint
from tests.exporters.test_recorder import damaged


def _script() -> list[str]:
    exe = Path(sys.executable).with_name("instrumented-alloc")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("instrumented-alloc")
    if found is None:
        pytest.fail("the instrumented-alloc console script is not installed (pip install -e .)")
    return [found]


def _run(*args, timeout=180):
    return subprocess.run([*_script(), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def _main(capsys, *args) -> subprocess.CompletedProcess:
    """``instrumented-alloc ARGS`` in this process (the console script runs ``cli.main`` alike): what a process would
    print and exit with, without an interpreter start per case."""
    try:
        rc = cli.main([str(a) for a in args])
    except SystemExit as exc:  # argparse's own usage errors
        rc = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, out.out, out.err)


def _one_line_error(res, *needles):
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_help_lists_the_commands():
    res = _run("--help")
    assert res.returncode == 0
    for cmd in ("demo", "check", "replay", "presets"):
        assert cmd in res.stdout
    demo = _run("demo", "--help")
    assert demo.returncode == 0
    for opt in ("--preset", "--steps", "--duration", "--rate", "--seed", "--mode", "--inject", "--page-size",
                "--metrics-port", "--record", "--otlp-endpoint", "--dashboard", "--trace", "--hash-request-ids"):
        assert opt in demo.stdout


def test_presets_lists_every_preset_and_fault():
    res = _run("presets")
    assert res.returncode == 0
    for name in PRESETS:
        assert f"{name}: " in res.stdout
    assert "window=128" in res.stdout and "window=1024" in res.stdout
    for f in FAULTS.values():
        assert f"{f.name}: " in res.stdout and f.invariant in res.stdout


def test_unknown_command_is_a_usage_error():
    _one_line_error(_run("no-such-command"), "invalid choice")


def test_bad_input_gets_one_line_and_exit_2(tmp_path, taken_port, capsys):
    bad_trace = tmp_path / "bad.jsonl"
    bad_trace.write_text('{"arrival": 0, "prompt_len": 10, "output_len": 5}\n{"arrival": 1, "prompt_len": -3}\n')
    not_rec = tmp_path / "notes.txt"
    not_rec.write_text("hello\n")
    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    binary_trace = tmp_path / "bin.jsonl"
    binary_trace.write_bytes(b"\xff\xfe{}\n")
    negative_trace = tmp_path / "neg.jsonl"
    negative_trace.write_text('{"arrival": -1, "prompt_len": 100, "output_len": 20}\n')
    huge_trace = tmp_path / "huge.jsonl"  # dense: a 32,768-token pool
    huge_trace.write_text(
        '{"arrival": 0, "prompt_len": 10, "output_len": 5}\n{"arrival": 1, "prompt_len": 32760, "output_len": 9}\n'
    )
    existing = tmp_path / "run.sqlite"
    assert _run("demo", "--steps", "3", "--record", existing).returncode == 0
    cases = [
        (("demo", "--preset", "nope"), ["unknown preset 'nope'"]),
        (("demo", "--inject", "nope"), ["unknown fault 'nope'"]),
        (("demo", "--steps", "10", "--inject", "leak@10"), ["step 10 is outside the run"]),
        (("demo", "--inject", "leak@x"), ["must be an integer"]),
        (("demo", "--preset", "dense", "--inject", "swa-misaligned"), ["needs an SWA preset"]),
        (("demo", "--preset", "dense", "--page-size", "1", "--inject", "alloc-len-misaligned"), ["page size > 1"]),
        (("demo", "--page-size", "7"), ["page size 7"]),
        (("demo", "--preset", "pd-decode", "--page-size", "1"), ["page size 1 is not supported"]),
        (("demo", "--steps", "0"), ["--steps must be >= 1"]),
        (("demo", "--trace", str(tmp_path / "missing.jsonl")), ["missing.jsonl", "No such file"]),
        (("demo", "--trace", str(bad_trace)), [f"{bad_trace}:2", "missing output_len"]),
        (("demo", "--steps", "5", "--metrics-port", str(taken_port)), [f"port {taken_port}", "already in use"]),
        (("check", str(tmp_path / "nope.sqlite")), ["nope.sqlite", "no such file"]),
        (("check", str(not_rec)), ["notes.txt", "not a flight recording"]),
        (("check", str(empty)), ["empty.sqlite", "not a flight recording"]),
        (("replay", str(not_rec), "--step", "1"), ["not a flight recording"]),
        (("demo", "--trace", str(binary_trace)), [f"trace {binary_trace}: not UTF-8 text"]),
        (("demo", "--trace", str(negative_trace)), [f"{negative_trace}:1: arrival must be >= 0 steps, got -1"]),
        (("demo", "--trace", str(huge_trace)), [f"{huge_trace}:2: prompt_len + output_len = 32769 tokens", "(32768"]),
        (("demo", "--steps", "5", "--otlp-endpoint", "notaurl"), ["--otlp-endpoint 'notaurl': expected an http://"]),
        (("demo", "--steps", "5", "--otlp-endpoint", "ftp://x"), ["--otlp-endpoint 'ftp://x': expected an http://"]),
        (("demo", "--steps", "5", "--max-bytes", "-5"), ["--max-bytes must be >= 1, got -5"]),
        (("demo", "--steps", "5", "--max-bytes", "4096"), ["--max-bytes needs --record"]),
        (("demo", "--steps", "3", "--record", str(existing)), ["a recording exists there (--overwrite replaces it)"]),
        (("dashboard", "--dir", str(tmp_path), "--refresh", "0.5"), ["--refresh must be >= 1 second, got 0.5"]),
        (("dashboard", "--dir", str(tmp_path), "--port", str(taken_port)), [f"port {taken_port} on 127.0.0.1 is"]),
    ]
    for args, needles in cases:
        # In this process, but the dashboard's (which would start one) and one demo case through the console script.
        in_process = args[0] != "dashboard" and args[:2] != ("demo", "--trace")
        _one_line_error(_main(capsys, *args) if in_process else _run(*args), *needles)
    # The port's message as serve() words it, without the "[Errno 98]" of the OSError's str().
    res = _main(capsys, "demo", "--steps", "5", "--metrics-port", str(taken_port))
    assert res.stderr.startswith(f"instrumented-alloc demo: error: metrics port {taken_port} on 127.0.0.1 is already")


@pytest.mark.parametrize(
    ("module", "args", "extra"),
    [
        ("exporters.prometheus", ["--metrics-port", "0"], "prometheus"),
        ("exporters.otel", ["--otlp-endpoint", "http://127.0.0.1:9/v1/traces"], "otel"),
        ("streamlit", ["--record", "{tmp}/r.sqlite", "--dashboard", "--dashboard-port", "0"], "dashboard"),
    ],
)
def test_a_missing_extra_is_named(tmp_path, monkeypatch, capsys, module, args, extra):
    # The base package needs torch and numpy only: an exporter whose optional dependency is not installed is bad
    # input naming the extra to install (exit 2, one line), never a traceback or a URL that will not answer.
    monkeypatch.setitem(sys.modules, module, None)  # imports of it fail as if it were not installed
    rc = cli.main(["demo", "--steps", "3", *(a.replace("{tmp}", str(tmp_path)) for a in args)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("instrumented-alloc demo: error: ") and f"pip install 'instrumented-alloc[{extra}]'" in err
    if extra == "dashboard":
        monkeypatch.setitem(sys.modules, module, None)
        assert cli.main(["dashboard", "--dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("instrumented-alloc dashboard: error: needs the dashboard extra") and "http" not in err


def test_a_fault_that_never_fired_is_said(tmp_path):
    # Asked for at the run's last step, where pd-decode has no request to free twice: said on stderr, not silent.
    res = _run("demo", "--preset", "pd-decode", "--steps", "300", "--inject", "double-free@299")
    assert res.returncode == 0, res.stderr
    assert "instrumented-alloc: warning: --inject double-free@299 never fired" in res.stderr
    assert "violations: none" in res.stdout and "injected double-free" not in res.stdout


def test_a_clean_run_checks_clean_and_replays(tmp_path):
    rec = tmp_path / "clean.sqlite"
    res = _run("demo", "--preset", "swa-128", "--steps", "600", "--record", rec)
    assert res.returncode == 0, res.stderr
    assert f"recording: {rec}" in res.stdout
    assert "finished after 600 steps" in res.stdout and "violations: none" in res.stdout
    chk = _run("check", rec)
    assert chk.returncode == 0, chk.stderr
    assert chk.stdout.startswith(f"clean: no violations in {rec}")
    rp = _run("replay", rec, "--step", "300", "--requests", "3")
    assert rp.returncode == 0, rp.stderr
    assert f"{rec} at step 300 (preset swa-128, page size 16, window 128)" in rp.stdout
    assert "\nfull " in rp.stdout and "\nswa " in rp.stdout and "kv_allocated_len" in rp.stdout
    # The replayed figures are the recorded state's: compare the pool line with the recording read directly.
    state = Recording(rec).state_at(300)
    used = int((state.owners["full"] >= 0).sum())
    full_line = next(line for line in rp.stdout.splitlines() if line.startswith("full "))
    assert full_line.split()[3] == str(used)
    _one_line_error(_run("replay", rec, "--step", "100000"), "outside the recording (steps 0..")


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_injected_fault_is_reported_by_check_with_its_invariant(tmp_path, fault, capsys):
    rec = tmp_path / f"{fault}.sqlite"
    # In this process (the console script runs cli.main alike; the other tests here start it).
    res = _main(capsys, "demo", "--preset", "swa-128", "--steps", "700", "--inject", f"{fault}@300", "--record", rec)
    assert res.returncode == 0, res.stderr
    inv = FAULTS[fault].invariant
    assert f"injected {fault} at step " in res.stdout and f"(expects {inv})" in res.stdout
    fired = int(res.stdout.split(f"injected {fault} at step ")[1].split(":")[0])
    assert fired >= 300
    chk = _main(capsys, "check", rec)
    assert chk.returncode == 1, chk.stdout + chk.stderr
    rows = chk.stdout.splitlines()
    assert rows[1].split()[:3] == ["invariant", "count", "first"]
    first = rows[2].split()
    # The table is ordered by first step: the injected mistake heads it, at the step it fired.
    assert first[0] == inv
    assert int(first[2]) == fired
    assert next(v.invariant for v in Recording(rec).violations()) == inv


def test_raise_mode_stops_with_the_violation_and_records_it(tmp_path):
    rec = tmp_path / "raise.sqlite"
    res = _run("demo", "--preset", "swa-128", "--steps", "800", "--mode", "raise", "--inject",
               "swa-misaligned@200", "--record", rec)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert "violation at step" in res.stderr and "swa_evicted_seqlen_page_aligned" in res.stderr
    assert "stopped by a violation (mode raise)" in res.stdout
    vs = Recording(rec).violations()
    assert [v.invariant for v in vs] == ["swa_evicted_seqlen_page_aligned"]
    assert vs[0].step >= 200


def _events(path):
    out = []
    for e in Recording(path).events():
        d = {f.name: getattr(e, f.name) for f in dataclasses.fields(e) if f.name not in CLOCK_FIELDS}
        if "violation" in d:
            d["violation"] = dataclasses.replace(d["violation"], ts=0.0)
        out.append((type(e).__name__, {k: v.tolist() if hasattr(v, "tolist") else v for k, v in d.items()}))
    return out


def test_same_seed_gives_the_same_recording(tmp_path, capsys):
    paths = []
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        p = tmp_path / f"{name}.sqlite"
        assert cli.main(["demo", "--preset", "pd-decode", "--steps", "300", "--seed", str(seed),
                         "--inject", "leak@100", "--record", str(p)]) == 0
        paths.append(p)
    capsys.readouterr()
    a, b, c = (_events(p) for p in paths)
    assert len(a) > 500
    assert a == b
    assert a != c


def test_a_trace_drives_the_demo(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival": i * 2, "prompt_len": 100 + i, "output_len": 20}) + "\n"
                             for i in range(20)))
    res = _run("demo", "--steps", "200", "--trace", trace)
    assert res.returncode == 0, res.stderr
    assert "20 requests arrived, 20 admitted, 20 finished" in res.stdout


def _start(*args):
    return subprocess.Popen([*_script(), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=restore_sigint)


def _wait_line(proc, prefix, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line.strip()
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {prefix!r} line; stderr: {proc.stderr.read()}")


def test_ctrl_c_stops_cleanly_and_closes_the_recording(tmp_path):
    rec = tmp_path / "live.sqlite"
    proc = _start("demo", "--preset", "dense", "--record", rec, "--metrics-port", "0")
    try:
        url = _wait_line(proc, "metrics: ").split(" ", 1)[1]
        _wait_line(proc, "recording: ")
        # Unbounded and paced: metrics are served while it runs.
        deadline = time.monotonic() + 30
        while True:
            body = urllib.request.urlopen(url, timeout=10).read().decode()
            if 'kvalloc_pages{engine="demo",pool="full",state="used"}' in body and "kvalloc_requests_live" in body:
                break
            assert time.monotonic() < deadline, body[:2000]
            time.sleep(0.5)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "stopped (Ctrl-C) after" in out
    meta = Recording(rec).meta
    assert meta["preset"] == "dense" and "end_time" in meta
    assert _run("check", rec).returncode == 0


def test_ctrl_c_inside_an_allocator_call_takes_effect_at_the_steps_end(tmp_path, monkeypatch, capsys):
    # SIGINT lands in the middle of an allocator call: the inner allocator has handed out its pages, the wrapper is
    # about to mirror them in its shadow. Raised there, the KeyboardInterrupt left the two apart and the shutdown
    # sweep reported pool_conservation on a clean run; now the step finishes first, and the run stops clean.
    import os

    import instrumented_alloc.sim as sim

    real_build = sim.build_engine
    fired = []

    def build_engine(*args, **kwargs):
        engine = real_build(*args, **kwargs)
        shadow = engine.alloc._w_st.full.shadow
        on_alloc = shadow.on_alloc

        def interrupted(*a, **kw):
            if engine.step_no >= 40 and not fired:
                fired.append(engine.step_no)
                os.kill(os.getpid(), signal.SIGINT)  # its handler runs here, before the shadow is updated
            return on_alloc(*a, **kw)

        shadow.on_alloc = interrupted
        return engine

    monkeypatch.setattr(sim, "build_engine", build_engine)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever pytest inherited
    try:
        rec = tmp_path / "interrupted.sqlite"
        assert cli.main(["demo", "--preset", "swa-128", "--steps", "400", "--record", str(rec)]) == 0
    finally:
        signal.signal(signal.SIGINT, previous)
    out = capsys.readouterr().out
    assert len(fired) == 1
    assert f"stopped (Ctrl-C) after {fired[0] + 1} steps" in out and "violations: none" in out, out
    assert cli.main(["check", str(rec)]) == 0
    assert signal.getsignal(signal.SIGINT) is previous


def test_a_dashboard_port_in_time_wait_is_free_and_a_listened_one_is_not():
    # A dashboard just stopped leaves its browser's connections in TIME-WAIT on the port for a minute; the app's
    # server binds it regardless (SO_REUSEADDR), so the check must too (it refused the README's next command).
    from dashboard import launch

    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the app's server (tornado) binds
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the server's side closes first: its end of the connection goes to TIME-WAIT
        client.close()
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is taken"):
            launch.check_port(port)  # the listener is still there
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # the control: without SO_REUSEADDR the TIME-WAIT entry blocks a bind
    assert launch.check_port(port) == port


def test_a_dashboard_that_cannot_start_leaves_the_recording_untouched(tmp_path, taken_port):
    rec = tmp_path / "incident.sqlite"
    assert _run("demo", "--preset", "pd-decode", "--steps", "120", "--inject", "double-free@60", "--record",
                rec).returncode == 1 or rec.exists()
    before = rec.read_bytes()
    res = _run("demo", "--steps", "5", "--record", rec, "--overwrite", "--dashboard", "--dashboard-port",
               str(taken_port))
    _one_line_error(res, f"--dashboard: port {taken_port} on 127.0.0.1 is taken")
    assert rec.read_bytes() == before  # bad input: nothing written, the incident still there
    assert _run("check", rec).returncode == 1


def test_check_says_how_many_violations_retention_deleted(tmp_path, capsys):
    # A corrupted pool violates at every step: under --max-bytes the recording keeps the first 100 violations and
    # the newest within a share of the bound, and check says how many more there were.
    rec = tmp_path / "bounded.sqlite"
    cli.main(["demo", "--preset", "pd-decode", "--steps", "1500", "--inject", "double-free@300", "--record",
              str(rec), "--max-bytes", "400000"])
    capsys.readouterr()
    with Recording(rec) as r:
        kept, dropped = len(r.violations()), int(r.meta["violations_dropped"])
    assert kept > 100 and dropped > 0
    assert rec.stat().st_size <= 1.25 * 400000
    assert cli.main(["check", str(rec)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{kept} violations of ")
    assert out[1] == (
        f"  and {dropped} more that retention deleted (the run's first 100 and the newest are kept; the counts "
        "below are of those kept)"
    )


def test_demo_hash_request_ids(tmp_path, capsys, otel_env):
    """--hash-request-ids: the recording and the spans hold pseudonyms only, the same ones (one hasher for the run),
    and the metadata names the scheme; the raw ids the engine used appear nowhere in the file."""
    from tests.otlp_receiver import Receiver

    otel_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    rec = tmp_path / "hashed.sqlite"
    with Receiver() as rx:
        assert cli.main(["demo", "--preset", "swa-128", "--steps", "300", "--inject", "leak@100", "--record", str(rec),
                         "--otlp-endpoint", rx.base, "--hash-request-ids"]) == 0
        out = capsys.readouterr().out
        assert "request ids: hashed (HMAC-SHA256, a random key for this run) in the recording and the spans" in out
        assert rx.wait_for(lambda r: len(r.request_spans()) > 0)
        span_ids = set(rx.request_spans())
    with Recording(rec) as r:
        assert r.meta["request_ids"] == {"scheme": "hmac-sha256", "prefix": "h:", "hex_digits": 16,
                                         "text": "str; int as decimal; else repr"}
        released = {e.rid for e in r.events() if type(e).__name__ == "RequestReleased"}
        (leak,) = [v for v in r.violations() if v.invariant == "request_leak"]
        texts = [repr(e) for e in r.events()] + [repr(v) for v in r.violations()]
        mid = r.state_at(150)
        texts += [repr(mid.ledger), repr(mid.slot_rids)]
    assert len(released) > 10 and all(isinstance(x, str) and len(x) == 18 and x.startswith("h:") for x in released)
    assert span_ids and span_ids <= released | {leak.rid}  # the same pseudonyms in the spans and the recording
    assert leak.rid.startswith("h:") and leak.message.startswith(f"request {leak.rid!r} released while still owning")
    # The demo's raw ids ("r0", "r1", ...: instrumented_alloc.sim.workload) appear nowhere in what the file holds.
    import re

    assert mid.ledger and all(k.startswith("h:") for k in mid.ledger)
    assert not any(re.search(r"'r\d+'", text) for text in texts)
    assert any(re.search(r"'h:[0-9a-f]{16}'", text) for text in texts)


def test_check_and_replay_of_a_damaged_recording_say_one_line_and_exit_2(tmp_path, capsys):
    # Values of the wrong type, a meta table without kinds, a damaged snapshot, a table without a column, missing
    # blocks: check and replay printed a traceback and exited 1 (for check: "violations found"), or printed the
    # state of another step.
    import sqlite3

    good = tmp_path / "good.sqlite"
    assert cli.main(["demo", "--preset", "swa-128", "--steps", "160", "--record", str(good), "--inject",
                     "leak@30"]) == 0  # fmt: skip
    assert cli.main(["check", str(good)]) == 1
    assert cli.main(["replay", str(good), "--step", "150"]) == 0
    capsys.readouterr()
    with sqlite3.connect(good) as c:
        blocks = [s for (s,) in c.execute("SELECT seq FROM blocks WHERE step >= 100 AND last_step < 150 ORDER BY seq")]
    assert blocks
    cases = [
        ("check", "DELETE FROM meta WHERE key = 'kinds'", "unusable flight recording: no kinds in its meta table"),
        ("check", "INSERT OR REPLACE INTO meta VALUES ('violations_dropped', '\"many\"')",
         "unusable flight recording: meta violations_dropped is not an int >= 0: 'many'"),
        ("check", "UPDATE violations SET step = 'abc' WHERE seq = (SELECT min(seq) FROM violations)",
         "a violation row holds values the recorder never writes"),
        ("replay", "DELETE FROM meta WHERE key = 'page_size'", "unusable flight recording: no page_size in its meta"),
        ("replay", "UPDATE meta SET value = '\"x\"' WHERE key = 'sliding_window'",
         "unusable flight recording: meta sliding_window is not null or an int >= 1: 'x'"),
        ("replay", "ALTER TABLE violations DROP COLUMN trace_id",
         "cannot read the recording (no such column: trace_id)"),
        ("replay", "UPDATE snapshots SET ledger = CAST('R[1,2]' AS BLOB) WHERE step = 100",
         "the snapshot at seq "),
        ("replay", f"DELETE FROM blocks WHERE seq = {blocks[0]}", f"the events of seq {blocks[0]}.."),
    ]  # fmt: skip
    for command, sql, needle in cases:
        bad = damaged(good, tmp_path, sql)
        args = [command, str(bad)] + (["--step", "150"] if command == "replay" else [])
        assert cli.main(args) == 2, (sql, capsys.readouterr())
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"instrumented-alloc {command}: error: {bad}: {needle}"), err
