"""Drop-in forwarding: the wrapper is an instance of the inner's class (ours and SGLang 0.5.23's own), answers
``hasattr`` as the inner does, forwards attribute reads, writes and every non-instrumented method, binds the
inner's own methods in ``mode="off"``, and rejects bad constructor / ``batch()`` / ``release_request`` arguments
clearly. Ends with a property test of random engine sequences over SGLang's own allocators (results identical
to a bare SGLang twin, zero violations, a clean sweep).
"""

from __future__ import annotations

import gc
import sys

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
        # The pools' own allocators come as their checked views (tests/test_wrapper_pool_views.py).
        assert w.swa_attn_allocator._w_inner is inner.swa_attn_allocator


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


# -- forwarding without __getattr__ (see InstrumentedAllocator's docstring) ----------------------------------------
class _LazyPaged(PagedTokenToKVPoolAllocator):
    """Our paged allocator with attributes its own code creates after construction: lazily, in a method."""

    def available_size(self) -> int:
        self.calls_seen = getattr(self, "calls_seen", 0) + 1  # first created by the first call
        return super().available_size()

    def note(self, value) -> None:
        self.last_note = value


def test_the_wrapper_class_has_no_getattr_hook():
    # The premise of the forwarding design: with a __getattr__ anywhere in the class's MRO, CPython 3.11
    # specialises no attribute lookup on its instances.
    for kind in ("ours-token", "ours-paged", "ours-swa", "ours-hisparse"):
        w = InstrumentedAllocator(ALL[kind]())
        assert [k.__name__ for k in type(w).__mro__ if "__getattr__" in vars(k)] == [], kind


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("kind", list(ALL))
def test_the_wrappers_own_attributes_stay_inline(kind, verify):
    # CPython 3.11 keeps at most 30 instance attributes inline (in the class's shared keys); past that (or once
    # something reads the instance's __dict__) the dict is materialised, and no method lookup on the wrapper is
    # specialised any more (about 25 ns more per self.method() call on the hot paths). A new per-wrapper value
    # belongs on _CallState. (Off mode adds the inner's bound methods, and its wrapper methods are not called.)
    inner = ALL[kind]()
    w = InstrumentedAllocator(inner, verify=verify)
    req = Req("a")
    _grow(w, "a", 2 * inner.page_size + 1, req)
    w.free(t(req.row))
    w.release_request("a")
    w.step()
    w.flush()
    w.clear()
    w.note_through_the_wrapper = 1  # lands on the inner
    if sys.implementation.name == "cpython" and sys.version_info[:2] == (3, 11):
        # Materialised, the dict would be among the object's referents (inline values are visited one by one).
        assert not [r for r in gc.get_referents(w) if type(r) is dict and "_w_st" in r]
    assert len(vars(w)) <= 30, sorted(vars(w))
    assert list(w.violations) == []


def test_reads_and_writes_of_inner_attributes_are_live():
    inner = OURS["ours-paged"]()
    w = InstrumentedAllocator(inner)
    assert w.num_pages == 16 and w.page_size == 4 and w.free_group is None
    inner.num_staged_pages = 7  # a write on the inner: read through the wrapper
    assert w.num_staged_pages == 7
    w.num_staged_pages = 0  # a write through the wrapper: lands on the inner, nothing on the wrapper
    assert inner.num_staged_pages == 0 and "num_staged_pages" not in vars(w)
    w.free_group_begin()  # the inner's method rebinds its attributes: the wrapper reads the new objects
    assert w.free_group == [] and w.free_group is inner.free_group
    w.free_group_end()
    assert w.free_group is None
    del w.free_group
    assert not hasattr(inner, "free_group")
    with pytest.raises(AttributeError, match="PagedTokenToKVPoolAllocator"):
        _ = w.free_group
    assert hasattr(type(inner), "free_group") is False


