"""HiSparse allocator: a large logical slot space backed by a smaller device buffer (SGLang's
``HiSparseTokenToKVPoolAllocator``).

Contract:
- ``logical_attn_allocator``: a paged allocator of ``size * host_to_device_ratio`` slots; the slots it hands out
  are what the engine stores in its request rows and what every ``alloc_*`` returns.
- ``hisparse_attn_allocator``: a paged allocator of ``size`` slots, the device-resident buffer.
- ``full_to_hisparse_device_index_mapping`` (int64, on ``device``, logical size + page_size + 1 entries): logical
  slot -> device slot, 0 when the slot has no device copy, last entry -1 (so ``last_loc = -1`` maps to -1).
- ``alloc_logical_only`` reserves logical slots only (the PD decode side's prealloc without an SWA tail);
  ``alloc_extend`` reserves both and records the mapping; ``alloc_decode`` is logical only.
- ``free`` releases the logical pages and the device slots mapped from them, and clears the mapping. Frees are
  never grouped (``free_group_begin/end`` are no-ops) because the mapping must be cleared at once.
- ``alloc_device_buffer`` reads device values (SGLang does too); it is not on the decode hot path.
"""

from __future__ import annotations

import torch

from instrumented_alloc.allocators.base import BaseTokenToKVPoolAllocator, assert_not_over_credited
from instrumented_alloc.allocators.paged import PagedTokenToKVPoolAllocator, new_pages_extend
from instrumented_alloc.argcheck import ArgumentValueError, check_batch, check_index_tensor, check_int


class HiSparseTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device,
        kvcache=None,
        need_sort: bool = False,
        host_to_device_ratio: int = 2,
    ):
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        ratio = check_int("host_to_device_ratio", host_to_device_ratio, minimum=1)
        self._size_hisparse = self.size
        self._size_full = self.size * ratio
        self.size = self._size_full  # SGLang reports the logical size
        self.compress_ratio = 1
        self.logical_attn_allocator = PagedTokenToKVPoolAllocator(
            self._size_full, self.page_size, dtype, device, kvcache, need_sort
        )
        self.hisparse_attn_allocator = PagedTokenToKVPoolAllocator(
            self._size_hisparse, self.page_size, dtype, device, kvcache, need_sort
        )
        self.full_to_hisparse_device_index_mapping = torch.cat(
            [
                torch.zeros(self._size_full + self.page_size, dtype=torch.int64, device=self.device),
                torch.tensor([-1], dtype=torch.int64, device=self.device),
            ]
        )
        self.clear()
        register = getattr(kvcache, "register_mapping", None)
        if register is not None:
            register(self.full_to_hisparse_device_index_mapping)

    @property
    def size_full(self) -> int:
        return self._size_full

    def available_size(self) -> int:
        return min(self.logical_attn_allocator.available_size(), self.hisparse_attn_allocator.available_size())

    def _translate(self, logical: torch.Tensor) -> torch.Tensor:
        return self.full_to_hisparse_device_index_mapping[logical.to(torch.int64)]

    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        return last_locs

    def get_last_loc_hisparse_device(self, last_locs: torch.Tensor) -> torch.Tensor:
        return self._translate(last_locs)

    def alloc(self, need_size: int):
        need_size = check_int("need_size", need_size)
        if self.page_size != 1:
            raise NotImplementedError("HiSparseTokenToKVPoolAllocator.alloc: page_size > 1 uses alloc_extend")
        logical = self.logical_attn_allocator.alloc(need_size)
        if logical is None:
            return None
        device_slots = self.hisparse_attn_allocator.alloc(need_size)
        if device_slots is None:
            self.logical_attn_allocator.free(logical)
            return None
        self.full_to_hisparse_device_index_mapping[logical] = device_slots
        return logical

    def alloc_logical_only(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ):
        """Reserve logical slots only; the mapping of the new slots stays 0 (no device copy yet)."""
        return self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ):
        check_batch(
            self.device,
            prefix_lens=prefix_lens,
            prefix_lens_cpu=prefix_lens_cpu,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            last_loc=last_loc,
            extend_num_tokens=extend_num_tokens,
        )
        ps = self.page_size
        num_new_pages = new_pages_extend(prefix_lens_cpu, seq_lens_cpu, ps)
        if num_new_pages > self.logical_attn_allocator.available_size() // ps:
            return None
        if num_new_pages > self.hisparse_attn_allocator.available_size() // ps:
            return None
        logical = self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        device_slots = self.hisparse_attn_allocator.alloc_extend(
            prefix_lens,
            prefix_lens_cpu,
            seq_lens,
            seq_lens_cpu,
            self.get_last_loc_hisparse_device(last_loc),
            extend_num_tokens,
            num_new_pages,
        )
        self.full_to_hisparse_device_index_mapping[logical] = device_slots
        return logical

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor):
        return self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def alloc_device_buffer(self, allocated_indices: torch.Tensor, need_size: int) -> torch.Tensor:
        """Give ``allocated_indices`` a device buffer of ``need_size`` slots (a page multiple), reusing the
        device slots they already map to and unmapping them. Reads device values: never on the decode path."""
        check_index_tensor("allocated_indices", allocated_indices, self.device)
        need_size = check_int("need_size", need_size)
        ps = self.page_size
        if need_size % ps:
            raise ArgumentValueError("need_size", f"{need_size} is not a multiple of page_size {ps}")
        mapped = self._translate(allocated_indices)
        self.full_to_hisparse_device_index_mapping[allocated_indices.to(torch.int64)] = 0
        mapped = mapped[mapped > 0]
        if len(mapped) >= need_size:
            self.free_hisparse_indices(mapped[need_size:])
            return mapped[:need_size]
        short = len(mapped) % ps
        if short:
            # Claim the rest of the last partly used page before taking whole new pages.
            last = int(mapped[-1])
            mapped = torch.cat([mapped, torch.arange(last + 1, last + 1 + ps - short, device=self.device)])
        extra = self.hisparse_attn_allocator.alloc(need_size - len(mapped))
        if extra is None:
            raise RuntimeError(
                f"alloc_device_buffer: the device buffer has {self.hisparse_attn_allocator.available_size()} "
                f"free slots, {need_size - len(mapped)} needed"
            )
        return torch.cat([mapped, extra])

    def free_hisparse_indices(self, buffer_indices: torch.Tensor) -> None:
        # Page 0 is the padding sink, never owned by a request.
        self.hisparse_attn_allocator.free(buffer_indices[buffer_indices >= self.page_size])

    def free_hisparse(self, free_indices: torch.Tensor) -> None:
        device_slots = self._translate(free_indices)
        self.free_hisparse_indices(device_slots[device_slots > 0])
        self.full_to_hisparse_device_index_mapping[free_indices.to(torch.int64)] = 0

    def free(self, free_index: torch.Tensor) -> None:
        check_index_tensor("free_index", free_index, self.device)
        if free_index.numel() == 0:
            return
        self.logical_attn_allocator.free(free_index)
        self.free_hisparse(free_index)
        assert_not_over_credited(self.logical_attn_allocator, "free")  # SGLang's post-conditions
        assert_not_over_credited(self.hisparse_attn_allocator, "free")

    def free_group_begin(self) -> None:
        return

    def free_group_end(self) -> None:
        return

    def clear(self) -> None:
        self.logical_attn_allocator.clear()
        self.hisparse_attn_allocator.clear()
        self.full_to_hisparse_device_index_mapping[:-1].fill_(0)
        self.free_group = None
