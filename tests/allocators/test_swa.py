"""SWATokenToKVPoolAllocator against the spec (shared/reference/sglang-allocator-semantics.md).

Expected slots, free lists and mapping entries are derived in this file from the spec's rules (``SWAModel``
built on the paged rules ``expected_extend``/``expected_decode``) and from examples worked by hand; they are never
copied from a run of the allocator. Spec rules exercised:
- a full pool (``size``) and a swa pool (``size_swa``), Token or Paged by page size, linked by
  ``full_to_swa_index_mapping`` of length size+page_size+1 whose last entry is -1 (``last_loc=-1`` maps to -1);
  0 means "no live SWA peer".
- ``available_size()`` = min(full, swa); ``full_available_size()``, ``swa_available_size()``, ``size_full``,
  ``size_swa``.
- ``alloc_extend``/``alloc_decode``: the paged rules in both pools with the same seq lens, the swa side continuing
  from ``last_loc`` translated through the mapping; the mapping records full->swa; the FULL slots are returned.
- ``alloc_extend_swa_tail``: batch size 1; full slots for the whole extend, SWA slots only for the last
  ``swa_tail_len`` tokens; the mapping of the non-tail part is cleared.
- ``free`` = ``free_swa`` then ``free_full``; ``free_swa`` releases the SWA peers of the pages touched and clears
  their mapping; ``free_swa_segment`` is the same for a row segment from a page-aligned start; free groups also
  open/close the inner full allocator's group.
- Page size 1: the engine calls ``alloc(n)``; the SWA allocator asserts page_size > 1 in ``alloc_extend``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from instrumented_alloc.allocators import SWATokenToKVPoolAllocator
from instrumented_alloc.argcheck import ArgumentError

CPU = torch.device("cpu")
META = torch.device("meta")
PS = 4


def t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=CPU)


def make(full_pages=16, swa_pages=8, ps=PS, need_sort=False):
    return SWATokenToKVPoolAllocator(
        full_pages * ps, swa_pages * ps, ps, torch.float16, "cpu", kvcache=None, need_sort=need_sort
    )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- the spec's rules, as plain Python ---------------------------------------------------------------------------


def expected_extend(prefixes, seqs, last_locs, free_list, ps):
    """Paged extend rule: per request, continue from last_loc+1 to the end of the partial page, then new pages
    from the head of the free list (page*ps + offset). Returns (slots, pages taken)."""
    out, head = [], 0
    for prefix, seq, last_loc in zip(prefixes, seqs, last_locs, strict=True):
        n1 = max(0, min(seq, ceil_div(prefix, ps) * ps) - prefix)
        out += [last_loc + 1 + k for k in range(n1)]
        pos = prefix + n1
        while pos < seq:
            page = free_list[head]
            head += 1
            out += [page * ps + k for k in range(min(ps, seq - pos))]
            pos += ps
    return out, head


def expected_decode(seqs, last_locs, free_list, ps):
    """Paged decode rule: a new page's first slot when (seq-1) % ps == 0, else last_loc + 1."""
    out, head = [], 0
    for seq, last_loc in zip(seqs, last_locs, strict=True):
        if (seq - 1) % ps == 0:
            out.append(free_list[head] * ps)
            head += 1
        else:
            out.append(last_loc + 1)
    return out, head


