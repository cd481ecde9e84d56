"""Scenarios shared by the fast-path behaviour tests: wrapped allocators driven through clean and faulty calls,
each builder ``scenario(verify, fast_paths=True)`` returning the wrapper (``fast_paths``: the constructor's
switch, see ``InstrumentedAllocator``), and ``_outcome(w)``: what two runs must agree on (violations, ledger
rows, page counts, shadows)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import (
    PagedTokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from instrumented_alloc.events import PageUpdate
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


def _start(make, verify, lens=(PS, PS, PS), fast_paths=True):
    w = InstrumentedAllocator(make(), mode="record", verify=verify, sliding_window=2 * PS, fast_paths=fast_paths)
    reqs = [Req(f"r{i}") for i in range(len(lens))]
    _extend(w, reqs, list(lens))
    w.step()
    return w, reqs


def swa_decode_page_in_use(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths)  # every request's next position opens a page
    inner = w.inner.swa_attn_allocator
    inner.free_pages = torch.cat([t([reqs[0].row[0] // PS]), inner.free_pages])  # an SWA page in use, at the head
    _decode(w, reqs)
    return w


def swa_decode_peer_misaligned(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(PS + 1, PS + 1))  # the next position continues a page
    mapping = w.inner.full_to_swa_index_mapping
    last = reqs[1].row[-1]
    mapping[last] = mapping[last] + 1  # the SWA side continues one slot off
    _decode(w, reqs)
    return w


def swa_decode_clean(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(PS - 1, PS, PS + 1))
    for _ in range(2 * PS):
        _decode(w, reqs)
        w.step()
    return w


def paged_decode_reserved_page(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths)
    w.inner.free_pages = torch.cat([t([0]), w.inner.free_pages])
    _decode(w, reqs)
    return w


def paged_decode_stolen_page(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=(PS, PS + 1))
    w.inner.free_pages = torch.cat([t([reqs[1].row[0] // PS]), w.inner.free_pages])
    _decode(w, reqs)
    return w


def paged_double_free(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths)
    w.free(t(reqs[0].row))
    w.free(t(reqs[0].row))
    return w


def paged_free_out_of_range(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths)
    w.free(t([*reqs[1].row, 10_000]))
    w.free(t([-5]))
    return w


def paged_free_two_owners(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths)
    w.free(t(reqs[0].row + reqs[2].row))
    return w


def segment_repeat(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=(2 * PS, PS))
    row = reqs[0].row
    w.free_page_ids(t([row[0] // PS, row[PS] // PS, row[0] // PS]))
    return w


def swa_segment_twice(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(3 * PS, 3 * PS))
    for _ in range(2):
        w.free_swa_segment(t(reqs[0].row[:PS]), start_pos=0)
    w.free_full(t(reqs[1].row))
    return w


def swa_free_in_group(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(2 * PS, 2 * PS, PS))
    w.free_group_begin()
    w.free(t(reqs[0].row))
    w.free(t(reqs[0].row[:1]))  # a page this group holds already: merged by the inner's dedup, no fault
    w.free_swa_segment(t(reqs[1].row), start_pos=0)
    w.free_full(t(reqs[1].row))
    w.free_full(t(reqs[2].row))  # its SWA KV was never freed: swa_mapping_inconsistent
    w.free_group_end()
    return w


# The decode run (fast path "decode_runs"): after a decode in which every request opened a page, the next PS - 1
# decodes of the same requests are verified against the run. Anything that changes the pages' owners or the
# ledger in between must send the next decode through the full check.
def paged_decode_run_clean(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths)  # every request opens a page at the next decode
    for _ in range(3 * PS):
        _decode(w, reqs)
        w.step()
    return w


def paged_decode_run_free_between(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths)
    _decode(w, reqs)  # all open a page: a run starts
    _decode(w, reqs)
    w.free(t(reqs[1].row))  # r1's pages go back to the free list (the engine forgets r1 is still decoding)
    _decode(w, reqs)  # slots and lengths exactly as the run expects: r1 continues in a page that is free now
    return w


def paged_decode_run_stolen_between(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths)
    _decode(w, reqs)
    inner = w.inner
    inner.free_pages = torch.cat([t([reqs[1].row[-1] // PS]), inner.free_pages])  # r1's current page, listed
    _extend(w, [Req("x")], [PS])  # another request takes it over (reported once, the page changes owner)
    _decode(w, reqs)  # r1 continues in a page that is now x's
    return w


def paged_decode_run_ledger_write_between(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths)
    _decode(w, reqs)
    w.ledger["r0"].kv_allocated_len = 3 * PS  # accepted, but no longer what r0's pages say
    _decode(w, reqs)
    w.step()
    return w


def paged_decode_run_lengths_skip(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths)
    _decode(w, reqs)
    seq, _, last = decode_args(reqs)
    with w.batch([r.rid for r in reqs]):
        w.alloc_decode(seq + 1, seq + 1, last)  # slots as the run expects, lengths one too far: misaligned
    return w


def paged_decode_run_repeated(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths)
    _decode(w, reqs)
    args = decode_args(reqs)
    for _ in range(2):  # the same decode twice: the second repeats the first's slots
        with w.batch([r.rid for r in reqs]):
            w.alloc_decode(*args)
    w.step()
    return w


def paged_decode_run_opened_twice(verify, fast_paths=True):
    # The inner lists a free page twice: two requests of a batch in step get it at the same decode (the call
    # passes, the later request owns the page); the earlier one's next decode in that page is reported.
    w, reqs = _start(paged, verify, fast_paths=fast_paths)
    w.inner.free_pages = torch.cat([w.inner.free_pages[:1], w.inner.free_pages])
    _decode(w, reqs)
    _decode(w, reqs)
    return w


def paged_decode_run_unbound(verify, fast_paths=True):
    w = InstrumentedAllocator(paged(), mode="record", verify=verify, fast_paths=fast_paths)
    reqs = [Req(f"r{i}") for i in range(3)]
    split_extend(reqs, [PS] * 3, w.alloc_extend(*extend_args(reqs, [PS] * 3)))  # no batch(): unattributed
    for _ in range(2 * PS):
        out = w.alloc_decode(*decode_args(reqs))
        for r, slot in zip(reqs, out.tolist()):
            r.row.append(slot)
        w.step()
    return w


def paged_frees_clean(verify, fast_paths=True):
    # Every free op the fast path takes on a single pool, outside and inside a free group.
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=(2 * PS + 1, 3 * PS, PS + 2))
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


def swa_frees_clean(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(3 * PS, 2 * PS + 1, 2 * PS, PS + 3))
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


def paged_segment_twice(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=(2 * PS, PS))
    w.free_segment(t(reqs[0].row[PS:]), start_pos=PS)
    w.free_segment(t(reqs[0].row), start_pos=0)  # its second page again: double_free
    w.free_segment(t(reqs[1].row + reqs[1].row), start_pos=0)  # one page twice in one call (no dedup)
    return w


def paged_free_pages_of_two_requests_and_free_page(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=(2 * PS, 2 * PS, PS))
    w.free_full(t(reqs[0].row[:PS] + reqs[1].row[:PS]))  # two owners: the general path, no fault
    w.free_full_segment(t(reqs[2].row), start_pos=0)
    w.free_full_segment(t(reqs[2].row), start_pos=0)  # double_free
    w.free_segment(t([10_000 * PS]), start_pos=0)  # a page past the end
    w.free(t([3]))  # page 0, reserved
    return w


def swa_full_with_live_peer(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(2 * PS, PS))
    w.free_full(t(reqs[0].row))  # its SWA KV still held: swa_mapping_inconsistent
    w.free_full_segment(t(reqs[1].row), start_pos=0)  # the same, by segment
    return w


def swa_segment_of_evicted_peer(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(3 * PS, 2 * PS))
    w.free_swa_segment(t(reqs[0].row[:PS]), start_pos=0)
    w.free_segment(t(reqs[0].row), start_pos=0)  # the first page's SWA peer is gone: unmapped
    # One SWA page twice: reported before the call; the inner then over-credits its pool and its own
    # post-condition raises after the change, which the wrapper mirrors.
    with contextlib.suppress(AssertionError):
        w.free_swa_segment(t(reqs[1].row[PS:] + reqs[1].row[PS:]), start_pos=PS)
    return w


def paged_extend_chunks(verify, fast_paths=True):
    # Extends whose prefixes end inside a page (the open-page mask) and on a boundary (none), clean and with
    # a page in use at the free list's head.
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=(PS + 1, PS, 2))
    _extend(w, reqs, [PS - 1, PS + 3, 1])
    _extend(w, reqs[1:], [2, PS])
    w.inner.free_pages = torch.cat([t([reqs[0].row[0] // PS]), w.inner.free_pages])
    _extend(w, reqs[:1], [PS])  # aligned prefix: duplicate_allocation
    return w


def swa_extend_chunks(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(PS + 1, PS, 2))
    _extend(w, reqs, [PS - 1, PS + 3, 1])
    inner = w.inner.swa_attn_allocator
    page = int(w.inner.full_to_swa_index_mapping[reqs[1].row[0]]) // PS
    inner.free_pages = torch.cat([t([page]), inner.free_pages])
    _extend(w, reqs[:1], [PS])  # the SWA side hands out a page in use
    return w


def paged_extend_runs_clean(verify, fast_paths=True):
    # All-new extends whose pages are runs of PS slots: one request (the last page partial or not), several with
    # whole pages but the last, a second chunk from a page boundary.
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=(2 * PS, PS, PS + 3))
    more = [Req(f"m{i}") for i in range(2)]
    _extend(w, more[:1], [3 * PS - 1])
    _extend(w, reqs[:2], [PS, 2 * PS + 1])
    _extend(w, more[1:], [PS])
    w.step()
    return w


def swa_extend_runs_clean(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(2 * PS, PS, PS + 3))
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


def paged_extend_bad_slots(verify, fast_paths=True):
    w, _ = _start(paged, verify, fast_paths=fast_paths, lens=(PS, PS))

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


def swa_extend_bad_slots(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(PS, PS))
    mapping = w.inner.full_to_swa_index_mapping

    def peer_page_in_use(out):
        mapping[out[:PS]] = mapping[torch.tensor(reqs[0].row)]  # the SWA side lands in a page in use
        return out

    _inner_extend_returns(w, peer_page_in_use)
    _extend(w, [Req("b")], [2 * PS])
    return w


def swa_free_inner_raises_after_the_change(verify, fast_paths=True):
    # A clean free (as the shadow sees it) whose inner over-credits its SWA pool (a page listed free twice by an
    # injected fault) and raises its post-condition after changing its free list: the change is mirrored before
    # the exception propagates, on the fast path as on the general one.
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(4 * PS, 4 * PS))
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


def swa_full_free_inner_raises_after_the_change(verify, fast_paths=True):
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(PS, PS))
    for r in reqs:
        w.free_swa_segment(t(r.row), start_pos=0)  # finished: its SWA KV first (no eviction to record)
    inner = w.inner.full_attn_allocator
    n_free = len(inner.free_pages)
    inner.free_pages = torch.cat([inner.free_pages, inner.free_pages[: inner.num_pages - n_free + 1]])
    with contextlib.suppress(AssertionError):
        w.free_full(t(reqs[0].row))
    w.step()
    return w


def paged_extend_runs_unbound_and_empty(verify, fast_paths=True):
    # Page-run extends without a binding (unowned pages), and with a request that extends by nothing between two
    # that extend by whole pages.
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=(PS, PS, PS))
    more = [Req(f"u{i}") for i in range(2)]
    split_extend(more, [2 * PS, PS + 1], w.alloc_extend(*extend_args(more, [2 * PS, PS + 1])))
    _extend(w, reqs, [PS, 0, 2 * PS + 3])
    w.step()
    return w


def swa_tail_runs(verify, fast_paths=True):
    # PD decode-side preallocation: the full pool for the whole prompt, the SWA pool for its tail only (page runs
    # from position 0 on the SWA side); clean, then with the tail's SWA peers moved into a page in use.
    w, reqs = _start(swa, verify, fast_paths=fast_paths, lens=(PS, PS))
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
    rows = sorted(
        (rid, *(getattr(led[rid], f) for f in ("kv_allocated_len", "kv_committed_len", "swa_evicted_seqlen")))
        for rid in led
    )
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


def _random_engine(seed: int, verify: str = "immediate", fast_paths=True):
    """A seeded engine: batches in step (so that runs start), with frees, new requests, ledger writes and injected
    faults (an in-use page listed as free) between decodes."""
    rng = np.random.default_rng(seed)
    w = InstrumentedAllocator(
        PagedTokenToKVPoolAllocator(1024, PS, torch.float16, "cpu", None, False),
        mode="record",
        verify=verify,
        fast_paths=fast_paths,
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


# Mixed batches: requests that open their pages at different decodes (what a real engine's batch does). Every
# scenario starts from four requests one token apart (PS = 4): one of them opens a page at each decode.
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


def paged_decode_mixed_clean(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=MIXED)
    for _ in range(3 * PS + 1):  # past several cycles of page openings
        _decode(w, reqs)
        w.step()
    return w


def paged_decode_mixed_misaligned(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=MIXED)
    for _ in range(PS + 2):
        _decode(w, reqs)
    i = _continuer(reqs)

    def off_by_one(last):
        last[i] += 1
        return last

    _decode_with(w, reqs, off_by_one)  # a continuing request one slot further: slot_page_alignment
    _decode(w, reqs)
    return w


def paged_decode_mixed_wrong_owner(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=MIXED)
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


def paged_decode_mixed_page_in_use(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=MIXED)
    for _ in range(PS + 1):
        _decode(w, reqs)
    _listed_first(w, reqs[0].row[0] // PS)  # the next opener gets a page in use: duplicate_allocation
    _decode(w, reqs)
    _decode(w, reqs)
    return w


def paged_decode_mixed_reserved_page(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=MIXED)
    for _ in range(2):
        _decode(w, reqs)
    _listed_first(w, 0)
    _decode(w, reqs)
    return w


def paged_decode_mixed_page_outside(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=MIXED)
    for _ in range(2):
        _decode(w, reqs)
    _listed_first(w, 10_000)  # past the pool's last page
    _decode(w, reqs)
    return w


def paged_decode_mixed_opened_twice(verify, fast_paths=True):
    # Two requests of one batch open a page at the same decode and get the same free page (the inner lists it
    # twice): what each path records must agree (the later request ends as the page's owner).
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=(PS, PS, PS + 1, PS + 2))
    for _ in range(PS):
        _decode(w, reqs)
    page = int(w.inner.free_pages[0])
    _listed_first(w, page)
    _decode(w, reqs)
    _decode(w, reqs)
    return w


def paged_decode_mixed_free_between(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=MIXED)
    for _ in range(3):
        _decode(w, reqs)
    w.free(t(reqs[_continuer(reqs)].row))  # a continuing request's pages go back to the free list
    _decode(w, reqs)  # what the batch would decode next
    return w


def paged_decode_mixed_ledger_write_between(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=MIXED)
    for _ in range(3):
        _decode(w, reqs)
    w.ledger[reqs[1].rid].kv_allocated_len = 4 * PS  # accepted, but no longer what its pages say
    for _ in range(PS):
        _decode(w, reqs)
    w.step()
    return w


def paged_decode_mixed_other_request_between(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=MIXED)
    for _ in range(3):
        _decode(w, reqs)
    other = [Req("x")]
    _extend(w, other, [PS + 1])  # another request's extend (the pool's owners change)
    for _ in range(2):
        _decode(w, reqs)
    _decode(w, reqs[:3])  # a smaller batch: another batch, full check
    _decode(w, reqs + other)
    return w


def paged_decode_mixed_lengths_skip(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=MIXED)
    for _ in range(2):
        _decode(w, reqs)
    seq, _, last = decode_args(reqs)
    with w.batch([r.rid for r in reqs]):
        w.alloc_decode(seq + 1, seq + 1, last)  # the expected slots, lengths one too far
    return w


def paged_decode_mixed_repeated(verify, fast_paths=True):
    w, reqs = _start(paged, verify, fast_paths=fast_paths, lens=MIXED)
    for _ in range(2):
        _decode(w, reqs)
    args = decode_args(reqs)
    for _ in range(2):  # the same decode twice: the second repeats the first's slots
        with w.batch([r.rid for r in reqs]):
            w.alloc_decode(*args)
    w.step()
    return w


def paged_decode_mixed_unbound(verify, fast_paths=True):
    w = InstrumentedAllocator(paged(), mode="record", verify=verify, fast_paths=fast_paths)
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


MIXED_SCENARIOS = [
    paged_decode_mixed_clean,
    paged_decode_mixed_misaligned,
    paged_decode_mixed_wrong_owner,
    paged_decode_mixed_page_in_use,
    paged_decode_mixed_reserved_page,
    paged_decode_mixed_page_outside,
    paged_decode_mixed_opened_twice,
    paged_decode_mixed_free_between,
    paged_decode_mixed_ledger_write_between,
    paged_decode_mixed_other_request_between,
    paged_decode_mixed_lengths_skip,
    paged_decode_mixed_repeated,
    paged_decode_mixed_unbound,
]
MIXED_CLEAN = {
    paged_decode_mixed_clean,
    paged_decode_mixed_ledger_write_between,  # the decodes bring the pages back to what the ledger says
    paged_decode_mixed_other_request_between,
}


def _random_mixed_engine(seed: int, verify: str = "immediate", fast_paths=True):
    """A seeded engine whose requests have any length (so that they open pages at different decodes), with frees,
    new requests, ledger writes and injected faults (an in-use page listed as free, page 0 listed, a request's
    last_loc one off) between decodes."""
    rng = np.random.default_rng(seed)
    w = InstrumentedAllocator(
        PagedTokenToKVPoolAllocator(2048, PS, torch.float16, "cpu", None, False),
        mode="record",
        verify=verify,
        fast_paths=fast_paths,
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
    """``scenario(verify)`` with a _PageLog subscribed from the start; ``general``: no fast path at all."""
    log = _PageLog()
    real = InstrumentedAllocator.__init__

    def init(self, inner, **kwargs):
        real(self, inner, **{**kwargs, "sinks": [log]})
        log.start(self)

    with monkeypatch.context() as m:
        m.setattr(InstrumentedAllocator, "__init__", init)
        w = scenario(verify, fast_paths=not general)
        w.flush()
    for name, snap in w.snapshot().items():
        assert log.owners[name].tolist() == snap.owner.tolist(), name  # replay equals the live shadow
    return log


# -- one page handed to two requests in one call (the inner's free list lists it twice) --------------------------
# Reported as duplicate_allocation at the call itself on every path (PoolShadow.shared_in_call); the fast paths
# decline such a call having changed nothing, so the general path's report, state and events are the outcome.


def _listed_twice(alloc) -> None:
    alloc.free_pages = torch.cat([alloc.free_pages[:1], alloc.free_pages])


def _full_inner(w):
    return getattr(w.inner, "full_attn_allocator", w.inner)


def _dup_decode(make, lens=(PS, PS, PS)):
    def scenario(verify, fast_paths=True):
        w, reqs = _start(make, verify, fast_paths=fast_paths, lens=lens)
        _listed_twice(_full_inner(w))
        _decode(w, reqs)
        return w

    scenario.__name__ = f"{make.__name__}_decode_{'_'.join(map(str, lens))}"
    return scenario


def _dup_extend(make, prefix, grow):
    def scenario(verify, fast_paths=True):
        w, reqs = (
            _start(make, verify, fast_paths=fast_paths, lens=prefix)
            if prefix
            else (
                InstrumentedAllocator(
                    make(), mode="record", verify=verify, sliding_window=2 * PS, fast_paths=fast_paths
                ),
                [],
            )
        )
        more = [Req(f"n{i}") for i in range(len(grow) - len(reqs))]
        _listed_twice(_full_inner(w))
        _extend(w, reqs + more, list(grow))
        return w

    scenario.__name__ = f"{make.__name__}_extend_{'_'.join(map(str, prefix))}_by_{'_'.join(map(str, grow))}"
    return scenario


def paged_decode_unbound_opened_twice(verify, fast_paths=True):
    w = InstrumentedAllocator(paged(), mode="record", verify=verify, fast_paths=fast_paths)
    reqs = [Req(f"r{i}") for i in range(3)]
    split_extend(reqs, [PS] * 3, w.alloc_extend(*extend_args(reqs, [PS] * 3)))  # no batch(): unattributed
    _listed_twice(w.inner)
    w.alloc_decode(*decode_args(reqs))
    return w


def paged_extend_unbound_opened_twice(verify, fast_paths=True):
    w = InstrumentedAllocator(paged(), mode="record", verify=verify, fast_paths=fast_paths)
    reqs = [Req(f"r{i}") for i in range(3)]
    _listed_twice(w.inner)
    w.alloc_extend(*extend_args(reqs, [PS, PS, 2]))  # adjacent runs of one page, one per request
    return w


def token_alloc_opened_twice(verify, fast_paths=True):
    w = InstrumentedAllocator(
        TokenToKVPoolAllocator(64, torch.float16, "cpu", None, False),
        mode="record",
        verify=verify,
        fast_paths=fast_paths,
    )
    with w.batch(["a", "b"]):
        w.alloc(4)
    _listed_twice(w.inner)
    with w.batch(["a", "b", "c"]):
        w.alloc(3)  # a decode at page size 1: one slot each, the first slot twice
    return w


def token_alloc_unbound_opened_twice(verify, fast_paths=True):
    w = InstrumentedAllocator(
        TokenToKVPoolAllocator(64, torch.float16, "cpu", None, False),
        mode="record",
        verify=verify,
        fast_paths=fast_paths,
    )
    _listed_twice(w.inner)
    w.alloc(3)
    return w


DUP = {
    # scenario: the first violation's (invariant, message, rid)
    _dup_decode(paged): (
        "alloc_decode handed out [4] (1 pages) to two requests in one call; page 4 went to request slot 0 and to "
        "request slot 1",
        "r0",
    ),
    _dup_decode(paged, (PS, PS + 1, PS)): (  # r1 continues its page: r0 and r2 open the page listed twice
        "alloc_decode handed out [5] (1 pages) to two requests in one call; page 5 went to request slot 0 and to "
        "request slot 2",
        "r0",
    ),
    _dup_decode(swa): (
        "alloc_decode handed out [4] (1 pages) to two requests in one call; page 4 went to request slot 0 and to "
        "request slot 1",
        "r0",
    ),
    _dup_extend(paged, (), (PS, 2 * PS)): (  # page runs
        "alloc_extend handed out [1] (1 pages) to two requests in one call; page 1 went to request slot 0 and to "
        "request slot 1",
        "n0",
    ),
    _dup_extend(paged, (PS, PS + 1), (PS, PS)): (  # r1 continues its page first: the per-slot check
        "alloc_extend handed out [4] (1 pages) to two requests in one call; page 4 went to request slot 0 and to "
        "request slot 1",
        "r0",
    ),
    _dup_extend(swa, (), (PS, PS)): (
        "alloc_extend handed out [1] (1 pages) to two requests in one call; page 1 went to request slot 0 and to "
        "request slot 1",
        "n0",
    ),
    paged_decode_unbound_opened_twice: (
        "alloc_decode handed out [4] (1 pages) to more than one unattributed request in one call (3 pages opened, "
        "2 distinct)",
        None,
    ),
    paged_extend_unbound_opened_twice: (
        "alloc_extend handed out [1] (1 pages) to more than one unattributed request in one call (3 pages opened, "
        "2 distinct)",
        None,
    ),
    token_alloc_opened_twice: (
        "alloc handed out [5] (1 pages) to two requests in one call; page 5 went to request slot 0 and to "
        "request slot 1",
        "a",
    ),
    token_alloc_unbound_opened_twice: (
        "alloc handed out [1] (1 pages) to more than one unattributed request in one call (3 pages opened, 2 distinct)",
        None,
    ),
}
