"""What every reference allocator shares: construction, free groups, need_sort staging, segment frees.

Contract (SGLang 0.5.23's, stated in our words):
- Slot 0 (page 0) is the padding sink: it is never in a free list, never handed out, never freed.
- ``free_pages`` is a 1-D int64 tensor on ``device``: token ids for the token allocator, page ids for the paged
  one. Its order is the allocation order: the head is handed out first.
- Between ``free_group_begin()`` and ``free_group_end()`` frees are held (as copies, since the caller may reuse
  its tensor) and released together at the end. Groups do not nest.
- With ``need_sort`` (prefill/decode disaggregation) frees are staged instead of returned to the free list; an
  allocation that would run short first merges the staged ids into the free list and sorts it.
- Host-side counts come from tensor lengths (metadata) and ``*_cpu`` arguments only; the allocators read no
  device values on the host except where SGLang itself does (``torch.unique`` in a set-shaped ``free``).
- Malformed arguments raise ``TypeError``/``ValueError`` naming the argument before any state changes.
"""

from __future__ import annotations

import torch

from instrumented_alloc.argcheck import (
    ArgumentValueError,
    check_index_tensor,
    check_int,
    check_segments,
    check_start_pos,
)


class BaseTokenToKVPoolAllocator:
    """State and behaviour common to the token and paged allocators."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device, kvcache, need_sort: bool):
        self.size = check_int("size", size)
        self.page_size = check_int("page_size", page_size, minimum=1)
        self.dtype = dtype
        self.device = torch.device(device)
        self._kvcache = kvcache
        self.need_sort = bool(need_sort)
        self.free_pages: torch.Tensor | None = None
        self.release_pages: torch.Tensor | None = None
        # None: frees happen at once. A list: frees are held until free_group_end().
        self.free_group: list[torch.Tensor] | None = None

    @property
    def size_full(self) -> int:
        return self.size

    def get_kvcache(self):
        return self._kvcache

    def debug_print(self) -> str:
        return ""

    def available_size(self) -> int:
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def get_all_free_pages(self) -> torch.Tensor:
        if self.release_pages is None or len(self.release_pages) == 0:
            return self.free_pages
        return torch.cat((self.free_pages, self.release_pages))

    def merge_and_sort_free(self) -> None:
        if len(self.release_pages) > 0:
            self.free_pages, _ = torch.sort(torch.cat((self.free_pages, self.release_pages)))
            self.release_pages = self.release_pages[:0]

    def free_group_begin(self) -> None:
        if self.free_group is not None:
            raise RuntimeError("free_group_begin: free groups cannot be nested")
        self.free_group = []

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        if pending:
            self.free(torch.cat(pending))

    def alloc_extend(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}.alloc_extend: only the paged allocators extend by batch")

    def alloc_decode(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}.alloc_decode: only the paged allocators decode by batch")

    def free_full(self, free_index: torch.Tensor) -> None:
        """A single pool has no SWA peer: a plain ``free``."""
        self.free(free_index)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free positions ``start_pos .. start_pos + len(free_index) - 1`` of one request's KV row.

        ``start_pos`` must sit on a page boundary; the end may fall mid-page and its whole page is released.
        """
        self._check_segment(free_index, start_pos)
        self.free(free_index)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self._check_segment(free_index, start_pos)
        self.free_full(free_index)

    def free_segments(self, segments) -> None:
        """Free several ``(free_index, start_pos)`` segments of one request's row, in order. Consecutive
        segments must not share a page (each page is released once); empty segments are skipped. Malformed
        segments raise before anything is freed."""
        segments = check_segments("segments", segments, self.device)
        for free_index, start_pos in page_disjoint(segments, self.page_size):
            self.free_segment(free_index, start_pos=start_pos)

    def free_full_segments(self, segments) -> None:
        """``free_segments`` for the full side alone (see ``free_full``)."""
        segments = check_segments("segments", segments, self.device)
        for free_index, start_pos in page_disjoint(segments, self.page_size):
            self.free_full_segment(free_index, start_pos=start_pos)

    def _check_segment(self, free_index, start_pos) -> None:
        check_index_tensor("free_index", free_index, self.device)
        start_pos = check_start_pos(start_pos)
        if start_pos % self.page_size:
            raise ArgumentValueError(
                "start_pos", f"segment start {start_pos} is not a multiple of page_size {self.page_size}"
            )

    @staticmethod
    def _hold(free_index: torch.Tensor) -> torch.Tensor:
        # The caller may overwrite its tensor (a view of req_to_token) before the group ends.
        return free_index.clone()


def assert_not_over_credited(pool, op: str) -> None:
    """SGLang's own post-condition after a free: a pool can never list more free slots than it has (an over-free,
    a double free). Like SGLang's assert it fires after the state changed; the wrapper catches the fault before."""
    if pool.available_size() > pool.size:
        raise AssertionError(f"{op}: pool has {pool.available_size()} free slots but only {pool.size} slots")


def page_disjoint(segments, page_size: int):
    """Yield the non-empty segments, checking that each starts on a page after the previous one's last page.

    An overlap raises AssertionError (SGLang 0.5.23 asserts the same, lazily: earlier segments are already
    freed when a later one fails)."""
    prev_end = None
    for free_index, start_pos in segments:
        n = free_index.numel()
        if n == 0:
            continue
        if prev_end is not None and start_pos // page_size <= (prev_end - 1) // page_size:
            raise AssertionError(f"segment at {start_pos} shares a page with the one ending at {prev_end}")
        prev_end = start_pos + n
        yield free_index, start_pos
