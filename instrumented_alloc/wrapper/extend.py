"""Checks of ``alloc_extend`` and its prealloc variants (``alloc_extend_swa_tail``, ``alloc_logical_only``).

Contract (``_ExtendChecks``, a mixin of ``InstrumentedAllocator``): validates the batch, forwards the call, then
checks that every slot sits at its position's offset in its page, that each opened page was free and no page went
to two requests, and mirrors it: the shadows, the bound requests' ledger columns (owned pages, lengths; the
records a free saved are dropped) and the call's events. An SWA tail's evicted length is judged before the call.
The page-run check (``fast_paths`` "extend_runs") verifies an all-new extend of whole-page runs on one slot per
page and changes nothing when it declines; the per-slot check then judges the call."""

from __future__ import annotations

import numpy as np
import torch

from instrumented_alloc.argcheck import (
    ArgumentError,
    ArgumentValueError,
    check_batch,
    check_int,
)
from instrumented_alloc.shadow import (
    FREE,
    PoolShadow,
    entry_ids,
)
from instrumented_alloc.wrapper.constants import _ABSENT, _ADD, _I64, _MAX
from instrumented_alloc.wrapper.state import _charged, _Pool


class _ExtendChecks:
    """Extend checks (see the module docstring)."""

    def alloc_extend(
        self,
        prefix_lens,
        prefix_lens_cpu,
        seq_lens,
        seq_lens_cpu,
        last_loc,
        extend_num_tokens,
        *args,
        **kwargs,
    ):
        inner = self._w_inner
        return self._extend(
            "alloc_extend",
            inner.alloc_extend,
            (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, *args),
            kwargs,
        )

    def alloc_logical_only(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        inner = self._w_inner
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        return self._extend("alloc_logical_only", inner.alloc_logical_only, args, {}, swa=False)

    def alloc_extend_swa_tail(
        self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, swa_tail_len
    ):
        inner = self._w_inner
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        return self._extend("alloc_extend_swa_tail", inner.alloc_extend_swa_tail, args, {}, tail=swa_tail_len)

    @_charged
    def _extend(self, op, call, args, kwargs, *, swa: bool = True, tail=_ABSENT):
        st = self._w_st  # the wrapper's state, read from it (see _CallState)
        with st.lock:
            st.op = op
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, n = args[:6]
            # An SWA tail is judged before the call (_tail_evicted_check reads seq_lens_cpu and swa_tail_len): its
            # arguments are validated here first, whoever the inner is.
            trusted = st.inner_checks and tail is _ABSENT and type(seq_lens) is torch.Tensor and seq_lens.dim() == 1
            if trusted:
                bs = seq_lens.shape[0]  # the inner validates everything before it changes anything
            else:
                bs = self._validate(
                    op,
                    check_batch,
                    st.device,
                    prefix_lens=prefix_lens,
                    prefix_lens_cpu=prefix_lens_cpu,
                    seq_lens=seq_lens,
                    seq_lens_cpu=seq_lens_cpu,
                    last_loc=last_loc,
                    extend_num_tokens=n,
                )
            if tail is not _ABSENT and not trusted:
                tail = self._validate(op, check_int, "swa_tail_len", tail)
                if bs != 1:
                    self._invalid(
                        op, ArgumentValueError("seq_lens", f"SWA tail allocation takes batch size 1, got {bs}")
                    )
                if tail > n:
                    self._invalid(op, ArgumentValueError("swa_tail_len", f"{tail} exceeds extend_num_tokens {n}"))
            bound = getattr(st.tls, "bound", None)
            if bound is None:
                slots = None
            elif len(bound[0]) == bs:
                slots = bound[1]
            else:
                slots = self._bound_slots(bs, op)  # raises: the bound batch does not match the call
            if tail is not _ABSENT:
                self._tail_evicted_check(op, seq_lens_cpu, tail, slots)
            if not st.capture_before:
                before = None
            elif st.need_sort:
                before = self._entries_before()
            else:
                # _entries_before's two-pool case, inline (an SWA allocator's every extend): free+staged page counts.
                before = [(p.count(), 0) for p in st.pools.values()]
            st.cost.stop_checks()
            t0 = st.clock()
            try:
                out = call(*args, tail, **kwargs) if tail is not _ABSENT else call(*args, **kwargs)
            except ArgumentError as exc:
                st.cost.start()
                self._invalid(op, exc)
            st.cost.start()
            dt = st.clock() - t0
            if st.need_sort:
                self._after_merge_check(before)
            if out is None:
                return self._alloc_none(op, n, before, dt)
            ps, shift = st.ps, st.shift
            prefix, seq = prefix_lens_cpu.numpy(), seq_lens_cpu.numpy()
            if prefix.dtype is not _I64:  # int32 lengths (the usual int64 needs no call)
                prefix = prefix.astype(np.int64)
            if seq.dtype is not _I64:
                seq = seq.astype(np.int64)
            ext = seq - prefix
            m = ps - 1
            if shift is not None:  # a shift floors as // does, for a third of the cost
                ceil_prefix, ceil_seq = (prefix + m) >> shift, (seq + m) >> shift
            else:
                ceil_prefix, ceil_seq = (prefix + m) // ps, (seq + m) // ps
            grow = ceil_seq - ceil_prefix
            # ufunc methods and ndarray.repeat are C calls; ndarray.sum, np.cumsum and np.repeat wrap them in
            # Python (a microsecond each on a batch).
            n_new = grow.item(0) if bs == 1 else int(_ADD.reduce(grow))
            got = int(out.shape[0])
            if got != n:
                self._violate(
                    "alloc_length_mismatch", f"{op} returned {got} slots for extend_num_tokens={n}", op=op, pool="full"
                )
                self._emit_alloc(op, got, n_new, dt)
                self._finish()
                return out
            # Every prefix ends on a page boundary (fresh requests, whole-page chunks): every slot opens a page taken
            # from the free list (on_alloc reads new_mask None as all new, and judges it with one comparison).
            if bs == 1:
                aligned = not prefix.item(0) % ps
            else:
                aligned = not np.count_nonzero(prefix & m if shift is not None else prefix % ps)
            # Immediate checks of an all-new extend whose pages are runs of page_size slots in call order (every
            # prefix page-aligned, every request but the last a whole number of pages: one request, or whole-page
            # chunks) try the page-run check first (_alloc_runs), which needs neither the slots' positions nor
            # their owners: those are built only when it declines (the per-slot check) or for a deferred check.
            runs = (
                st.extend_runs
                and aligned
                and shift is not None
                and not st.deferred
                and (bs == 1 or not np.count_nonzero(ext[:-1] & m))
            )
            full, swa_pool = st.full, st.swa
            led = st.ledger
            if slots is not None:
                if bs == 1:  # Python ints: a fancy-index update is a gather and a scatter
                    s0 = slots.item(0)
                    owned_full = led.owned["full"]
                    owned_full[s0] = owned_full.item(s0) + grow.item(0)
                    led.committed[s0] = seq.item(0)
                    # The request's allocated length: whole pages, or (allocated_len="tokens") its token count, the
                    # value the engine writes next (then no change to report).
                    led.allocated[s0] = ceil_seq.item(0) * ps if st.track_lengths else seq.item(0)
                else:
                    led.owned["full"][slots] += grow
                    led.committed[slots] = seq
                    led.allocated[slots] = ceil_seq * ps if st.track_lengths else seq
                if led.kept:
                    led.unkeep(slots)  # the record is this allocation's now
                if st.want_ledger:
                    self._emit_ledger(op, slots, bound[0], private=True)  # the binding's (read-only)
            swa_grow = None
            if swa and swa_pool is not None:
                if tail is _ABSENT:
                    swa_grow, swa_ext, swa_n_new = grow, ext, n_new
                    peer = self._swa_peer(out)
                elif tail > 0:
                    swa_n_new = (tail + ps - 1) // ps
                    swa_grow = np.array([swa_n_new], np.int64)
                    swa_ext = np.array([tail], np.int64)  # bs == 1: the tail is the request's whole SWA share
                    peer = self._swa_peer(out[-tail:])
                if swa_grow is not None and slots is not None:
                    owned_swa = led.owned["swa"]
                    if bs == 1:
                        s0 = slots.item(0)
                        owned_swa[s0] = owned_swa.item(s0) + swa_grow.item(0)
                    else:
                        owned_swa[slots] += swa_grow
            if runs:
                # Immediate: called directly, no closure (this is every fresh request's extend).
                o = out.numpy()
                pos = own = None
                if not self._alloc_runs(o, slots, grow, ext, full.shadow, n_new):
                    pos, own = self._extend_layout(prefix, ext, n, bs, slots)
                    self._check_extend(o, pos, own, full, None, n_new, op, "full")
                if swa_grow is not None and not self._alloc_runs(
                    peer, slots, swa_grow, swa_ext, swa_pool.shadow, swa_n_new
                ):
                    if tail is _ABSENT:
                        if pos is None:
                            pos, own = self._extend_layout(prefix, ext, n, bs, slots)
                        swa_pos, swa_own = pos, own
                    else:
                        swa_pos = np.arange(tail, dtype=np.int64)  # the SWA side lays the tail out from position 0
                        swa_own = -1 if slots is None else slots.astype(np.int32).repeat(swa_ext)
                    self._check_extend(peer, swa_pos, swa_own, swa_pool, None, swa_n_new, op, "swa")
            else:
                pos, own = self._extend_layout(prefix, ext, n, bs, slots)
                new_mask = None if aligned else pos >= (ceil_prefix * ps).repeat(ext)
                if swa_grow is not None:
                    if tail is _ABSENT:
                        swa_pos, swa_new, swa_own = pos, new_mask, own
                    else:
                        swa_pos = np.arange(tail, dtype=np.int64)  # the SWA side lays the tail out from position 0
                        swa_new = None  # every tail slot opens its page
                        swa_own = own if slots is None else own[-tail:]
                swa_args = (swa_pos, swa_own, swa_pool, swa_new, swa_n_new) if swa_grow is not None else None
                if st.deferred:
                    full_args = (pos, own, full, new_mask, n_new)
                    self._extend_deferred(out, peer if swa_grow is not None else None, full_args, swa_args, op)
                else:
                    # Immediate (host tensors): at once, no closure.
                    self._check_extend(out.numpy(), pos, own, full, new_mask, n_new, op, "full")
                    if swa_args is not None:
                        self._check_extend(peer, *swa_args, op, "swa")
            if st.note_alloc:
                emit_alloc = self._emit_alloc
                emit_alloc(op, got, n_new, dt)
                if swa_grow is not None:
                    emit_alloc(op, int(peer.shape[0]), swa_n_new, 0.0, pool="swa")
            if st.events or st.to_raise or st.want_pages:
                self._finish()
            return out

    def _tail_evicted_check(self, op: str, seq_lens_cpu, tail: int, slots) -> None:
        """An SWA tail allocation (PD decode prealloc) leaves the request's first ``seq_len - swa_tail_len``
        positions without SWA KV: that evicted length must be a non-negative multiple of page_size (the seed's
        invariant I2; ``free_swa_segment`` relies on it). Judged from host values before the call, so raise mode
        refuses the allocation before anything is handed out, and before the engine's own check of the same rule
        after the call (SGLang's bare ``assert``)."""
        ps = self._w_ps
        seq = int(seq_lens_cpu[0])
        evicted = seq - int(tail)
        if evicted >= 0 and not evicted % ps:
            return
        slot = -1 if slots is None else slots.item(0)
        rid = None if slot < 0 else self._w_st.ledger.rid_of(slot)
        if slot >= 0:
            self._w_st.ledger.reported_evicted[slot] = evicted
        self._violate(
            "swa_evicted_seqlen_page_aligned",
            (f"request {rid!r}: " if rid is not None else "")
            + f"{op} with seq_len={seq}, swa_tail_len={tail} implies swa_evicted_seqlen={evicted}, not a "
            f"non-negative multiple of page_size={ps} (remainder {evicted % ps})",
            slot=slot,
            op=op,
            pool="swa",
        )
        if self._w_st.raising:
            self._finish()  # raises: nothing is allocated

    def _extend_deferred(self, out, peer, full_args: tuple, swa_args: tuple | None, op: str) -> None:
        """Queue an extend's per-slot checks for when the slots' copies land (deferred verification). A method of
        its own: the closure would otherwise make a cell of each variable it reads on every extend."""
        check = self._check_extend

        def verify(o, s=None):
            check(o, *full_args, op, "full")
            if s is not None:
                check(s, *swa_args, op, "swa")

        if peer is not None:
            self._slot_tier(verify, out, peer)
        else:
            self._slot_tier(verify, out)

    @staticmethod
    def _extend_layout(prefix: np.ndarray, ext: np.ndarray, n: int, bs: int, slots):
        """The position of every slot an extend returned, and its owner (the bound request's ledger slot as an int32
        owner code, or -1 unattributed): what the per-slot check reads."""
        if bs == 1:
            p0 = prefix.item(0)
            pos = np.arange(p0, p0 + n, dtype=np.int64)
        else:
            # ufunc methods and ndarray.repeat are C calls; np.cumsum and np.repeat wrap them in Python.
            first = _ADD.accumulate(ext) - ext
            pos = np.arange(n, dtype=np.int64) + (prefix - first).repeat(ext)
        # Owner codes in the shadow's dtype (int32): its write and read-back then need no cast.
        return pos, (-1 if slots is None else slots.astype(np.int32).repeat(ext))

    def _check_extend(self, o: np.ndarray, pos: np.ndarray, own, pool: _Pool, new, n_new: int, op: str, name: str):
        """One pool's per-slot check of an extend's slots ``o`` (positions ``pos``, owners ``own``; ``new``: the
        open-page mask, None when every slot opens a page), then its mirror in the shadow (``on_alloc``)."""
        ps, shift = self._w_ps, self._w_shift
        # Bit operations where the page size is a power of two (they floor negatives as % and // do).
        if shift is not None:
            misaligned, pages = np.count_nonzero((o - pos) & (ps - 1)), o >> shift
        else:
            misaligned, pages = np.count_nonzero((o - pos) % ps), o // ps
        if misaligned:
            self._misaligned(o, pos, own, op, name)
        bad = pool.shadow.on_alloc(pages, own, new, n_new, op, True, o)  # runs: page_size slots per page
        if bad:
            self._report(bad, name, op)

    def _alloc_runs(
        self, o: np.ndarray, slots, grow: np.ndarray, ext: np.ndarray, shadow: PoolShadow, n_new: int
    ) -> bool:
        """One pool's check of an all-new extend (immediate, power-of-two page size) whose slots ``o`` form runs of
        page_size consecutive positions, each run starting on a page boundary (the last run may be shorter), each
        run one request's (see ``_extend``), for the case where every check passes: each run lies in one page at
        its positions' offsets (the run's k-th slot is its page's k-th: ``o`` equals its pages' first slots plus
        0 .. page_size - 1, compared as bytes), each run's page was free, and no two runs share a page (one
        duplicate test on the runs' pages: two requests', or one request's twice). That is the per-slot check
        (``slot % ps == position % ps``, ``on_alloc`` with every slot new) on one slot per page. Then it applies
        what ``on_alloc`` applies (owners: request ``r``'s ledger slot on its ``grow[r]`` pages, the page delta
        ``on_alloc`` records for it when deltas are kept, one entry per page, the free count) and returns True;
        otherwise it returns False having changed nothing, and the per-slot check runs and reports. ``slots``: the
        bound requests' ledger slots (None: unattributed); ``ext``: each request's slots in ``o`` (not read since
        the page delta keeps one entry per page; kept for the callers)."""
        ps, shift = self._w_ps, self._w_shift
        n = o.size
        if not n or o.dtype is not _I64:
            return False
        pages = o[::ps] >> shift  # one per run (a negative slot floors to a negative page: reserved below)
        # Each run's expected slots: its page's first slot + the offsets. One bytes compare checks alignment and
        # that no run leaves its page.
        expected = (pages << shift)[:, None] + shadow.offsets
        if o.tobytes() != expected.tobytes()[: o.nbytes]:
            return False
        # A page outside the pool reads as reserved (the clipped gather, see PoolShadow): not free.
        prev = shadow._owner_ext.take(pages, mode="clip")
        if _MAX.reduce(prev) > FREE:
            return False
        # One page opened twice in this call (the inner listed it twice), for two requests or for one: declined,
        # the owners as they were; the per-slot check reports it (PoolShadow.shared_in_call, with one page per run
        # here). Found by writing each run's id at its page and reading them back (the later run's id wins): a
        # scatter and a gather, where a sort of the pages would cost several times more at a batch's size.
        if n_new > 1:
            if pages.size != n_new:
                return False
            ids = entry_ids(n_new)
            owner = shadow.owner
            owner[pages] = ids
            if owner[pages].tobytes() != ids.tobytes():
                owner[pages] = prev
                return False
        if slots is None:
            own = -1
        elif slots.size == 1:
            own = slots.item(0)  # one request owns every page
        else:
            own = slots.astype(np.int32).repeat(grow)  # the owner codes' dtype: no cast below, a private delta
        shadow.owner[pages] = own
        shadow.version += 1  # the owners changed (see PoolShadow.version: a decode run must not outlive this)
        if shadow.deltas is not None:
            # What on_alloc records for such a call (runs: one entry per page, see PoolShadow._note_alloc); pages:
            # a shift computed here, held by no one else.
            shadow.note(pages, own, private=True)
        shadow.expected_entries -= n_new
        return True
