"""Remembered ``batch()`` bindings (``fast_paths`` "bind_memo"): a remembered binding attributes as a fresh one,
follows a release and still rejects bad ids."""

from __future__ import annotations

import pytest

from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.wrapper import FAST_PATHS
from tests.engine_model import Req, t
from tests.wrapper.scenarios import PS, _decode, _extend, _outcome, _random_engine, paged

NO_MEMO = set(FAST_PATHS) - {"bind_memo"}  # every batch() binds from scratch


@pytest.mark.parametrize("seed", range(6))
def test_remembered_bindings_attribute_as_fresh_ones_on_a_random_engine(seed):
    # The random engine binds the same live batch decode after decode, and changes it (a release, a new request)
    # between some of them.
    remembered = _outcome(_random_engine(seed))
    assert _outcome(_random_engine(seed, fast_paths=NO_MEMO)) == remembered


def _rebind_after_release(verify, fast_paths=True):
    # The same ids bound again after one of them was released and came back (a new slot, maybe another's old
    # one), and after another request took the released slot.
    w = InstrumentedAllocator(paged(), mode="record", verify=verify, fast_paths=fast_paths)
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


def test_remembered_binding_follows_a_release():
    remembered = _outcome(_rebind_after_release("immediate"))
    assert remembered[0] == []
    assert _outcome(_rebind_after_release("immediate", fast_paths=NO_MEMO)) == remembered


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
