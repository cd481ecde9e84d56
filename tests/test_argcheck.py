"""Unit tests of the argument-validation helpers (instrumented_alloc.argcheck), called directly.

The contract under test (argcheck's module docstring): a failed check raises ``TypeError`` (wrong kind of object
or dtype) or ``ValueError`` (wrong device, shape or range) whose message starts with the argument's name, and
``ArgumentError`` mixes into both; device tensors are checked by metadata only, never by value.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instrumented_alloc.argcheck import (
    ArgumentError,
    ArgumentTypeError,
    ArgumentValueError,
    check_batch,
    check_index_tensor,
    check_int,
    check_segments,
    check_start_pos,
    same_device,
)

CPU = torch.device("cpu")
META = torch.device("meta")


def t(values, dtype=torch.int64, device=CPU):
    return torch.tensor(values, dtype=dtype, device=device)


def assert_names(excinfo, name: str) -> None:
    """The error is an ArgumentError for ``name`` and its message starts with ``name``."""
    exc = excinfo.value
    assert isinstance(exc, ArgumentError)
    assert exc.argument == name
    assert str(exc).startswith(f"{name}:"), str(exc)


# -- the exception classes ---------------------------------------------------------------------------------------


def test_argument_type_error_is_both_argument_error_and_type_error():
    exc = ArgumentTypeError("free_index", "expected a torch.Tensor, got list")
    assert isinstance(exc, ArgumentError)
    assert isinstance(exc, TypeError)
    assert not isinstance(exc, ValueError)
    assert exc.argument == "free_index"
    assert str(exc) == "free_index: expected a torch.Tensor, got list"


def test_argument_value_error_is_both_argument_error_and_value_error():
    exc = ArgumentValueError("start_pos", "must be >= 0, got -1")
    assert isinstance(exc, ArgumentError)
    assert isinstance(exc, ValueError)
    assert not isinstance(exc, TypeError)
    assert exc.argument == "start_pos"
    assert str(exc).startswith("start_pos: ")


@pytest.mark.parametrize("cls, builtin", [(ArgumentTypeError, TypeError), (ArgumentValueError, ValueError)])
def test_argument_errors_are_catchable_as_builtin_and_as_argument_error(cls, builtin):
    with pytest.raises(builtin):
        raise cls("x", "bad")
    with pytest.raises(ArgumentError):
        raise cls("x", "bad")


def test_argument_error_is_not_a_catch_all_for_allocator_bugs():
    # A plain RuntimeError/AssertionError raised by an allocator is not an ArgumentError.
    assert not issubclass(RuntimeError, ArgumentError)
    assert not issubclass(AssertionError, ArgumentError)


# -- same_device -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ("cpu", "cpu", True),
        ("cpu", "cpu:0", True),  # a missing index matches index 0
        ("cuda", "cuda:0", True),
        ("cuda:0", "cuda:1", False),
        ("cuda:1", "cuda:1", True),
        ("cpu", "meta", False),
        ("cpu", "cuda", False),
    ],
)
def test_same_device(a, b, expected):
    assert same_device(torch.device(a), torch.device(b)) is expected
    assert same_device(torch.device(b), torch.device(a)) is expected


# -- check_int ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 7, 10**12, np.int64(5), np.int32(3)])
def test_check_int_accepts_python_and_numpy_ints(value):
    out = check_int("n", value)
    assert out == int(value)
    assert type(out) is int


@pytest.mark.parametrize(
    "value", [True, False, 1.0, 2.5, "3", None, torch.tensor(3), torch.tensor([3]), np.float64(2.0)]
)
def test_check_int_rejects_non_ints_with_type_error(value):
    with pytest.raises(TypeError) as excinfo:
        check_int("extend_num_tokens", value)
    assert_names(excinfo, "extend_num_tokens")


def test_check_int_minimum():
    assert check_int("page_size", 1, minimum=1) == 1
    with pytest.raises(ValueError) as excinfo:
        check_int("page_size", 0, minimum=1)
    assert_names(excinfo, "page_size")
    with pytest.raises(ValueError) as excinfo:
        check_int("need_size", -1)
    assert_names(excinfo, "need_size")
    assert "-1" in str(excinfo.value)


def test_check_int_negative_minimum_allowed():
    assert check_int("x", -3, minimum=-5) == -3


def test_check_start_pos_names_start_pos():
    assert check_start_pos(8) == 8
    for bad, exc_type in ((-4, ValueError), (True, TypeError), (4.0, TypeError), (None, TypeError)):
        with pytest.raises(exc_type) as excinfo:
            check_start_pos(bad)
        assert_names(excinfo, "start_pos")


# -- check_index_tensor ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_check_index_tensor_accepts_1d_int_tensors(dtype):
    x = t([1, 2, 3], dtype=dtype)
    assert check_index_tensor("free_index", x, CPU) is x
    empty = torch.empty((0,), dtype=dtype)
    assert check_index_tensor("free_index", empty, CPU) is empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int16, torch.uint8, torch.bool])
def test_check_index_tensor_rejects_other_dtypes(dtype):
    with pytest.raises(TypeError) as excinfo:
        check_index_tensor("free_index", torch.zeros(3, dtype=dtype), CPU)
    assert_names(excinfo, "free_index")


@pytest.mark.parametrize("value", [[1, 2, 3], (1, 2), None, 3, np.array([1, 2])])
def test_check_index_tensor_rejects_non_tensors(value):
    with pytest.raises(TypeError) as excinfo:
        check_index_tensor("page_ids", value, CPU)
    assert_names(excinfo, "page_ids")


@pytest.mark.parametrize("shape", [(), (2, 3), (1, 1, 1)])
def test_check_index_tensor_rejects_non_1d(shape):
    with pytest.raises(ValueError) as excinfo:
        check_index_tensor("free_index", torch.zeros(shape, dtype=torch.int64), CPU)
    assert_names(excinfo, "free_index")


def test_check_index_tensor_rejects_wrong_device():
    with pytest.raises(ValueError) as excinfo:
        check_index_tensor("last_loc", torch.empty((3,), dtype=torch.int64, device=META), CPU)
    assert_names(excinfo, "last_loc")
    with pytest.raises(ValueError) as excinfo:
        check_index_tensor("seq_lens", t([1, 2]), META)
    assert_names(excinfo, "seq_lens")


def test_check_index_tensor_does_not_read_values():
    # A meta tensor has no data: reading a value would raise. Checking it against the meta device must pass.
    x = torch.empty((4,), dtype=torch.int64, device=META)
    assert check_index_tensor("free_index", x, META) is x


# -- check_batch -------------------------------------------------------------------------------------------------


_SUM = object()


def extend_batch(prefix, seq, last_loc=None, extend_num_tokens=_SUM, device=CPU):
    if last_loc is None:
        last_loc = [-1] * len(seq)
    if extend_num_tokens is _SUM:
        extend_num_tokens = sum(s - p for p, s in zip(prefix, seq, strict=True))
    return dict(
        prefix_lens=t(prefix, device=device),
        prefix_lens_cpu=t(prefix),
        seq_lens=t(seq, device=device),
        seq_lens_cpu=t(seq),
        last_loc=t(last_loc, device=device),
        extend_num_tokens=extend_num_tokens,
    )


def decode_batch(seq, last_loc=None, device=CPU):
    if last_loc is None:
        last_loc = [s - 2 for s in seq]
    return dict(seq_lens=t(seq, device=device), seq_lens_cpu=t(seq), last_loc=t(last_loc, device=device))


def test_check_batch_extend_returns_batch_size():
    assert check_batch(CPU, **extend_batch([0, 4, 3], [5, 4, 9])) == 3


def test_check_batch_decode_returns_batch_size():
    assert check_batch(CPU, **decode_batch([1, 5, 9])) == 3


def test_check_batch_empty_batch():
    assert check_batch(CPU, **extend_batch([], [])) == 0
    assert check_batch(CPU, **decode_batch([])) == 0


def test_check_batch_accepts_int32():
    kw = extend_batch([0, 2], [3, 4])
    kw = {k: (v.to(torch.int32) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    assert check_batch(CPU, **kw) == 2


def test_check_batch_reads_no_device_values():
    # Device tensors on "meta" have no values; only the CPU mirrors are read.
    meta = dict(
        prefix_lens=torch.empty((2,), dtype=torch.int64, device=META),
        prefix_lens_cpu=t([0, 4]),
        seq_lens=torch.empty((2,), dtype=torch.int64, device=META),
        seq_lens_cpu=t([5, 6]),
        last_loc=torch.empty((2,), dtype=torch.int64, device=META),
        extend_num_tokens=7,
    )
    assert check_batch(META, **meta) == 2
    dec = {k: meta[k] for k in ("seq_lens", "seq_lens_cpu", "last_loc")}
    assert check_batch(META, **dec) == 2


def test_check_batch_cpu_mirrors_must_be_on_cpu():
    kw = extend_batch([0], [3])
    kw["seq_lens_cpu"] = torch.empty((1,), dtype=torch.int64, device=META)
    with pytest.raises(ValueError) as excinfo:
        check_batch(CPU, **kw)
    assert_names(excinfo, "seq_lens_cpu")
    kw = extend_batch([0], [3])
    kw["prefix_lens_cpu"] = torch.empty((1,), dtype=torch.int64, device=META)
    with pytest.raises(ValueError) as excinfo:
        check_batch(CPU, **kw)
    assert_names(excinfo, "prefix_lens_cpu")


@pytest.mark.parametrize("name", ["prefix_lens", "seq_lens", "last_loc"])
def test_check_batch_device_tensors_must_be_on_device(name):
    kw = extend_batch([0, 1], [3, 3])
    kw[name] = torch.empty((2,), dtype=torch.int64, device=META)
    with pytest.raises(ValueError) as excinfo:
        check_batch(CPU, **kw)
    assert_names(excinfo, name)


_MALFORMED = [("float", TypeError), ("list", TypeError), ("none", TypeError), ("2d", ValueError)]


@pytest.mark.parametrize(
    "name, bad, exc_type",
    [
        (name, bad, exc_type)
        for name in ("prefix_lens", "prefix_lens_cpu", "seq_lens", "seq_lens_cpu", "last_loc")
        for bad, exc_type in _MALFORMED
        # check_batch(prefix_lens=None) is the decode form by design; the allocators' alloc_extend is tested
        # with prefix_lens=None in tests/allocators.
        if (name, bad) != ("prefix_lens", "none")
    ],
)
def test_check_batch_malformed_tensor_names_argument(name, bad, exc_type):
    kw = extend_batch([0, 1], [3, 3])
    good = kw[name]
    kw[name] = {"float": good.float(), "list": good.tolist(), "none": None, "2d": good[None, :]}[bad]
    with pytest.raises(exc_type) as excinfo:
        check_batch(CPU, **kw)
    assert_names(excinfo, name)


@pytest.mark.parametrize("name", ["prefix_lens", "prefix_lens_cpu", "seq_lens_cpu", "last_loc"])
def test_check_batch_mismatched_lengths_name_the_argument(name):
    kw = extend_batch([0, 1], [3, 3])
    kw[name] = torch.cat([kw[name], kw[name][:1]])
    with pytest.raises(ValueError) as excinfo:
        check_batch(CPU, **kw)
    assert_names(excinfo, name)
    assert "3 entries" in str(excinfo.value)


def test_check_batch_seq_lens_is_the_reference_length():
    kw = extend_batch([0, 1], [3, 3])
    kw["seq_lens"] = t([3, 3, 3])
    with pytest.raises(ValueError) as excinfo:
        check_batch(CPU, **kw)
    # The first mirror compared against it is named; the message names seq_lens as the reference.
    assert_names(excinfo, "seq_lens_cpu")
    assert "seq_lens has 3" in str(excinfo.value)


def test_check_batch_prefix_longer_than_seq():
    with pytest.raises(ValueError) as excinfo:
        check_batch(CPU, **extend_batch([0, 5], [3, 4], extend_num_tokens=2))
    assert_names(excinfo, "prefix_lens_cpu")
    msg = str(excinfo.value)
    assert "request 1" in msg and "5" in msg and "4" in msg


def test_check_batch_negative_prefix():
    with pytest.raises(ValueError) as excinfo:
        check_batch(CPU, **extend_batch([-1, 0], [3, 4], extend_num_tokens=8))
    assert_names(excinfo, "prefix_lens_cpu")


def test_check_batch_negative_seq_len_in_extend_names_seq_lens_cpu():
    with pytest.raises(ValueError) as excinfo:
        check_batch(CPU, **extend_batch([0, 0], [3, -2], extend_num_tokens=1))
    assert_names(excinfo, "seq_lens_cpu")


def test_check_batch_negative_seq_len_in_extend_is_rejected():
    # Whatever argument it names, a negative length never passes.
    with pytest.raises(ValueError):
        check_batch(CPU, **extend_batch([0, 0], [3, -2], extend_num_tokens=1))


@pytest.mark.parametrize("seq", [[0], [3, 0], [-1, 4]])
def test_check_batch_decode_needs_seq_len_at_least_one(seq):
    with pytest.raises(ValueError) as excinfo:
        check_batch(CPU, **decode_batch(seq, last_loc=[0] * len(seq)))
    assert_names(excinfo, "seq_lens_cpu")


@pytest.mark.parametrize("n", [6, 8, 0])
def test_check_batch_extend_num_tokens_must_equal_sum(n):
    # sum(seq - prefix) = (3 - 0) + (6 - 2) = 7
    with pytest.raises(ValueError) as excinfo:
        check_batch(CPU, **extend_batch([0, 2], [3, 6], extend_num_tokens=n))
    assert_names(excinfo, "extend_num_tokens")
    assert "7" in str(excinfo.value)


@pytest.mark.parametrize("n, exc_type", [(7.0, TypeError), (True, TypeError), (None, TypeError), (-7, ValueError)])
def test_check_batch_extend_num_tokens_must_be_a_non_negative_int(n, exc_type):
    with pytest.raises(exc_type) as excinfo:
        check_batch(CPU, **extend_batch([0, 2], [3, 6], extend_num_tokens=n))
    assert_names(excinfo, "extend_num_tokens")


def test_check_batch_extend_num_tokens_accepts_numpy_int():
    assert check_batch(CPU, **extend_batch([0, 2], [3, 6], extend_num_tokens=np.int64(7))) == 2


def test_check_batch_zero_length_extends_are_fine():
    assert check_batch(CPU, **extend_batch([4, 0, 7], [4, 0, 7], extend_num_tokens=0)) == 3


# -- check_segments ----------------------------------------------------------------------------------------------


def test_check_segments_returns_the_pairs_as_a_list_and_consumes_a_generator():
    a, b = t([4, 5, 6, 7]), t([8])
    assert check_segments("segments", [(a, 0), (b, np.int64(4))], CPU) == [(a, 0), (b, 4)]
    gen = ((x, i * 4) for i, x in enumerate([a, b]))
    out = check_segments("segments", gen, CPU)
    assert [s for _, s in out] == [0, 4] and out[0][0] is a
    assert check_segments("segments", [], CPU) == []


@pytest.mark.parametrize(
    "segments, exc_type, detail",
    [
        (None, TypeError, "expected a sequence of (free_index, start_pos) pairs, got NoneType"),
        (t([1, 2]), TypeError, "expected a sequence of (free_index, start_pos) pairs, got Tensor"),
        ([t([1, 2])], TypeError, "segment 0: expected a (free_index, start_pos) pair, got Tensor"),
        ([(t([1]), 0, 0)], TypeError, "segment 0: expected a (free_index, start_pos) pair, got tuple"),
        ([(t([1]), 0), ([2], 4)], TypeError, "segment 1: free_index: expected a torch.Tensor, got list"),
        ([(t([1]), None)], TypeError, "segment 0: start_pos: expected an int, got NoneType"),
        ([(t([1]), -4)], ValueError, "segment 0: start_pos: must be >= 0, got -4"),
        ([(t([[1]]), 0)], ValueError, "segment 0: free_index: expected a 1-D tensor, got shape (1, 1)"),
        ([(t([1], device=META), 0)], ValueError, "segment 0: free_index: expected a tensor on cpu, got one on meta"),
    ],
)
def test_check_segments_names_segments_and_the_part(segments, exc_type, detail):
    with pytest.raises(exc_type) as info:
        check_segments("segments", segments, CPU)
    assert_names(info, "segments")
    assert str(info.value) == f"segments: {detail}"
