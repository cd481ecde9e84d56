"""``instrumented-alloc demo --engine sglang``: one real run of the demo on SGLang's server on the CPU (a leak and a
double free injected, the metrics scraped while it runs, the recording, the summary, the exit code, nothing left
running), and the bad input it refuses before it starts anything (one line, exit 2)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

from instrumented_alloc import cli
from instrumented_alloc.sglang_plugin import faults, traffic
from tests.sglang import harness

pytestmark = pytest.mark.sglang

ROOT = harness.ROOT
SEED = 3
SAMPLE = re.compile(r"^([\w:]+)\{([^}]*)\} (\S+)$", re.M)


def _demo_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "instrumented_alloc.cli", "demo", "--engine", "sglang", *map(str, args)]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("KVALLOC_", "OTEL_", "PROMETHEUS_"))}


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    return [(dict(re.findall(r'(\w+)="([^"]*)"', m[2])), float(m[3])) for m in SAMPLE.finditer(text) if m[1] == name]


class Demo:
    """The demo in a process of its own, its output (stdout and stderr together) read line by line as it comes."""

    def __init__(self, args: list, deadline: float):
        self.proc = subprocess.Popen(
            _demo_cmd(*args), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        # A demo that never ends is stopped as a service manager would (SIGTERM: it stops its server first).
        self.watchdog = threading.Timer(deadline, self.proc.terminate)
        self.watchdog.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str) -> re.Match:
        """The first output line matching ``pattern``, once printed (fails if the demo ended without it)."""
        rx = re.compile(pattern)
        with self.changed:
            while True:
                found = next((m for m in map(rx.search, self.lines) if m), None)
                if found is not None:
                    return found
                if not self.reader.is_alive():
                    pytest.fail(
                        f"the demo ended (exit {self.proc.poll()}) without printing {pattern!r}:\n{self.output}"
                    )
                self.changed.wait(1)

    def finish(self) -> int:
        rc = self.proc.wait()
        self.reader.join()
        self.watchdog.cancel()
        return rc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One demo run: 12 s of traffic from 4 threads, a leak at 2 s and a double free at 5 s, metrics on a free
    port, the recording in its own directory. The metrics are scraped while the traffic runs."""
    harness.need_sglang()
    tmp = tmp_path_factory.mktemp("demo")
    rec_dir, work = tmp / "recordings", tmp / "work"
    args = ["--duration", 12, "--concurrency", 4, "--seed", SEED, "--inject", "leak@2", "--inject", "double-free@5"]
    args += ["--metrics-port", 0, "--record-dir", rec_dir, "--workdir", work]
    demo = Demo(args, deadline=180)
    try:
        url = demo.wait_for(r"^metrics: (http://127\.0\.0\.1:\d+/metrics) \(tp0\)$")[1]
        demo.wait_for(r"^traffic: ")
        with urllib.request.urlopen(url, timeout=10) as r:
            scraped = r.read().decode()
    finally:
        rc = demo.finish()
    pid = int(re.search(r"^sglang: starting the server on \S+ \(pid (\d+), mode record\)", demo.output, re.M)[1])
    return {"rc": rc, "out": demo.output, "scraped": scraped, "rec_dir": rec_dir, "work": work, "pid": pid}


def test_the_demo_serves_the_kvalloc_metrics_with_sglangs_labels(run):
    pages = samples(run["scraped"], "kvalloc_pages")
    assert pages, run["scraped"][:2000]
    model = str(run["work"] / "model-swa")
    for labels, _ in pages:
        assert {k: labels.get(k) for k in ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")} == {
            "model_name": model,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }, labels
    by_pool: dict[str, float] = {}
    for labels, v in pages:
        by_pool[labels["pool"]] = by_pool.get(labels["pool"], 0) + v
    # 4096 tokens at page size 16: 256 pages and page 0, in each pool (the SWA pool is as large as the full one).
    assert by_pool == {"full": 257, "swa": 257}, by_pool


