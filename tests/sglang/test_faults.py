"""Faults are named: each one injected into SGLang's real Engine through a test-only hook (``KVALLOC_INJECT``, on
the requests tagged for it) is reported with its exact invariant id and the request's id, in record mode, while
clean requests beside it stay clean. SGLang's own idle check, strict off, only logs sums for the same leaks.

Two Engine starts (hybrid SWA model, page size 16, radix cache on): one for the leaks and the seed's misaligned
SWA evicted length (last: SGLang's SWA tree fails on the misaligned value it stored, which ends that engine), one
for the prefix cache handed the same pages twice and a double free (last: it corrupts SGLang's free list). Record
mode verifies SGLang's writes of a request's KV lengths together, after each allocation (``KVALLOC_LEDGER``'s
default, deferred); a third Engine runs the faults that SGLang survives with each write checked as it is made
(immediate), and must report what the first two report for them. (The two that end an engine take paths the
setting does not change: the SWA evicted length's hook checks at once in both, and a free is a free.)"""

from __future__ import annotations

import re

import pytest

from instrumented_alloc.sglang_plugin.faults import FAULTS
from tests.sglang import harness

pytestmark = pytest.mark.sglang

ENGINE = {"page_size": 16, "max_total_tokens": 8192}
ENV = {
    "KVALLOC_MODE": "record",
    "SGLANG_SWA_EVICTION_INTERVAL": "16",
    # SGLang's own idle leak check logs instead of raising (its default raises and ends the scheduler).
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0",
}
IDLE = {"kind": "idle", "seconds": 1.5}


def fault(name: str, seed: int) -> dict:
    return {"kind": "fault", "fault": name, "seed": seed, "n": 3, "prefix": 40, "new_tokens": 60}


@pytest.fixture(scope="module")
def leaks(tmp_path_factory):
    return harness.run(
        tmp_path_factory.mktemp("leaks"),
        model="swa",
        engine=ENGINE,
        env={**ENV, "KVALLOC_INJECT": "leak,no-release,swa-misaligned"},
        workloads=[fault("leak", 1), IDLE, fault("no-release", 2), IDLE, fault("swa-misaligned", 3), IDLE],
    )


@pytest.fixture(scope="module")
def frees(tmp_path_factory):
    return harness.run(
        tmp_path_factory.mktemp("frees"),
        model="swa",
        engine=ENGINE,
        env={**ENV, "KVALLOC_INJECT": "cache-twice,double-free"},
        workloads=[fault("cache-twice", 4), IDLE, fault("double-free", 5), IDLE],
    )


@pytest.fixture(scope="module")
def survived_immediate(tmp_path_factory):
    """The faults SGLang survives, with their seeds above (so their request ids), each length write checked as it
    is made."""
    return harness.run(
        tmp_path_factory.mktemp("immediate"),
        model="swa",
        engine=ENGINE,
        env={**ENV, "KVALLOC_INJECT": "leak,no-release,cache-twice", "KVALLOC_LEDGER": "immediate"},
        workloads=[fault("leak", 1), IDLE, fault("no-release", 2), IDLE, fault("cache-twice", 4), IDLE],
    )


def first_violation_of(rec, rid):
    for v in rec.violations():
        if v.rid == rid:
            return v
    raise AssertionError(f"no violation names {rid!r}: {[(v.invariant, v.rid) for v in rec.violations()]}")


def target_of(run: harness.Run, name: str) -> str:
    (rid,) = [w["target"] for w in run.results["workloads"] if w.get("target", "").startswith(f"inject-{name}-")]
    return rid


def test_a_request_released_without_freeing_its_pages(leaks):
    rec = leaks.recording
    rid = target_of(leaks, "leak")
    v = first_violation_of(rec, rid)
    assert (v.invariant, v.op) == ("request_leak", "release"), harness.describe(leaks)
    # It names the request and its pages: the ones past the prefix the cache holds (full) and their SWA peers.
    assert re.fullmatch(
        rf"request '{rid}' released while still owning \d+ pages, neither freed nor handed to the prefix cache "
        r"\(full: \[[\d, ]+\] \(\d+ pages\); swa: \[[\d, ]+\] \(\d+ pages\)\)",
        v.message,
    ), v.message
    # SGLang's own idle check saw the same leak, and counted it.
    assert re.search(r"pool memory leak detected! \[full\] total=8192, available=\d+", leaks.log), leaks.log[-3000:]


