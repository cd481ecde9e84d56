"""exporters.prometheus in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, as SGLang runs), with real processes:
ranks aggregated by prometheus_client's ``MultiProcessCollector``, label-set and server claims, the trailing
refresh, a full disk (a small tmpfs in a user namespace), the lifecycle and a fork. The scenarios run in child
processes (prometheus_client chooses multiprocess mode when first imported): those tests are marked
``integration``, and those that start several ranks also ``slow``.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from exporters.prometheus import PrometheusExporter
from instrumented_alloc import INVARIANTS
from tests.exporters.test_prometheus import CONST, REPO, make_alloc

CHILD = r"""
import json, os, sys, urllib.request
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from tests.engine_model import Req, extend_args, split_extend, t
from tests.prometheus_server import api, need_binary, query, wait_until_up
from exporters.prometheus import PrometheusExporter

rank = int(sys.argv[1])
now = [100.0]
w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
exp = PrometheusExporter(w, const_labels={"engine": "e0", "tp_rank": rank}, refresh_interval=5.0, clock=lambda: now[0])
labels = {"engine": "e0", "tp_rank": str(rank), "pool": "full", "state": "used"}
out = {"pid": os.getpid(), "multiprocess": exp.multiprocess}
reqs = [Req(f"r{rank}-{i}") for i in range(rank + 2)]  # rank + 2 requests of 2 pages each
with w.batch([r.rid for r in reqs]):
    split_extend(reqs, [6] * len(reqs), w.alloc_extend(*extend_args(reqs, [6] * len(reqs))))
w.step()  # the clock has not moved since construction: rate-limited, no refresh
out["used_rate_limited"] = exp.registry.get_sample_value("kvalloc_pages", labels)
now[0] += 5.0
w.step()  # refresh_interval elapsed: refreshed
out["used_refreshed"] = exp.registry.get_sample_value("kvalloc_pages", labels)
w.free(t(reqs[0].row))
w.free(t(reqs[0].row))  # one double free per process
now[0] += 5.0
w.step()
if rank == 0:
    port = exp.serve()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        out["served"] = r.read().decode()
exp.close()
print("RESULT " + json.dumps(out))
"""


def _mp_samples(path) -> dict:
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(path))
    out = {}
    for fam in reg.collect():
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _find(samples: dict, name: str, **labels) -> dict:
    """{labels: value} of the samples of ``name`` whose labels include ``labels``."""
    out = {}
    for (n, lab), value in samples.items():
        if n == name and labels.items() <= dict(lab).items():
            out[lab] = value
    return out


@pytest.mark.integration
@pytest.mark.slow
def test_multiprocess_two_ranks_aggregate(tmp_path):
    mp_dir = tmp_path / "mp"
    mp_dir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir), "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(rank)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for rank in (0, 1)
    ]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr.decode()[-3000:]
        line = [ln for ln in stdout.decode().splitlines() if ln.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT ") :]))

    for rank, r in enumerate(results):
        assert r["multiprocess"] is True  # chosen from the environment, in the constructor
        assert r["used_rate_limited"] == 0  # the construction-time refresh; the first step was rate-limited
        assert r["used_refreshed"] == 2 * (rank + 2)
    served = results[0]["served"]
    assert 'kvalloc_pages{engine="e0",pool="full",state="used",tp_rank="0"}' in served

    s = _mp_samples(mp_dir)
    used = _find(s, "kvalloc_pages", pool="full", state="used")
    by_rank = {dict(lab)["tp_rank"]: v for lab, v in used.items()}
    assert by_rank == {"0": 2.0, "1": 4.0}  # after the double free of request 0: (rank + 1) * 2 pages
    assert all("pid" not in dict(lab) for lab in used)  # livesum: per-process series are merged
    cap = _find(s, "kvalloc_pages", pool="full")
    assert sum(cap.values()) == 2 * (16 + 1)  # both ranks' states sum to their capacity
    assert sum(_find(s, "kvalloc_invariant_violations_total", invariant="double_free").values()) == 2
    assert len(_find(s, "kvalloc_invariant_violations_total", tp_rank="1")) == len(INVARIANTS)
    assert sum(_find(s, "kvalloc_pages_allocated_total", pool="full").values()) == 2 * 2 + 2 * 3
    assert sum(_find(s, "kvalloc_pages_freed_total", pool="full").values()) == 4 + 4
    assert _find(s, "kvalloc_page_size_tokens", tp_rank="1") == {(("engine", "e0"), ("tp_rank", "1")): 4.0}
    assert _find(s, "kvalloc_events_dropped_total", sink="prometheus", tp_rank="0")

    # A dead rank: its live gauges leave the aggregate, its counters keep counting into the sums.
    mark_process_dead(results[1]["pid"], str(mp_dir))
    s = _mp_samples(mp_dir)
    assert {dict(lab)["tp_rank"] for lab in _find(s, "kvalloc_pages")} == {"0"}
    assert sum(_find(s, "kvalloc_invariant_violations_total", invariant="double_free").values()) == 2


NO_LABELS_CHILD = r"""
import json, os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from exporters.prometheus import PrometheusExporter

