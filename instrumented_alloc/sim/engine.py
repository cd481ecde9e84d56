"""The demo engine: a simulated serving engine's scheduler loop driving a KV page allocator, as SGLang drives it.

One ``step()`` is one scheduler iteration:
1. arrivals join the waiting queue;
2. decode: every request past its prefill gets one slot (``alloc_decode``; ``alloc`` at page size 1). When the
   pool cannot hold the batch's new pages, running requests are retracted (their KV freed, the request re-queued
   with its generated tokens as part of its prompt), fewest generated tokens first, as SGLang's retract does;
3. prefill: chunked, up to ``chunk_tokens`` tokens over the in-progress and newly admitted requests, one
   ``alloc_extend`` per step (``alloc`` at page size 1). Admission is by free pages, holding back an estimate of
   the running requests' future decode (SGLang's ``new_token_ratio``, which decays while nothing is retracted:
   the engine over-admits under load and then retracts, which is the pressure the demo exists to show). On the PD
   decode side requests arrive prefilled instead: ``alloc_for_decode_prealloc`` with an SWA tail, one at a time;
4. SWA eviction (hybrid presets): once ``evict_every`` tokens have left a request's window, its evicted length is
   written through the ledger (page-floored) and the SWA KV between the old and the new length is freed with
   ``free_swa_segment`` -- from the values the ledger holds, so a write the wrapper rejects frees nothing;
5. finished requests are freed in one free group (SWA: the SWA KV still held by segment, then the full row) and
   released (``release_request``);
6. ``alloc.step()``; when idle, the full ``check_consistency()`` sweep, as SGLang's idle leak check.

Deterministic: the same preset, seed, page size and faults give the same calls in the same order (and so the
same events, up to their timestamps and durations). No I/O: the command line owns files, exporters and output.
``wrapped=False`` drives the bare allocator (the benchmark's baseline): the same calls, no ledger, no checks.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from instrumented_alloc.allocators import (
    PagedTokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from instrumented_alloc.prealloc import alloc_for_decode_prealloc, swa_tail_len
from instrumented_alloc.sim.faults import Injection
from instrumented_alloc.sim.presets import Preset
from instrumented_alloc.sim.workload import RequestSpec
from instrumented_alloc.wrapper import InstrumentedAllocator

I64 = torch.int64
_RATIO_INIT, _RATIO_MIN, _RATIO_DECAY = 0.7, 0.1, 0.0015  # SGLang's new_token_ratio schedule, roughly
_OUTPUT_CLIP = 4096  # SGLang clips each request's expected remaining output in the same estimate
_IDLE_CHECK_EVERY = 100


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I64)


@dataclass
class Req:
    rid: str
    prompt_len: int  # positions to prefill (PD decode side: positions that arrive prefilled)
    output_len: int  # tokens to generate from admission on
    arrival_step: int
    row: list[int] = field(default_factory=list)  # full-pool slot of every position (a req_to_token row)
    evicted: int = 0  # SWA evicted length, as the ledger holds it
    generated: int = 0

    @property
    def decoding(self) -> bool:
        return len(self.row) >= self.prompt_len


@dataclass(frozen=True)
class Fired:
    """A fault that fired: what was done, at which step, to which request."""

    fault: str
    invariant: str
    step: int
    rid: str | None
    detail: str


@dataclass
class EngineStats:
    steps: int = 0
    arrived: int = 0
    rejected: int = 0  # the queue was full
    admitted: int = 0
    finished: int = 0
    retracted: int = 0
    evictions: int = 0
    alloc_failures: int = 0
    idle_checks: int = 0
    peak_occupancy: float = 0.0  # fraction of the full pool's pages in use, highest seen
    peak_swa_occupancy: float = 0.0


def make_allocator(preset: Preset, device="cpu"):
    """The reference allocator SGLang would build for this preset (page size 1: token-granular)."""
    ps = preset.page_size
    if preset.is_swa:
        return SWATokenToKVPoolAllocator(
            preset.full_tokens, preset.swa_tokens, ps, torch.float16, device, need_sort=preset.need_sort
        )
    if ps == 1:
        return TokenToKVPoolAllocator(preset.full_tokens, torch.float16, device, need_sort=preset.need_sort)
    return PagedTokenToKVPoolAllocator(preset.full_tokens, ps, torch.float16, device, need_sort=preset.need_sort)


class SimEngine:
    """A continuous-batching scheduler over one allocator. Single-threaded: call ``step()`` from one thread."""

    def __init__(
        self,
        preset: Preset,
        requests: Iterable[RequestSpec],
        *,
        mode: str = "record",
        wrapped: bool = True,
        injections: Iterable[Injection] = (),
        sinks=(),
        clock=None,
        verify: str = "auto",
    ):
        if preset.pd_decode and preset.page_size == 1:
            raise ValueError(f"preset {preset.name}: the PD decode side preallocates SWA tails by page; page size 1 "
                             "is not supported")
        self.preset = preset
        self.ps = preset.page_size
        self.inner = make_allocator(preset)
        if wrapped:
            kw = {} if clock is None else {"clock": clock}
            self.alloc = InstrumentedAllocator(
                self.inner, mode=mode, sliding_window=preset.window, sinks=sinks, verify=verify, **kw
            )
            self.ledger = None if mode == "off" else self.alloc.ledger
        else:
            self.alloc = self.inner
            self.ledger = None
        self.wrapped = wrapped
        self._arrivals: Iterator[RequestSpec] = iter(requests)
        self._next: RequestSpec | None = next(self._arrivals, None)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stats = EngineStats()
        self.step_no = 0
        self.new_token_ratio = _RATIO_INIT
        self._armed: list[Injection] = []
        self._pending: list[Injection] = sorted(injections, key=lambda i: i.step)
        self.fired: list[Fired] = []
        self._full_pages = self.inner.size // self.ps if not preset.is_swa else self.inner.size_full // self.ps
        self._swa_pages = self.inner.size_swa // self.ps if preset.is_swa else 0

    # -- the loop ----------------------------------------------------------------------------------------------
    def step(self) -> None:
        """One scheduler iteration (see the module docstring). In ``mode="raise"`` an ``InvariantViolation``
        propagates from here, with the engine's state as it was at the failing call."""
        # Steps count from 0, as the wrapper's do: every call of step s is recorded at step s.
        s = self.step_no
        while self._next is not None and self._next.arrival <= s:
            spec = self._next
            self.stats.arrived += 1
            if len(self.waiting) < self.preset.max_waiting:
                self.waiting.append(Req(spec.rid, spec.prompt_len, spec.output_len, s))
            else:
                self.stats.rejected += 1
            self._next = next(self._arrivals, None)
        while self._pending and self._pending[0].step <= s:
            self._armed.append(self._pending.pop(0))
        self._decode()
        if self.preset.pd_decode:
            self._admit_prefilled()
        else:
            self._prefill()
        if self.preset.is_swa:
            self._evict()
        self._finish()
        self.new_token_ratio = max(_RATIO_MIN, self.new_token_ratio - _RATIO_DECAY)
        self._note_occupancy()
        if self.wrapped:
            if not self.running and not self.waiting and s % _IDLE_CHECK_EVERY == 0:
                self.alloc.check_consistency()
                self.stats.idle_checks += 1
            self.alloc.step()
        self.step_no = self.stats.steps = s + 1

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def shutdown(self) -> list:
        """Abort every request still holding KV (freed, released), drop the queue, close the last step and run
        the full sweep. Returns the sweep's findings (empty for a clean run)."""
        if self.running:
            self.alloc.free_group_begin()
            for r in self.running:
                self._free_row(r)
            self.alloc.free_group_end()
            for r in self.running:
                self._release(r)
        self.running.clear()
        self.waiting.clear()
        if not self.wrapped:
            return []
        self.alloc.step()
        return self.alloc.check_consistency()

    # -- reads -------------------------------------------------------------------------------------------------
    def free_pages(self) -> tuple[int, int]:
        """(full, swa) pages available now, from the inner allocator's host-side counts."""
        if self.preset.is_swa:
            return self.inner.full_available_size() // self.ps, self.inner.swa_available_size() // self.ps
        return self.inner.available_size() // self.ps, 0

    def unfired(self) -> list:
        """The injections that have not fired (yet): armed ones waiting for their chance (a request to act on),
        then those whose step has not come."""
        return [*self._armed, *self._pending]

    def occupancy(self) -> tuple[float, float]:
        full, swa = self.free_pages()
        return 1 - full / self._full_pages, (1 - swa / self._swa_pages) if self._swa_pages else 0.0

    def violation_count(self) -> int:
        return sum(self.alloc.violation_counts.values()) if self.wrapped and self.ledger is not None else 0

    # -- the phases --------------------------------------------------------------------------------------------
    def _bind(self, rids, lens=None):
        if self.ledger is None:
            return contextlib.nullcontext()
        return self.alloc.batch(rids, lens=lens)

    def _new_pages(self, reqs) -> int:
        # The position each request writes next starts a new page when it sits on a page boundary.
        return sum(1 for r in reqs if len(r.row) % self.ps == 0)

    def _decode(self) -> None:
        dec = [r for r in self.running if r.decoding]
        if not dec:
            return
        while dec:
            need = self._new_pages(dec)
            full, swa = self.free_pages()
            if need <= full and (not self.preset.is_swa or need <= swa):
                break
            victim = min(reversed(dec), key=lambda r: r.generated)
            self._retract(victim)
            dec.remove(victim)
        if not dec:
            return
        rids = [r.rid for r in dec]
        with self._bind(rids):
            if self.ps == 1:
                out = self.alloc.alloc(len(dec))
            else:
                seq = _t([len(r.row) + 1 for r in dec])
                out = self.alloc.alloc_decode(seq, seq, _t([r.row[-1] for r in dec]))
        if out is None:
            self.stats.alloc_failures += 1
            return
        for r, slot in zip(dec, out.tolist()):
            r.row.append(slot)
            r.generated += 1

    def _retract(self, r: Req) -> None:
        self._free_row(r)
        self._release(r)
        self.running.remove(r)
        # Back to the queue's head with what it generated folded into its prompt, as SGLang re-prefills it.
        self.waiting.appendleft(Req(r.rid, len(r.row), r.output_len - r.generated, r.arrival_step))
        self.stats.retracted += 1
        self.new_token_ratio = _RATIO_INIT

    def _reserve_pages(self) -> int:
        remaining = sum(min(r.output_len - r.generated, _OUTPUT_CLIP) for r in self.running)
        return -(-int(remaining * self.new_token_ratio) // self.ps)

    def _prefill(self) -> None:
        ps = self.ps
        budget = self.preset.chunk_tokens
        full, swa = self.free_pages()
        full -= self._reserve_pages()
        swa -= sum(1 for r in self.running if r.decoding)
        chosen: list[tuple[Req, int]] = []
        candidates = [r for r in self.running if not r.decoding]
        for r in candidates:
            if budget <= 0:
                break
            n = min(r.prompt_len - len(r.row), budget)
            pages = -(-(len(r.row) + n) // ps) - (-(-len(r.row) // ps))
            if pages > full or (self.preset.is_swa and pages > swa):
                continue
            chosen.append((r, n))
            budget, full, swa = budget - n, full - pages, swa - pages
        while budget > 0 and self.waiting and len(self.running) < self.preset.max_running:
            r = self.waiting[0]
            n = min(r.prompt_len, budget)
            pages = -(-n // ps)
            if pages > full or (self.preset.is_swa and pages > swa):
                break  # first come, first served: no one overtakes the queue's head
            self.waiting.popleft()
            self.running.append(r)
            self.stats.admitted += 1
            chosen.append((r, n))
            budget, full, swa = budget - n, full - pages, swa - pages
        if not chosen:
            return
        self._fault_duplicate_alloc()
        reqs = [r for r, _ in chosen]
        lens = [n for _, n in chosen]
        rids = [r.rid for r in reqs]
        total = sum(lens)
        if ps == 1:
            with self._bind(rids, lens):
                out = self.alloc.alloc(total)
        else:
            prefix = _t([len(r.row) for r in reqs])
            seq = _t([len(r.row) + n for r, n in chosen])
            last = _t([r.row[-1] if r.row else -1 for r in reqs])
            with self._bind(rids):
                out = self.alloc.alloc_extend(prefix, prefix, seq, seq, last, total)
        if out is None:
            self.stats.alloc_failures += 1
            return
        slots = out.tolist()
        i = 0
        for r, n in chosen:
            r.row.extend(slots[i : i + n])
            i += n
        self._fault_alloc_len(reqs)

    def _admit_prefilled(self) -> None:
        """PD decode side: each admitted request's transferred KV is preallocated, full pool whole, SWA pool for
        the window's tail only; its evicted length starts at the tail's (page-aligned) start."""
        ps, window = self.ps, self.preset.window
        budget = self.preset.chunk_tokens
        full, swa = self.free_pages()
        full -= self._reserve_pages()
        swa -= sum(1 for r in self.running if r.decoding)
        while budget > 0 and self.waiting and len(self.running) < self.preset.max_running:
            r = self.waiting[0]
            tail = swa_tail_len(r.prompt_len, window, ps)
            pages, swa_pages = -(-r.prompt_len // ps), -(-tail // ps)
            if pages > full or swa_pages > swa:
                break
            self._fault_duplicate_alloc()
            if self.ledger is not None:
                out = alloc_for_decode_prealloc(self.alloc, rid=r.rid, fill_len=r.prompt_len, swa_tail_len=tail)
            else:
                zero, fill = _t([0]), _t([r.prompt_len])
                out = self.alloc.alloc_extend_swa_tail(zero, zero, fill, fill, _t([-1]), r.prompt_len, tail)
            if out is None:
                self.stats.alloc_failures += 1
                break
            self.waiting.popleft()
            self.running.append(r)
            self.stats.admitted += 1
            r.row = out.tolist()
            r.evicted = self.ledger[r.rid].swa_evicted_seqlen if self.ledger is not None else r.prompt_len - tail
            self._fault_alloc_len([r])
            budget, full, swa = budget - r.prompt_len, full - pages, swa - swa_pages

    def _evict(self) -> None:
        ps, window, every = self.ps, self.preset.window, max(1, self.preset.evict_every)
        for r in self.running:
            seq = len(r.row)
            target = max(0, seq - window) // ps * ps
            if target - r.evicted < every:
                continue
            old = r.evicted
            value = self._fault_eviction_value(r, target)
            new = self._write(r, "swa_evicted_seqlen", value)
            if new > old:
                if not self._fault_segment_swa(r, old, new):
                    self.alloc.free_swa_segment(_t(r.row[old:new]), start_pos=old)
                self.stats.evictions += 1
            r.evicted = new

    def _finish(self) -> None:
        done = [r for r in self.running if r.decoding and r.generated >= r.output_len]
        if not done:
            return
        leak = self._take("leak")
        unaligned = self._take("segment-unaligned") if not self.preset.is_swa else None
        if unaligned is not None:
            self._unaligned_segment_free(unaligned, done[0])
        self.alloc.free_group_begin()
        for r in done:
            if leak is not None and r is done[0]:
                self._fire(leak, r.rid, f"released {r.rid} holding {len(r.row)} positions of KV, unfreed")
                continue
            self._free_row(r)
        self.alloc.free_group_end()
        # A request freed just now (not the one a leak kept): with a single request finishing and leaked, the
        # double free waits for the next finish (its "second" free would have been the first).
        freed = [r for r in done if not (leak is not None and r is done[0])]
        double = self._take("double-free") if freed else None
        if double is not None:
            r = freed[-1]
            self._fire(double, r.rid, f"freed {r.rid}'s {len(r.row)} positions a second time")
            self.alloc.free_full(_t(r.row))  # free_full is free on a single pool
        for r in done:
            self._release(r)
            self.running.remove(r)
            self.stats.finished += 1

    # -- helpers -----------------------------------------------------------------------------------------------
    def _free_row(self, r: Req) -> None:
        if not r.row:
            return
        if self.preset.is_swa:
            # SGLang's contract: the SWA KV still held (from the evicted length on) goes by segment, then the full
            # row; free() would look up SWA peers of evicted positions too, and they have none.
            if r.evicted < len(r.row):
                self.alloc.free_swa_segment(_t(r.row[r.evicted :]), start_pos=r.evicted)
            self.alloc.free_full(_t(r.row))
        else:
            self.alloc.free(_t(r.row))

    def _release(self, r: Req) -> None:
        if self.ledger is not None:
            self.alloc.release_request(r.rid)

    def _write(self, r: Req, field_name: str, value: int) -> int:
        """Write through the ledger (the checked write point) and return what it holds afterwards: a value the
        wrapper rejects (record mode) is not stored, so the engine goes on from the old one."""
        if self.ledger is None:
            return value
        kv = self.ledger[r.rid]
        setattr(kv, field_name, value)
        return getattr(kv, field_name)

    def _note_occupancy(self) -> None:
        full, swa = self.occupancy()
        st = self.stats
        st.peak_occupancy = max(st.peak_occupancy, full)
        st.peak_swa_occupancy = max(st.peak_swa_occupancy, swa)

    # -- faults: each fires once, at the first chance at or after its step ---------------------------------------
    def _take(self, name: str) -> Injection | None:
        for inj in self._armed:
            if inj.fault.name == name:
                self._armed.remove(inj)
                return inj
        return None

    def _fire(self, inj: Injection, rid, detail: str) -> None:
        self.fired.append(Fired(inj.fault.name, inj.fault.invariant, self.step_no, rid, detail))

    def _fault_eviction_value(self, r: Req, target: int) -> int:
        inj = self._take("swa-misaligned")
        if inj is not None:
            value = target - 1  # the seed's bug: the window start, not floored to a page
            self._fire(inj, r.rid, f"wrote swa_evicted_seqlen={value} for {r.rid} (page size {self.ps})")
            return value
        inj = self._take("swa-inside-window")
        if inj is not None:
            value = target + self.ps
            self._fire(inj, r.rid, f"wrote swa_evicted_seqlen={value} for {r.rid} at {len(r.row)} positions, "
                                   f"window {self.preset.window}")
            return value
        return target

    def _fault_segment_swa(self, r: Req, old: int, new: int) -> bool:
        inj = self._take("segment-unaligned") if self.preset.is_swa else None
        if inj is None:
            return False
        start = old + 1
        self._fire(inj, r.rid, f"free_swa_segment of {r.rid} from start_pos={start} (page size {self.ps})")
        try:
            self.alloc.free_swa_segment(_t(r.row[start:new]), start_pos=start)
        except ValueError:
            return False  # the allocator refused the segment: the engine frees it right
        return True

    def _unaligned_segment_free(self, inj: Injection, r: Req) -> None:
        start = 1
        self._fire(inj, r.rid, f"free_segment of {r.rid} from start_pos={start} (page size {self.ps})")
        with contextlib.suppress(ValueError):  # the allocator refuses it; the finish below frees the row right
            self.alloc.free_segment(_t(r.row[start:]), start_pos=start)

    def _fault_duplicate_alloc(self) -> None:
        inj = self._take("duplicate-alloc")
        if inj is None:
            return
        victims = [r for r in self.running if r.row]
        if not victims:
            self._armed.append(inj)  # nothing in use to hand out twice yet
            return
        r = victims[0]
        target = self.inner.full_attn_allocator if self.preset.is_swa else self.inner
        page = r.row[0] // self.ps if self.ps > 1 else r.row[0]
        target.free_pages = torch.cat([_t([page]), target.free_pages])
        self._fire(inj, r.rid, f"put page {page} (in use by {r.rid}) at the head of the free list")

    def _fault_alloc_len(self, reqs: list[Req]) -> None:
        if not any(i.fault.name == "alloc-len-misaligned" for i in self._armed):
            return
        for r in reqs:
            if len(r.row) % self.ps:
                inj = self._take("alloc-len-misaligned")
                self._fire(inj, r.rid, f"wrote kv_allocated_len={len(r.row)} for {r.rid} (page size {self.ps})")
                self._write(r, "kv_allocated_len", len(r.row))
                return
