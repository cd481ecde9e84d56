"""Paged allocator: whole pages of ``page_size`` slots (SGLang's ``PagedTokenToKVPoolAllocator``).

Contract:
- ``free_pages`` holds free PAGE ids (int64, on ``device``), initially ``1..num_pages``; page 0 is reserved.
  Page ``p`` covers slots ``p*ps .. p*ps+ps-1``.
- Layout invariant of every slot handed out for a request: the slot of position ``i`` has
  ``slot % ps == i % ps``. ``alloc_extend`` fills, per request and in batch order, first the rest of the
  request's current partial page (continuing from ``last_loc + 1``), then whole new pages from the head of the
  free list, then a last partial page.
- Capacity is decided from ``*_cpu`` arguments and ``len(free_pages)`` before any state changes; on shortage the
  call returns ``None`` and the free list is as it was (apart from a need_sort merge, which SGLang also does
  first).
- Freed pages go to the HEAD of the free list (reused first). ``free`` dedups pages (``torch.unique``: sorted);
  ``free_segment`` and ``free_page_ids`` do not, and keep the caller's page order.
- No double-free detection (SGLang's only exists in its debug mode): the wrapper catches it.
"""

from __future__ import annotations

import torch

from instrumented_alloc.allocators.base import BaseTokenToKVPoolAllocator
from instrumented_alloc.argcheck import check_batch, check_index_tensor, check_int


