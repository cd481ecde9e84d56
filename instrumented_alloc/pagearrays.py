"""Integer-array helpers for the shadow's and the wrapper's checks: numpy's generic calls without their fixed cost.

Each returns what the numpy call it replaces returns (fresh arrays unless said otherwise); they are measured
against one call of a decode step (microseconds), where numpy's Python wrappers dominate.
"""

from __future__ import annotations

import numpy as np

_ALL = np.logical_and.reduce  # ndarray.all() goes through a Python wrapper


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` for a 1-D integer array (sorted distinct values, a fresh array), without its fixed cost:
    numpy 2's ``unique`` spends several microseconds per call even on a handful of values (13 us on 256), a sort
    and a neighbour compare about 1.5."""
    n = a.size
    if n < 2:
        return a.copy()
    if n > 64:
        # Runs of equal neighbours first (a freed row repeats each page page_size times in a row): the same set
        # of values, so the same result, with a linear pass instead of sorting every entry.
        heads = np.empty(n, bool)
        heads[0] = True
        np.not_equal(a[1:], a[:-1], out=heads[1:])
        srt = a[heads]  # a boolean gather: a fresh array
        if srt.size < 2:
            return srt
    else:
        srt = a.copy()
    srt.sort()  # in place (np.sort copies first, through a Python wrapper)
    differ = srt[1:] != srt[:-1]
    if _ALL(differ):
        return srt  # the usual case: no value repeats once runs are gone
    keep = np.empty(srt.size, bool)
    keep[0] = True
    keep[1:] = differ
    return srt[keep]


def has_repeat(a: np.ndarray) -> bool:
    """Whether some value occurs twice in a 1-D integer array."""
    n = a.size
    if n < 2:
        return False
    if n <= 64:
        return len(set(a.tolist())) != n  # a few dozen values: a Python set beats a sort's fixed cost
    srt = np.sort(a)
    return bool(np.count_nonzero(srt[1:] == srt[:-1]))


_IDS = np.arange(4096, dtype=np.int32)
_IDS.setflags(write=False)


def entry_ids(n: int) -> np.ndarray:
    """``0 .. n-1`` as int32 (read-only; shared): codes to write at a call's pages and read back, which finds a
    page listed twice in one scatter, one gather and one bytes compare (a later entry overwrites an earlier one's
    code) instead of a sort."""
    global _IDS
    if n > _IDS.size:
        _IDS = np.arange(max(n, 2 * _IDS.size), dtype=np.int32)
        _IDS.setflags(write=False)
    return _IDS[:n]
