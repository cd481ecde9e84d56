"""PagedTokenToKVPoolAllocator against the spec (shared/reference/sglang-allocator-semantics.md).

Expected slots and free lists are derived here from the spec's rules (``expected_extend``, ``expected_decode``,
``PagedModel``) and from a few examples worked by hand; they are never copied from a run of the allocator.
Spec rules exercised:
- ``num_pages = size // page_size``; ``clear()``: free list = page ids 1..num_pages; page 0 is reserved.
- ``available_size()`` = (free pages + staged pages) * page_size.
- ``alloc(n)``: ``n // page_size`` whole pages, all their slots, in page order.
- ``alloc_extend``: per request in batch order, (1) positions up to the end of the current partial page
  continue from ``last_loc + 1``, (2) whole new pages ``page*ps + offset``, (3) a last partial page; new pages per
  request = ceil(seq/ps) - ceil(prefix/ps), from the head of the free list in request order; ``None`` when too few
  pages are free (capacity checked before any work); layout invariant ``slot % ps == position % ps``.
- ``alloc_decode``: position ``seq_len-1`` gets a new page's first slot when ``(seq_len-1) % ps == 0``, else
  ``last_loc + 1``; ``None`` when too few pages are free.
- ``free`` dedups by page; ``free_segment`` (page-aligned ``start_pos``) takes one representative per page;
  ``free_page_ids`` frees exactly these pages, no dedup; freed pages go to the HEAD of the free list.
- Free groups hold frees until ``free_group_end``; set-shaped frees are released before page-id frees.
- ``need_sort`` stages frees; an allocation whose demand bound exceeds the free list merges and sorts first.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from instrumented_alloc.argcheck import ArgumentError

CPU = torch.device("cpu")
META = torch.device("meta")
PAGE_SIZES = [1, 4, 16]


def t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=CPU)


def make(num_pages=16, ps=4, need_sort=False, size=None):
    size = num_pages * ps if size is None else size
    return PagedTokenToKVPoolAllocator(size, ps, torch.float16, "cpu", kvcache=None, need_sort=need_sort)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- the spec's rules, as plain Python ---------------------------------------------------------------------------


def new_pages(prefix: int, seq: int, ps: int) -> int:
    """Spec: new pages per request = ceil(seq/ps) - ceil(prefix/ps)."""
    return ceil_div(seq, ps) - ceil_div(prefix, ps)


def expected_extend(prefixes, seqs, last_locs, free_list, ps):
    """The slots of positions prefix..seq-1 of every request, concatenated, and the pages taken per request.

    Per request: (1) up to the end of the current partial page, consecutive slots from last_loc + 1; then, from
    the head of the free list in request order, (2) whole new pages and (3) a last partial page, each position at
    ``page*ps + offset in page``.
    """
    out, taken, head = [], [], 0
    for prefix, seq, last_loc in zip(prefixes, seqs, last_locs, strict=True):
        partial_end = ceil_div(prefix, ps) * ps  # end of the current partial page (== prefix when aligned)
        n1 = max(0, min(seq, partial_end) - prefix)
        out += [last_loc + 1 + k for k in range(n1)]
        pos, mine = prefix + n1, []
        while pos < seq:  # pos is page-aligned here
            page = free_list[head]
            head += 1
            mine.append(page)
            out += [page * ps + k for k in range(min(ps, seq - pos))]
            pos += ps
        taken.append(mine)
    return out, taken


def expected_decode(seqs, last_locs, free_list, ps):
    """One slot per request for position seq-1: a new page's first slot if (seq-1) % ps == 0, else last_loc+1."""
    out, head = [], 0
    for seq, last_loc in zip(seqs, last_locs, strict=True):
        if (seq - 1) % ps == 0:
            out.append(free_list[head] * ps)
            head += 1
        else:
            out.append(last_loc + 1)
    return out, head


