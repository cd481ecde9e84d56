"""The fast paths (immediate verification: the decode fast path, the one-gather free check, the one-owner free
mirror, SWA peers read with numpy) against the general path (verify="deferred" takes none of them): the same
faults give the same violations -- id, message, request, pool, op -- and leave the same shadow and ledger."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instrumented_alloc import InstrumentedAllocator
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

CLEAN = {swa_decode_clean, paged_free_two_owners}  # no fault: the fast paths' own bookkeeping is compared


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
