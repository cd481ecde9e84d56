"""Does the wrapper add a host-device synchronisation? A decode loop on CUDA under
``torch.cuda.set_sync_debug_mode``, bare and wrapped in every mode, and the per-step ratio on the GPU.

``python -m benchmarks.gpu_sync_check [--steps N] [--batch B] [--device cuda|cpu]``

The loop is an engine's: one extend of ``batch`` requests (prompts of 3 pages + 5 tokens), then ``steps`` decode
steps; every ``evict_every`` steps each request's SWA KV that left the window is freed by segment and its evicted
length written through the ledger; at the end (wrapped, mode record or raise) every other request hands its whole
pages to a prefix cache (``cache_insert``, offered and held a slice of its row, then its ``cache_protected_len``
written through the ledger) and a ``step()`` follows; then every request frees its own pages (SWA segment, then
the full row) and is released, and the cache evicts what it took (the same frees). Everything the allocator reads
on the device stays there: ``seq_lens`` and ``last_loc`` are device tensors updated on the device, ``*_cpu`` twins
are host tensors, the request rows live in a device ``req_to_token`` table, and the frees and the cache's inserts
take slices of it. Allocators: paged (page size 16) and SWA (page size 16), each bare, then wrapped with
``mode="off"``, ``mode="record", verify="auto"`` (deferred on CUDA: the same configuration as the next, kept as
the default an engine gets), ``mode="record", verify="deferred"``, ``mode="raise", verify="deferred"``, and
record/deferred with a sink that has every event kind built (the exporters' event paths: page deltas, ledger
updates, step boundaries, snapshots every 8 steps). Page size 1, free groups and need_sort are not in this loop.

Counting: ``set_sync_debug_mode("warn")`` makes every synchronising CUDA call (``.item()``, ``.cpu()``,
``nonzero``, a D2H copy...) warn; the warnings raised inside each operation are counted by operation, bare and
wrapped, and the table reports the difference (the target: the wrapper adds none; the bare allocators have their
own, e.g. ``torch.unique`` in a set-shaped ``free``, which SGLang has too). ``step()``, ``cache_insert`` and
``release_request`` are counted too (the bare allocator has none of them: any sync there is the wrapper's): under
deferred verification a call only queues its check, which runs at a later ``step()``. Then the same loop runs once
more per configuration under ``set_sync_debug_mode("error")``, as the proof: around every call but the allocator's
own extend and final frees (which synchronise in the bare allocator too), so every ``step()`` (the one after the
extend, each decode step's, the one after the cache's inserts, the one after the final frees and releases, where
those calls' deferred checks run), every insert and every release is in it. ``flush()`` and
``check_consistency()`` (with the cache's slots, and ``idle=True``) may wait, and are called after it, outside.

On a machine without CUDA it says so and exits 2; ``--device cpu`` runs the same loop on the CPU without the
sync check (a smoke test of the script, used by the tests). Runs in well under a minute on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import Counter

import torch

from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator

I64 = torch.int64
PS = 16
WINDOW = 64
# (label, mode, verify, a sink that has every event built)
CONFIGS = (("bare", None, None, False), ("off", "off", "auto", False), ("record auto", "record", "auto", False),
           ("record deferred", "record", "deferred", False), ("raise deferred", "raise", "deferred", False),
           ("record def+sink", "record", "deferred", True))


class _AllEvents:
    """A sink that reads every event kind (none declared), so the wrapper builds them all; keeps a count only."""

    name = "gpu-check"

    def __init__(self):
        self.n = 0

    def __call__(self, batch) -> None:
        self.n += len(batch)


class _Counter:
    """Counts the sync-debug warnings raised inside each named operation."""

    def __init__(self, device: torch.device, counting: bool):
        self.by_op: Counter = Counter()
        self.counting = counting and device.type == "cuda"

    def __call__(self, op: str, fn, *args, **kwargs):
        if not self.counting:
            return fn(*args, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn(*args, **kwargs)
        n = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
        if n:
            self.by_op[op] += n
        return out


def _make(kind: str, device, mode, verify, tokens: int, sink: bool = False):
    if kind == "swa":
        inner = SWATokenToKVPoolAllocator(tokens, tokens, PS, torch.float16, device)
    else:
        inner = PagedTokenToKVPoolAllocator(tokens, PS, torch.float16, device)
    if mode is None:
        return inner, None
    w = InstrumentedAllocator(
        inner, mode=mode, verify=verify, sliding_window=WINDOW if kind == "swa" else None,
        snapshot_every=8 if sink else 0,
    )
    if sink:
        w.subscribe(_AllEvents())
    return w, (w.ledger if mode != "off" else None)


class _Strict:
    """``set_sync_debug_mode("error")`` switched on and off around parts of a loop (CUDA and ``strict`` only)."""

    def __init__(self, device: torch.device, strict: bool):
        self.active = strict and device.type == "cuda"

    def on(self) -> None:
        if self.active:
            torch.cuda.set_sync_debug_mode("error")

    def off(self) -> None:
        if self.active:
            torch.cuda.set_sync_debug_mode("default")


def run_loop(kind: str, device: torch.device, mode, verify, *, batch: int, steps: int, evict_every: int,
             counting: bool, strict: bool = False, sink: bool = False) -> tuple[Counter, float]:
    """One loop; returns (sync warnings by op, seconds per decode step incl. the step boundary). ``strict``: all but
    the allocator's own extend and final frees run under ``set_sync_debug_mode("error")`` (see the module
    docstring)."""
    prompt = 3 * PS + 5
    max_len = prompt + steps + PS
    tokens = (batch * (max_len // PS + 2) + 4) * PS
    alloc, ledger = _make(kind, device, mode, verify, tokens, sink)
    count = _Counter(device, counting)
    strict_mode = _Strict(device, strict)
    rids = [f"r{i}" for i in range(batch)]
    req_to_token = torch.zeros((batch, max_len), dtype=I64, device=device)
    zeros_cpu = torch.zeros(batch, dtype=I64)
    seq_cpu = torch.full((batch,), prompt, dtype=I64)
    seq = seq_cpu.clone().to(device, non_blocking=True)  # clone: on the CPU, .to() would alias the host twin
    zeros = zeros_cpu.to(device, non_blocking=True)
    last = torch.full((batch,), -1, dtype=I64, device=device)
    bind = alloc.batch if ledger is not None else (lambda r: _Null())
    with bind(rids):
        out = count("alloc_extend", alloc.alloc_extend, zeros, zeros_cpu, seq, seq_cpu, last, batch * prompt)
    req_to_token[:, :prompt] = out.view(batch, prompt)
    last = out.view(batch, prompt)[:, -1]
    strict_mode.on()
    try:
        if mode is not None:
            count("step", alloc.step)  # the extend's deferred check runs here once its copy has landed
    finally:
        strict_mode.off()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    strict_mode.on()
    try:
        _decode_loop(alloc, ledger, count, kind, mode, rids, req_to_token, seq, seq_cpu, last, prompt, steps,
                     evict_every, bind)
    finally:
        strict_mode.off()
    if device.type == "cuda":
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / steps
    length = prompt + steps
    evicted = _last_eviction(prompt, steps, evict_every) if kind == "swa" else 0
    # The prefix cache takes every other request's whole pages before its final frees (wrapped, record or raise).
    whole = length // PS * PS
    cached = range(0, batch, 2) if ledger is not None else range(0)
    strict_mode.on()
    try:
        for i in cached:
            count("cache_insert", _cache_insert, alloc, ledger, rids[i], req_to_token[i, :whole])
        if cached:
            count("step", alloc.step)  # where the inserts' deferred checks run once their copies have landed
    finally:
        strict_mode.off()
    for i in range(batch):
        # The bare allocators' own frees synchronise (torch.unique): outside the strict region, counted as usual.
        own = whole if i in cached else 0  # the request's own pages start after what the cache took
        _free_row(alloc, count, kind, req_to_token[i], own, max(evicted, own), length)
        if ledger is not None:
            strict_mode.on()
            try:
                count("release_request", alloc.release_request, rids[i])
            finally:
                strict_mode.off()
    for i in cached:  # the cache evicts what it took: frees as the requests' own
        _free_row(alloc, count, kind, req_to_token[i], 0, evicted, whole)
    if mode not in (None, "off"):
        if device.type == "cuda":
            torch.cuda.synchronize()  # the frees' copies have landed: their checks run in this step()
        strict_mode.on()
        try:
            count("step", alloc.step)
        finally:
            strict_mode.off()
        alloc.flush()  # may wait: outside the loop, as an engine's idle check
        # The cache holds nothing now and every request was released: an idle engine's sweep finds nothing.
        found = alloc.check_consistency(cached=torch.zeros(0, dtype=I64, device=device), idle=True)
        if found or alloc.violation_counts:
            raise AssertionError(f"{kind} {mode}/{verify}: the loop was not clean: {dict(alloc.violation_counts)}")
    return count.by_op, per_step


def _decode_loop(alloc, ledger, count, kind, mode, rids, req_to_token, seq, seq_cpu, last, length, steps, evict_every,
                 bind):
    evicted = 0
    for s in range(steps):
        seq_cpu = seq_cpu + 1
        seq = seq + 1
        with bind(rids):
            last = count("alloc_decode", alloc.alloc_decode, seq, seq_cpu, last)
        req_to_token[:, length] = last
        length += 1
        if kind == "swa" and s % evict_every == evict_every - 1:
            new = max(0, length - WINDOW) // PS * PS
            if new > evicted:
                for i, rid in enumerate(rids):
                    count("free_swa_segment", alloc.free_swa_segment, req_to_token[i, evicted:new], start_pos=evicted)
                    if ledger is not None:
                        count("ledger write", setattr, ledger[rid], "swa_evicted_seqlen", new)
                evicted = new
        if mode is not None:
            count("step", alloc.step)


def _cache_insert(alloc, ledger, rid, row) -> None:
    """The prefix cache takes the request's whole pages ``row`` (a slice of the device ``req_to_token`` table):
    offered and held the same slots (nothing cached before), then the request's protected length written."""
    with alloc.cache_insert(rid, row) as ins:
        ins.held = row
    ledger[rid].cache_protected_len = row.shape[0]