class PagedModel:
    """The spec's paged free list (page ids), staging and free groups, as Python lists."""

    def __init__(self, num_pages: int, need_sort: bool = False):
        self.free = list(range(1, num_pages + 1))
        self.staged: list[int] = []
        self.need_sort = need_sort
        self.group_sets: list[int] | None = None  # slots from set-shaped frees
        self.group_ids: list[int] = []  # page ids from page-id frees

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def merge(self) -> None:
        self.free = sorted(self.free + self.staged)
        self.staged = []

    def _release(self, pages: list[int]) -> None:
        if self.need_sort:
            self.staged += pages
        else:
            self.free = pages + self.free  # HEAD

    def free_slots(self, slots: list[int], ps: int) -> None:
        if not slots:
            return
        if self.group_sets is not None:
            self.group_sets += slots
        else:
            self._release(sorted({s // ps for s in slots}))

    def free_page_ids(self, pages: list[int]) -> None:
        if not pages:
            return
        if self.group_sets is not None:
            self.group_ids += pages
        else:
            self._release(list(pages))

    def group_begin(self) -> None:
        self.group_sets, self.group_ids = [], []

    def group_end(self, ps: int) -> None:
        sets, ids = self.group_sets, self.group_ids
        self.group_sets, self.group_ids = None, []
        self.free_slots(sets, ps)  # set-shaped first ...
        self.free_page_ids(ids)  # ... then page ids, which end at the very head


def call_extend(a, prefixes, seqs, last_locs):
    p, s = t(prefixes), t(seqs)
    return a.alloc_extend(p, p.clone(), s, s.clone(), t(last_locs), sum(seqs) - sum(prefixes))


def call_decode(a, seqs, last_locs):
    s = t(seqs)
    return a.alloc_decode(s, s.clone(), t(last_locs))


def staged(a) -> list[int]:
    return [int(p) for chunk in a.staged_pages for p in chunk.tolist()]


def snapshot(a):
    return dict(
        free=a.free_pages.clone(),
        staged=[s.clone() for s in a.staged_pages],
        num_staged=a.num_staged_pages,
        group=None if a.free_group is None else [g.clone() for g in a.free_group],
        group_ids=[g.clone() for g in a.free_page_ids_group],
    )


def assert_unchanged(a, snap) -> None:
    now = snapshot(a)
    assert torch.equal(now["free"], snap["free"])
    assert now["num_staged"] == snap["num_staged"]
    assert len(now["staged"]) == len(snap["staged"])
    assert all(torch.equal(x, y) for x, y in zip(now["staged"], snap["staged"], strict=True))
    assert (now["group"] is None) == (snap["group"] is None)
    if snap["group"] is not None:
        assert len(now["group"]) == len(snap["group"])
        assert all(torch.equal(x, y) for x, y in zip(now["group"], snap["group"], strict=True))
    assert len(now["group_ids"]) == len(snap["group_ids"])
    assert all(torch.equal(x, y) for x, y in zip(now["group_ids"], snap["group_ids"], strict=True))


# -- clear / alloc -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_clear_free_list_is_pages_one_to_num_pages(ps):
    a = make(num_pages=10, ps=ps)
    assert a.num_pages == 10
    assert a.free_pages.tolist() == list(range(1, 11))
    assert a.free_pages.dtype == torch.int64 and a.free_pages.device == CPU
    assert a.available_size() == 10 * ps


@pytest.mark.parametrize("size, ps, pages", [(30, 4, 7), (31, 16, 1), (15, 16, 0), (7, 1, 7)])
def test_num_pages_is_size_floor_div_page_size(size, ps, pages):
    a = make(ps=ps, size=size)
    assert a.num_pages == pages
    assert a.free_pages.tolist() == list(range(1, pages + 1))
    assert a.available_size() == pages * ps


def test_clear_resets():
    a = make(num_pages=6, ps=4, need_sort=True)
    a.alloc(12)
    a.free(t([4]))
    a.free_group_begin()
    a.clear()
    assert a.free_pages.tolist() == [1, 2, 3, 4, 5, 6]
    assert staged(a) == [] and a.num_staged_pages == 0
    assert a.free_group is None


def test_alloc_whole_pages_by_hand():
    a = make(num_pages=8, ps=4)
    assert a.alloc(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert a.free_pages.tolist() == [3, 4, 5, 6, 7, 8]
    assert a.available_size() == 24


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("n", [0, 1, 5, 17, 33])
def test_alloc_takes_n_floordiv_ps_pages_in_page_order(ps, n):
    order = [9, 4, 30, 5, 6, 7, 8, 10]
    a = make(num_pages=40, ps=ps)
    a.alloc(40 * ps)
    a.free_page_ids(t(order))  # the free list is now exactly `order`
    k = n // ps  # an unaligned n is truncated
    out = a.alloc(n)
    if k > len(order):
        assert out is None
        assert a.free_pages.tolist() == order
        return
    assert out.tolist() == [p * ps + off for p in order[:k] for off in range(ps)]
    assert a.free_pages.tolist() == order[k:]


def test_alloc_unaligned_is_truncated():
    a = make(num_pages=8, ps=4)
    assert a.alloc(7).tolist() == [4, 5, 6, 7]
    assert a.alloc(3).tolist() == []
    assert a.free_pages.tolist() == [2, 3, 4, 5, 6, 7, 8]


def test_alloc_none_when_short_state_unchanged():
    a = make(num_pages=4, ps=4)
    a.alloc(8)
    snap = snapshot(a)
    assert a.alloc(12) is None
    assert_unchanged(a, snap)


# -- alloc_extend ------------------------------------------------------------------------------------------------


def test_alloc_extend_by_hand_page_size_4():
    a = make(num_pages=16, ps=4)
    # A: positions 0..5 -> pages 1, 2: slots 4..7, 8..9.  B: positions 0..2 -> page 3: slots 12..14.
    out = call_extend(a, [0, 0], [6, 3], [-1, -1])
    assert out.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14]
    assert a.free_pages.tolist()[0] == 4
    # A: 6..10 -> 10, 11 (rest of page 2), then page 4: 16, 17, 18.   B: 3 -> 15 (rest of page 3).
    # C: a zero-length extend of a 4-token request (nothing is allocated, last_loc is not used).
    # D: fresh request 0..7 -> pages 5, 6.   E: zero-length empty request (prefix 0, last_loc -1).
    out = call_extend(a, [6, 3, 4, 0, 0], [11, 4, 4, 8, 0], [9, 14, 15, -1, -1])
    assert out.tolist() == [10, 11, 16, 17, 18, 15, 20, 21, 22, 23, 24, 25, 26, 27]
    assert a.free_pages.tolist() == list(range(7, 17))


def test_alloc_extend_by_hand_page_size_16():
    a = make(num_pages=16, ps=16)
    # A: 0..19 -> page 1 (16..31) + page 2 (32..35).  B: 0..15 -> exactly page 3 (48..63).
    out = call_extend(a, [0, 0], [20, 16], [-1, -1])
    assert out.tolist() == list(range(16, 36)) + list(range(48, 64))
    # A: 20..39 -> 36..47 (rest of page 2) then page 4: 64..71.  B: aligned prefix 16 -> new page 5: 80.
    out = call_extend(a, [20, 16], [40, 17], [35, 63])
    assert out.tolist() == list(range(36, 48)) + list(range(64, 72)) + [80]
    assert a.free_pages.tolist()[0] == 6


def test_alloc_extend_by_hand_page_size_1():
    a = make(num_pages=16, ps=1)
    a.alloc(4)
    a.free_page_ids(t([3, 1]))  # head: 3 1 5 6 ...
    # Every position opens a page: no continuation from last_loc at page size 1.
    out = call_extend(a, [0, 2], [2, 4], [-1, 2])
    assert out.tolist() == [3, 1, 5, 6]


def test_alloc_extend_new_pages_come_from_the_head_in_request_order():
    a = make(num_pages=12, ps=4)
    a.alloc(48)
    a.free_page_ids(t([9, 2, 11, 5, 7]))
    out = call_extend(a, [0, 0], [5, 3], [-1, -1])
    # A takes 9, 2; B takes 11.
    assert out.tolist() == [36, 37, 38, 39, 8, 44, 45, 46]
    assert a.free_pages.tolist() == [5, 7]


def test_alloc_extend_returns_int64_on_device_and_length():
    a = make(num_pages=8, ps=4)
    out = call_extend(a, [0, 0], [3, 5], [-1, -1])
    assert out.dtype == torch.int64 and out.device == CPU and out.numel() == 8


def test_alloc_extend_empty_batch():
    a = make(num_pages=4, ps=4)
    out = call_extend(a, [], [], [])
    assert out.numel() == 0
    assert a.free_pages.tolist() == [1, 2, 3, 4]


def test_alloc_extend_all_zero_length():
    a = make(num_pages=4, ps=4)
    out = call_extend(a, [0, 3], [0, 3], [-1, 6])
    assert out.numel() == 0
    assert a.free_pages.tolist() == [1, 2, 3, 4]


class Req:
    def __init__(self):
        self.row: list[int] = []

    @property
    def last_loc(self) -> int:
        return self.row[-1] if self.row else -1


def run_extend(a, model, reqs, lens, ps):
    """Extend each request to its new length; check the result against the spec; returns the output."""
    prefixes = [len(r.row) for r in reqs]
    last_locs = [r.last_loc for r in reqs]
    want, taken = expected_extend(prefixes, lens, last_locs, model.free, ps)
    for p, s, mine in zip(prefixes, lens, taken, strict=True):
        assert len(mine) == new_pages(p, s, ps)
    model.take(sum(len(m) for m in taken))
    out = call_extend(a, prefixes, lens, last_locs)
    assert out is not None
    assert out.tolist() == want
    assert a.free_pages.tolist() == model.free
    k = 0
    for r, p, s in zip(reqs, prefixes, lens, strict=True):
        r.row += want[k : k + s - p]
        k += s - p
    return out


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_alloc_extend_mixed_batch_derived(ps):
    num_pages = 64
    a, m = make(num_pages=num_pages, ps=ps), PagedModel(num_pages)
    reqs = [Req() for _ in range(5)]
    # Round 1: prefixes from nothing (last_loc = -1), mixed aligned/unaligned and empty.
    run_extend(a, m, reqs, [ps, ps + 1, 0, 2 * ps - 1, 3], ps)
    # Round 2: mixed aligned/unaligned prefixes, one zero-length extend, one staying inside its partial page.
    lens = [len(r.row) for r in reqs]
    run_extend(a, m, reqs, [lens[0] + 2 * ps + 1, lens[1], lens[2] + 1, lens[3] + 1, lens[4] + ps], ps)
    # Round 3: everyone grows by less than a page.
    run_extend(a, m, reqs, [len(r.row) + max(1, ps // 2) for r in reqs], ps)
    for r in reqs:
        assert all(slot % ps == pos % ps for pos, slot in enumerate(r.row))


@given(
    ps=st.sampled_from(PAGE_SIZES),
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4),
    rnd=st.randoms(use_true_random=False),
)
def test_alloc_extend_random_batches_match_spec_and_keep_layout(ps, lens, rnd):
    num_pages = 400
    a, m = make(num_pages=num_pages, ps=ps), PagedModel(num_pages)
    # A shuffled free list, so that "pages from the head in request order" is visible.
    order = list(range(1, num_pages + 1))
    rnd.shuffle(order)
    a.alloc(num_pages * ps)
    a.free_page_ids(t(order))
    m.free = order
    reqs = [Req() for _ in lens]
    run_extend(a, m, reqs, [p for p, _ in lens], ps)
    out = run_extend(a, m, reqs, [p + e for p, e in lens], ps)
    for r in reqs:
        # The layout invariant: the slot of position i has slot % ps == i % ps.
        assert all(slot % ps == pos % ps for pos, slot in enumerate(r.row))
    every = [s for r in reqs for s in r.row]
    assert len(set(every)) == len(every)
    assert min(every, default=ps) >= ps  # page 0 never handed out
    assert out.numel() == sum(e for _, e in lens)


def test_alloc_extend_none_when_out_of_pages_free_list_unchanged():
    a = make(num_pages=8, ps=4)
    a.alloc(24)  # free: 7 8
    snap = snapshot(a)
    # A needs ceil(9/4) = 3 pages > 2.
    assert call_extend(a, [0], [9], [-1]) is None
    assert_unchanged(a, snap)
    # Two requests needing 2 + 1 pages.
    assert call_extend(a, [0, 0], [5, 1], [-1, -1]) is None
    assert_unchanged(a, snap)
    # Exactly enough: 2 pages.
    assert call_extend(a, [0, 0], [4, 1], [-1, -1]).tolist() == [28, 29, 30, 31, 32]
    assert a.free_pages.numel() == 0


def test_alloc_extend_within_partial_pages_needs_no_free_page():
    a = make(num_pages=2, ps=4)
    first = call_extend(a, [0, 0], [1, 2], [-1, -1])
    assert first.tolist() == [4, 8, 9]
    assert a.free_pages.numel() == 0
    # Both extends stay inside their partial pages: last_loc + 1 onwards, no page needed.
    assert call_extend(a, [1, 2], [4, 3], [4, 9]).tolist() == [5, 6, 7, 10]


# -- alloc_decode ------------------------------------------------------------------------------------------------


def test_alloc_decode_by_hand_page_size_4():
    a = make(num_pages=16, ps=4)
    call_extend(a, [0, 0, 0], [4, 6, 8], [-1, -1, -1])  # A: 4..7  B: 8..13  C: 16..23; head 6
    # A pos 4 opens a page (6 -> 24), B pos 6 -> 13 + 1, C pos 8 opens a page (7 -> 28).
    out = call_decode(a, [5, 7, 9], [7, 13, 23])
    assert out.tolist() == [24, 14, 28]
    assert a.free_pages.tolist()[0] == 8


@pytest.mark.parametrize("ps", [4, 16])
def test_alloc_decode_mixed_batch_derived(ps):
    a, m = make(num_pages=32, ps=ps), PagedModel(32)
    reqs = [Req() for _ in range(6)]
    # Prefix lengths: aligned (next decode opens a page), mid-page, last-in-page, empty.
    run_extend(a, m, reqs, [ps, ps + 1, 2 * ps - 1, 0, 3 * ps, 1], ps)
    a.alloc(ps * 2)  # shift the head so page ids and positions do not coincide
    m.take(2)
    for _ in range(ps + 2):
        seqs = [len(r.row) + 1 for r in reqs]
        last_locs = [r.last_loc for r in reqs]
        want, used = expected_decode(seqs, last_locs, m.free, ps)
        assert any((s - 1) % ps == 0 for s in seqs) or used == 0
        m.take(used)
        out = call_decode(a, seqs, last_locs)
        assert out.tolist() == want
        assert a.free_pages.tolist() == m.free
        for r, slot in zip(reqs, want, strict=True):
            r.row.append(slot)
    for r in reqs:
        assert all(slot % ps == pos % ps for pos, slot in enumerate(r.row))


@given(ps=st.sampled_from([4, 16]), prefixes=st.lists(st.integers(0, 50), min_size=1, max_size=6))
def test_alloc_decode_random_batches_match_spec(ps, prefixes):
    a, m = make(num_pages=128, ps=ps), PagedModel(128)  # room for 6 * ceil(51 / 4) pages
    reqs = [Req() for _ in prefixes]
    run_extend(a, m, reqs, prefixes, ps)
    seqs = [p + 1 for p in prefixes]
    last_locs = [r.last_loc for r in reqs]
    want, used = expected_decode(seqs, last_locs, m.free, ps)
    out = call_decode(a, seqs, last_locs)
    assert out.tolist() == want
    assert a.free_pages.tolist() == m.free[used:]
    assert all(slot % ps == (s - 1) % ps for slot, s in zip(want, seqs, strict=True))


def test_alloc_decode_page_size_1_decodes_in_place_like_sglang():
    # SGLang 0.5.23 counts decode pages as seq_len % ps == 1, never true at page size 1: a paged allocator with
    # page size 1 returns last_loc + 1 and takes nothing from the free list (engines use the token allocator
    # there). The reference doc's "(seq_len-1) % ps == 0 opens a page" holds for ps > 1; SGLang's result wins.
    a = make(num_pages=16, ps=1)
    row = call_extend(a, [0], [3], [-1]).tolist()  # 1 2 3
    free_before = a.free_pages.tolist()
    out = call_decode(a, [4], [row[-1]])
    assert out.tolist() == [row[-1] + 1]
    assert a.free_pages.tolist() == free_before
    # A first decode with an empty row lands on the reserved slot 0: a misuse the wrapper reports.
    assert call_decode(a, [1], [-1]).tolist() == [0]


def test_alloc_decode_none_when_out_of_pages_state_unchanged():
    a = make(num_pages=3, ps=4)
    call_extend(a, [0, 0], [4, 4], [-1, -1])  # A: page 1 (4..7), B: page 2 (8..11); free: 3
    snap = snapshot(a)
    assert call_decode(a, [5, 5], [7, 11]) is None  # two openers, one free page
    assert_unchanged(a, snap)
    assert call_decode(a, [5], [7]).tolist() == [12]  # A alone opens page 3
    assert a.free_pages.numel() == 0
    snap = snapshot(a)
    assert call_decode(a, [6, 5], [12, 11]) is None  # B still needs a page
    assert_unchanged(a, snap)
    # No page needed: in-place decodes work with an empty free list.
    assert call_decode(a, [6], [12]).tolist() == [13]
    assert a.free_pages.numel() == 0


def test_alloc_decode_empty_batch():
    a = make(num_pages=2, ps=4)
    assert call_decode(a, [], []).numel() == 0
    assert a.free_pages.tolist() == [1, 2]


# -- frees -------------------------------------------------------------------------------------------------------


def test_free_dedups_pages_and_puts_them_sorted_at_head_by_hand():
    a = make(num_pages=8, ps=4)
    a.alloc(16)  # pages 1..4 (slots 4..19); free: 5..8
    a.free(t([13, 5, 14, 6, 4, 19]))  # pages 3 1 3 1 1 4
    assert a.free_pages.tolist() == [1, 3, 4, 5, 6, 7, 8]
    assert a.available_size() == 7 * 4


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_free_set_shaped_derived(ps):
    a, m = make(num_pages=20, ps=ps), PagedModel(20)
    out = a.alloc(12 * ps).tolist()
    m.take(12)
    chosen = [out[i] for i in (len(out) - 1, 0, ps * 5, ps * 5 + (ps - 1), 3 * ps, 0)]  # duplicates on purpose
    a.free(t(chosen))
    m.free_slots(chosen, ps)
    assert a.free_pages.tolist() == m.free


def test_free_empty_is_noop():
    a = make(num_pages=4, ps=4)
    a.alloc(8)
    snap = snapshot(a)
    a.free(t([]))
    a.free_page_ids(t([]))
    a.free_segment(t([]), start_pos=0)
    assert_unchanged(a, snap)


def test_free_int32_indices():
    a = make(num_pages=4, ps=4)
    a.alloc(16)
    a.free(t([9, 4], dtype=torch.int32))
    assert a.free_pages.tolist() == [1, 2]
    assert a.free_pages.dtype == torch.int64


def test_free_page_ids_keeps_order_and_does_not_dedup():
    a = make(num_pages=8, ps=4)
    a.alloc(32)
    a.free_page_ids(t([6, 2, 6]))
    assert a.free_pages.tolist() == [6, 2, 6]
    a.free_page_ids(t([5]))
    assert a.free_pages.tolist() == [5, 6, 2, 6]
    assert a.available_size() == 16


def _unsorted_row(a, ps, pages):
    """A request whose pages are ``pages`` in that order (released at the head, then extended into)."""
    a.alloc(a.free_pages.numel() * ps)
    a.free_page_ids(t(pages))
    return call_extend(a, [0], [len(pages) * ps], [-1])


def test_free_segment_one_page_per_representative_in_caller_order():
    ps = 4
    a = make(num_pages=10, ps=ps)
    row = _unsorted_row(a, ps, [7, 2, 5])  # slots 28..31, 8..11, 20..23
    assert row.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23]
    a.free_segment(row[4:10], start_pos=4)  # positions 4..9: pages 2 and 5 (end mid-page: whole page)
    assert a.free_pages.tolist() == [2, 5]
    a.free_segment(row[0:4], start_pos=0)
    assert a.free_pages.tolist() == [7, 2, 5]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_free_segment_derived(ps):
    pages = [9, 3, 12, 1, 6]
    a = make(num_pages=12, ps=ps)
    row = _unsorted_row(a, ps, pages).tolist()
    for start_page, end in ((1, 3 * ps + 1), (0, ps)):
        start = start_page * ps
        segment = row[start:end]
        a_before = a.free_pages.tolist()
        a.free_segment(t(segment), start_pos=start)
        reps = segment[::ps]  # one representative per page from an aligned start
        assert a.free_pages.tolist() == [s // ps for s in reps] + a_before


@pytest.mark.parametrize("ps, start", [(4, 1), (4, 6), (16, 8), (16, 17)])
def test_free_segment_unaligned_start_raises_and_changes_nothing(ps, start):
    a = make(num_pages=8, ps=ps)
    row = call_extend(a, [0], [3 * ps], [-1])
    snap = snapshot(a)
    with pytest.raises(ValueError) as excinfo:
        a.free_segment(row[start:], start_pos=start)
    assert excinfo.value.argument == "start_pos"
    assert "start_pos" in str(excinfo.value)
    assert_unchanged(a, snap)


def test_free_full_is_free():
    a = make(num_pages=4, ps=4)
    a.alloc(16)
    a.free_full(t([13, 5]))
    assert a.free_pages.tolist() == [1, 3]
    a.free_full_segment(t([8, 9, 10, 11]), start_pos=4)
    assert a.free_pages.tolist() == [2, 1, 3]


# -- free groups -------------------------------------------------------------------------------------------------


def test_free_group_order_by_hand():
    a = make(num_pages=12, ps=4)
    a.alloc(32)  # pages 1..8 out; free 9..12
    a.free_group_begin()
    a.free(t([22, 8, 9]))  # pages 5 2 2
    a.free_page_ids(t([7, 1]))
    a.free(t([13]))  # page 3
    a.free_segment(t([24, 25, 26, 27]), start_pos=8)  # page 6, page-id shaped
    assert a.free_pages.tolist() == [9, 10, 11, 12]
    assert a.available_size() == 16
    a.free_group_end()
    # set-shaped first: sorted {2, 3, 5} at the head; then page ids [7, 1, 6] at the very head.
    assert a.free_pages.tolist() == [7, 1, 6, 2, 3, 5, 9, 10, 11, 12]
    assert a.free_group is None


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("need_sort", [False, True])
def test_free_group_derived(ps, need_sort):
    a, m = make(num_pages=16, ps=ps, need_sort=need_sort), PagedModel(16, need_sort)
    out = a.alloc(12 * ps).tolist()
    m.take(12)
    a.free_group_begin()
    m.group_begin()
    calls = [
        ("set", [out[5 * ps], out[2 * ps + ps - 1]]),
        ("ids", [11, 4]),
        ("set", [out[0], out[5 * ps]]),
        ("ids", [9]),
        ("set", [out[7 * ps]]),
    ]
    before = a.free_pages.tolist()
    for kind, values in calls:
        if kind == "set":
            a.free(t(values))
            m.free_slots(values, ps)
        else:
            a.free_page_ids(t(values))
            m.free_page_ids(values)
        assert a.free_pages.tolist() == before
        assert staged(a) == []
    a.free_group_end()
    m.group_end(ps)
    assert a.free_pages.tolist() == m.free
    assert staged(a) == m.staged
    assert a.available_size() == (len(m.free) + len(m.staged)) * ps


def test_free_group_copies_the_callers_tensors():
    a = make(num_pages=8, ps=4)
    a.alloc(32)
    slots, ids = t([4, 5]), t([3])
    a.free_group_begin()
    a.free(slots)
    a.free_page_ids(ids)
    slots.fill_(28)
    ids.fill_(8)
    a.free_group_end()
    assert a.free_pages.tolist() == [3, 1]


def test_nested_free_group_begin_raises():
    a = make()
    a.free_group_begin()
    with pytest.raises(RuntimeError, match="nest"):
        a.free_group_begin()


# -- need_sort ---------------------------------------------------------------------------------------------------


def test_need_sort_frees_are_staged_and_counted():
    a = make(num_pages=8, ps=4, need_sort=True)
    a.alloc(24)  # free: 7 8
    a.free(t([13, 4]))  # pages 3, 1
    a.free_page_ids(t([5]))
    a.free_segment(t([8, 9]), start_pos=0)  # page 2
    assert a.free_pages.tolist() == [7, 8]
    assert sorted(staged(a)) == [1, 2, 3, 5]
    assert a.num_staged_pages == 4
    assert a.available_size() == (2 + 4) * 4


def test_need_sort_alloc_extend_merges_when_bound_exceeds_free_list():
    ps = 4
    a = make(num_pages=16, ps=ps, need_sort=True)
    a.alloc(48)  # free: 13 14 15 16
    a.free_page_ids(t([3, 1]))  # staged
    free, stg = [13, 14, 15, 16], [3, 1]
    # bound = extend_num_tokens // ps + bs + 1 = 4 // 4 + 1 + 1 = 3 <= 4: no merge, head page 13.
    assert 4 // ps + 1 + 1 <= len(free)
    assert call_extend(a, [0], [4], [-1]).tolist() == [52, 53, 54, 55]
    free = free[1:]
    assert a.free_pages.tolist() == free and sorted(staged(a)) == sorted(stg)
    # bound = 8 // 4 + 1 + 1 = 4 > 3 although only 2 pages are needed: merge + sort, then take 1 and 3.
    assert 8 // ps + 1 + 1 > len(free) >= 2
    merged = sorted(free + stg)
    assert call_extend(a, [0], [8], [-1]).tolist() == [p * ps + k for p in merged[:2] for k in range(ps)]
    assert a.free_pages.tolist() == merged[2:]
    assert staged(a) == [] and a.num_staged_pages == 0


def test_need_sort_alloc_extend_short_after_merge_returns_none():
    a = make(num_pages=4, ps=4, need_sort=True)
    a.alloc(16)
    a.free_page_ids(t([4, 2]))
    assert call_extend(a, [0], [12], [-1]) is None
    assert a.free_pages.tolist() == [2, 4]  # the merge happened first, as in SGLang; nothing was taken
    assert a.available_size() == 8


def test_need_sort_alloc_decode_merges_when_bs_exceeds_free_list():
    ps = 4
    a = make(num_pages=8, ps=ps, need_sort=True)
    rows = call_extend(a, [0, 0], [6, 4], [-1, -1]).tolist()  # A: pages 1, 2 (4..9)  B: page 3 (12..15)
    a.alloc(12)  # pages 4 5 6 out; free: 7 8
    a.free_page_ids(t([5, 4]))  # staged
    # bs = 2 <= 2 free pages: no merge. A in place (9 + 1), B opens page 7.
    out = call_decode(a, [7, 5], [rows[5], rows[-1]])
    assert out.tolist() == [10, 28]
    assert a.free_pages.tolist() == [8] and sorted(staged(a)) == [4, 5]
    # bs = 2 > 1 free page: merge -> sorted(8, 5, 4) = 4 5 8; A (position 7) in place, B (position 5) in place.
    out = call_decode(a, [8, 6], [10, 28])
    assert out.tolist() == [11, 29]
    assert a.free_pages.tolist() == [4, 5, 8] and staged(a) == []


def test_need_sort_alloc_decode_opener_takes_from_merged_list():
    ps = 4
    a = make(num_pages=4, ps=ps, need_sort=True)
    call_extend(a, [0, 0], [4, 4], [-1, -1])  # pages 1, 2; free: 3 4
    a.alloc(4)  # page 3; free: 4
    a.free_page_ids(t([3, 1]))  # staged (pages of a finished request)
    out = call_decode(a, [5, 5], [11, 11])  # two openers, bs 2 > 1: merge -> 1 3 4
    assert out.tolist() == [4, 12]
    assert a.free_pages.tolist() == [4]


def test_need_sort_alloc_merges_when_short():
    a = make(num_pages=6, ps=4, need_sort=True)
    a.alloc(16)  # free: 5 6
    a.free_page_ids(t([4, 2]))
    assert a.alloc(8).tolist() == list(range(20, 28))  # 2 pages fit: no merge
    assert sorted(staged(a)) == [2, 4]
    assert a.alloc(4).tolist() == [8, 9, 10, 11]  # 1 > 0: merge -> 2 4
    assert a.free_pages.tolist() == [4]


# -- reserved page 0 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("need_sort", [False, True])
def test_page_zero_is_never_handed_out_even_when_drained(ps, need_sort):
    num_pages = 6
    a = make(num_pages=num_pages, ps=ps, need_sort=need_sort)
    got = []
    got += call_extend(a, [0, 0], [ps + 1, 1], [-1, -1]).tolist()  # 3 pages
    got += a.alloc(2 * ps).tolist()  # 2 pages
    if ps > 1:
        got += call_decode(a, [1], [-1]).tolist()  # 1 page (position 0 opens a page)
    else:
        # At page size 1 alloc_decode does not open pages (see the xfail above): extend instead.
        got += call_extend(a, [0], [1], [-1]).tolist()
    assert a.available_size() == 0
    assert call_extend(a, [0], [1], [-1]) is None
    if ps > 1:
        assert call_decode(a, [1], [-1]) is None
    assert a.alloc(ps) is None
    assert min(got) >= ps
    # Free everything and drain again.
    a.free(t(got))
    again = a.alloc(num_pages * ps)
    assert again is not None and int(again.min()) >= ps
    assert sorted(again.tolist()) == list(range(ps, (num_pages + 1) * ps))
    assert a.alloc(ps) is None


# -- bad input ---------------------------------------------------------------------------------------------------


def _state(kind: str):
    a = make(num_pages=16, ps=4, need_sort=(kind == "need_sort"))
    a.alloc(40)  # pages 1..10 out
    a.free(t([4, 13]))  # pages 1, 3 (staged with need_sort)
    a.free_page_ids(t([7]))
    if kind == "group":
        a.free_group_begin()
        a.free(t([20]))
        a.free_page_ids(t([8]))
    return a


def _extend_args():
    # A fresh request of 5 and a request extending 4 -> 6 (last slot 19 of page 4).
    return dict(
        prefix_lens=t([0, 4]),
        prefix_lens_cpu=t([0, 4]),
        seq_lens=t([5, 6]),
        seq_lens_cpu=t([5, 6]),
        last_loc=t([-1, 19]),
        extend_num_tokens=7,
    )


def _decode_args():
    return dict(seq_lens=t([5, 7]), seq_lens_cpu=t([5, 7]), last_loc=t([19, 29]))


def _tensor_mutations(name, good):
    yield "float", good.float(), TypeError, name
    yield "list", good.tolist(), TypeError, name
    yield "none", None, TypeError, name
    yield "2d", good[None, :], ValueError, name
    yield "meta", torch.empty(good.shape, dtype=good.dtype, device=META), ValueError, name
    longer = torch.cat([good, good[:1]])
    # A longer seq_lens is the reference length: the first mirror compared with it is named.
    yield "longer", longer, ValueError, ("seq_lens_cpu" if name == "seq_lens" else name)


def _int_mutations(name):
    yield "bool", True, TypeError, name
    yield "float", 7.0, TypeError, name
    yield "none", None, TypeError, name
    yield "negative", -7, ValueError, name


def _cases():
    cases = []
    ext = _extend_args()
    for name, good in ext.items():
        if name == "extend_num_tokens":
            continue
        for label, bad, exc, named in _tensor_mutations(name, good):
            marks = ()
            cases.append(
                pytest.param("alloc_extend", {name: bad}, exc, named, id=f"alloc_extend-{name}-{label}", marks=marks)
            )
    for label, bad, exc, named in _int_mutations("extend_num_tokens"):
        cases.append(
            pytest.param(
                "alloc_extend", {"extend_num_tokens": bad}, exc, named, id=f"alloc_extend-extend_num_tokens-{label}"
            )
        )
    cases += [
        pytest.param(
            "alloc_extend",
            {"extend_num_tokens": 8},
            ValueError,
            "extend_num_tokens",
            id="alloc_extend-extend_num_tokens-wrong-sum",
        ),
        pytest.param(
            "alloc_extend",
            {"prefix_lens_cpu": t([0, 7]), "prefix_lens": t([0, 7])},
            ValueError,
            "prefix_lens_cpu",
            id="alloc_extend-prefix-gt-seq",
        ),
        pytest.param(
            "alloc_extend",
            {"prefix_lens_cpu": t([-1, 4]), "prefix_lens": t([-1, 4]), "extend_num_tokens": 8},
            ValueError,
            "prefix_lens_cpu",
            id="alloc_extend-negative-prefix",
        ),
        pytest.param(
            "alloc_extend", {"num_new_pages": True}, TypeError, "num_new_pages", id="alloc_extend-num_new_pages-bool"
        ),
        pytest.param(
            "alloc_extend", {"num_new_pages": -1}, ValueError, "num_new_pages", id="alloc_extend-num_new_pages-negative"
        ),
    ]
    for name, good in _decode_args().items():
        for label, bad, exc, named in _tensor_mutations(name, good):
            cases.append(pytest.param("alloc_decode", {name: bad}, exc, named, id=f"alloc_decode-{name}-{label}"))
    cases += [
        pytest.param(
            "alloc_decode",
            {"seq_lens_cpu": t([0, 7]), "seq_lens": t([0, 7])},
            ValueError,
            "seq_lens_cpu",
            id="alloc_decode-zero-seq",
        ),
        pytest.param(
            "alloc_decode",
            {"seq_lens_cpu": t([-3, 7]), "seq_lens": t([-3, 7])},
            ValueError,
            "seq_lens_cpu",
            id="alloc_decode-negative-seq",
        ),
    ]
    for label, bad, exc, named in _int_mutations("need_size"):
        cases.append(pytest.param("alloc", {"need_size": bad}, exc, named, id=f"alloc-{label}"))
    good_idx = t([36, 37])
    for method, arg in (
        ("free", "free_index"),
        ("free_full", "free_index"),
        ("free_page_ids", "page_ids"),
        ("free_segment", "free_index"),
        ("free_full_segment", "free_index"),
    ):
        for label, bad, exc, named in _tensor_mutations(arg, good_idx):
            if label == "longer":
                continue
            cases.append(pytest.param(method, {arg: bad}, exc, named, id=f"{method}-{label}"))
    for method in ("free_segment", "free_full_segment"):
        for label, bad, exc, named in [*_int_mutations("start_pos"), ("unaligned", 2, ValueError, "start_pos")]:
            cases.append(pytest.param(method, {"start_pos": bad}, exc, named, id=f"{method}-start_pos-{label}"))
    return cases


def _invoke(a, method, override):
    if method == "alloc_extend":
        kw = {**_extend_args(), **override}
        return a.alloc_extend(**kw)
    if method == "alloc_decode":
        kw = {**_decode_args(), **override}
        return a.alloc_decode(**kw)
    if method == "alloc":
        return a.alloc(override["need_size"])
    if method == "free_page_ids":
        return a.free_page_ids(override.get("page_ids", t([9])))
    if method in ("free", "free_full"):
        return getattr(a, method)(override["free_index"])
    # segments
    return getattr(a, method)(override.get("free_index", t([36, 37])), start_pos=override.get("start_pos", 0))


@pytest.mark.parametrize("kind", ["plain", "need_sort", "group"])
@pytest.mark.parametrize("method, override, exc_type, name", _cases())
def test_bad_input_raises_naming_argument_and_changes_nothing(kind, method, override, exc_type, name):
    a = _state(kind)
    snap = snapshot(a)
    with pytest.raises(exc_type) as excinfo:
        _invoke(a, method, override)
    assert isinstance(excinfo.value, ArgumentError)
    assert excinfo.value.argument == name
    assert str(excinfo.value).startswith(f"{name}:")
    assert_unchanged(a, snap)


@pytest.mark.parametrize("kind", ["plain", "need_sort", "group"])
@pytest.mark.parametrize("method", ["alloc_extend", "alloc_decode", "free_segment", "free_page_ids"])
def test_good_input_baseline_succeeds(kind, method):
    # The unmutated calls of the bad-input matrix are valid: the errors above come from the mutation alone.
    a = _state(kind)
    _invoke(a, method, {})
