"""Harness that builds SGLang's *real* KV-slot allocators on a CPU-only machine.

This is a helper module for tests (not a test file itself).  It exposes:

* ``sglang_available(require_swa=True) -> (ok, reason)``
* ``make_sglang_token(size, need_sort=False)`` -> ``TokenToKVPoolAllocator``
* ``make_sglang_paged(size, page_size, need_sort=False)``
  -> ``PagedTokenToKVPoolAllocator``
* ``make_sglang_swa(size, size_swa, page_size, need_sort=False)``
  -> ``SWATokenToKVPoolAllocator``

All allocators are built on ``device="cpu"``.  Index tensors they hand out and
keep (``free_pages``, ``alloc*`` results, ``full_to_swa_index_mapping``) are
``torch.int64``.  The ``dtype`` constructor argument of SGLang's allocators is
the *KV cache* dtype (``ModelRunner.kv_cache_dtype``), which the allocators only
store and never use; we pass ``torch.bfloat16`` (SGLang's usual "auto" KV dtype
for bf16 models) unless told otherwise.

SGLang is imported lazily, inside the functions, so importing this module never
fails even when SGLang (or one of its dependencies) is missing.  Install with::

    pip install -c requirements/constraints.txt -e '.[test,sglang-compat]'
    pip install --no-deps sglang==0.5.23

(``--no-deps`` because SGLang's declared dependencies pin a CUDA torch and a
long list of serving packages that the allocators do not need.)

Why each stub / tweak exists
----------------------------

``torchvision`` stub
    ``sglang.srt.mem_cache.allocator.swa`` imports ``base_swa_memory_pool`` ->
    ``memory_pool`` -> ``sglang.srt.configs`` (every model config), and some of
    those (``internvl_utils``, ``nano_nemotron_vl``, ``deepseek_ocr`` ...) do
    ``import torchvision.transforms as T`` at module level.  The allocators never
    touch torchvision, and PyPI's torchvision wheels are built against a
    specific (CUDA) torch and do not load next to the CPU ``torch==2.13.0``.  So
    if the real ``import torchvision`` fails, a meta-path finder is installed
    that answers every ``torchvision`` / ``torchvision.*`` import with an empty
    package whose attributes are inert placeholders (callable, subclassable,
    attribute-chainable).  Side effect: ``importlib.util.find_spec("torchvision")``
    now finds the stub, so e.g. ``transformers.is_torchvision_available()`` may
    say True in the same process.  Token/Paged allocators alone do not need it.

Dummy ``kvcache`` (Token / Paged)
    The allocators only keep a reference to the KV pool (``get_kvcache()``,
    ``get_cpu_copy``/``load_cpu_copy`` forward to it).  Building a real
    ``MHATokenToKVPool`` would allocate buffers and pull in device code, so a
    plain placeholder object is passed.

``_CompatSWAKVPool`` (SWA)
    ``SWATokenToKVPoolAllocator.__init__`` asserts
    ``isinstance(kvcache, BaseSWAKVPool)``, reads ``kvcache.swa_req_ring_size``
    (``None`` = ordinary paged SWA pool, not the per-request ring), calls
    ``kvcache.register_mapping(full_to_swa_index_mapping)``, and its
    ``translate_loc_from_full_to_swa`` asserts
    ``kvcache.full_to_swa_index_mapping is not None`` and forwards to
    ``kvcache.translate_loc_from_full_to_swa(idx)`` (== ``mapping[idx]``, which
    is what ``SWAKVPool`` does).  ``BaseSWAKVPool``/``KVCache`` also declare as
    abstract ``__init__``, ``get_key_buffer``, ``get_value_buffer``,
    ``get_kv_buffer``, ``set_kv_buffer`` and ``get_state_buf_infos``; those are
    implemented minimally (buffer accessors raise, there are no buffers).
    ``KVCache.__init__`` is deliberately not called: it would set up memory
    saver / custom memory pool machinery that is irrelevant here.
    ``full_kv_pool`` / ``swa_kv_pool`` are ``None`` (only stored by the
    sub-allocators).

Environment
    ``SGLANG_DEBUG_MEMORY_POOL`` is read once, in ``PagedTokenToKVPoolAllocator.
    __init__``; when truthy it adds assertions (page-aligned ``alloc``, unique
    outputs, no duplicate free pages).  The factories unset it *while
    constructing* (restoring it afterwards) so tests see SGLang's default,
    production behaviour regardless of the caller's environment; pass
    ``debug_memory_pool=True`` to opt in.  ``SGLANG_INVARIANT_CHECK`` /
    ``SGLANG_ENABLE_ASYNC_ASSERT`` (read on SWA frees via ``expect``) are left alone;
    unset they default to OFF.

Warnings
    Importing the SWA module imports much of SGLang, which emits
    ``UserWarning``s ("Only CUDA, HIP and XPU support AWQ currently.", "Only
    CUDA, MUSA and NPU support GGUF quantization currently.") and
    ``DeprecationWarning``s (14x torch's ``torch.jit.script_method``, and
    sentencepiece's SWIG types "has no __module__ attribute"; one of those,
    ``swigvarlink``, is printed at interpreter exit and cannot be caught here).
    Token/Paged alone import silently.  The import runs under
    ``warnings.catch_warnings()`` with those ignored so that a project running
    pytest with ``-W error`` / ``filterwarnings = error`` can still import it.

Platform path
    On a machine without CUDA/ROCm, ``current_platform.capabilities.
    supports_triton`` is False, so ``PagedTokenToKVPoolAllocator`` uses the
    pure-torch ``alloc_extend_naive`` / ``alloc_decode_naive`` instead of the
    Triton kernels (triton is still imported, for the ``@triton.jit``
    definitions, but no kernel is launched).  ``SWATokenToKVPoolAllocator``
    likewise takes the non-CUDA ``_free_swa_pages_none_cuda`` path.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

SGLANG_VERSION = "0.5.23"
DEVICE = "cpu"

_DEBUG_ENV = "SGLANG_DEBUG_MEMORY_POOL"

# True once the torchvision stub finder has been installed in this process.
torchvision_stubbed = False


# --------------------------------------------------------------------------
# torchvision stub
# --------------------------------------------------------------------------


class _Placeholder:
    """Inert stand-in for any torchvision object used at SGLang import time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Placeholder:
        return _Placeholder()

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __mro_entries__(self, bases: tuple) -> tuple:
        # ``class Foo(torchvision.something.Bar)`` -> plain object subclass.
        return (object,)

    def __or__(self, other: Any) -> Any:
        return Any

    __ror__ = __or__

    def __repr__(self) -> str:
        return "<torchvision stub placeholder>"


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _TorchvisionStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``torchvision`` and every ``torchvision.*`` import with a stub."""

    _ROOT = "torchvision"

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self._ROOT or fullname.startswith(self._ROOT + "."):
            return importlib.machinery.ModuleSpec(
                fullname, self, origin="sglang_compat-torchvision-stub", is_package=True
            )
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []  # a package, so submodule imports resolve here too
        module.__version__ = "0.0.0+sglang_compat_stub"
        return module

    def exec_module(self, module) -> None:
        pass


def _ensure_torchvision() -> None:
    """Use the real torchvision if it imports; otherwise install the stub."""
    global torchvision_stubbed
    if torchvision_stubbed:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("torchvision")
        return
    except Exception:  # ImportError, or RuntimeError from an ABI-mismatched wheel
        pass
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _TorchvisionStubFinder())
    torchvision_stubbed = True


# --------------------------------------------------------------------------
# lazy SGLang import
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


@functools.cache
def _import_base() -> types.SimpleNamespace:
    from importlib.metadata import version

    installed = version("sglang")
    if installed != SGLANG_VERSION:
        raise ImportError(
            f"sglang {installed} is installed but this harness is pinned to "
            f"{SGLANG_VERSION} (expected values in tests were taken from it)"
        )
    with _quiet_import():
        import torch
        from sglang.srt.mem_cache.allocator import (
            PagedTokenToKVPoolAllocator,
            TokenToKVPoolAllocator,
        )
    return types.SimpleNamespace(
        torch=torch,
        TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
    )


@functools.cache
def _import_swa() -> types.SimpleNamespace:
    _import_base()
    _ensure_torchvision()
    with _quiet_import():
        from sglang.srt.mem_cache.allocator.swa import PureSWATokenToKVPoolAllocator, SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

    class _CompatSWAKVPool(BaseSWAKVPool):
        """Bufferless BaseSWAKVPool: just the full->SWA index mapping."""

        swa_req_ring_size = None  # paged SWA pool, not a per-request ring
        full_kv_pool = None
        swa_kv_pool = None

        def __init__(self, size: int, size_swa: int, page_size: int, dtype) -> None:
            # KVCache.__init__ intentionally not called (see module docstring).
            self.size = size
            self.size_swa = size_swa
            self.page_size = page_size
            self.dtype = dtype
            self.store_dtype = dtype
            self.device = DEVICE
            self.layer_num = 0
            self.full_to_swa_index_mapping = None

        def register_mapping(self, full_to_swa_index_mapping):
            self.full_to_swa_index_mapping = full_to_swa_index_mapping

        def translate_loc_from_full_to_swa(self, kv_indices):
            assert self.full_to_swa_index_mapping is not None
            return self.full_to_swa_index_mapping[kv_indices]

        def get_state_buf_infos(self):
            return [], [], []

        def _no_buffers(self, *args, **kwargs):
            raise NotImplementedError("sglang_compat SWA pool stub has no KV buffers")

        get_key_buffer = _no_buffers
        get_value_buffer = _no_buffers
        get_kv_buffer = _no_buffers
        set_kv_buffer = _no_buffers

    return types.SimpleNamespace(
        SWATokenToKVPoolAllocator=SWATokenToKVPoolAllocator,
        PureSWATokenToKVPoolAllocator=PureSWATokenToKVPoolAllocator,
        BaseSWAKVPool=BaseSWAKVPool,
        CompatSWAKVPool=_CompatSWAKVPool,
    )


def sglang_available(require_swa: bool = True) -> tuple[bool, str]:
    """Whether SGLang's allocators can be imported here, and why not.

    ``require_swa=False`` checks only Token/Paged (which need far fewer
    dependencies than the SWA allocator).
    """
    try:
        _import_swa() if require_swa else _import_base()
    except Exception as exc:
        return False, f"SGLang {SGLANG_VERSION} allocators not importable: {type(exc).__name__}: {exc}"
    return True, ""


def require_sglang(require_swa: bool = True) -> None:
    """In a test: stop it (skip, or fail under CI) when SGLang's allocators cannot be used here."""
    ok, reason = sglang_available(require_swa=require_swa)
    if not ok:
        from tests.ci import missing

        missing(reason)


