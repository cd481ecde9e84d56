"""What each free op releases, per pool: its "parts".

Contract (``_FreeParts``, a mixin of ``InstrumentedAllocator``): a part is ``(pool, fn, tensors)``; ``fn`` maps
host views of ``tensors`` to ``(pages, dedup, unmapped)`` for that pool, or (``pool`` None) only checks (an SWA
peer that must or must not be mapped). Reads the inner's SWA mapping and the shadows; writes nothing but the
violations it reports."""

from __future__ import annotations

import numpy as np
import torch

from instrumented_alloc.argcheck import (
    check_index_tensor,
    check_int,
)
from instrumented_alloc.wrapper.state import _Pool


class _FreeParts:
    """Free parts (see the module docstring)."""

    def _free_parts(self, free_index, op):
        st = self._w_st
        if st.swa is not None:
            return self._swa_set_part(free_index) + self._full_set_part(free_index)
        if st.swa_frees == "pool":
            return self._one_pool_part(free_index, op)
        return self._full_set_part(free_index)

    def _free_full_parts(self, free_index, op):
        if self._w_st.swa_frees == "pool":
            return None  # one pool for both sides: its SWA frees released it, free_full is a no-op
        parts = self._full_set_part(free_index)
        return parts if self._w_st.swa is None else [self._peer_released_check(free_index, op), *parts]

    def _page_ids_parts(self, page_ids, op):
        return [(self._w_st.full, lambda p: (p, False, None), (page_ids,))]

    def _segment_parts(self, free_index, op):
        if self._w_st.swa_frees == "pool":
            return self._one_pool_part(free_index, op)
        parts = [self._full_segment_part(free_index)]
        return parts if self._w_st.swa is None else [self._swa_segment_part(free_index, op), *parts]

    def _full_segment_parts(self, free_index, op):
        if self._w_st.swa_frees == "pool":
            return None  # see _free_full_parts
        if self._w_st.swa is None and self._w_st.swa_frees != "none":
            # A single pool's free_full_segment is a set-shaped free (base class: free_full -> free).
            return self._full_set_part(free_index)
        # The two-pool SWA allocator and a per-request SWA ring (its mapping is never written, so no peer to
        # check) free the segment through the full allocator's free_segment: one page per page_size slots, by
        # id, no dedup (a page named twice is listed twice).
        part = self._full_segment_part(free_index)
        return [part] if self._w_st.swa is None else [self._peer_released_check(free_index, op), part]

    def _swa_parts(self, free_index, op):
        if self._w_st.swa is None:
            return self._one_pool_swa_free(free_index, op)
        return [*self._swa_set_part(free_index), self._full_range_check(free_index, op)]

    def _full_range_check(self, free_index, op):
        """``free_swa`` names full-pool slots only to look up their SWA peers: a slot outside the full pool reads
        as no peer there (the clipped lookup), while the inner indexes its mapping with it (a negative slot wraps
        around to a live request's peer). Reported as ``free_unallocated`` (raise mode refuses host indices
        before the call, as for any free)."""
        full = self._w_st.full.shadow
        ps = self._w_ps

        def check(idx):
            pages = idx // ps  # floor: a negative slot's page is negative
            oob = pages[(pages < 0) | (pages > full.num_pages)]
            if oob.size:
                self._violate(
                    "free_unallocated",
                    f"{op} frees slots outside the full pool (valid pages 1..{full.num_pages}): "
                    f"{idx[(pages < 0) | (pages > full.num_pages)][:8].tolist()} ({oob.size} slots)",
                    op=op,
                    pool="full",
                )

        return (None, check, (free_index,))

    def _swa_segment_parts(self, free_index, op):
        if self._w_st.swa is None:
            return self._one_pool_swa_free(free_index, op)
        return [self._swa_segment_part(free_index, op)]

    def _one_pool_swa_free(self, free_index, op):
        """An SWA free on an allocator with no SWA pool of its own: SGLang's all-SWA allocator releases its one
        pool (``_one_pool_part``); a per-request SWA ring, or an allocator with no SWA side, frees nothing
        (None: forwarded unchecked)."""
        return self._one_pool_part(free_index, op) if self._w_st.swa_frees == "pool" else None

    def _one_pool_part(self, free_index, op) -> list:
        """A free of SGLang's all-SWA allocator (``free``, ``free_segment``, ``free_swa``, ``free_swa_segment``):
        it releases ``free_index[free_index > 0]`` into its one token pool (set-shaped, no dedup at page size 1),
        at once or at the end of its free group. The entries it drops (slot 0, negative slots) are misuse,
        reported here (``reserved_page_touched``, ``free_unallocated``; raise mode refuses host indices before
        the call), and neither judged again nor counted as freed: the inner lists none of them."""
        pool = self._w_st.full
        num_pages = pool.shadow.num_pages

        def fn(idx):
            keep = idx > 0
            if keep.all():
                return idx, False, None
            dropped = idx[~keep]
            if (dropped == 0).any():
                self._violate("reserved_page_touched", f"{op} frees reserved slot 0", op=op, pool=pool.name)
            neg = dropped[dropped < 0]
            if neg.size:
                self._violate(
                    "free_unallocated",
                    f"{op} frees slots outside the pool (valid 1..{num_pages}): {neg[:8].tolist()} "
                    f"({neg.size} slots; the allocator drops them)",
                    op=op,
                    pool=pool.name,
                )
            return idx[keep], False, None

        return [(pool, fn, (free_index,))]

    # -- free parts: (pool, fn(arrays) -> (pages, dedup, unmapped_mask), tensors) ---------------------------------
    # Page ids from slots: a shift when the page size is a power of two (it floors negatives as // does, and
    # costs less than a division).
    def _full_set_part(self, free_index) -> list:
        return [self._set_part(self._w_st.full, free_index)]

    def _full_segment_part(self, free_index):
        return self._segment_part(self._w_st.full, free_index)

    def _set_part(self, pool: _Pool, free_index):
        """The part of a set-shaped free of ``pool`` by its own slots (every distinct page touched)."""
        ps, shift = self._w_ps, self._w_shift
        if pool.dedup_free:
            if shift is not None:
                return (pool, lambda idx: (idx >> shift, True, None), (free_index,))
            return (pool, lambda idx: (idx // ps, True, None), (free_index,))
        return (pool, lambda idx: (idx, False, None), (free_index,))

    def _segment_part(self, pool: _Pool, free_index):
        """The part of a row-segment free of ``pool`` by its own slots (one page per ``page_size`` slots)."""
        ps, shift = self._w_ps, self._w_shift
        if pool.dedup_free:
            if shift is not None:
                return (pool, lambda idx: (idx[::ps] >> shift, False, None), (free_index,))
            return (pool, lambda idx: (idx[::ps] // ps, False, None), (free_index,))
        return (pool, lambda idx: (idx, False, None), (free_index,))

    def _peers_at(self, full_slots):
        """SWA peers of freed full slots, read before the inner clears them. Slot values outside the mapping (a
        free_unallocated fault the full part reports) read as no live peer (0 or the -1 sentinel) instead of
        failing the lookup. No sync: immediate mode (host tensors only) gathers from a numpy view of the
        mapping (``take(mode="clip")`` is the clamp), deferred mode with device ops. ``full_slots`` is a
        tensor, or in immediate mode its numpy view."""
        mapping = self._w_inner.full_to_swa_index_mapping
        if not self._w_deferred:
            idx = full_slots if type(full_slots) is np.ndarray else full_slots.numpy()
            return mapping.numpy().take(idx, mode="clip")
        return mapping[full_slots.to(torch.int64).clamp(0, mapping.shape[0] - 1)]

    def _swa_set_part(self, free_index) -> list:
        swa = self._w_st.swa
        ps = self._w_ps
        if not self._w_deferred:
            idx = free_index.numpy().astype(np.int64, copy=False)
            if ps > 1:
                idx = ((idx // ps * ps)[:, None] + np.arange(ps, dtype=np.int64)).reshape(-1)
        else:
            idx = free_index.to(torch.int64)
            if ps > 1:
                idx = ((idx // ps * ps)[:, None] + torch.arange(ps, dtype=torch.int64, device=idx.device)).reshape(-1)
        peers = self._peers_at(idx)
        if ps == 1:
            return [(swa, lambda p: self._peers_mapped(p, "free_swa"), (peers,))]
        return [(swa, lambda p: (p[p > 0] // ps, True, None), (peers,))]

    def _swa_segment_part(self, free_index, op):
        swa = self._w_st.swa
        ps = self._w_ps
        reps = free_index.numpy()[::ps] if not self._w_deferred else free_index[::ps]
        peers = self._peers_at(reps)
        return (swa, lambda p: self._peers_mapped(p, op), (peers,))

    def _peers_mapped(self, peers: np.ndarray, op: str):
        """SWA peers of page representatives must be mapped (> 0) when their SWA KV is freed."""
        ps = self._w_ps
        unmapped = peers <= 0
        if np.count_nonzero(unmapped):
            self._violate(
                "swa_mapping_inconsistent",
                f"{op}: {int(np.count_nonzero(unmapped))} of {peers.size} full pages have no live SWA peer "
                "(already evicted or never mapped); the SWA allocator will release page 0 for them",
                op=op,
                pool="swa",
            )
            return peers // ps, False, unmapped
        shift = self._w_shift
        return (peers >> shift if shift is not None else peers // ps), False, None

    def _peer_released_check(self, free_index, op):
        peers = self._peers_at(free_index)
        full = self._w_st.full.shadow
        ps = self._w_ps

        def check(p, idx):
            still = p > 0
            if np.count_nonzero(still):
                pages = idx[still] // ps
                owners = full.owner[pages[(pages >= 0) & (pages < full.owner.size)]]
                slot = int(owners[owners >= 0][0]) if (owners >= 0).any() else -1
                self._violate(
                    "swa_mapping_inconsistent",
                    f"{op}: {int(np.count_nonzero(still))} of {p.size} slots still map to a live SWA peer; free_swa "
                    "must come first (their SWA pages are stranded)",
                    slot=slot,
                    op=op,
                    pool="swa",
                )

        return (None, check, (peers, free_index))

    def _segment_args(self, op, free_index, start_pos, pool: str = "full") -> None:
        self._validate(op, check_index_tensor, "free_index", free_index, self._w_device)
        start = self._validate(op, check_int, "start_pos", start_pos)
        if start % self._w_ps:
            self._violate(
                "segment_start_unaligned",
                f"{op}: start_pos={start} is not a multiple of page_size={self._w_ps}",
                slot=self._segment_owner(free_index, pool),
                op=op,
                pool=pool,
            )
            self._finish()

    def _segment_owner(self, free_index, pool: str = "full") -> int:
        """The ledger slot owning the segment's first page, to name the request; -1 when unknown. Reads an index
        value, so only under immediate verification: on an accelerator that would be a sync, and the request stays
        unnamed; ``verify="deferred"`` on the host does as it does there (its shadow is a step behind, too)."""
        if self._w_st.deferred or free_index.device.type != "cpu" or free_index.numel() == 0:
            return -1
        page = int(free_index[0]) // self._w_ps
        owner = self._w_st.pools[pool].shadow.owner
        return int(owner[page]) if 0 <= page < owner.size else -1