def _free_row(alloc, count, kind: str, row, start: int, swa_start: int, end: int) -> None:
    """Free the pages of ``row[start:end]``: on the SWA allocator its SWA KV from ``swa_start`` (what the window
    left) by segment, then the full row."""
    if kind == "swa":
        count("free_swa_segment", alloc.free_swa_segment, row[swa_start:end], start_pos=swa_start)
        count("free_full", alloc.free_full, row[start:end])
    else:
        count("free", alloc.free, row[start:end])


def _last_eviction(prompt: int, steps: int, evict_every: int) -> int:
    """The evicted length ``_decode_loop`` leaves (the same arithmetic, without running it)."""
    evicted, length = 0, prompt
    for s in range(steps):
        length += 1
        if s % evict_every == evict_every - 1:
            evicted = max(evicted, max(0, length - WINDOW) // PS * PS)
    return evicted


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_sync_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--evict-every", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_sync_check: no CUDA device here (torch.cuda.is_available() is False): nothing measured. "
              "Run it on a GPU machine, or with --device cpu for a smoke test of the loop.", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    print(f"device: {torch.cuda.get_device_name(0) if cuda else 'cpu'}; torch {torch.__version__}; batch "
          f"{args.batch}, {args.steps} decode steps, page size {PS}, SWA window {WINDOW}")
    ok = True
    rows = []
    for kind in ("paged", "swa"):
        base = None
        times: dict[str, list[float]] = {}
        for label, mode, verify, sink in CONFIGS:
            kw = dict(batch=args.batch, steps=args.steps, evict_every=args.evict_every, sink=sink)
            run_loop(kind, device, mode, verify, counting=False, **kw)  # warm-up (allocator kernels, caches)
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                syncs, _ = run_loop(kind, device, mode, verify, counting=True, **kw)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
            times[label] = [run_loop(kind, device, mode, verify, counting=False, **kw)[1]
                            for _ in range(args.repeats)]
            if base is None:
                base = syncs
            added = {op: n - base.get(op, 0) for op, n in syncs.items() if n > base.get(op, 0)}
            proof = "-"
            if cuda:
                try:
                    run_loop(kind, device, mode, verify, counting=False, strict=True, **kw)
                    proof = "clean"
                except RuntimeError as exc:
                    proof = f"FAILED: {str(exc).splitlines()[0]}"
                    ok = ok and mode is None  # the bare allocator's own syncs are reported, not ours to fail
            if added:
                ok = False
            ratio = statistics.median(times[label]) / statistics.median(times["bare"])
            rows.append((kind, label, dict(syncs) if cuda else "n/a", added if cuda else "n/a", proof,
                         statistics.median(times[label]) * 1e6, ratio))
    head = f"{'pool':6} {'config':16} {'syncs (by op)':34} {'added':22} {'error mode':10} {'us/step':>9} {'/bare':>7}"
    print(head)
    print("-" * len(head))
    for kind, label, syncs, added, proof, us, ratio in rows:
        print(f"{kind:6} {label:16} {syncs!s:34} {added or 'none'!s:22} {proof:10} {us:9.1f} {ratio:7.3f}")
    if not cuda:
        print("cpu run: the loop and the table only; no sync check without CUDA")
        return 0
    print("gpu_sync_check: " + ("PASS: the wrapper adds no synchronisation" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
