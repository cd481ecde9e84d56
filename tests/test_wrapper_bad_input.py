"""The bad-input matrix over every public method of the WRAPPER (and, as the ``bare`` target, of the reference
allocators themselves, which extends tests/allocators' matrices to free_segments/free_full_segments, free_page_ids,
the SWA-only frees and translate on every config, 0-d tensors, numpy arrays, scalars and other dtypes).

Configs: token ps 1, paged ps 4, SWA ps 1 and 4, HiSparse ps 4, each with two live requests and a freed page.
For every method the config has, every argument is replaced by: another dtype (float32, int16, bool), the ``meta``
device, 2-D and 0-d shapes, None, a list, a float, an int, a numpy array (tensors); True, a float, None, a
negative int, a numpy array, a 0-d tensor, a string (ints); a mismatched batch length, negative lengths,
prefix > seq, zero-length decode, a wrong ``extend_num_tokens``, an over-long SWA tail (batch arguments).

What must happen (the wrapper's contract, "Malformed calls"):
- ``record`` and ``raise``: a ``TypeError``/``ValueError`` that is an ``ArgumentError`` naming the argument (the
  message starts with ``"<name>:"``), after exactly one ``invalid_argument`` violation (op = the method, message
  ``"<method>: <name>: ..."``) was recorded and published; the inner allocator's state is unchanged and equal to
  a bare twin that was not called.
- ``off``: the call is forwarded untouched; the inner allocator's own checks apply (ours check everything, so the
  same exception, same argument name), nothing is recorded, the state is unchanged.
- ``bare``: the allocator alone raises the same exception naming the same argument, state unchanged.

Not argument errors, and tested as such below: index VALUES (negative, out of range, page 0) are device data the
argument checks never read; they are invariant violations (``free_unallocated``, ``reserved_page_touched``):
refused before the inner allocator in ``raise`` mode, recorded and forwarded in ``record`` mode (state then equal
to the bare twin's after the same call). An unaligned ``start_pos`` is ``segment_start_unaligned``. Empty tensors
and empty batches are valid calls. Requests larger than the pool return None.

Wrapper-only API: ``batch()`` raises ``TypeError``/``ValueError`` naming ``rids``/``lens`` and records nothing
(it is not an allocator call; tests/test_wrapper_forwarding.py); ``release_request`` and ledger writes record
``invalid_argument`` and name ``rid`` / the field. In ``off`` mode these do nothing and check nothing.
``translate_loc_from_full_to_swa`` is not instrumented (a read-only lookup on the decode path): it is forwarded in
every mode, the inner's own check names ``kv_indices``, and no violation is recorded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instrumented_alloc import InstrumentedAllocator, InvariantViolation
from instrumented_alloc.allocators import SWATokenToKVPoolAllocator
from instrumented_alloc.argcheck import ArgumentError
from instrumented_alloc.events import ViolationEvent
from tests.engine_model import Req, allocator_state, t
from tests.test_wrapper_properties import Engine

META = torch.device("meta")
CONFIGS = ["token-1", "paged-4", "swa-1", "swa-4", "hisparse-4"]
MODES = ["record", "raise", "off", "bare"]


class Setup:
    """An Engine (wrapper in ``mode`` + bare twin) with requests a (2ps+1 tokens, last page freed again) and
    b (ps+1 tokens)."""

    def __init__(self, config: str, mode: str):
        self.e = e = Engine(config, False, "immediate", mode="record" if mode == "bare" else mode)
        self.published = []
        e.w.subscribe(self.published.extend)
        ps = self.ps = e.ps
        self.a, self.b = Req("a"), Req("b")
        e.extend([self.a, self.b], [3 * ps + 1, ps + 1])
        e.rollback(self.a, 1)
        self.kind = e.kind
        self.target = e.bare if mode == "bare" else e.w

    # Valid arguments for every method this config has (the mutations replace one of them).
    def good(self, method: str) -> dict:
        a, b, ps = self.a, self.b, self.ps
        if method == "alloc":
            return dict(need_size=ps if ps > 1 else 2)
        if method in ("alloc_extend", "alloc_logical_only"):
            p = [a.seq, 0]
            s = [a.seq + 3, 2]
            return dict(
                prefix_lens=t(p),
                prefix_lens_cpu=t(p),
                seq_lens=t(s),
                seq_lens_cpu=t(s),
                last_loc=t([a.row[-1], -1]),
                extend_num_tokens=5,
            )
        if method == "alloc_extend_swa_tail":
            return dict(
                prefix_lens=t([0]),
                prefix_lens_cpu=t([0]),
                seq_lens=t([10]),
                seq_lens_cpu=t([10]),
                last_loc=t([-1]),
                extend_num_tokens=10,
                swa_tail_len=6,
            )
        if method == "alloc_decode":
            s = [a.seq + 1, b.seq + 1]
            return dict(seq_lens=t(s), seq_lens_cpu=t(s), last_loc=t([a.row[-1], b.row[-1]]))
        if method in ("free", "free_full", "free_swa"):
            return dict(free_index=t(b.row))
        if method == "free_page_ids":
            return dict(page_ids=t([b.row[0] // ps]))
        if method in ("free_segment", "free_full_segment"):
            return dict(free_index=t(b.row[ps:]), start_pos=ps)
        if method == "free_swa_segment":
            return dict(free_index=t(b.row), start_pos=0)
        if method in ("free_segments", "free_full_segments"):
            return dict(segments=[(t(b.row[:ps]), 0), (t(b.row[ps:]), ps)])
        if method == "translate_loc_from_full_to_swa":
            return dict(kv_indices=t(a.row))
        raise AssertionError(method)


def methods_of(config: str) -> list[str]:
    kind, ps = config.split("-")
    ms = ["alloc", "free", "free_full", "free_segment", "free_full_segment", "free_segments", "free_full_segments"]
    if kind in ("token", "paged"):
        ms.append("free_page_ids")
    if int(ps) > 1 and kind != "token":
        ms += ["alloc_extend", "alloc_decode"]
    if kind == "swa":
        ms += ["free_swa", "free_swa_segment", "translate_loc_from_full_to_swa"]
        if int(ps) > 1:
            ms.append("alloc_extend_swa_tail")
    if kind == "hisparse":
        ms.append("alloc_logical_only")
    return ms


def invoke(target, method: str, args: dict):
    if method in ("free_segment", "free_full_segment", "free_swa_segment"):
        return getattr(target, method)(args["free_index"], start_pos=args["start_pos"])
    return getattr(target, method)(*args.values())


BATCH_TENSORS = {"prefix_lens", "prefix_lens_cpu", "seq_lens", "seq_lens_cpu", "last_loc"}


def tensor_mutations(name: str, good: torch.Tensor):
    yield "float32", good.float(), TypeError, name
    yield "int16", good.to(torch.int16), TypeError, name
    yield "bool", good.bool(), TypeError, name
    yield "meta", torch.empty(good.shape, dtype=good.dtype, device=META), ValueError, name
    yield "2d", good[None, :], ValueError, name
    yield "0d", good[0], ValueError, name
    yield "none", None, TypeError, name
    yield "list", good.tolist(), TypeError, name
    yield "float", 1.0, TypeError, name
    yield "int", 5, TypeError, name
    yield "numpy", good.numpy(), TypeError, name
    if name in BATCH_TENSORS:
        yield "longer", torch.cat([good, good[:1]]), ValueError, ("seq_lens_cpu" if name == "seq_lens" else name)


def int_mutations(name: str, good: int):
    yield "bool", True, TypeError, name
    yield "float", float(good), TypeError, name
    yield "none", None, TypeError, name
    yield "negative", -max(good, 1), ValueError, name
    yield "numpy-array", np.array([good]), TypeError, name
    yield "tensor", torch.tensor(good), TypeError, name
    yield "str", str(good), TypeError, name


def segments_mutations(good: list):
    (i0, s0), (i1, s1) = good
    yield "none", None, TypeError
    yield "int", 3, TypeError
    yield "tensor", i0, TypeError  # a bare index tensor, not a list of pairs
    yield "not-a-pair", [i0], TypeError
    yield "triple", [(i0, s0, 0)], TypeError
    yield "list-index", [(i0.tolist(), s0)], TypeError
    yield "float-index", [(i0.float(), s0)], TypeError
    yield "meta-index", [(torch.empty(i0.shape, dtype=i0.dtype, device=META), s0)], ValueError
    yield "2d-index", [(i0[None, :], s0)], ValueError
    yield "none-start", [(i0, None)], TypeError
    yield "float-start", [(i0, float(s0))], TypeError
    yield "negative-start", [(i0, -4)], ValueError
    # A good first segment then a bad one: nothing may be freed (no partial free before the error).
    yield "second-bad", [(i0, s0), (i1.tolist(), s1)], TypeError
    yield "second-none-start", [(i0, s0), (i1, None)], TypeError


def _cases():
    cases = []
    for config in CONFIGS:
        ps = int(config.split("-")[1])
        for method in methods_of(config):
            if method in ("free_segments", "free_full_segments"):
                for label, _bad, exc in segments_mutations([(t([0]), 0), (t([0]), ps)]):
                    cases.append(
                        pytest.param(
                            config, method, "segments", label, exc, "segments", id=f"{config}-{method}-{label}"
                        )
                    )
                continue
            for name, good in _good_shapes(config, method).items():
                muts = tensor_mutations(name, good) if isinstance(good, torch.Tensor) else int_mutations(name, good)
                for label, _bad, exc, named in muts:
                    cases.append(
                        pytest.param(config, method, name, label, exc, named, id=f"{config}-{method}-{name}-{label}")
                    )
            for name, label, exc in _value_cases(method):
                cases.append(
                    pytest.param(config, method, name, label, exc, name, id=f"{config}-{method}-{name}-{label}")
                )
    return cases


def _good_shapes(config: str, method: str) -> dict:
    """Argument names and kinds (tensor or int) of a method; the values are rebuilt per test from the Setup."""
    s = _SHAPES.get(config)
    if s is None:
        s = _SHAPES[config] = Setup(config, "bare")
    return s.good(method)


_SHAPES: dict = {}


def _value_cases(method: str):
    """Range faults of the batch arguments (CPU mirrors are read; device tensors are not)."""
    if method in ("alloc_extend", "alloc_logical_only", "alloc_extend_swa_tail"):
        yield "prefix_lens_cpu", "negative", ValueError
        yield "seq_lens_cpu", "negative", ValueError
        yield "prefix_lens_cpu", "gt-seq", ValueError
        yield "extend_num_tokens", "wrong-sum", ValueError
    if method == "alloc_extend_swa_tail":
        yield "swa_tail_len", "too-long", ValueError
    if method == "alloc_decode":
        yield "seq_lens_cpu", "zero", ValueError


def mutate(args: dict, name: str, label: str):
    """The bad value for (name, label), built from this Setup's good arguments."""
    good = args[name]
    if name == "segments":
        for lab, bad, _ in segments_mutations(good):
            if lab == label:
                return bad
    if label == "negative" and isinstance(good, torch.Tensor):
        bad = good.clone()
        bad[0] = -1
        return bad
    if label == "gt-seq":
        bad = good.clone()
        bad[0] = int(args["seq_lens_cpu"][0]) + 1
        return bad
    if label == "wrong-sum":
        return good + 1
    if label == "too-long":
        return int(args["extend_num_tokens"]) + 1
    if label == "zero":
        bad = good.clone()
        bad[0] = 0
        return bad
    muts = tensor_mutations(name, good) if isinstance(good, torch.Tensor) else int_mutations(name, good)
    for lab, bad, _, _ in muts:
        if lab == label:
            return bad
    raise AssertionError((name, label))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("config", "method", "name", "label", "exc_type", "named"), _cases())
