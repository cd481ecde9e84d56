"""SWA hybrid allocator: a full pool and a sliding-window pool linked slot by slot (SGLang's
``SWATokenToKVPoolAllocator``).

Contract:
- Two inner allocators of the same page size: ``full_attn_allocator`` (``size`` slots) and
  ``swa_attn_allocator`` (``size_swa`` slots); token allocators at page size 1, paged ones above.
- ``full_to_swa_index_mapping`` (int64, on ``device``, ``size + page_size + 1`` entries) maps a full slot to its
  SWA peer; 0 means "no live SWA peer"; the last entry is -1 so that ``last_loc = -1`` (empty prefix) maps to -1.
- ``alloc_extend`` / ``alloc_decode`` allocate in both pools with the same lengths (the SWA side continues from
  the SWA peer of ``last_loc``), record the mapping, and return the FULL slots.
- ``alloc_extend_swa_tail`` (batch size 1, decode side of PD disaggregation): full slots for the whole extend,
  SWA slots only for the last ``swa_tail_len`` tokens; the mapping of the rest is cleared. The SWA tail starts
  at position ``seq - swa_tail_len``, which must be page-aligned for the SWA slots to keep the layout
  invariant: that is the seed's invariant I2, checked by the wrapper, not here.
- Frees: ``free`` = ``free_swa`` then ``free_full``. ``free_swa`` releases the SWA peers of every page touched
  and clears their mapping; ``free_swa_segment`` does the same for one request's row from a page-aligned start,
  one representative per page (no dedup, no sync). ``free_full`` expects the peers already released.
  Like SGLang with its invariant checks off, a peer that is unmapped (0) at ``free_swa`` or still mapped at
  ``free_full`` is not rejected here: the wrapper reports ``swa_mapping_inconsistent``.
- ``alloc_decode`` allocates in the full pool first; if the SWA pool then comes up short it returns ``None``
  without giving the full pages back (SGLang 0.5.23 behaves the same; the wrapper's conservation check sees it).
"""

from __future__ import annotations

import torch

from instrumented_alloc.allocators.base import BaseTokenToKVPoolAllocator, assert_not_over_credited
from instrumented_alloc.allocators.paged import PagedTokenToKVPoolAllocator, new_pages_extend
from instrumented_alloc.allocators.token import TokenToKVPoolAllocator
from instrumented_alloc.argcheck import (
    ArgumentValueError,
    check_batch,
    check_index_tensor,
    check_int,
)


class SWATokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        dtype: torch.dtype,
        device,
        kvcache=None,
        need_sort: bool = False,
        req_to_token_pool=None,
    ):
        self._size_swa = check_int("size_swa", size_swa)
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        self._req_to_token_pool = req_to_token_pool
        full_kv = getattr(kvcache, "full_kv_pool", None)
        swa_kv = getattr(kvcache, "swa_kv_pool", None)
        if self.page_size == 1:
            self.full_attn_allocator = TokenToKVPoolAllocator(self._size_full, dtype, device, full_kv, need_sort)
            self.swa_attn_allocator = TokenToKVPoolAllocator(self._size_swa, dtype, device, swa_kv, need_sort)
        else:
            self.full_attn_allocator = PagedTokenToKVPoolAllocator(
                self._size_full, page_size, dtype, device, full_kv, need_sort
            )
            self.swa_attn_allocator = PagedTokenToKVPoolAllocator(
                self._size_swa, page_size, dtype, device, swa_kv, need_sort
            )
        self.full_to_swa_index_mapping = torch.cat(
            [
                torch.zeros(self._size_full + self.page_size, dtype=torch.int64, device=self.device),
                torch.tensor([-1], dtype=torch.int64, device=self.device),
            ]
        )
        self.swa_free_group: list[torch.Tensor] = []
        self.swa_page_ids_group: list[torch.Tensor] = []
        self.clear()
        register = getattr(kvcache, "register_mapping", None)
        if register is not None:
            register(self.full_to_swa_index_mapping)

    # -- sizes -------------------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return min(self._size_full, self._size_swa)

    @size.setter
    def size(self, value: int) -> None:
        # Only the base constructor assigns it, before the pools exist.
        self._size_full = value

    @property
    def size_full(self) -> int:
        return self._size_full

    @property
    def size_swa(self) -> int:
        return self._size_swa

    def available_size(self) -> int:
        return min(self.full_attn_allocator.available_size(), self.swa_attn_allocator.available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        ps = self.page_size
        return (
            num_full_pages <= self.full_attn_allocator.available_size() // ps
            and num_swa_pages <= self.swa_attn_allocator.available_size() // ps
        )

    def debug_print(self) -> str:
        return (
            f"#swa-available-size: {self.swa_available_size()}, "
            f"#full-attn-available-size: {self.full_available_size()}, "
        )

    # -- mapping -----------------------------------------------------------------------------------------------
    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        check_index_tensor("kv_indices", kv_indices, self.device)
        return self.full_to_swa_index_mapping[kv_indices.to(torch.int64)]

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        if full_indices.numel() == 0:
            return
        self.full_to_swa_index_mapping[full_indices.to(torch.int64)] = swa_indices.to(torch.int64)

    def clear_full_to_swa_mapping(self, full_indices: torch.Tensor) -> None:
        if full_indices.numel() == 0:
            return
        # index_fill_ takes the 0 as a kernel argument; mapping[idx] = 0 would copy a host scalar and block.
        self.full_to_swa_index_mapping.index_fill_(0, full_indices.to(torch.int64), 0)

    def _expand_to_full_pages(self, indices: torch.Tensor) -> torch.Tensor:
        # Keeps duplicates: dedup would be a torch.unique, whose data-dependent shape synchronises.
        ps = self.page_size
        base = indices.to(torch.int64) // ps * ps
        return (base[:, None] + torch.arange(ps, dtype=torch.int64, device=indices.device)).reshape(-1)

    # -- allocation --------------------------------------------------------------------------------------------
    def alloc(self, need_size: int):
        """Page size 1 only: ``need_size`` slots in each pool."""
        need_size = check_int("need_size", need_size)
        if self.page_size != 1:
            raise NotImplementedError("SWATokenToKVPoolAllocator.alloc: page_size > 1 uses alloc_extend/alloc_decode")
        if need_size > self.full_attn_allocator.available_size():
            return None
        if need_size > self.swa_attn_allocator.available_size():
            return None
        full = self.full_attn_allocator.alloc(need_size)
        swa = self.swa_attn_allocator.alloc(need_size)
        self.set_full_to_swa_mapping(full, swa)
        return full

    def _require_paged(self, op: str) -> None:
        if self.page_size == 1:
            raise NotImplementedError(f"SWATokenToKVPoolAllocator.{op}: page size 1 uses alloc()")

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ):
        self._require_paged("alloc_extend")
        check_batch(
            self.device,
            prefix_lens=prefix_lens,
            prefix_lens_cpu=prefix_lens_cpu,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            last_loc=last_loc,
            extend_num_tokens=extend_num_tokens,
        )
        num_new_pages = new_pages_extend(prefix_lens_cpu, seq_lens_cpu, self.page_size)
        if not self.new_pages_available(num_new_pages, num_new_pages):
            return None
        swa_last_loc = self.full_to_swa_index_mapping[last_loc.to(torch.int64)]
        full = self.full_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages
        )
        swa = self.swa_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, swa_last_loc, extend_num_tokens, num_new_pages
        )
        self.set_full_to_swa_mapping(full, swa)
        return full

    def alloc_extend_swa_tail(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        swa_tail_len: int,
    ):
        self._require_paged("alloc_extend_swa_tail")
        bs = check_batch(
            self.device,
            prefix_lens=prefix_lens,
            prefix_lens_cpu=prefix_lens_cpu,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            last_loc=last_loc,
            extend_num_tokens=extend_num_tokens,
        )
        if bs != 1:
            raise ArgumentValueError("seq_lens", f"SWA tail allocation takes batch size 1, got {bs}")
        swa_tail_len = check_int("swa_tail_len", swa_tail_len)
        if swa_tail_len > extend_num_tokens:
            raise ArgumentValueError("swa_tail_len", f"{swa_tail_len} exceeds extend_num_tokens {extend_num_tokens}")
        ps = self.page_size
        num_full_pages = new_pages_extend(prefix_lens_cpu, seq_lens_cpu, ps)
        num_swa_pages = (swa_tail_len + ps - 1) // ps
        if not self.new_pages_available(num_full_pages, num_swa_pages):
            return None
        full = self.full_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_full_pages
        )
        if swa_tail_len == 0:
            return full
        zero = torch.zeros((1,), dtype=torch.int64)
        tail_cpu = torch.tensor([swa_tail_len], dtype=torch.int64)
        swa = self.swa_attn_allocator.alloc_extend(
            zero.to(self.device, non_blocking=True),
            zero,
            tail_cpu.to(self.device, non_blocking=True),
            tail_cpu,
            torch.full((1,), -1, dtype=torch.int64).to(self.device, non_blocking=True),
            swa_tail_len,
            num_swa_pages,
        )
        self.set_full_to_swa_mapping(full[-swa_tail_len:], swa)
        if swa_tail_len < extend_num_tokens:
            self.clear_full_to_swa_mapping(full[:-swa_tail_len])
        return full

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor):
        self._require_paged("alloc_decode")
        check_batch(self.device, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu, last_loc=last_loc)
        swa_last_loc = self.full_to_swa_index_mapping[last_loc.to(torch.int64)]
        full = self.full_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        swa = self.swa_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, swa_last_loc)
        if full is None or swa is None:
            return None
        self.full_to_swa_index_mapping[full] = swa
        return full

    # -- frees -------------------------------------------------------------------------------------------------
    def free(self, free_index: torch.Tensor) -> None:
        check_index_tensor("free_index", free_index, self.device)
        if free_index.numel() == 0:
            return
        # SWA side first: it reads the mapping that free_full expects cleared.
        self.free_swa(free_index)
        self.free_full(free_index)

    def free_swa(self, free_index: torch.Tensor) -> None:
        check_index_tensor("free_index", free_index, self.device)
        if free_index.numel() == 0:
            return
        if self.page_size == 1:
            self._free_swa_pages(free_index)
            return
        expanded = self._expand_to_full_pages(free_index)
        swa_indices = self.full_to_swa_index_mapping[expanded]
        self.clear_full_to_swa_mapping(expanded)
        if self.free_group is not None:
            # Resolved now: a later call in the group may map the same full slot to a new peer.
            self.swa_free_group.append(swa_indices)
            return
        self._release_swa(swa_indices)

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self._check_segment(free_index, start_pos)
        if free_index.numel() == 0:
            return
        self._free_swa_pages(free_index)

    def _free_swa_pages(self, free_index: torch.Tensor) -> None:
        ps = self.page_size
        reps = free_index[::ps].to(torch.int64)
        swa_tokens = self.full_to_swa_index_mapping[reps]
        if ps == 1:
            swa_pages, cleared = swa_tokens, reps
        else:
            # Both pools page in step, so the peer of a page's representative names the whole peer page.
            swa_pages, cleared = swa_tokens // ps, self._expand_to_full_pages(reps)
        self.clear_full_to_swa_mapping(cleared)
        if self.free_group is not None:
            self.swa_page_ids_group.append(swa_pages)
            return
        self.swa_attn_allocator.free_page_ids(swa_pages)
        assert_not_over_credited(self.swa_attn_allocator, "free_swa")

    def _release_swa(self, swa_indices: torch.Tensor) -> None:
        if self.page_size > 1:
            # The page expansion picked up unmapped slots (0): drop them.
            swa_indices = swa_indices[swa_indices > 0]
        self.swa_attn_allocator.free(swa_indices)
        assert_not_over_credited(self.swa_attn_allocator, "free_swa")

    def free_full(self, free_index: torch.Tensor) -> None:
        check_index_tensor("free_index", free_index, self.device)
        if free_index.numel() == 0:
            return
        self.full_attn_allocator.free(free_index)
        assert_not_over_credited(self.full_attn_allocator, "free_full")

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self._check_segment(free_index, start_pos)
        if free_index.numel() == 0:
            return
        self.free_swa_segment(free_index, start_pos=start_pos)
        self.full_attn_allocator.free_segment(free_index, start_pos=start_pos)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self._check_segment(free_index, start_pos)
        if free_index.numel() == 0:
            return
        self.full_attn_allocator.free_segment(free_index, start_pos=start_pos)

    def free_group_begin(self) -> None:
        super().free_group_begin()
        self.swa_free_group = []
        self.swa_page_ids_group = []
        self.full_attn_allocator.free_group_begin()

    def free_group_end(self) -> None:
        super().free_group_end()
        if self.swa_page_ids_group:
            held, self.swa_page_ids_group = self.swa_page_ids_group, []
            self.swa_attn_allocator.free_page_ids(torch.cat(held))
        if self.swa_free_group:
            held, self.swa_free_group = self.swa_free_group, []
            self._release_swa(torch.cat(held))
        self.full_attn_allocator.free_group_end()
        assert_not_over_credited(self.full_attn_allocator, "free_group_end")
        assert_not_over_credited(self.swa_attn_allocator, "free_group_end")

    def clear(self) -> None:
        self.swa_attn_allocator.clear()
        self.full_attn_allocator.clear()
        self.full_to_swa_index_mapping[:-1].fill_(0)
        self.free_group = None
        self.swa_free_group = []
        self.swa_page_ids_group = []
