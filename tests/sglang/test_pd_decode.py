"""The seed's own path: SGLang's PD decode side on the CPU with its fake transfer backend (requests carry SGLang's
``FAKE_BOOTSTRAP_HOST``), where every request is preallocated through ``alloc_for_decode_prealloc``: with the
hybrid SWA model, with an SWA tail (``alloc_extend_swa_tail``, then SGLang's assert and ``set_evicted_seqlen``).

Clean preallocation, with and without a tail, records nothing. A tail one token short (the seed's case: an SWA
evicted length off a page boundary) is reported as ``swa_evicted_seqlen_page_aligned`` at the allocation, naming
the request and the numbers, before SGLang's own check (a bare ``assert``): in raise mode the scheduler stops
there, with the violation's message in SGLang's own scheduler failure."""

from __future__ import annotations

import re

import pytest

from tests.sglang import harness

pytestmark = pytest.mark.sglang

PD = {
    "page_size": 16,
    "max_total_tokens": 8192,
    "disaggregation_mode": "decode",
    "disaggregation_transfer_backend": "fake",
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return harness.run(
        tmp_path_factory.mktemp("pd-dense"),
        engine=PD,
        workloads=[{"kind": "pd", "n": 12, "seed": 1}, {"kind": "idle", "seconds": 1.5}],
    )


@pytest.fixture(scope="module")
def swa_tail(tmp_path_factory):
    # Raise mode: clean requests first, then one whose tail the injected fault makes one token short.
    return harness.run(
        tmp_path_factory.mktemp("pd-swa"),
        model="swa",
        engine=PD,
        env={"KVALLOC_INJECT": "prealloc-tail"},
        workloads=[
            {"kind": "pd", "n": 12, "seed": 2},
            {"kind": "idle", "seconds": 1.5},
            {"kind": "pd", "n": 3, "seed": 3, "fault": "prealloc-tail"},
        ],
        deadline=150,
    )


def allocs(rec, op: str, pool: str = "full") -> list:
    return [e for e in rec.events() if type(e).__name__ == "Alloc" and e.op == op and e.pool == pool]


def test_clean_preallocation_without_a_tail(dense):
    assert dense.returncode == 0 and dense.results["phase"] == "done", harness.describe(dense)
    rec = dense.recording
    assert rec.violations() == []
    assert rec.meta["engine_type"] == "decode"
    pd = dense.workload("pd")
    # Every request preallocated once, for its whole prompt: one alloc_extend of one request each.
    extends = allocs(rec, "alloc_extend")
    assert sorted(e.rids for e in extends) == sorted((rid,) for rid in pd["rids"])
    assert sorted(e.n_slots for e in extends) == sorted(pd["prompt_lens"])
    assert pd["completion"] == [16] * 12


def test_clean_preallocation_with_an_swa_tail(swa_tail):
    rec = swa_tail.recording
    clean = swa_tail.results["workloads"][0]
    assert clean["done"] and clean["completion"] == [16] * 12, harness.describe(swa_tail)
    tails = [e for e in allocs(rec, "alloc_extend_swa_tail", "swa") if e.rids[0] in clean["rids"]]
    assert len(tails) == 12
    # The tail's SWA slots cover the window, from a page boundary: fewer than the prompt where the prompt is long.
    by_rid = dict(zip(clean["rids"], clean["prompt_lens"]))
    for e in tails:
        n = by_rid[e.rids[0]]
        assert e.n_slots == n - max(0, n - 32) // 16 * 16, (e, n)
    assert [v for v in rec.violations() if v.rid in by_rid] == []


def test_a_misaligned_tail_is_named_at_the_allocation_and_stops_the_scheduler(swa_tail):
    rec = swa_tail.recording
    faulty = swa_tail.results["workloads"][2]
    rid = faulty["rids"][-1]
    assert rid.startswith("inject-prealloc-tail-") and not faulty["done"]
    (v,) = rec.violations()
    assert (v.invariant, v.op, v.rid, v.pool) == (
        "swa_evicted_seqlen_page_aligned",
        "alloc_extend_swa_tail",
        rid,
        "swa",
    )
    m = re.fullmatch(
        rf"request '{rid}': alloc_extend_swa_tail with seq_len=(\d+), swa_tail_len=(\d+) implies "
        r"swa_evicted_seqlen=(\d+), not a non-negative multiple of page_size=16 \(remainder (\d+)\)",
        v.message,
    )
    assert m, v.message
    seq, tail, evicted, rem = map(int, m.groups())
    assert seq == faulty["prompt_lens"][-1] and evicted == seq - tail and evicted % 16 == rem != 0
    # Nothing was handed out for it (raise mode refuses before the call), and SGLang's scheduler failed with
    # the violation's message, not its bare assert.
    assert not [e for e in allocs(rec, "alloc_extend_swa_tail") if e.rids == (rid,)]
    assert "Scheduler hit an exception" in swa_tail.log
    assert re.search(
        r"InvariantViolation: \[swa_evicted_seqlen_page_aligned\] request 'inject-prealloc-tail-", swa_tail.log
    )