def test_bad_argument(config, method, name, label, exc_type, named, mode):
    s = Setup(config, mode)
    e = s.e
    args = s.good(method)
    args[name] = mutate(args, name, label)
    before = allocator_state(e.inner)
    bare_before = allocator_state(e.bare)
    n_violations = len(e.w.violations)
    with pytest.raises(exc_type) as info:
        invoke(s.target, method, args)
    exc = info.value
    assert isinstance(exc, ArgumentError), repr(exc)
    assert exc.argument == named
    assert str(exc).startswith(f"{named}: "), str(exc)
    # Nothing changed, in the allocator that was called and in the one that was not.
    assert allocator_state(e.inner) == before
    assert allocator_state(e.bare) == bare_before == before
    new = list(e.w.violations)[n_violations:]
    if mode in ("record", "raise") and method != "translate_loc_from_full_to_swa":
        assert [v.invariant for v in new] == ["invalid_argument"], [str(v) for v in new]
        assert new[0].op == method
        assert new[0].message == f"{method}: {exc}"
        published = [x.violation for x in s.published if isinstance(x, ViolationEvent)]
        assert published == new
    else:
        assert new == []


# -- valid edge cases: empty tensors and batches, requests larger than the pool --------------------------------
def _empty_args(s: Setup, method: str) -> dict | None:
    args = s.good(method)
    e0 = t([])
    if method in ("alloc_extend", "alloc_logical_only"):
        return dict(prefix_lens=e0, prefix_lens_cpu=e0, seq_lens=e0, seq_lens_cpu=e0, last_loc=e0, extend_num_tokens=0)
    if method == "alloc_decode":
        return dict(seq_lens=e0, seq_lens_cpu=e0, last_loc=e0)
    if method in ("alloc", "alloc_extend_swa_tail", "translate_loc_from_full_to_swa"):
        return None
    if method in ("free_segments", "free_full_segments"):
        return dict(segments=[])
    key = "page_ids" if method == "free_page_ids" else "free_index"
    args[key] = e0
    return args


