"""HiSparseTokenToKVPoolAllocator against the spec (shared/reference/sglang-allocator-semantics.md) and the
module contract of instrumented_alloc/allocators/hisparse.py.

Spec: a logical allocator ``host_to_device_ratio`` times larger than the device one; ``alloc_logical_only``
reserves logical slots only. Module contract: ``alloc_extend`` reserves both and records logical -> device in
``full_to_hisparse_device_index_mapping`` (0 = no device copy, last entry -1); ``free`` releases the logical pages
and the device slots mapped from them and clears the mapping; ``available_size`` = min of the two; ``size`` is the
logical size. Expected slots come from the paged extend rule, written out here (``expected_extend``), never from a
run of the allocator.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from instrumented_alloc.allocators import HiSparseTokenToKVPoolAllocator
from instrumented_alloc.argcheck import ArgumentError

CPU = torch.device("cpu")
META = torch.device("meta")
PS = 4


def t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=CPU)


def make(device_pages=8, ps=PS, ratio=2, need_sort=False):
    return HiSparseTokenToKVPoolAllocator(
        device_pages * ps, ps, torch.float16, "cpu", kvcache=None, need_sort=need_sort, host_to_device_ratio=ratio
    )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def expected_extend(prefixes, seqs, last_locs, free_list, ps):
    """Paged extend rule: continue from last_loc+1 to the end of the partial page, then new pages from the head of
    the free list (page*ps + offset), request by request. Returns (slots, pages taken)."""
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


class HiSparseModel:
    def __init__(self, device_pages: int, ratio: int, ps: int):
        self.ps = ps
        self.logical = list(range(1, device_pages * ratio + 1))
        self.device = list(range(1, device_pages + 1))
        self.map: dict[int, int] = {}

    def logical_only(self, prefixes, seqs, last_locs):
        out, n = expected_extend(prefixes, seqs, last_locs, self.logical, self.ps)
        self.logical = self.logical[n:]
        return out

    def extend(self, prefixes, seqs, last_locs):
        logical = self.logical_only(prefixes, seqs, last_locs)
        dev_last = [-1 if x == -1 else self.map.get(x, 0) for x in last_locs]
        device, n = expected_extend(prefixes, seqs, dev_last, self.device, self.ps)
        self.device = self.device[n:]
        self.map.update(zip(logical, device, strict=True))
        return logical, device

    def free(self, slots) -> None:
        self.logical = sorted({s // self.ps for s in slots}) + self.logical
        device = [self.map.pop(s) for s in slots if self.map.get(s, 0) > 0]
        if device:
            self.device = sorted({d // self.ps for d in device}) + self.device


def assert_matches(a, m: HiSparseModel) -> None:
    assert a.logical_attn_allocator.free_pages.tolist() == m.logical
    assert a.hisparse_attn_allocator.free_pages.tolist() == m.device
    mapping = a.full_to_hisparse_device_index_mapping
    want = torch.zeros_like(mapping)
    want[-1] = -1
    if m.map:
        want[t(list(m.map))] = t(list(m.map.values()))
    assert torch.equal(mapping, want)


def mapping_of(a, slots):
    return a.full_to_hisparse_device_index_mapping[t(slots)].tolist()


def call(a, method, prefixes, seqs, last_locs):
    p, s = t(prefixes), t(seqs)
    return getattr(a, method)(p, p.clone(), s, s.clone(), t(last_locs), sum(seqs) - sum(prefixes))


# -- sizes -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_size_is_the_logical_size(ratio):
    a = make(device_pages=8, ratio=ratio)
    assert a.size == 8 * PS * ratio
    assert a.size_full == 8 * PS * ratio
    assert a.logical_attn_allocator.free_pages.tolist() == list(range(1, 8 * ratio + 1))
    assert a.hisparse_attn_allocator.free_pages.tolist() == list(range(1, 9))
    mapping = a.full_to_hisparse_device_index_mapping
    assert mapping.shape == (8 * PS * ratio + PS + 1,)
    assert mapping[-1].item() == -1 and int(mapping[:-1].count_nonzero()) == 0


def test_available_size_is_min():
    a = make(device_pages=8, ratio=2)
    assert a.available_size() == min(16 * PS, 8 * PS)
    call(a, "alloc_logical_only", [0], [9 * PS], [-1])  # 9 logical pages: 7 left < 8 device pages
    assert a.available_size() == 7 * PS


# -- allocation --------------------------------------------------------------------------------------------------


def test_alloc_logical_only_by_hand():
    a = make(device_pages=4, ratio=2)
    out = call(a, "alloc_logical_only", [0, 0], [5, 2], [-1, -1])
    assert out.tolist() == [4, 5, 6, 7, 8, 12, 13]
    assert a.logical_attn_allocator.free_pages.tolist() == [4, 5, 6, 7, 8]
    assert a.hisparse_attn_allocator.free_pages.tolist() == [1, 2, 3, 4]
    assert mapping_of(a, out.tolist()) == [0] * 7


def test_alloc_extend_by_hand():
    a = make(device_pages=4, ratio=2)
    call(a, "alloc_logical_only", [0], [8], [-1])  # logical pages 1, 2
    # A: 0..5 -> logical pages 3, 4 (12..17), device pages 1, 2 (4..9).
    out = call(a, "alloc_extend", [0], [6], [-1])
    assert out.tolist() == [12, 13, 14, 15, 16, 17]
    assert mapping_of(a, out.tolist()) == [4, 5, 6, 7, 8, 9]
    # A: 6..8 continues in both spaces: logical 18, 19 + page 5 (20); device mapping[17] + 1 = 10, 11 + page 3 (12).
    out = call(a, "alloc_extend", [6], [9], [17])
    assert out.tolist() == [18, 19, 20]
    assert mapping_of(a, [18, 19, 20]) == [10, 11, 12]
    assert a.hisparse_attn_allocator.free_pages.tolist() == [4]


def test_alloc_logical_only_and_extend_derived():
    a, m = make(device_pages=16, ratio=2), HiSparseModel(16, 2, PS)
    assert call(a, "alloc_logical_only", [0, 0], [3, 9], [-1, -1]).tolist() == m.logical_only([0, 0], [3, 9], [-1, -1])
    assert_matches(a, m)
    logical, _ = m.extend([0, 0, 0], [7, 4, 1], [-1, -1, -1])
    assert call(a, "alloc_extend", [0, 0, 0], [7, 4, 1], [-1, -1, -1]).tolist() == logical
    assert_matches(a, m)
    last = [logical[6], logical[10], logical[11]]
    logical2, _ = m.extend([7, 4, 1], [13, 4, 6], last)
    assert call(a, "alloc_extend", [7, 4, 1], [13, 4, 6], last).tolist() == logical2
    assert_matches(a, m)


@given(lens=st.lists(st.integers(0, 20), min_size=1, max_size=4), logical_first=st.integers(0, 10))
def test_alloc_extend_random_batches(lens, logical_first):
    a, m = make(device_pages=32, ratio=2), HiSparseModel(32, 2, PS)
    if logical_first:
        assert call(a, "alloc_logical_only", [0], [logical_first], [-1]).tolist() == m.logical_only(
            [0], [logical_first], [-1]
        )
    n = len(lens)
    logical, device = m.extend([0] * n, lens, [-1] * n)
    out = call(a, "alloc_extend", [0] * n, lens, [-1] * n)
    assert out.tolist() == logical
    assert_matches(a, m)
    pos = [i for s in lens for i in range(s)]
    assert all(x % PS == i % PS and d % PS == i % PS for x, d, i in zip(logical, device, pos, strict=True))


def test_alloc_extend_none_when_either_space_is_short():
    a = make(device_pages=2, ratio=2)
    snap = snapshot(a)
    assert call(a, "alloc_extend", [0], [9], [-1]) is None  # 3 pages: 4 logical, 2 device
    assert_unchanged(a, snap)
    call(a, "alloc_logical_only", [0], [4 * PS], [-1])  # logical space now empty
    snap = snapshot(a)
    assert call(a, "alloc_extend", [0], [1], [-1]) is None
    assert_unchanged(a, snap)
    assert call(a, "alloc_logical_only", [0], [1], [-1]) is None
    assert_unchanged(a, snap)


def test_alloc_decode_is_logical_only():
    a = make(device_pages=4, ratio=2)
    call(a, "alloc_extend", [0], [4], [-1])  # logical page 1, device page 1
    s = t([5])
    out = a.alloc_decode(s, s.clone(), t([7]))  # position 4 opens logical page 2
    assert out.tolist() == [8]
    assert a.hisparse_attn_allocator.free_pages.tolist() == [2, 3, 4]
    assert mapping_of(a, [8]) == [0]


# -- free --------------------------------------------------------------------------------------------------------


def test_free_releases_both_and_clears_mapping_by_hand():
    a = make(device_pages=4, ratio=2)
    call(a, "alloc_logical_only", [0], [4], [-1])  # logical page 1
    out = call(a, "alloc_extend", [0], [6], [-1]).tolist()  # logical 8..13 -> device 4..9
    a.free(t(out))
    assert a.logical_attn_allocator.free_pages.tolist() == [2, 3, 4, 5, 6, 7, 8]
    assert a.hisparse_attn_allocator.free_pages.tolist() == [1, 2, 3, 4]
    assert mapping_of(a, out) == [0] * 6


def test_free_derived_mixed_logical_only_and_mapped():
    a, m = make(device_pages=16, ratio=2), HiSparseModel(16, 2, PS)
    lo = call(a, "alloc_logical_only", [0], [6], [-1]).tolist()
    m.logical_only([0], [6], [-1])
    logical, _ = m.extend([0, 0], [5, 9], [-1, -1])
    assert call(a, "alloc_extend", [0, 0], [5, 9], [-1, -1]).tolist() == logical
    chosen = [logical[7], *lo, logical[0], logical[1], logical[2], logical[3], logical[4]]
    a.free(t(chosen))
    m.free(chosen)
    assert_matches(a, m)
    assert a.available_size() == min(len(m.logical), len(m.device)) * PS


def test_a_free_that_over_credits_a_pool_asserts_after_the_change_as_sglang():
    # SGLang's HiSparse free asserts, after freeing, that neither pool lists more free slots than it has: a double
    # free with the pools nearly empty trips it. The state changed before the assert, as in SGLang.
    a = make(device_pages=4, ratio=2)
    out = call(a, "alloc_extend", [0], [16], [-1])  # every device page
    a.free(out)
    before = a.logical_attn_allocator.free_pages.clone()
    with pytest.raises(AssertionError, match=r"^free: pool has \d+ free slots but only \d+ slots$"):
        a.free(out)
    assert len(a.logical_attn_allocator.free_pages) > len(before)  # freed again: listed twice


def test_free_empty_is_noop():
    a = make()
    call(a, "alloc_extend", [0], [6], [-1])
    snap = snapshot(a)
    a.free(t([]))
    assert_unchanged(a, snap)


def test_free_groups_are_no_ops_frees_are_immediate():
    a = make(device_pages=4, ratio=2)
    out = call(a, "alloc_extend", [0], [4], [-1])
    a.free_group_begin()
    a.free(out)
    assert a.logical_attn_allocator.free_pages.tolist()[0] == 1
    assert a.hisparse_attn_allocator.free_pages.tolist()[0] == 1
    a.free_group_end()
    assert mapping_of(a, out.tolist()) == [0] * 4


def test_page_size_1_alloc():
    a = make(device_pages=4, ps=1, ratio=2)
    out = a.alloc(3)
    assert out.tolist() == [1, 2, 3]
    assert mapping_of(a, [1, 2, 3]) == [1, 2, 3]
    assert a.available_size() == min(8 - 3, 4 - 3)
    logical_before = a.logical_attn_allocator.free_pages.clone()
    assert a.alloc(2) is None  # 1 device slot left: the logical slots are given back
    assert sorted(a.logical_attn_allocator.free_pages.tolist()) == sorted(logical_before.tolist())


# -- bad input ---------------------------------------------------------------------------------------------------


def _inner(x):
    return (x.free_pages.clone(), [s.clone() for s in x.staged_pages], x.num_staged_pages)


def snapshot(a):
    return dict(
        logical=_inner(a.logical_attn_allocator),
        device=_inner(a.hisparse_attn_allocator),
        mapping=a.full_to_hisparse_device_index_mapping.clone(),
    )


def assert_unchanged(a, snap) -> None:
    now = snapshot(a)
    assert torch.equal(now["mapping"], snap["mapping"])
    for key in ("logical", "device"):
        free, staged, n = now[key]
        free0, staged0, n0 = snap[key]
        assert torch.equal(free, free0), key
        assert n == n0 and len(staged) == len(staged0), key
        assert all(torch.equal(x, y) for x, y in zip(staged, staged0, strict=True)), key


def _state(need_sort: bool):
    a = make(device_pages=8, ratio=2, need_sort=need_sort)
    call(a, "alloc_logical_only", [0], [8], [-1])  # logical 4..11
    call(a, "alloc_extend", [0, 0], [6, 4], [-1, -1])  # A: logical 12..17, B: logical 20..23
    a.free(t([4, 20]))  # (staged with need_sort)
    return a


def _extend_args():
    return dict(
        prefix_lens=t([6, 0]),
        prefix_lens_cpu=t([6, 0]),
        seq_lens=t([9, 3]),
        seq_lens_cpu=t([9, 3]),
        last_loc=t([17, -1]),
        extend_num_tokens=6,
    )


def _tensor_mutations(name, good):
    yield "float", good.float(), TypeError, name
    yield "list", good.tolist(), TypeError, name
    yield "none", None, TypeError, name
    yield "2d", good[None, :], ValueError, name
    yield "meta", torch.empty(good.shape, dtype=good.dtype, device=META), ValueError, name
    yield "longer", torch.cat([good, good[:1]]), ValueError, ("seq_lens_cpu" if name == "seq_lens" else name)


def _cases():
    cases = []
    for method in ("alloc_extend", "alloc_logical_only"):
        for name, good in _extend_args().items():
            if name == "extend_num_tokens":
                continue
            for label, bad, exc, named in _tensor_mutations(name, good):
                marks = ()
                cases.append(pytest.param(method, {name: bad}, exc, named, id=f"{method}-{name}-{label}", marks=marks))
        for label, bad, exc in (("bool", True, TypeError), ("float", 6.0, TypeError), ("none", None, TypeError),
                                ("negative", -6, ValueError), ("wrong-sum", 7, ValueError)):  # fmt: skip
            cases.append(
                pytest.param(method, {"extend_num_tokens": bad}, exc, "extend_num_tokens", id=f"{method}-ent-{label}")
            )
        cases.append(
            pytest.param(
                method,
                {"prefix_lens_cpu": t([10, 0]), "prefix_lens": t([10, 0])},
                ValueError,
                "prefix_lens_cpu",
                id=f"{method}-prefix-gt-seq",
            )
        )
    decode = dict(seq_lens=t([7, 5]), seq_lens_cpu=t([7, 5]), last_loc=t([17, 23]))
    for name, good in decode.items():
        for label, bad, exc, named in _tensor_mutations(name, good):
            cases.append(pytest.param("alloc_decode", {name: bad}, exc, named, id=f"alloc_decode-{name}-{label}"))
    for label, bad, exc, named in _tensor_mutations("free_index", t([12, 13])):
        if label != "longer":
            cases.append(pytest.param("free", {"free_index": bad}, exc, named, id=f"free-{label}"))
    return cases


def _invoke(a, method, override):
    if method in ("alloc_extend", "alloc_logical_only"):
        return getattr(a, method)(**{**_extend_args(), **override})
    if method == "alloc_decode":
        kw = dict(seq_lens=t([7, 5]), seq_lens_cpu=t([7, 5]), last_loc=t([17, 23]))
        return a.alloc_decode(**{**kw, **override})
    return a.free(override.get("free_index", t([12, 13])))


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("method, override, exc_type, name", _cases())
def test_bad_input_raises_naming_argument_and_changes_nothing(need_sort, method, override, exc_type, name):
    a = _state(need_sort)
    snap = snapshot(a)
    with pytest.raises(exc_type) as excinfo:
        _invoke(a, method, override)
    assert isinstance(excinfo.value, ArgumentError)
    assert excinfo.value.argument == name
    assert str(excinfo.value).startswith(f"{name}:")
    assert_unchanged(a, snap)


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("method", ["alloc_extend", "alloc_logical_only", "alloc_decode", "free"])
def test_good_input_baseline_succeeds(need_sort, method):
    # The unmutated calls of the bad-input matrix are valid: the errors above come from the mutation alone.
    a = _state(need_sort)
    out = _invoke(a, method, {})
    if method != "free":
        assert out is not None
