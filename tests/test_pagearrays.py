"""The array helpers return what the numpy calls they replace return, on every size path they take."""

from __future__ import annotations

import numpy as np
import pytest

from instrumented_alloc.pagearrays import entry_ids, has_repeat, sorted_unique


def _cases():
    rng = np.random.default_rng(0)
    yield np.array([], np.int64)
    yield np.array([5], np.int64)
    yield np.array([3, 3], np.int64)
    for n in (2, 17, 64, 65, 300):
        yield rng.integers(0, n, n)  # repeats likely
        yield rng.permutation(4 * n)[:n]  # distinct
    yield np.repeat(rng.permutation(40), 16)  # a freed row: each page page_size times in a row
    yield np.full(200, 7, np.int64)


@pytest.mark.parametrize("a", list(_cases()), ids=lambda a: f"n{a.size}")
def test_sorted_unique_and_has_repeat_agree_with_numpy(a):
    before = a.copy()
    got = sorted_unique(a)
    assert got.tolist() == np.unique(a).tolist()
    assert not np.shares_memory(got, a)  # a fresh array
    assert np.array_equal(a, before)  # the input is left as it was
    assert has_repeat(a) == (np.unique(a).size != a.size)


def test_entry_ids_are_shared_read_only_and_grow_on_demand():
    small = entry_ids(3)
    assert small.tolist() == [0, 1, 2] and small.dtype == np.int32 and not small.flags.writeable
    big = entry_ids(10_000)
    assert big.tolist() == list(range(10_000)) and not big.flags.writeable
