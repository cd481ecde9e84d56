"""What each of the wrapper's fast paths buys: ``python -m benchmarks.bench_fast_paths [--repeats N] [--quick]``.

For each name of ``instrumented_alloc.wrapper.FAST_PATHS`` and each ``bench_ops`` case it may serve, the wrapped
allocator runs the same calls with every fast path on and with that one off, alternating in one process; the figure
is the median of (seconds without it) / (seconds with all on). Above 1: the fast path pays on that case. A last
block compares ``fast_paths=False`` (the general path everywhere) with all on. Cases are ``bench_ops``' (record
mode, immediate verification: the fast paths serve immediate verification; a step boundary after each round).

A fast path stays in the wrapper when one of its cases, or SGLang's real engine (``bench_sglang``), shows it pays
(see docs/fast-paths.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench_ops import I64, _Case, _prompt, rounds_for, run
from instrumented_alloc.wrapper import FAST_PATHS

# (op, page size, batch): the bench_ops cases each fast path may serve.
CASES = {
    "alloc": [("alloc_decode", 1, 256), ("alloc_extend", 1, 256)],
    "bind_memo": [("rebind_decode", 16, 256), ("rebind_decode", 16, 32)],
    "decode": [("alloc_decode", 16, 256), ("alloc_decode_mixed", 16, 256)],
    "decode_runs": [("alloc_decode", 16, 256), ("alloc_decode_mixed", 16, 256)],
    # One request's extend (SGLang's prefill of one new request; alloc_extend_swa_tail's rows are calls of one).
    "extend_runs": [("alloc_extend", 16, 1), ("alloc_extend_swa_tail", 16, 32), ("alloc_extend", 16, 256)],
    "free": [("free", 16, 32), ("free_segment", 16, 32)],
}


def rebind_decode(ps: int, bs: int, rounds: int, clock, fast_paths) -> float:
    """Seconds of ``rounds`` decodes of one batch, each in its own ``batch()`` of the same ids, as an engine binds
    every iteration (the SGLang plugin does), with a step boundary after each (not a ``bench_ops`` case)."""
    prompt = _prompt(ps)
    c = _Case("alloc_decode", ps, bs, bs * (prompt + 5 * ps + rounds) + 4 * ps, "record", "immediate", fast_paths)
    a = c.alloc
    rids = c.rids(bs)
    last = c.extend_bound(rids, prompt)[:, -1].clone()
    seqs = [torch.full((bs,), prompt + i + 1, dtype=I64) for i in range(rounds)]
    t0 = clock()
    for s in seqs:
        with a.batch(rids):
            last = a.alloc_decode(s, s, last)
        a.step()
    spent = clock() - t0
    assert not a.violations, list(a.violations)[:3]
    return spent


def _run(op: str, ps: int, bs: int, rounds: int, clock, fast_paths) -> float:
    if op == "rebind_decode":
        return rebind_decode(ps, bs, rounds, clock, fast_paths)
    return run(op, ps, bs, "record", "immediate", rounds, clock, fast_paths=fast_paths)


def gain(op: str, ps: int, bs: int, without, *, repeats: int, quick: bool, clock) -> list[float]:
    """(seconds with ``without`` as the fast paths) / (seconds with all on), per repeat, after one warm-up pair."""
    rounds = rounds_for("alloc_decode" if op == "rebind_decode" else op, bs, quick)
    out = []
    for warm_up in (True, *([False] * repeats)):
        t_all = _run(op, ps, bs, rounds, clock, True)
        t_without = _run(op, ps, bs, rounds, clock, without)
        if not warm_up:
            out.append(t_without / t_all)
    return out


def rows(
    *, repeats: int = 5, quick: bool = False, clock=time.thread_time, only=None
) -> list[tuple[str, list[float]]]:
    """``only``: the fast-path names to measure (default: all, and the general-path block); the general-path block
    then covers only their cases."""
    names = list(FAST_PATHS) if only is None else list(only)
    out = []
    for name in names:
        without = frozenset(FAST_PATHS) - {name}
        for op, ps, bs in CASES[name]:
            rs = gain(op, ps, bs, without, repeats=repeats, quick=quick, clock=clock)
            out.append((f"{name}: {op} bs={bs} ps={ps} without/with", rs))
    for op, ps, bs in sorted({c for n in names for c in CASES[n]}):
        rs = gain(op, ps, bs, False, repeats=repeats, quick=quick, clock=clock)
        out.append((f"none: {op} bs={bs} ps={ps} general/fast", rs))
    return out


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_fast_paths", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="samples per case (median reported)")
    ap.add_argument("--quick", action="store_true", help="fewer calls per sample")
    ap.add_argument("--only", help="comma-separated fast-path names (default: all)")
    args = ap.parse_args(argv)
    only = None if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    if only is not None and (not only or set(only) - set(FAST_PATHS)):
        unknown = sorted(set(only) - set(FAST_PATHS))
        ap.error(f"--only: unknown fast-path names {unknown}; known: {', '.join(FAST_PATHS)}")
    torch.set_num_threads(1)
    started = time.perf_counter()
    found = rows(repeats=args.repeats, quick=args.quick, only=only)
    width = max(len(n) for n, _ in found)
    lines = [
        f"python -m benchmarks.bench_fast_paths --repeats {args.repeats}{' --quick' if args.quick else ''}"
        f"{' --only ' + ','.join(only) if only else ''}: "
        f"thread CPU time, median of {args.repeats}; {time.perf_counter() - started:.0f} s",
        f"{'case':{width}} {'median':>8} {'min':>8} {'max':>8}",
    ]
    for name, rs in found:
        lines.append(f"{name:{width}} {statistics.median(rs):8.3f} {min(rs):8.3f} {max(rs):8.3f}")
    out = "\n".join(lines)
    print(out)
    return out


if __name__ == "__main__":
    main()
