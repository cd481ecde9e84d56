"""Attribute forwarding: how a wrapper answers for its inner allocator without a ``__getattr__``.

Contract: ``_subclass_for(inner_cls, base)`` makes (once per pair) a subclass of ``base`` and ``inner_cls`` on
which every name of the inner class, and every name its code stores as an attribute (found by scanning its
bytecode), is a property that reads, writes and deletes the inner's attribute. ``isinstance`` then answers as for
the bare allocator, and no ``__getattr__`` slows the interpreter's attribute lookups (off mode stays within a few
percent of the bare call). A name the inner lacks raises the inner's own ``AttributeError``. ``_PoolView`` is a
pool's own allocator as the wrapper hands it out, forwarded the same way, its pool-changing calls checked.
Reads and writes no wrapper state but the generated classes (module-level cache, ``_SUBCLASSES``)."""

from __future__ import annotations

import dis
import inspect
import operator
import types

from instrumented_alloc.wrapper.constants import _ABSENT, _OWN_ATTRS, INSTRUMENTED_OPS


class _Missing:
    """Hides an instrumented method the inner class lacks, so ``hasattr`` answers as for the bare allocator."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        raise AttributeError(f"{owner.__name__ if owner else 'allocator'} has no attribute {self.name!r}")


def _forward_property(name: str) -> property:
    """A data descriptor forwarding ``name`` to the inner allocator, read, write and delete. The read is a C getter
    (``attrgetter``): no Python frame per read; a method reads as the inner's bound method (looked up at each
    read, so an instance attribute of the inner shadowing it is honoured), and calling it costs no forwarding
    frame. A name the inner lacks raises the inner's own ``AttributeError`` (naming the inner's type), so
    ``hasattr`` and ``getattr(w, name, default)`` answer as for the bare allocator."""

    def set_inner(self, value) -> None:
        setattr(self._w_inner, name, value)

    def del_inner(self) -> None:
        delattr(self._w_inner, name)

    return property(operator.attrgetter(f"_w_inner.{name}"), set_inner, del_inner, doc=f"The inner's ``{name}``.")


def _stored_names(cls: type) -> set[str]:
    """Every attribute name the code of ``cls`` and its bases stores with ``x.name = ...`` (``STORE_ATTR``): the
    instance attributes its methods may create after construction (``clear()``, lazily). A superset (it also
    holds names stored on other objects): a forwarding property for a name the inner lacks answers as the inner
    does (``AttributeError``), so an extra name costs nothing but a ``dir()`` entry."""
    names: set[str] = set()
    seen: set = set()

    def scan(code) -> None:
        if code in seen:
            return
        seen.add(code)
        for ins in dis.get_instructions(code):
            if ins.opname == "STORE_ATTR":
                names.add(ins.argval)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                scan(const)

    for klass in cls.__mro__:
        if klass is object:
            continue
        for value in vars(klass).values():
            parts = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
            for part in parts:
                try:  # class attributes may be any object: one that misbehaves here has no code to scan
                    part = getattr(part, "__func__", part)  # staticmethod, classmethod
                    part = getattr(part, "func", part)  # functools.cached_property, partialmethod
                    part = inspect.unwrap(part)
                    code = getattr(part, "__code__", None)
                except Exception:
                    continue
                if isinstance(code, types.CodeType):
                    scan(code)
    return names


def _is_own(name: str, base: type) -> bool:
    """A name the wrapper keeps for itself (never forwarded): its private ``_w_*`` state, its public instance
    attributes, dunders, and every name the classes of ``base`` (``InstrumentedAllocator`` or a subclass of it)
    define."""
    if name.startswith("_w_") or name in _OWN_ATTRS or (name.startswith("__") and name.endswith("__")):
        return True
    return any(name in vars(klass) for klass in base.__mro__)


# (wrapper class, inner class) -> the generated class (see _subclass_for).
_SUBCLASSES: dict[tuple[type, type], type] = {}


def _forward_names(sub: type, names) -> None:
    """Give the generated class ``sub`` a forwarding property for each of ``names`` it does not answer yet.
    Cold: the class's creation and the first assignment of a new name through the wrapper (changing a class
    resets the interpreter's lookup caches for it)."""
    base = sub._w_base
    for name in names:
        if type(name) is str and name not in sub.__dict__ and not _is_own(name, base):
            setattr(sub, name, _forward_property(name))