EMPTY_CASES = [
    pytest.param(c, m, id=f"{c}-{m}")
    for c in CONFIGS
    for m in methods_of(c)
    if m not in ("alloc", "alloc_extend_swa_tail", "translate_loc_from_full_to_swa")
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("config", "method"), EMPTY_CASES)
def test_empty_is_a_valid_no_op(config, method, mode):
    s = Setup(config, mode)
    args = _empty_args(s, method)
    before = allocator_state(s.e.inner)
    out = invoke(s.target, method, args)
    if method.startswith("alloc"):
        assert out is not None and out.dtype == torch.int64 and out.numel() == 0
    else:
        assert out is None
    assert allocator_state(s.e.inner) == before == allocator_state(s.e.bare)
    assert list(s.e.w.violations) == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", CONFIGS)
def test_more_than_the_pool_returns_none(config, mode):
    s = Setup(config, mode)
    w = s.target
    before = allocator_state(s.e.inner)
    huge = 10**6
    out = w.alloc(huge) if s.ps == 1 else w.alloc_extend(t([0]), t([0]), t([huge]), t([huge]), t([-1]), huge)
    assert out is None
    assert allocator_state(s.e.inner) == before == allocator_state(s.e.bare)
    assert list(s.e.w.violations) == []


# -- index values are device data: invariant violations, not argument errors ------------------------------------
def _value_fault_cases():
    for config in CONFIGS:
        kind = config.split("-")[0]
        op = "free_full" if kind == "swa" else "free"
        yield pytest.param(config, op, "negative", "free_unallocated", id=f"{config}-{op}-negative")
        yield pytest.param(config, op, "out-of-range", "free_unallocated", id=f"{config}-{op}-out-of-range")
        yield pytest.param(config, op, "page-0", "reserved_page_touched", id=f"{config}-{op}-page-0")
        if kind in ("token", "paged"):
            yield pytest.param(config, "free_page_ids", "out-of-range", "free_unallocated", id=f"{config}-ids-oor")


