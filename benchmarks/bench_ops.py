"""Wrapped / bare per allocator operation, at batch sizes 1, 32, 256, page sizes 1 and 16, in the modes off,
record (immediate) and record (deferred).

Each figure is a ratio: seconds the wrapped allocator spends in the timed calls / seconds the bare allocator
spends in the same calls, both driven through the identical call sequence in the same process, interleaved
(bare, wrapped, bare, wrapped, ...) so that machine noise hits both; the first pair warms up and is not counted.

What is timed, per operation (``bs`` is the number of requests in the step):
- ``alloc_extend``: one extend of ``bs`` new requests (prompt of 3 pages + 1 token), ``batch()`` entry included
  (attribution is part of the wrapper's price). Page size 1 uses SGLang's token allocator, whose extend is
  ``alloc(n)`` (bound with per-request ``lens``).
- ``alloc_decode``: one decode of the whole batch plus, for the wrapper, the ``step()`` boundary that follows it
  (where deferred checks and count conservation run). Page size 1: ``alloc(bs)``. Every request of the batch has
  the same length, so at page size 16 the whole batch opens a page together every 16th decode (a lockstep batch,
  which the wrapper's decode runs serve: see ``_DecodeRun``). ``alloc_decode_mixed`` (page size 16, batch 256 only):
  the same with request ``i``'s prompt ``i % 16`` tokens longer, so that a sixteenth of the batch opens a page at
  every decode, as in a real engine's batch.
- ``free`` / ``free_segment``: ``bs`` per-request calls (one finished request each, as an engine's release path
  does).
- ``free_swa_segment`` (SWA allocator): ``bs`` per-request evictions of the first two pages' SWA KV, each
  followed (wrapper, record modes) by the engine's ledger write of the new evicted length.
- ``alloc_extend_swa_tail`` (SWA allocator, PD decode-side prealloc): ``bs`` calls of batch size 1 (the call takes
  one request), each in its own ``batch()``, followed (wrapper, record modes) by the ledger write of the evicted
  length that ``prealloc.py`` makes. Paged only: SGLang's SWA allocator has no tail allocation at page size 1.
The calls of a sample run back to back, then (wrapper) one ``step()``, inside the timed region: what the wrapper
defers to the step boundary (deferred checks, the ledger against the pages) is part of its price. Setup (the
extends before a free) runs outside it, identically on both sides. ``release_request`` is not timed.

Clock: thread CPU time by default (``time.thread_time``: the machine this runs on is shared, and a preempted
sample would otherwise count someone else's work); ``--clock wall`` measures ``perf_counter`` instead.
"""

from __future__ import annotations

import contextlib
import time

import torch

from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import (
    PagedTokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)

I64 = torch.int64
OPS = ("alloc_extend", "alloc_decode", "free", "free_segment", "free_swa_segment", "alloc_extend_swa_tail")
BATCHES = (1, 32, 256)
PAGE_SIZES = (1, 16)
MODES = (("off", "auto"), ("record", "immediate"), ("record", "deferred"))
_SWA_OPS = frozenset({"free_swa_segment", "alloc_extend_swa_tail"})


def applicable(op: str, ps: int) -> bool:
    return not (op == "alloc_extend_swa_tail" and ps == 1)