def test_forwarded_methods_return_the_inners_results():
    inner = OURS["ours-swa"]()
    w = InstrumentedAllocator(inner)
    assert w.get_kvcache() is inner.get_kvcache() is None
    assert w.available_size() == inner.available_size() == 64
    assert w.new_pages_available(16, 16) is True
    assert w.size_full == 64 and w.size_swa == 64  # properties of the inner class
    assert w.full_to_swa_index_mapping is inner.full_to_swa_index_mapping
    assert w.swa_attn_allocator._w_inner is inner.swa_attn_allocator
    assert w.full_attn_allocator._w_inner is inner.full_attn_allocator
    # A forwarded method is the inner's own, bound to the inner (no forwarding frame between).
    assert w.available_size.__self__ is inner and w.available_size.__func__ is type(inner).available_size
    assert w.debug_print() == inner.debug_print()


def test_attributes_the_inner_class_creates_later_are_forwarded():
    inner = _LazyPaged(64, 4, F16, "cpu")
    w = InstrumentedAllocator(inner)
    assert not hasattr(w, "calls_seen") and not hasattr(w, "last_note")  # not created yet: as the inner answers
    assert w.available_size() == 64
    assert w.calls_seen == 1 == inner.calls_seen  # created by the inner's own method after wrapping
    w.note("x")
    assert w.last_note == "x"
    inner.last_note = "y"
    assert w.last_note == "y"


def test_a_name_added_through_the_wrapper():
    inner, other = OURS["ours-paged"](), OURS["ours-paged"]()
    w, w2 = InstrumentedAllocator(inner), InstrumentedAllocator(other)
    assert type(w) is type(w2)
    w.engine_tag = {"tp": 0}
    assert inner.engine_tag == {"tp": 0} and w.engine_tag is inner.engine_tag
    assert "engine_tag" not in vars(w)
    # The name is forwarded for every wrapper of the class: one whose inner lacks it answers as its inner does.
    assert not hasattr(w2, "engine_tag")
    with pytest.raises(AttributeError, match=r"'PagedTokenToKVPoolAllocator' object has no attribute 'engine_tag'"):
        _ = w2.engine_tag
    w2.engine_tag = 3
    assert other.engine_tag == 3 and w.engine_tag == {"tp": 0}


def test_an_attribute_created_on_the_inner_directly_is_not_forwarded():
    # The documented limit: a name set on the inner object directly (not through the wrapper) that the inner
    # class's code never assigns is read from ``inner``, or forwarded once it is assigned through the wrapper.
    inner = OURS["ours-paged"]()
    w = InstrumentedAllocator(inner)
    inner.set_from_outside_xyz = 5
    assert w.inner.set_from_outside_xyz == 5
    w.clear()
    assert not hasattr(w, "set_from_outside_xyz")
    w.set_from_outside_xyz = 6
    assert w.set_from_outside_xyz == 6 == inner.set_from_outside_xyz
    assert list(w.violations) == []


class _DictSpy(PagedTokenToKVPoolAllocator):
    """Records reads of its ``__dict__`` (``vars()``, ``dir()`` and ``__dict__`` all go through here)."""

    def __getattribute__(self, name):
        if name == "__dict__":
            type(self).dict_reads += 1
        return super().__getattribute__(name)

    dict_reads = 0


@pytest.mark.parametrize("mode", ["record", "off"])
def test_the_wrapper_never_reads_the_inners_instance_dict(mode):
    # Reading it makes CPython 3.11 materialise the instance dict, which slows every attribute access of the
    # inner's own code from then on: the forwarding set comes from the class, never from the instance.
    _DictSpy.dict_reads = 0
    inner = _DictSpy(64, 4, F16, "cpu")
    w = InstrumentedAllocator(inner, mode=mode)
    req = Req("a")
    _grow(w, "a", 5, req)
    assert w.free_pages is inner.free_pages and w.num_pages == 16 and w.page_size == 4
    w.free(t(req.row))
    w.release_request("a")
    w.step()
    w.clear()
    w.new_name = 1
    repr(w)
    assert _DictSpy.dict_reads == 0
    vars(inner)
    assert _DictSpy.dict_reads == 1  # the spy works


