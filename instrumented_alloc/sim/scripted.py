"""A short scripted scenario through an instrumented SWA allocator: what ``instrumented-alloc demo`` runs until
the full demo engine exists.

It plays one engine's life in a few steps -- chunked prefill, decode with page crossings, sliding-window
eviction, a PD decode-side prealloc with an SWA tail, finishing requests -- and then makes the two mistakes the
product exists to catch: the seed's unaligned SWA evicted length, and a double free. Every line it reports is
computed from the wrapper's own state (ledger, snapshot, violations); nothing is printed that did not happen.
Pure: ``run`` returns the lines; the CLI prints them.
"""

from __future__ import annotations

import torch

from instrumented_alloc.allocators import SWATokenToKVPoolAllocator
from instrumented_alloc.prealloc import alloc_for_decode_prealloc, swa_tail_len
from instrumented_alloc.stats import figures
from instrumented_alloc.wrapper import InstrumentedAllocator

I64 = torch.int64


def _t(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=I64)


def run(*, page_size: int = 16, window: int = 64, mode: str = "record") -> list[str]:
    ps = page_size
    inner = SWATokenToKVPoolAllocator(64 * ps, 48 * ps, ps, torch.float16, "cpu")
    alloc = InstrumentedAllocator(inner, mode=mode, sliding_window=window)
    out: list[str] = []
    rows: dict[str, list[int]] = {}

    def state(label: str) -> None:
        f = figures(alloc.snapshot())
        pools = ", ".join(
            f"{n}: {p['pages_by_state']['used']} used / {p['pages_by_state']['free']} free"
            for n, p in f["pools"].items()
        )
        out.append(f"step {alloc.step_count:>2}  {label:<44} {pools}; live requests {f['requests_live']}")

    def extend(rids, lens) -> None:
        reqs = [rows.setdefault(r, []) for r in rids]
        prefix = [len(r) for r in reqs]
        seq = [p + n for p, n in zip(prefix, lens)]
        last = [r[-1] if r else -1 for r in reqs]
        with alloc.batch(rids):
            slots = alloc.alloc_extend(_t(prefix), _t(prefix), _t(seq), _t(seq), _t(last), sum(lens)).tolist()
        i = 0
        for r, n in zip(reqs, lens):
            r.extend(slots[i : i + n])
            i += n

    def decode(rids) -> None:
        reqs = [rows[r] for r in rids]
        seq = [len(r) + 1 for r in reqs]
        with alloc.batch(rids):
            slots = alloc.alloc_decode(_t(seq), _t(seq), _t(r[-1] for r in reqs)).tolist()
        for r, s in zip(reqs, slots):
            r.append(s)

    def evict(rid) -> None:
        kv = alloc.ledger[rid]
        seq = len(rows[rid])
        new = max(0, seq - window) // ps * ps
        if new > kv.swa_evicted_seqlen:
            alloc.free_swa_segment(_t(rows[rid][kv.swa_evicted_seqlen : new]), start_pos=kv.swa_evicted_seqlen)
            kv.swa_evicted_seqlen = new

    def finish(rid) -> None:
        kv = alloc.ledger[rid]
        row = rows.pop(rid)
        alloc.free_swa_segment(_t(row[kv.swa_evicted_seqlen :]), start_pos=kv.swa_evicted_seqlen)
        alloc.free_full(_t(row))
        alloc.release_request(rid)

    out.append(f"SWA hybrid allocator: page size {ps}, window {window}, mode {mode}")
    state("start")
    extend(["a", "b"], [3 * ps + 5, 2 * ps])  # prefill chunk 1
    alloc.step()
    state("prefill a (53 tokens) and b (32 tokens)")
    extend(["a"], [2 * ps])  # chunked prefill continues
    alloc.step()
    state("prefill a, second chunk (+32)")
    for _ in range(ps + 3):
        decode(["a", "b"])
        alloc.step()
    state(f"{ps + 3} decode steps for a and b")
    for rid in ("a", "b"):
        evict(rid)
    alloc.step()
    kv_a, kv_b = alloc.ledger["a"], alloc.ledger["b"]
    state(f"SWA eviction: a evicted {kv_a.swa_evicted_seqlen}, b evicted {kv_b.swa_evicted_seqlen}")
    fill = 5 * ps + 7
    tail = swa_tail_len(fill, window, ps)
    rows["c"] = alloc_for_decode_prealloc(alloc, rid="c", fill_len=fill, swa_tail_len=tail).tolist()
    alloc.step()
    state(f"PD prealloc c: {fill} tokens, SWA tail {tail}")
    finish("b")
    alloc.step()
    state("b finished")
    clean = list(alloc.violations)
    out.append(f"violations so far: {len(clean)}; check_consistency: {len(alloc.check_consistency())} findings")

    out.append("now the engine's bugs:")
    bad_tail = tail - 7  # a caller that bypasses swa_tail_len: the window start is not floored to a page
    try:
        rows["d"] = alloc_for_decode_prealloc(alloc, rid="d", fill_len=fill, swa_tail_len=bad_tail).tolist()
    except AssertionError as exc:
        out.append(f"  raised: {exc}")
    try:
        alloc.free(_t(rows["c"]))
        alloc.free(_t(rows["c"]))  # the same request's pages, freed twice
    except AssertionError as exc:
        out.append(f"  raised: {exc}")
    alloc.step()
    for v in alloc.violations:
        out.append(f"  {v.severity:<8} {v.invariant:<32} step {v.step} rid {v.rid}: {v.message}")
    state("after the faults")
    return out