class _Case:
    """One allocator (bare or wrapped) and the requests driven through it."""

    def __init__(self, op: str, ps: int, bs: int, tokens: int, mode: str | None, verify: str, fast_paths=True):
        if op in _SWA_OPS:
            inner = SWATokenToKVPoolAllocator(tokens, tokens, ps, torch.float16, "cpu")
        elif ps == 1:
            inner = TokenToKVPoolAllocator(tokens, torch.float16, "cpu")
        else:
            inner = PagedTokenToKVPoolAllocator(tokens, ps, torch.float16, "cpu")
        self.wrapped = mode is not None
        self.alloc = (
            InstrumentedAllocator(inner, mode=mode, verify=verify, fast_paths=fast_paths) if self.wrapped else inner
        )
        self.recording = self.wrapped and mode != "off"
        self.ps, self.bs = ps, bs
        self.n = 0

    def rids(self, k: int) -> list[str]:
        out = [f"r{self.n + i}" for i in range(k)]
        self.n += k
        return out

    def bind(self, rids, lens=None):
        if not self.wrapped:
            return contextlib.nullcontext()
        return self.alloc.batch(rids, lens=lens)

    def extend(self, rids, prompt: int) -> torch.Tensor:
        """The rows (bs x prompt slots) of ``len(rids)`` new requests; inside the caller's binding."""
        bs = len(rids)
        a = self.alloc
        if self.ps == 1:
            return a.alloc(bs * prompt).view(bs, prompt)
        zero = torch.zeros(bs, dtype=I64)
        seq = torch.full((bs,), prompt, dtype=I64)
        return a.alloc_extend(zero, zero, seq, seq.clone(), torch.full((bs,), -1, dtype=I64), bs * prompt).view(
            bs, prompt
        )

    def extend_mixed(self, rids, prompt: int) -> torch.Tensor:
        """The last slot of each of ``len(rids)`` new requests, request ``i`` of ``prompt + i % ps`` tokens."""
        bs = len(rids)
        zero = torch.zeros(bs, dtype=I64)
        seq = prompt + torch.arange(bs, dtype=I64) % self.ps
        with self.bind(rids):
            out = self.alloc.alloc_extend(
                zero, zero, seq, seq.clone(), torch.full((bs,), -1, dtype=I64), int(seq.sum())
            )
        return out[torch.cumsum(seq, 0) - 1].clone(), seq

    def extend_bound(self, rids, prompt: int) -> torch.Tensor:
        with self.bind(rids, lens=[prompt] * len(rids) if self.ps == 1 else None):
            return self.extend(rids, prompt)

    def step(self) -> None:
        if self.wrapped:
            self.alloc.step()


def _prompt(ps: int) -> int:
    return 3 * ps + 1


def run(
    op: str, ps: int, bs: int, mode: str | None, verify: str, rounds: int, clock=time.thread_time, fast_paths=True
) -> float:
    """Seconds (of ``clock``) spent in the timed calls of ``rounds`` rounds of ``bs`` requests (see the module
    docstring); mode None: the bare allocator. ``fast_paths``: the wrapper's (``InstrumentedAllocator``'s)."""
    prompt = _prompt(ps)
    decode = op in ("alloc_decode", "alloc_decode_mixed")
    n_req = bs if decode else bs * rounds
    c = _Case(op, ps, bs, n_req * (prompt + 5 * ps + (rounds if decode else 0)) + 4 * ps, mode, verify, fast_paths)
    a = c.alloc
    wrapped = c.wrapped
    if op == "alloc_decode_mixed":
        rids = c.rids(bs)
        last, seq0 = c.extend_mixed(rids, prompt)
        seqs = [seq0 + (i + 1) for i in range(rounds)]
        with c.bind(rids):
            t0 = clock()
            for s in seqs:
                last = a.alloc_decode(s, s, last)
                if wrapped:
                    a.step()
            spent = clock() - t0
    elif op == "alloc_decode":
        rids = c.rids(bs)
        rows = c.extend_bound(rids, prompt)
        last = rows[:, -1].clone()
        seqs = [torch.full((bs,), prompt + i + 1, dtype=I64) for i in range(rounds)]
        with c.bind(rids):
            t0 = clock()
            for s in seqs:
                last = a.alloc(bs) if ps == 1 else a.alloc_decode(s, s, last)
                if wrapped:
                    a.step()
            spent = clock() - t0
    elif op == "alloc_extend":
        batches = [c.rids(bs) for _ in range(rounds)]
        t0 = clock()
        for rids in batches:
            c.extend_bound(rids, prompt)
        if wrapped:
            a.step()
        spent = clock() - t0
    elif op in ("free", "free_segment", "free_swa_segment"):
        full = 4 * ps if op == "free_swa_segment" else prompt
        rids = [r for _ in range(rounds) for r in c.rids(bs)]
        rows = [row for i in range(rounds) for row in c.extend_bound(rids[i * bs : (i + 1) * bs], full)]
        c.step()
        cut = 2 * ps
        t0 = clock()
        if op == "free":
            for row in rows:
                a.free(row)
        elif op == "free_segment":
            for row in rows:
                a.free_segment(row, start_pos=0)
        else:
            for rid, row in zip(rids, rows):
                a.free_swa_segment(row[:cut], start_pos=0)
                if c.recording:  # the engine records the eviction: the wrapper checks it (bare: a plain attribute)
                    a.ledger[rid].swa_evicted_seqlen = cut
        if wrapped:
            a.step()
        spent = clock() - t0
    elif op == "alloc_extend_swa_tail":
        prompt4, tail = 4 * ps, 2 * ps
        zero = torch.zeros(1, dtype=I64)
        seq = torch.full((1,), prompt4, dtype=I64)
        last = torch.full((1,), -1, dtype=I64)
        rids = [c.rids(1) for _ in range(bs * rounds)]
        t0 = clock()
        for rid in rids:
            with c.bind(rid):
                a.alloc_extend_swa_tail(zero, zero, seq, seq, last, prompt4, tail)
            if c.recording:  # the engine records what the SWA side does not hold (prealloc.py does the same)
                a.ledger[rid[0]].swa_evicted_seqlen = prompt4 - tail
        if wrapped:
            a.step()
        spent = clock() - t0
    else:
        raise ValueError(op)
    if c.recording:
        a.flush()
        assert not a.violations, (op, ps, bs, mode, verify, list(a.violations)[:3])
    return spent