@pytest.mark.parametrize("mode", ["record", "off"])
def test_the_wrapper_never_reads_the_instance_dict_of_our_paged_allocator(mode, monkeypatch):
    # The exact class, which the wrapper's pool counts special-case (wrapper.state._page_counter): the spy above is a
    # subclass, which they do not.
    reads = []
    real = PagedTokenToKVPoolAllocator.__getattribute__

    def spy(self, name):
        if name == "__dict__":
            reads.append(name)
        return real(self, name)

    inner = PagedTokenToKVPoolAllocator(64, 4, F16, "cpu")
    monkeypatch.setattr(PagedTokenToKVPoolAllocator, "__getattribute__", spy)
    w = InstrumentedAllocator(inner, mode=mode)
    req = Req("a")
    _grow(w, "a", 5, req)
    w.free(t(req.row))
    w.release_request("a")
    w.step()
    assert reads == []
    vars(inner)
    assert reads == ["__dict__"]  # the spy works


def test_isinstance_and_repr():
    inner = OURS["ours-swa"]()
    w = InstrumentedAllocator(inner, mode="off")
    assert isinstance(w, SWATokenToKVPoolAllocator) and isinstance(w, InstrumentedAllocator)
    assert not isinstance(w, PagedTokenToKVPoolAllocator)
    assert repr(w) == f"InstrumentedAllocator({inner!r}, mode='off')"


def test_a_missing_name_raises_attribute_error_naming_the_inner_type():
    for kind, cls_name in (("ours-paged", "PagedTokenToKVPoolAllocator"), ("ours-swa", "SWATokenToKVPoolAllocator")):
        w = InstrumentedAllocator(ALL[kind]())
        with pytest.raises(AttributeError, match=rf"'Instrumented{cls_name}' object has no attribute 'no_such_name'"):
            _ = w.no_such_name
        assert getattr(w, "no_such_name", "default") == "default"
        assert not hasattr(w, "no_such_name")


def test_two_wrappers_of_different_inner_types():
    paged, swa = OURS["ours-paged"](), OURS["ours-swa"]()
    wp, ws = InstrumentedAllocator(paged), InstrumentedAllocator(swa)
    assert type(wp) is not type(ws)
    assert ws.swa_attn_allocator._w_inner is swa.swa_attn_allocator
    assert not hasattr(wp, "swa_attn_allocator") and not hasattr(wp, "full_to_swa_index_mapping")
    wp.only_on_paged = 1
    assert "only_on_paged" in vars(type(wp)) and "only_on_paged" not in vars(type(ws))
    assert not hasattr(ws, "only_on_paged")
    assert wp.num_pages == 16 and ws.size_swa == 64
    assert wp.page_size == ws.page_size == 4


def test_the_wrappers_own_names_win_over_the_inners():
    inner = OURS["ours-paged"]()
    inner.mode = "inner's"  # the inner happens to have attributes named as the wrapper's own
    inner.ledger = "inner's"
    w = InstrumentedAllocator(inner, mode="off")
    assert w.mode == "off" and w.ledger is not inner.ledger and w.inner is inner
    w.clear()
    assert w.mode == "off" and inner.mode == "inner's"


@pytest.mark.parametrize("mode", ["record", "off"])
@pytest.mark.parametrize("kind", list(ALL))
def test_every_instance_attribute_of_the_inner_reads_through(kind, mode):
    """After a workload through the wrapper (SGLang's own classes included), every attribute the inner holds
    reads through the wrapper as the same object, except the wrapper's own names."""
    inner = ALL[kind]()
    w = InstrumentedAllocator(inner, mode=mode)
    ps = inner.page_size
    req = Req("a")
    _grow(w, "a", 3 * ps + 1, req)
    w.free_group_begin()
    w.free(t(req.row[-1:]))
    w.free_group_end()
    w.available_size()
    names = [n for n in vars(inner) if n not in ("mode", "ledger", "inner", "bus")]
    assert "page_size" in names and "free_group" in names
    # The pools' own allocators read as their checked views outside "off" (tests/test_wrapper_pool_views.py).
    views = {"full_attn_allocator", "swa_attn_allocator"} if mode != "off" else set()
    assert [n for n in names if n not in views and getattr(w, n) is not getattr(inner, n)] == []
    assert [n for n in names if n in views and getattr(w, n)._w_inner is not getattr(inner, n)] == []


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


# SWA allocators at page size 1, 10 full and 8 SWA slots: ours and SGLang's.
SWA1_SMALL = [
    lambda: SWATokenToKVPoolAllocator(10, 8, 1, F16, "cpu", None, False),
    _sg(True, lambda: sglang_compat.make_sglang_swa(10, 8, 1)),
]