def test_the_injected_faults_are_recorded_with_their_invariants_and_request_ids(run):
    from exporters.recorder import Recording

    paths = sorted(run["rec_dir"].glob("*.sqlite"))
    assert [p.name for p in paths] == [f"kvalloc-{run['pid']}-tp0-pp0.sqlite"], run["out"]
    stream = traffic.Stream(SEED)
    expected = {f: stream.tagged(faults.tag(f)).rid for f in ("leak", "double-free")}
    with Recording(paths[0]) as rec:
        assert rec.meta["engine"] == "sglang" and rec.meta["tp_rank"] == 0
        found = {(v.invariant, v.rid) for v in rec.violations()}
    assert ("request_leak", expected["leak"]) in found, (expected, sorted(found, key=str)[:20])
    assert ("double_free", expected["double-free"]) in found, (expected, sorted(found, key=str)[:20])
    for fault, rid in expected.items():
        assert f"inject: {fault} at " in run["out"] and f"request {rid} (expects {faults.FAULTS[fault]})" in run["out"]
    check = subprocess.run(
        [sys.executable, "-m", "instrumented_alloc.cli", "check", str(paths[0])],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert check.returncode == 1 and re.search(rf"^request_leak\s+\d+\s+\d+\s+{expected['leak']}\s", check.stdout, re.M)


def test_the_summary_names_the_faults_violations_and_recording_and_the_exit_code_is_0(run):
    out, path = run["out"], run["rec_dir"] / f"kvalloc-{run['pid']}-tp0-pp0.sqlite"
    assert run["rc"] == 0, out
    assert re.search(r"^ *\d+\.\d/12s \| requests \d+ done, \d+ running \| tokens \d+ generated", out, re.M), out
    m = re.search(
        r"^finished after (\d+\.\d)s of traffic \(the server was ready in [\d.]+s\): requests (\d+) done", out, re.M
    )
    assert m and 12 <= float(m[1]) < 14 and int(m[2]) > 0, out
    stream = traffic.Stream(SEED)
    for fault, inv in (("leak", "request_leak"), ("double-free", "double_free")):
        rid = stream.tagged(faults.tag(fault)).rid
        assert re.search(
            rf"^injected {fault} at \d+\.\ds: request {rid} \(expects {inv}\); recorded: (\w+, )*{inv}\b", out, re.M
        ), out
    counts = re.search(rf"^violations \({path.name}\): (.*)$", out, re.M)
    assert counts and re.search(r"\bdouble_free [1-9]", counts[1]) and re.search(r"\brequest_leak [1-9]", counts[1])
    nexts = f"next: instrumented-alloc check {path}\n      instrumented-alloc dashboard {path}"
    assert f"\nrecording: {path}\n" in out and out.endswith(nexts), out


def test_the_demo_leaves_nothing_running(run):
    with pytest.raises(ProcessLookupError):
        os.killpg(run["pid"], 0)  # the server's process group: the server, its schedulers, its detokenizer


# -- bad input: one line, exit 2, nothing started -------------------------------------------------------------------
def _one_line_error(capsys, args, *needles, workdir: Path, engine=("--engine", "sglang")):
    """``demo`` with ``args``, in this process: exit 2, one line on stderr holding ``needles``, nothing written or
    started."""
    try:
        rc = cli.main(["demo", *engine, *map(str, args), *(["--workdir", str(workdir)] if engine else [])])
    except SystemExit as exc:  # argparse's errors
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    assert out == "" and not workdir.exists()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--inject", "nope"], ["unknown fault 'nope'", "known with --engine sglang: leak, no-release"]),
        (["--inject", "prealloc-tail"], ["unknown fault 'prealloc-tail' (it needs SGLang's PD decode side)"]),
        (["--model", "dense", "--inject", "swa-misaligned"], ["fault swa-misaligned needs the hybrid", "--model swa"]),
        (["--inject", "leak@soon"], ["'leak@soon': the time after @ must be a number of seconds >= 0"]),
        (["--mode", "off"], ["--mode off with --engine sglang"]),
        (["--preset", "swa-128"], ["--preset applies to --engine sim only"]),
        (["--record", "x.sqlite"], ["--record applies to --engine sim only", "--record-dir DIR"]),
        (["--steps", "5"], ["--steps applies to --engine sim only"]),
        (["--requests", "0"], ["--requests must be >= 1, got 0"]),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, args, needles):
    _one_line_error(capsys, args, *needles, workdir=tmp_path / "work")


def test_an_unknown_engine_and_sglang_flags_without_it(tmp_path, capsys):
    work = tmp_path / "work"
    _one_line_error(capsys, ["--engine", "vllm"], "argument --engine: invalid choice: 'vllm'", workdir=work, engine=())
    _one_line_error(
        capsys, ["--record-dir", work], "--record-dir applies to --engine sglang only", workdir=work, engine=()
    )
    # The console script says the same, in one line.
    res = subprocess.run([sys.executable, "-m", "instrumented_alloc.cli", "demo", "--engine", "vllm"], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "invalid choice: 'vllm'" in res.stderr, res.stderr


def test_taken_ports_and_an_unwritable_record_dir(tmp_path, capsys, taken_port):
    harness.need_sglang()
    work = tmp_path / "work"
    for args, needle in (
        (["--sglang-port", taken_port], f"--sglang-port: port {taken_port} on 127.0.0.1 is taken"),
        (["--metrics-port", taken_port], f"--metrics-port: port {taken_port} on 127.0.0.1 is taken"),
        (["--dashboard", "--dashboard-port", taken_port], f"--dashboard: port {taken_port} on 127.0.0.1 is taken"),
    ):
        _one_line_error(capsys, args, needle, workdir=work)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    needle = f"--record-dir {blocker}/recordings: Not a directory"
    _one_line_error(capsys, ["--record-dir", blocker / "recordings"], needle, workdir=work)


def test_sglang_not_installed(tmp_path, monkeypatch, capsys):
    real = metadata.version

    def version(name):
        if name == "sglang":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    previous = signal.getsignal(signal.SIGTERM)
    needle = "instrumented-alloc demo: error: --engine sglang needs sglang 0.5.23; SGLang is not installed (make setup)"
    _one_line_error(capsys, [], needle, workdir=tmp_path / "work")
    assert signal.getsignal(signal.SIGTERM) is previous