w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
exp = PrometheusExporter(w, refresh_interval=0.0)  # one rank: no const labels
with w.batch(["a"]):
    w.alloc(8)
w.step()
exp.close()
print("RESULT ok")
"""


def _one_rank(tmp_path, child: str):
    """Run ``child`` (a script taking the multiprocess directory) as one rank in a fresh process."""
    mp_dir = tmp_path / "mp"
    mp_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    p = subprocess.run(
        [sys.executable, "-c", child, str(mp_dir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    return mp_dir, p


@pytest.mark.integration
def test_multiprocess_without_const_labels(tmp_path):
    # A single rank under PROMETHEUS_MULTIPROC_DIR with no const labels: the gauges without labels of their own
    # are their own series (prometheus_client refused .labels() on them, and the constructor failed).
    mp_dir, p = _one_rank(tmp_path, NO_LABELS_CHILD)
    assert p.returncode == 0 and "RESULT ok" in p.stdout, p.stderr[-3000:]
    s = _mp_samples(mp_dir)
    assert _find(s, "kvalloc_page_size_tokens") == {(): 4.0}
    assert _find(s, "kvalloc_requests_live") == {(): 1.0}
    assert _find(s, "kvalloc_pages", pool="full", state="used") == {(("pool", "full"), ("state", "used")): 2.0}


SWA_CHILD = r"""
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]  # before prometheus_client is imported
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import SWATokenToKVPoolAllocator
from tests.engine_model import Req, extend_args, split_extend, t
from exporters.prometheus import PrometheusExporter

w = InstrumentedAllocator(SWATokenToKVPoolAllocator(16 * 4, 8 * 4, 4, torch.float16, "cpu"), mode="record",
                          sliding_window=8)
exp = PrometheusExporter(w, const_labels={"engine": "e0", "tp_rank": "0"}, refresh_interval=0.0)
assert exp.multiprocess
a, b = Req("a"), Req("b")
with w.batch(["a", "b"]):
    split_extend([a, b], [16, 6], w.alloc_extend(*extend_args([a, b], [16, 6])))  # a 4 pages, b 2 (each pool)
