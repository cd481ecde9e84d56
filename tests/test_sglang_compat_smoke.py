"""Smoke tests: SGLang 0.5.23's own allocators run on CPU through tests/sglang_compat.py.

Expected values were taken from SGLang 0.5.23 on CPU (pure-torch naive path).
Skipped when SGLang is not importable, except under CI=true, where that fails.
"""

from __future__ import annotations

import pytest

from tests import sglang_compat

try:
    import torch
except ImportError:  # reported through sglang_available() below
    torch = None


def i64(values):
    return torch.tensor(values, dtype=torch.int64)


def lst(t):
    return t.tolist()


def test_token_alloc_and_free_appends_at_tail():
    sglang_compat.require_sglang(require_swa=False)
    a = sglang_compat.make_sglang_token(8)
    assert type(a).__name__ == "TokenToKVPoolAllocator"
    assert lst(a.free_pages) == [1, 2, 3, 4, 5, 6, 7, 8]  # slot 0 is padding

    out = a.alloc(3)
    assert out.dtype == torch.int64 and out.device.type == "cpu"
    assert lst(out) == [1, 2, 3]
    assert a.available_size() == 5

    a.free(i64([2]))
    assert lst(a.free_pages) == [4, 5, 6, 7, 8, 2]  # freed slot appended at tail
    assert lst(a.alloc(6)) == [4, 5, 6, 7, 8, 2]
    assert a.alloc(1) is None
    assert a.available_size() == 0

    # Order of a free is kept as given (no sort / unique at page size 1).
    a.free(i64([3, 1]))
    assert lst(a.free_pages) == [3, 1]

    # Page-size-1 decode goes through alloc(); alloc_decode is paged-only.
    with pytest.raises(NotImplementedError):
        a.alloc_decode(i64([1]), i64([1]), i64([0]))


def test_token_need_sort_stages_frees_until_short():
    sglang_compat.require_sglang(require_swa=False)
    a = sglang_compat.make_sglang_token(8, need_sort=True)
    assert lst(a.alloc(6)) == [1, 2, 3, 4, 5, 6]
    a.free(i64([5, 2]))
    assert lst(a.free_pages) == [7, 8]
    assert lst(a.release_pages) == [5, 2]
    assert a.available_size() == 4
    assert lst(a.alloc(3)) == [2, 5, 7]  # merge_and_sort_free, then take the head
    assert lst(a.free_pages) == [8]


def test_paged_extend_decode_and_free_at_head():
    sglang_compat.require_sglang(require_swa=False)
    a = sglang_compat.make_sglang_paged(32, 4)
    assert type(a).__name__ == "PagedTokenToKVPoolAllocator"
    assert a.use_triton_kernels is False  # CPU: naive torch path
    assert a.debug_mode is False
    assert lst(a.free_pages) == [1, 2, 3, 4, 5, 6, 7, 8]  # page 0 is padding

    out = a.alloc_extend(i64([0]), i64([0]), i64([6]), i64([6]), i64([-1]), 6)
    assert out.dtype == torch.int64
    assert lst(out) == [4, 5, 6, 7, 8, 9]
    assert lst(a.free_pages) == [3, 4, 5, 6, 7, 8]
    assert a.available_size() == 24

    # Decode: seq_len 7 stays in page 2; seq_len 9 opens a new page (page 3).
    d7 = a.alloc_decode(i64([7]), i64([7]), i64([9]))
    assert lst(d7) == [10]
    d8 = a.alloc_decode(i64([8]), i64([8]), d7)
    assert lst(d8) == [11]
    d9 = a.alloc_decode(i64([9]), i64([9]), d8)
    assert lst(d9) == [12]
    assert lst(a.free_pages) == [4, 5, 6, 7, 8]

    # free(): page ids go through torch.unique (sorted, deduplicated) and are
    # put at the HEAD of free_pages.
    a.free(i64([12]))
    assert lst(a.free_pages) == [3, 4, 5, 6, 7, 8]
    a.free(i64([11, 10, 9, 8, 7, 6, 5, 4]))
    assert lst(a.free_pages) == [1, 2, 3, 4, 5, 6, 7, 8]

    # Reverse-order free comes back sorted: unique() sorts page ids.
    assert lst(a.alloc(12)) == list(range(4, 16))
    a.free(i64([12, 13, 4]))
    assert lst(a.free_pages) == [1, 3, 4, 5, 6, 7, 8]

    # free_page_ids / free_segment skip the unique: order kept as given.
    a.free_page_ids(i64([2]))
    assert lst(a.free_pages) == [2, 1, 3, 4, 5, 6, 7, 8]