def _index_value(s: Setup, label: str) -> torch.Tensor:
    ps = s.ps
    pages = s.e.w.snapshot()["full"].num_pages
    if label == "negative":
        return t([-ps])
    if label == "out-of-range":
        return t([(pages + 3) * ps])
    return t([1 % ps])  # a slot in page 0 (slot 1 at page size > 1; slot 0 at page size 1)


@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize(("config", "op", "label", "inv"), list(_value_fault_cases()))
def test_index_values_are_invariant_faults(config, op, label, inv, mode):
    s = Setup(config, mode)
    e = s.e
    idx = _index_value(s, label)
    if op == "free_page_ids":
        idx = idx // s.ps
    before = allocator_state(e.inner)
    if mode == "raise":
        with pytest.raises(InvariantViolation) as info:
            getattr(e.w, op)(idx)
        assert info.value.invariant == inv
        assert allocator_state(e.inner) == before  # refused before the inner allocator
    else:
        # Recorded, then forwarded: the same call as the bare twin, with the same outcome (HiSparse's own
        # mapping lookup fails on an out-of-range slot: IndexError from the inner, in both).
        outcomes = []
        for target in (e.w, e.bare):
            try:
                outcomes.append(getattr(target, op)(idx))
            except IndexError as exc:
                outcomes.append(type(exc))
        assert outcomes[0] == outcomes[1]
        assert outcomes[0] is (IndexError if (config, label) == ("hisparse-4", "out-of-range") else None)
        assert allocator_state(e.inner) == allocator_state(e.bare)
    assert [v.invariant for v in e.w.violations] == [inv]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", ["paged-4", "swa-4", "hisparse-4"])