def _subclass_for(cls: type, base: type) -> type:
    """The generated subclass of ``(base, cls)`` for inner class ``cls`` (one per pair, cached; ``base`` is
    ``InstrumentedAllocator`` or a subclass of it): every name of ``cls`` the wrapper does not define forwards to
    the inner through a property (``_forward_property``: methods included), and so does every name the code of
    ``cls`` stores as an attribute (``_stored_names``); ``_Missing`` hides the instrumented methods ``cls``
    lacks."""
    sub = _SUBCLASSES.get((base, cls))
    if sub is not None:
        return sub
    ns: dict = {"__module__": base.__module__, "__doc__": base.__doc__, "_w_base": base}
    for name in dir(cls):
        if not _is_own(name, base):
            ns[name] = _forward_property(name)
    for name in INSTRUMENTED_OPS:
        if not hasattr(cls, name):
            ns[name] = _Missing(name)
    sub = type(f"{getattr(base, '_w_class_prefix', 'Instrumented')}{cls.__name__}", (base, cls), ns)
    _forward_names(sub, _stored_names(cls))
    _SUBCLASSES[(base, cls)] = sub
    return sub


class _PoolView:
    """One pool's own allocator (an SWA allocator's ``full_attn_allocator`` or ``swa_attn_allocator``) as the
    wrapper hands it out: SGLang's caches call these directly (the unified radix cache frees an evicted node's
    full pages with ``full_attn_allocator.free_segment``, on purpose without the composite's peer check, before
    its SWA component frees the SWA side; HiCache and external KV loads allocate and free on either side). A call
    that bypassed the wrapper would change a pool behind its shadow, and every later call on those pages would
    read as a fault (``duplicate_allocation``, ``pool_conservation``).

    ``alloc``, ``free``, ``free_segment`` and ``free_page_ids`` are checked and mirrored as the wrapper's own
    calls are, on this pool alone: pages handed out here belong to no request (a cache's), a free must release
    pages in use, raise mode refuses a bad one before the call; the op is named ``<attribute>.<method>``
    (``full_attn_allocator.free_segment``). No SWA peer check: these calls are below the mapping. Every other
    name reads and writes through to the allocator, as the wrapper's own forwarding does (an instance of a class
    made once per allocator class: ``isinstance`` answers as for the allocator). Other methods that change the
    pool (``alloc_extend``, ``alloc_decode``, ``clear``, its free groups) are forwarded unchecked: SGLang calls
    them on the composite allocator only. Threading and ordering: as the wrapper's calls (its lock)."""

    _w_base = None
    _w_class_prefix = "Checked"

    def __setattr__(self, name, value):
        setattr(self._w_inner, name, value)
        cls = type(self)
        if name not in cls.__dict__:
            _forward_names(cls, (name,))

    def __repr__(self) -> str:
        return f"<checked view of {self._w_attr} of {self._w_owner!r}: {self._w_inner!r}>"

    def alloc(self, need_size: int):
        return self._w_owner._w_sub_alloc(self._w_attr, self._w_pool, need_size)

    def free(self, free_index):
        return self._w_owner._w_sub_free(self._w_attr, self._w_pool, "free", free_index, _ABSENT)

    def free_segment(self, free_index, *, start_pos):
        return self._w_owner._w_sub_free(self._w_attr, self._w_pool, "free_segment", free_index, start_pos)

    def free_page_ids(self, page_ids):
        return self._w_owner._w_sub_free(self._w_attr, self._w_pool, "free_page_ids", page_ids, _ABSENT)


def _pool_view(owner, attr: str, pool: str, allocator) -> _PoolView:
    view = object.__new__(_subclass_for(type(allocator), _PoolView))
    for name, value in (("_w_inner", allocator), ("_w_owner", owner), ("_w_attr", attr), ("_w_pool", pool)):
        object.__setattr__(view, name, value)
    return view
