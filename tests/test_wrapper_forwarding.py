"""Drop-in forwarding: the wrapper is an instance of the inner's class (ours and SGLang 0.5.23's own), answers
``hasattr`` as the inner does, forwards attribute reads, writes and every non-instrumented method, binds the
inner's own methods in ``mode="off"``, and rejects bad constructor / ``batch()`` / ``release_request`` arguments
clearly. Ends with a property test of random engine sequences over SGLang's own allocators (results identical
to a bare SGLang twin, zero violations, a clean sweep).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import (
    HiSparseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from instrumented_alloc.wrapper import INSTRUMENTED_OPS
from tests import sglang_compat
from tests import test_wrapper_properties as properties
from tests.engine_model import Req, allocator_state, decode_args, extend_args, split_extend, t

F16 = torch.float16


def _sg(require_swa, make):
    def factory():
        sglang_compat.require_sglang(require_swa)
        return make()

    return factory


OURS = {
    "ours-token": lambda: TokenToKVPoolAllocator(64, F16, "cpu", None, False),
    "ours-paged": lambda: PagedTokenToKVPoolAllocator(64, 4, F16, "cpu", None, False),
    "ours-swa": lambda: SWATokenToKVPoolAllocator(64, 64, 4, F16, "cpu", None, False),
    "ours-swa1": lambda: SWATokenToKVPoolAllocator(64, 48, 1, F16, "cpu", None, False),
    "ours-hisparse": lambda: HiSparseTokenToKVPoolAllocator(64, 4, F16, "cpu", None, False, 2),
}
SGLANG = {
    "sglang-token": _sg(False, lambda: sglang_compat.make_sglang_token(64)),
    "sglang-paged": _sg(False, lambda: sglang_compat.make_sglang_paged(64, 4)),
    "sglang-swa": _sg(True, lambda: sglang_compat.make_sglang_swa(64, 64, 4)),
}
ALL = {**OURS, **SGLANG}


def _grow(alloc, rid: str, n: int, req: Req) -> torch.Tensor:
    """One request grows by ``n`` tokens: alloc() at page size 1, alloc_extend() otherwise."""
    bind = getattr(alloc, "batch", None)
    if alloc.page_size == 1:
        if bind is None:
            out = alloc.alloc(n)
        else:
            with bind([rid]):
                out = alloc.alloc(n)
        req.row.extend(out.tolist())
        return out
    args = extend_args([req], [n])
    if bind is None:
        out = alloc.alloc_extend(*args)
    else:
        with bind([rid]):
            out = alloc.alloc_extend(*args)
    split_extend([req], [n], out)
    return out


# -- identity and hasattr ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(ALL))
def test_isinstance_of_the_inner_class(kind):
    inner = ALL[kind]()
    w = InstrumentedAllocator(inner)
    assert isinstance(w, type(inner))
    assert isinstance(w, InstrumentedAllocator)
    assert type(w).__name__ == f"Instrumented{type(inner).__name__}"
    assert type(InstrumentedAllocator(ALL[kind]())) is type(w)  # one generated subclass per inner class
    assert w.inner is inner
    if "swa" not in kind:
        # The scheduler's SWA branch must not be taken for a non-SWA allocator.
        swa_cls = type(SGLANG["sglang-swa"]()) if kind.startswith("sglang") else SWATokenToKVPoolAllocator
        assert not isinstance(w, swa_cls)


@pytest.mark.parametrize("mode", ["record", "off"])
@pytest.mark.parametrize("kind", list(ALL))
def test_hasattr_matches_inner_for_every_instrumented_op(kind, mode):
    inner = ALL[kind]()
    w = InstrumentedAllocator(inner, mode=mode)
    answers = {name: (hasattr(w, name), hasattr(inner, name)) for name in INSTRUMENTED_OPS}
    assert {n: a for n, a in answers.items() if a[0] != a[1]} == {}
    # Each class lacks something, so the _Missing path is exercised for every kind.
    assert not all(h for h, _ in answers.values())
    for name in INSTRUMENTED_OPS:
        if not hasattr(inner, name):
            with pytest.raises(AttributeError, match=name):
                getattr(w, name)


def test_hasattr_extra_methods():
    for kind, extra in (("ours-hisparse", "alloc_device_buffer"), ("ours-swa", "new_pages_available")):
        inner = ALL[kind]()
        w = InstrumentedAllocator(inner)
        assert hasattr(w, extra) and hasattr(inner, extra)
    paged_w = InstrumentedAllocator(OURS["ours-paged"]())
    assert not hasattr(paged_w, "alloc_device_buffer")
    assert not hasattr(paged_w, "full_to_swa_index_mapping")


# -- attribute forwarding ------------------------------------------------------------------------------------------
ATTRS = ("free_pages", "page_size", "device", "size", "size_swa", "num_pages", "release_pages", "need_sort")


@pytest.mark.parametrize("kind", list(ALL))
def test_attribute_reads_forward(kind):
    inner = ALL[kind]()
    w = InstrumentedAllocator(inner)
    seen = []
    for name in ATTRS:
        assert hasattr(w, name) == hasattr(inner, name), name
        if not hasattr(inner, name):
            continue
        seen.append(name)
        got, want = getattr(w, name), getattr(inner, name)
        if isinstance(want, int):
            assert type(got) is type(want) and got == want, name
        else:
            assert got is want, name
    assert {"page_size", "device", "size", "need_sort"} <= set(seen)
    # Live, not a copy taken at construction: after an allocation the inner holds a new free list.
    before = inner.free_pages
    _grow(w, "a", 2 * inner.page_size, Req("a"))
    if before is not None:
        assert inner.free_pages is not before
        assert w.free_pages is inner.free_pages
    if hasattr(inner, "full_to_swa_index_mapping"):
        assert w.full_to_swa_index_mapping is inner.full_to_swa_index_mapping
        assert w.swa_attn_allocator is inner.swa_attn_allocator


@pytest.mark.parametrize("kind", list(ALL))
def test_attribute_writes_forward(kind):
    inner = ALL[kind]()
    w = InstrumentedAllocator(inner)
    assert inner.need_sort is False
    w.need_sort = True
    assert inner.need_sort is True
    w.engine_note = "x"  # an attribute neither has: lands on the inner
    assert inner.engine_note == "x" and w.engine_note == "x"
    assert "engine_note" not in vars(w)
    # The wrapper's own public attributes stay on the wrapper.
    assert w.mode == "record" and not hasattr(inner, "mode")
    assert not hasattr(inner, "ledger") and not hasattr(inner, "violations")


@pytest.mark.parametrize("kind", list(ALL))
def test_non_instrumented_methods_forward_with_identical_results(kind):
    inner, bare = ALL[kind](), ALL[kind]()
    w = InstrumentedAllocator(inner)
    ps = inner.page_size
    rw, rb = Req("a"), Req("a")
    ow = _grow(w, "a", 3 * ps + 1, rw)
    ob = _grow(bare, "a", 3 * ps + 1, rb)
    assert torch.equal(ow, ob)
    w.free(t(rw.row[-1:]))
    bare.free(t(rb.row[-1:]))
    checked = []
    for name in ("available_size", "full_available_size", "swa_available_size", "debug_print", "size_full"):
        if not hasattr(inner, name):
            assert not hasattr(w, name)
            continue
        checked.append(name)
        got = getattr(w, name)
        want = getattr(bare, name)
        if callable(want):
            got, want = got(), want()
        assert got == want, name
    assert "available_size" in checked and "debug_print" in checked
    assert w.available_size() == inner.available_size() < ALL[kind]().available_size()
    assert w.get_kvcache() is inner.get_kvcache()
    got, want = w.get_all_free_pages(), bare.get_all_free_pages()
    if "swa" in kind or "hisparse" in kind:
        assert got is None and want is None  # multi-pool classes keep no flat free list (SGLang's too)
    else:
        assert torch.equal(got, want) and torch.equal(got, inner.get_all_free_pages())
    if hasattr(inner, "translate_loc_from_full_to_swa"):
        idx = t(rw.row)
        assert torch.equal(w.translate_loc_from_full_to_swa(idx), bare.translate_loc_from_full_to_swa(t(rb.row)))
        assert (w.translate_loc_from_full_to_swa(idx)[:-1] > 0).all()
    assert list(w.violations) == []


def test_forwarded_method_is_the_inner_implementation():
    inner = OURS["ours-swa"]()
    w = InstrumentedAllocator(inner)
    assert w.new_pages_available(16, 16) is True
    assert w.new_pages_available(17, 1) is False
    calls = []
    inner.debug_print = lambda: calls.append(1) or "patched"  # an instance attribute shadows the class method
    assert w.debug_print() == "patched" and calls == [1]


# -- mode="off" ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(ALL))
def test_off_mode_binds_inner_methods(kind):
    inner = ALL[kind]()
    w = InstrumentedAllocator(inner, mode="off")
    bound = [name for name in INSTRUMENTED_OPS if hasattr(inner, name)]
    assert "free" in bound and "alloc" in bound
    for name in bound:
        method = getattr(w, name)
        assert method == getattr(inner, name), name
        assert method.__self__ is inner, name


def test_off_mode_records_nothing():
    got = []
    inner = OURS["ours-paged"]()
    w = InstrumentedAllocator(inner, mode="off", sinks=[got.append], sliding_window=4)
    a = Req("a")
    _grow(w, "a", 6, a)
    w.free(t(a.row))
    w.free(t(a.row))  # a double free: not observed
    w.free_segment(t(a.row[2:]), start_pos=0)
    w.release_request("a")
    w.step()
    w.flush()
    assert w.check_consistency() == []
    assert list(w.violations) == [] and sum(w.violation_counts.values()) == 0
    assert got == []
    assert w.step_count == 0
    # Forwarded untouched: the double free and the segment re-free are in the inner's free list.
    assert inner.free_pages[:5].tolist() == [1, 1, 2, 1, 2]


def test_off_mode_batch_does_not_grow_the_ledger():
    w = InstrumentedAllocator(OURS["ours-paged"](), mode="off")
    for i in range(1000):
        with w.batch([f"r{i}"]):
            pass
        w.release_request(f"r{i}")
    assert len(w.ledger) == 0


# -- constructor, batch(), release_request -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"mode": "loud"}, ValueError, "mode"),
        ({"mode": None}, ValueError, "mode"),
        ({"verify": "lazy"}, ValueError, "verify"),
        ({"sliding_window": 0}, ValueError, "sliding_window"),
        ({"sliding_window": -8}, ValueError, "sliding_window"),
        ({"sliding_window": True}, TypeError, "sliding_window"),
        ({"sliding_window": 8.0}, TypeError, "sliding_window"),
    ],
)
def test_constructor_errors_name_the_parameter(kwargs, exc, name):
    with pytest.raises(exc) as info:
        InstrumentedAllocator(OURS["ours-paged"](), **kwargs)
    assert str(info.value).startswith(f"{name}: ")


def test_immediate_verification_needs_a_cpu_allocator():
    inner = PagedTokenToKVPoolAllocator(64, 16, torch.float16, "meta")
    with pytest.raises(ValueError) as info:
        InstrumentedAllocator(inner, verify="immediate")
    assert str(info.value).startswith("verify: ") and "on meta" in str(info.value)
    assert InstrumentedAllocator(inner, verify="auto").deferred  # auto defers off the CPU
    assert InstrumentedAllocator(inner, verify="deferred").deferred


def test_constructor_requires_inner():
    with pytest.raises(TypeError, match="inner is required"):
        InstrumentedAllocator()


def test_batch_argument_errors():
    inner = OURS["ours-paged"]()
    w = InstrumentedAllocator(inner)
    with pytest.raises(ValueError, match=r"^rids: a request id appears twice"), w.batch(["a", "b", "a"]):
        pass
    with pytest.raises(ValueError, match=r"^lens: has 1 entries for 2 requests"), w.batch(["a", "b"], lens=[3]):
        pass
    assert len(w.ledger) == 0  # nothing bound, nothing created
    assert list(w.violations) == []


def test_batch_does_not_nest_and_outer_binding_survives():
    inner = OURS["ours-paged"]()
    w = InstrumentedAllocator(inner)
    a = Req("a")
    with w.batch(["a"]):
        with pytest.raises(RuntimeError, match=r"already inside a batch\(\) block"), w.batch(["b"]):
            pass
        split_extend([a], [5], w.alloc_extend(*extend_args([a], [5])))
    assert "b" not in w.ledger
    assert w.ledger["a"].kv_allocated_len == 8 and w.ledger["a"].kv_committed_len == 5
    # The binding ended with the block: the next call is unattributed.
    x = Req("x")
    split_extend([x], [4], w.alloc_extend(*extend_args([x], [4])))
    assert list(w.ledger) == ["a"]
    # An exception inside the block also ends the binding.
    with pytest.raises(KeyError), w.batch(["c"]):
        raise KeyError("engine error")
    with w.batch(["d"]):
        pass
    assert list(w.violations) == []


@pytest.mark.parametrize("mode", ["record", "raise"])
def test_bound_batch_size_mismatch_is_invalid_argument_and_inner_untouched(mode):
    inner = OURS["ours-paged"]()
    w = InstrumentedAllocator(inner, mode=mode)
    a, b = Req("a"), Req("b")
    with w.batch(["a", "b"]):
        split_extend([a, b], [5, 6], w.alloc_extend(*extend_args([a, b], [5, 6])))
    state = allocator_state(inner)
    with w.batch(["a", "b"]), pytest.raises(ValueError) as info:
        w.alloc_extend(*extend_args([a], [3]))
    assert str(info.value) == "batch: 2 request ids bound, the call has 1 requests"
    with w.batch(["a"]), pytest.raises(ValueError, match=r"^batch: 1 request ids bound, the call has 2 requests$"):
        w.alloc_decode(*decode_args([a, b]))
    assert allocator_state(inner) == state
    assert [v.invariant for v in w.violations] == ["invalid_argument", "invalid_argument"]
    assert w.violations[0].op == "alloc_extend" and w.violations[1].op == "alloc_decode"
    assert w.violations[0].message == "alloc_extend: batch: 2 request ids bound, the call has 1 requests"
    assert (w.ledger["a"].kv_committed_len, w.ledger["b"].kv_committed_len) == (5, 6)


def test_alloc_with_lens_not_summing_to_n_is_invalid_argument():
    inner = OURS["ours-token"]()
    w = InstrumentedAllocator(inner)
    state = allocator_state(inner)
    with w.batch(["a", "b"], lens=[2, 2]), pytest.raises(ValueError):
        w.alloc(5)
    assert allocator_state(inner) == state
    assert [v.invariant for v in w.violations] == ["invalid_argument"]


@pytest.mark.parametrize("mode", ["record", "raise"])
def test_release_unknown_rid(mode):
    inner = OURS["ours-paged"]()
    w = InstrumentedAllocator(inner, mode=mode)
    with pytest.raises(ValueError) as info:
        w.release_request("ghost")
    assert str(info.value) == "rid: unknown request id 'ghost'"
    (v,) = w.violations
    assert (v.invariant, v.op, v.rid) == ("invalid_argument", "release_request", "ghost")  # the id it names
    assert v.message == "release_request: rid: unknown request id 'ghost'"
    # Released once is unknown afterwards.
    with w.batch(["a"]):
        pass
    w.release_request("a")
    with pytest.raises(ValueError, match="unknown request id 'a'"):
        w.release_request("a")


# -- SGLang-only batched segment frees -----------------------------------------------------------------------------
def test_sglang_free_segments_is_instrumented():
    inner = SGLANG["sglang-paged"]()
    w = InstrumentedAllocator(inner, mode="record")
    a = Req("a")
    _grow(w, "a", 10, a)
    w.free_segments([(t(a.row[0:4]), 0), (t(a.row[4:]), 4)])
    w.step()
    assert w.check_consistency() == []
    w.release_request("a")
    assert [str(v) for v in w.violations] == []


# -- property test over SGLang's own classes -----------------------------------------------------------------------
SG_CONFIGS = {
    "token-sglang1": (False, lambda ns: sglang_compat.make_sglang_token(96, ns)),
    "paged-sglang16": (False, lambda ns: sglang_compat.make_sglang_paged(16 * 16, 16, ns)),
    "swa-sglang16": (True, lambda ns: sglang_compat.make_sglang_swa(16 * 16, 16 * 20, 16, ns)),
}


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("name", list(SG_CONFIGS))
@settings(max_examples=15)
@given(data=st.data())
def test_random_sequences_over_sglang_classes(name, need_sort, verify, data):
    """tests.test_wrapper_properties.run with SGLang's class as inner and bare twin: identical results at every
    call, zero violations, check_consistency() == [] and every page free at the end. The name's prefix selects
    the engine's behaviour for that allocator kind (token / paged / swa)."""
    require_swa, make = SG_CONFIGS[name]
    sglang_compat.require_sglang(require_swa)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(properties.CONFIGS, name, make)
        e = properties.run(data, name, need_sort, verify)
    assert type(e.inner).__module__.startswith("sglang.")
    assert e.w.deferred is (verify == "deferred")