@pytest.mark.parametrize("method", ["free_segment", "free_full_segment", "free_segments"])
def test_unaligned_start_pos(config, method, mode):
    """Not an argument error but ``segment_start_unaligned``: raise mode refuses before the inner allocator;
    record mode records it and forwards, and the inner's own check raises ValueError naming start_pos."""
    s = Setup(config, mode)
    e, b = s.e, s.b
    if s.kind == "swa" and method == "free_full_segment":
        e.both("free_swa", t(b.row))  # free_full_* expects the SWA peers released first
    before = allocator_state(e.inner)
    idx = t(b.row[1:])
    call = (
        (lambda: s.target.free_segments([(idx, 1)]))
        if method == "free_segments"
        else (lambda: getattr(s.target, method)(idx, start_pos=1))
    )
    if mode == "raise":
        with pytest.raises(InvariantViolation) as info:
            call()
        assert info.value.invariant == "segment_start_unaligned"
    else:
        with pytest.raises(ValueError) as info:
            call()
        assert info.value.argument == "start_pos"
    assert allocator_state(e.inner) == before == allocator_state(e.bare)
    want = ["segment_start_unaligned"] if mode in ("record", "raise") else []
    assert [v.invariant for v in e.w.violations] == want


class _ForeignSWA:
    """An SGLang-interface SWA allocator that is not one of the reference allocators (duck-typed): the wrapper
    cannot rely on its checks, so it checks the SWA tail itself. Records the tail calls that reach it."""

    def __init__(self):
        object.__setattr__(self, "real", SWATokenToKVPoolAllocator(64, 64, 4, torch.float16, "cpu", None, False))
        object.__setattr__(self, "forwarded", [])

    def __getattr__(self, name):
        return getattr(self.real, name)

    def alloc_extend_swa_tail(self, *args):
        self.forwarded.append(args[-2:])
        return self.real.alloc_extend_swa_tail(*args)


@pytest.mark.parametrize("mode", ["record", "raise"])
def test_too_long_swa_tail_never_reaches_a_foreign_inner(mode):
    inner = _ForeignSWA()
    w = InstrumentedAllocator(inner, mode=mode)
    before = allocator_state(inner.real)
    with pytest.raises(ValueError) as info:
        w.alloc_extend_swa_tail(t([0]), t([0]), t([8]), t([8]), t([-1]), 8, 9)  # tail 9 > 8 tokens
    assert (info.value.argument, str(info.value)) == ("swa_tail_len", "swa_tail_len: 9 exceeds extend_num_tokens 8")
    assert inner.forwarded == []
    assert allocator_state(inner.real) == before
    assert [(v.invariant, v.op, v.message) for v in w.violations] == [
        (
            "invalid_argument",
            "alloc_extend_swa_tail",
            "alloc_extend_swa_tail: swa_tail_len: 9 exceeds extend_num_tokens 8",
        )
    ]
    # A tail of all 8 tokens is valid and forwarded.
    assert w.alloc_extend_swa_tail(t([0]), t([0]), t([8]), t([8]), t([-1]), 8, 8).tolist() == list(range(4, 12))
    assert inner.forwarded == [(8, 8)]


# -- wrapper-only API ---------------------------------------------------------------------------------------------
BATCH_BAD = [
    ("none", dict(rids=None), TypeError, "rids"),
    ("int", dict(rids=3), TypeError, "rids"),
    ("unhashable", dict(rids=[["x"]]), TypeError, "rids"),
    ("duplicate", dict(rids=["x", "x"]), ValueError, "rids"),
    ("lens-length", dict(rids=["x", "y"], lens=[1]), ValueError, "lens"),
    ("lens-none-entry", dict(rids=["x"], lens=[None]), TypeError, "lens"),
    ("lens-float", dict(rids=["x"], lens=[1.5]), TypeError, "lens"),
    ("lens-bool", dict(rids=["x"], lens=[True]), TypeError, "lens"),
    ("lens-negative", dict(rids=["x"], lens=[-1]), ValueError, "lens"),
    ("lens-int", dict(rids=["x"], lens=3), TypeError, "lens"),
]


@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize(("label", "kwargs", "exc_type", "named"), [pytest.param(*c, id=c[0]) for c in BATCH_BAD])
def test_batch_bad_arguments(label, kwargs, exc_type, named, mode):
    s = Setup("paged-4", mode)
    w = s.e.w
    before = allocator_state(s.e.inner)
    live = list(w.ledger)
    with pytest.raises(exc_type) as info, w.batch(**kwargs):
        pass
    assert isinstance(info.value, ArgumentError) and info.value.argument == named
    assert str(info.value).startswith(f"{named}: ")
    assert list(w.ledger) == live  # nothing bound, no request created
    assert list(w.violations) == []  # batch() is not an allocator call (test_wrapper_forwarding)
    assert allocator_state(s.e.inner) == before
    with w.batch(["a"]):  # the binding was not left behind
        pass