def test_paged_need_sort_stages_pages():
    sglang_compat.require_sglang(require_swa=False)
    a = sglang_compat.make_sglang_paged(32, 4, need_sort=True)
    out = a.alloc(32)
    assert lst(out) == list(range(4, 36))  # token ids run up to size + page_size - 1
    a.free(out[20:24])  # page 6
    a.free(out[0:8])  # pages 1, 2
    assert lst(a.free_pages) == []
    assert [lst(p) for p in a.staged_pages] == [[6], [1, 2]]
    assert a.available_size() == 12
    assert lst(a.alloc(8)) == [4, 5, 6, 7, 8, 9, 10, 11]  # merged + sorted
    assert lst(a.free_pages) == [6]


def test_swa_extend_free_swa_segment_and_free_clear_mapping():
    sglang_compat.require_sglang(require_swa=True)
    a = sglang_compat.make_sglang_swa(32, 16, 4)
    assert type(a).__name__ == "SWATokenToKVPoolAllocator"
    kv = a.get_kvcache()
    mapping = a.full_to_swa_index_mapping
    assert kv.full_to_swa_index_mapping is mapping
    assert mapping.dtype == torch.int64
    assert mapping.shape == (32 + 4 + 1,)  # size + page_size, plus trailing -1
    assert mapping[-1].item() == -1
    full, swa = a.full_attn_allocator, a.swa_attn_allocator
    assert type(full).__name__ == "PagedTokenToKVPoolAllocator"
    assert full.use_triton_kernels is False
    assert (a.size_full, a.size_swa, a.size) == (32, 16, 16)

    r1 = a.alloc_extend(i64([0]), i64([0]), i64([6]), i64([6]), i64([-1]), 6)
    assert lst(r1) == [4, 5, 6, 7, 8, 9]
    assert lst(mapping[r1]) == [4, 5, 6, 7, 8, 9]
    assert lst(full.free_pages) == [3, 4, 5, 6, 7, 8]
    assert lst(swa.free_pages) == [3, 4]
    assert (a.full_available_size(), a.swa_available_size()) == (24, 8)
    assert a.available_size() == 8

    # Slide the window past the first page: SWA side only.
    a.free_swa_segment(r1[:4], start_pos=0)
    assert lst(mapping[r1]) == [0, 0, 0, 0, 8, 9]
    assert lst(swa.free_pages) == [1, 3, 4]  # page put at head
    assert lst(full.free_pages) == [3, 4, 5, 6, 7, 8]  # full side untouched

    # A second request now gets full page 3 but SWA page 1.
    r2 = a.alloc_extend(i64([0]), i64([0]), i64([3]), i64([3]), i64([-1]), 3)
    assert lst(r2) == [12, 13, 14]
    assert lst(a.translate_loc_from_full_to_swa(r2)) == [4, 5, 6]
    assert lst(kv.translate_loc_from_full_to_swa(i64([-1]))) == [-1]

    # Decode for r1 (seq_len 7, last_loc 9) stays in its pages on both sides.
    d = a.alloc_decode(i64([7]), i64([7]), i64([9]))
    assert lst(d) == [10]
    assert lst(mapping[d]) == [10]

    # free(): SWA peers first (mapping cleared), then the full slots.
    a.free(torch.cat([r1[4:], d]))
    assert lst(mapping[r1]) == [0] * 6 and mapping[10].item() == 0
    assert lst(swa.free_pages) == [2, 3, 4]
    assert lst(full.free_pages) == [2, 4, 5, 6, 7, 8]

    # free_full(): the first page's SWA peer is already gone.
    a.free_full(r1[:4])
    assert lst(full.free_pages) == [1, 2, 4, 5, 6, 7, 8]

    a.free(r2)
    assert int(mapping[:-1].abs().sum()) == 0
    assert mapping[-1].item() == -1
    assert (a.full_available_size(), a.swa_available_size()) == (32, 16)