# --------------------------------------------------------------------------
# factories
# --------------------------------------------------------------------------


class _PlaceholderKVCache:
    """Stands in for a KVCache; Token/Paged allocators only store it."""

    full_kv_pool = None
    swa_kv_pool = None

    def __repr__(self) -> str:
        return "<sglang_compat placeholder kvcache>"


@contextlib.contextmanager
def _memory_pool_debug(enabled: bool) -> Iterator[None]:
    old = os.environ.pop(_DEBUG_ENV, None)
    if enabled:
        os.environ[_DEBUG_ENV] = "true"
    try:
        yield
    finally:
        os.environ.pop(_DEBUG_ENV, None)
        if old is not None:
            os.environ[_DEBUG_ENV] = old


def _default_dtype(dtype):
    return _import_base().torch.bfloat16 if dtype is None else dtype


def make_sglang_token(size: int, need_sort: bool = False, *, dtype=None):
    """SGLang ``TokenToKVPoolAllocator`` (page size 1) with ``size`` slots.

    Slots are ``1..size``; slot 0 is SGLang's padding slot and never handed out.
    """
    m = _import_base()
    return m.TokenToKVPoolAllocator(size, _default_dtype(dtype), DEVICE, _PlaceholderKVCache(), need_sort)


def make_sglang_paged(
    size: int,
    page_size: int,
    need_sort: bool = False,
    *,
    dtype=None,
    debug_memory_pool: bool = False,
):
    """SGLang ``PagedTokenToKVPoolAllocator`` with ``size // page_size`` pages.

    Pages are ``1..size // page_size`` (page 0 is padding), so token ids run
    from ``page_size`` to ``size + page_size - 1``.
    """
    m = _import_base()
    with _memory_pool_debug(debug_memory_pool):
        return m.PagedTokenToKVPoolAllocator(
            size, page_size, _default_dtype(dtype), DEVICE, _PlaceholderKVCache(), need_sort
        )