w.step()
w.free_swa_segment(t(a.row[0:4]), start_pos=0)  # one SWA eviction: one free_swa_segment call, pool swa only
w.ledger["a"].swa_evicted_seqlen = 4
w.step()
w.free(t(b.row))
w.release_request("b")  # peak 2, holds nothing
w.release_request("a")  # request_leak: peak 4, still holds 4 full + 3 swa pages
w.step()
exp.close()
print("RESULT " + repr([v.invariant for v in w.violations]))
"""


@pytest.mark.integration
def test_multiprocess_histograms_of_an_swa_run(tmp_path):
    mp_dir, p = _one_rank(tmp_path, SWA_CHILD)
    assert p.returncode == 0 and "RESULT ['request_leak']" in p.stdout, p.stderr[-3000:]
    s = _mp_samples(mp_dir)
    lab = tuple(sorted(CONST.items()))
    full = tuple(sorted({**CONST, "pool": "full"}.items()))
    # Released requests' peaks (not what they still held): b 2, a 4.
    assert _find(s, "kvalloc_request_pages_sum") == {full: 6.0}
    assert _find(s, "kvalloc_request_pages_count") == {full: 2.0}
    buckets = {dict(k)["le"]: v for k, v in _find(s, "kvalloc_request_pages_bucket").items()}
    want = {"1.0": 0.0, "2.0": 1.0, "4.0": 2.0, "8.0": 2.0, "+Inf": 2.0}
    assert {le: buckets[le] for le in want} == want
    # One duration observation per call: the SWA segment free is observed though its only Free is the swa pool's.
    counts = {dict(k)["op"]: v for k, v in _find(s, "kvalloc_op_duration_seconds_count").items()}
    assert counts == {"alloc_extend": 1.0, "free": 1.0, "free_swa_segment": 1.0}
    assert _find(s, "kvalloc_swa_evicted_tokens_total") == {lab: 4.0}
    assert _find(s, "kvalloc_invariant_violations_total", invariant="request_leak") == {
        tuple(sorted({**CONST, "invariant": "request_leak"}.items())): 1.0
    }


# One rank for the claim tests: its own wrapper and exporter in multiprocess mode; argv: directory, tp_rank,
# requests of 2 pages to hold, then flags. Prints READY <pid> [port] once refreshed, then follows commands on stdin
# ("serve", "close", "exit"; end of input: exit without closing, as a killed rank).
RANK = r"""
import json, os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from tests.engine_model import Req, extend_args, split_extend
from exporters.mpclaims import ClaimError
from exporters.prometheus import PrometheusExporter

tp, n = sys.argv[2], int(sys.argv[3])
w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
try:
    exp = PrometheusExporter(w, const_labels={"engine": "e0", "tp_rank": tp}, refresh_interval=0.0)
except ClaimError as exc:
    print("CLAIM " + str(exc), flush=True)
    sys.exit(0)
reqs = [Req(f"r{i}") for i in range(n)]
if reqs:
    with w.batch([r.rid for r in reqs]):
        split_extend(reqs, [8] * n, w.alloc_extend(*extend_args(reqs, [8] * n)))
