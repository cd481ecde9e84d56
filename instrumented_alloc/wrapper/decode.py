"""Checks of ``alloc_decode``, with the decode fast path and its caches.

Contract (``_DecodeChecks``, a mixin of ``InstrumentedAllocator``): forwards the call, then checks that each slot
sits at its position's offset in its page, that a request opening a page got a free one (and no other request
the same), that every other continues a page it owns; mirrors it in the shadows, the bound requests' ledger
columns (lengths, owned pages, ``decode_steps += 1``) and the call's events. Fast paths (``fast_paths``: see
``core``) verify the usual call with a few whole-array compares and change nothing when they decline;
``_DecodeRun`` holds facts established by a verified call, valid while the shadow's and the ledger's ``version``
are unchanged. Writes ``st.run`` and ``st.consts``."""

from __future__ import annotations

import numpy as np
import torch

from instrumented_alloc.argcheck import (
    ArgumentError,
    check_batch,
)
from instrumented_alloc.shadow import (
    FREE,
    has_repeat,
)
from instrumented_alloc.wrapper.constants import _I64
from instrumented_alloc.wrapper.state import _CallState, _charged


class _DecodeRun:
    """What the decode fast path knows after a verified decode of a batch in step (every request at the same
    offset ``a`` of its page: the same length, or a single request), either one in which every request opened a
    page (``a`` = 0) or one mid-page that no run vouched for, so that the next ``ps - 1 - a`` decodes of the same
    requests can be verified by two comparisons instead of reading the pages again.

    Invariant (established by a verified call, kept while ``shadow.version`` and ``ledger.version`` are those
    recorded): the batch's pages read their requests' codes (-1 for an unattributed batch), and the opening call's
    slots and lengths sat at offset ``a`` of those pages. The k-th decode verified
    after it (k < ps - a) whose slots are exactly the opening ones + k and whose lengths are exactly the opening
    ones + k (row k - 1 of ``o_rows`` and ``seq_rows``) then passes every check of the general path: each slot
    continues its request's own page at its position's offset, and no request opens a page. Any change of the
    pages' owners (a free, an allocation, clear, resize) or of the ledger (a checked write, a release)
    invalidates it; a call that does not match exactly takes the full check. SWA allocators keep no run (their
    peers are read from a mapping the inner may change)."""

    __slots__ = ("end", "ledger_version", "o_rows", "row", "seq_rows", "shadow", "slots_b", "version")

    def __init__(self, shadow, ledger_version: int, slots_b, o_rows: bytes, seq_rows: bytes, row: int):
        self.shadow = shadow
        self.version = shadow.version
        self.ledger_version = ledger_version
        self.slots_b = slots_b  # the slots' bytes (None: an unattributed batch)
        # The expected arguments of the next ps - 1 decodes, one row of ``row`` bytes each: a matching call costs
        # two slices and two compares (memcmp), no array operation.
        self.o_rows = o_rows
        self.seq_rows = seq_rows
        self.row = row
        self.end = row  # where the next call's row ends (past the rows: the run is spent)


def _run_after(shadow, ledger, slots, o: np.ndarray, seq: np.ndarray, steps: np.ndarray):
    """The ``_DecodeRun`` after a verified call with slots ``o`` and lengths ``seq``: the next decodes' expected
    arguments, ``o`` and ``seq`` + each of ``steps`` (a column)."""
    return _DecodeRun(
        shadow,
        ledger.version,
        None if slots is None else slots.tobytes(),
        (o + steps).tobytes(),
        (seq + steps).tobytes(),
        o.nbytes,
    )


