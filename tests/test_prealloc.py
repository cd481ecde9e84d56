"""PD decode-side preallocation: ``swa_tail_len`` (table and property), ``alloc_for_decode_prealloc`` and the
HiSparse variant over wrapped and bare allocators: exact ledger values, pages per pool, the seed's I2 at the
checked write point, a short pool, and argument errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from instrumented_alloc import InstrumentedAllocator, InvariantViolation, KvLedger
from instrumented_alloc.allocators import (
    HiSparseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
)
from instrumented_alloc.prealloc import alloc_for_decode_prealloc, alloc_for_decode_prealloc_hisparse, swa_tail_len
from tests.engine_model import allocator_state, t

F16 = torch.float16
PS = 16
WINDOW = 32


def swa(size=640, size_swa=320):
    return SWATokenToKVPoolAllocator(size, size_swa, PS, F16, "cpu", None, False)


def wrapped_swa(**kwargs):
    return InstrumentedAllocator(swa(**kwargs), mode="record", sliding_window=WINDOW)


def owned_pages(w, rid) -> dict[str, int]:
    slot = w.ledger[rid].slot
    return {name: int(np.count_nonzero(snap.owner == slot)) for name, snap in w.snapshot().items()}


def record(w, rid) -> tuple[int, int, int]:
    kv = w.ledger[rid]
    return kv.kv_allocated_len, kv.kv_committed_len, kv.swa_evicted_seqlen


# -- swa_tail_len --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("seq", "window", "ps", "tail"),
    [
        (100, 32, 16, 36),  # the seed's case: start 68 floored to 64
        (10, 32, 16, 10),  # shorter than the window: everything
        (0, 32, 16, 0),
        (32, 32, 16, 32),  # exactly the window
        (33, 32, 16, 33),  # start 1 floors to 0
        (48, 32, 16, 32),  # start 16, aligned
        (49, 32, 16, 33),
        (64, 64, 16, 64),
        (65, 64, 16, 65),
        (80, 64, 16, 64),
        (81, 64, 16, 65),
        (95, 64, 16, 79),  # the longest tail: window + page_size - 1
        (96, 64, 16, 64),
        (100, 32, 1, 32),  # page size 1: exactly the window
        (100, 1, 16, 4),  # window 1: from the last page boundary
        (7, 8, 4, 7),
        (12, 8, 4, 8),
        (13, 8, 4, 9),
    ],
)
def test_swa_tail_len_table(seq, window, ps, tail):
    assert swa_tail_len(seq, window, ps) == tail
    start = max(0, seq - window) // ps * ps
    assert tail == seq - start


@settings(max_examples=200)
@given(seq=st.integers(0, 20000), window=st.integers(1, 4096), ps=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]))
def test_swa_tail_len_property(seq, window, ps):
    tail = swa_tail_len(seq, window, ps)
    assert type(tail) is int
    assert (seq - tail) % ps == 0  # the evicted length stays page-aligned (I2)
    assert min(seq, window) <= tail <= seq  # the whole window is kept
    assert tail < window + ps  # and less than one extra page
    if seq <= window:
        assert tail == seq


@given(seq=st.integers(0, 5000), window=st.integers(1, 512), ps=st.sampled_from([1, 4, 16, 64]))
@settings(max_examples=50)
def test_swa_tail_len_is_minimal(seq, window, ps):
    """No shorter page-aligned tail keeps the window: one page less would evict inside it."""
    tail = swa_tail_len(seq, window, ps)
    if tail >= ps:
        assert tail - ps < min(seq, window)


@pytest.mark.parametrize(
    ("args", "exc", "name"),
    [
        ((-1, 32, 16), ValueError, "seq_len"),
        ((10, 0, 16), ValueError, "window"),
        ((10, 32, 0), ValueError, "page_size"),
        ((10.0, 32, 16), TypeError, "seq_len"),
        ((10, True, 16), TypeError, "window"),
        ((10, 32, "16"), TypeError, "page_size"),
    ],
)
def test_swa_tail_len_bad_arguments(args, exc, name):
    with pytest.raises(exc) as info:
        swa_tail_len(*args)
    assert str(info.value).startswith(f"{name}: ")


def test_swa_tail_len_accepts_numpy_ints():
    assert swa_tail_len(np.int64(100), np.int32(32), np.int64(16)) == 36


# -- alloc_for_decode_prealloc, wrapped ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fill", "tail", "full_pages", "swa_pages"),
    [
        (100, 36, 7, 3),  # swa_tail_len(100, 32, 16)
        (64, 32, 4, 2),  # aligned fill: evicted 32
        (20, 20, 2, 2),  # shorter than the window: nothing evicted
        (100, None, 7, 7),  # no tail: SWA KV for every token
        (16, None, 1, 1),
    ],
)
def test_prealloc_wrapped_swa_exact_ledger_and_pages(fill, tail, full_pages, swa_pages):
    w = wrapped_swa()
    out = alloc_for_decode_prealloc(w, rid="r", fill_len=fill, swa_tail_len=tail)
    assert out is not None and out.shape == (fill,)
    evicted = 0 if tail is None else fill - tail
    assert record(w, "r") == (-(-fill // PS) * PS, fill, evicted)
    assert owned_pages(w, "r") == {"full": full_pages, "swa": swa_pages}
    assert w.inner.full_available_size() == 640 - full_pages * PS
    assert w.inner.swa_available_size() == 320 - swa_pages * PS
    # The SWA tail maps the last `tail` positions only.
    mapped = (w.inner.full_to_swa_index_mapping[out] > 0).tolist()
    assert mapped == [False] * evicted + [True] * (fill - evicted)
    w.step()
    assert list(w.violations) == []
    # The decode side later finishes the request: SWA tail first, then the full KV.
    if evicted < fill:
        w.free_swa_segment(out[evicted:], start_pos=evicted)
    w.free_full(out)
    w.release_request("r")
    w.step()
    assert w.check_consistency() == []
    assert list(w.violations) == []


def test_prealloc_wrapped_unaligned_tail_recorded_not_stored():
    w = wrapped_swa()
    out = alloc_for_decode_prealloc(w, rid="bad", fill_len=100, swa_tail_len=30)
    assert out is not None
    # evicted 70: unaligned AND inside the window (at most 100 - 32 = 68). The wrapper records every broken
    # rule of the write, in the ledger's order (a standalone ledger raises the first).
    assert [v.invariant for v in w.violations] == ["swa_evicted_seqlen_page_aligned", "swa_evicted_within_window"]
    assert {v.rid for v in w.violations} == {"bad"}
    assert record(w, "bad") == (112, 100, 0)
    w.step()  # the request's pages disagree with its ledger for a reported reason: not reported again
    assert len(w.violations) == 2


def test_prealloc_without_tail_on_paged():
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(256, PS, F16, "cpu", None, False), mode="raise")
    out = alloc_for_decode_prealloc(w, rid="p", fill_len=33)
    assert out.tolist() == list(range(16, 49))
    assert record(w, "p") == (48, 33, 0)
    assert owned_pages(w, "p") == {"full": 3}


@pytest.mark.parametrize("kind", ["ours-token", "ours-swa1", "sglang-token", "sglang-swa1"])
def test_prealloc_at_page_size_1_allocates_with_alloc(kind):
    # SGLang's scheduler preallocates with alloc(delta_len) at page size 1 (SWA KV for every token, a tail or
    # not): so does the helper, on our allocators and SGLang's own behind the wrapper.
    from instrumented_alloc.allocators import TokenToKVPoolAllocator
    from tests import sglang_compat

    if kind.startswith("sglang"):
        sglang_compat.require_sglang(kind.endswith("swa1"))
    make = {
        "ours-token": lambda: TokenToKVPoolAllocator(64, F16, "cpu", None, False),
        "ours-swa1": lambda: SWATokenToKVPoolAllocator(64, 48, 1, F16, "cpu", None, False),
        "sglang-token": lambda: sglang_compat.make_sglang_token(64),
        "sglang-swa1": lambda: sglang_compat.make_sglang_swa(64, 48, 1),
    }[kind]
    swa1 = kind.endswith("swa1")
    w = InstrumentedAllocator(make(), mode="raise", sliding_window=8 if swa1 else None)
    out = alloc_for_decode_prealloc(w, rid="p", fill_len=5, swa_tail_len=3 if swa1 else None)
    assert out.tolist() == [1, 2, 3, 4, 5]
    assert record(w, "p") == (5, 5, 0)
    assert owned_pages(w, "p") == ({"full": 5, "swa": 5} if swa1 else {"full": 5})
    assert list(w.violations) == []


# -- over a bare allocator with a standalone ledger ----------------------------------------------------------------
def test_prealloc_bare_with_standalone_ledger_aligned():
    bare = swa()
    led = KvLedger(PS, sliding_window=WINDOW)
    out = alloc_for_decode_prealloc(bare, rid="b", fill_len=100, swa_tail_len=36, ledger=led)
    assert out is not None and out.shape == (100,)
    kv = led["b"]
    assert (kv.kv_allocated_len, kv.kv_committed_len, kv.swa_evicted_seqlen) == (112, 100, 64)
    assert (bare.full_available_size(), bare.swa_available_size()) == (640 - 112, 320 - 48)


def test_prealloc_bare_unaligned_tail_raises_from_the_ledger_and_is_not_stored():
    bare = swa()
    led = KvLedger(PS, sliding_window=WINDOW)
    with pytest.raises(InvariantViolation) as info:
        alloc_for_decode_prealloc(bare, rid="b", fill_len=100, swa_tail_len=32, ledger=led)
    v = info.value.violation
    assert (v.invariant, v.rid, v.op) == ("swa_evicted_seqlen_page_aligned", "b", "ledger")
    assert v.message == "swa_evicted_seqlen=68 is not a non-negative multiple of page_size=16 (remainder 4); kept 0"
    kv = led["b"]
    # allocated and committed were written first (the documented order); the evicted length never stored.
    assert (kv.kv_allocated_len, kv.kv_committed_len, kv.swa_evicted_seqlen) == (112, 100, 0)
    # The allocation itself happened (the ledger write comes after it).
    assert (bare.full_available_size(), bare.swa_available_size()) == (640 - 112, 320 - 32)


def test_prealloc_bare_without_ledger_is_a_type_error():
    bare = swa()
    state = allocator_state(bare)
    with pytest.raises(TypeError, match=r"^ledger: a bare allocator needs a KvLedger"):
        alloc_for_decode_prealloc(bare, rid="b", fill_len=100, swa_tail_len=36)
    assert allocator_state(bare) == state


# -- HiSparse variant ----------------------------------------------------------------------------------------------
def test_prealloc_hisparse_logical_only():
    inner = HiSparseTokenToKVPoolAllocator(64, 4, F16, "cpu", None, False, 2)
    w = InstrumentedAllocator(inner, mode="record")
    device_free = inner.hisparse_attn_allocator.free_pages.clone()
    device_avail = inner.hisparse_attn_allocator.available_size()
    out = alloc_for_decode_prealloc_hisparse(w, rid="h", fill_len=10, uses_swa_tail=False, swa_tail_len=4)
    assert out.tolist() == list(range(4, 14))
    assert record(w, "h") == (12, 10, 0)  # swa_tail_len is ignored without uses_swa_tail
    assert w.pools == ("full",)
    assert owned_pages(w, "h") == {"full": 3}
    assert inner.logical_attn_allocator.available_size() == 128 - 12
    # No device buffer: the device allocator and the mapping are untouched.
    assert torch.equal(inner.hisparse_attn_allocator.free_pages, device_free)
    assert inner.hisparse_attn_allocator.available_size() == device_avail
    assert not inner.full_to_hisparse_device_index_mapping[:-1].any()
    w.step()
    assert list(w.violations) == []
    w.free(out)
    w.release_request("h")
    assert w.check_consistency() == []
    assert list(w.violations) == []


def test_prealloc_hisparse_with_swa_tail_on_swa():
    w = wrapped_swa()
    out = alloc_for_decode_prealloc_hisparse(w, rid="s", fill_len=100, uses_swa_tail=True, swa_tail_len=36)
    assert out is not None
    assert record(w, "s") == (112, 100, 64)
    assert owned_pages(w, "s") == {"full": 7, "swa": 3}
    w.step()
    assert list(w.violations) == []


def test_prealloc_hisparse_unaligned_tail_raise_mode_refuses_the_allocation():
    # The tail implies swa_evicted_seqlen 60 (page size 16: remainder 12), judged from host values before the call:
    # raise mode refuses it there, so nothing is handed out and nothing is written.
    inner = swa()
    w = InstrumentedAllocator(inner, mode="raise", sliding_window=WINDOW)
    before = (inner.full_available_size(), inner.swa_available_size())
    with pytest.raises(InvariantViolation) as info:
        alloc_for_decode_prealloc_hisparse(w, rid="s", fill_len=100, uses_swa_tail=True, swa_tail_len=40)
    assert info.value.invariant == "swa_evicted_seqlen_page_aligned"
    assert info.value.violation.rid == "s" and info.value.violation.op == "alloc_extend_swa_tail"
    assert "seq_len=100, swa_tail_len=40 implies swa_evicted_seqlen=60" in str(info.value)
    assert (inner.full_available_size(), inner.swa_available_size()) == before
    assert record(w, "s") == (0, 0, 0)


def test_prealloc_hisparse_bare_with_ledger():
    inner = HiSparseTokenToKVPoolAllocator(64, 4, F16, "cpu", None, False, 2)
    led = KvLedger(4)
    out = alloc_for_decode_prealloc_hisparse(inner, rid="h", fill_len=9, uses_swa_tail=False, ledger=led)
    assert out.shape == (9,)
    assert (led["h"].kv_allocated_len, led["h"].kv_committed_len, led["h"].swa_evicted_seqlen) == (12, 9, 0)


# -- a pool too small ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fill", "tail"),
    [(100, 36), (60, 60), (200, None)],  # full pool of 64 tokens; SWA pool of 32
)
def test_prealloc_pool_too_small_writes_nothing(fill, tail):
    inner = swa(size=64, size_swa=32)
    bare = swa(size=64, size_swa=32)
    w = InstrumentedAllocator(inner, mode="raise", sliding_window=WINDOW)
    assert alloc_for_decode_prealloc(w, rid="s", fill_len=fill, swa_tail_len=tail) is None
    assert allocator_state(inner) == allocator_state(bare)
    # The binding created the request id; nothing was written to it.
    assert "s" in w.ledger
    assert record(w, "s") == (0, 0, 0)
    assert list(w.violations) == []
    w.release_request("s")
    assert "s" not in w.ledger and list(w.violations) == []


def test_prealloc_pool_too_small_bare_ledger_untouched():
    bare = swa(size=64, size_swa=32)
    led = KvLedger(PS, sliding_window=WINDOW)
    assert alloc_for_decode_prealloc(bare, rid="s", fill_len=100, swa_tail_len=36, ledger=led) is None
    assert "s" not in led and len(led) == 0


def test_prealloc_hisparse_pool_too_small():
    inner = HiSparseTokenToKVPoolAllocator(16, 4, F16, "cpu", None, False, 2)  # 32 logical slots
    w = InstrumentedAllocator(inner)
    assert alloc_for_decode_prealloc_hisparse(w, rid="h", fill_len=33, uses_swa_tail=False) is None
    assert record(w, "h") == (0, 0, 0)


# -- bad arguments ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"fill_len": -1}, ValueError, "fill_len"),
        ({"fill_len": 1.5}, TypeError, "fill_len"),
        ({"fill_len": True}, TypeError, "fill_len"),
        ({"fill_len": "10"}, TypeError, "fill_len"),
        ({"fill_len": 10, "swa_tail_len": 11}, ValueError, "swa_tail_len"),
        ({"fill_len": 10, "swa_tail_len": -1}, ValueError, "swa_tail_len"),
        ({"fill_len": 10, "swa_tail_len": 4.0}, TypeError, "swa_tail_len"),
        ({"fill_len": 10, "swa_tail_len": False}, TypeError, "swa_tail_len"),
    ],
)
def test_prealloc_bad_arguments(kwargs, exc, name):
    inner, bare = swa(), swa()
    w = InstrumentedAllocator(inner, mode="record", sliding_window=WINDOW)
    with pytest.raises(exc) as info:
        alloc_for_decode_prealloc(w, rid="x", **kwargs)
    assert str(info.value).startswith(f"{name}: ")
    assert allocator_state(inner) == allocator_state(bare)  # nothing was allocated
    assert "x" not in w.ledger


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"fill_len": -5, "uses_swa_tail": False}, ValueError, "fill_len"),
        ({"fill_len": 2.0, "uses_swa_tail": True, "swa_tail_len": 1}, TypeError, "fill_len"),
        ({"fill_len": 10, "uses_swa_tail": True, "swa_tail_len": 11}, ValueError, "swa_tail_len"),
        ({"fill_len": 10, "uses_swa_tail": True, "swa_tail_len": None}, TypeError, "swa_tail_len"),
    ],
)
def test_prealloc_hisparse_bad_arguments(kwargs, exc, name):
    inner, bare = swa(), swa()
    w = InstrumentedAllocator(inner, mode="record", sliding_window=WINDOW)
    with pytest.raises(exc) as info:
        alloc_for_decode_prealloc_hisparse(w, rid="x", **kwargs)
    assert str(info.value).startswith(f"{name}: ")
    assert allocator_state(inner) == allocator_state(bare)
    assert "x" not in w.ledger


def test_prealloc_result_is_the_full_pool_slots_of_a_bare_twin():
    w = wrapped_swa()
    bare = swa()
    out = alloc_for_decode_prealloc(w, rid="r", fill_len=50, swa_tail_len=swa_tail_len(50, WINDOW, PS))
    tail = swa_tail_len(50, WINDOW, PS)
    assert tail == 34
    ref = bare.alloc_extend_swa_tail(t([0]), t([0]), t([50]), t([50]), t([-1]), 50, tail)
    assert torch.equal(out, ref)
    assert allocator_state(w.inner) == allocator_state(bare)
