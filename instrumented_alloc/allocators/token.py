"""Token allocator: page size 1, one slot at a time (SGLang's ``TokenToKVPoolAllocator``).

Contract:
- ``free_pages`` holds free slot ids (int64, on ``device``), initially ``1..size``; slot 0 is reserved.
- ``alloc(n)`` hands out the first ``n`` free slots in free-list order, or returns ``None`` (state untouched)
  when fewer are free.
- Freed slots go to the TAIL of the free list (the paged allocator uses the head), or, with ``need_sort``, to
  ``release_pages`` until an allocation that would run short merges and sorts them.
- No dedup on free: freeing a slot twice puts it in the free list twice. Catching that is the wrapper's job.
- No device value is read: ``len()`` of a tensor is metadata.
"""

from __future__ import annotations

import torch

from instrumented_alloc.allocators.base import BaseTokenToKVPoolAllocator
from instrumented_alloc.argcheck import check_index_tensor, check_int


class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    def __init__(self, size: int, dtype: torch.dtype, device, kvcache=None, need_sort: bool = False):
        super().__init__(size, 1, dtype, device, kvcache, need_sort)
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.free_group = None

    def available_size(self) -> int:
        return len(self.free_pages) + len(self.release_pages)

    def alloc(self, need_size: int):
        need_size = check_int("need_size", need_size)
        if self.need_sort and need_size > len(self.free_pages):
            self.merge_and_sort_free()
        if need_size > len(self.free_pages):
            return None
        out = self.free_pages[:need_size]
        self.free_pages = self.free_pages[need_size:]
        return out

    def free(self, free_index: torch.Tensor) -> None:
        check_index_tensor("free_index", free_index, self.device)
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._hold(free_index))
        elif self.need_sort:
            self.release_pages = torch.cat((self.release_pages, free_index))
        else:
            self.free_pages = torch.cat((self.free_pages, free_index))

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """At page size 1 a page id is a slot id."""
        check_index_tensor("page_ids", page_ids, self.device)
        self.free(page_ids)
