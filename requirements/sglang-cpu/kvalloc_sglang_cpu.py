"""What SGLang 0.5.23 needs to run on a CPU-only machine beside a CPU build of torch, in one place.

``make setup`` copies this module into the project's virtual environment with a ``.pth`` file that imports it at
every interpreter start, so that SGLang's spawned processes (scheduler, detokenizer) get it too. It costs nothing
until one of the three names below is imported. It is for this CPU environment only: a GPU server has the real
packages and needs none of it.

1. ``torchvision``: some model configs import it at module level. PyPI's wheels are built against a CUDA torch and
   do not load beside ``torch==2.13.0+cpu``. When no real torchvision is found, every ``torchvision`` and
   ``torchvision.*`` import gets an empty package whose attributes are inert placeholders. It has a ``__file__``
   and a module spec, because ``torch.compile`` inspects both.
2. ``sgl_kernel``: on a CPU machine SGLang imports its CPU kernels from it at import time (``mem_cache/allocation.py``,
   ``kernels/ops/kvcache/cache_move.py``, the speculative kernels...), and its CPU build is not on PyPI. When no
   real one is found, every name imported from it is a function that raises ``NotImplementedError`` when called;
   none is called on the torch_native path. Its submodules stay missing (ImportError), so SGLang's guarded
   imports of them (``sgl_kernel.scalar_type``...) take their fallbacks.
3. ``cudaHostRegister``: the PD decode side builds a host KV pool that pins its buffers with cudaHostRegister
   (``mem_cache/pool_host/common.py`` ``_cuda_host_register``), which a CPU build of torch cannot do. When torch
   has no CUDA, that one function becomes a no-op right after its module is imported.

The finders for 1 and 2 are appended to ``sys.meta_path``: they answer only when every real finder failed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_ORIGIN = "kvalloc-sglang-cpu-stub"


class _Placeholder:
    """Inert stand-in for any object a stubbed package is asked for at import time."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        return _Placeholder()

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)  # class Foo(torchvision.x.Bar): a plain subclass of object

    def __or__(self, other):
        return object

    __ror__ = __or__

    def __repr__(self) -> str:
        return "<stub placeholder>"


def _not_built(qualname: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"{qualname}: sgl_kernel has no CPU build here (stubbed by kvalloc_sglang_cpu)")

    kernel.__name__ = kernel.__qualname__ = qualname.rsplit(".", 1)[-1]
    return kernel


class _StubPackage(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if self.__name__ == "sgl_kernel":
            return _not_built(f"sgl_kernel.{name}")
        return _Placeholder()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``root`` and ``root.*`` with a stub package (consulted last: only when nothing real exists)."""

    def __init__(self, root: str, *, submodules: bool) -> None:
        self.root = root
        self.submodules = submodules

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.root or (self.submodules and fullname.startswith(self.root + ".")):
            return importlib.machinery.ModuleSpec(fullname, self, origin=_ORIGIN, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubPackage(spec.name)
        module.__path__ = []
        module.__file__ = f"<{_ORIGIN}:{spec.name}>"
        module.__version__ = "0.0.0+stub"
        return module

    def exec_module(self, module) -> None:
        pass


_HOST_POOL = "sglang.srt.mem_cache.pool_host.common"


class _HostRegisterPatch(importlib.abc.MetaPathFinder):
    """After ``sglang.srt.mem_cache.pool_host.common`` is executed, turn ``_cuda_host_register`` into a no-op when
    torch has no CUDA (see the module docstring, 3)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _HOST_POOL:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        import torch

        if not torch.cuda.is_available() and hasattr(module, "_cuda_host_register"):

            def _cuda_host_register(*args, **kwargs):
                return None  # a CPU build of torch cannot pin host memory for a GPU it does not have

            module._cuda_host_register = _cuda_host_register


def install() -> None:
    """Idempotent: add the finders once per process."""
    if any(isinstance(f, (_StubFinder, _HostRegisterPatch)) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _HostRegisterPatch())
    sys.meta_path.append(_StubFinder("torchvision", submodules=True))
    sys.meta_path.append(_StubFinder("sgl_kernel", submodules=False))


install()