def test_batch_off_mode_checks_nothing():
    s = Setup("paged-4", "off")
    for _, kwargs, _, _ in BATCH_BAD:
        with s.e.w.batch(**kwargs):
            pass
    assert list(s.e.w.violations) == [] and len(s.e.w.ledger) == 0


@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize(
    ("rid", "exc_type"),
    [("ghost", ValueError), (None, ValueError), (["a"], TypeError), ({"a": 1}, TypeError)],
    ids=["unknown", "none", "list", "dict"],
)
def test_release_request_bad_rid(rid, exc_type, mode):
    s = Setup("paged-4", mode)
    w = s.e.w
    before = allocator_state(s.e.inner)
    with pytest.raises(exc_type) as info:
        w.release_request(rid)
    assert isinstance(info.value, ArgumentError) and info.value.argument == "rid"
    assert [v.invariant for v in w.violations] == ["invalid_argument"]
    assert w.violations[0].op == "release_request"
    assert allocator_state(s.e.inner) == before
    assert set(w.ledger) == {"a", "b"}


def test_release_request_off_mode_checks_nothing():
    s = Setup("paged-4", "off")
    for rid in ("ghost", None, ["a"]):
        assert s.e.w.release_request(rid) is None
    assert list(s.e.w.violations) == []


LEDGER_FIELDS = ("kv_allocated_len", "kv_committed_len", "swa_evicted_seqlen", "cache_protected_len")
LEDGER_BAD = [(f, label, v) for f in LEDGER_FIELDS
              for label, v in (("none", None), ("float", 8.0), ("str", "8"), ("bool", True),
                               ("tensor", torch.tensor(8)), ("numpy-array", np.array([8])), ("list", [8]))]  # fmt: skip


@pytest.mark.parametrize("mode", ["record", "raise"])
@pytest.mark.parametrize(("field", "label", "value"), [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in LEDGER_BAD])
def test_ledger_write_bad_type(field, label, value, mode):
    s = Setup("swa-4", mode)
    w = s.e.w
    kv = w.ledger["a"]
    old = tuple(getattr(kv, f) for f in LEDGER_FIELDS)
    before = allocator_state(s.e.inner)
    with pytest.raises(TypeError) as info:
        setattr(kv, field, value)
    assert isinstance(info.value, ArgumentError) and info.value.argument == field
    assert str(info.value).startswith(f"{field}: expected an int, got ")
    assert tuple(getattr(kv, f) for f in LEDGER_FIELDS) == old  # never stored
    assert [v.invariant for v in w.violations] == ["invalid_argument"]
    assert w.violations[0].rid == "a" and w.violations[0].op == "ledger"
    assert allocator_state(s.e.inner) == before


@pytest.mark.parametrize("mode", ["record", "raise"])
def test_ledger_numpy_int_is_an_int_and_unknown_rid_is_a_key_error(mode):
    s = Setup("paged-4", mode)
    w = s.e.w
    kv = w.ledger["a"]
    kv.kv_committed_len = np.int64(kv.kv_committed_len)  # numbers.Integral: accepted
    with pytest.raises(KeyError):
        w.ledger["ghost"]
    assert list(w.violations) == []


@pytest.mark.parametrize("mode", ["record", "raise"])
def test_ledger_negative_values_are_invariant_faults(mode):
    s = Setup("swa-4", mode)
    w = s.e.w
    kv = w.ledger["b"]
    for field, inv in (
        ("kv_allocated_len", "kv_allocated_len_page_aligned"),
        ("kv_committed_len", "kv_committed_le_allocated"),
        ("swa_evicted_seqlen", "swa_evicted_seqlen_page_aligned"),
    ):
        n = len(w.violations)
        old = getattr(kv, field)
        if mode == "raise":
            with pytest.raises(InvariantViolation) as info:
                setattr(kv, field, -4 if field != "kv_committed_len" else -1)
            assert info.value.invariant == inv
        else:
            setattr(kv, field, -4 if field != "kv_committed_len" else -1)
        assert getattr(kv, field) == old
        assert w.violations[n].invariant == inv


def test_ledger_off_mode_has_no_requests():
    s = Setup("paged-4", "off")
    with pytest.raises(KeyError):
        s.e.w.ledger["a"]  # nothing is attributed when off: there is no record to write