def test_the_idle_sweep_names_a_request_never_released(leaks):
    rid = target_of(leaks, "no-release")
    v = first_violation_of(leaks.recording, rid)
    assert (v.invariant, v.op) == ("request_leak", "sweep"), harness.describe(leaks)
    assert re.fullmatch(
        rf"the engine is idle, yet request '{rid}' still owns \d+ pages \(full: \[[\d, ]+\] \(\d+ pages\); "
        r"swa: \[[\d, ]+\] \(\d+ pages\)\): it was never released",
        v.message,
    ), v.message
    assert "req_to_token_pool memory leak detected!" in leaks.log  # SGLang: a count of request rows


def test_the_seeds_misaligned_swa_evicted_length(leaks):
    rid = target_of(leaks, "swa-misaligned")
    v = first_violation_of(leaks.recording, rid)
    assert (v.invariant, v.op) == ("swa_evicted_seqlen_page_aligned", "ledger"), harness.describe(leaks)
    m = re.fullmatch(
        r"swa_evicted_seqlen=(\d+) is not a non-negative multiple of page_size=16 \(remainder 1\); "
        r"kept (\d+)",
        v.message,
    )
    assert m and int(m[1]) % 16 == 1 and int(m[2]) % 16 == 0, v.message


def test_clean_requests_beside_the_faulty_ones_stay_clean(leaks, frees):
    for run in (leaks, frees):
        faulty = {w["target"] for w in run.results["workloads"] if w["kind"] == "fault"}
        clean = {r for w in run.results["workloads"] if w["kind"] == "fault" for r in w["rids"]} - faulty
        named = {v.rid for v in run.recording.violations()}
        assert not (named & clean), harness.describe(run)


def test_pages_handed_to_the_prefix_cache_twice(frees):
    rid = target_of(frees, "cache-twice")
    v = first_violation_of(frees.recording, rid)
    assert (v.invariant, v.op) == ("double_free", "cache_insert"), harness.describe(frees)
    assert re.fullmatch(
        rf"request '{rid}' offers the prefix cache \[[\d, ]+\] \(\d+ pages\) which the prefix cache owns already: "
        r"handed to it twice",
        v.message,
    ), v.message


def test_a_double_free(frees):
    rid = target_of(frees, "double-free")
    v = first_violation_of(frees.recording, rid)
    assert v.invariant == "double_free" and v.op.startswith("free"), harness.describe(frees)
    assert re.search(r"frees \[[\d, ]+\] \(\d+ pages\) that are not in use", v.message), v.message


def test_every_fault_expects_the_id_it_is_reported_with():
    assert FAULTS == {
        "leak": "request_leak",
        "no-release": "request_leak",
        "double-free": "double_free",
        "cache-twice": "double_free",
        "swa-misaligned": "swa_evicted_seqlen_page_aligned",
        "prealloc-tail": "swa_evicted_seqlen_page_aligned",
    }


def test_deferred_verification_reports_what_immediate_verification_reports(leaks, frees, survived_immediate):
    immediate = survived_immediate
    assert leaks.recording.meta["ledger_checks"] == frees.recording.meta["ledger_checks"] == "deferred"
    assert immediate.recording.meta["ledger_checks"] == "immediate"
    # The same seeds, so the same request ids: every request of those workloads, faulty or clean.
    rids = {r for w in immediate.results["workloads"] if w["kind"] == "fault" for r in w["rids"]}
    assert len(rids) == 9

    def found(*runs) -> list:
        return sorted({(v.invariant, str(v.rid), v.op) for run in runs for v in run.recording.violations()
                       if v.rid in rids})  # fmt: skip

    assert found(leaks, frees) == found(immediate), (harness.describe(leaks), harness.describe(immediate))
    # ... and each fault is among them, under its id and its request's.
    named = {(inv, rid) for inv, rid, _ in found(immediate)}
    for f in ("leak", "no-release", "cache-twice"):
        assert (FAULTS[f], target_of(immediate, f)) in named, (f, named)
