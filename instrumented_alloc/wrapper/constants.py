"""The wrapper's constants, in one place: the modes and options the constructor takes, the operations it
instruments, the invariants that taint a request's ledger comparison, and the positional event builders of the
kinds built on every call."""

from __future__ import annotations

import numpy as np
import torch

from instrumented_alloc import events as ev

MODES = ("raise", "record", "off")


# "This op has no such argument" (None is a value a caller can pass, and must be rejected as one).
_ABSENT = object()


_I64 = np.dtype(np.int64)


_TORCH_I64 = torch.int64


_ADD = np.add


_MAX = np.maximum
_MIN = np.minimum


_make_event = ev.make


# Positional builders of the kinds built on every call (see events.builder): no keyword dict, no template copy.
_B_ALLOC = ev.builder(ev.Alloc)


_B_FREE = ev.builder(ev.Free)


_B_LEDGER = ev.builder(ev.LedgerUpdate)


_B_PAGES = ev.builder(ev.PageUpdate)


_B_STEP = ev.builder(ev.StepBoundary)


_B_STATS = ev.builder(ev.StepStats)


_B_RELEASED = ev.builder(ev.RequestReleased)


_NOOP = {}.clear


VERIFY = ("auto", "immediate", "deferred")


# What a request's kv_allocated_len counts: whole pages (the host-allocator contract of SGLang's #35223: page-aligned,
# and the wrapper shrinks it with the request's frees), or tokens (SGLang 0.5.23: the engine writes every length,
# its pages are the ceiling, and frees leave the lengths to the engine).
ALLOCATED_LEN = ("pages", "tokens")


# Allocator methods the wrapper instruments. Any other attribute of the inner allocator is forwarded.
INSTRUMENTED_OPS = (
    "alloc",
    "alloc_extend",
    "alloc_decode",
    "alloc_extend_swa_tail",
    "alloc_logical_only",
    "free",
    "free_page_ids",
    "free_segment",
    "free_full",
    "free_full_segment",
    "free_swa",
    "free_swa_segment",
    "free_segments",
    "free_full_segments",
    "free_group_begin",
    "free_group_end",
    "merge_and_sort_free",
    "clear",
    "resize",
)


# Page-level faults after which a request's ledger-vs-pages comparison says nothing new.
_TAINTING = frozenset(
    {
        "duplicate_allocation",
        "slot_page_alignment",
        "swa_mapping_inconsistent",
        "double_free",
        "free_unallocated",
        "reserved_page_touched",
        "alloc_length_mismatch",
    }
)


# Bindings each thread remembers (see _bind): a decode batch, an extend's, a few more.
_BIND_MEMO = 8


# The fast paths the constructor's ``fast_paths`` switches (see ``InstrumentedAllocator``): each verifies the
# usual call of its kind more cheaply and changes nothing when it declines, so that the general path then judges
# the call. Off, a wrapper takes the general paths only; the findings are the same either way.
FAST_PATHS = (
    "alloc",  # a plain alloc at page size 1, bound to requests, on one pool
    "bind_memo",  # each thread remembers its last few batch() bindings (ids -> slots)
    "decode",  # alloc_decode at a power-of-two page size > 1: whole-array compares
    "decode_runs",  # after a decode in step, the next decodes of the batch checked against their expected bytes
    "extend_runs",  # an all-new extend of whole-page runs, checked on one slot per page
    "free",  # the usual free: every page of one owner
)


_OWN_ATTRS = frozenset({"ledger", "violations", "violation_counts", "mode", "inner", "trace_id_for", "bus"})