class _DecodeChecks:
    """Decode checks (see the module docstring)."""

    @_charged
    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        st = self._w_st  # every read below from it (see _CallState): the wrapper's own attributes are slow
        with st.lock:
            op = "alloc_decode"
            st.op = op
            if st.inner_checks and type(seq_lens) is torch.Tensor and seq_lens.dim() == 1:
                bs = seq_lens.shape[0]  # the inner validates everything before it changes anything
            else:
                bs = self._validate(
                    op, check_batch, st.device, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu, last_loc=last_loc
                )
            bound = getattr(st.tls, "bound", None)
            if bound is None:
                slots = None
            elif len(bound[0]) == bs:
                slots = bound[1]
            else:
                slots = self._bound_slots(bs, op)  # raises: the bound batch does not match the call
            if not st.capture_before:
                before = None
            elif st.need_sort:
                before = self._entries_before()
            else:
                # _entries_before's two-pool case, inline (an SWA allocator's every decode): free+staged page counts.
                before = [(p.count(), 0) for p in st.pools.values()]
            timed = st.time_decode  # the duration is only read by this call's Alloc or AllocFailed events or stats
            cost = st.cost
            cost.stop_checks()
            t0 = st.clock() if timed else 0.0
            try:
                out = st.inner.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
            except ArgumentError as exc:
                cost.start()
                self._invalid(op, exc)
            cost.start()
            dt = st.clock() - t0 if timed else 0.0
            allocs = st.note_alloc  # this call's Alloc events are built, or counted in the step's statistics
            if st.need_sort:  # only need_sort merges (before then holds the staged counts _after_merge_check reads)
                self._after_merge_check(before)
            if out is None:
                return self._alloc_none(op, bs, before, dt)
            n_new = None
            if st.fast_decode and out.shape[0] == bs:
                o = out.numpy()
                seq = seq_lens_cpu.numpy()
                run = st.run
                if (
                    run is not None
                    and o.tobytes() == run.o_rows[run.end - run.row : run.end]
                    and seq.tobytes() == run.seq_rows[run.end - run.row : run.end]
                    and o.dtype is _I64
                    and seq.dtype is _I64
                    and run.shadow is st.full.shadow
                    and run.version == run.shadow.version
                    and run.ledger_version == st.ledger.version
                    and run.slots_b == (None if slots is None else slots.tobytes())
                ):
                    # Inline (a method call costs a tenth of what is left here): every slot is the last verified
                    # one + 1 in a page its request owns, no request opens a page (see _DecodeRun). Apply what
                    # the full check applies to such a call.
                    run.end += run.row  # past the rows' end: an empty slice, which no call's bytes match
                    if slots is not None:
                        st.ledger.committed[slots] = seq
                        if not st.track_lengths:
                            st.ledger.allocated[slots] = seq  # tokens: the engine's next write (see _extend)
                    # No page delta: no owner changes (see PageUpdate), so the call publishes none.
                    n_new = 0
                else:
                    n_new = self._decode_fast(st, o, seq, slots, bound, bs)
            if n_new is not None:
                if slots is not None:
                    led = st.ledger
                    if slots is led.dec_slots:  # the pending run's batch (see KvLedger.count_decodes)
                        led.dec_n += 1
                    else:
                        led.count_decodes(slots)
                    if st.want_ledger:
                        self._emit_ledger(op, slots, bound[0], private=True)  # the binding's (read-only)
                if allocs:
                    emit_alloc = self._emit_alloc
                    emit_alloc(op, bs, int(n_new), dt)
                    if st.swa is not None:
                        emit_alloc(op, bs, int(n_new), 0.0, pool="swa")
                # want_pages: a page delta alone is a batch too (a sink that reads only PageUpdate gets it now,
                # named for this call, not with the next call's events).
                if st.events or st.to_raise or st.want_pages:
                    self._finish()
                return out
            return self._decode_checked(op, out, seq_lens_cpu, bs, slots, allocs, dt)

    def _decode_checked(self, op: str, out, seq_lens_cpu, bs: int, slots, allocs: bool, dt: float):
        """``alloc_decode``'s general path (under the lock, after the inner call): every check, with the faults
        named. A method of its own: its closures would otherwise make a cell of each variable they read on every
        decode, the fast ones included."""
        ps = self._w_ps
        seq = seq_lens_cpu.numpy()
        # SGLang's rule for a page-opening decode (never true at page size 1, where it decodes in place).
        shift = self._w_shift
        new_mask = (seq & (ps - 1) if shift is not None else seq % ps) == 1
        n_new = int(np.count_nonzero(new_mask))
        got = out.shape[0]
        if got != bs:
            self._violate("alloc_length_mismatch", f"{op} returned {got} slots for a batch of {bs}", op=op, pool="full")
            if allocs:
                self._emit_alloc(op, got, n_new, dt)
            self._finish()
            return out
        own = -1
        if slots is not None:
            own = slots
            led = self._w_st.ledger
            led.committed[slots] = seq
            if n_new:
                openers = slots[new_mask]
                for arr in led.owned.values():
                    arr[openers] += 1
                led.allocated[openers] = (seq[new_mask] + (ps - 1)) // ps * ps
            if not self._w_st.track_lengths:
                led.allocated[slots] = seq  # tokens: the engine's next write (see _extend)
            led.count_decodes(slots)
            if self._w_st.want_ledger:
                self._emit_ledger(op, slots, self._w_bound[0], private=True)  # the binding's (read-only)
        full, swa_pool = self._w_st.full, self._w_st.swa
        pos = seq - 1

        def check(o, pool, name):
            # Page sizes are powers of two in practice: bit operations are 2-3x cheaper than % and //.
            if shift is not None:
                misaligned = np.count_nonzero((o - pos) & (ps - 1))
                pages = o >> shift
            else:
                misaligned = np.count_nonzero((o - pos) % ps)
                pages = o // ps
            if misaligned:
                self._misaligned(o, pos, own, op, name)
            bad = pool.shadow.on_alloc(pages, own, new_mask, n_new, op)
            if bad:
                self._report(bad, name, op)

        def verify(o, s=None):
            check(o, full, "full")
            if s is not None:
                check(s, swa_pool, "swa")

        st = self._w_st
        if swa_pool is not None:
            self._slot_tier(verify, out, self._swa_peer(out))
        else:
            self._slot_tier(verify, out)
        if allocs:
            self._emit_alloc(op, got, n_new, dt)
            if swa_pool is not None:
                self._emit_alloc(op, got, n_new, 0.0, pool="swa")
        if st.events or st.to_raise or st.want_pages:
            self._finish()
        return out

    def _decode_consts(self, bs: int) -> tuple:
        """Per-batch-size operands of the decode fast path (arrays: numpy's array-scalar ops cost more)."""
        consts = self._w_consts
        c = consts.get(bs)
        if c is None:
            if len(consts) > 64:
                consts.clear()
            ps = self._w_ps
            c = (
                np.full(bs, ps - 1, np.int64),  # offset in a page
                np.full(bs, (ps - 1) - 2**63, np.int64),  # the same plus the sign bit: a negative slot never matches
                np.ones(bs, np.int64),
                np.full(bs, self._w_shift, np.int64),
                np.full(bs, -1, np.int32),  # owner code of an unattributed slot
                np.zeros(bs, np.int64),
                np.full(bs, FREE, np.int32),
            )
            consts[bs] = c
        return c

    def _decode_fast(self, st: _CallState, o: np.ndarray, seq: np.ndarray, slots, bound, bs: int):
        """Immediate verification of a decode with a power-of-two page size > 1, for the case where every check
        passes: each slot (and on an SWA allocator its SWA peer, read from the mapping after the call) sits at its
        position's offset in its page; a request that opens a page got one that was free, and no other request of
        the call got the same one (``PoolShadow.shared_in_call``'s rule, applied before anything is written: the
        owners read back, or a duplicate test when unattributed), every other continues in a page it owns.
        Then it applies what the general path applies (ledger lengths and page counts, the shadows,
        the free counts) and returns the number of pages opened.
        Anything else (a fault, other dtypes) returns None having changed nothing: the general path then checks
        the call again and reports it. Whole-array compares go through ``tobytes`` (a memcmp): a tenth of the cost
        of a numpy reduction at this size. ``st``: the wrapper's ``_CallState`` (every read from it)."""
        swa = st.swa
        shadow = st.full.shadow
        if o.dtype is not _I64 or seq.dtype is not _I64:
            return None
        mask, smask, _one, shift, unowned, zero, free = st.consts.get(bs) or self._decode_consts(bs)
        # The offset in its page of the position each new slot holds ((seq - 1) & mask, as seq + mask: -1 and
        # mask agree modulo ps); 0: the request opens a page. seq + mask is an opener's allocated length too.
        seq_m = seq + mask
        at = seq_m & mask
        at_b = at.tobytes()
        if (o & smask).tobytes() != at_b:
            return None  # slot_page_alignment, or a negative slot
        pages = o >> shift
        try:
            prev = shadow.owner[pages]
        except IndexError:
            return None  # a page past the end
        if swa is not None:
            # The SWA peers: the same offsets, the same owners (the slot check above bounds o by the mapping).
            peers = st.inner.full_to_swa_index_mapping.numpy()[o]
            if (peers & smask).tobytes() != at_b:
                return None
            swa_pages = peers >> shift
            swa_shadow = swa.shadow
            try:
                swa_prev = swa_shadow.owner[swa_pages]
            except IndexError:
                return None
        n_new = bs - np.count_nonzero(at)
        if slots is None:
            own = unowned  # owner codes (int32) of the pages, as they must read
        else:
            own = bound[3]
            if own is None:
                own = bound[3] = slots.astype(np.int32)
                own.setflags(write=False)  # shared by this block's page deltas (see _bind)
        if n_new == 0:
            own_b = own.tobytes()
            if prev.tobytes() != own_b or (swa is not None and swa_prev.tobytes() != own_b):
                return None  # a page owned by another request, free, or reserved
            if slots is not None:
                st.ledger.committed[slots] = seq
                if not st.track_lengths:
                    st.ledger.allocated[slots] = seq  # tokens: the engine's next write (see _extend)
            # The pages already read as own (just compared): no write, and no page delta (see PageUpdate).
            if swa is None and st.decode_runs:
                a = at.item(0) if bs else 0
                rows = st.ps - 1 - a
                if bs and rows and not np.count_nonzero(at != a):
                    # A batch in step mid-page (every request at offset a; reached when no run vouched for the
                    # call: the prefix cache's transfers or a release spent it): its next decodes up to the pages'
                    # end are a run of their own, as after an opening call (see _DecodeRun).
                    st.run = _run_after(shadow, st.ledger, slots, o, seq, st.steps[:rows])
            return 0
        # Openers must find their page free (code <= FREE: clipped up to FREE, it reads FREE), the others their
        # own page (codes >= -1, which the clip leaves alone).
        if n_new == bs:
            opens = None  # every request opens a page (a batch in step, a single request): no masks
            expect_b = free.tobytes()
        else:
            opens = at == zero
            expect = own.copy()
            expect[opens] = FREE
            expect_b = expect.tobytes()
        if np.maximum(prev, free).tobytes() != expect_b or (
            swa is not None and np.maximum(swa_prev, free).tobytes() != expect_b
        ):
            return None
        # One page opened by two requests (the inner listed it twice): decline before anything is written, the
        # general path reports it (PoolShadow.shared_in_call). Attributed: the owners written read back as own
        # (the later write wins; undone at once when not); unattributed: a duplicate test on the opened pages.
        if n_new > 1:
            if slots is None:
                if has_repeat(pages if opens is None else pages[opens]) or (
                    swa is not None and has_repeat(swa_pages if opens is None else swa_pages[opens])
                ):
                    return None
            else:
                own_b = own.tobytes()
                owner = shadow.owner
                owner[pages] = own
                if owner[pages].tobytes() != own_b:
                    owner[pages] = prev
                    return None
                if swa is not None:
                    swa_owner = swa_shadow.owner
                    swa_owner[swa_pages] = own
                    if swa_owner[swa_pages].tobytes() != own_b:
                        swa_owner[swa_pages] = swa_prev
                        owner[pages] = prev
                        return None
        # pages and swa_pages: shifts computed here, held by no one else; own: read-only (see _bind) or the shared
        # unattributed constant (not private: copied). With non-openers, the page deltas keep the openers' entries
        # alone (boolean gathers: fresh): every other page read own already (see PageUpdate).
        private = slots is not None
        written = n_new > 1 and slots is not None  # the owners are in place (the read-back above)
        if swa is not None:
            if not written:
                swa_shadow.owner[swa_pages] = own
            swa_shadow.version += 1
            if swa_shadow.deltas is not None:
                if opens is None:
                    swa_shadow.note(swa_pages, own, private=private)
                else:
                    swa_shadow.note(swa_pages[opens], own[opens], private=True)
            swa_shadow.expected_entries -= n_new
        if slots is not None:
            led = st.ledger
            led.committed[slots] = seq
            openers = slots if opens is None else slots[opens]
            for arr in led.owned.values():
                arr[openers] += 1
            # An opener's position is a page's first (seq = k * ps + 1): it now holds ceil(seq / ps) * ps slots.
            led.allocated[openers] = seq_m if opens is None else seq_m[opens]
            if not st.track_lengths:
                led.allocated[slots] = seq  # tokens: the engine's next write (see _extend)
        if not written:
            shadow.owner[pages] = own
        shadow.version += 1
        if shadow.deltas is not None:
            if opens is None:
                shadow.note(pages, own, private=private)
            else:
                shadow.note(pages[opens], own[opens], private=True)
        shadow.expected_entries -= n_new
        if swa is None and opens is None and st.decode_runs:
            # A batch in step: each request now sits at offset 0 of a fresh page (see _DecodeRun; never on SWA
            # allocators). Two array additions (the next ps - 1 calls' arguments) here, where the call opened a
            # page for every request; nothing on other calls.
            st.run = _run_after(shadow, st.ledger, slots, o, seq, st.steps)
        return n_new