def rounds_for(op: str, bs: int, quick: bool) -> int:
    """Rounds per timed sample: enough calls that one sample is not a handful of microseconds."""
    if op in ("alloc_decode", "alloc_decode_mixed"):
        return 128 if quick else 512
    if op == "alloc_extend":
        # One extend is one call whatever bs is: a sample of a few calls (a few microseconds each at page size 1)
        # would be too short for the clock and dominated by per-sample effects.
        return max(16, 128 // bs) if quick else max(64, 512 // bs)
    return max(2, 128 // bs) if quick else max(4, 512 // bs)


def measure(
    op: str, ps: int, bs: int, mode: str, verify: str, *, repeats: int, quick: bool, clock=time.thread_time
) -> list[float]:
    rounds = rounds_for(op, bs, quick)
    ratios = []
    for warm_up in (True, *([False] * repeats)):
        tb = run(op, ps, bs, None, verify, rounds, clock)
        tw = run(op, ps, bs, mode, verify, rounds, clock)
        if not warm_up:
            ratios.append(tw / tb)
    return ratios


def rows(
    *, repeats: int = 5, quick: bool = False, clock=time.thread_time, ops=OPS, batches=BATCHES, page_sizes=PAGE_SIZES
) -> list:
    """(name, ratios, target) for every applicable combination."""
    out = []
    for op in ops:
        for ps in page_sizes:
            if not applicable(op, ps):
                continue
            for bs in batches:
                for mode, verify in MODES:
                    rs = measure(op, ps, bs, mode, verify, repeats=repeats, quick=quick, clock=clock)
                    target = ""
                    if mode == "off":
                        target = "<= 1.03"
                    elif op == "alloc_decode" and bs == 256 and ps == 16 and verify == "immediate":
                        target = "<= 1.25"
                    name = f"{op} bs={bs} ps={ps} {mode if mode == 'off' else verify} wrapped/bare"
                    out.append((name, rs, target))
        if op == "alloc_decode" and 16 in page_sizes and 256 in batches:
            # The target row again, on a batch whose requests open their pages at different decodes.
            rs = measure("alloc_decode_mixed", 16, 256, "record", "immediate", repeats=repeats, quick=quick,
                         clock=clock)
            out.append(("alloc_decode bs=256 ps=16 immediate, mixed lengths wrapped/bare", rs, "<= 1.25"))
    return out
