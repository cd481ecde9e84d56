"""Reference KV-cache allocators with SGLang 0.5.23's constructors, methods and results.

They exist so that the wrapper, the demo engine and the tests have a real allocator to instrument without
installing SGLang; the differential tests hold them to SGLang's own classes slot for slot.
"""

from instrumented_alloc.allocators.base import BaseTokenToKVPoolAllocator
from instrumented_alloc.allocators.hisparse import HiSparseTokenToKVPoolAllocator
from instrumented_alloc.allocators.paged import PagedTokenToKVPoolAllocator
from instrumented_alloc.allocators.swa import SWATokenToKVPoolAllocator
from instrumented_alloc.allocators.token import TokenToKVPoolAllocator

__all__ = [
    "BaseTokenToKVPoolAllocator",
    "HiSparseTokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
]