# -- an inner that raises after changing one pool of two ----------------------------------------------------------
@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("make", SWA1_SMALL, ids=["ours-swa1", "sglang-swa1"])
def test_a_free_that_raises_between_its_pools_is_mirrored_pool_by_pool(make, verify):
    # An engine bug first: free_swa of a slot with no SWA peer puts SWA page 0 on the SWA free list (the inner's
    # over-credit assert fires). From then on a free of both pools releases the SWA side, asserts, and never frees
    # the full side: the wrapper must mirror the SWA side alone, so the request still owns its 4 full pages.
    inner, bare = make(), make()
    w = InstrumentedAllocator(inner, mode="record", sliding_window=4, verify=verify)
    for a in (w, bare):
        with pytest.raises(AssertionError):
            a.free_swa(t([5]))
    with w.batch(["a"]):
        out = w.alloc(4)
    assert torch.equal(out, bare.alloc(4)) and out.tolist() == [1, 2, 3, 4]
    for a in (w, bare):
        with pytest.raises(AssertionError):
            a.free(out)
    w.step()
    assert allocator_state(inner) == allocator_state(bare)
    assert inner.full_attn_allocator.free_pages.tolist() == [5, 6, 7, 8, 9, 10]  # the full side was never freed
    slot = w.ledger.slot_of("a", create=False)
    assert w.snapshot()["full"].owner[1:5].tolist() == [slot] * 4
    assert int(w.ledger.owned["full"][slot]) == 4 and w.ledger["a"].kv_allocated_len == 4
    before = len(w.violations)
    w.release_request("a")
    w.step()
    # Deferred verification reports the release at the boundary that checks it (the step after).
    assert [str(v) for v in list(w.violations)[before:]] == [
        "[request_leak] request 'a' released while still owning 4 pages, neither freed nor handed to the prefix "
        "cache (full: [1, 2, 3, 4] (4 pages)) "
        f"(op=release pool=full rid=a step={1 if verify == 'immediate' else 2})"
    ]
    assert w.check_consistency() == []  # the shadow agrees with the inner's free lists: nothing unexplained


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
def test_a_second_release_is_refused_at_the_call_under_either_verification(verify):
    # Deferred verification checks a release later, but the id is forgotten at the call: a second release is the
    # same invalid_argument as under immediate verification (not a KeyError at the next step), and an id taken
    # again before the step names a new request (no false request_leak).
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(40, 4, F16, "cpu", None, False), mode="record", verify=verify)
    with w.batch(["a"]):
        out = w.alloc(4)
    w.free(out)
    w.release_request("a")
    with pytest.raises(ValueError, match=r"^rid: unknown request id 'a'$"):
        w.release_request("a")
    with w.batch(["a"]):  # the id again, before the step: a new request
        again = w.alloc(8)
    w.step()
    assert [v.invariant for v in w.violations] == ["invalid_argument"]
    assert w.ledger["a"].kv_allocated_len == 8
    w.free(again)
    w.release_request("a")
    w.step()
    assert [v.invariant for v in w.violations] == ["invalid_argument"]
    assert w.check_consistency() == [] and w.available_size() == 40


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
@pytest.mark.parametrize("make", SWA1_SMALL, ids=["ours-swa1", "sglang-swa1"])
def test_a_free_group_end_that_raises_leaves_the_group(make, verify):
    # After the same engine bug (SWA page 0 listed free), free_group_end releases the held pages and its SWA
    # over-credit assert fires: the inner has left its group, and so must the shadow, with the pools it released
    # released. Before: the shadow stayed in the group for good, and the next allocation of those full pages was
    # reported as a duplicate_allocation of pages the inner really listed free.
    inner, bare = make(), make()
    w = InstrumentedAllocator(inner, mode="record", sliding_window=4, verify=verify)

    def both(name, *args):
        out = []
        for a in (w, bare):
            try:
                out.append(getattr(a, name)(*args))
            except AssertionError:
                out.append("assert")
        assert str(out[0]) == str(out[1]), (name, out)
        assert allocator_state(inner) == allocator_state(bare)
        return out[0]

    assert both("free_swa", t([5])) == "assert"
    w.step()  # deferred verification reports the bug here
    assert [(v.invariant, v.pool) for v in w.violations] == [("swa_mapping_inconsistent", "swa")]
    with w.batch(["a"]):
        a = both("alloc", 2)
    with w.batch(["b"]):
        b = both("alloc", 2)
    both("free_group_begin")
    both("free", a)
    both("free", b)
    assert both("free_group_end") == "assert"
    w.release_request("a")
    w.release_request("b")
    assert w.check_consistency() == []
    before = len(w.violations)
    with w.batch(["c"]):
        c = both("alloc", 8)
    assert c.tolist() == [5, 6, 7, 8, 9, 10, 1, 2]  # pages 1 and 2: released by the group
    w.step()
    # What remains is the engine bug's own trace in the SWA pool (its page 0 handed out); nothing in the full pool.
    assert [(v.invariant, v.pool) for v in list(w.violations)[before:]] == [("reserved_page_touched", "swa")]


