"""Keyed pseudonyms for request ids: what recordings and spans hold instead of the engine's raw ids, on request.

``RequestIdHasher(key)`` maps a request id to ``"h:" + the first 16 hex digits of HMAC-SHA256(key, text)``, where
``text`` is the id's canonical text (UTF-8):
- a ``str`` is its own text; an integer (``int`` or a numpy integer, not a bool) is its decimal digits, so ``7``
  and ``"7"`` get the same pseudonym; anything else is its ``repr`` (what the flight recorder stores for such ids).
- ``None`` stays ``None`` (no request).
- Deterministic for a key: two components that share one hasher (the recorder and the OTel exporter of one run)
  give a request the same pseudonym, so a recording and the spans can still be joined. Without the key a
  pseudonym cannot be computed from an id (nor an id recovered from it, short of guessing ids and having the
  key). 16 hex digits are 64 bits: two of a million requests share a pseudonym with a chance of about 3e-8.
- ``RequestIdHasher.random()`` uses a key from ``os.urandom`` that nobody keeps: pseudonyms are consistent within
  the run (for every component given that hasher) and cannot be linked to the ids afterwards.
- The key is never stored nor shown (``repr`` and ``scheme`` leave it out); ``scheme`` describes the mapping for a
  recording's metadata.
- Cost: the pseudonyms of the ids seen last are cached (at most ``cache_size``; the oldest entry goes first), so
  a request seen before costs one dictionary lookup, not an HMAC. Thread-safe: the hit path is a lookup; a miss
  computes and inserts under a lock.

Violations: ``violation(v)`` returns ``v`` with its ``rid`` replaced by the pseudonym and the request id inside its
message too. The wrapper formats a request id in a message only as ``request {rid!r}`` or (an unknown id given to
``release_request``) ``request id {rid!r}``; exactly those forms are replaced, so numbers elsewhere in a message
(``page_size=16``, page lists, ``request slot 3``) are never touched.

Events and snapshots (what the flight recorder stores): ``event_fields(values)`` redacts an event's fields (its
instance dict: ``rid``, ``rids``, ``violation``, a ``Snapshot``'s ``ledger`` rows and its ``rids``, which are
``(slot, rid)`` pairs); ``snapshots(snaps)`` redacts ``InstrumentedAllocator.snapshot()``'s ``PoolSnapshot``s
(``ledger.rids``, ``slot_rids``). Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import numbers
import os
import re
import threading
from collections.abc import Mapping

from instrumented_alloc.invariants import Violation

__all__ = ["SCHEME", "RequestIdHasher", "as_hasher"]

SCHEME = "hmac-sha256"
PREFIX = "h:"


def canonical_text(rid) -> str:
    """The text a request id is hashed as (see the module docstring)."""
    if isinstance(rid, str):
        return rid
    if isinstance(rid, numbers.Integral) and not isinstance(rid, bool):
        return str(int(rid))
    return repr(rid)


class RequestIdHasher:
    """Keyed pseudonyms for request ids (see the module docstring). ``key``: bytes, or a str (UTF-8); not empty."""

    def __init__(self, key: bytes | str, *, digits: int = 16, cache_size: int = 16384):
        if isinstance(key, str):
            key = key.encode()
        if not isinstance(key, (bytes, bytearray)):
            raise TypeError(f"key: expected bytes or str, got {type(key).__name__}")
        if not key:
            raise ValueError("key: expected a non-empty key")
        if isinstance(digits, bool) or not isinstance(digits, int) or not 8 <= digits <= 64:
            raise ValueError(f"digits: expected an int in 8..64, got {digits!r}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size: expected an int >= 1, got {cache_size!r}")
        self._key = bytes(key)
        self.digits = digits
        self.cache_size = cache_size
        self._cache: dict = {}
        self._tuples: dict = {}  # id(tuple) -> (tuple, hashed tuple): a batch's rids tuple repeats every step
        self._lock = threading.Lock()

    @classmethod
    def random(cls, **kwargs) -> RequestIdHasher:
        """A hasher whose key (32 bytes from ``os.urandom``) nobody keeps."""
        return cls(os.urandom(32), **kwargs)

    @property
    def scheme(self) -> dict:
        """What the pseudonyms are, for a recording's metadata (never the key)."""
        return {"scheme": SCHEME, "prefix": PREFIX, "hex_digits": self.digits, "text": "str; int as decimal; else repr"}

    def __repr__(self) -> str:
        return f"RequestIdHasher({SCHEME}, {self.digits} hex digits)"

    # -- ids ------------------------------------------------------------------------------------------------------
    def _compute(self, rid) -> str:
        mac = hmac.new(self._key, canonical_text(rid).encode("utf-8", "surrogatepass"), hashlib.sha256)
        return PREFIX + mac.hexdigest()[: self.digits]

    def __call__(self, rid):
        """The pseudonym of ``rid`` (None for None)."""
        if rid is None:
            return None
        t = type(rid)
        if t is not str and t is not int:
            return self._compute(rid)  # not cached: a bool would hit the entry of 0 or 1
        p = self._cache.get(rid)
        if p is not None:
            return p
        p = self._compute(rid)
        with self._lock:
            cache = self._cache
            if len(cache) >= self.cache_size:
                cache.pop(next(iter(cache)), None)
            cache[rid] = p
        return p

    def ids(self, rids: tuple) -> tuple:
        """A tuple of ids, each as its pseudonym. The same tuple object (a ``batch()`` block's) is mapped once."""
        hit = self._tuples.get(id(rids))
        if hit is not None and hit[0] is rids:
            return hit[1]
        out = tuple(self(r) for r in rids)
        with self._lock:
            if len(self._tuples) >= 64:
                self._tuples.clear()
            self._tuples[id(rids)] = (rids, out)  # holds the tuple: its id is not reused while cached
        return out

    # -- violations -----------------------------------------------------------------------------------------------
    def message(self, message: str, rid) -> str:
        """``message`` with ``request {rid!r}`` and ``request id {rid!r}`` naming the pseudonym instead."""
        if rid is None or not isinstance(message, str):
            return message
        pattern = r"\brequest (id )?" + re.escape(repr(rid)) + r"(?![\w'\"])"
        p = repr(self(rid))
        return re.sub(pattern, lambda m: f"request {m.group(1) or ''}{p}", message)

    def violation(self, v: Violation) -> Violation:
        """``v`` with its request id (``rid`` and in ``message``) replaced by the pseudonym."""
        if v.rid is None:
            return v
        return dataclasses.replace(v, rid=self(v.rid), message=self.message(v.message, v.rid))

    # -- events and snapshots -------------------------------------------------------------------------------------
    def event_fields(self, values: Mapping) -> Mapping:
        """An event's fields (its instance dict) with every request id as its pseudonym: ``rid``, ``rids``,
        ``violation`` and a ``Snapshot`` event's ``ledger`` rows (rid first); a ``Snapshot``'s ``rids`` are
        ``(slot, rid)`` pairs, their slots kept. ``values`` itself is not changed; it is returned as it is when it
        holds no request id."""
        out = None
        for name in ("rid", "rids", "violation", "ledger"):
            if name not in values:
                continue
            v = values[name]
            if name == "rid":
                new = self(v)
            elif name == "violation":
                new = self.violation(v) if isinstance(v, Violation) else v
            elif not isinstance(v, tuple):
                continue
            elif name == "rids":
                # A Snapshot event (the only one with a ledger) names its slots: (slot, rid) pairs.
                new = tuple((slot, self(rid)) for slot, rid in v) if "ledger" in values else self.ids(v)
            else:
                new = tuple((self(row[0]), *row[1:]) if isinstance(row, tuple) and row else row for row in v)
            if out is None:
                out = dict(values)
            out[name] = new
        return values if out is None else out

    def snapshots(self, snaps: Mapping) -> dict:
        """``InstrumentedAllocator.snapshot()``'s pools with ``ledger.rids`` and ``slot_rids`` as pseudonyms."""
        out = {}
        ledgers: dict = {}
        for name, s in snaps.items():
            led = ledgers.get(id(s.ledger))
            if led is None:
                led = ledgers[id(s.ledger)] = dataclasses.replace(s.ledger, rids=tuple(self(r) for r in s.ledger.rids))
            out[name] = dataclasses.replace(s, ledger=led, slot_rids={slot: self(r) for slot, r in s.slot_rids.items()})
        return out


def as_hasher(value) -> RequestIdHasher | None:
    """What a component's ``hash_request_ids=`` argument means: None/False: off; a ``RequestIdHasher``: that one
    (share one between components to join their ids); bytes or str: a hasher with that key; True: a hasher with a
    random key of its own (see ``RequestIdHasher.random``)."""
    if value is None or value is False:
        return None
    if value is True:
        return RequestIdHasher.random()
    if isinstance(value, RequestIdHasher):
        return value
    if isinstance(value, (bytes, bytearray, str)):
        return RequestIdHasher(value)
    raise TypeError(
        f"hash_request_ids: expected a RequestIdHasher, a key (bytes or str), a bool or None, "
        f"got {type(value).__name__}"
    )