w.step()
print("READY", os.getpid(), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "serve":
        try:
            print("PORT", exp.serve(), flush=True)
        except ClaimError as exc:
            print("CLAIM " + str(exc), flush=True)
    elif cmd == "close":
        exp.close()
        print("CLOSED", flush=True)
    elif cmd == "exit":
        break
"""


class _Rank:
    """A RANK child process, driven line by line."""

    def __init__(self, mp_dir, tp: str, n: int):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.p = subprocess.Popen(
            [sys.executable, "-c", RANK, str(mp_dir), tp, str(n)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.first = self.read()
        self.pid = self.p.pid

    def read(self) -> str:
        line = self.p.stdout.readline().strip()
        assert line, self.p.stderr.read()[-3000:]
        return line

    def send(self, cmd: str) -> str:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.read()

    def end(self, cmd: str = "exit") -> None:
        if cmd == "kill":
            self.p.kill()
        else:
            self.p.stdin.write(cmd + "\n")
            self.p.stdin.close()
        self.p.wait(timeout=60)


def _pages(mp_dir, tp: str) -> dict:
    return {dict(lab)["state"]: v for lab, v in _find(_mp_samples(mp_dir), "kvalloc_pages", tp_rank=tp).items()}


@pytest.mark.integration
@pytest.mark.slow
def test_multiprocess_label_set_of_a_live_rank_is_refused(tmp_path):
    # Two live ranks given the same labels (both think they are tp_rank 0) were merged without a word: pages by
    # state summed to twice the capacity.
    mp_dir = tmp_path / "mp"
    mp_dir.mkdir()
    a = _Rank(mp_dir, "0", 2)
    assert a.first == f"READY {a.pid}"
    b = _Rank(mp_dir, "0", 3)
    assert b.first == (
        f"CLAIM multiprocess metrics in {mp_dir}: const_labels {{'engine': 'e0', 'tp_rank': '0'}} already used by "
        f"live process {a.pid} (its gauges stay in the directory until it exits, even after its exporter closed); "
        "every process (rank) needs its own const_labels (engine, tp_rank, dp_rank, ...)"
    )
    b.p.wait(timeout=60)
    assert _pages(mp_dir, "0") == {"free": 12.0, "used": 4.0, "staged": 0.0, "reserved": 1.0}  # a's alone
    c = _Rank(mp_dir, "1", 1)  # another label set is fine
    assert c.first == f"READY {c.pid}"
    assert a.send("close") == "CLOSED"
    # Closed, a's gauges still stand in the directory while it lives: the label set is still refused.
    d = _Rank(mp_dir, "0", 1)
    assert d.first.startswith(f"CLAIM multiprocess metrics in {mp_dir}: const_labels")
    for r in (a, c):
        r.end()


@pytest.mark.integration
@pytest.mark.slow
def test_multiprocess_restarted_rank_takes_over_its_dead_predecessor(tmp_path):
    # A rank killed without cleanup and restarted with its labels: its predecessor's gauges used to be summed with
    # the new process's until a supervisor called mark_process_dead; the new exporter now does it.
    mp_dir = tmp_path / "mp"
    mp_dir.mkdir()
    old = _Rank(mp_dir, "1", 3)
    other = _Rank(mp_dir, "0", 1)
    old.end("kill")
    new = _Rank(mp_dir, "1", 1)
    assert new.first == f"READY {new.pid}"
    assert _pages(mp_dir, "1") == {"free": 14.0, "used": 2.0, "staged": 0.0, "reserved": 1.0}  # capacity 17
    assert _pages(mp_dir, "0") == {"free": 14.0, "used": 2.0, "staged": 0.0, "reserved": 1.0}  # untouched
    s = _mp_samples(mp_dir)
    # The dead rank's counters keep counting into the sums: 3 * 2 pages, then 1 * 2.
    assert _find(s, "kvalloc_pages_allocated_total", tp_rank="1") == {
        (("engine", "e0"), ("pool", "full"), ("tp_rank", "1")): 8.0
    }
    # A rank that exited cleanly is taken over the same way.
    new.end("close")
    again = _Rank(mp_dir, "1", 0)
    assert again.first == f"READY {again.pid}"
    assert _pages(mp_dir, "1")["used"] == 0.0
    for r in (other, again):
        r.end()


@pytest.mark.integration
@pytest.mark.slow
def test_multiprocess_one_server_per_directory(tmp_path):
    # Each serve() exposes every rank of the directory: two servers, both scraped, doubled every sum.
    mp_dir = tmp_path / "mp"
    mp_dir.mkdir()
    a, b = _Rank(mp_dir, "0", 1), _Rank(mp_dir, "1", 1)
    port = int(a.send("serve").split()[1])
    assert b.send("serve") == (
        f"CLAIM multiprocess metrics in {mp_dir}: already served by live process {a.pid}; every process's metrics "
        "are served from one endpoint per directory (serve() from one rank, or from the parent with a "
        "MultiProcessCollector)"
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    assert 'kvalloc_pages{engine="e0",pool="full",state="used",tp_rank="1"} 2.0' in body
    assert a.send("close") == "CLOSED"
    assert b.send("serve").startswith("PORT ")  # the directory's server is gone: b may serve it now
    for r in (a, b):
        r.end()


@pytest.mark.integration
def test_multiprocess_claims_within_one_process(tmp_path):
    # Two allocators in one process (two DP ranks of one scheduler) given the same labels overwrote each other's
    # counter entries: increments were lost.
    child = r"""
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from exporters.mpclaims import ClaimError
from exporters.prometheus import PrometheusExporter

def wrapped():
    return InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")

lab = {"engine": "e0", "dp_rank": "0"}
w1, w2 = wrapped(), wrapped()
x1 = PrometheusExporter(w1, const_labels=lab, refresh_interval=0.0)
try:
    PrometheusExporter(w2, const_labels=lab, refresh_interval=0.0)
except ClaimError as exc:
    print("CLAIM " + str(exc))
print("SINKS", len(w2.bus.sinks))
x2 = PrometheusExporter(w2, const_labels={"engine": "e0", "dp_rank": "1"}, refresh_interval=0.0)
x1.serve()
try:
    x2.serve()
except ClaimError as exc:
    print("CLAIM " + str(exc))
for w in (w1, w2):
    s = w.alloc(8)
    w.free(s)
    w.free(s)
    w.step()
x1.close()
x3 = PrometheusExporter(wrapped(), const_labels=lab, refresh_interval=0.0)  # closed in this process: taken over
print("PORT", x2.serve() > 0)
x2.close(); x3.close()
"""
    mp_dir, p = _one_rank(tmp_path, child)
    assert p.returncode == 0, p.stderr[-3000:]
    pid = p.stdout.split("pid ")[1].split(")")[0]
    assert p.stdout.splitlines() == [
        f"CLAIM multiprocess metrics in {mp_dir}: const_labels {{'engine': 'e0', 'dp_rank': '0'}} already used by "
        f"another exporter of this process (pid {pid}); every allocator needs its own const_labels (engine, "
        "tp_rank, dp_rank, ...)",
        "SINKS 0",
        f"CLAIM multiprocess metrics in {mp_dir}: already served by another exporter of this process (pid {pid}); "
        "serve one endpoint per directory",
        "PORT True",
    ]
    s = _mp_samples(mp_dir)
    assert {dict(lab)["dp_rank"]: v for lab, v in _find(s, "kvalloc_pages_allocated_total").items()} == {
        "0": 2.0,
        "1": 2.0,
    }
    dbl = _find(s, "kvalloc_invariant_violations_total", invariant="double_free")
    assert {dict(lab)["dp_rank"]: v for lab, v in dbl.items()} == {"0": 1.0, "1": 1.0}


TRAILING_CHILD = r"""
import json, os, sys, time
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from exporters.prometheus import PrometheusExporter

now = [100.0]
w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
exp = PrometheusExporter(w, const_labels={"engine": "e0"}, refresh_interval=0.1, clock=lambda: now[0])
lab = {"engine": "e0", "pool": "full", "state": "used"}
def used():
    return exp.registry.get_sample_value("kvalloc_pages", lab)
with w.batch(["a"]):
    w.alloc(8)
w.step()  # within the interval of the construction's refresh: held back
out = {"held_back": used()}
time.sleep(0.5)
out["clock_still"] = used()  # no time has passed on the exporter's clock: still held back
now[0] += 1.0  # the interval passes; the engine is idle (no more steps)
deadline = time.monotonic() + 20
while used() != 2.0 and time.monotonic() < deadline:
    time.sleep(0.02)
out["trailing"] = used()
out["live"] = exp.registry.get_sample_value("kvalloc_requests_live", {"engine": "e0"})
exp.close()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.integration
def test_multiprocess_gauges_catch_up_when_the_engine_goes_idle(tmp_path):
    # A step within refresh_interval of the last refresh is held back; an engine that then goes idle calls nothing
    # that would refresh: the gauges showed the old state for as long as it stayed idle.
    _, p = _one_rank(tmp_path, TRAILING_CHILD)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.split("RESULT ")[1])
    assert r == {"held_back": 0.0, "clock_still": 0.0, "trailing": 2.0, "live": 1.0}


