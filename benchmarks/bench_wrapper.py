"""Wrapped vs bare allocator cost, measured side by side in one process.

Each figure is a ratio: time of the wrapped loop / time of the bare loop, both run in the same process on
identical allocators, interleaved (bare, wrapped, bare, wrapped, ...) so that machine noise hits both. The
median of the repeats is reported with the min and max beside it.

The decode loop is what an engine does every step: one ``alloc_decode`` for the whole batch and, for the
wrapped allocator, one ``step()`` (the step boundary where deferred checks and count conservation run), so
the step boundary's cost is in the figure.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import table
from instrumented_alloc import InstrumentedAllocator
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator

I64 = torch.int64


def _decode_setup(alloc, bs: int, ps: int, prompt: int, bind: bool):
    prefix = torch.zeros(bs, dtype=I64)
    seq = torch.full((bs,), prompt, dtype=I64)
    last = torch.full((bs,), -1, dtype=I64)
    rids = [f"r{i}" for i in range(bs)]
    if bind:
        with alloc.batch(rids):
            out = alloc.alloc_extend(prefix, prefix, seq, seq.clone(), last, bs * prompt)
    else:
        out = alloc.alloc_extend(prefix, prefix, seq, seq.clone(), last, bs * prompt)
    last = out.view(bs, prompt)[:, -1].clone()
    return rids, seq, last


def decode_loop(alloc, *, bs: int, ps: int, steps: int, wrapped: bool) -> float:
    """Seconds for ``steps`` decode steps of a batch of ``bs`` requests (prompt of 3 pages + 1 token)."""
    prompt = 3 * ps + 1
    rids, seq, last = _decode_setup(alloc, bs, ps, prompt, wrapped and alloc.mode != "off")
    seqs = [seq + i + 1 for i in range(steps)]  # host-side inputs prepared outside the timed loop
    t0 = time.perf_counter()
    if wrapped:
        with alloc.batch(rids):
            for s in seqs:
                last = alloc.alloc_decode(s, s, last)
                alloc.step()
    else:
        for s in seqs:
            last = alloc.alloc_decode(s, s, last)
    return time.perf_counter() - t0


def measure_decode(mode: str, verify: str, *, bs: int, ps: int, steps: int, repeats: int) -> list[float]:
    pages_needed = bs * (4 + steps // ps + 2)
    ratios = []
    for warm_up in (True, *([False] * repeats)):
        bare = PagedTokenToKVPoolAllocator(pages_needed * ps, ps, torch.float16, "cpu")
        inner = PagedTokenToKVPoolAllocator(pages_needed * ps, ps, torch.float16, "cpu")
        wrapped = InstrumentedAllocator(inner, mode=mode, verify=verify)
        tb = decode_loop(bare, bs=bs, ps=ps, steps=steps, wrapped=False)
        tw = decode_loop(wrapped, bs=bs, ps=ps, steps=steps, wrapped=True)
        if mode != "off":
            assert not wrapped.violations, list(wrapped.violations)[:3]
        if not warm_up:  # the first pair pays for lazy initialisation
            ratios.append(tw / tb)
    return ratios


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for mode, verify, target in (("off", "auto", "<= 1.05"), ("record", "immediate", "<= 1.50"),
                                 ("record", "deferred", "")):  # fmt: skip
        rs = measure_decode(mode, verify, bs=256, ps=16, steps=args.steps, repeats=args.repeats)
        rows.append((f"alloc_decode bs=256 ps=16 wrapped/bare mode={mode} verify={verify}", rs, target))
    out = table(rows)
    print(out)
    return out


if __name__ == "__main__":
    main()
