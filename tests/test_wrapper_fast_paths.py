"""The fast paths (immediate verification: the decode fast path and its decode runs, the free fast path, the
page-run extend check, the one-gather free check, the one-owner free mirror, SWA peers read with numpy) against the
general path (verify="deferred" takes none of them): the same faults give the same violations -- id, message,
request, pool, op -- and leave the same shadow and ledger."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from instrumented_alloc import InstrumentedAllocator, shadow, wrapper
from instrumented_alloc.allocators import (
    PagedTokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from instrumented_alloc.events import CLOCK_FIELDS, PageUpdate
from instrumented_alloc.invariants import InvariantViolation
from instrumented_alloc.shadow import PoolShadow
from tests.engine_model import Req, decode_args, extend_args, split_extend, t

PS = 4


def paged():
    return PagedTokenToKVPoolAllocator(128, PS, torch.float16, "cpu", None, False)


def swa():
    return SWATokenToKVPoolAllocator(128, 128, PS, torch.float16, "cpu", None, False)


def big_paged():
    return PagedTokenToKVPoolAllocator(1024, PS, torch.float16, "cpu", None, False)


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


def paged_decode_run_opened_twice(verify):
    # The inner lists a free page twice: two requests of a batch in step get it at the same decode (the call
    # passes, the later request owns the page); the earlier one's next decode in that page is reported.
    w, reqs = _start(paged, verify)
    w.inner.free_pages = torch.cat([w.inner.free_pages[:1], w.inner.free_pages])
    _decode(w, reqs)
    _decode(w, reqs)
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


def paged_frees_clean(verify):
    # Every free op the fast path takes on a single pool, outside and inside a free group.
    w, reqs = _start(paged, verify, lens=(2 * PS + 1, 3 * PS, PS + 2))
    extra = [Req(f"x{i}") for i in range(3)]
    _extend(w, extra, [2 * PS, PS + 1, 3 * PS])
    w.free_segment(t(reqs[0].row[PS:]), start_pos=PS)  # a tail by segment, then the rest
    w.free(t(reqs[0].row[:PS]))
    w.free_full(t(reqs[1].row))
    w.free_group_begin()
    w.free_full_segment(t(reqs[2].row), start_pos=0)
    w.free_segment(t(extra[0].row), start_pos=0)
    w.free(t(extra[1].row))
    w.free_group_end()
    w.free(t(extra[2].row + extra[2].row))  # the same pages twice: the inner dedups, no fault
    for r in reqs + extra:
        w.release_request(r.rid)
    w.step()
    return w


def swa_frees_clean(verify):
    w, reqs = _start(swa, verify, lens=(3 * PS, 2 * PS + 1, 2 * PS, PS + 3))
    w.free_swa_segment(t(reqs[0].row[:PS]), start_pos=0)  # an eviction, then the engine's ledger write
    w.ledger[reqs[0].rid].swa_evicted_seqlen = PS
    w.free_swa_segment(t(reqs[0].row[PS:]), start_pos=PS)
    w.free_full(t(reqs[0].row))
    w.free_segment(t(reqs[1].row), start_pos=0)  # both pools by segment
    w.free_group_begin()
    w.free_swa_segment(t(reqs[2].row), start_pos=0)
    w.free_full_segment(t(reqs[2].row), start_pos=0)
    w.free_segment(t(reqs[3].row[PS:]), start_pos=PS)
    w.free_group_end()
    w.free_segment(t(reqs[3].row[:PS]), start_pos=0)
    for r in reqs:
        w.release_request(r.rid)
    w.step()
    return w


def paged_segment_twice(verify):
    w, reqs = _start(paged, verify, lens=(2 * PS, PS))
    w.free_segment(t(reqs[0].row[PS:]), start_pos=PS)
    w.free_segment(t(reqs[0].row), start_pos=0)  # its second page again: double_free
    w.free_segment(t(reqs[1].row + reqs[1].row), start_pos=0)  # one page twice in one call (no dedup)
    return w


def paged_free_pages_of_two_requests_and_free_page(verify):
    w, reqs = _start(paged, verify, lens=(2 * PS, 2 * PS, PS))
    w.free_full(t(reqs[0].row[:PS] + reqs[1].row[:PS]))  # two owners: the general path, no fault
    w.free_full_segment(t(reqs[2].row), start_pos=0)
    w.free_full_segment(t(reqs[2].row), start_pos=0)  # double_free
    w.free_segment(t([10_000 * PS]), start_pos=0)  # a page past the end
    w.free(t([3]))  # page 0, reserved
    return w


def swa_full_with_live_peer(verify):
    w, reqs = _start(swa, verify, lens=(2 * PS, PS))
    w.free_full(t(reqs[0].row))  # its SWA KV still held: swa_mapping_inconsistent
    w.free_full_segment(t(reqs[1].row), start_pos=0)  # the same, by segment
    return w


def swa_segment_of_evicted_peer(verify):
    w, reqs = _start(swa, verify, lens=(3 * PS, 2 * PS))
    w.free_swa_segment(t(reqs[0].row[:PS]), start_pos=0)
    w.free_segment(t(reqs[0].row), start_pos=0)  # the first page's SWA peer is gone: unmapped
    # One SWA page twice: reported before the call; the inner then over-credits its pool and its own
    # post-condition raises after the change, which the wrapper mirrors.
    with contextlib.suppress(AssertionError):
        w.free_swa_segment(t(reqs[1].row[PS:] + reqs[1].row[PS:]), start_pos=PS)
    return w


def paged_extend_chunks(verify):
    # Extends whose prefixes end inside a page (the open-page mask) and on a boundary (none), clean and with
    # a page in use at the free list's head.
    w, reqs = _start(paged, verify, lens=(PS + 1, PS, 2))
    _extend(w, reqs, [PS - 1, PS + 3, 1])
    _extend(w, reqs[1:], [2, PS])
    w.inner.free_pages = torch.cat([t([reqs[0].row[0] // PS]), w.inner.free_pages])
    _extend(w, reqs[:1], [PS])  # aligned prefix: duplicate_allocation
    return w


def swa_extend_chunks(verify):
    w, reqs = _start(swa, verify, lens=(PS + 1, PS, 2))
    _extend(w, reqs, [PS - 1, PS + 3, 1])
    inner = w.inner.swa_attn_allocator
    page = int(w.inner.full_to_swa_index_mapping[reqs[1].row[0]]) // PS
    inner.free_pages = torch.cat([t([page]), inner.free_pages])
    _extend(w, reqs[:1], [PS])  # the SWA side hands out a page in use
    return w


def paged_extend_runs_clean(verify):
    # All-new extends whose pages are runs of PS slots: one request (the last page partial or not), several with
    # whole pages but the last, a second chunk from a page boundary.
    w, reqs = _start(paged, verify, lens=(2 * PS, PS, PS + 3))
    more = [Req(f"m{i}") for i in range(2)]
    _extend(w, more[:1], [3 * PS - 1])
    _extend(w, reqs[:2], [PS, 2 * PS + 1])
    _extend(w, more[1:], [PS])
    w.step()
    return w


def swa_extend_runs_clean(verify):
    w, reqs = _start(swa, verify, lens=(2 * PS, PS, PS + 3))
    _extend(w, reqs[:2], [PS, 2 * PS + 1])
    w.step()
    return w


def _inner_extend_returns(w, change):
    # The inner's own method (its class's), changed by ``change``: one change at a time, not stacked.
    real = type(w.inner).alloc_extend.__get__(w.inner)

    def alloc_extend(*args, **kwargs):
        out = real(*args, **kwargs)
        return out if out is None else change(out.clone())

    w.inner.alloc_extend = alloc_extend


def paged_extend_bad_slots(verify):
    w, _ = _start(paged, verify, lens=(PS, PS))

    def shifted(out):
        return out + 1  # every slot one off its position's offset

    def run_over_two_pages(out):
        out[1] = out[PS + 1]  # aligned, but the first run reaches into the second page
        return out

    last_page = w.inner.num_pages  # far from the free list's head: handed to no one in this scenario

    def run_into_a_free_page(out):
        out[1] = last_page * PS + 1  # into a free page
        return out

    def last_run_into_a_free_page(out):
        out[-1] = (last_page - 1) * PS + 1  # the same in the last, partial run
        return out

    def shared_page(out):
        out[PS : 2 * PS] = out[:PS].clone()  # two runs in one page
        return out

    def reserved(out):
        out[:PS] = torch.arange(PS)  # page 0
        return out

    changes = (shifted, run_over_two_pages, run_into_a_free_page, last_run_into_a_free_page, shared_page, reserved)
    for i, change in enumerate(changes):
        _inner_extend_returns(w, change)
        _extend(w, [Req(f"b{i}")], [2 * PS + 2])
    return w


def swa_extend_bad_slots(verify):
    w, reqs = _start(swa, verify, lens=(PS, PS))
    mapping = w.inner.full_to_swa_index_mapping

    def peer_page_in_use(out):
        mapping[out[:PS]] = mapping[torch.tensor(reqs[0].row)]  # the SWA side lands in a page in use
        return out

    _inner_extend_returns(w, peer_page_in_use)
    _extend(w, [Req("b")], [2 * PS])
    return w


def swa_free_inner_raises_after_the_change(verify):
    # A clean free (as the shadow sees it) whose inner over-credits its SWA pool (a page listed free twice by an
    # injected fault) and raises its post-condition after changing its free list: the change is mirrored before
    # the exception propagates, on the fast path as on the general one.
    w, reqs = _start(swa, verify, lens=(4 * PS, 4 * PS))
    inner = w.inner.swa_attn_allocator
    n_free = len(inner.free_pages)
    inner.free_pages = torch.cat([inner.free_pages, inner.free_pages[: inner.num_pages - n_free + 1]])
    with contextlib.suppress(AssertionError):
        w.free_swa_segment(t(reqs[0].row[:PS]), start_pos=0)
    w.ledger[reqs[0].rid].swa_evicted_seqlen = PS
    with contextlib.suppress(AssertionError):
        w.free_segment(t(reqs[1].row), start_pos=0)  # two pools: through _forward_free
    w.step()
    return w


def swa_full_free_inner_raises_after_the_change(verify):
    w, reqs = _start(swa, verify, lens=(PS, PS))
    for r in reqs:
        w.free_swa_segment(t(r.row), start_pos=0)  # finished: its SWA KV first (no eviction to record)
    inner = w.inner.full_attn_allocator
    n_free = len(inner.free_pages)
    inner.free_pages = torch.cat([inner.free_pages, inner.free_pages[: inner.num_pages - n_free + 1]])
    with contextlib.suppress(AssertionError):
        w.free_full(t(reqs[0].row))
    w.step()
    return w


def paged_extend_runs_unbound_and_empty(verify):
    # Page-run extends without a binding (unowned pages), and with a request that extends by nothing between two
    # that extend by whole pages.
    w, reqs = _start(paged, verify, lens=(PS, PS, PS))
    more = [Req(f"u{i}") for i in range(2)]
    split_extend(more, [2 * PS, PS + 1], w.alloc_extend(*extend_args(more, [2 * PS, PS + 1])))
    _extend(w, reqs, [PS, 0, 2 * PS + 3])
    w.step()
    return w


def swa_tail_runs(verify):
    # PD decode-side preallocation: the full pool for the whole prompt, the SWA pool for its tail only (page runs
    # from position 0 on the SWA side); clean, then with the tail's SWA peers moved into a page in use.
    w, reqs = _start(swa, verify, lens=(PS, PS))
    zero = t([0])
    for i, (fill, tail) in enumerate(((3 * PS + 1, 2 * PS + 1), (2 * PS, 2 * PS), (3 * PS, 2 * PS))):
        with w.batch([f"t{i}"]):
            out = w.alloc_extend_swa_tail(zero, zero, t([fill]), t([fill]), t([-1]), fill, tail)
        w.ledger[f"t{i}"].swa_evicted_seqlen = (fill - tail) // PS * PS
    mapping = w.inner.full_to_swa_index_mapping
    real = type(w.inner).alloc_extend_swa_tail.__get__(w.inner)

    def moved(*args):
        out = real(*args)
        mapping[out[-PS:]] = mapping[torch.tensor(reqs[0].row)]  # the tail's SWA side lands in r0's page
        return out

    w.inner.alloc_extend_swa_tail = moved
    with w.batch(["bad"]):
        out = w.alloc_extend_swa_tail(zero, zero, t([2 * PS]), t([2 * PS]), t([-1]), 2 * PS, PS)
    assert out is not None
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
    paged_decode_run_opened_twice,
    paged_decode_run_unbound,
    paged_frees_clean,
    swa_frees_clean,
    paged_segment_twice,
    paged_free_pages_of_two_requests_and_free_page,
    swa_full_with_live_peer,
    swa_segment_of_evicted_peer,
    paged_extend_chunks,
    swa_extend_chunks,
    paged_extend_runs_clean,
    swa_extend_runs_clean,
    paged_extend_bad_slots,
    swa_extend_bad_slots,
    swa_free_inner_raises_after_the_change,
    swa_full_free_inner_raises_after_the_change,
    paged_extend_runs_unbound_and_empty,
    swa_tail_runs,
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
    paged_frees_clean,
    swa_frees_clean,
    paged_extend_runs_clean,
    swa_extend_runs_clean,
    paged_extend_runs_unbound_and_empty,
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
    paged_decode_run_opened_twice,
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
    spent = w._w_run
    with w.batch([r.rid for r in batch]):
        w.alloc_decode(*decode_args(batch))  # exactly what the run expects, but it no longer vouches for it
    if request.node.callspec.id != "clear":
        assert len(w.violations) == n  # the full check found nothing: the batch's pages are untouched
        # ... and, the batch being in step mid-page, made a run of its own from there to the pages' end (the
        # spent one never advanced: it vouched for nothing).
        assert w._w_run is not spent and _run_left(w) == left - 1
        assert spent.end == spent.row * 2
    else:
        assert len(w.violations) == n + 1
        assert w._w_run is spent and _run_left(w) == left  # the full check ran, and built nothing


def test_decode_run_is_per_pool_shadow():
    w, reqs = _start(paged, "immediate")
    _decode(w, reqs)
    run = w._w_run
    assert run.shadow is w._w_full.shadow
    # The next decode's expected slots: each request's last slot + 1, in the page it opened.
    assert run.o_rows[: run.row] == np.array([r.row[-1] + 1 for r in reqs], np.int64).tobytes()


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


@pytest.mark.parametrize("scenario", [paged_frees_clean, swa_frees_clean], ids=lambda f: f.__name__)
def test_clean_frees_take_the_fast_path(scenario, monkeypatch):
    # Every free of a clean run is judged by the fast path: the general immediate path is never reached.
    def general(*args, **kwargs):
        raise AssertionError("the general free path ran")

    monkeypatch.setattr(InstrumentedAllocator, "_free_now", general)
    assert _outcome(scenario("immediate"))[0] == []


def test_fast_free_refused_in_raise_mode_before_the_inner_sees_it():
    # A fault the fast path leaves to the general path is still refused before the call in raise mode.
    w = InstrumentedAllocator(paged(), mode="raise", verify="immediate")
    reqs = [Req("a")]
    _extend(w, reqs, [2 * PS])
    w.free_segment(t(reqs[0].row[PS:]), start_pos=PS)
    free_before = w.inner.free_pages.clone()
    with pytest.raises(InvariantViolation) as info:
        w.free_segment(t(reqs[0].row), start_pos=0)
    assert info.value.violation.invariant == "double_free"
    assert torch.equal(w.inner.free_pages, free_before)


@pytest.mark.parametrize(
    "scenario", [paged_extend_runs_clean, swa_extend_runs_clean, paged_extend_runs_unbound_and_empty],
    ids=lambda f: f.__name__,
)
def test_clean_page_run_extends_take_the_fast_check(scenario, monkeypatch):
    # Their extends are judged one slot per page: the per-slot check (PoolShadow.on_alloc) never runs.
    def per_slot(*args, **kwargs):
        raise AssertionError("the per-slot extend check ran")

    monkeypatch.setattr(PoolShadow, "on_alloc", per_slot)
    assert _outcome(scenario("immediate"))[0] == []


def _ledger_mismatches(few: bool, monkeypatch):
    # Requests whose pages disagree with their ledger in either pool (and one tainted), compared at a step.
    monkeypatch.setattr(wrapper, "_FEW_DIRTY", 64 if few else 0)
    w, reqs = _start(swa, "immediate", lens=(2 * PS, 2 * PS, PS + 1, 3 * PS, PS))
    led = w.ledger
    slots = [led.slot_of(r.rid) for r in reqs]
    led.owned["full"][slots[0]] += 1
    led.owned["swa"][slots[1]] -= 1
    led.owned["full"][slots[3]] -= 2
    led.owned["swa"][slots[3]] += 1
    led.owned["full"][slots[4]] += 1
    led.tainted.add(slots[4])
    led.dirty.update(slots)
    w.step()
    led.dirty.update(slots)
    w.step()  # the same facts: reported once
    led.owned["swa"][slots[1]] -= 1
    led.dirty.update(slots[:2])
    w.step()  # a new fact for the same request: reported again
    return [(v.invariant, v.message, v.rid, v.pool, v.op) for v in w.violations]


def test_few_and_many_changed_requests_compare_alike(monkeypatch):
    few = _ledger_mismatches(True, monkeypatch)
    assert few == _ledger_mismatches(False, monkeypatch)
    assert [(v[2], v[3]) for v in few] == [("r0", "full"), ("r3", "full"), ("r1", "swa"), ("r3", "swa"), ("r1", "swa")]


# The decode roll (wrapper._DecodeRoll): after a verified decode of a batch whose requests open their pages at
# different decodes, the following decodes of the same requests are verified against it, cycle after cycle.
# Every scenario starts from four requests one token apart (PS = 4): one of them opens a page at each decode.
MIXED = (PS, PS + 1, PS + 2, PS + 3)


def _decode_with(w, reqs, change):
    """One decode of ``reqs`` whose last_loc is changed by ``change`` (a list of slots -> the list passed)."""
    seq, _, _ = decode_args(reqs)
    last = change([r.row[-1] for r in reqs])
    with w.batch([r.rid for r in reqs]):
        out = w.alloc_decode(seq, seq.clone(), t(last))
    if out is not None:
        for r, slot in zip(reqs, out.tolist()):
            r.row.append(slot)


def _continuer(reqs):
    """A request whose next decode continues its page (its last slot is not at a page's last offset)."""
    return next(i for i, r in enumerate(reqs) if (r.seq + 1) % PS != 1)


def paged_decode_roll_clean(verify):
    w, reqs = _start(paged, verify, lens=MIXED)
    for _ in range(3 * PS + 1):  # past several cycles of the roll
        _decode(w, reqs)
        w.step()
    return w


def paged_decode_roll_misaligned(verify):
    w, reqs = _start(paged, verify, lens=MIXED)
    for _ in range(PS + 2):
        _decode(w, reqs)
    i = _continuer(reqs)

    def off_by_one(last):
        last[i] += 1
        return last

    _decode_with(w, reqs, off_by_one)  # a continuing request one slot further: slot_page_alignment
    _decode(w, reqs)
    return w


def paged_decode_roll_wrong_owner(verify):
    w, reqs = _start(paged, verify, lens=MIXED)
    for _ in range(3):
        _decode(w, reqs)
    i = _continuer(reqs)
    j = (i + 1) % len(reqs)

    def into_another_page(last):
        last[i] = reqs[j].row[-1] // PS * PS + last[i] % PS  # the same offset, in another request's page
        return last

    _decode_with(w, reqs, into_another_page)
    return w


def _listed_first(w, page: int) -> None:
    w.inner.free_pages = torch.cat([t([page]), w.inner.free_pages])


def paged_decode_roll_page_in_use(verify):
    w, reqs = _start(paged, verify, lens=MIXED)
    for _ in range(PS + 1):
        _decode(w, reqs)
    _listed_first(w, reqs[0].row[0] // PS)  # the next opener gets a page in use: duplicate_allocation
    _decode(w, reqs)
    _decode(w, reqs)
    return w


def paged_decode_roll_reserved_page(verify):
    w, reqs = _start(paged, verify, lens=MIXED)
    for _ in range(2):
        _decode(w, reqs)
    _listed_first(w, 0)
    _decode(w, reqs)
    return w


def paged_decode_roll_page_outside(verify):
    w, reqs = _start(paged, verify, lens=MIXED)
    for _ in range(2):
        _decode(w, reqs)
    _listed_first(w, 10_000)  # past the pool's last page
    _decode(w, reqs)
    return w


def paged_decode_roll_opened_twice(verify):
    # Two requests of one batch open a page at the same decode and get the same free page (the inner lists it
    # twice): what each path records must agree (the later request ends as the page's owner).
    w, reqs = _start(paged, verify, lens=(PS, PS, PS + 1, PS + 2))
    for _ in range(PS):
        _decode(w, reqs)
    page = int(w.inner.free_pages[0])
    _listed_first(w, page)
    _decode(w, reqs)
    _decode(w, reqs)
    return w


def paged_decode_roll_free_between(verify):
    w, reqs = _start(paged, verify, lens=MIXED)
    for _ in range(3):
        _decode(w, reqs)
    w.free(t(reqs[_continuer(reqs)].row))  # a continuing request's pages go back to the free list
    _decode(w, reqs)  # exactly what the roll expects, but it no longer vouches for it
    return w


def paged_decode_roll_ledger_write_between(verify):
    w, reqs = _start(paged, verify, lens=MIXED)
    for _ in range(3):
        _decode(w, reqs)
    w.ledger[reqs[1].rid].kv_allocated_len = 4 * PS  # accepted, but no longer what its pages say
    for _ in range(PS):
        _decode(w, reqs)
    w.step()
    return w


def paged_decode_roll_other_request_between(verify):
    w, reqs = _start(paged, verify, lens=MIXED)
    for _ in range(3):
        _decode(w, reqs)
    other = [Req("x")]
    _extend(w, other, [PS + 1])  # another request's extend (the pool's owners change)
    for _ in range(2):
        _decode(w, reqs)
    _decode(w, reqs[:3])  # a smaller batch: another batch, full check
    _decode(w, reqs + other)
    return w


def paged_decode_roll_lengths_skip(verify):
    w, reqs = _start(paged, verify, lens=MIXED)
    for _ in range(2):
        _decode(w, reqs)
    seq, _, last = decode_args(reqs)
    with w.batch([r.rid for r in reqs]):
        w.alloc_decode(seq + 1, seq + 1, last)  # slots as the roll expects, lengths one too far
    return w


def paged_decode_roll_repeated(verify):
    w, reqs = _start(paged, verify, lens=MIXED)
    for _ in range(2):
        _decode(w, reqs)
    args = decode_args(reqs)
    for _ in range(2):  # the same decode twice: the second repeats the first's slots
        with w.batch([r.rid for r in reqs]):
            w.alloc_decode(*args)
    w.step()
    return w


def paged_decode_roll_unbound(verify):
    w = InstrumentedAllocator(paged(), mode="record", verify=verify)
    reqs = [Req(f"r{i}") for i in range(len(MIXED))]
    split_extend(reqs, list(MIXED), w.alloc_extend(*extend_args(reqs, list(MIXED))))  # no batch(): unattributed
    for _ in range(2 * PS + 1):
        out = w.alloc_decode(*decode_args(reqs))
        for r, slot in zip(reqs, out.tolist()):
            r.row.append(slot)
        w.step()
    _listed_first(w, reqs[0].row[0] // PS)
    w.alloc_decode(*decode_args(reqs))
    return w


ROLL_SCENARIOS = [
    paged_decode_roll_clean,
    paged_decode_roll_misaligned,
    paged_decode_roll_wrong_owner,
    paged_decode_roll_page_in_use,
    paged_decode_roll_reserved_page,
    paged_decode_roll_page_outside,
    paged_decode_roll_opened_twice,
    paged_decode_roll_free_between,
    paged_decode_roll_ledger_write_between,
    paged_decode_roll_other_request_between,
    paged_decode_roll_lengths_skip,
    paged_decode_roll_repeated,
    paged_decode_roll_unbound,
]
ROLL_CLEAN = {
    paged_decode_roll_clean,
    paged_decode_roll_ledger_write_between,  # the decodes bring the pages back to what the ledger says
    paged_decode_roll_other_request_between,
}


def _no_roll(monkeypatch):
    monkeypatch.setattr(wrapper, "_DecodeRoll", lambda *args: None)  # no roll is ever kept


# A roll is built after _ROLL_AFTER verified decodes of one batch in a row; at 1 the scenarios' faults land on
# decodes the roll verifies (or would), at the default on some before it exists.
ROLL_AFTER = [1, wrapper._ROLL_AFTER]


@pytest.mark.parametrize("roll_after", ROLL_AFTER)
@pytest.mark.parametrize("scenario", ROLL_SCENARIOS, ids=lambda f: f.__name__)
def test_decode_roll_reports_as_the_fast_and_the_general_path(scenario, roll_after, monkeypatch):
    monkeypatch.setattr(wrapper, "_ROLL_AFTER", roll_after)
    with_roll = _outcome(scenario("immediate"))
    if scenario is not paged_decode_roll_free_between:  # see RUN_SCENARIOS on a free between decodes
        assert with_roll == _outcome(scenario("deferred"))  # no fast path at all
    _no_roll(monkeypatch)
    assert with_roll == _outcome(scenario("immediate"))
    assert bool(with_roll[0]) == (scenario not in ROLL_CLEAN)


def _events(scenario, monkeypatch, roll: bool):
    got = []
    real = InstrumentedAllocator.__init__

    def init(self, inner, **kwargs):
        real(self, inner, **{**kwargs, "sinks": [got.extend]})  # every kind built: page deltas, ledger updates

    with monkeypatch.context() as m:
        m.setattr(InstrumentedAllocator, "__init__", init)
        if not roll:
            _no_roll(m)
        scenario("immediate").flush()
    out = []
    for e in got:
        fields = {k: v for k, v in vars(e).items() if k not in CLOCK_FIELDS}
        if "violation" in fields:
            v = fields["violation"]
            fields["violation"] = (v.invariant, v.message, v.rid, v.pool, v.op, v.step)
        out.append((type(e).__name__, {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in fields.items()}))
    return out


@pytest.mark.parametrize("scenario", ROLL_SCENARIOS, ids=lambda f: f.__name__)
def test_decode_roll_publishes_what_the_fast_path_publishes(scenario, monkeypatch):
    monkeypatch.setattr(wrapper, "_ROLL_AFTER", 1)
    assert _events(scenario, monkeypatch, True) == _events(scenario, monkeypatch, False)


def test_decode_roll_verifies_a_mixed_batch_cycle_after_cycle(monkeypatch):
    w, reqs = _start(big_paged, "immediate", lens=MIXED)
    calls = []
    real = InstrumentedAllocator._decode_fast
    monkeypatch.setattr(InstrumentedAllocator, "_decode_fast", lambda self, *a: calls.append(1) or real(self, *a))
    n = wrapper._ROLL_AFTER + 3 * PS
    for _ in range(n):
        _decode(w, reqs)  # a new batch() each time: the same slots
        w.step()
    assert [r.seq for r in reqs] == [x + n for x in MIXED]  # every decode got its slots
    assert len(calls) == wrapper._ROLL_AFTER  # the last of them built the roll; it verified every other one
    assert w._w_st.roll is not None and w._w_st.run is None
    assert not w.violations
    led = w.ledger
    for r in reqs:
        assert led[r.rid].kv_allocated_len == -(-r.seq // PS) * PS
        assert led.owned["full"][led.slot_of(r.rid)] == -(-r.seq // PS)


def test_decode_roll_fault_raises_as_without_it(monkeypatch):
    monkeypatch.setattr(wrapper, "_ROLL_AFTER", 1)

    def run():
        w = InstrumentedAllocator(paged(), mode="raise", verify="immediate")
        reqs = [Req(f"r{i}") for i in range(len(MIXED))]
        _extend(w, reqs, list(MIXED))
        for _ in range(PS + 1):
            _decode(w, reqs)
        _listed_first(w, reqs[0].row[0] // PS)
        with pytest.raises(InvariantViolation) as info:
            _decode(w, reqs)
        v = info.value.violation
        led = w.ledger
        return (
            (v.invariant, v.message, v.rid, v.pool, v.op),
            w.inner.free_pages.tolist(),
            w._w_full.shadow.owner.tolist(),
            [
                (int(led.allocated[s]), int(led.committed[s]), int(led.owned["full"][s]))
                for s in (led.slot_of(r.rid) for r in reqs)
            ],
        )

    with_roll = run()
    _no_roll(monkeypatch)
    assert run() == with_roll
    assert with_roll[0][0] == "duplicate_allocation"


def _random_mixed_engine(seed: int, verify: str = "immediate"):
    """A seeded engine whose requests have any length (so that they open pages at different decodes), with frees,
    new requests, ledger writes and injected faults (an in-use page listed as free, page 0 listed, a request's
    last_loc one off) between decodes."""
    rng = np.random.default_rng(seed)
    w = InstrumentedAllocator(
        PagedTokenToKVPoolAllocator(2048, PS, torch.float16, "cpu", None, False), mode="record", verify=verify
    )
    live = [Req(f"r{i}") for i in range(5)]
    _extend(w, live, [int(x) for x in rng.integers(1, 3 * PS, len(live))])
    n = len(live)
    for _ in range(80):
        roll = rng.random()
        if roll < 0.05 and live:
            victim = live.pop(int(rng.integers(len(live))))
            w.free(t(victim.row))
            w.release_request(victim.rid)
        elif roll < 0.10:
            new = [Req(f"r{n}")]
            n += 1
            _extend(w, new, [int(rng.integers(1, 3 * PS))])
            live += new
        elif roll < 0.13 and live:
            r = live[int(rng.integers(len(live)))]
            w.ledger[r.rid].kv_committed_len = r.seq  # a checked write of the value it has
        elif roll < 0.15 and live:
            r = live[int(rng.integers(len(live)))]
            _listed_first(w, r.row[-1] // PS)  # fault: a page in use listed as free
        elif roll < 0.16:
            _listed_first(w, 0)  # fault: the reserved page listed as free
        elif roll < 0.18 and live:
            i = int(rng.integers(len(live)))

            def off(last, i=i):
                last[i] += 1
                return last

            _decode_with(w, live, off)  # fault: a request's last_loc one off
        if live:
            _decode(w, live)
        w.step()
    return w


def _same_until_pages_shared(immediate, deferred) -> bool:
    """What deferred verification promises against immediate (README, Using the wrapper): the same findings and
    state, except that after a fault that leaves one page with two requests (``duplicate_allocation``) a later free
    of it moves the other request's ledger at the step boundary, after the host-side writes made in between; from
    there on, findings and ledger rows of those requests may differ. Up to and including the first such finding
    the violations are the same; with none, everything is."""
    found_i, found_d = immediate[0], deferred[0]
    dup = next((i for i, v in enumerate(found_i) if v[0] == "duplicate_allocation"), None)
    if dup is None:
        return immediate == deferred
    return found_i[: dup + 1] == found_d[: dup + 1]


@pytest.mark.parametrize("roll_after", ROLL_AFTER)
@pytest.mark.parametrize("seed", range(12))
def test_decode_roll_reports_as_the_full_check_on_a_random_engine(seed, roll_after, monkeypatch):
    monkeypatch.setattr(wrapper, "_ROLL_AFTER", roll_after)
    with_roll = _outcome(_random_mixed_engine(seed))
    assert _same_until_pages_shared(with_roll, _outcome(_random_mixed_engine(seed, "deferred")))
    _no_roll(monkeypatch)
    assert _outcome(_random_mixed_engine(seed)) == with_roll


# Seeds where the two modes part after a page went to two requests (the first four of seeds 0-119; about 4% of
# seeds do): the comparison above holds there too, and the roll still matches the full check exactly.
@pytest.mark.parametrize("seed", [18, 34, 38, 89])
def test_decode_roll_on_engines_where_the_modes_part_after_a_shared_page(seed, monkeypatch):
    with_roll = _outcome(_random_mixed_engine(seed))
    deferred = _outcome(_random_mixed_engine(seed, "deferred"))
    assert with_roll != deferred  # they do part here (the case is not vacuous)
    assert _same_until_pages_shared(with_roll, deferred)
    _no_roll(monkeypatch)
    assert _outcome(_random_mixed_engine(seed)) == with_roll


def test_decode_roll_is_not_built_for_a_batch_that_changes_at_every_decode():
    w, reqs = _start(big_paged, "immediate", lens=MIXED)
    for i in range(wrapper._ROLL_AFTER + 2 * PS):
        _decode(w, reqs[: 3 + i % 2])  # three requests, then four, then three ...
        assert w._w_st.roll is None
    for _ in range(wrapper._ROLL_AFTER + PS):
        _decode(w, reqs[:3])  # the same batch from now on
    assert w._w_st.roll is not None
    assert not w.violations


def test_decode_roll_is_not_built_while_other_allocations_come_between_decodes():
    # Another request's allocation between decodes would drop a roll at once: none is built.
    w, reqs = _start(big_paged, "immediate", lens=MIXED)
    for i in range(wrapper._ROLL_AFTER + 2 * PS):
        other = Req(f"x{i}")
        _extend(w, [other], [1])
        _decode(w, reqs)
        assert w._w_st.roll is None
        w.free(t(other.row))
        w.release_request(other.rid)
    assert not w.violations


def test_decode_roll_used_on_the_random_engines(monkeypatch):
    # The random engines' decodes do reach the roll (the comparison above is not vacuous).
    monkeypatch.setattr(wrapper, "_ROLL_AFTER", 1)
    used = []
    real = InstrumentedAllocator._decode_roll

    def counted(self, *args):
        n = real(self, *args)
        used.append(n is not None)
        return n

    monkeypatch.setattr(InstrumentedAllocator, "_decode_roll", counted)
    for seed in range(4):
        _random_mixed_engine(seed)
    assert sum(used) > 20


def _bind_without_memo(monkeypatch):
    """Every batch() binds from scratch: the thread's remembered bindings are dropped first."""
    real = InstrumentedAllocator._bind

    def bind(self, rids, lens):
        self._w_tls.__dict__.pop("memo", None)
        return real(self, rids, lens)

    monkeypatch.setattr(InstrumentedAllocator, "_bind", bind)


@pytest.mark.parametrize("seed", range(6))
def test_remembered_bindings_attribute_as_fresh_ones_on_a_random_engine(seed, monkeypatch):
    # The random engine binds the same live batch decode after decode, and changes it (a release, a new request)
    # between some of them.
    remembered = _outcome(_random_engine(seed))
    _bind_without_memo(monkeypatch)
    assert _outcome(_random_engine(seed)) == remembered


def _rebind_after_release(verify):
    # The same ids bound again after one of them was released and came back (a new slot, maybe another's old
    # one), and after another request took the released slot.
    w = InstrumentedAllocator(paged(), mode="record", verify=verify)
    a, b = Req("a"), Req("b")
    _extend(w, [a, b], [PS, PS])
    _decode(w, [a, b])
    w.free(t(a.row))
    w.release_request("a")
    c = Req("c")
    _extend(w, [c], [PS])  # takes a's slot
    a = Req("a")
    _extend(w, [a], [PS])
    for _ in range(PS + 1):
        _decode(w, [a, b])
        w.step()
    return w


def test_remembered_binding_follows_a_release(monkeypatch):
    remembered = _outcome(_rebind_after_release("immediate"))
    assert remembered[0] == []
    _bind_without_memo(monkeypatch)
    assert _outcome(_rebind_after_release("immediate")) == remembered


def test_remembered_binding_still_rejects_bad_ids():
    w = InstrumentedAllocator(paged(), mode="record", verify="immediate")
    reqs = [Req("a"), Req("b")]
    _extend(w, reqs, [PS, PS])
    _decode(w, reqs)  # ("a", "b") is remembered now
    with pytest.raises(ValueError, match="appears twice"), w.batch(["a", "a"]):
        pass
    with pytest.raises(TypeError, match="hashable"), w.batch(["a", ["b"]]):
        pass
    with pytest.raises(RuntimeError, match="nest"), w.batch(["a", "b"]), w.batch(["a", "b"]):
        pass
    _decode(w, reqs)  # the refused bindings left nothing bound: this one binds and attributes as before
    w.step()
    assert not w.violations
    assert [w.ledger[r.rid].kv_committed_len for r in reqs] == [PS + 2, PS + 2]


def _slot_arrays(rng):
    """Slot arrays a free may pass: page-run rows (whole, a partial last page, from mid-page), rows with a page
    twice, shuffled slots, negative and huge values, runs of one value, and short ones."""
    for n_pages in (1, 2, 5, 17, 70):
        pages = rng.choice(4096, size=n_pages, replace=False)
        row = (pages[:, None] * PS + np.arange(PS)).reshape(-1)
        yield row
        yield row[: -(PS - 1)]  # the last page partial
        yield row[1:]  # from mid-page
        yield np.concatenate([row, row[:PS]])  # a page twice
        yield rng.permutation(row)
        yield row[::-1].copy()
    for n in (1, 2, 3, 63, 64, 65, 200):
        yield rng.integers(-3 * PS, 50 * PS, size=n)
        yield np.full(n, 7 * PS + 1)
    yield np.array([-PS, -PS + 1, -PS + 2, -1])  # a run in the negative page -1
    yield np.array([2**40 * PS + i for i in range(PS)])


def test_distinct_pages_and_sorted_unique_are_np_unique():
    rng = np.random.default_rng(0)
    offsets = np.arange(PS, dtype=np.int64)
    shift = PS.bit_length() - 1
    for slots in _slot_arrays(rng):
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        want = np.unique(slots >> shift)
        for got in (wrapper._distinct_pages(slots, PS, shift, offsets), shadow.sorted_unique(slots >> shift)):
            assert got.dtype == np.int64
            assert got.tolist() == want.tolist()
            assert not np.shares_memory(got, slots)


# -- page deltas: what PageUpdate lists (see its contract in events.py) -------------------------------------------
class _PageLog:
    """A sink that reads PageUpdate alone and replays it on the pools' owners from the wrapper's construction."""

    event_types = frozenset({PageUpdate})

    def __init__(self):
        self.updates: list = []
        self.owners: dict = {}
        self.no_ops = 0  # entries that found their page already reading that owner (clear's reset aside)
        self.repeats = 0  # entries of a page listed earlier in the same update

    def start(self, w) -> None:
        self.owners = {n: s.owner.copy() for n, s in w.snapshot().items()}

    def __call__(self, batch) -> None:
        for e in batch:
            owner = self.owners[e.pool]
            assert e.pages.dtype == np.int64 and e.owners.dtype == np.int32 and e.pages.shape == e.owners.shape
            assert e.pages.size  # never empty
            if e.pages.size != owner.size:
                self.no_ops += int(np.count_nonzero(owner[e.pages] == e.owners))
                self.repeats += e.pages.size - np.unique(e.pages).size
            self.updates.append((e.pool, e.pages.tolist(), e.owners.tolist()))
            owner[e.pages] = e.owners


def _page_log(scenario, verify: str, monkeypatch, general: bool = False):
    """``scenario(verify)`` with a _PageLog subscribed from the start; ``general``: immediate checks with no fast
    path (no decode run, roll or fast decode, no page-run extend check, no free fast path)."""
    log = _PageLog()
    real = InstrumentedAllocator.__init__

    def init(self, inner, **kwargs):
        real(self, inner, **{**kwargs, "sinks": [log]})
        log.start(self)

    with monkeypatch.context() as m:
        m.setattr(InstrumentedAllocator, "__init__", init)
        if general:
            m.setattr(wrapper, "_DecodeRun", lambda *args: None)
            _no_roll(m)
            m.setattr(InstrumentedAllocator, "_decode_fast", lambda *args: None)
            m.setattr(InstrumentedAllocator, "_alloc_runs", lambda *args: False)
            m.setattr(InstrumentedAllocator, "_free_fast", lambda *args: wrapper._ABSENT)
        w = scenario(verify)
        w.flush()
    for name, snap in w.snapshot().items():
        assert log.owners[name].tolist() == snap.owner.tolist(), name  # replay equals the live shadow
    return log


CLEAN_PAGE_SCENARIOS = [
    paged_decode_run_clean,
    paged_decode_run_unbound,
    paged_decode_roll_clean,
    paged_extend_runs_clean,
    swa_extend_runs_clean,
    swa_decode_clean,
    paged_frees_clean,
    swa_frees_clean,
]


@pytest.mark.parametrize("scenario", CLEAN_PAGE_SCENARIOS, ids=lambda f: f.__name__)
def test_page_deltas_of_clean_calls_list_changes_alone_on_every_path(scenario, monkeypatch):
    # Every path publishes the same page deltas, and in calls that pass every check each entry changes its page's
    # owner (a decode that opens no page publishes none; an extend one entry per page, not per slot).
    fast = _page_log(scenario, "immediate", monkeypatch)
    assert (fast.no_ops, fast.repeats) == (0, 0)
    assert _page_log(scenario, "immediate", monkeypatch, general=True).updates == fast.updates
    assert _page_log(scenario, "deferred", monkeypatch).updates == fast.updates


@pytest.mark.parametrize(
    "scenario",
    [s for s in RUN_SCENARIOS + ROLL_SCENARIOS + SCENARIOS if s not in CLEAN_PAGE_SCENARIOS],
    ids=lambda f: f.__name__,
)
def test_page_deltas_of_faulty_calls_replay_to_the_shadow(scenario, monkeypatch):
    # Faults keep whatever entries their judged paths write (no-ops included): replay still equals the shadow.
    for verify in ("immediate", "deferred"):
        _page_log(scenario, verify, monkeypatch)
    _page_log(scenario, "immediate", monkeypatch, general=True)


def test_decode_page_delta_lists_the_opened_pages_in_batch_order(monkeypatch):
    monkeypatch.setattr(wrapper, "_ROLL_AFTER", 1)
    w, reqs = _start(big_paged, "immediate", lens=MIXED)
    log = _PageLog()
    log.start(w)
    w.subscribe(log)
    for _ in range(2 * PS):
        openers = [r for r in reqs if r.seq % PS == 0]  # the next position is a page's first
        n = len(log.updates)
        _decode(w, reqs)
        if not openers:
            assert len(log.updates) == n  # nothing changed: no PageUpdate
            continue
        (update,) = log.updates[n:]
        led = w.ledger
        assert update == ("full", [r.row[-1] // PS for r in openers], [led.slot_of(r.rid) for r in openers])
    assert w._w_st.roll is not None  # the roll verified these decodes


def test_extend_page_delta_lists_each_new_page_once(monkeypatch):
    # A chunk from inside a page: the continued page has no entry, each new page one (per-slot check).
    for general in (False, True):
        w, reqs = _start(paged, "immediate", lens=(PS + 1, PS))
        log = _PageLog()
        log.start(w)
        w.subscribe(log)
        with monkeypatch.context() as m:
            if general:
                m.setattr(InstrumentedAllocator, "_alloc_runs", lambda *args: False)
            _extend(w, reqs, [2 * PS + 1, PS + 2])
        a, b = (w.ledger.slot_of(r.rid) for r in reqs)
        pages = [reqs[0].row[s] // PS for s in (2 * PS, 3 * PS)] + [reqs[1].row[s] // PS for s in (PS, 2 * PS)]
        assert log.updates == [("full", pages, [a, a, b, b])]


# Page counts (wrapper._page_counter): our paged allocator's free + staged pages read directly (free_pages.shape[0]),
# what every count check of the wrapper compares, against the allocator's own available_size() // page_size.
def _generic_counter(allocator, ps):
    def count():
        return allocator.available_size() // ps

    def probe():
        return allocator.available_size()

    return count, probe


def _checked_counts(monkeypatch):
    """Every step() first asserts that each pool's count reads what its allocator's available_size() says."""
    real = InstrumentedAllocator.step
    seen = []

    def step(self):
        for p in self._w_pools.values():
            assert p.count() == p.allocator.available_size() // p.page_size
            assert p.probe() * p.page_size == p.allocator.available_size()  # probe: the same count, in pages
            seen.append(p.count is p.probe)  # the direct read (the generic counter's are two functions)
        return real(self)

    monkeypatch.setattr(InstrumentedAllocator, "step", step)
    return seen


@pytest.mark.parametrize("seed", range(4))
def test_page_counts_read_what_available_size_reads(seed, monkeypatch):
    seen = _checked_counts(monkeypatch)
    _random_engine(seed)
    assert len(seen) > 50 and all(seen)


def _sim_outcome(preset, seed, inject):
    from instrumented_alloc.sim import build_engine

    e = build_engine(preset, seed=seed, inject=inject, steps=300, verify="immediate")
    e.run(300)
    e.shutdown()
    direct = [p.count is p.probe for p in e.alloc._w_pools.values()]
    return _outcome(e.alloc), direct


SIM_CASES = [
    ("swa-128", ("duplicate-alloc@40", "double-free@60", "leak@80")),
    ("swa-128", ("swa-misaligned@50", "segment-unaligned@90")),
    ("dense", ("duplicate-alloc@40", "double-free@60", "leak@80")),
]


@pytest.mark.parametrize("case", range(len(SIM_CASES)))
@pytest.mark.parametrize("seed", range(2))
def test_page_counts_report_as_available_size_on_faulted_engines(case, seed, monkeypatch):
    # The demo engine with faults that corrupt the free lists (a page listed while in use, freed twice, leaked):
    # every count check reports and resyncs as with the allocator's available_size() read each time.
    preset, inject = SIM_CASES[case]
    fast, direct = _sim_outcome(preset, seed, inject)
    assert fast[0] and all(direct)  # faults reported, counts read directly (the comparison is not vacuous)
    monkeypatch.setattr(wrapper, "_page_counter", _generic_counter)
    general, direct = _sim_outcome(preset, seed, inject)
    assert not any(direct)
    assert general == fast


def test_page_counts_on_an_swa_engine_read_available_size(monkeypatch):
    seen = _checked_counts(monkeypatch)
    from instrumented_alloc.sim import build_engine

    e = build_engine("swa-128", seed=3, inject=("duplicate-alloc@40", "double-free@60"), steps=200, verify="immediate")
    e.run(200)
    assert len(seen) >= 400 and all(seen)  # two pools, every step


def test_page_count_follows_an_available_size_set_on_the_instance():
    # A patched available_size (on the instance, after wrapping) is what the count checks read: a count that
    # disagrees with the shadow is reported at the next step, as without the direct read.
    found = []
    for counter in (wrapper._page_counter, _generic_counter):
        real = wrapper._page_counter
        wrapper._page_counter = counter
        try:
            w, _ = _start(swa, "immediate")
        finally:
            wrapper._page_counter = real
        inner = w.inner.swa_attn_allocator
        size = inner.available_size()
        inner.available_size = lambda size=size: size - PS  # one page fewer than the shadow expects
        w.step()
        found.append([(v.invariant, v.pool, v.op) for v in w.violations])
        assert w._w_swa.count() == (size - PS) // PS
    assert found[0] == found[1] != []


def test_page_count_reads_staged_pages_with_need_sort():
    inner = PagedTokenToKVPoolAllocator(128, PS, torch.float16, "cpu", None, True)
    w = InstrumentedAllocator(inner, mode="record", verify="immediate")
    reqs = [Req("a"), Req("b")]
    _extend(w, reqs, [2 * PS, PS])
    w.free(t(reqs[0].row))
    assert inner.num_staged_pages == 2
    assert w._w_full.count() == inner.available_size() // PS == len(inner.free_pages) + 2
    w.step()
    assert list(w.violations) == []


# -- one page handed to two requests in one call (the inner's free list lists it twice) --------------------------
# Reported as duplicate_allocation at the call itself on every path (PoolShadow.shared_in_call); the fast paths
# decline such a call having changed nothing, so the general path's report, state and events are the outcome.


def _listed_twice(alloc) -> None:
    alloc.free_pages = torch.cat([alloc.free_pages[:1], alloc.free_pages])


def _full_inner(w):
    return getattr(w.inner, "full_attn_allocator", w.inner)


def _dup_decode(make, lens=(PS, PS, PS)):
    def scenario(verify):
        w, reqs = _start(make, verify, lens=lens)
        _listed_twice(_full_inner(w))
        _decode(w, reqs)
        return w

    scenario.__name__ = f"{make.__name__}_decode_{'_'.join(map(str, lens))}"
    return scenario


def _dup_extend(make, prefix, grow):
    def scenario(verify):
        w, reqs = _start(make, verify, lens=prefix) if prefix else (InstrumentedAllocator(
            make(), mode="record", verify=verify, sliding_window=2 * PS), [])
        more = [Req(f"n{i}") for i in range(len(grow) - len(reqs))]
        _listed_twice(_full_inner(w))
        _extend(w, reqs + more, list(grow))
        return w

    scenario.__name__ = f"{make.__name__}_extend_{'_'.join(map(str, prefix))}_by_{'_'.join(map(str, grow))}"
    return scenario


def paged_decode_unbound_opened_twice(verify):
    w = InstrumentedAllocator(paged(), mode="record", verify=verify)
    reqs = [Req(f"r{i}") for i in range(3)]
    split_extend(reqs, [PS] * 3, w.alloc_extend(*extend_args(reqs, [PS] * 3)))  # no batch(): unattributed
    _listed_twice(w.inner)
    w.alloc_decode(*decode_args(reqs))
    return w


def paged_extend_unbound_opened_twice(verify):
    w = InstrumentedAllocator(paged(), mode="record", verify=verify)
    reqs = [Req(f"r{i}") for i in range(3)]
    _listed_twice(w.inner)
    w.alloc_extend(*extend_args(reqs, [PS, PS, 2]))  # adjacent runs of one page, one per request
    return w


def token_alloc_opened_twice(verify):
    w = InstrumentedAllocator(TokenToKVPoolAllocator(64, torch.float16, "cpu", None, False), mode="record",
                              verify=verify)
    with w.batch(["a", "b"]):
        w.alloc(4)
    _listed_twice(w.inner)
    with w.batch(["a", "b", "c"]):
        w.alloc(3)  # a decode at page size 1: one slot each, the first slot twice
    return w


def token_alloc_unbound_opened_twice(verify):
    w = InstrumentedAllocator(TokenToKVPoolAllocator(64, torch.float16, "cpu", None, False), mode="record",
                              verify=verify)
    _listed_twice(w.inner)
    w.alloc(3)
    return w


DUP = {
    # scenario: the first violation's (invariant, message, rid)
    _dup_decode(paged): (
        "alloc_decode handed out [4] (1 pages) to two requests in one call; page 4 went to request slot 0 and to "
        "request slot 1", "r0"),
    _dup_decode(paged, (PS, PS + 1, PS)): (  # r1 continues its page: r0 and r2 open the page listed twice
        "alloc_decode handed out [5] (1 pages) to two requests in one call; page 5 went to request slot 0 and to "
        "request slot 2", "r0"),
    _dup_decode(swa): (
        "alloc_decode handed out [4] (1 pages) to two requests in one call; page 4 went to request slot 0 and to "
        "request slot 1", "r0"),
    _dup_extend(paged, (), (PS, 2 * PS)): (  # page runs
        "alloc_extend handed out [1] (1 pages) to two requests in one call; page 1 went to request slot 0 and to "
        "request slot 1", "n0"),
    _dup_extend(paged, (PS, PS + 1), (PS, PS)): (  # r1 continues its page first: the per-slot check
        "alloc_extend handed out [4] (1 pages) to two requests in one call; page 4 went to request slot 0 and to "
        "request slot 1", "r0"),
    _dup_extend(swa, (), (PS, PS)): (
        "alloc_extend handed out [1] (1 pages) to two requests in one call; page 1 went to request slot 0 and to "
        "request slot 1", "n0"),
    paged_decode_unbound_opened_twice: (
        "alloc_decode handed out [4] (1 pages) to more than one unattributed request in one call (3 pages opened, "
        "2 distinct)", None),
    paged_extend_unbound_opened_twice: (
        "alloc_extend handed out [1] (1 pages) to more than one unattributed request in one call (3 pages opened, "
        "2 distinct)", None),
    token_alloc_opened_twice: (
        "alloc handed out [5] (1 pages) to two requests in one call; page 5 went to request slot 0 and to "
        "request slot 1", "a"),
    token_alloc_unbound_opened_twice: (
        "alloc handed out [1] (1 pages) to more than one unattributed request in one call (3 pages opened, "
        "2 distinct)", None),
}


@pytest.mark.parametrize("scenario", list(DUP), ids=lambda f: f.__name__)
def test_page_handed_to_two_requests_in_one_call_is_reported_at_the_call(scenario):
    message, rid = DUP[scenario]
    w = scenario("immediate")
    first = w.violations[0]  # at the call, before any step or flush
    assert (first.invariant, first.message, first.rid) == ("duplicate_allocation", message, rid)
    assert first.step == w.step_count
    assert first.op == message.split()[0]
    fast, general = _outcome(w), _outcome(scenario("deferred"))
    assert fast == general
    assert fast[0][0][:3] == ("duplicate_allocation", message, rid)


@pytest.mark.parametrize("scenario", list(DUP), ids=lambda f: f.__name__)
def test_page_handed_to_two_requests_in_one_call_fast_path_declines_unchanged(scenario, monkeypatch):
    # The fast paths off (the page-run extend check, the decode fast path, alloc's fast path): the same outcome.
    fast = _outcome(scenario("immediate"))
    monkeypatch.setattr(InstrumentedAllocator, "_alloc_runs", lambda *args: False)
    monkeypatch.setattr(InstrumentedAllocator, "_decode_fast", lambda *args: None)
    monkeypatch.setattr(InstrumentedAllocator, "_alloc_fast", lambda *args: False)
    assert _outcome(scenario("immediate")) == fast


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
def test_page_handed_to_two_requests_in_one_call_raises_after_the_call(verify):
    w = InstrumentedAllocator(paged(), mode="raise", verify=verify)
    reqs = [Req(f"r{i}") for i in range(3)]
    _extend(w, reqs, [PS] * 3)
    w.step()
    _listed_twice(w.inner)
    n_free = len(w.inner.free_pages)
    with pytest.raises(InvariantViolation) as info:
        _decode(w, reqs)
        w.step()  # deferred: the call is verified at the step
    assert info.value.violation.invariant == "duplicate_allocation"
    assert info.value.violation.rid == "r0"
    assert len(w.inner.free_pages) == n_free - 3  # the inner's call went through: raised after it


def test_page_handed_to_two_requests_in_one_call_by_the_roll(monkeypatch):
    # The roll vouches for the batch; the call that opens a page listed twice is reported at once.
    monkeypatch.setattr(wrapper, "_ROLL_AFTER", 1)
    w = paged_decode_roll_opened_twice("immediate")
    dup = [v for v in w.violations if v.invariant == "duplicate_allocation"]
    assert dup and "to two requests in one call" in dup[0].message
    _no_roll(monkeypatch)
    assert _outcome(paged_decode_roll_opened_twice("immediate")) == _outcome(w)


@pytest.mark.parametrize("scenario", list(DUP), ids=lambda f: f.__name__)
def test_page_handed_to_two_requests_in_one_call_publishes_what_the_general_path_publishes(scenario, monkeypatch):
    fast = _page_log(scenario, "immediate", monkeypatch)  # replay equals the live shadow (asserted inside)
    assert _page_log(scenario, "immediate", monkeypatch, general=True).updates == fast.updates
