"""Every write of a request's KV lengths in SGLang, through the wrapper's checked ledger.

SGLang 0.5.23 keeps them on ``Req.kv``, a ``ReqKvInfo`` (a ``slots=True`` dataclass): ``kv_allocated_len``,
``kv_committed_len``, ``cache_protected_len``, written from a dozen places (allocation, speculative accepts, PD
prealloc, retraction, the radix cache...). ``route`` replaces those three fields' slot descriptors on the class
with properties over the same slots: a read is the slot's own (a C-level call), a write first goes to the
session's ``routed_write`` (checked there; in raise mode a rejected value raises before it is stored, as the
seed's assert does), then into the slot. The SWA evicted length goes through ``set_evicted_seqlen``, which the
registry hooks (``hooks.py``).
"""

from __future__ import annotations

from instrumented_alloc.sglang_plugin import session

FIELDS = ("kv_allocated_len", "kv_committed_len", "cache_protected_len")
_MARK = "_kvalloc_routed"


def _routed_property(name: str, member) -> property:
    store = member.__set__

    def write(kv, value) -> None:
        sess = session._SESSION
        if sess is not None and sess.kv_rid:
            sess.routed_write(kv, name, value)
        store(kv, value)

    prop = property(member.__get__, write, member.__delete__, f"{name} (routed through instrumented-alloc)")
    return prop


def route(cls) -> None:
    """Route ``cls``'s length fields (idempotent)."""
    if getattr(cls, _MARK, False):
        return
    for name in FIELDS:
        member = cls.__dict__[name]
        setattr(cls, name, _routed_property(name, member))
    setattr(cls, _MARK, True)


def routed(cls) -> bool:
    return getattr(cls, _MARK, False) and all(isinstance(cls.__dict__.get(n), property) for n in FIELDS)