def new_pages_extend(prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, page_size: int) -> int:
    """Pages an extend batch takes from the free list: sum of ceil(seq/ps) - ceil(prefix/ps). CPU only."""
    ps = page_size
    return int(((seq_lens_cpu + ps - 1) // ps - (prefix_lens_cpu + ps - 1) // ps).sum())


def new_pages_decode(seq_lens_cpu: torch.Tensor, page_size: int) -> int:
    """Pages a decode batch takes: requests whose new position opens a page. CPU only.

    Counted as ``seq_len % ps == 1`` (SGLang's rule), which is never true at page size 1: a paged allocator
    with page size 1 decodes in place (``last_loc + 1``); engines use the token allocator there.
    """
    return int((seq_lens_cpu % page_size == 1).sum())


def extend_slots(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    num_tokens: int,
) -> torch.Tensor:
    """The slots of positions ``prefix..seq-1`` of every request, concatenated. Device ops only, no sync.

    Request r takes new pages ``free_pages[base_r : base_r + k_r]`` where ``k_r`` is its page growth and
    ``base_r`` the growth of the requests before it.
    """
    ps = page_size
    device = free_pages.device
    prefix = prefix_lens.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    ext = seq - prefix
    ends = torch.cumsum(ext, 0)
    j = torch.arange(num_tokens, dtype=torch.int64, device=device)
    owner = torch.searchsorted(ends, j, right=True)
    pos = j - (ends - ext)[owner] + prefix[owner]
    cont = last_loc.to(torch.int64)[owner] + 1 + (pos - prefix[owner])
    if free_pages.numel() == 0:
        # Only reachable when no request opens a page (capacity was checked by the caller).
        return cont
    ceil_prefix = (prefix + ps - 1) // ps * ps
    grow = (seq + ps - 1) // ps - ceil_prefix // ps
    base = torch.cumsum(grow, 0) - grow
    in_partial = pos < ceil_prefix[owner]
    # Positions in the partial page give a negative rank: clamp so the gather stays in range; where() drops them.
    rank = (base[owner] + (pos - ceil_prefix[owner]) // ps).clamp_(0, free_pages.numel() - 1)
    fresh = free_pages[rank] * ps + pos % ps
    return torch.where(in_partial, cont, fresh)


def decode_slots(
    seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor, page_size: int, num_new_pages: int
) -> torch.Tensor:
    """The slot of position ``seq_len - 1`` of every request. Device ops only, no sync."""
    cont = last_loc.to(torch.int64) + 1
    if num_new_pages == 0:
        return cont
    opens = ((seq_lens.to(torch.int64) - 1) % page_size == 0).to(torch.int64)
    rank = (torch.cumsum(opens, 0) - opens).clamp_(max=num_new_pages - 1)
    return torch.where(opens.bool(), free_pages[rank] * page_size, cont)


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device, kvcache=None, need_sort: bool = False):
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        self.num_pages = self.size // self.page_size
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.free_group = None
        self.free_page_ids_group: list[torch.Tensor] = []
        # need_sort only: freed page ids wait here, unsorted, until an allocation runs short.
        self.staged_pages: list[torch.Tensor] = []
        self.num_staged_pages = 0

    def available_size(self) -> int:
        return (len(self.free_pages) + self.num_staged_pages) * self.page_size

    def get_all_free_pages(self) -> torch.Tensor:
        return torch.cat((self.free_pages, *self.staged_pages))

    def merge_and_sort_free(self) -> None:
        if not self.staged_pages:
            return
        self.free_pages, _ = torch.sort(self.get_all_free_pages())
        self.staged_pages = []
        self.num_staged_pages = 0

    def _take(self, n: int) -> torch.Tensor:
        pages = self.free_pages[:n]
        self.free_pages = self.free_pages[n:]
        return pages

    def alloc(self, need_size: int):
        """Whole pages: ``need_size // page_size`` of them (an unaligned size is truncated, as in SGLang)."""
        need_size = check_int("need_size", need_size)
        num_pages = need_size // self.page_size
        if num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
            return None
        pages = self._take(num_pages)
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ):
        bs = check_batch(
            self.device,
            prefix_lens=prefix_lens,
            prefix_lens_cpu=prefix_lens_cpu,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            last_loc=last_loc,
            extend_num_tokens=extend_num_tokens,
        )
        if num_new_pages is None:
            num_new_pages = new_pages_extend(prefix_lens_cpu, seq_lens_cpu, self.page_size)
        else:
            num_new_pages = check_int("num_new_pages", num_new_pages)
        # SGLang merges staged pages when a cheap upper bound on the demand exceeds the free list; the
        # merge decides the free-list order, so the same bound is used here.
        if extend_num_tokens // self.page_size + bs + 1 > len(self.free_pages):
            self.merge_and_sort_free()
            if num_new_pages > len(self.free_pages):
                return None
        out = extend_slots(prefix_lens, seq_lens, last_loc, self.free_pages, self.page_size, extend_num_tokens)
        self.free_pages = self.free_pages[num_new_pages:]
        return out

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor):
        bs = check_batch(self.device, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu, last_loc=last_loc)
        if bs > len(self.free_pages):
            self.merge_and_sort_free()
        num_new_pages = new_pages_decode(seq_lens_cpu, self.page_size)
        if num_new_pages > len(self.free_pages):
            return None
        out = decode_slots(seq_lens, last_loc, self.free_pages, self.page_size, num_new_pages)
        self.free_pages = self.free_pages[num_new_pages:]
        return out

    def free(self, free_index: torch.Tensor) -> None:
        """Free every page any index touches, once each (``torch.unique``, which syncs on an accelerator)."""
        check_index_tensor("free_index", free_index, self.device)
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._hold(free_index))
            return
        self._release(torch.unique(free_index.to(torch.int64) // self.page_size))

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free one request's row from page-aligned ``start_pos``: one representative per page, no dedup, no sync."""
        self._check_segment(free_index, start_pos)
        if free_index.numel() == 0:
            return
        self.free_page_ids(free_index[:: self.page_size].to(torch.int64) // self.page_size)

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages, in this order; no dedup."""
        check_index_tensor("page_ids", page_ids, self.device)
        if page_ids.numel() == 0:
            return
        if self.free_group is not None:
            self.free_page_ids_group.append(self._hold(page_ids))
            return
        self._release(page_ids.to(torch.int64))

    def _release(self, page_ids: torch.Tensor) -> None:
        if self.need_sort:
            self.staged_pages.append(page_ids)
            self.num_staged_pages += page_ids.numel()
        else:
            self.free_pages = torch.cat((page_ids, self.free_pages))

    def free_group_begin(self) -> None:
        super().free_group_begin()
        self.free_page_ids_group = []

    def free_group_end(self) -> None:
        # Set-shaped frees first, then page-id frees, so the latter end up at the very head (SGLang's order).
        super().free_group_end()
        if self.free_page_ids_group:
            held, self.free_page_ids_group = self.free_page_ids_group, []
            self._release(torch.cat(held))