class SWAModel:
    """Both free lists (page ids), the full->swa mapping (absent = 0) and the spec's free rules."""

    def __init__(self, full_pages: int, swa_pages: int, ps: int):
        self.ps = ps
        self.full = list(range(1, full_pages + 1))
        self.swa = list(range(1, swa_pages + 1))
        self.map: dict[int, int] = {}

    def translate(self, slot: int) -> int:
        return -1 if slot == -1 else self.map.get(slot, 0)

    def extend(self, prefixes, seqs, last_locs):
        full, n_full = expected_extend(prefixes, seqs, last_locs, self.full, self.ps)
        swa_last = [self.translate(x) for x in last_locs]
        swa, n_swa = expected_extend(prefixes, seqs, swa_last, self.swa, self.ps)
        assert n_full == n_swa  # same seq lens: same page growth in both pools
        self.full, self.swa = self.full[n_full:], self.swa[n_swa:]
        self.map.update(zip(full, swa, strict=True))
        return full, swa

    def decode(self, seqs, last_locs):
        full, n = expected_decode(seqs, last_locs, self.full, self.ps)
        swa, n_swa = expected_decode(seqs, [self.translate(x) for x in last_locs], self.swa, self.ps)
        assert n == n_swa
        self.full, self.swa = self.full[n:], self.swa[n:]
        self.map.update(zip(full, swa, strict=True))
        return full, swa

    def swa_tail(self, prefix, seq, last_loc, tail):
        full, n_full = expected_extend([prefix], [seq], [last_loc], self.full, self.ps)
        self.full = self.full[n_full:]
        # The tail is laid out as a fresh request: prefix 0, last_loc -1.
        swa, n_swa = expected_extend([0], [tail], [-1], self.swa, self.ps)
        assert n_swa == ceil_div(tail, self.ps)
        self.swa = self.swa[n_swa:]
        split = len(full) - tail
        for s in full[:split]:
            self.map.pop(s, None)  # non-tail part: cleared
        self.map.update(zip(full[split:], swa, strict=True))
        return full, swa

    def page_slots(self, page: int) -> list[int]:
        return [page * self.ps + k for k in range(self.ps)]

    def free_swa(self, slots) -> None:
        full_pages = sorted({s // self.ps for s in slots})
        peers = [self.map.pop(x, 0) for p in full_pages for x in self.page_slots(p)]
        self.swa = sorted({x // self.ps for x in peers if x > 0}) + self.swa  # set-shaped free: head, sorted

    def free_swa_segment(self, slots) -> None:
        reps = slots[:: self.ps]
        swa_pages = [self.map.get(r, 0) // self.ps for r in reps]
        for r in reps:
            for x in self.page_slots(r // self.ps):
                self.map.pop(x, None)
        self.swa = swa_pages + self.swa  # page ids: head, caller order

    def free_full(self, slots) -> None:
        self.full = sorted({s // self.ps for s in slots}) + self.full

    def free(self, slots) -> None:
        self.free_swa(slots)
        self.free_full(slots)


def mapping_of(a, slots) -> list[int]:
    return a.full_to_swa_index_mapping[t(slots)].tolist()


def assert_matches(a, m: SWAModel) -> None:
    assert a.full_attn_allocator.free_pages.tolist() == m.full
    assert a.swa_attn_allocator.free_pages.tolist() == m.swa
    mapping = a.full_to_swa_index_mapping
    want = torch.zeros_like(mapping)
    want[-1] = -1
    if m.map:
        want[t(list(m.map))] = t(list(m.map.values()))
    assert torch.equal(mapping, want)


def call_extend(a, prefixes, seqs, last_locs):
    p, s = t(prefixes), t(seqs)
    return a.alloc_extend(p, p.clone(), s, s.clone(), t(last_locs), sum(seqs) - sum(prefixes))


def call_decode(a, seqs, last_locs):
    s = t(seqs)
    return a.alloc_decode(s, s.clone(), t(last_locs))


def call_tail(a, prefix, seq, last_loc, tail):
    p, s = t([prefix]), t([seq])
    return a.alloc_extend_swa_tail(p, p.clone(), s, s.clone(), t([last_loc]), seq - prefix, tail)


# -- construction, sizes, mapping --------------------------------------------------------------------------------


@pytest.mark.parametrize("ps", [1, 4])
def test_mapping_shape_and_sentinel(ps):
    a = make(full_pages=10, swa_pages=6, ps=ps)
    mapping = a.full_to_swa_index_mapping
    assert mapping.shape == (10 * ps + ps + 1,)
    assert mapping.dtype == torch.int64 and mapping.device == CPU
    assert mapping[-1].item() == -1
    assert int(mapping[:-1].abs().sum()) == 0
    assert a.translate_loc_from_full_to_swa(t([-1])).tolist() == [-1]
    assert a.translate_loc_from_full_to_swa(t([ps, 2 * ps + 1])).tolist() == [0, 0]


@pytest.mark.parametrize("ps", [1, 4])
def test_sizes_and_available(ps):
    a = make(full_pages=10, swa_pages=6, ps=ps)
    assert a.size_full == 10 * ps
    assert a.size_swa == 6 * ps
    assert a.full_available_size() == 10 * ps
    assert a.swa_available_size() == 6 * ps
    assert a.available_size() == min(10 * ps, 6 * ps)
    b = make(full_pages=3, swa_pages=6, ps=ps)
    assert b.available_size() == 3 * ps


def test_inner_allocators_by_page_size():
    from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    assert isinstance(make(ps=1).full_attn_allocator, TokenToKVPoolAllocator)
    assert isinstance(make(ps=1).swa_attn_allocator, TokenToKVPoolAllocator)
    assert isinstance(make(ps=4).full_attn_allocator, PagedTokenToKVPoolAllocator)
    assert isinstance(make(ps=4).swa_attn_allocator, PagedTokenToKVPoolAllocator)


def test_register_mapping_is_called_with_the_mapping():
    class KV:
        registered = None

        def register_mapping(self, mapping):
            self.registered = mapping

    kv = KV()
    a = SWATokenToKVPoolAllocator(32, 16, 4, torch.float16, "cpu", kvcache=kv)
    assert kv.registered is a.full_to_swa_index_mapping


# -- alloc_extend / alloc_decode (page size 4) -------------------------------------------------------------------


def test_alloc_extend_by_hand():
    a = make(full_pages=16, swa_pages=8)
    # Desynchronise the pools: 12 full slots (pages 1-3), SWA only for the last 4 (SWA page 1).
    assert call_tail(a, 0, 12, -1, 4).tolist() == list(range(4, 16))
    assert mapping_of(a, list(range(4, 16))) == [0] * 8 + [4, 5, 6, 7]
    # A: 0..5 -> full pages 4, 5 (16..21), SWA pages 2, 3 (8..13). B: 0..2 -> full page 6, SWA page 4.
    out = call_extend(a, [0, 0], [6, 3], [-1, -1])
    assert out.tolist() == [16, 17, 18, 19, 20, 21, 24, 25, 26]
    assert mapping_of(a, out.tolist()) == [8, 9, 10, 11, 12, 13, 16, 17, 18]
    assert a.full_attn_allocator.free_pages.tolist()[0] == 7
    assert a.swa_attn_allocator.free_pages.tolist()[0] == 5
    # A: 6..8 -> 22, 23 (rest of full page 5) + full page 7; SWA continues from mapping[21] + 1 = 14, 15 + page 5.
    out = call_extend(a, [6], [9], [21])
    assert out.tolist() == [22, 23, 28]
    assert mapping_of(a, [22, 23, 28]) == [14, 15, 20]
    # Both pools consumed the same number of pages for alloc_extend: 1 + 2 + 1 (plus 3 vs 1 for the tail).
    assert a.full_available_size() == (16 - 3 - 4) * PS
    assert a.swa_available_size() == (8 - 1 - 4) * PS
    assert a.available_size() == min(a.full_available_size(), a.swa_available_size())


def test_alloc_decode_by_hand():
    a = make(full_pages=16, swa_pages=8)
    call_tail(a, 0, 8, -1, 4)  # full pages 1, 2; SWA page 1 -> the pools are one page apart
    call_extend(a, [0, 0], [3, 4], [-1, -1])  # A: full 12..14 / SWA 8..10; B: full 16..19 / SWA 12..15
    # A position 3: in place: full 15, SWA mapping[14] + 1 = 11. B position 4 opens a page: full 5 -> 20, SWA 4 -> 16.
    out = call_decode(a, [4, 5], [14, 19])
    assert out.tolist() == [15, 20]
    assert mapping_of(a, [15, 20]) == [11, 16]


def _desync(a, m):
    """Make the two pools' free lists differ, so that the mapping is not the identity."""
    out = call_tail(a, 0, 3 * PS, -1, PS)
    full, _ = m.swa_tail(0, 3 * PS, -1, PS)
    assert out.tolist() == full


def test_alloc_extend_and_decode_derived():
    a, m = make(full_pages=40, swa_pages=30), SWAModel(40, 30, PS)
    _desync(a, m)
    rows: list[list[int]] = [[] for _ in range(5)]

    def extend(lens):
        prefixes = [len(r) for r in rows]
        last_locs = [r[-1] if r else -1 for r in rows]
        full, swa = m.extend(prefixes, lens, last_locs)
        out = call_extend(a, prefixes, lens, last_locs)
        assert out.tolist() == full
        assert mapping_of(a, full) == swa
        assert_matches(a, m)
        k = 0
        for r, p, s in zip(rows, prefixes, lens, strict=True):
            r += full[k : k + s - p]
            k += s - p

    extend([5, 4, 0, 1, 7])
    extend([9, 4, 3, 8, 8])  # mixed: continuation, zero-length, new pages
    for _ in range(6):
        seqs = [len(r) + 1 for r in rows]
        last_locs = [r[-1] if r else -1 for r in rows]
        full, swa = m.decode(seqs, last_locs)
        out = call_decode(a, seqs, last_locs)
        assert out.tolist() == full
        assert mapping_of(a, full) == swa
        assert_matches(a, m)
        for r, slot in zip(rows, full, strict=True):
            r.append(slot)
    # Layout invariant in both pools: the full slot and its SWA peer have position % ps.
    for r in rows:
        peers = mapping_of(a, r)
        assert all(s % PS == i % PS and p % PS == i % PS for i, (s, p) in enumerate(zip(r, peers, strict=True)))


@given(
    lens=st.lists(st.tuples(st.integers(0, 14), st.integers(0, 14)), min_size=1, max_size=4),
    desync=st.booleans(),
)
def test_alloc_extend_random_batches(lens, desync):
    a, m = make(full_pages=40, swa_pages=36), SWAModel(40, 36, PS)
    if desync:
        _desync(a, m)
    prefixes = [p for p, _ in lens]
    full, swa = m.extend([0] * len(lens), prefixes, [-1] * len(lens))
    assert call_extend(a, [0] * len(lens), prefixes, [-1] * len(lens)).tolist() == full
    rows, k = [], 0
    for p in prefixes:
        rows.append(full[k : k + p])
        k += p
    seqs = [p + e for p, e in lens]
    last_locs = [r[-1] if r else -1 for r in rows]
    full, swa = m.extend(prefixes, seqs, last_locs)
    out = call_extend(a, prefixes, seqs, last_locs)
    assert out.tolist() == full
    assert_matches(a, m)
    pos = [i for p, s in zip(prefixes, seqs, strict=True) for i in range(p, s)]
    assert all(f % PS == i % PS and w % PS == i % PS for f, w, i in zip(full, swa, pos, strict=True))


def test_alloc_extend_none_when_either_pool_short_and_nothing_changes():
    a = make(full_pages=16, swa_pages=2)
    snap = snapshot(a)
    assert call_extend(a, [0], [9], [-1]) is None  # 3 pages: full has 16, SWA has 2
    assert_unchanged(a, snap)
    b = make(full_pages=2, swa_pages=16)
    snap = snapshot(b)
    assert call_extend(b, [0, 0], [4, 1], [-1, -1]).tolist() == [4, 5, 6, 7, 8]
    snap = snapshot(b)
    assert call_extend(b, [0], [1], [-1]) is None
    assert_unchanged(b, snap)


def test_alloc_decode_swa_short_returns_none_after_full_consumed():
    # Documented behaviour (swa.py, SGLang 0.5.23 alike): the full pool is allocated first and keeps its page.
    a = make(full_pages=8, swa_pages=2)
    call_extend(a, [0], [8], [-1])  # full pages 1, 2; SWA pages 1, 2 -> SWA pool empty
    full_before = a.full_attn_allocator.free_pages.tolist()
    assert a.swa_available_size() == 0
    assert call_decode(a, [9], [11]) is None  # position 8 opens a page in both pools
    assert a.full_attn_allocator.free_pages.tolist() == full_before[1:]
    assert a.swa_attn_allocator.free_pages.numel() == 0
    # The consumed full page got no mapping.
    assert mapping_of(a, [full_before[0] * PS]) == [0]
    # An in-place decode needs no page in either pool and still works.
    assert call_decode(a, [8], [10]).tolist() == [11]
    assert mapping_of(a, [11]) == [11]


def test_alloc_decode_returns_none_when_full_short():
    a = make(full_pages=2, swa_pages=8)
    call_extend(a, [0], [8], [-1])
    assert call_decode(a, [9], [11]) is None
    assert a.full_attn_allocator.free_pages.numel() == 0


# -- alloc_extend_swa_tail ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix, seq, tail",
    [(0, 12, 4), (0, 10, 6), (0, 9, 9), (0, 16, 5), (0, 7, 0), (0, 8, 1), (5, 14, 6), (4, 12, 8)],
)
def test_alloc_extend_swa_tail_derived(prefix, seq, tail):
    a, m = make(full_pages=32, swa_pages=16), SWAModel(32, 16, PS)
    _desync(a, m)
    last_loc = -1
    if prefix:
        full, _ = m.extend([0], [prefix], [-1])
        assert call_extend(a, [0], [prefix], [-1]).tolist() == full
        last_loc = full[-1]
    swa_before = a.swa_attn_allocator.free_pages.tolist()
    full, swa = m.swa_tail(prefix, seq, last_loc, tail)
    out = call_tail(a, prefix, seq, last_loc, tail)
    assert out.tolist() == full
    assert len(full) == seq - prefix
    split = len(full) - tail
    assert mapping_of(a, full[split:]) == swa
    assert mapping_of(a, full[:split]) == [0] * split
    # SWA pages: only ceil(tail / ps), from a fresh page, the tail's first position taken as position 0.
    assert a.swa_attn_allocator.free_pages.tolist() == swa_before[ceil_div(tail, PS) :]
    assert all(w % PS == j % PS for j, w in enumerate(swa))
    assert_matches(a, m)


def test_alloc_extend_swa_tail_by_hand():
    a = make(full_pages=16, swa_pages=8)
    call_extend(a, [0], [4], [-1])  # full page 1, SWA page 1
    # 0..9: full pages 2, 3, 4 (8..17); tail 6 = positions 4..9 -> SWA pages 2, 3 laid out as 0..5: 8..13.
    out = call_tail(a, 0, 10, -1, 6)
    assert out.tolist() == list(range(8, 18))
    assert mapping_of(a, list(range(8, 18))) == [0, 0, 0, 0, 8, 9, 10, 11, 12, 13]
    assert a.swa_attn_allocator.free_pages.tolist()[0] == 4


def test_alloc_extend_swa_tail_zero_takes_no_swa_pages():
    a = make(full_pages=8, swa_pages=2)
    swa_before = a.swa_attn_allocator.free_pages.clone()
    out = call_tail(a, 0, 10, -1, 0)
    assert out.tolist() == list(range(4, 14))
    assert torch.equal(a.swa_attn_allocator.free_pages, swa_before)
    assert mapping_of(a, out.tolist()) == [0] * 10
    assert a.full_available_size() == 5 * PS


@pytest.mark.parametrize(
    "tail, swa",
    [(4, [4, 5, 6, 7]), (11, list(range(4, 15)))],  # 11 of 12: a single non-tail slot, cleared all the same
)
def test_alloc_extend_swa_tail_clears_stale_mapping_of_non_tail(tail, swa):
    a = make(full_pages=8, swa_pages=8)
    a.full_to_swa_index_mapping[4:16] = 99  # stale values where the new slots will land
    out = call_tail(a, 0, 12, -1, tail)
    assert mapping_of(a, out.tolist()) == [0] * (12 - tail) + swa


def test_alloc_extend_swa_tail_zero_leaves_mapping_like_sglang():
    # With swa_tail_len == 0 SGLang 0.5.23 returns right after the full allocation: the non-tail mapping is not
    # cleared (fresh slots map to 0 anyway, since every free clears its mapping). Ours does the same.
    a = make(full_pages=8, swa_pages=8)
    a.full_to_swa_index_mapping[4:16] = 99
    out = call_tail(a, 0, 12, -1, 0)
    assert mapping_of(a, out.tolist()) == [99] * 12
    assert a.swa_available_size() == 8 * a.page_size


@pytest.mark.parametrize("bs", [0, 2])
def test_alloc_extend_swa_tail_batch_size_must_be_one(bs):
    a = make()
    snap = snapshot(a)
    p, s = t([0] * bs), t([4] * bs)
    with pytest.raises(ValueError) as excinfo:
        a.alloc_extend_swa_tail(p, p.clone(), s, s.clone(), t([-1] * bs), 4 * bs, 0)
    assert isinstance(excinfo.value, ArgumentError)
    assert "batch size 1" in str(excinfo.value)
    assert_unchanged(a, snap)


def test_alloc_extend_swa_tail_none_when_a_pool_is_short():
    a = make(full_pages=8, swa_pages=1)
    snap = snapshot(a)
    assert call_tail(a, 0, 12, -1, 5) is None  # 2 SWA pages needed, 1 free
    assert_unchanged(a, snap)
    assert call_tail(a, 0, 40, -1, 4) is None  # 10 full pages needed, 8 free
    assert_unchanged(a, snap)
    assert call_tail(a, 0, 12, -1, 4) is not None


# -- frees (page size 4) -----------------------------------------------------------------------------------------


def _two_requests(a, m):
    """A: 6 tokens, B: 9 tokens, after a desync. Returns their full rows."""
    _desync(a, m)
    full, _ = m.extend([0, 0], [6, 9], [-1, -1])
    assert call_extend(a, [0, 0], [6, 9], [-1, -1]).tolist() == full
    return full[:6], full[6:]


def test_free_swa_clears_touched_pages_and_releases_swa_pages_by_hand():
    a = make(full_pages=16, swa_pages=8)
    call_extend(a, [0], [6], [-1])  # full 4..9, SWA 4..9 (pages 1, 2 in both)
    full_before = a.full_attn_allocator.free_pages.tolist()
    a.free_swa(t([5]))  # touches full page 1: all of 4..7 cleared; SWA page 1 back at the head
    assert mapping_of(a, list(range(4, 10))) == [0, 0, 0, 0, 8, 9]
    assert a.swa_attn_allocator.free_pages.tolist()[:2] == [1, 3]
    assert a.full_attn_allocator.free_pages.tolist() == full_before


def test_free_swa_derived():
    a, m = make(full_pages=20, swa_pages=16), SWAModel(20, 16, PS)
    row_a, row_b = _two_requests(a, m)
    chosen = [row_b[8], row_a[0], row_b[1], row_a[5]]
    a.free_swa(t(chosen))
    m.free_swa(chosen)
    assert_matches(a, m)


def test_free_swa_segment_one_swa_page_per_full_page_in_caller_order():
    a, m = make(full_pages=20, swa_pages=16), SWAModel(20, 16, PS)
    # Put SWA pages 4 then 2 at the head, so that the next request's SWA pages are in unsorted order.
    row_a, row_b = _two_requests(a, m)  # SWA: A pages 2, 3; B pages 4, 5, 6
    for row in (row_a, row_b):
        a.free_swa_segment(t(row[4:]), start_pos=4)
        m.free_swa_segment(row[4:])
    assert_matches(a, m)
    assert a.swa_attn_allocator.free_pages.tolist()[:3] == [5, 6, 3]
    full, swa = m.extend([0], [8], [-1])
    row_c = call_extend(a, [0], [8], [-1]).tolist()
    assert row_c == full
    assert [w // PS for w in swa[::PS]] == [5, 6]
    a.free_swa_segment(t(row_c[0:7]), start_pos=0)  # ends mid-page: both pages released
    m.free_swa_segment(row_c[0:7])
    assert_matches(a, m)
    assert a.swa_attn_allocator.free_pages.tolist()[:2] == [5, 6]


def test_free_swa_segment_unaligned_start_raises_and_changes_nothing():
    a, m = make(full_pages=20, swa_pages=16), SWAModel(20, 16, PS)
    _, row_b = _two_requests(a, m)
    snap = snapshot(a)
    with pytest.raises(ValueError) as excinfo:
        a.free_swa_segment(t(row_b[2:]), start_pos=2)
    assert excinfo.value.argument == "start_pos"
    assert_unchanged(a, snap)


def test_free_is_free_swa_then_free_full():
    a, m = make(full_pages=20, swa_pages=16), SWAModel(20, 16, PS)
    row_a, row_b = _two_requests(a, m)
    full_avail, swa_avail = a.full_available_size(), a.swa_available_size()
    a.free(t(row_b))
    m.free(row_b)
    assert_matches(a, m)
    # Both pools get B's three pages back.
    assert a.full_available_size() == full_avail + 3 * PS
    assert a.swa_available_size() == swa_avail + 3 * PS
    a.free(t(row_a[:1]))  # one slot: its whole page in both pools
    m.free(row_a[:1])
    assert_matches(a, m)


def test_free_full_after_free_swa():
    a, m = make(full_pages=20, swa_pages=16), SWAModel(20, 16, PS)
    row_a, _ = _two_requests(a, m)
    a.free_swa(t(row_a))
    m.free_swa(row_a)
    swa_after = a.swa_attn_allocator.free_pages.clone()
    a.free_full(t(row_a))
    m.free_full(row_a)
    assert_matches(a, m)
    assert torch.equal(a.swa_attn_allocator.free_pages, swa_after)


def test_free_segment_frees_both_pools():
    a, m = make(full_pages=20, swa_pages=16), SWAModel(20, 16, PS)
    _, row_b = _two_requests(a, m)
    a.free_segment(t(row_b[4:]), start_pos=4)
    m.free_swa_segment(row_b[4:])
    m.full = [s // PS for s in row_b[4::PS]] + m.full  # full side: page ids in caller order
    assert_matches(a, m)


def test_free_empty_is_noop():
    a, m = make(full_pages=20, swa_pages=16), SWAModel(20, 16, PS)
    _two_requests(a, m)
    snap = snapshot(a)
    for method in ("free", "free_swa", "free_full"):
        getattr(a, method)(t([]))
    a.free_swa_segment(t([]), start_pos=0)
    a.free_segment(t([]), start_pos=0)
    assert_unchanged(a, snap)


def test_free_group_defers_releases_until_end():
    a, m = make(full_pages=20, swa_pages=16), SWAModel(20, 16, PS)
    row_a, row_b = _two_requests(a, m)
    full_free = a.full_attn_allocator.free_pages.clone()
    swa_free = a.swa_attn_allocator.free_pages.clone()
    a.free_group_begin()
    a.free(t(row_a))
    a.free_swa_segment(t(row_b[4:]), start_pos=4)
    assert torch.equal(a.full_attn_allocator.free_pages, full_free)
    assert torch.equal(a.swa_attn_allocator.free_pages, swa_free)
    a.free_group_end()
    m.free(row_a)
    m.free_swa_segment(row_b[4:])
    # Full side: one set-shaped free, exactly the paged rule. SWA side: the same pages, order not specified.
    assert a.full_attn_allocator.free_pages.tolist() == m.full
    assert sorted(a.swa_attn_allocator.free_pages.tolist()) == sorted(m.swa)
    assert a.swa_attn_allocator.free_pages.tolist()[len(m.swa) - len(swa_free) :] == swa_free.tolist()
    mapping = a.full_to_swa_index_mapping
    assert mapping_of(a, row_a) == [0] * len(row_a)
    assert mapping_of(a, row_b[4:]) == [0] * len(row_b[4:])
    assert int(mapping[:-1].count_nonzero()) == len(m.map)
    assert a.free_group is None


def test_free_group_opens_the_inner_full_group_and_does_not_nest():
    a = make()
    a.free_group_begin()
    assert a.full_attn_allocator.free_group is not None
    with pytest.raises(RuntimeError, match="nest"):
        a.free_group_begin()
    a.free_group_end()
    assert a.full_attn_allocator.free_group is None


def test_clear_resets_everything():
    a, m = make(full_pages=20, swa_pages=16), SWAModel(20, 16, PS)
    _two_requests(a, m)
    a.clear()
    assert_matches(a, SWAModel(20, 16, PS))


# -- page size 1 -------------------------------------------------------------------------------------------------


def test_page_size_1_alloc_and_mapping():
    a = make(full_pages=10, swa_pages=6, ps=1)
    out = a.alloc(3)
    assert out.tolist() == [1, 2, 3]
    assert mapping_of(a, [1, 2, 3]) == [1, 2, 3]
    a.free_swa(t([2]))  # SWA slot 2 appended at the TAIL of the SWA token free list
    assert a.swa_attn_allocator.free_pages.tolist() == [4, 5, 6, 2]
    assert mapping_of(a, [2]) == [0]
    out = a.alloc(4)  # full 4..7, SWA 4 5 6 2
    assert out.tolist() == [4, 5, 6, 7]
    assert mapping_of(a, [4, 5, 6, 7]) == [4, 5, 6, 2]
    assert a.available_size() == min(10 - 7, 6 - 6)
    assert a.alloc(1) is None  # SWA pool empty
    assert a.full_attn_allocator.free_pages.tolist() == [8, 9, 10]


def test_page_size_1_free_returns_both_to_tail():
    a = make(full_pages=10, swa_pages=6, ps=1)
    a.alloc(2)
    a.free_swa(t([1]))
    a.alloc(4)  # full 3..6, SWA 3 4 5 6 -> mapping[3..6] = 3..6; SWA free: 1
    a.free(t([5, 3]))
    assert a.full_attn_allocator.free_pages.tolist() == [7, 8, 9, 10, 5, 3]
    assert a.swa_attn_allocator.free_pages.tolist() == [1, 5, 3]
    assert mapping_of(a, [3, 4, 5, 6]) == [0, 4, 0, 6]
    assert a.translate_loc_from_full_to_swa(t([-1, 4])).tolist() == [-1, 4]


def test_page_size_1_free_swa_segment_and_group():
    a = make(full_pages=10, swa_pages=6, ps=1)
    a.alloc(5)
    a.free_group_begin()
    a.free_swa_segment(t([4, 2]), start_pos=3)
    a.free(t([5]))
    assert a.swa_attn_allocator.free_pages.tolist() == [6]
    assert a.full_attn_allocator.free_pages.tolist() == [6, 7, 8, 9, 10]
    a.free_group_end()
    assert sorted(a.swa_attn_allocator.free_pages.tolist()) == [2, 4, 5, 6]
    assert a.full_attn_allocator.free_pages.tolist() == [6, 7, 8, 9, 10, 5]
    assert mapping_of(a, [1, 2, 3, 4, 5]) == [1, 0, 3, 0, 0]


def test_page_size_1_alloc_none_when_full_short():
    a = make(full_pages=3, swa_pages=6, ps=1)
    snap = snapshot(a)
    assert a.alloc(4) is None
    assert_unchanged(a, snap)


@pytest.mark.parametrize("method", ["alloc_extend", "alloc_decode", "alloc_extend_swa_tail"])
def test_page_size_1_has_no_batch_allocation(method):
    a = make(ps=1)
    snap = snapshot(a)
    calls = {
        "alloc_extend": lambda: call_extend(a, [0], [2], [-1]),
        "alloc_decode": lambda: call_decode(a, [1], [-1]),
        "alloc_extend_swa_tail": lambda: call_tail(a, 0, 2, -1, 1),
    }
    with pytest.raises(NotImplementedError):
        calls[method]()
    assert_unchanged(a, snap)


def test_alloc_is_page_size_1_only():
    with pytest.raises(NotImplementedError):
        make(ps=4).alloc(4)


# -- bad input ---------------------------------------------------------------------------------------------------


def _inner_snapshot(x):
    if hasattr(x, "staged_pages"):
        return (
            x.free_pages.clone(),
            [s.clone() for s in x.staged_pages],
            None if x.free_group is None else [g.clone() for g in x.free_group],
            [g.clone() for g in x.free_page_ids_group],
        )
    return (
        x.free_pages.clone(),
        x.release_pages.clone(),
        None if x.free_group is None else [g.clone() for g in x.free_group],
    )


def snapshot(a):
    return dict(
        full=_inner_snapshot(a.full_attn_allocator),
        swa=_inner_snapshot(a.swa_attn_allocator),
        mapping=a.full_to_swa_index_mapping.clone(),
        group=None if a.free_group is None else len(a.free_group),
        swa_group=[g.clone() for g in a.swa_free_group],
        swa_ids_group=[g.clone() for g in a.swa_page_ids_group],
    )


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, (list, tuple)):
        return isinstance(y, type(x)) and len(x) == len(y) and all(_same(p, q) for p, q in zip(x, y, strict=True))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return x == y


def assert_unchanged(a, snap) -> None:
    now = snapshot(a)
    for key in snap:
        assert _same(now[key], snap[key]), key


def _state(kind: str, ps: int = PS):
    """Two live requests, some frees (staged with need_sort), maybe an open group with held frees."""
    a = make(full_pages=24, swa_pages=16, ps=ps, need_sort=(kind == "need_sort"))
    if ps == 1:
        a.alloc(6)
        a.free(t([2]))
        a.free_swa(t([4]))
        if kind == "group":
            a.free_group_begin()
            a.free(t([5]))
            a.free_swa_segment(t([6]), start_pos=0)
        return a
    call_tail(a, 0, 12, -1, 4)  # full 4..15, SWA 4..7
    call_extend(a, [0, 0], [6, 4], [-1, -1])  # A: full 16..21, B: full 24..27
    a.free(t([4, 13]))
    a.free_swa_segment(t([24, 25, 26, 27]), start_pos=0)
    if kind == "group":
        a.free_group_begin()
        a.free(t([8]))
        a.free_swa_segment(t([16, 17, 18, 19]), start_pos=0)
    return a


def _extend_args():
    # A: 6 -> 9 (last slot 21), C: a fresh request of 3.
    return dict(
        prefix_lens=t([6, 0]),
        prefix_lens_cpu=t([6, 0]),
        seq_lens=t([9, 3]),
        seq_lens_cpu=t([9, 3]),
        last_loc=t([21, -1]),
        extend_num_tokens=6,
    )


def _tail_args():
    return dict(
        prefix_lens=t([0]),
        prefix_lens_cpu=t([0]),
        seq_lens=t([10]),
        seq_lens_cpu=t([10]),
        last_loc=t([-1]),
        extend_num_tokens=10,
        swa_tail_len=6,
    )


def _decode_args():
    return dict(seq_lens=t([7, 5]), seq_lens_cpu=t([7, 5]), last_loc=t([21, 27]))


def _tensor_mutations(name, good):
    yield "float", good.float(), TypeError, name
    yield "list", good.tolist(), TypeError, name
    yield "none", None, TypeError, name
    yield "2d", good[None, :], ValueError, name
    yield "meta", torch.empty(good.shape, dtype=good.dtype, device=META), ValueError, name
    yield "longer", torch.cat([good, good[:1]]), ValueError, ("seq_lens_cpu" if name == "seq_lens" else name)


def _int_mutations(name, good=7):
    yield "bool", True, TypeError, name
    yield "float", float(good), TypeError, name
    yield "none", None, TypeError, name
    yield "negative", -good, ValueError, name


def _cases():
    cases = []
    for method, args in (("alloc_extend", _extend_args()), ("alloc_extend_swa_tail", _tail_args())):
        for name, good in args.items():
            if not isinstance(good, torch.Tensor):
                continue
            for label, bad, exc, named in _tensor_mutations(name, good):
                if method == "alloc_extend_swa_tail" and label == "longer":
                    continue  # covered by the batch-size checks
                marks = ()
                cases.append(pytest.param(method, {name: bad}, exc, named, id=f"{method}-{name}-{label}", marks=marks))
        for label, bad, exc, named in _int_mutations("extend_num_tokens", args["extend_num_tokens"]):
            cases.append(pytest.param(method, {"extend_num_tokens": bad}, exc, named, id=f"{method}-ent-{label}"))
        p = args["prefix_lens_cpu"].clone()
        p[0] = int(args["seq_lens_cpu"][0]) + 1
        cases += [
            pytest.param(
                method,
                {"extend_num_tokens": args["extend_num_tokens"] + 1},
                ValueError,
                "extend_num_tokens",
                id=f"{method}-ent-wrong-sum",
            ),
            pytest.param(
                method,
                {"prefix_lens_cpu": p, "prefix_lens": p.clone()},
                ValueError,
                "prefix_lens_cpu",
                id=f"{method}-prefix-gt-seq",
            ),
        ]
    for label, bad, exc, named in _int_mutations("swa_tail_len", 6):
        cases.append(pytest.param("alloc_extend_swa_tail", {"swa_tail_len": bad}, exc, named, id=f"tail-{label}"))
    cases.append(
        pytest.param("alloc_extend_swa_tail", {"swa_tail_len": 11}, ValueError, "swa_tail_len", id="tail-too-long")
    )
    for name, good in _decode_args().items():
        for label, bad, exc, named in _tensor_mutations(name, good):
            cases.append(pytest.param("alloc_decode", {name: bad}, exc, named, id=f"alloc_decode-{name}-{label}"))
    cases.append(
        pytest.param(
            "alloc_decode",
            {"seq_lens_cpu": t([0, 5]), "seq_lens": t([0, 5])},
            ValueError,
            "seq_lens_cpu",
            id="alloc_decode-zero-seq",
        )
    )
    good_idx = t([20, 21])
    for method in ("free", "free_swa", "free_full", "free_segment", "free_swa_segment", "free_full_segment"):
        for label, bad, exc, named in _tensor_mutations("free_index", good_idx):
            if label != "longer":
                cases.append(pytest.param(method, {"free_index": bad}, exc, named, id=f"{method}-{label}"))
    for method in ("free_segment", "free_swa_segment", "free_full_segment"):
        for label, bad, exc, named in [*_int_mutations("start_pos", 4), ("unaligned", 2, ValueError, "start_pos")]:
            cases.append(pytest.param(method, {"start_pos": bad}, exc, named, id=f"{method}-start_pos-{label}"))
    for label, bad, exc, named in _tensor_mutations("kv_indices", good_idx):
        if label != "longer":
            cases.append(
                pytest.param("translate_loc_from_full_to_swa", {"kv_indices": bad}, exc, named, id=f"translate-{label}")
            )
    return cases


def _invoke(a, method, override):
    if method == "alloc_extend":
        return a.alloc_extend(**{**_extend_args(), **override})
    if method == "alloc_extend_swa_tail":
        return a.alloc_extend_swa_tail(**{**_tail_args(), **override})
    if method == "alloc_decode":
        return a.alloc_decode(**{**_decode_args(), **override})
    if method == "alloc":
        return a.alloc(override["need_size"])
    if method == "translate_loc_from_full_to_swa":
        return a.translate_loc_from_full_to_swa(override["kv_indices"])
    idx = override.get("free_index", t([20, 21]))
    if method.endswith("segment"):
        return getattr(a, method)(idx, start_pos=override.get("start_pos", 4))
    return getattr(a, method)(idx)


def _check_bad(a, method, override, exc_type, name):
    snap = snapshot(a)
    with pytest.raises(exc_type) as excinfo:
        _invoke(a, method, override)
    assert isinstance(excinfo.value, ArgumentError)
    assert excinfo.value.argument == name
    assert str(excinfo.value).startswith(f"{name}:")
    assert_unchanged(a, snap)


@pytest.mark.parametrize("kind", ["plain", "need_sort", "group"])
@pytest.mark.parametrize("method, override, exc_type, name", _cases())
def test_bad_input_raises_naming_argument_and_changes_nothing(kind, method, override, exc_type, name):
    _check_bad(_state(kind), method, override, exc_type, name)


def _cases_ps1():
    cases = []
    for label, bad, exc, named in _int_mutations("need_size", 3):
        cases.append(pytest.param("alloc", {"need_size": bad}, exc, named, id=f"alloc-{label}"))
    for method in ("free", "free_swa", "free_full", "free_swa_segment"):
        for label, bad, exc, named in _tensor_mutations("free_index", t([1, 3])):
            if label != "longer":
                cases.append(pytest.param(method, {"free_index": bad}, exc, named, id=f"{method}-{label}"))
    for label, bad, exc, named in _int_mutations("start_pos", 1):
        cases.append(pytest.param("free_swa_segment", {"start_pos": bad}, exc, named, id=f"segment-start-{label}"))
    return cases


@pytest.mark.parametrize("kind", ["plain", "need_sort", "group"])
@pytest.mark.parametrize("method, override, exc_type, name", _cases_ps1())
def test_bad_input_page_size_1(kind, method, override, exc_type, name):
    _check_bad(_state(kind, ps=1), method, override, exc_type, name)


@pytest.mark.parametrize("kind", ["plain", "need_sort", "group"])
@pytest.mark.parametrize("method", ["alloc_extend", "alloc_extend_swa_tail", "alloc_decode", "free_swa_segment"])
def test_good_input_baseline_succeeds(kind, method):
    # The unmutated calls of the bad-input matrix are valid: the errors above come from the mutation alone.
    a = _state(kind)
    out = _invoke(a, method, {})
    if method.startswith("alloc"):
        assert out is not None
