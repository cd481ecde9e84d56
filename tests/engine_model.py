"""A tiny engine model for tests: requests with KV rows, and the allocator arguments an engine would pass.

Used by the wrapper's scenario and property tests to drive a wrapped allocator and a bare twin with the same
calls. Rows are plain Python lists of slot ids (position -> slot), as SGLang's req_to_token rows are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

I64 = torch.int64


def t(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=I64)


@dataclass
class Req:
    rid: str
    row: list = field(default_factory=list)
    evicted: int = 0

    @property
    def seq(self) -> int:
        return len(self.row)


def extend_args(reqs: list[Req], new_lens: list[int]):
    """alloc_extend arguments for extending each request by new_lens[i] tokens."""
    prefix = [r.seq for r in reqs]
    seq = [r.seq + n for r, n in zip(reqs, new_lens)]
    last = [r.row[-1] if r.row else -1 for r in reqs]
    return (t(prefix), t(prefix), t(seq), t(seq), t(last), sum(new_lens))


def decode_args(reqs: list[Req]):
    seq = [r.seq + 1 for r in reqs]
    return (t(seq), t(seq), t(r.row[-1] for r in reqs))


def split_extend(reqs: list[Req], new_lens: list[int], out: torch.Tensor) -> None:
    """Append the slots of an extend result to the requests' rows."""
    slots = out.tolist()
    i = 0
    for r, n in zip(reqs, new_lens):
        r.row.extend(slots[i : i + n])
        i += n


def allocator_state(alloc) -> dict:
    """Everything that defines an allocator's future behaviour, as comparable Python values."""
    inner = getattr(alloc, "inner", alloc)
    state = {}
    parts = {"": inner}
    for name in ("full_attn_allocator", "swa_attn_allocator", "logical_attn_allocator", "hisparse_attn_allocator"):
        sub = getattr(inner, name, None)
        if sub is not None:
            parts[name] = sub
    for prefix, a in parts.items():
        fp = getattr(a, "free_pages", None)
        if fp is not None:
            state[prefix + ".free_pages"] = fp.tolist()
        rel = getattr(a, "release_pages", None)
        if rel is not None:
            state[prefix + ".release_pages"] = rel.tolist()
        staged = getattr(a, "staged_pages", None)
        if staged is not None:
            state[prefix + ".staged_pages"] = [x.tolist() for x in staged]
        state[prefix + ".available"] = a.available_size()
    for name in ("full_to_swa_index_mapping", "full_to_hisparse_device_index_mapping"):
        m = getattr(inner, name, None)
        if m is not None:
            state[name] = m.tolist()
    return state
