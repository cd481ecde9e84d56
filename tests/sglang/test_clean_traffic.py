"""Clean traffic is silent: SGLang's real Engine, plugin on in raise mode, seeded traffic with shared prefixes
(cache hits), aborted requests and retraction, in the configurations SGLang is run in. A violation in raise mode
kills the scheduler (the driver then exits non-zero), and every violation is in the rank's recording: both must
stay empty. Each configuration is one Engine start, shared by its checks; two of them also carry a failing
exporter (an unwritable record directory, a taken metrics port), which must leave SGLang serving."""

from __future__ import annotations

import re
import socket
from collections import Counter

import pytest

from tests.prometheus_server import free_port
from tests.sglang import harness

pytestmark = pytest.mark.sglang

WAVES = {"kind": "waves", "seed": 3, "waves": 3, "per_wave": 16}
IDLE = {"kind": "idle", "seconds": 1.5}  # the scheduler goes idle: the plugin's consistency sweep runs


def released(rec) -> Counter:
    return Counter(e.rid for e in rec.events() if type(e).__name__ == "RequestReleased")


def assert_clean(run: harness.Run) -> None:
    assert run.returncode == 0 and run.results.get("phase") == "done", harness.describe(run)
    assert [rec.violations() for rec in run.recordings] == [[]], harness.describe(run)


def assert_cache_hits(run: harness.Run) -> None:
    cached = run.workload("waves")["cached"]
    assert cached[0] < cached[1] and cached[2] > 0, cached  # the waves after the first hit the prefix cache


@pytest.fixture(scope="module")
def page_size_1(tmp_path_factory):
    # Page size 1 with the radix cache and the overlap scheduler; aborted requests.
    return harness.run(
        tmp_path_factory.mktemp("ps1"),
        engine={"page_size": 1, "max_total_tokens": 8192},
        workloads=[WAVES, {"kind": "abort", "n": 3}, IDLE],
    )


@pytest.fixture(scope="module")
def page_size_16(tmp_path_factory):
    # Page size 16 with the radix cache, the overlap scheduler off, and a pool small enough that a decode-heavy
    # batch that reserves by SGLang's token ratio (no ignore_eos) gets retracted; aborted requests.
    return harness.run(
        tmp_path_factory.mktemp("ps16"),
        engine={
            "page_size": 16,
            "max_total_tokens": 2048,
            "disable_overlap_schedule": True,
            "max_running_requests": 24,
            "schedule_conservativeness": 0.3,
        },
        workloads=[
            WAVES,
            {"kind": "abort", "n": 2},
            {"kind": "decode", "n": 24, "new_tokens": 300, "ignore_eos": False},
            IDLE,
        ],
    )


@pytest.fixture(scope="module")
def hybrid_swa(tmp_path_factory):
    # The hybrid sliding-window model (SGLang's real SWATokenToKVPoolAllocator) at page size 16, radix cache on,
    # SWA evictions every 16 tokens. Its KVALLOC_METRICS_PORT is taken (test_bad_input's case, on this engine).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        run = harness.run(
            tmp_path_factory.mktemp("swa"),
            model="swa",
            engine={"page_size": 16, "max_total_tokens": 8192},
            env={"SGLANG_SWA_EVICTION_INTERVAL": "16", "KVALLOC_METRICS_PORT": str(taken.getsockname()[1])},
            workloads=[WAVES, {"kind": "abort", "n": 2}, IDLE],
        )
        run.taken_port = taken.getsockname()[1]
    return run


@pytest.fixture(scope="module")
def radix_off(tmp_path_factory):
    # The radix cache off. Its KVALLOC_RECORD_DIR cannot be created (test_bad_input's case, on this engine): the
    # metrics, on KVALLOC_METRICS_PORT, say what it recorded instead.
    tmp = tmp_path_factory.mktemp("radix-off")
    blocker = tmp / "not-a-dir"
    blocker.write_text("a file where the directory would be\n")
    port = free_port()
    run = harness.run(
        tmp,
        model="swa",
        engine={"page_size": 16, "max_total_tokens": 8192, "disable_radix_cache": True},
        env={
            "SGLANG_SWA_EVICTION_INTERVAL": "16",
            "KVALLOC_RECORD_DIR": str(blocker / "recordings"),
            "KVALLOC_METRICS_PORT": str(port),
        },
        workloads=[WAVES, IDLE, {"kind": "scrape", "url": f"http://127.0.0.1:{port}/metrics"}],
    )
    run.blocker = blocker
    return run