def make_sglang_swa(
    size: int,
    size_swa: int,
    page_size: int,
    need_sort: bool = False,
    *,
    dtype=None,
    debug_memory_pool: bool = False,
):
    """SGLang ``SWATokenToKVPoolAllocator``: full pool of ``size`` tokens plus an
    SWA pool of ``size_swa`` tokens (Token allocators at page size 1, Paged ones
    otherwise).  The stub pool is ``allocator.get_kvcache()``."""
    m = _import_swa()
    dtype = _default_dtype(dtype)
    kvcache = m.CompatSWAKVPool(size, size_swa, page_size, dtype)
    with _memory_pool_debug(debug_memory_pool):
        return m.SWATokenToKVPoolAllocator(size, size_swa, page_size, dtype, DEVICE, kvcache, need_sort)


class _ReqSlots:
    """What SGLang's SWA allocator reads of a ``ReqToTokenPool`` in per-request ring mode: its free slot count."""

    def __init__(self, slots: int) -> None:
        self.slots = slots

    def available_size(self) -> int:
        return self.slots


def make_sglang_swa_ring(size: int, size_swa: int, page_size: int, ring_size: int, req_slots: int = 8, *, dtype=None):
    """SGLang ``SWATokenToKVPoolAllocator`` in per-request SWA ring mode (``kvcache.swa_req_ring_size`` set, as
    DeepSeek-V4's unified KV pool sets it): only the full pool is paged; the SWA frees are no-ops."""
    m = _import_swa()
    dtype = _default_dtype(dtype)
    kvcache = m.CompatSWAKVPool(size, size_swa, page_size, dtype)
    kvcache.swa_req_ring_size = ring_size
    return m.SWATokenToKVPoolAllocator(
        size, size_swa, page_size, dtype, DEVICE, kvcache, False, req_to_token_pool=_ReqSlots(req_slots)
    )


def make_sglang_pure_swa(size_swa: int, need_sort: bool = False, *, dtype=None):
    """SGLang ``PureSWATokenToKVPoolAllocator`` (every layer sliding-window): one token pool that is both its
    ``full_attn_allocator`` and its ``swa_attn_allocator``; page size 1."""
    m = _import_swa()
    dtype = _default_dtype(dtype)
    kvcache = m.CompatSWAKVPool(size_swa, size_swa, 1, dtype)
    return m.PureSWATokenToKVPoolAllocator(size_swa, 1, dtype, DEVICE, kvcache, need_sort)
