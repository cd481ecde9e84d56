"""Decode-side preallocation for prefill/decode (PD) disaggregation, written through the checked ledger.

The seed put one assert (``swa_evicted_seqlen >= 0 and % page_size == 0``) in one of these paths
(``alloc_for_decode_prealloc_hisparse``). Here every prealloc path stores the request's KV record through the
ledger's single checked write point, so the rule holds for the plain path too, counts when it breaks, and
``mode`` decides whether the engine stops.

Contract:
- ``allocator`` is an ``InstrumentedAllocator`` (its ledger is used and the allocation is bound to ``rid``), or a
  bare allocator together with a ``KvLedger`` passed as ``ledger`` (whose standalone writes raise on a broken rule).
- Batch size 1, empty prefix: positions ``0 .. fill_len-1``. The device tensors are built from host values with
  ``non_blocking`` copies; nothing is read back.
- Only after a successful allocation the record is written, in this order: ``kv_allocated_len`` (``fill_len``
  ceiled to a page: the host-allocator contract), ``kv_committed_len = fill_len``, and with an SWA tail
  ``swa_evicted_seqlen = fill_len - swa_tail_len`` (invariant I2: page-aligned, checked before it is stored).
  A failed allocation (``None``) writes nothing.
"""

from __future__ import annotations

import torch

from instrumented_alloc.argcheck import ArgumentTypeError, ArgumentValueError, check_int


def swa_tail_len(seq_len: int, window: int, page_size: int) -> int:
    """Tokens of SWA KV the decode side needs: from the window start floored to a page, to ``seq_len``.

    Flooring the start keeps ``seq_len - swa_tail_len`` (the evicted length) page-aligned, which is what
    ``free_swa_segment`` relies on. The tail is at most ``window + page_size - 1`` tokens.
    """
    seq_len = check_int("seq_len", seq_len)
    window = check_int("window", window, minimum=1)
    page_size = check_int("page_size", page_size, minimum=1)
    start = max(0, seq_len - window) // page_size * page_size
    return seq_len - start


def _ledger_for(allocator, ledger):
    if ledger is not None:
        return ledger
    led = getattr(allocator, "ledger", None)
    if led is None:
        raise ArgumentTypeError("ledger", "a bare allocator needs a KvLedger passed as ledger=")
    return led


def _batch_of_one(device, fill_len: int):
    zero = torch.zeros((1,), dtype=torch.int64)
    fill = torch.tensor([fill_len], dtype=torch.int64)
    dev = torch.device(device)
    return (
        zero.to(dev, non_blocking=True),
        zero,
        fill.to(dev, non_blocking=True),
        fill,
        torch.full((1,), -1, dtype=torch.int64).to(dev, non_blocking=True),
    )


def _allocate(allocator, rid, call):
    bind = getattr(allocator, "batch", None)
    if bind is None:
        return call()
    with bind([rid]):
        return call()


def _write_record(ledger, rid, fill_len: int, page_size: int, evicted: int | None) -> None:
    kv = ledger.get_or_create(rid) if hasattr(ledger, "get_or_create") else ledger[rid]
    kv.kv_allocated_len = -(-fill_len // page_size) * page_size
    kv.kv_committed_len = fill_len
    if evicted is not None:
        # The seed's I2, now at the single write point for every path.
        kv.swa_evicted_seqlen = evicted


def alloc_for_decode_prealloc(
    allocator, *, rid, fill_len: int, swa_tail_len: int | None = None, ledger=None
) -> torch.Tensor | None:
    """Preallocate KV for ``fill_len`` transferred tokens: full KV for all of them, SWA KV for all of them
    (``alloc_extend``) or, with ``swa_tail_len``, only for the window's tail (``alloc_extend_swa_tail``).
    Page size 1 allocates with ``alloc(fill_len)``, SWA KV for every token, a tail or not, as SGLang's scheduler
    does there. Returns the full-pool slots, or None when the pool is short."""
    fill_len = check_int("fill_len", fill_len)
    led = _ledger_for(allocator, ledger)
    ps = int(allocator.page_size)
    if swa_tail_len is not None:
        tail = check_int("swa_tail_len", swa_tail_len)
        if tail > fill_len:
            raise ArgumentValueError("swa_tail_len", f"{tail} exceeds fill_len {fill_len}")
    if ps == 1:
        out = _allocate(allocator, rid, lambda: allocator.alloc(fill_len))
        if out is not None:
            _write_record(led, rid, fill_len, ps, None)
        return out
    args = _batch_of_one(allocator.device, fill_len)
    if swa_tail_len is None:
        out = _allocate(allocator, rid, lambda: allocator.alloc_extend(*args, fill_len))
        evicted = None
    else:
        out = _allocate(allocator, rid, lambda: allocator.alloc_extend_swa_tail(*args, fill_len, tail))
        evicted = fill_len - tail
    if out is not None:
        _write_record(led, rid, fill_len, ps, evicted)
    return out


def alloc_for_decode_prealloc_hisparse(
    allocator, *, rid, fill_len: int, uses_swa_tail: bool, swa_tail_len: int = 0, ledger=None
) -> torch.Tensor | None:
    """The seed's entry point: with ``uses_swa_tail``, full KV plus the SWA tail (``alloc_extend_swa_tail``);
    otherwise logical slots only (``alloc_logical_only``, HiSparse). Returns the slots, or None when short."""
    fill_len = check_int("fill_len", fill_len)
    led = _ledger_for(allocator, ledger)
    ps = int(allocator.page_size)
    args = _batch_of_one(allocator.device, fill_len)
    if uses_swa_tail:
        tail = check_int("swa_tail_len", swa_tail_len)
        if tail > fill_len:
            raise ArgumentValueError("swa_tail_len", f"{tail} exceeds fill_len {fill_len}")
        out = _allocate(allocator, rid, lambda: allocator.alloc_extend_swa_tail(*args, fill_len, tail))
        evicted = fill_len - tail
    else:
        out = _allocate(allocator, rid, lambda: allocator.alloc_logical_only(*args, fill_len))
        evicted = None
    if out is not None:
        _write_record(led, rid, fill_len, ps, evicted)
    return out
