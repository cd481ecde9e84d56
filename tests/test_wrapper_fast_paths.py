"""The fast paths (immediate verification: the decode fast path, the one-gather free check, the one-owner free
mirror, SWA peers read with numpy) against the general path (verify="deferred" takes none of them): the same
faults give the same violations -- id, message, request, pool, op -- and leave the same shadow and ledger."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instrumented_alloc import InstrumentedAllocator, wrapper
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from tests.engine_model import Req, decode_args, extend_args, split_extend, t

PS = 4


def paged():
    return PagedTokenToKVPoolAllocator(128, PS, torch.float16, "cpu", None, False)


def swa():
    return SWATokenToKVPoolAllocator(128, 128, PS, torch.float16, "cpu", None, False)


def _extend(w, reqs, lens):
    with w.batch([r.rid for r in reqs]):
        out = w.alloc_extend(*extend_args(reqs, lens))
    split_extend(reqs, lens, out)


def _decode(w, reqs):
    with w.batch([r.rid for r in reqs]):
        out = w.alloc_decode(*decode_args(reqs))
    if out is not None:
        for r, slot in zip(reqs, out.tolist()):
            r.row.append(slot)


def _start(make, verify, lens=(PS, PS, PS)):
    w = InstrumentedAllocator(make(), mode="record", verify=verify, sliding_window=2 * PS)
    reqs = [Req(f"r{i}") for i in range(len(lens))]
    _extend(w, reqs, list(lens))
    w.step()
    return w, reqs


def swa_decode_page_in_use(verify):
    w, reqs = _start(swa, verify)  # every request's next position opens a page
    inner = w.inner.swa_attn_allocator
    inner.free_pages = torch.cat([t([reqs[0].row[0] // PS]), inner.free_pages])  # an SWA page in use, at the head
    _decode(w, reqs)
    return w


def swa_decode_peer_misaligned(verify):
    w, reqs = _start(swa, verify, lens=(PS + 1, PS + 1))  # the next position continues a page
    mapping = w.inner.full_to_swa_index_mapping
    last = reqs[1].row[-1]
    mapping[last] = mapping[last] + 1  # the SWA side continues one slot off
    _decode(w, reqs)
    return w


def swa_decode_clean(verify):
    w, reqs = _start(swa, verify, lens=(PS - 1, PS, PS + 1))
    for _ in range(2 * PS):
        _decode(w, reqs)
        w.step()
    return w


def paged_decode_reserved_page(verify):
    w, reqs = _start(paged, verify)
    w.inner.free_pages = torch.cat([t([0]), w.inner.free_pages])
    _decode(w, reqs)
    return w


def paged_decode_stolen_page(verify):
    w, reqs = _start(paged, verify, lens=(PS, PS + 1))
    w.inner.free_pages = torch.cat([t([reqs[1].row[0] // PS]), w.inner.free_pages])
    _decode(w, reqs)
    return w


def paged_double_free(verify):
    w, reqs = _start(paged, verify)
    w.free(t(reqs[0].row))
    w.free(t(reqs[0].row))
    return w


def paged_free_out_of_range(verify):
    w, reqs = _start(paged, verify)
    w.free(t([*reqs[1].row, 10_000]))
    w.free(t([-5]))
    return w


def paged_free_two_owners(verify):
    w, reqs = _start(paged, verify)
    w.free(t(reqs[0].row + reqs[2].row))
    return w


def segment_repeat(verify):
    w, reqs = _start(paged, verify, lens=(2 * PS, PS))
    row = reqs[0].row
    w.free_page_ids(t([row[0] // PS, row[PS] // PS, row[0] // PS]))
    return w


def swa_segment_twice(verify):
    w, reqs = _start(swa, verify, lens=(3 * PS, 3 * PS))
    for _ in range(2):
        w.free_swa_segment(t(reqs[0].row[:PS]), start_pos=0)
    w.free_full(t(reqs[1].row))
    return w


def swa_free_in_group(verify):
    w, reqs = _start(swa, verify, lens=(2 * PS, 2 * PS, PS))
    w.free_group_begin()
    w.free(t(reqs[0].row))
    w.free(t(reqs[0].row[:1]))  # a page this group holds already: merged by the inner's dedup, no fault
    w.free_swa_segment(t(reqs[1].row), start_pos=0)
    w.free_full(t(reqs[1].row))
    w.free_full(t(reqs[2].row))  # its SWA KV was never freed: swa_mapping_inconsistent
    w.free_group_end()
    return w


# The decode run (wrapper._DecodeRun): after a decode in which every request opened a page, the next PS - 1
# decodes of the same requests are verified against the run. Anything that changes the pages' owners or the
# ledger in between must send the next decode through the full check.
def paged_decode_run_clean(verify):
    w, reqs = _start(paged, verify)  # every request opens a page at the next decode
    for _ in range(3 * PS):
        _decode(w, reqs)
        w.step()
    return w


def paged_decode_run_free_between(verify):
    w, reqs = _start(paged, verify)
    _decode(w, reqs)  # all open a page: a run starts
    _decode(w, reqs)
    w.free(t(reqs[1].row))  # r1's pages go back to the free list (the engine forgets r1 is still decoding)
    _decode(w, reqs)  # slots and lengths exactly as the run expects: r1 continues in a page that is free now
    return w


def paged_decode_run_stolen_between(verify):
    w, reqs = _start(paged, verify)
    _decode(w, reqs)
    inner = w.inner
    inner.free_pages = torch.cat([t([reqs[1].row[-1] // PS]), inner.free_pages])  # r1's current page, listed
    _extend(w, [Req("x")], [PS])  # another request takes it over (reported once, the page changes owner)
    _decode(w, reqs)  # r1 continues in a page that is now x's
    return w


def paged_decode_run_ledger_write_between(verify):
    w, reqs = _start(paged, verify)
    _decode(w, reqs)
    w.ledger["r0"].kv_allocated_len = 3 * PS  # accepted, but no longer what r0's pages say
    _decode(w, reqs)
    w.step()
    return w


def paged_decode_run_lengths_skip(verify):
    w, reqs = _start(paged, verify)
    _decode(w, reqs)
    seq, _, last = decode_args(reqs)
    with w.batch([r.rid for r in reqs]):
        w.alloc_decode(seq + 1, seq + 1, last)  # slots as the run expects, lengths one too far: misaligned
    return w


def paged_decode_run_repeated(verify):
    w, reqs = _start(paged, verify)
    _decode(w, reqs)
    args = decode_args(reqs)
    for _ in range(2):  # the same decode twice: the second repeats the first's slots
        with w.batch([r.rid for r in reqs]):
            w.alloc_decode(*args)
    w.step()
    return w


def paged_decode_run_unbound(verify):
    w = InstrumentedAllocator(paged(), mode="record", verify=verify)
    reqs = [Req(f"r{i}") for i in range(3)]
    split_extend(reqs, [PS] * 3, w.alloc_extend(*extend_args(reqs, [PS] * 3)))  # no batch(): unattributed
    for _ in range(2 * PS):
        out = w.alloc_decode(*decode_args(reqs))
        for r, slot in zip(reqs, out.tolist()):
            r.row.append(slot)
        w.step()
    return w


SCENARIOS = [
    swa_decode_page_in_use,
    swa_decode_peer_misaligned,
    swa_decode_clean,
    paged_decode_reserved_page,
    paged_decode_stolen_page,
    paged_double_free,
    paged_free_out_of_range,
    paged_free_two_owners,
    segment_repeat,
    swa_segment_twice,
    swa_free_in_group,
    paged_decode_run_clean,
    paged_decode_run_stolen_between,
    paged_decode_run_ledger_write_between,
    paged_decode_run_lengths_skip,
    paged_decode_run_repeated,
    paged_decode_run_unbound,
]


def _outcome(w):
    w.flush()
    found = [(v.invariant, v.message, v.rid, v.pool, v.op) for v in w.violations]
    snap = w.snapshot()
    led = w.ledger
    rows = sorted((rid, *(getattr(led[rid], f) for f in ("kv_allocated_len", "kv_committed_len", "swa_evicted_seqlen")))
                  for rid in led)
    owned = {n: a[: led.capacity].tolist() for n, a in led.owned.items()}
    shadows = {n: (s.owner.tolist(), p.shadow.expected_entries) for (n, s), p in zip(snap.items(), w._w_pools.values())}
    return found, rows, owned, shadows

CLEAN = {
    swa_decode_clean,
    paged_free_two_owners,
    paged_decode_run_clean,
    paged_decode_run_repeated,
    paged_decode_run_unbound,
}  # no fault: the fast paths' own bookkeeping is compared


# Against the immediate path without runs. paged_decode_run_free_between is not compared with verify="deferred":
# there the decode's ledger write (host tier, at the call) lands before the free's ledger update (slot tier,
# deferred to the step), in the opposite order from immediate verification, with or without runs.
RUN_SCENARIOS = [
    paged_decode_run_clean,
    paged_decode_run_free_between,
    paged_decode_run_stolen_between,
    paged_decode_run_ledger_write_between,
    paged_decode_run_lengths_skip,
    paged_decode_run_repeated,
    paged_decode_run_unbound,
]


@pytest.mark.parametrize("scenario", RUN_SCENARIOS, ids=lambda f: f.__name__)
def test_decode_run_reports_as_the_full_check(scenario, monkeypatch):
    with_runs = _outcome(scenario("immediate"))
    monkeypatch.setattr(wrapper, "_DecodeRun", lambda *args: None)  # no run is ever kept: every decode in full
    without = _outcome(scenario("immediate"))
    assert with_runs == without
    assert bool(with_runs[0]) == (scenario not in CLEAN)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_fast_path_reports_as_the_general_path(scenario):
    fast, general = _outcome(scenario("immediate")), _outcome(scenario("deferred"))
    assert fast[0] == general[0]
    assert fast[1:] == general[1:]
    if scenario in CLEAN:
        assert fast[0] == []
    else:
        assert fast[0], "the scenario injects a fault"


def test_guard_entry_is_not_a_page():
    w, _ = _start(paged, "immediate")
    shadow = w._w_full.shadow
    assert shadow.owner.size == shadow.num_pages + 1
    assert np.shares_memory(shadow.owner, shadow._owner_ext)


def _run_left(w):
    """How many more decodes the run can verify."""
    run = w._w_run
    return None if run is None else (len(run.o_rows) - run.end) // run.row + 1


def test_decode_run_is_used_on_a_batch_in_step():
    w, reqs = _start(paged, "immediate")
    _decode(w, reqs)
    assert _run_left(w) == PS - 1  # every request opened a page
    for left in range(PS - 2, -1, -1):
        _decode(w, reqs)  # a new batch() each time: the same slots
        assert _run_left(w) == left
    _decode(w, reqs)  # the run is spent: every request opens a page again, a new run starts
    assert _run_left(w) == PS - 1
    assert not w.violations


@pytest.mark.parametrize(
    "between",
    [
        lambda w, reqs, other: w.free(t(other.row)),
        lambda w, reqs, other: w.ledger.__getitem__(other.rid).__setattr__("kv_committed_len", other.seq),
        lambda w, reqs, other: w.ledger.__getitem__(reqs[0].rid).__setattr__("kv_allocated_len", 99),  # rejected
        lambda w, reqs, other: _extend(w, [Req("x")], [1]),
        lambda w, reqs, other: w.clear(),  # then the decode continues pages that are free: reported
    ],
    ids=["free", "ledger_write", "rejected_ledger_write", "alloc", "clear"],
)
def test_decode_run_is_dropped_by_any_change_between_decodes(between, request):
    w, reqs = _start(paged, "immediate")
    batch, other = reqs[:2], reqs[2]
    _decode(w, batch)
    _decode(w, batch)
    left = _run_left(w)
    assert left == PS - 2
    between(w, batch, other)
    n = len(w.violations)
    with w.batch([r.rid for r in batch]):
        w.alloc_decode(*decode_args(batch))  # exactly what the run expects, but it no longer vouches for it
    assert _run_left(w) == left  # the full check ran
    if request.node.callspec.id != "clear":
        assert len(w.violations) == n  # and found nothing: the batch's pages are untouched
    else:
        assert len(w.violations) == n + 1


def test_decode_run_is_per_pool_shadow():
    w, reqs = _start(paged, "immediate")
    _decode(w, reqs)
    run = w._w_run
    assert run.shadow is w._w_full.shadow
    assert run.pages.tolist() == [slot // PS for slot in (r.row[-1] for r in reqs)]


def _random_engine(seed: int, verify: str = "immediate"):
    """A seeded engine: batches in step (so that runs start), with frees, new requests, ledger writes and injected
    faults (an in-use page listed as free) between decodes."""
    rng = np.random.default_rng(seed)
    w = InstrumentedAllocator(
        PagedTokenToKVPoolAllocator(1024, PS, torch.float16, "cpu", None, False), mode="record", verify=verify
    )
    live = [Req(f"r{i}") for i in range(4)]
    _extend(w, live, [PS] * len(live))
    n = len(live)
    for _ in range(60):
        roll = rng.random()
        if roll < 0.06 and live:
            victim = live.pop(int(rng.integers(len(live))))
            w.free(t(victim.row))
            w.release_request(victim.rid)
        elif roll < 0.12:
            new = [Req(f"r{n}")]
            n += 1
            _extend(w, new, [live[0].seq if live else PS])
            live += new
        elif roll < 0.16 and live:
            r = live[int(rng.integers(len(live)))]
            w.ledger[r.rid].kv_committed_len = r.seq  # a checked write of the value it has
        elif roll < 0.19 and live:
            r = live[int(rng.integers(len(live)))]
            w.inner.free_pages = torch.cat([t([r.row[-1] // PS]), w.inner.free_pages])  # fault: listed twice
        if live:
            _decode(w, live)
        w.step()
    return w


@pytest.mark.parametrize("seed", range(12))
def test_decode_run_reports_as_the_full_check_on_a_random_engine(seed, monkeypatch):
    with_runs = _outcome(_random_engine(seed))
    monkeypatch.setattr(wrapper, "_DecodeRun", lambda *args: None)
    assert _outcome(_random_engine(seed)) == with_runs