@pytest.mark.parametrize("verify", ["immediate", "deferred"])
def test_a_free_group_end_that_raises_before_releasing_keeps_the_pages_held(verify):
    # The inner leaves its group, then its free of the held pages raises before it changes anything: those pages
    # are lost to the inner (neither free nor handed out). The shadow leaves the group too and keeps them held, so
    # it agrees with the inner, and the frees after it are immediate again.
    from instrumented_alloc import shadow as sh

    inner = PagedTokenToKVPoolAllocator(32, 4, F16, "cpu", None, False)
    w = InstrumentedAllocator(inner, mode="record", verify=verify)
    with w.batch(["a"]):
        a = w.alloc(8)  # pages 1, 2
    with w.batch(["b"]):
        b = w.alloc(8)  # pages 3, 4
    w.free_group_begin()
    w.free(a)

    def broken(free_index):
        raise RuntimeError("device lost")

    inner.free = broken
    with pytest.raises(RuntimeError, match="device lost"):
        w.free_group_end()
    del inner.free  # the class's free again
    assert inner.free_group is None and sorted(inner.free_pages.tolist()) == [5, 6, 7, 8]
    w.release_request("a")
    w.free(b)  # immediate: not held in a group any more
    w.release_request("b")
    w.step()
    owner = w.snapshot()["full"].owner
    assert owner[1:3].tolist() == [sh.HELD_SET] * 2  # lost to the inner: held for good
    assert owner[3:5].tolist() == [sh.FREE] * 2 and sorted(inner.free_pages.tolist()) == [3, 4, 5, 6, 7, 8]
    assert w.check_consistency() == [] and [v.invariant for v in w.violations] == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: SWATokenToKVPoolAllocator(96, 96, 4, F16, "cpu", None, False),
        _sg(True, lambda: sglang_compat.make_sglang_swa(96, 96, 4)),
    ],
    ids=["ours-swa4", "sglang-swa4"],
)
def test_free_swa_of_slots_outside_the_full_pool_is_refused_in_raise_mode(make):
    # free_swa names full slots only to find their SWA peers. A negative slot read as "no peer" here while the
    # inner's torch indexing wrapped it around to a live request's peer and freed its SWA pages: not refused, not
    # reported. Now free_unallocated, refused before the call in raise mode, the inner untouched.
    inner, bare = make(), make()
    w = InstrumentedAllocator(inner, mode="raise", verify="immediate", sliding_window=13)
    a = Req("a")
    with w.batch(["a"]):
        out = w.alloc_extend(*extend_args([a], [96]))  # every page of both pools
    assert torch.equal(out, bare.alloc_extend(*extend_args([Req("a")], [96])))
    for slot in (-5, 102):
        with pytest.raises(AssertionError) as info:
            w.free_swa(t([slot]))
        assert str(info.value) == (
            f"[free_unallocated] free_swa frees slots outside the full pool (valid pages 1..24): [{slot}] (1 slots) "
            "(op=free_swa pool=full step=0)"
        )
    assert allocator_state(inner) == allocator_state(bare) and inner.swa_available_size() == 0
    assert w.check_consistency() == []