def test_page_size_1_with_the_radix_cache(page_size_1):
    assert_clean(page_size_1)
    assert_cache_hits(page_size_1)
    rec = page_size_1.recording
    assert rec.meta["page_size"] == 1 and rec.meta["engine"] == "sglang" and rec.meta["tp_rank"] == 0
    # Every request was released exactly once, and the prefix cache holds pages at the end.
    assert set(released(rec)) == set(page_size_1.workload("waves")["rids"]) | set(page_size_1.workload("abort")["rids"])
    assert max(released(rec).values()) == 1


def test_aborted_requests_are_released_clean(page_size_1):
    aborts = page_size_1.workload("abort")
    assert [r["type"] for r in aborts["finish_reasons"]] == ["abort"] * 3
    assert all(released(page_size_1.recording)[rid] == 1 for rid in aborts["rids"])


def test_page_size_16_overlap_off_with_retraction(page_size_16):
    assert_clean(page_size_16)
    assert_cache_hits(page_size_16)
    decode = page_size_16.workload("decode")
    counts = released(page_size_16.recording)
    retracted = [rid for rid in decode["rids"] if counts[rid] > 1]
    assert retracted, "no request was retracted: the pool was not small enough"
    assert decode["completion"] == [300] * 24  # retracted requests were resumed and finished


def test_hybrid_swa_with_the_radix_cache(hybrid_swa):
    assert_clean(hybrid_swa)
    assert_cache_hits(hybrid_swa)
    rec = hybrid_swa.recording
    assert [p["name"] for p in rec.meta["pools"]] == ["full", "swa"] and rec.meta["sliding_window"] == 32
    evicted = [e for e in rec.events() if type(e).__name__ == "SwaEvict"]
    assert evicted and all(e.new % 16 == 0 for e in evicted)  # SGLang evicted out-of-window KV, page-aligned


def test_radix_cache_off(radix_off):
    # Raise mode: a violation would have ended the scheduler. No recording here (see the fixture): the metrics
    # count the violations, and there are none.
    assert radix_off.returncode == 0 and radix_off.results["phase"] == "done", harness.describe(radix_off)
    assert radix_off.recordings == []
    text = radix_off.workload("scrape")["text"]
    assert re.search(r"^kvalloc_pages_allocated_total\{[^}]*pool=\"full\"[^}]*\} [1-9]", text, re.M), text[:3000]
    assert not re.search(r"^kvalloc_invariant_violations_total\{[^}]*\} [1-9]", text, re.M)
    assert radix_off.workload("waves")["cached"] == [0, 0, 0]


def test_an_unwritable_record_dir_leaves_sglang_serving_and_counts_the_loss(radix_off):
    lines = [line for line in radix_off.log.splitlines() if "KVALLOC_RECORD_DIR=" in line]
    assert len(lines) == 1 and re.search(
        rf"instrumented-alloc: KVALLOC_RECORD_DIR={re.escape(str(radix_off.blocker))}/recordings: no recording for "
        r"this rank: .*Not a directory.*; SGLang goes on without it \(its events are counted as dropped\)",
        lines[0],
    ), lines
    text = radix_off.workload("scrape")["text"]
    (dropped,) = re.findall(r'^kvalloc_events_dropped_total\{[^}]*sink="recorder"[^}]*\} (\S+)$', text, re.M)
    assert float(dropped) > 0


def test_a_taken_metrics_port_leaves_sglang_serving(hybrid_swa):
    assert_clean(hybrid_swa)
    lines = [line for line in hybrid_swa.log.splitlines() if "KVALLOC_METRICS_PORT" in line]
    assert len(lines) == 1 and f"serving on 127.0.0.1:{hybrid_swa.taken_port}" in lines[0], lines
    assert "in use" in lines[0]
    assert "in use" in hybrid_swa.recording.meta["exporters_failed"]["prometheus"]