def test_multiprocess_needs_the_directory(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    w = make_alloc()
    with pytest.raises(ValueError, match="PROMETHEUS_MULTIPROC_DIR"):
        PrometheusExporter(w, multiprocess=True)
    assert w.bus.sinks == ()  # nothing subscribed by a failed constructor
    exp = PrometheusExporter(w)  # the default reads the (unset) variable: single process
    assert exp.multiprocess is False
    exp.close()


# A filesystem that fills up under the multiprocess files (run in a child, on a small tmpfs of its own: see
# _on_small_tmpfs). prometheus_client grows its files sparse and writes through mmap, so an unreserved write on a
# full filesystem is a SIGBUS: the child would die with -7 instead of printing its RESULT.
DISK_FULL_CHILD = r"""
import errno, json, os, sys
d = sys.argv[1]
os.environ["PROMETHEUS_MULTIPROC_DIR"] = d  # before prometheus_client is imported
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from exporters.prometheus import PrometheusExporter

filler = os.path.join(d, "filler")


def fill():
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (4096, 512, 1):  # to the last byte
            while True:
                try:
                    if os.write(fd, bytes(size)) < size:
                        break
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)


w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
out = {}
fill()  # 1. full before the exporter is built: a clear error, nothing subscribed
try:
    PrometheusExporter(w, const_labels={"engine": "e0"}, refresh_interval=0.0)
    out["ctor"] = None
except OSError as exc:
    out["ctor"] = [exc.errno, str(exc)]
out["sinks_after_failed_ctor"] = len(w.bus.sinks)
os.remove(filler)

exp = PrometheusExporter(w, const_labels={"engine": "e0"}, refresh_interval=0.0)
fill()  # 2. full while it runs: the series that exist keep counting, the allocator never sees an error
for _ in range(5):
    slots = w.alloc(8)
    w.step()
    w.free(slots)
    w.step()
out["allocated"] = exp.registry.get_sample_value("kvalloc_pages_allocated_total", {"engine": "e0", "pool": "full"})
out["errors_existing"] = exp.sink_errors
# 3. new series on the full disk: each refusing sink adds an events_dropped series at the next refresh, until the
# counters' file must grow and cannot: those refreshes fail, their batches are refused and counted.
names = []
for k in range(400):
    def refuse(batch):
        return False
    refuse.name = f"refuser-{k:03d}"
    names.append(refuse.name)
    w.subscribe(refuse)
    slots = w.alloc(4)
    w.free(slots)
    w.step()
    if exp.sink_errors:
        break
out["refusers"] = len(names)
out["sink_errors"] = exp.sink_errors
out["last_error"] = exp.last_error
out["bus_dropped"] = w.bus.dropped.get("prometheus", 0)
out["available"] = w.available_size()
os.remove(filler)  # 4. space again: the next refresh writes the new series
slots = w.alloc(4)
w.free(slots)
w.step()
exp.refresh()  # the step's refresh ran before the refusing sinks were handed that step's batch
out["last_refuser"] = exp.registry.get_sample_value(
    "kvalloc_events_dropped_total", {"engine": "e0", "sink": names[-1]}
)
out["last_refuser_bus"] = w.bus.dropped[names[-1]]
exp.close()
print("RESULT " + json.dumps(out))
"""


def _on_small_tmpfs(tmp_path, script: str, size: str) -> tuple[int, str, str]:
    """Run ``script`` with a fresh tmpfs of ``size`` mounted at its argv[1], in a mount namespace of its own
    (``unshare --user --map-root-user --mount``: no root needed where user namespaces are allowed). Returns
    (returncode, stdout, stderr); a machine that cannot mount one there skips (fails under CI)."""
    from tests.ci import missing

    mnt = tmp_path / "small-fs"
    mnt.mkdir()
    shell = 'mount -t tmpfs -o size="$2" tmpfs "$1" || { echo MOUNT-FAILED >&2; exit 97; }; exec "$3" -c "$4" "$1"'
    cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell, "sh", str(mnt), size, sys.executable]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    try:
        p = subprocess.run([*cmd, script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        missing("unshare (util-linux) is needed to mount a small tmpfs for the full-disk test")
    if p.returncode == 97 or (p.returncode != 0 and "unshare:" in p.stderr):
        missing(f"cannot mount a small tmpfs in a user namespace here: {p.stderr.strip()[-300:]}")
    return p.returncode, p.stdout, p.stderr


@pytest.mark.integration
def test_multiprocess_full_disk_never_kills_the_engine(tmp_path):
    # 4 files of 64 KiB reserved at construction (counters, histograms, two gauge modes) fit in 320 KiB.
    rc, stdout, stderr = _on_small_tmpfs(tmp_path, DISK_FULL_CHILD, "320k")
    assert rc == 0, f"child exited {rc} (-7: SIGBUS): {stderr[-3000:]}"
    r = json.loads([ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT ") :])
    assert r["ctor"][0] == errno.ENOSPC
    assert "multiprocess metrics: no space for new series in" in r["ctor"][1] and "small-fs" in r["ctor"][1]
    assert r["sinks_after_failed_ctor"] == 0
    assert r["allocated"] == 5 * 2 and r["errors_existing"] == 0  # 8 slots = 2 pages, five times
    # The counters' file could not grow: refreshes failed from then on, each refused batch counted by the bus.
    assert 1 < r["refusers"] < 400 and r["sink_errors"] >= 1 and r["bus_dropped"] >= r["sink_errors"]
    assert r["last_error"].startswith("OSError: [Errno 28] multiprocess metrics: no space for new series")
    assert r["available"] == 64  # every page back: the allocator saw nothing of it
    # Space again: the next refresh wrote the series the full disk had held back, with the bus's count.
    assert r["last_refuser"] == r["last_refuser_bus"] >= 1, r


LIFECYCLE_CHILD = r"""
import gc, json, os, sys, threading, time
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
import torch
from instrumented_alloc import InstrumentedAllocator, stats
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from exporters.prometheus import PrometheusExporter

def wrapped():
    return InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")

out = {}
# 1. A port out of range: a clear error, and no server claim left behind (a retry serves).
x = PrometheusExporter(wrapped(), const_labels={"engine": "a"}, refresh_interval=0.0)
try:
    x.serve(port=94000)
except ValueError as exc:
    out["bad_port"] = str(exc)
out["retry_serves"] = x.serve(port=0) > 0
x.close()

# 2. An exporter dropped without close(): collected (its refresh thread ends), its label set free again.
w = wrapped()
x = PrometheusExporter(w, const_labels={"engine": "b"}, refresh_interval=0.0)
t = x._refresher
del x, w
gc.collect()
t.join(timeout=10)
out["thread_ended"] = not t.is_alive()
PrometheusExporter(wrapped(), const_labels={"engine": "b"}, refresh_interval=0.0).close()
out["relabelled"] = True

# 3. A clock that goes back: the next step refreshes (it used to wait for the clock to climb back).
now = [1000.0]
w = wrapped()
x = PrometheusExporter(w, const_labels={"engine": "c"}, refresh_interval=5.0, clock=lambda: now[0])
lab = {"engine": "c", "pool": "full", "state": "used"}
with w.batch(["r"]):
    w.alloc(8)
now[0] = 10.0
w.step()
out["after_clock_back"] = x.registry.get_sample_value("kvalloc_pages", lab)
x.close()

# 4. close() while the refresh thread refreshes from an older snapshot: close's refresh is the last word.
now = [0.0]
w = wrapped()
x = PrometheusExporter(w, const_labels={"engine": "d"}, refresh_interval=1.0, clock=lambda: now[0])
inside, release = threading.Event(), threading.Event()
real = stats.figures
def slow(snaps):
    fig = real(snaps)
    if threading.current_thread() is x._refresher:
        inside.set()
        release.wait(10)
    return fig
stats.figures = slow
with w.batch(["r"]):
    slots = w.alloc(8)
w.step()  # within the interval: held back, left to the thread
now[0] = 2.0  # the thread refreshes (2 pages used) and is held inside
assert inside.wait(10)
w.free(slots)
w.release_request("r")
threading.Timer(0.3, release.set).start()
x.close()  # waits for the thread's refresh, then refreshes: 0 pages used
stats.figures = real
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
reg = CollectorRegistry()
MultiProcessCollector(reg, path=sys.argv[1])
out["after_close"] = reg.get_sample_value("kvalloc_pages", {"engine": "d", "pool": "full", "state": "used"})
print("RESULT " + json.dumps(out))
"""


@pytest.mark.integration
def test_multiprocess_exporter_lifecycle(tmp_path):
    _, p = _one_rank(tmp_path, LIFECYCLE_CHILD)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.split("RESULT ")[1])
    assert r == {
        "bad_port": "serve(): port: expected an int 0..65535, got 94000",
        "retry_serves": True,
        "thread_ended": True,
        "relabelled": True,
        "after_clock_back": 2.0,
        "after_close": 0.0,
    }


FORK_CHILD = r"""
import json, os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from exporters.prometheus import PrometheusExporter

w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
x = PrometheusExporter(w, const_labels={"engine": "e0"}, refresh_interval=0.0)
with w.batch(["r"]):
    w.alloc(8)
w.step()
x.serve(port=0)
pid = os.fork()
if pid == 0:  # a worker forked from the engine process leaves a `with` block: closes its copy
    x.close()
    os._exit(0)
_, status = os.waitpid(pid, 0)
claims = sorted(n.split("_")[1] for n in os.listdir(sys.argv[1]) if n.endswith(".claim"))
print("RESULT " + json.dumps({"child_status": status, "claims": claims}))
x.close()
"""


@pytest.mark.integration
def test_multiprocess_close_in_a_forked_child_leaves_the_parent_alone(tmp_path):
    # The child's close() used to remove the parent's server claim, write the parent's label set into the child's
    # own files (pages doubled for good) and hang in the HTTP server's shutdown.
    mp_dir, p = _one_rank(tmp_path, FORK_CHILD)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.split("RESULT ")[1])
    assert r == {"child_status": 0, "claims": ["labels", "serve"]}
    pages = {dict(lab)["state"]: v for lab, v in _find(_mp_samples(mp_dir), "kvalloc_pages").items()}
    assert pages == {"free": 14.0, "used": 2.0, "staged": 0.0, "reserved": 1.0}  # one process's 17 pages


MANY_NEW_SINKS_CHILD = r"""
import errno, json, os, sys
d = sys.argv[1]
os.environ["PROMETHEUS_MULTIPROC_DIR"] = d  # before prometheus_client is imported
import torch
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from exporters.prometheus import PrometheusExporter

now = [0.0]
w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
# Refreshes held back (the clock never moves): the sinks below appear while no refresh runs.
exp = PrometheusExporter(w, const_labels={"engine": "e0"}, refresh_interval=60.0, clock=lambda: now[0])
for k in range(400):
    def refuse(batch):
        return False
    refuse.name = f"refuser-{k:03d}"
    w.subscribe(refuse)
slots = w.alloc(4)
w.free(slots)
w.step()
fd = os.open(os.path.join(d, "filler"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
for size in (4096, 512, 1):  # the disk full to the last byte
    while True:
        try:
            if os.write(fd, bytes(size)) < size:
                break
        except OSError:
            break
out = {}
try:
    exp.refresh()  # 400 new series at once: more than the headroom reserved at its start
    out["refresh"] = None
except OSError as exc:
    out["refresh"] = [exc.errno, str(exc)]
out["written"] = sum(
    1 for k in range(400)
    if exp.registry.get_sample_value("kvalloc_events_dropped_total", {"engine": "e0", "sink": f"refuser-{k:03d}"})
)
out["available"] = w.available_size()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.integration
def test_multiprocess_refresh_with_many_new_series_on_a_full_disk(tmp_path):
    # One refresh that brings more new series than the headroom reserved at its start (here 400 sinks that
    # appeared while refreshes were held back; in a run, a refresh thread and a step racing for the refresh):
    # it reserved once, so prometheus_client grew its file sparse and the next write was a SIGBUS.
    rc, stdout, stderr = _on_small_tmpfs(tmp_path, MANY_NEW_SINKS_CHILD, "320k")
    assert rc == 0, f"child exited {rc} (-7: SIGBUS): {stderr[-3000:]}"
    r = json.loads([ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT ") :])
    assert r["refresh"][0] == errno.ENOSPC
    assert r["refresh"][1].startswith("[Errno 28] multiprocess metrics: no space for new series in")
    assert 0 < r["written"] < 400  # the series that fitted were written; the rest wait for space
    assert r["available"] == 64
